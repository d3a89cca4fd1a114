#include "dflash/target_head.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cstring>
#include <vector>

#include "dflash/error.h"
#include "gguf.h"
#include "gguf_keys.h"
#include "gguf_open.h"

namespace dflash {

struct MappedFile {
    void * addr = MAP_FAILED;
    size_t size = 0;
    ~MappedFile() {
        if (addr != MAP_FAILED) munmap(addr, size);
    }
};

TargetHead::~TargetHead() {
    // tensors reference the buffer, which references the mapping: free in that order
    buffer.reset();
    ctx.reset();
    mapping.reset();
}

std::unique_ptr<TargetHead> load_target_head(const std::string & path, ggml_backend_dev_t dev) {
    auto head = std::make_unique<TargetHead>();
    head->path = path;

    struct stat st{};
    if (stat(path.c_str(), &st) != 0) {
        throw Error(path + ": cannot open target GGUF (" + std::string(strerror(errno)) + ")");
    }
    {
        char magic[4] = {0};
        FILE * f = fopen(path.c_str(), "rb");
        const size_t n = f ? fread(magic, 1, 4, f) : 0;
        if (f) fclose(f);
        if (n != 4 || memcmp(magic, "GGUF", 4) != 0) {
            throw Error(path + ": target is not a GGUF file (expected magic 'GGUF')");
        }
    }

    ggml_context_ptr meta;
    gguf_ptr g = open_gguf(path, meta, "malformed or truncated target GGUF");
    const GgufKeys keys(g.get(), path);
    head->arch = keys.get_string("general.architecture");
    head->n_embd = (uint32_t)keys.get_int(head->arch + ".embedding_length", 1, 1 << 20);
    head->n_layer = (uint32_t)keys.get_int(head->arch + ".block_count", 1, 1 << 16);

    const int64_t id_embd = gguf_find_tensor(g.get(), "token_embd.weight");
    if (id_embd < 0) {
        throw Error(path +
                    ": target has no tensor 'token_embd.weight' (the drafter needs the target's token embedding)");
    }
    int64_t id_out = gguf_find_tensor(g.get(), "output.weight");
    if (id_out < 0) id_out = id_embd;  // tied embeddings

    const size_t data_offset = gguf_get_data_offset(g.get());
    std::vector<int64_t> ids = {id_embd};
    if (id_out != id_embd) ids.push_back(id_out);
    for (int64_t id : ids) {
        const char * name = gguf_get_tensor_name(g.get(), id);
        ggml_tensor * t = ggml_get_tensor(meta.get(), name);
        const size_t off = data_offset + gguf_get_tensor_offset(g.get(), id);
        if (ggml_n_dims(t) != 2 || t->ne[0] != head->n_embd) {
            throw Error(path + ": tensor '" + name + "': expected ggml ne {" + std::to_string(head->n_embd) +
                        ", n_vocab}, found " + std::to_string(ggml_n_dims(t)) +
                        "-D with ne0=" + std::to_string(t->ne[0]));
        }
        if (off > (size_t)st.st_size || ggml_nbytes(t) > (size_t)st.st_size - off) {
            throw Error(path + ": tensor '" + name + "': data lies beyond the end of the file (truncated?)");
        }
    }
    ggml_tensor * m_embd = ggml_get_tensor(meta.get(), gguf_get_tensor_name(g.get(), id_embd));
    ggml_tensor * m_out = ggml_get_tensor(meta.get(), gguf_get_tensor_name(g.get(), id_out));
    head->n_vocab = (uint32_t)m_embd->ne[1];
    if (m_out->ne[1] != m_embd->ne[1]) {
        throw Error(path + ": 'output.weight' has " + std::to_string(m_out->ne[1]) +
                    " rows but 'token_embd.weight' has " + std::to_string(m_embd->ne[1]));
    }

    head->output_offset = data_offset + gguf_get_tensor_offset(g.get(), id_out);

    // our own context holding just the two tensors
    ggml_init_params ip{/*mem_size =*/2 * ggml_tensor_overhead(), /*mem_buffer =*/nullptr, /*no_alloc =*/true};
    head->ctx.reset(ggml_init(ip));
    head->tok_embd = ggml_dup_tensor(head->ctx.get(), m_embd);
    ggml_set_name(head->tok_embd, "target.token_embd");
    head->output = head->tok_embd;
    if (id_out != id_embd) {
        head->output = ggml_dup_tensor(head->ctx.get(), m_out);
        ggml_set_name(head->output, "target.output");
    }

    ggml_backend_dev_props props{};
    ggml_backend_dev_get_props(dev, &props);
    const bool host_dev = ggml_backend_dev_type(dev) == GGML_BACKEND_DEVICE_TYPE_CPU;
    if (host_dev && props.caps.buffer_from_host_ptr) {
        int fd = open(path.c_str(), O_RDONLY);
        if (fd < 0) throw Error(path + ": cannot open for mapping");
        auto map = std::make_shared<MappedFile>();
        map->size = (size_t)st.st_size;
        map->addr = mmap(nullptr, map->size, PROT_READ, MAP_SHARED, fd, 0);
        close(fd);
        if (map->addr == MAP_FAILED) throw Error(path + ": mmap failed");
        head->buffer.reset(ggml_backend_dev_buffer_from_host_ptr(dev, map->addr, map->size, map->size));
        if (!head->buffer) throw Error(path + ": the device cannot wrap the mapped file");
        ggml_backend_buffer_set_usage(head->buffer.get(), GGML_BACKEND_BUFFER_USAGE_WEIGHTS);
        auto * base = (char *)ggml_backend_buffer_get_base(head->buffer.get());
        const size_t off_e = data_offset + gguf_get_tensor_offset(g.get(), id_embd);
        ggml_backend_tensor_alloc(head->buffer.get(), head->tok_embd, base + off_e);
        if (head->output != head->tok_embd) {
            const size_t off_o = data_offset + gguf_get_tensor_offset(g.get(), id_out);
            ggml_backend_tensor_alloc(head->buffer.get(), head->output, base + off_o);
        }
        head->mapping = map;
        head->zero_copy = true;
    } else {
        head->buffer.reset(
            ggml_backend_alloc_ctx_tensors_from_buft(head->ctx.get(), ggml_backend_dev_buffer_type(dev)));
        if (!head->buffer) throw Error(path + ": cannot allocate the target head on " + ggml_backend_dev_name(dev));
        FILE * f = fopen(path.c_str(), "rb");
        if (!f) throw Error(path + ": cannot reopen");
        std::vector<uint8_t> staging;
        std::vector<std::pair<ggml_tensor *, int64_t>> uploads = {{head->tok_embd, id_embd}};
        if (head->output != head->tok_embd) uploads.push_back({head->output, id_out});
        for (auto [t, id] : uploads) {
            staging.resize(ggml_nbytes(t));
            const size_t off = data_offset + gguf_get_tensor_offset(g.get(), id);
            if (fseek(f, (long)off, SEEK_SET) != 0 || fread(staging.data(), 1, staging.size(), f) != staging.size()) {
                fclose(f);
                throw Error(path + ": short read of '" + std::string(ggml_get_name(t)) + "'");
            }
            ggml_backend_tensor_set(t, staging.data(), 0, staging.size());
        }
        fclose(f);
    }
    return head;
}

}  // namespace dflash
