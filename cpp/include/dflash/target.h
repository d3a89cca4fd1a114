#pragma once
// The target model in libllama, seen by the speculator: batched decode with
// per-row logits and the layer-input features the drafter needs, plus
// rollback by the target's memory kind. Either owns its context, on a model it
// loaded or shares with other targets (share()), or adopts the model and
// context of an existing llama_cpp.Llama.
#include <cstdint>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "llama.h"

namespace dflash {

enum class Repack { Auto, Off, On, WithoutAmx };

struct TargetOptions {
    uint32_t n_ctx = 4096;
    uint32_t n_batch = 512;
    int n_gpu_layers = 0;
    int n_threads = 0;  // 0 = default_cpu_threads() (physical cores we may use)
    // libllama's extra CPU weight buffers (ggml's repacked layouts, AMX). Auto: all of them, except where AMX
    // would take the weights (an AMX CPU, weights of a type its kernels take): libllama 0.3.36 crashes in
    // ggml_backend_amx_mul_mat on the first decode there (ggml-org/llama.cpp#20824; SIGSEGV with a Q8_0
    // target, SIGILL at tilezero with a Q4_K_M one, on two AMX Xeons). Then each weight goes to the repacked
    // layout that takes it by name (WithoutAmx: layers on the CPU only), or with layers offloaded to a GPU
    // stays in the plain one (Off, llama-server's --no-repack). The repacked layouts pay: the F16 tinycode
    // target verifies 4 tokens in 1.05-1.1 ms with them, 1.3-1.35 ms without, on an AMX Xeon.
    Repack repack = Repack::Auto;
    // recurrent-state snapshots per sequence (llama_context_params.n_rs_seq) for archs whose recurrent
    // layers libllama can roll back itself; other archs ignore it
    uint32_t n_rs_seq = 0;
    // weights whose names match a regex (std::regex, searched) go to the named ggml buffer type, first match
    // first (llama-server's --override-tensor; a MoE's experts on the CPU with the rest offloaded: --cpu-moe)
    std::vector<std::pair<std::string, std::string>> tensor_overrides;
    // sliding-window layers keep every position (llama.cpp's --swa-full). Off, as in llama-server, they keep
    // a window plus a batch of positions (gpt-oss-20b's 12 sliding layers at a 32k context: 18 MiB of F16
    // K/V instead of 768 MiB); a rollback past what they still hold restores a prompt's checkpoint and
    // re-decodes the tokens after it
    bool swa_full = false;
    // LoRA adapters (GGUF file, scale) on the target's weights, as llama-server's --lora / --lora-scaled:
    // loaded once with the model, applied to each context at these scales (set_lora_scales changes them)
    std::vector<std::pair<std::string, float>> loras;
    // the K/V cache's types (llama-server's --cache-type-k / --cache-type-v; q8_0: 8.5 bits a value against
    // f16's 16); a quantized V cache needs flash attention, which the context then gets
    ggml_type type_k = GGML_TYPE_F16, type_v = GGML_TYPE_F16;
};
// The K/V cache types llama-server takes (its --cache-type-k / -v names), by name; throws for another.
ggml_type kv_cache_type(const std::string & name);

// How the target's memory goes back to an earlier position.
enum class TargetMemory {
    Attention,            // K/V cells per position: llama_memory_seq_rm anywhere
    RecurrentSnapshots,   // recurrent state with libllama's per-token snapshots (n_rs_seq): seq_rm of up to
                          // n_rs_seq tokens of the most recent decode call, at least one of them kept
    RecurrentCheckpoint,  // recurrent state without them: a saved state restored and the kept tokens re-decoded
    SlidingWindow,        // attention with sliding-window layers: seq_rm while those still hold the window before
                          // the new end (always within a verify), else as RecurrentCheckpoint
};
const char * memory_name(TargetMemory m);

// The archs whose graphs in libllama 0.3.36 fill the layer inputs that llama_get_embeddings_layer_inp
// returns (t_layer_inp); for any other arch libllama aborts the process on the first decode with them on.
bool arch_exposes_layer_inputs(const std::string & arch);
const std::vector<std::string> & archs_exposing_layer_inputs();
// The arch string of a GGUF file (general.architecture), read from its header alone.
std::string gguf_architecture(const std::string & path);
// Where the target's weights go on the CPU (opts.repack resolved for this file): whether libllama's extra
// buffers are on, and the tensor overrides that put weights into ggml's repacked layouts without AMX. The
// bench's own verify timing loads the target the same way.
struct WeightPlacement {
    bool use_extra_bufts = true;
    std::vector<std::pair<std::string, ggml_backend_buffer_type_t>> overrides;
};
WeightPlacement target_weight_placement(const std::string & path, const TargetOptions & opts);
// The flash-attention setting the target's context gets (llama_context_params.flash_attn_type). The bench
// gives it to its own verify timing and to llama-server, so that all systems run the same kernels.
llama_flash_attn_type target_flash_attn(int n_gpu_layers);

class Target {
public:
    Target(const std::string & path, const TargetOptions & opts);
    Target(llama_model * model, llama_context * ctx);  // adopt (not freed here)
    // Another target on this one's loaded model (its weights held once, freed with the last target sharing
    // them) with a context of its own, made with the same options but n_rs_seq; throws for an adopted target.
    std::unique_ptr<Target> share(uint32_t n_rs_seq) const;
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
    // Drops every cached position >= p, by the memory's kind: seq_rm, libllama's snapshots, or the newest
    // checkpoint at or before p with the tokens after it re-decoded (without touching features() or the
    // shape record). Throws when the tokens to re-decode are not known (decoded by someone else).
    void truncate(int32_t p);
    // Where a truncate(p) would start re-decoding the kept tokens (p: it need not).
    int32_t replay_from(int32_t p) const;
    void clear();
    // Before a decode whose last n_tokens may be dropped again: for a recurrent target that cannot roll
    // them back itself, keep a checkpoint of the sequence as it is (replacing the previous such one).
    void prepare_rollback(uint32_t n_tokens);
    // A checkpoint of the sequence as it is that later truncate() calls may restore (a prompt's end, a
    // calibration context); none is needed (nor kept) for attention-only memory.
    void checkpoint();
    // Someone else may have decoded in the context (an adopted llama_cpp.Llama): libllama's snapshots are
    // not ours until our next decode, and the tokens after `keep` are no longer known.
    void forget_after(uint32_t keep);
    // The sequence's K/V (and recurrent state) as libllama serialises it (llama_state_seq_get_data), and
    // back into a cleared context as the state of `tokens`; load_seq throws when libllama refuses the bytes
    // (another model, a smaller context).
    std::vector<uint8_t> save_seq() const;
    void load_seq(const std::vector<uint8_t> & bytes, const std::vector<int32_t> & tokens);
    uint32_t seq_len() const;  // positions the sequence holds (0..n-1)
    TargetMemory memory() const { return memory_; }
    // whether checkpoint() keeps anything: a recurrent state, or sliding-window layers that keep only their
    // window (our own context without swa_full; an adopted one's pruning is unknown, so a rollback past its
    // window re-decodes from the start)
    bool keeps_checkpoints() const { return keeps_checkpoints_; }
    bool recurrent() const {
        return memory_ == TargetMemory::RecurrentSnapshots || memory_ == TargetMemory::RecurrentCheckpoint;
    }
    uint32_t n_rs_seq() const;
    const std::string & arch() const { return arch_; }
    // what rollback has done so far (tests and statistics)
    struct RollbackCounters {
        uint64_t seq_rm = 0, snapshot = 0, restored = 0, replayed_tokens = 0, checkpoints = 0;
        uint64_t checkpoint_bytes = 0;  // of the last checkpoint taken
    };
    const RollbackCounters & rollback_counters() const { return rollback_; }

    llama_model * model() const { return model_; }
    llama_context * ctx() const { return ctx_; }
    const llama_vocab * vocab() const { return vocab_; }
    uint32_t n_vocab() const { return n_vocab_; }
    uint32_t n_embd() const { return n_embd_; }
    uint32_t n_layer() const { return n_layer_; }
    uint32_t n_ctx() const;
    uint32_t n_batch() const { return n_batch_; }            // rows per llama_decode call
    uint64_t decode_calls() const { return decode_calls_; }  // llama_decode calls made through this object
    // the LoRA adapters' files and their scales in this context (TargetOptions::loras, as set since)
    const std::vector<std::pair<std::string, float>> & loras() const { return opts_.loras; }
    // The adapters' scales in this context (one per adapter; 0 leaves one out). What the context holds was
    // computed with the old ones: the caller drops it when they change.
    void set_lora_scales(const std::vector<float> & scales);
    bool is_eog(int32_t tok) const { return llama_vocab_is_eog(vocab_, tok); }

private:
    Target() = default;                                                       // share()'s
    void open_context(const std::string & path, const TargetOptions & opts);  // a context of our own on model_
    void init_common();
    // decodes a chunk of at most n_batch tokens (logits for every row, or for last_row alone); throws when
    // libllama refuses it
    void decode_chunk(const int32_t * tokens, uint32_t n, int32_t p0, bool all_logits, uint32_t last_row);
    void replay(int32_t from, int32_t to);  // re-decodes known tokens [from, to) after a restore
    void roll_back(int32_t p);              // truncate()'s, for p < seq_len()
    void drop_checkpoints_after(int32_t p);
    // whether sliding-window layers whose oldest position is pos_min hold every position a token at p
    // attends to (seq_rm to p then leaves the sequence decodable)
    bool holds_window(int32_t pos_min, int32_t p) const;
    bool rolls_back_in_place(int32_t p) const;  // by seq_rm alone (attention, a sliding window it holds)
    // whether libllama's snapshots hold the state at p: within our latest decode call, once per call
    bool snapshot_holds(int32_t p, int32_t end) const;

    struct Checkpoint {
        int32_t pos = 0;      // the state holds positions 0..pos-1
        int32_t pos_min = 0;  // the oldest position its sliding-window layers hold
        bool step = false;    // prepare_rollback's (replaced each time) rather than checkpoint()'s
        std::vector<uint8_t> bytes;
    };
    void save_checkpoint(Checkpoint c);  // of the sequence as it is now, into c.bytes (reusing its capacity)
    const Checkpoint * checkpoint_for(int32_t p) const;  // the one a rollback to p restores; null: none

    void apply_loras();  // opts_.loras' scales onto ctx_

    llama_model * model_ = nullptr;
    std::shared_ptr<llama_model> shared_model_;   // model_ when loaded here (null when adopted)
    std::vector<llama_adapter_lora *> adapters_;  // opts_.loras' adapters, freed with the model
    llama_context * ctx_ = nullptr;
    bool owns_ = false;  // of ctx_
    std::string path_;   // the file and the options ctx_ was made with, for share()
    TargetOptions opts_;
    const llama_vocab * vocab_ = nullptr;
    uint32_t n_vocab_ = 0, n_embd_ = 0, n_layer_ = 0, n_batch_ = 0;
    std::vector<int32_t> layers_;
    std::vector<float> features_;
    llama_batch batch_{};
    uint32_t batch_cap_ = 0;
    uint32_t last_chunk_rows_ = 0;
    bool last_all_logits_ = false;
    bool repeated_shape_ = false;
    std::string arch_;
    TargetMemory memory_ = TargetMemory::Attention;
    bool keeps_checkpoints_ = false;
    int32_t n_swa_ = 0;            // llama_model_n_swa: positions a sliding-window layer attends to
    std::vector<int32_t> tokens_;  // the tokens of positions 0..tokens_.size()-1, as far as known
    int32_t last_chunk_p0_ = -1;   // first position of our most recent llama_decode call; -1: not ours
    bool rolled_back_ = false;     // a snapshot rollback since that call (libllama allows one)
    uint64_t decode_calls_ = 0;
    std::vector<Checkpoint> checkpoints_;
    RollbackCounters rollback_;
};

}  // namespace dflash
