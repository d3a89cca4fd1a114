#include "dflash/target.h"

#include <sys/stat.h>

#include <algorithm>
#include <cstring>

#include "dflash/cpu_threads.h"
#include "dflash/error.h"
#include "dflash/llama_ext.h"
#include "ggml-cpu.h"
#include "gguf_open.h"

namespace dflash {

namespace {

// Whether libllama would put weights of this model into its AMX buffers: weights of a type ggml's AMX
// kernels take, on a CPU with AMX (ggml-cpu/amx/common.h, qtype_has_amx_kernels).
bool amx_would_take(const std::string & path) {
    if (!ggml_cpu_has_amx_int8()) return false;
    ggml_context_ptr meta;
    gguf_ptr g = open_gguf(path, meta, "cannot read the target's tensor types");
    for (int64_t i = 0; i < gguf_get_n_tensors(g.get()); ++i) {
        switch (gguf_get_tensor_type(g.get(), i)) {
            case GGML_TYPE_Q4_0: case GGML_TYPE_Q4_1: case GGML_TYPE_Q8_0: case GGML_TYPE_Q4_K:
            case GGML_TYPE_Q5_K: case GGML_TYPE_Q6_K: case GGML_TYPE_IQ4_XS:
                return true;
            default:
                break;
        }
    }
    return false;
}

}  // namespace

Target::Target(const std::string & path, const TargetOptions & opts) {
    struct stat st{};
    if (stat(path.c_str(), &st) != 0) {
        throw Error(path + ": target model file not found");
    }
    llama_backend_init();
    llama_model_params mp = llama_model_default_params();
    mp.n_gpu_layers = opts.n_gpu_layers;
    mp.use_extra_bufts = opts.repack < 0 ? !amx_would_take(path) : opts.repack != 0;
    model_ = llama_model_load_from_file(path.c_str(), mp);
    if (!model_) {
        throw Error(path + ": libllama could not load the target model (see its log above)");
    }
    llama_context_params cp = llama_context_default_params();
    cp.n_ctx = opts.n_ctx;
    cp.n_batch = opts.n_batch;
    cp.n_ubatch = opts.n_batch;
    const int n_threads = opts.n_threads > 0 ? opts.n_threads : default_cpu_threads();
    cp.n_threads = n_threads;
    cp.n_threads_batch = n_threads;
    cp.no_perf = true;
    // flash attention on the CPU makes multi-token verification of small models 2-2.5x slower
    // (measured on the bundled pair); on a GPU let libllama decide
    cp.flash_attn_type = opts.n_gpu_layers == 0 ? LLAMA_FLASH_ATTN_TYPE_DISABLED : LLAMA_FLASH_ATTN_TYPE_AUTO;
    ctx_ = llama_init_from_model(model_, cp);
    if (!ctx_) {
        llama_model_free(model_);
        throw Error(path + ": libllama could not create a context (n_ctx " + std::to_string(opts.n_ctx) + ")");
    }
    owns_ = true;
    init_common();
}

Target::Target(llama_model * model, llama_context * ctx) : model_(model), ctx_(ctx), owns_(false) {
    if (!model_ || !ctx_) throw Error("adopting a target needs a loaded llama model and context");
    init_common();
}

void Target::init_common() {
    vocab_ = llama_model_get_vocab(model_);
    n_vocab_ = (uint32_t) llama_vocab_n_tokens(vocab_);
    n_embd_ = (uint32_t) llama_model_n_embd(model_);
    n_layer_ = (uint32_t) llama_model_n_layer(model_);
    n_batch_ = std::min(llama_n_batch(ctx_), llama_n_ubatch(ctx_));
    batch_cap_ = n_batch_;
    batch_ = llama_batch_init((int32_t) batch_cap_, 0, 1);
}

Target::~Target() {
    llama_batch_free(batch_);
    if (owns_) {
        for (int32_t lid : layers_) llama_set_embeddings_layer_inp(ctx_, (uint32_t) lid, false);
        llama_free(ctx_);
        llama_model_free(model_);
    } else {
        // hand the adopted context back as we found it
        for (int32_t lid : layers_) llama_set_embeddings_layer_inp(ctx_, (uint32_t) lid, false);
    }
}

uint32_t Target::n_ctx() const { return llama_n_ctx(ctx_); }

void Target::set_feature_layers(const std::vector<int32_t> & layers) {
    for (int32_t lid : layers) {
        if (lid < 0 || (uint32_t) lid > n_layer_) {
            throw Error("target layer " + std::to_string(lid) + " is outside the target's " + std::to_string(n_layer_) +
                        " layers (layer inputs 0.." + std::to_string(n_layer_) + ")");
        }
    }
    for (int32_t lid : layers_) llama_set_embeddings_layer_inp(ctx_, (uint32_t) lid, false);
    layers_ = layers;
    for (int32_t lid : layers_) llama_set_embeddings_layer_inp(ctx_, (uint32_t) lid, true);
}

void Target::decode(const int32_t * tokens, uint32_t n, int32_t p0, bool all_logits) {
    if (n == 0) return;
    if ((uint64_t) p0 + n > n_ctx()) {
        throw Error("target context full: positions up to " + std::to_string(p0 + n) + " exceed n_ctx = " +
                    std::to_string(n_ctx()));
    }
    repeated_shape_ = n <= n_batch_ && n == last_chunk_rows_ && all_logits == last_all_logits_;
    const size_t width = layers_.size() * n_embd_;
    features_.resize((size_t) n * width);
    for (uint32_t done = 0; done < n;) {
        const uint32_t chunk = std::min(n_batch_, n - done);
        batch_.n_tokens = (int32_t) chunk;
        for (uint32_t i = 0; i < chunk; ++i) {
            batch_.token[i] = tokens[done + i];
            batch_.pos[i] = p0 + (int32_t) (done + i);
            batch_.n_seq_id[i] = 1;
            batch_.seq_id[i][0] = 0;
            batch_.logits[i] = all_logits || (done + i == n - 1);
        }
        const int32_t rc = llama_decode(ctx_, batch_);
        if (rc != 0) {
            throw Error("target decode failed (llama_decode returned " + std::to_string(rc) + ") at positions " +
                        std::to_string(p0 + done) + ".." + std::to_string(p0 + done + chunk - 1));
        }
        for (size_t k = 0; k < layers_.size(); ++k) {
            const float * src = llama_get_embeddings_layer_inp(ctx_, (uint32_t) layers_[k]);
            for (uint32_t i = 0; i < chunk; ++i) {
                std::memcpy(&features_[(size_t) (done + i) * width + k * n_embd_], src + (size_t) i * n_embd_,
                            n_embd_ * sizeof(float));
            }
        }
        done += chunk;
        last_chunk_rows_ = chunk;
    }
    last_all_logits_ = all_logits;
}

const float * Target::logits(uint32_t row) const {
    // rows index the last chunk's batch; with all_logits off only its last row has logits
    const int32_t i = last_all_logits_ ? (int32_t) row : -1;
    const float * p = llama_get_logits_ith(ctx_, i);
    if (!p) throw Error("target logits unavailable for row " + std::to_string(row));
    return p;
}

void Target::truncate(int32_t p) {
    if (!llama_memory_seq_rm(llama_get_memory(ctx_), 0, p, -1)) {
        throw Error("target KV cache rollback to position " + std::to_string(p) + " failed");
    }
}

void Target::clear() { llama_memory_clear(llama_get_memory(ctx_), true); }

uint32_t Target::seq_len() const { return (uint32_t) (llama_memory_seq_pos_max(llama_get_memory(ctx_), 0) + 1); }

std::vector<uint8_t> Target::save_seq() const {
    std::vector<uint8_t> bytes(llama_state_seq_get_size(ctx_, 0));
    bytes.resize(llama_state_seq_get_data(ctx_, bytes.data(), bytes.size(), 0));
    return bytes;
}

void Target::load_seq(const std::vector<uint8_t> & bytes) {
    clear();
    if (llama_state_seq_set_data(ctx_, bytes.data(), bytes.size(), 0) != bytes.size()) {
        clear();
        throw Error("the saved target state (" + std::to_string(bytes.size()) + " bytes) does not load into this "
                    "context: saved from another model, or it holds more tokens than n_ctx = " + std::to_string(n_ctx()));
    }
}

}  // namespace dflash
