#pragma once
// The target model in libllama, seen by the speculator: batched decode with
// per-row logits and the layer-input features the drafter needs, plus
// rollback of the KV cache. Either owns its model/context or adopts those of
// an existing llama_cpp.Llama.
#include <cstdint>
#include <string>
#include <vector>

#include "llama.h"

namespace dflash {

struct TargetOptions {
    uint32_t n_ctx = 4096;
    uint32_t n_batch = 512;
    int n_gpu_layers = 0;
    int n_threads = 0;  // 0 = default_cpu_threads() (physical cores we may use)
    // libllama's extra CPU weight buffers (repacked layouts, AMX; llama-server's --no-repack turns them off):
    // 1 on, 0 off, -1 auto = off only where AMX would take the weights (an AMX CPU, weights of a type its
    // kernels take), as libllama 0.3.36 can segfault in ggml_backend_amx_mul_mat on the first decode
    // (ggml-org/llama.cpp#20824; seen here with a Q8_0 target). Elsewhere they pay: the F16 tinycode
    // target verifies 4 tokens in 1.05-1.1 ms with them, 1.3-1.35 ms without, on this AMX Xeon.
    int repack = -1;
};

class Target {
  public:
    Target(const std::string & path, const TargetOptions & opts);
    Target(llama_model * model, llama_context * ctx);  // adopt (not freed here)
    ~Target();
    Target(const Target &) = delete;
    Target & operator=(const Target &) = delete;

    // Enables extraction of the inputs of these target layers (dflash.target_layers).
    void set_feature_layers(const std::vector<int32_t> & layers);

    // Decodes tokens at positions p0..p0+n-1; logits for every row if all_logits,
    // else for the last only; features for every row when feature layers are set.
    // Splits into n_batch chunks. Throws on failure.
    void decode(const int32_t * tokens, uint32_t n, int32_t p0, bool all_logits);
    const float * logits(uint32_t row) const;  // row of the last decode (last chunk for prefill)
    // [n_rows][n_layers * n_embd] features of all rows of the last decode() call
    const std::vector<float> & features() const { return features_; }
    // whether the last decode had the batch shape of the one before (rows, logits of all rows or the
    // last): libllama then reuses its graph, else it rebuilds it
    bool repeated_shape() const { return repeated_shape_; }
    // Drops every cached position >= p.
    void truncate(int32_t p);
    void clear();
    // The sequence's K/V as libllama serialises it (llama_state_seq_get_data), and back into a cleared
    // context; load_seq throws when libllama refuses the bytes (another model, a smaller context).
    std::vector<uint8_t> save_seq() const;
    void load_seq(const std::vector<uint8_t> & bytes);
    uint32_t seq_len() const;  // positions the sequence holds (0..n-1)

    llama_model * model() const { return model_; }
    llama_context * ctx() const { return ctx_; }
    const llama_vocab * vocab() const { return vocab_; }
    uint32_t n_vocab() const { return n_vocab_; }
    uint32_t n_embd() const { return n_embd_; }
    uint32_t n_layer() const { return n_layer_; }
    uint32_t n_ctx() const;
    uint32_t n_batch() const { return n_batch_; }  // rows per llama_decode call
    bool is_eog(int32_t tok) const { return llama_vocab_is_eog(vocab_, tok); }

  private:
    void init_common();

    llama_model * model_ = nullptr;
    llama_context * ctx_ = nullptr;
    bool owns_ = false;
    const llama_vocab * vocab_ = nullptr;
    uint32_t n_vocab_ = 0, n_embd_ = 0, n_layer_ = 0, n_batch_ = 0;
    std::vector<int32_t> layers_;
    std::vector<float> features_;
    llama_batch batch_{};
    uint32_t batch_cap_ = 0;
    uint32_t last_chunk_rows_ = 0;
    bool last_all_logits_ = false;
    bool repeated_shape_ = false;
};

}  // namespace dflash
