#include "dflash/target.h"

#include <sys/stat.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <regex>

#include "cpu_repack.h"
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
            case GGML_TYPE_Q4_0:
            case GGML_TYPE_Q4_1:
            case GGML_TYPE_Q8_0:
            case GGML_TYPE_Q4_K:
            case GGML_TYPE_Q5_K:
            case GGML_TYPE_Q6_K:
            case GGML_TYPE_IQ4_XS:
                return true;
            default:
                break;
        }
    }
    return false;
}

Repack resolved_repack(const TargetOptions & opts, const std::string & path) {
    if (opts.repack != Repack::Auto) {
        if (opts.repack == Repack::WithoutAmx && opts.n_gpu_layers != 0) {
            throw Error(path + ": repack without AMX places the layers' weights on the CPU: it needs n_gpu_layers = 0");
        }
        return opts.repack;
    }
    if (!amx_would_take(path)) return Repack::On;
    // the repacked layouts without AMX only where every layer runs on the CPU: the placement is by name
    return opts.n_gpu_layers == 0 ? Repack::WithoutAmx : Repack::Off;
}

std::string supported_list() {
    std::string out;
    for (const std::string & a : archs_exposing_layer_inputs()) out += (out.empty() ? "" : ", ") + a;
    return out;
}

std::string model_arch(const llama_model * model) {
    char arch[128] = {0};
    if (llama_model_meta_val_str(model, "general.architecture", arch, sizeof(arch)) < 0) arch[0] = 0;
    return arch;
}

void check_arch(const std::string & arch, const std::string & where) {
    if (arch_exposes_layer_inputs(arch)) return;
    throw Error(where + ": the target's architecture '" + arch +
                "' cannot feed a DFlash drafter: libllama does "
                "not expose its layer inputs (llama_get_embeddings_layer_inp), which the drafter reads; "
                "architectures that do: " +
                supported_list());
}

}  // namespace

const char * memory_name(TargetMemory m) {
    switch (m) {
        case TargetMemory::Attention:
            return "attention";
        case TargetMemory::RecurrentSnapshots:
            return "recurrent-snapshots";
        case TargetMemory::RecurrentCheckpoint:
            return "recurrent-checkpoint";
        case TargetMemory::SlidingWindow:
            return "sliding-window";
    }
    return "?";
}

const std::vector<std::string> & archs_exposing_layer_inputs() {
    // the model graphs of libllama 0.3.36 that set t_layer_inp (src/models/*.cpp), by arch name
    static const std::vector<std::string> archs = {
        "bailingmoe3",    "deepseek4", "gemma4",     "gpt-oss",    "hunyuan_vl",   "lfm2",      "lfm2moe",
        "llama",          "mimo2",     "minimax-01", "minimax-m2", "muse-glimmer", "nanbeige",  "nemotron_h",
        "nemotron_h_moe", "qwen3",     "qwen35",     "qwen35moe",  "qwen3moe",     "qwen3next", "qwen4exp",
    };
    return archs;
}

bool arch_exposes_layer_inputs(const std::string & arch) {
    const auto & a = archs_exposing_layer_inputs();
    return std::find(a.begin(), a.end(), arch) != a.end();
}

std::string gguf_architecture(const std::string & path) {
    ggml_context_ptr meta;
    gguf_ptr g = open_gguf(path, meta, "cannot read the target's header");
    const int64_t k = gguf_find_key(g.get(), "general.architecture");
    if (k < 0 || gguf_get_kv_type(g.get(), k) != GGUF_TYPE_STRING) {
        throw Error(path + ": general.architecture: expected a string key, found none");
    }
    return gguf_get_val_str(g.get(), k);
}

namespace {

// libllama's tensor overrides: the user's (pattern, buffer type name) first, then `placed`; the patterns'
// strings must outlive the load
std::vector<llama_model_tensor_buft_override> resolve_tensor_overrides(
    const std::vector<std::pair<std::string, std::string>> & overrides,
    const std::vector<std::pair<std::string, ggml_backend_buffer_type_t>> & placed, const std::string & path) {
    std::vector<llama_model_tensor_buft_override> out;
    if (overrides.empty() && placed.empty()) return out;
    // the buffer types a weight can be placed in: each device's own, by name (CPU, CUDA0, Vulkan0, ...)
    std::vector<std::pair<std::string, ggml_backend_buffer_type_t>> known;
    for (size_t i = 0; i < ggml_backend_dev_count(); ++i) {
        ggml_backend_buffer_type_t buft = ggml_backend_dev_buffer_type(ggml_backend_dev_get(i));
        if (buft) known.emplace_back(ggml_backend_buft_name(buft), buft);
    }
    for (const auto & [pattern, name] : overrides) {
        try {
            std::regex check(pattern);  // libllama would throw inside its load and only log it
        } catch (const std::regex_error & e) {
            throw Error(path + ": tensor override '" + pattern + "': not a regular expression (" + e.what() + ")");
        }
        auto it = std::find_if(known.begin(), known.end(), [&](const auto & k) { return k.first == name; });
        if (it == known.end()) {
            std::string names;
            for (const auto & k : known) names += (names.empty() ? "" : ", ") + k.first;
            throw Error(path + ": tensor override '" + pattern + "=" + name + "': unknown buffer type '" + name +
                        "' (this build has: " + names + ")");
        }
        out.push_back({pattern.c_str(), it->second});
    }
    for (const auto & [pattern, buft] : placed) out.push_back({pattern.c_str(), buft});
    out.push_back({nullptr, nullptr});
    return out;
}

}  // namespace

WeightPlacement target_weight_placement(const std::string & path, const TargetOptions & opts) {
    WeightPlacement out;
    const Repack repack = resolved_repack(opts, path);
    out.use_extra_bufts = repack == Repack::On;
    if (repack == Repack::WithoutAmx) {
        out.overrides =
            repacked_placement(path, repacking_bufts(ggml_backend_dev_by_type(GGML_BACKEND_DEVICE_TYPE_CPU)));
    }
    return out;
}

llama_flash_attn_type target_flash_attn(int n_gpu_layers) {
    // flash attention on the CPU verifies more slowly once the context is more than a few hundred tokens
    // (2 cores, 1024 tokens: a 1.7B-shaped Q4_K_M target 11-16% slower at 1-4 tokens, 0.6B F16 11-33%, the
    // bundled pair 3-24%; within 4% either way at 100 tokens); on a GPU let libllama decide
    return n_gpu_layers == 0 ? LLAMA_FLASH_ATTN_TYPE_DISABLED : LLAMA_FLASH_ATTN_TYPE_AUTO;
}

ggml_type kv_cache_type(const std::string & name) {
    static const ggml_type kTypes[] = {GGML_TYPE_F32,  GGML_TYPE_F16,    GGML_TYPE_BF16, GGML_TYPE_Q8_0, GGML_TYPE_Q4_0,
                                       GGML_TYPE_Q4_1, GGML_TYPE_IQ4_NL, GGML_TYPE_Q5_0, GGML_TYPE_Q5_1};
    std::string names;
    for (ggml_type t : kTypes) {
        if (name == ggml_type_name(t)) return t;
        names += std::string(names.empty() ? "" : ", ") + ggml_type_name(t);
    }
    throw Error("K/V cache type must be one of " + names + ", got '" + name + "'");
}

Target::Target(const std::string & path, const TargetOptions & opts) {
    struct stat st{};
    if (stat(path.c_str(), &st) != 0) {
        throw Error(path + ": target model file not found");
    }
    check_arch(gguf_architecture(path), path);  // before a load that could take minutes
    for (const auto & [lora, scale] : opts.loras) {
        if (stat(lora.c_str(), &st) != 0) throw Error(lora + ": LoRA adapter file not found");
        if (!std::isfinite(scale)) throw Error(lora + ": a LoRA adapter's scale must be finite");
    }
    llama_backend_init();
    llama_model_params mp = llama_model_default_params();
    mp.n_gpu_layers = opts.n_gpu_layers;
    const WeightPlacement placed = target_weight_placement(path, opts);
    mp.use_extra_bufts = placed.use_extra_bufts;
    const auto overrides = resolve_tensor_overrides(opts.tensor_overrides, placed.overrides, path);
    mp.tensor_buft_overrides = overrides.empty() ? nullptr : overrides.data();
    model_ = llama_model_load_from_file(path.c_str(), mp);
    if (!model_) {
        throw Error(path + ": libllama could not load the target model (see its log above)");
    }
    shared_model_.reset(model_, llama_model_free);
    for (const auto & [lora, scale] : opts.loras) {
        llama_adapter_lora * a = llama_adapter_lora_init(model_, lora.c_str());
        if (!a) {
            throw Error(lora + ": libllama could not load this LoRA adapter for " + path +
                        " (see its log above: not a LoRA GGUF, or one for another base model)");
        }
        adapters_.push_back(a);
    }
    open_context(path, opts);
}

void Target::apply_loras() {
    if (adapters_.empty()) return;
    std::vector<float> scales;
    for (const auto & lora : opts_.loras) scales.push_back(lora.second);
    if (llama_set_adapters_lora(ctx_, adapters_.data(), adapters_.size(), scales.data()) != 0) {
        throw Error("libllama could not apply the LoRA adapters to the target's context");
    }
}

void Target::set_lora_scales(const std::vector<float> & scales) {
    if (scales.size() != adapters_.size()) {
        throw Error("set_lora_scales: " + std::to_string(scales.size()) + " scales for " +
                    std::to_string(adapters_.size()) + " LoRA adapters");
    }
    for (float s : scales) {
        if (!std::isfinite(s)) throw Error("set_lora_scales: a scale must be finite");
    }
    for (size_t i = 0; i < scales.size(); ++i) opts_.loras[i].second = scales[i];
    apply_loras();
}

void Target::open_context(const std::string & path, const TargetOptions & opts) {
    llama_context_params cp = llama_context_default_params();
    cp.n_ctx = opts.n_ctx;
    cp.n_batch = opts.n_batch;
    cp.n_ubatch = opts.n_batch;
    const int n_threads = opts.n_threads > 0 ? opts.n_threads : default_cpu_threads();
    cp.n_threads = n_threads;
    cp.n_threads_batch = n_threads;
    cp.no_perf = true;
    cp.n_rs_seq = opts.n_rs_seq;  // libllama clamps it to 0 for archs without snapshot rollback
    cp.flash_attn_type =
        ggml_is_quantized(opts.type_v) ? LLAMA_FLASH_ATTN_TYPE_ENABLED : target_flash_attn(opts.n_gpu_layers);
    cp.swa_full = opts.swa_full;
    cp.type_k = opts.type_k;
    cp.type_v = opts.type_v;
    ctx_ = llama_init_from_model(model_, cp);
    if (!ctx_) {
        throw Error(path + ": libllama could not create a context (n_ctx " + std::to_string(opts.n_ctx) +
                    ", K/V cache " + ggml_type_name(opts.type_k) + "/" + ggml_type_name(opts.type_v) +
                    "; see its log above)");
    }
    owns_ = true;
    path_ = path;
    opts_ = opts;
    init_common();
    apply_loras();
}

std::unique_ptr<Target> Target::share(uint32_t n_rs_seq) const {
    if (!shared_model_) {
        throw Error("an adopted target's model belongs to its llama_cpp.Llama: it cannot be shared");
    }
    std::unique_ptr<Target> t(new Target());
    t->model_ = model_;
    t->shared_model_ = shared_model_;
    t->adapters_ = adapters_;
    TargetOptions opts = opts_;
    opts.n_rs_seq = n_rs_seq;
    t->open_context(path_, opts);
    return t;
}

Target::Target(llama_model * model, llama_context * ctx) : model_(model), ctx_(ctx), owns_(false) {
    if (!model_ || !ctx_) throw Error("adopting a target needs a loaded llama model and context");
    check_arch(model_arch(model_), "target model");  // a file is checked before its load, in the other constructor
    init_common();
}

void Target::init_common() {
    arch_ = model_arch(model_);
    if (llama_model_is_recurrent(model_) || llama_model_is_hybrid(model_)) {
        memory_ = llama_n_rs_seq(ctx_) > 0 ? TargetMemory::RecurrentSnapshots : TargetMemory::RecurrentCheckpoint;
        keeps_checkpoints_ = true;
    } else if ((n_swa_ = llama_model_n_swa(model_)) > 0) {
        memory_ = TargetMemory::SlidingWindow;
        // libllama's sliding-window cache (llama-kv-cache-iswa.cpp) holds a window and a batch of positions,
        // padded; where that is not shorter than the context it holds them all
        const uint32_t swa_cells = GGML_PAD((uint32_t)n_swa_ + llama_n_ubatch(ctx_), 256);
        keeps_checkpoints_ = owns_ && !opts_.swa_full && swa_cells < llama_n_ctx(ctx_);
    }
    vocab_ = llama_model_get_vocab(model_);
    n_vocab_ = (uint32_t)llama_vocab_n_tokens(vocab_);
    n_embd_ = (uint32_t)llama_model_n_embd(model_);
    n_layer_ = (uint32_t)llama_model_n_layer(model_);
    n_batch_ = std::min(llama_n_batch(ctx_), llama_n_ubatch(ctx_));
    batch_cap_ = n_batch_;
    batch_ = llama_batch_init((int32_t)batch_cap_, 0, 1);
}

Target::~Target() {
    llama_batch_free(batch_);
    if (owns_) {  // the model goes with the last target sharing it (shared_model_)
        for (int32_t lid : layers_) llama_set_embeddings_layer_inp(ctx_, (uint32_t)lid, false);
        llama_free(ctx_);
    } else {
        // hand the adopted context back as we found it
        for (int32_t lid : layers_) llama_set_embeddings_layer_inp(ctx_, (uint32_t)lid, false);
    }
}

uint32_t Target::n_ctx() const { return llama_n_ctx(ctx_); }

void Target::set_feature_layers(const std::vector<int32_t> & layers) {
    for (int32_t lid : layers) {
        if (lid < 0 || (uint32_t)lid > n_layer_) {
            throw Error("target layer " + std::to_string(lid) + " is outside the target's " + std::to_string(n_layer_) +
                        " layers (layer inputs 0.." + std::to_string(n_layer_) + ")");
        }
    }
    for (int32_t lid : layers_) llama_set_embeddings_layer_inp(ctx_, (uint32_t)lid, false);
    layers_ = layers;
    for (int32_t lid : layers_) llama_set_embeddings_layer_inp(ctx_, (uint32_t)lid, true);
}

void Target::decode(const int32_t * tokens, uint32_t n, int32_t p0, bool all_logits) {
    if (n == 0) return;
    if ((uint64_t)p0 + n > n_ctx()) {
        throw Error("target context full: positions up to " + std::to_string(p0 + n) +
                    " exceed n_ctx = " + std::to_string(n_ctx()));
    }
    repeated_shape_ = n <= n_batch_ && n == last_chunk_rows_ && all_logits == last_all_logits_;
    if (tokens_.size() >= (size_t)p0) {
        tokens_.resize((size_t)p0);
        tokens_.insert(tokens_.end(), tokens, tokens + n);
    }  // else positions before p0 were decoded by someone else: what they hold stays unknown
    const size_t width = layers_.size() * n_embd_;
    features_.resize((size_t)n * width);
    for (uint32_t done = 0; done < n;) {
        const uint32_t chunk = std::min(n_batch_, n - done);
        decode_chunk(tokens + done, chunk, p0 + (int32_t)done, all_logits, n - 1 - done);
        for (size_t k = 0; k < layers_.size(); ++k) {
            const float * src = llama_get_embeddings_layer_inp(ctx_, (uint32_t)layers_[k]);
            for (uint32_t i = 0; i < chunk; ++i) {
                std::memcpy(&features_[(size_t)(done + i) * width + k * n_embd_], src + (size_t)i * n_embd_,
                            n_embd_ * sizeof(float));
            }
        }
        done += chunk;
        last_chunk_rows_ = chunk;
    }
    last_all_logits_ = all_logits;
}

void Target::decode_chunk(const int32_t * tokens, uint32_t n, int32_t p0, bool all_logits, uint32_t last_row) {
    batch_.n_tokens = (int32_t)n;
    for (uint32_t i = 0; i < n; ++i) {
        batch_.token[i] = tokens[i];
        batch_.pos[i] = p0 + (int32_t)i;
        batch_.n_seq_id[i] = 1;
        batch_.seq_id[i][0] = 0;
        batch_.logits[i] = all_logits || i == last_row;
    }
    const int32_t rc = llama_decode(ctx_, batch_);
    ++decode_calls_;
    if (rc != 0) {
        last_chunk_p0_ = -1;
        throw Error("target decode failed (llama_decode returned " + std::to_string(rc) + ") at positions " +
                    std::to_string(p0) + ".." + std::to_string(p0 + (int32_t)n - 1));
    }
    last_chunk_p0_ = p0;
    rolled_back_ = false;
}

const float * Target::logits(uint32_t row) const {
    // rows index the last chunk's batch; with all_logits off only its last row has logits
    const int32_t i = last_all_logits_ ? (int32_t)row : -1;
    const float * p = llama_get_logits_ith(ctx_, i);
    if (!p) throw Error("target logits unavailable for row " + std::to_string(row));
    return p;
}

uint32_t Target::n_rs_seq() const { return llama_n_rs_seq(ctx_); }

void Target::truncate(int32_t p) {
    p = std::max(p, 0);
    if (p < (int32_t)seq_len()) roll_back(p);
    drop_checkpoints_after(p);  // they hold tokens no longer the sequence's
}

void Target::roll_back(int32_t p) {
    const int32_t end = (int32_t)seq_len();
    if (tokens_.size() > (size_t)p) tokens_.resize((size_t)p);
    llama_memory_t mem = llama_get_memory(ctx_);
    if (p == 0) {
        clear();
        return;
    }
    if (rolls_back_in_place(p)) {
        if (!llama_memory_seq_rm(mem, 0, p, -1)) {
            throw Error("target KV cache rollback to position " + std::to_string(p) + " failed");
        }
        rollback_.seq_rm++;
        return;
    }
    // libllama's snapshots hold the states after each token of our latest decode call alone, and it takes
    // one rollback per call; removing all of that call's tokens (or tokens of earlier calls) gives wrong
    // states while seq_rm still says yes, so those go through a checkpoint
    if (snapshot_holds(p, end) && llama_memory_seq_rm(mem, 0, p, -1)) {
        rolled_back_ = true;
        rollback_.snapshot++;
        return;
    }
    const Checkpoint * from = checkpoint_for(p);
    if ((int32_t)tokens_.size() < p && (!from || from->pos < p)) {
        throw Error("target rollback to position " + std::to_string(p) + ": its " +
                    (memory_ == TargetMemory::SlidingWindow ? "sliding-window layers no longer hold the window"
                                                            : "recurrent state cannot go back") +
                    ", and the tokens to re-decode from " + std::to_string(from ? from->pos : 0) + " are unknown");
    }
    if (from) {
        if (llama_state_seq_set_data_ext(ctx_, from->bytes.data(), from->bytes.size(), 0,
                                         LLAMA_STATE_SEQ_FLAGS_PARTIAL_ONLY) != from->bytes.size() ||
            !llama_memory_seq_rm(mem, 0, std::min(from->pos, p), -1)) {
            clear();
            throw Error("target rollback to position " + std::to_string(p) +
                        ": libllama refused the checkpoint of "
                        "position " +
                        std::to_string(from->pos));
        }
        rollback_.restored++;
    } else {
        llama_memory_clear(mem, true);
    }
    replay(from ? std::min(from->pos, p) : 0, p);
}

bool Target::rolls_back_in_place(int32_t p) const {
    return memory_ == TargetMemory::Attention || (memory_ == TargetMemory::SlidingWindow &&
                                                  holds_window(llama_memory_seq_pos_min(llama_get_memory(ctx_), 0), p));
}

const Target::Checkpoint * Target::checkpoint_for(int32_t p) const {
    // the one that leaves the fewest tokens to re-decode: one at or before p, or for sliding-window layers
    // one after p that still holds the window before p (a prompt's end, when that prompt comes again)
    const Checkpoint * from = nullptr;
    const auto to_replay = [p](const Checkpoint & c) { return std::max(0, p - c.pos); };
    for (const Checkpoint & c : checkpoints_) {
        if (c.pos > p && !(memory_ == TargetMemory::SlidingWindow && holds_window(c.pos_min, p))) continue;
        if (!from || to_replay(c) < to_replay(*from)) from = &c;
    }
    return from;
}

bool Target::snapshot_holds(int32_t p, int32_t end) const {
    return memory_ == TargetMemory::RecurrentSnapshots && !rolled_back_ && last_chunk_p0_ >= 0 && p > last_chunk_p0_ &&
           (uint32_t)(end - p) <= n_rs_seq();
}

int32_t Target::replay_from(int32_t p) const {
    p = std::max(p, 0);
    const int32_t end = (int32_t)seq_len();
    if (p >= end || rolls_back_in_place(p) || snapshot_holds(p, end)) return p;
    const Checkpoint * from = checkpoint_for(p);
    return from ? std::min(from->pos, p) : 0;
}

bool Target::holds_window(int32_t pos_min, int32_t p) const {
    // llama-server's threshold: one position more than the window needs (libllama's pos_min of a
    // sliding-window cache is its sliding layers')
    return pos_min <= std::max(0, p - n_swa_);
}

void Target::replay(int32_t from, int32_t to) {
    for (int32_t done = from; done < to;) {
        const uint32_t chunk = std::min<uint32_t>(n_batch_, (uint32_t)(to - done));
        decode_chunk(&tokens_[(size_t)done], chunk, done, false, chunk - 1);
        done += (int32_t)chunk;
        rollback_.replayed_tokens += chunk;
    }
    // the shape record stays the caller's: a step that rolls back this way pays the replay's graph rebuild
    // every time, and the draft-length controller must time those steps as the steady ones they are
}

void Target::prepare_rollback(uint32_t n_tokens) {
    // a decode overwrites only sliding positions that its first token no longer attends to: dropping its
    // tokens again leaves the window whole
    if (memory_ == TargetMemory::Attention || memory_ == TargetMemory::SlidingWindow || n_tokens == 0) return;
    if (memory_ == TargetMemory::RecurrentSnapshots && n_tokens <= n_rs_seq()) return;
    Checkpoint c;
    c.step = true;
    const auto old =
        std::find_if(checkpoints_.begin(), checkpoints_.end(), [](const Checkpoint & k) { return k.step; });
    if (old != checkpoints_.end()) {
        c.bytes = std::move(old->bytes);  // the previous step's: its allocation is reused
        checkpoints_.erase(old);
    }
    save_checkpoint(std::move(c));
}

void Target::checkpoint() {
    if (!keeps_checkpoints_) return;
    constexpr size_t kMaxKept = 3;                   // prompt ends: a repeated prompt, a chat's earlier turns
    drop_checkpoints_after((int32_t)seq_len() - 1);  // one per position
    const auto is_kept = [](const Checkpoint & k) { return !k.step; };
    if ((size_t)std::count_if(checkpoints_.begin(), checkpoints_.end(), is_kept) >= kMaxKept) {
        checkpoints_.erase(std::find_if(checkpoints_.begin(), checkpoints_.end(), is_kept));  // the oldest
    }
    save_checkpoint(Checkpoint{});
}

void Target::save_checkpoint(Checkpoint c) {
    c.pos = (int32_t)seq_len();
    c.pos_min = llama_memory_seq_pos_min(llama_get_memory(ctx_), 0);
    // the recurrent state or the sliding-window layers' cells alone (libllama's partial state): the full
    // layers' K/V rolls back with seq_rm after a restore
    c.bytes.resize(llama_state_seq_get_size_ext(ctx_, 0, LLAMA_STATE_SEQ_FLAGS_PARTIAL_ONLY));
    c.bytes.resize(
        llama_state_seq_get_data_ext(ctx_, c.bytes.data(), c.bytes.size(), 0, LLAMA_STATE_SEQ_FLAGS_PARTIAL_ONLY));
    rollback_.checkpoints++;
    rollback_.checkpoint_bytes = c.bytes.size();
    checkpoints_.push_back(std::move(c));
}

void Target::drop_checkpoints_after(int32_t p) {
    checkpoints_.erase(
        std::remove_if(checkpoints_.begin(), checkpoints_.end(), [p](const Checkpoint & c) { return c.pos > p; }),
        checkpoints_.end());
}

void Target::forget_after(uint32_t keep) {
    last_chunk_p0_ = -1;
    if (tokens_.size() > keep) tokens_.resize(keep);
    drop_checkpoints_after((int32_t)keep);
}

void Target::clear() {
    llama_memory_clear(llama_get_memory(ctx_), true);
    tokens_.clear();
    checkpoints_.clear();
    last_chunk_p0_ = -1;
}

uint32_t Target::seq_len() const { return (uint32_t)(llama_memory_seq_pos_max(llama_get_memory(ctx_), 0) + 1); }

std::vector<uint8_t> Target::save_seq() const {
    std::vector<uint8_t> bytes(llama_state_seq_get_size(ctx_, 0));
    bytes.resize(llama_state_seq_get_data(ctx_, bytes.data(), bytes.size(), 0));
    return bytes;
}

void Target::load_seq(const std::vector<uint8_t> & bytes, const std::vector<int32_t> & tokens) {
    clear();
    if (llama_state_seq_set_data(ctx_, bytes.data(), bytes.size(), 0) != bytes.size()) {
        clear();
        throw Error("the saved target state (" + std::to_string(bytes.size()) +
                    " bytes) does not load into this "
                    "context: saved from another model, or it holds more tokens than n_ctx = " +
                    std::to_string(n_ctx()));
    }
    tokens_ = tokens;
}

}  // namespace dflash
