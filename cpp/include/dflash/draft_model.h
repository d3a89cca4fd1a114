#pragma once
// A DFlash / DFlash2 drafter GGUF (arch "dflash"): hyper-parameters, per-layer
// weights and the validated loader. Field comments name the Hugging Face
// tensor each weight came from (see shared/GGUF-DFLASH.md section 2).
#include <cstdint>
#include <map>
#include <string>
#include <vector>

#include "ggml-backend.h"
#include "ggml-cpp.h"
#include "ggml.h"

namespace dflash {

constexpr uint32_t kMaxBlockSize = 32;  // dflash.block_size range: 2..kMaxBlockSize

struct DraftHparams {
    int version = 1;                  // 1 = DFlash, 2 = DFlash2 (conv + selector)
    uint32_t n_ctx_train = 0;         // dflash.context_length
    uint32_t n_embd = 0;              // dflash.embedding_length (drafter hidden)
    uint32_t n_layer = 0;             // dflash.block_count
    uint32_t n_ff = 0;                // dflash.feed_forward_length
    uint32_t n_head = 0;              // dflash.attention.head_count
    uint32_t n_head_kv = 0;           // dflash.attention.head_count_kv
    uint32_t head_dim = 0;            // dflash.attention.key_length (== value_length)
    uint32_t n_rot = 0;               // dflash.rope.dimension_count (default head_dim)
    float rms_eps = 1e-6f;            // dflash.attention.layer_norm_rms_epsilon
    float rope_freq_base = 10000.0f;  // dflash.rope.freq_base
    float rope_freq_scale = 1.0f;     // dflash.rope.scaling.factor (linear), 1 = none
    // dflash.rope.dimension_sections: a drafter for an M-RoPE target (Qwen3.5) ropes on the temporal section
    // alone, [n, 0, 0, 0]: the same rotation as NeoX RoPE at the token's position; empty when absent
    std::vector<int32_t> rope_sections;
    uint32_t block_size = 0;             // dflash.block_size
    std::vector<int32_t> target_layers;  // dflash.target_layers (= HF target_layer_ids + 1)
    int32_t mask_token_id = -1;          // tokenizer.ggml.mask_token_id
    uint32_t n_vocab = 0;                // from the selector codebooks / tokenizer / target head
    uint32_t target_hidden = 0;          // fc input width / n_target_layers

    // optional scales (0 = unset)
    float logit_scale = 0.0f;         // dflash.logit_scale (HF output_multiplier)
    float logit_softcap = 0.0f;       // dflash.final_logit_softcapping
    float embedding_scale = 0.0f;     // dflash.embedding_scale
    float attn_value_scale = 0.0f;    // dflash.attention.value_scale
    float attn_scale = 0.0f;          // dflash.attention.scale (default 1/sqrt(head_dim))
    bool causal = false;              // dflash.attention.causal: every layer's block attends only to earlier rows
    std::vector<bool> causal_layers;  // dflash.attention.causal_layers: which layers do, when only some do
    // the MLP's gate activation, dflash.hidden_activation (HF hidden_act): "silu" (the default),
    // "gelu_pytorch_tanh" (tanh approximation) or "gelu" (HF: exact, erf)
    enum class Activation { silu, gelu_tanh, gelu_erf } hidden_act = Activation::silu;
    // sliding-window attention (0 = none): in a layer swa_layers marks, a block row at position q sees only
    // the rows at positions > q - swa_window (HF's sliding_window mask, llama.cpp's LLAMA_SWA_TYPE_STANDARD)
    uint32_t swa_window = 0;       // dflash.attention.sliding_window
    std::vector<bool> swa_layers;  // dflash.attention.sliding_window_pattern, one flag per layer

    // DFlash2
    uint32_t conv_kernel = 0;     // dflash.conv_kernel_size
    uint32_t conv_group = 0;      // dflash.conv_group_size
    uint32_t selector_rank = 0;   // dflash.selector_rank
    uint32_t selector_top_k = 0;  // dflash.selector_top_k

    bool is_swa(uint32_t il) const { return swa_window != 0 && swa_layers[il]; }
    bool is_causal(uint32_t il) const { return causal || (!causal_layers.empty() && causal_layers[il]); }
    uint32_t n_conv_groups() const { return conv_group ? n_embd / conv_group : 0; }
    uint32_t n_embd_q() const { return n_head * head_dim; }
    uint32_t n_embd_kv() const { return n_head_kv * head_dim; }
    uint32_t n_target_features() const { return (uint32_t)target_layers.size() * target_hidden; }
};

struct DraftLayer {
    ggml_tensor * attn_norm = nullptr;  // layers.i.input_layernorm.weight
    ggml_tensor * wq = nullptr;         // layers.i.self_attn.q_proj.weight
    ggml_tensor * wk = nullptr;         // layers.i.self_attn.k_proj.weight
    ggml_tensor * wv = nullptr;         // layers.i.self_attn.v_proj.weight
    ggml_tensor * wo = nullptr;         // layers.i.self_attn.o_proj.weight
    ggml_tensor * q_norm = nullptr;     // layers.i.self_attn.q_norm.weight
    ggml_tensor * k_norm = nullptr;     // layers.i.self_attn.k_norm.weight
    ggml_tensor * ffn_norm = nullptr;   // layers.i.post_attention_layernorm.weight
    ggml_tensor * ffn_gate = nullptr;   // layers.i.mlp.gate_proj.weight
    ggml_tensor * ffn_up = nullptr;     // layers.i.mlp.up_proj.weight
    ggml_tensor * ffn_down = nullptr;   // layers.i.mlp.down_proj.weight
    // DFlash2 dynamic conv
    ggml_tensor * attn_conv_base = nullptr;  // layers.i.attention_conv.base_kernel        ne {n_embd, K, 2}
    ggml_tensor * attn_conv_proj = nullptr;  // layers.i.attention_conv.kernel_projection  ne {n_embd, 2*K*G}
    ggml_tensor * ffn_conv_base = nullptr;   // layers.i.mlp_conv.base_kernel
    ggml_tensor * ffn_conv_proj = nullptr;   // layers.i.mlp_conv.kernel_projection
};

// One tensor as described in the file (for `dflash info` and error messages).
struct TensorInfo {
    std::string name;
    ggml_type type;
    std::vector<int64_t> ne;  // the dims ggml reports (trailing 1s dropped)
    int64_t ne4[GGML_MAX_DIMS] = {1, 1, 1, 1};
    size_t offset;  // absolute file offset of the data
    size_t nbytes;
};

// What the file says, fully validated, without any tensor data loaded.
struct DraftFileInfo {
    std::string path;
    size_t file_size = 0;
    uint32_t gguf_version = 0;
    DraftHparams hparams;
    std::vector<TensorInfo> tensors;
    bool has_token_embd = false;  // drafter carries the target's embedding / LM head
    bool has_output = false;
    bool mask_embedding = false;  // dflash.mask_embedding: token_embd is the target's with a trained mask row
    std::map<std::string, std::string> meta;  // general.name etc, for display
};

// Validates the file completely (keys, types, ranges, every tensor's name,
// type, shape and data range). Throws dflash::Error naming what is wrong.
DraftFileInfo inspect_draft_file(const std::string & path);

// A loaded drafter: validated hparams and weights in one backend buffer.
struct DraftModel {
    DraftFileInfo info;
    DraftHparams & hp() { return info.hparams; }
    const DraftHparams & hp() const { return info.hparams; }

    ggml_context_ptr ctx;                                // tensor metadata
    ggml_backend_buffer_ptr buffer;                      // weights on the chosen device
    std::vector<ggml_backend_buffer_ptr> extra_buffers;  // matmul weights in the CPU's repacked layouts
    size_t repacked_weights = 0;

    ggml_tensor * fc = nullptr;           // fc.weight            ne {n_tl*target_hidden, n_embd}
    ggml_tensor * hidden_norm = nullptr;  // hidden_norm.weight   (enc.output_norm)
    ggml_tensor * output_norm = nullptr;  // norm.weight
    ggml_tensor * sel_prev = nullptr;     // candidate_selector.predecessor_codebook  ne {R, vocab}
    ggml_tensor * sel_next = nullptr;     // candidate_selector.successor_codebook    ne {R, vocab}
    ggml_tensor * sel_hidden = nullptr;   // candidate_selector.hidden_projection     ne {n_embd, R}
    ggml_tensor * tok_embd = nullptr;     // embed_tokens.weight (optional)
    ggml_tensor * output = nullptr;       // lm_head.weight (optional)
    std::vector<DraftLayer> layers;
};

// Loads a validated drafter into a buffer of `buft`; weights only ever multiplied go to the first of
// `matmul_bufts` that runs a matmul with them (ggml's repacked CPU layouts).
DraftModel load_draft_model(const std::string & path, ggml_backend_buffer_type_t buft,
                            const std::vector<ggml_backend_buffer_type_t> & matmul_bufts = {});

}  // namespace dflash
