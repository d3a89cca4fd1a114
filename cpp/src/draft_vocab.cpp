#include "dflash/draft_vocab.h"

#include <fcntl.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>

#include "cpu_repack.h"
#include "dflash/draft_model.h"
#include "dflash/error.h"
#include "ggml-alloc.h"
#include "gguf_open.h"

namespace dflash {

namespace {

// The subset's rows of a tensor, read from its file: the loaded copy may sit in a repacked layout
// that cannot be read back, and on a GPU reading the file costs no device transfer.
std::vector<uint8_t> read_rows(const RowSource & src, const std::vector<int32_t> & ids) {
    const size_t row = src.tensor->nb[1];
    std::vector<uint8_t> out(row * ids.size());
    const int fd = open(src.path.c_str(), O_RDONLY);
    if (fd < 0) throw Error(src.path + ": cannot reopen for the drafting vocabulary (" + strerror(errno) + ")");
    for (size_t i = 0; i < ids.size(); ++i) {
        const off_t at = (off_t)(src.offset + (size_t)ids[i] * row);
        if (pread(fd, out.data() + i * row, row, at) != (ssize_t)row) {
            close(fd);
            throw Error(src.path + ": tensor '" + ggml_get_name(src.tensor) + "': short read of row " +
                        std::to_string(ids[i]) + " (file truncated?)");
        }
    }
    close(fd);
    return out;
}

ggml_tensor * rows_like(ggml_context * ctx, const RowSource & src, size_t n, const char * name) {
    ggml_tensor * t = ggml_new_tensor_2d(ctx, src.tensor->type, src.tensor->ne[0], (int64_t)n);
    ggml_set_name(t, name);
    return t;
}

}  // namespace

std::shared_ptr<const DraftVocab> make_draft_vocab(const std::vector<int32_t> & ids, uint32_t n_vocab,
                                                   uint32_t min_size, const RowSource & head,
                                                   const RowSource * sel_prev, const RowSource * sel_next,
                                                   ggml_backend_buffer_type_t buft,
                                                   const std::vector<ggml_backend_buffer_type_t> & matmul_bufts) {
    if (ids.size() < min_size || ids.size() > n_vocab) {
        throw Error("draft_vocab has " + std::to_string(ids.size()) + " tokens; expected " + std::to_string(min_size) +
                    " (the selector's top k) to " + std::to_string(n_vocab) + " (the vocabulary)");
    }
    std::vector<bool> seen(n_vocab, false);
    for (int32_t id : ids) {
        if (id < 0 || (uint32_t)id >= n_vocab) {
            throw Error("draft_vocab: token id " + std::to_string(id) + " is outside the vocabulary (0.." +
                        std::to_string(n_vocab - 1) + ")");
        }
        if (seen[id]) throw Error("draft_vocab: token id " + std::to_string(id) + " is listed twice");
        seen[id] = true;
    }

    auto v = std::make_shared<DraftVocab>();
    v->ids = ids;
    ggml_init_params ip{3 * ggml_tensor_overhead(), nullptr, true};
    v->ctx.reset(ggml_init(ip));
    v->output = rows_like(v->ctx.get(), head, ids.size(), "draft_vocab.output");
    if (sel_prev) v->sel_prev = rows_like(v->ctx.get(), *sel_prev, ids.size(), "draft_vocab.sel_prev");
    if (sel_next) v->sel_next = rows_like(v->ctx.get(), *sel_next, ids.size(), "draft_vocab.sel_next");

    for (ggml_backend_buffer_type_t mb : matmul_bufts) {
        if (!mul_mat_runs_from(mb, v->output)) continue;
        ggml_backend_buffer_ptr buf(
            ggml_backend_buft_alloc_buffer(mb, ggml_backend_buft_get_alloc_size(mb, v->output)));
        if (!buf)
            throw Error(std::string("cannot allocate the drafting vocabulary's head on ") + ggml_backend_buft_name(mb));
        ggml_backend_buffer_set_usage(buf.get(), GGML_BACKEND_BUFFER_USAGE_WEIGHTS);
        ggml_tallocr alloc = ggml_tallocr_new(buf.get());
        ggml_tallocr_alloc(&alloc, v->output);
        v->buffers.push_back(std::move(buf));
        break;
    }
    ggml_backend_buffer_ptr rest(ggml_backend_alloc_ctx_tensors_from_buft(v->ctx.get(), buft));
    if (!rest && (!v->output->buffer || v->sel_prev)) {
        throw Error(std::string("cannot allocate the drafting vocabulary on ") + ggml_backend_buft_name(buft));
    }
    if (rest) {
        ggml_backend_buffer_set_usage(rest.get(), GGML_BACKEND_BUFFER_USAGE_WEIGHTS);
        v->buffers.push_back(std::move(rest));
    }

    const QuietDebugLog quiet;  // a line per repacked weight otherwise
    const std::pair<ggml_tensor *, const RowSource *> fills[] = {
        {v->output, &head}, {v->sel_prev, sel_prev}, {v->sel_next, sel_next}};
    for (auto [t, src] : fills) {
        if (!t) continue;
        const std::vector<uint8_t> bytes = read_rows(*src, ids);
        ggml_backend_tensor_set(t, bytes.data(), 0, bytes.size());
    }
    return v;
}

}  // namespace dflash
