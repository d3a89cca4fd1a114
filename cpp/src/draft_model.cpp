#include "dflash/draft_model.h"

#include <sys/stat.h>

#include <cerrno>
#include <cstdio>
#include <cstring>
#include <memory>
#include <set>

#include "cpu_repack.h"
#include "dflash/error.h"
#include "ggml-alloc.h"
#include "ggml-backend.h"
#include "ggml-cpp.h"
#include "gguf.h"
#include "gguf_keys.h"
#include "gguf_open.h"

namespace dflash {

namespace {

constexpr const char * kArch = "dflash";

// Sanity bounds: generous for real drafters, tight enough that a corrupt value
// is reported instead of turning into a giant allocation.
constexpr int64_t kMaxLayers = 256;
constexpr int64_t kMaxEmbd = 65536;
constexpr int64_t kMaxFF = 1 << 20;
constexpr int64_t kMaxHeads = 1024;
constexpr int64_t kMaxHeadDim = 1024;
constexpr int64_t kMaxVocab = 1 << 22;
constexpr int64_t kMinBlock = 2;
constexpr int64_t kMaxBlock = kMaxBlockSize;
constexpr int64_t kMaxTargetLayer = 4096;

struct FileCloser {
    void operator()(FILE * f) const {
        if (f) fclose(f);
    }
};
using file_ptr = std::unique_ptr<FILE, FileCloser>;

std::string shape_str(const std::vector<int64_t> & ne) {
    std::string s = "{";
    for (size_t i = 0; i < ne.size(); ++i) {
        s += (i ? ", " : "") + std::to_string(ne[i]);
    }
    return s + "}";
}

// Which ggml types each tensor class may use.
enum class TypeRule { F32Only, Matrix };

bool type_allowed(ggml_type t, TypeRule rule) {
    if (rule == TypeRule::F32Only) return t == GGML_TYPE_F32;
    switch (t) {
        case GGML_TYPE_F32:
        case GGML_TYPE_F16:
        case GGML_TYPE_BF16:
        case GGML_TYPE_Q8_0:
        case GGML_TYPE_Q4_0:
        case GGML_TYPE_Q4_1:
        case GGML_TYPE_Q5_0:
        case GGML_TYPE_Q5_1:
        case GGML_TYPE_Q2_K:
        case GGML_TYPE_Q3_K:
        case GGML_TYPE_Q4_K:
        case GGML_TYPE_Q5_K:
        case GGML_TYPE_Q6_K:
        case GGML_TYPE_IQ4_NL:
        case GGML_TYPE_IQ4_XS:
            return true;
        default:
            return false;
    }
}

struct Expected {
    std::vector<int64_t> ne;
    TypeRule rule;
    bool required;
};

// stands for the vocabulary while it is unknown (no tokenizer, no codebook)
constexpr int64_t kAnyVocab = -1;

std::map<std::string, Expected> expected_tensors(const DraftHparams & hp) {
    std::map<std::string, Expected> e;
    const int64_t E = hp.n_embd;
    const int64_t V = hp.n_vocab ? (int64_t)hp.n_vocab : kAnyVocab;
    e["fc.weight"] = {{(int64_t)hp.n_target_features(), E}, TypeRule::Matrix, true};
    e["enc.output_norm.weight"] = {{E}, TypeRule::F32Only, true};
    e["output_norm.weight"] = {{E}, TypeRule::F32Only, true};
    e["token_embd.weight"] = {{E, V}, TypeRule::Matrix, false};
    e["output.weight"] = {{E, V}, TypeRule::Matrix, false};
    for (uint32_t i = 0; i < hp.n_layer; ++i) {
        const std::string p = "blk." + std::to_string(i) + ".";
        e[p + "attn_norm.weight"] = {{E}, TypeRule::F32Only, true};
        e[p + "attn_q.weight"] = {{E, hp.n_embd_q()}, TypeRule::Matrix, true};
        e[p + "attn_k.weight"] = {{E, hp.n_embd_kv()}, TypeRule::Matrix, true};
        e[p + "attn_v.weight"] = {{E, hp.n_embd_kv()}, TypeRule::Matrix, true};
        e[p + "attn_output.weight"] = {{hp.n_embd_q(), E}, TypeRule::Matrix, true};
        e[p + "attn_q_norm.weight"] = {{hp.head_dim}, TypeRule::F32Only, true};
        e[p + "attn_k_norm.weight"] = {{hp.head_dim}, TypeRule::F32Only, true};
        e[p + "ffn_norm.weight"] = {{E}, TypeRule::F32Only, true};
        e[p + "ffn_gate.weight"] = {{E, hp.n_ff}, TypeRule::Matrix, true};
        e[p + "ffn_up.weight"] = {{E, hp.n_ff}, TypeRule::Matrix, true};
        e[p + "ffn_down.weight"] = {{hp.n_ff, E}, TypeRule::Matrix, true};
        if (hp.version == 2) {
            const int64_t proj = 2 * (int64_t)hp.conv_kernel * hp.n_conv_groups();
            e[p + "attn_conv_base"] = {{E, hp.conv_kernel, 2}, TypeRule::F32Only, true};
            e[p + "attn_conv_proj.weight"] = {{E, proj}, TypeRule::Matrix, true};
            e[p + "ffn_conv_base"] = {{E, hp.conv_kernel, 2}, TypeRule::F32Only, true};
            e[p + "ffn_conv_proj.weight"] = {{E, proj}, TypeRule::Matrix, true};
        }
    }
    if (hp.version == 2) {
        e["selector_predecessor.weight"] = {{hp.selector_rank, V}, TypeRule::Matrix, true};
        e["selector_successor.weight"] = {{hp.selector_rank, V}, TypeRule::Matrix, true};
        e["selector_hidden.weight"] = {{E, hp.selector_rank}, TypeRule::Matrix, true};
    }
    return e;
}

void check_magic(const std::string & path, size_t & file_size) {
    struct stat st{};
    if (stat(path.c_str(), &st) != 0) {
        throw Error(path + ": cannot open file (" + std::string(strerror(errno)) + ")");
    }
    if (!S_ISREG(st.st_mode)) {
        throw Error(path + ": not a regular file (" + (S_ISDIR(st.st_mode) ? "a directory" : "a special file") + ")");
    }
    file_ptr f(fopen(path.c_str(), "rb"));
    if (!f) {
        throw Error(path + ": cannot open file (" + std::string(strerror(errno)) + ")");
    }
    if (fseek(f.get(), 0, SEEK_END) != 0) {
        throw Error(path + ": cannot seek (not a regular file?)");
    }
    const long size = ftell(f.get());
    if (size < 0) {
        throw Error(path + ": cannot determine the file size");
    }
    file_size = (size_t)size;
    char magic[4] = {0, 0, 0, 0};
    fseek(f.get(), 0, SEEK_SET);
    const size_t n = fread(magic, 1, 4, f.get());
    if (n < 4 || memcmp(magic, "GGUF", 4) != 0) {
        throw Error(path + ": not a GGUF file (expected magic 'GGUF' at offset 0, file is " +
                    std::to_string(file_size) + " bytes)");
    }
}

// one flag per layer (attention.sliding_window_pattern, attention.causal_layers)
std::vector<bool> layer_flags(const GgufKeys & keys, const std::string & key, uint32_t n_layer) {
    std::vector<bool> flags = keys.get_flag_array(key);
    if (flags.size() != n_layer) {
        throw Error(keys.where(key) + ": expected " + std::to_string(n_layer) + " flags (block_count), found " +
                    std::to_string(flags.size()));
    }
    return flags;
}

// hparams that must be known before the tensor table can be checked
DraftHparams read_hparams(const GgufKeys & keys, const gguf_context * g) {
    DraftHparams hp;
    const std::string arch = keys.get_string("general.architecture");
    if (arch != kArch) {
        throw Error(keys.where("general.architecture") + ": expected \"dflash\", found \"" + arch + "\"");
    }
    const std::string p = "dflash.";
    hp.n_ctx_train = (uint32_t)keys.get_int(p + "context_length", 1, INT32_MAX);
    hp.n_embd = (uint32_t)keys.get_int(p + "embedding_length", 1, kMaxEmbd);
    hp.n_layer = (uint32_t)keys.get_int(p + "block_count", 1, kMaxLayers);
    hp.n_ff = (uint32_t)keys.get_int(p + "feed_forward_length", 1, kMaxFF);
    hp.n_head = (uint32_t)keys.get_int(p + "attention.head_count", 1, kMaxHeads);
    hp.n_head_kv = (uint32_t)keys.get_int(p + "attention.head_count_kv", 1, kMaxHeads);
    if (hp.n_head % hp.n_head_kv != 0) {
        throw Error(keys.where(p + "attention.head_count_kv") + ": " + std::to_string(hp.n_head_kv) +
                    " must divide attention.head_count = " + std::to_string(hp.n_head));
    }
    hp.head_dim = (uint32_t)keys.find_int(p + "attention.key_length", 2, kMaxHeadDim).value_or(hp.n_embd / hp.n_head);
    const int64_t v_len = keys.find_int(p + "attention.value_length", 2, kMaxHeadDim).value_or(hp.head_dim);
    if (v_len != hp.head_dim) {
        throw Error(keys.where(p + "attention.value_length") + ": expected " + std::to_string(hp.head_dim) +
                    " (= key_length), found " + std::to_string(v_len));
    }
    if (hp.head_dim < 2) {
        throw Error(keys.where(p + "attention.key_length") + ": head dim " + std::to_string(hp.head_dim) +
                    " is invalid (embedding_length / head_count when the key is absent), expected >= 2");
    }
    if (hp.head_dim % 2 != 0) {
        throw Error(keys.where(p + "attention.key_length") + ": head dim must be even for RoPE, found " +
                    std::to_string(hp.head_dim));
    }
    hp.n_rot = (uint32_t)keys.find_int(p + "rope.dimension_count", 2, hp.head_dim).value_or(hp.head_dim);
    hp.rms_eps = keys.get_float(p + "attention.layer_norm_rms_epsilon");
    if (!(hp.rms_eps > 0.0f && hp.rms_eps < 1.0f)) {
        throw Error(keys.where(p + "attention.layer_norm_rms_epsilon") + ": expected a value in (0, 1), found " +
                    std::to_string(hp.rms_eps));
    }
    hp.rope_freq_base = keys.find_float(p + "rope.freq_base").value_or(10000.0f);
    if (keys.find_array_size(p + "rope.dimension_sections")) {
        const auto s = keys.get_int_array(p + "rope.dimension_sections", 0, hp.head_dim);
        if (s.size() != 4 || s[0] <= 0 || s[1] != 0 || s[2] != 0 || s[3] != 0) {
            throw Error(keys.where(p + "rope.dimension_sections") +
                        ": expected 4 sections [n > 0, 0, 0, 0] (a drafter ropes on the temporal section alone)");
        }
        hp.rope_sections.assign(s.begin(), s.end());
    }
    if (!(hp.rope_freq_base > 0.0f)) {
        throw Error(keys.where(p + "rope.freq_base") + ": expected > 0");
    }
    if (auto type = keys.find_string(p + "rope.scaling.type")) {
        if (*type == "linear") {
            const float factor = keys.get_float(p + "rope.scaling.factor");
            if (!(factor > 0.0f)) throw Error(keys.where(p + "rope.scaling.factor") + ": expected > 0");
            hp.rope_freq_scale = 1.0f / factor;
        } else if (*type != "none") {
            throw Error(keys.where(p + "rope.scaling.type") + ": only \"linear\" and \"none\" are supported, found \"" +
                        *type + "\"");
        }
    }
    hp.block_size = (uint32_t)keys.get_int(p + "block_size", kMinBlock, kMaxBlock);

    const auto tl = keys.get_int_array(p + "target_layers", 1, kMaxTargetLayer);
    if (tl.empty() || tl.size() > 64) {
        throw Error(keys.where(p + "target_layers") + ": expected 1..64 layer ids, found " + std::to_string(tl.size()));
    }
    for (size_t i = 1; i < tl.size(); ++i) {
        if (tl[i] <= tl[i - 1]) {
            throw Error(keys.where(p + "target_layers") + ": layer ids must be strictly increasing");
        }
    }
    hp.target_layers.assign(tl.begin(), tl.end());

    hp.logit_scale = keys.find_float(p + "logit_scale").value_or(0.0f);
    hp.logit_softcap = keys.find_float(p + "final_logit_softcapping").value_or(0.0f);
    hp.embedding_scale = keys.find_float(p + "embedding_scale").value_or(0.0f);
    hp.attn_value_scale = keys.find_float(p + "attention.value_scale").value_or(0.0f);
    hp.attn_scale = keys.find_float(p + "attention.scale").value_or(0.0f);
    hp.causal = keys.find_bool(p + "attention.causal").value_or(false);
    if (const auto act = keys.find_string(p + "hidden_activation")) {
        if (*act == "gelu") {
            hp.hidden_act = DraftHparams::Activation::gelu_erf;
        } else if (*act == "gelu_pytorch_tanh") {
            hp.hidden_act = DraftHparams::Activation::gelu_tanh;
        } else if (*act != "silu") {
            throw Error(keys.where(p + "hidden_activation") +
                        R"(: expected "silu", "gelu" or "gelu_pytorch_tanh", found ")" + *act + "\"");
        }
    }
    if (hp.logit_softcap < 0.0f) {
        throw Error(keys.where(p + "final_logit_softcapping") + ": expected >= 0");
    }
    if (keys.has(p + "attention.causal_layers")) {
        hp.causal_layers = layer_flags(keys, p + "attention.causal_layers", hp.n_layer);
    }
    hp.swa_window = (uint32_t)keys.find_int(p + "attention.sliding_window", 0, INT32_MAX).value_or(0);
    if (hp.swa_window != 0) {
        const std::string pattern = p + "attention.sliding_window_pattern";
        if (!keys.has(pattern)) {
            throw Error(keys.where(pattern) + ": missing; attention.sliding_window = " + std::to_string(hp.swa_window) +
                        " needs it to say which layers slide (one flag per layer)");
        }
        hp.swa_layers = layer_flags(keys, pattern, hp.n_layer);
    }

    // DFlash2 is marked by its conv/selector keys or tensors; then all of them are required.
    const bool has_selector = gguf_find_tensor(g, "selector_hidden.weight") >= 0;
    const bool has_conv_keys = keys.has(p + "conv_kernel_size") || keys.has(p + "selector_top_k");
    hp.version = (has_selector || has_conv_keys) ? 2 : 1;
    if (hp.version == 2) {
        hp.conv_kernel = (uint32_t)keys.get_int(p + "conv_kernel_size", 1, 8);
        hp.conv_group = (uint32_t)keys.get_int(p + "conv_group_size", 1, hp.n_embd);
        hp.selector_rank = (uint32_t)keys.get_int(p + "selector_rank", 1, 65536);
        hp.selector_top_k = (uint32_t)keys.get_int(p + "selector_top_k", 1, 256);
        if (hp.n_embd % hp.conv_group != 0) {
            throw Error(keys.where(p + "conv_group_size") + ": " + std::to_string(hp.conv_group) +
                        " must divide embedding_length = " + std::to_string(hp.n_embd));
        }
        const uint64_t need = (uint64_t)hp.selector_top_k * (hp.selector_top_k + 1);
        if (hp.n_embd < need) {
            throw Error(keys.where(p + "selector_top_k") + ": DFlash2 needs embedding_length >= top_k*(top_k+1) = " +
                        std::to_string(need) + ", found embedding_length " + std::to_string(hp.n_embd));
        }
    }

    hp.mask_token_id = (int32_t)keys.get_int("tokenizer.ggml.mask_token_id", 0, kMaxVocab - 1);
    return hp;
}

}  // namespace

DraftFileInfo inspect_draft_file(const std::string & path) {
    DraftFileInfo info;
    info.path = path;
    check_magic(path, info.file_size);

    ggml_context_ptr meta;
    gguf_ptr g = open_gguf(
        path, meta, "malformed or truncated GGUF header/metadata (" + std::to_string(info.file_size) + " bytes)");
    info.gguf_version = gguf_get_version(g.get());
    const GgufKeys keys(g.get(), path);
    DraftHparams & hp = info.hparams;
    hp = read_hparams(keys, g.get());

    for (const char * k : {"general.name", "general.architecture", "tokenizer.ggml.model"}) {
        if (auto v = keys.find_string(k)) info.meta[k] = *v;
    }
    info.mask_embedding = keys.find_bool("dflash.mask_embedding").value_or(false);

    // Collect the tensor table and check every data range lies inside the file.
    const int64_t n_tensors = gguf_get_n_tensors(g.get());
    const size_t data_offset = gguf_get_data_offset(g.get());
    std::map<std::string, const TensorInfo *> by_name;
    info.tensors.reserve((size_t)n_tensors);
    for (int64_t i = 0; i < n_tensors; ++i) {
        const char * name = gguf_get_tensor_name(g.get(), i);
        ggml_tensor * t = ggml_get_tensor(meta.get(), name);
        TensorInfo ti;
        ti.name = name;
        ti.type = gguf_get_tensor_type(g.get(), i);
        for (int d = 0; d < ggml_n_dims(t); ++d) ti.ne.push_back(t->ne[d]);
        for (int d = 0; d < GGML_MAX_DIMS; ++d) ti.ne4[d] = t->ne[d];
        ti.nbytes = gguf_get_tensor_size(g.get(), i);
        ti.offset = data_offset + gguf_get_tensor_offset(g.get(), i);
        if (ti.offset > info.file_size || ti.nbytes > info.file_size - ti.offset) {
            throw Error(path + ": tensor '" + ti.name + "': data [" + std::to_string(ti.offset) + ", " +
                        std::to_string(ti.offset + ti.nbytes) + ") lies beyond the end of the file (" +
                        std::to_string(info.file_size) + " bytes): truncated file?");
        }
        info.tensors.push_back(ti);
    }
    for (const auto & ti : info.tensors) by_name[ti.name] = &ti;

    // The fc width tells the target hidden size; the codebooks (or the tokenizer) the vocabulary.
    auto fc = by_name.find("fc.weight");
    if (fc == by_name.end()) {
        throw Error(path + ": tensor 'fc.weight' is missing (required)");
    }
    const int64_t fc_in = fc->second->ne.empty() ? 0 : fc->second->ne[0];
    if (fc_in <= 0 || fc_in % (int64_t)hp.target_layers.size() != 0) {
        throw Error(path + ": tensor 'fc.weight': input width " + std::to_string(fc_in) +
                    " is not a multiple of the number of target layers (" + std::to_string(hp.target_layers.size()) +
                    ")");
    }
    hp.target_hidden = (uint32_t)(fc_in / (int64_t)hp.target_layers.size());

    if (auto n_tok = keys.find_array_size("tokenizer.ggml.tokens")) {
        hp.n_vocab = (uint32_t)*n_tok;
    }
    for (const char * vname : {"selector_predecessor.weight", "token_embd.weight", "output.weight"}) {
        auto it = by_name.find(vname);
        if (hp.n_vocab == 0 && it != by_name.end() && it->second->ne.size() == 2) {
            hp.n_vocab = (uint32_t)it->second->ne[1];
        }
    }
    if (hp.n_vocab > 0 && (int64_t)hp.mask_token_id >= (int64_t)hp.n_vocab) {
        throw Error(keys.where("tokenizer.ggml.mask_token_id") + ": " + std::to_string(hp.mask_token_id) +
                    " is outside the vocabulary (" + std::to_string(hp.n_vocab) + " tokens)");
    }
    if (hp.n_vocab > kMaxVocab) {
        throw Error(path + ": vocabulary of " + std::to_string(hp.n_vocab) + " tokens exceeds " +
                    std::to_string(kMaxVocab));
    }

    const auto expected = expected_tensors(hp);
    for (const auto & ti : info.tensors) {
        auto it = expected.find(ti.name);
        if (it == expected.end()) {
            throw Error(path + ": unexpected tensor '" + ti.name + "' (not part of a DFlash" +
                        (hp.version == 2 ? "2" : "") + " drafter with " + std::to_string(hp.n_layer) + " layers)");
        }
        const Expected & ex = it->second;
        // compare all four ggml dims (trailing ones are 1); kAnyVocab matches any row count
        bool shape_ok = ex.ne.size() <= GGML_MAX_DIMS;
        for (size_t d = 0; shape_ok && d < GGML_MAX_DIMS; ++d) {
            const int64_t want = d < ex.ne.size() ? ex.ne[d] : 1;
            shape_ok = want == kAnyVocab || ti.ne4[d] == want;
        }
        if (!shape_ok) {
            throw Error(path + ": tensor '" + ti.name + "': expected shape (ggml ne) " + shape_str(ex.ne) + ", found " +
                        shape_str(ti.ne));
        }
        if (!type_allowed(ti.type, ex.rule)) {
            throw Error(path + ": tensor '" + ti.name + "': type " + ggml_type_name(ti.type) + " is not allowed" +
                        (ex.rule == TypeRule::F32Only ? " (norms, conv bases and 1-D tensors must be F32)"
                                                      : " (expected F32/F16/BF16 or a Q4_0..Q8_0 / K-quant type)"));
        }
    }
    for (const auto & [name, ex] : expected) {
        if (ex.required && !by_name.count(name)) {
            throw Error(path + ": tensor '" + name + "' is missing (required, expected shape (ggml ne) " +
                        shape_str(ex.ne) + ")");
        }
    }
    info.has_token_embd = by_name.count("token_embd.weight") > 0;
    info.has_output = by_name.count("output.weight") > 0;
    return info;
}

namespace {

// Weights only ever used as a matmul's first operand go to the first extra CPU buffer type that
// takes them (ggml repacks them there into the layout of a faster kernel); the rest stays put.
void place_matmul_weights(DraftModel & m, const std::string & path,
                          const std::vector<ggml_backend_buffer_type_t> & bufts) {
    std::vector<ggml_tensor *> matmul_only = {m.fc, m.output};
    for (const DraftLayer & l : m.layers) {
        for (ggml_tensor * t :
             {l.wq, l.wk, l.wv, l.wo, l.ffn_gate, l.ffn_up, l.ffn_down, l.attn_conv_proj, l.ffn_conv_proj}) {
            matmul_only.push_back(t);
        }
    }
    for (ggml_backend_buffer_type_t buft : bufts) {
        std::vector<ggml_tensor *> picked;
        size_t size = 0;
        for (ggml_tensor * t : matmul_only) {
            if (!t || t->buffer || !mul_mat_runs_from(buft, t)) continue;
            picked.push_back(t);
            size += GGML_PAD(ggml_backend_buft_get_alloc_size(buft, t), ggml_backend_buft_get_alignment(buft));
        }
        if (picked.empty()) continue;
        ggml_backend_buffer_ptr buf(ggml_backend_buft_alloc_buffer(buft, size));
        if (!buf)
            throw Error(path + ": cannot allocate " + std::to_string(size) + " bytes on " +
                        ggml_backend_buft_name(buft));
        ggml_backend_buffer_set_usage(buf.get(), GGML_BACKEND_BUFFER_USAGE_WEIGHTS);
        ggml_tallocr alloc = ggml_tallocr_new(buf.get());
        for (ggml_tensor * t : picked) ggml_tallocr_alloc(&alloc, t);
        m.repacked_weights += picked.size();
        m.extra_buffers.push_back(std::move(buf));
    }
}

}  // namespace

DraftModel load_draft_model(const std::string & path, ggml_backend_buffer_type_t buft,
                            const std::vector<ggml_backend_buffer_type_t> & matmul_bufts) {
    DraftModel m;
    m.info = inspect_draft_file(path);

    gguf_ptr g = open_gguf(path, m.ctx, "the file changed while loading");
    auto get = [&](const std::string & name) { return ggml_get_tensor(m.ctx.get(), name.c_str()); };
    m.fc = get("fc.weight");
    m.hidden_norm = get("enc.output_norm.weight");
    m.output_norm = get("output_norm.weight");
    m.tok_embd = get("token_embd.weight");
    m.output = get("output.weight");
    m.sel_prev = get("selector_predecessor.weight");
    m.sel_next = get("selector_successor.weight");
    m.sel_hidden = get("selector_hidden.weight");
    m.layers.resize(m.hp().n_layer);
    for (uint32_t i = 0; i < m.hp().n_layer; ++i) {
        const std::string p = "blk." + std::to_string(i) + ".";
        DraftLayer & l = m.layers[i];
        l.attn_norm = get(p + "attn_norm.weight");
        l.wq = get(p + "attn_q.weight");
        l.wk = get(p + "attn_k.weight");
        l.wv = get(p + "attn_v.weight");
        l.wo = get(p + "attn_output.weight");
        l.q_norm = get(p + "attn_q_norm.weight");
        l.k_norm = get(p + "attn_k_norm.weight");
        l.ffn_norm = get(p + "ffn_norm.weight");
        l.ffn_gate = get(p + "ffn_gate.weight");
        l.ffn_up = get(p + "ffn_up.weight");
        l.ffn_down = get(p + "ffn_down.weight");
        l.attn_conv_base = get(p + "attn_conv_base");
        l.attn_conv_proj = get(p + "attn_conv_proj.weight");
        l.ffn_conv_base = get(p + "ffn_conv_base");
        l.ffn_conv_proj = get(p + "ffn_conv_proj.weight");
    }
    place_matmul_weights(m, path, matmul_bufts);
    m.buffer.reset(ggml_backend_alloc_ctx_tensors_from_buft(m.ctx.get(), buft));
    if (!m.buffer) {
        throw Error(path + ": cannot allocate " + std::to_string(m.info.file_size) + " bytes of weights on " +
                    ggml_backend_buft_name(buft));
    }
    ggml_backend_buffer_set_usage(m.buffer.get(), GGML_BACKEND_BUFFER_USAGE_WEIGHTS);

    file_ptr f(fopen(path.c_str(), "rb"));
    if (!f) throw Error(path + ": cannot reopen file");
    std::vector<uint8_t> staging;
    const QuietDebugLog quiet;  // a line per repacked weight otherwise
    for (const auto & ti : m.info.tensors) {
        ggml_tensor * t = ggml_get_tensor(m.ctx.get(), ti.name.c_str());
        staging.resize(ti.nbytes);
        if (fseek(f.get(), (long)ti.offset, SEEK_SET) != 0 ||
            fread(staging.data(), 1, ti.nbytes, f.get()) != ti.nbytes) {
            throw Error(path + ": tensor '" + ti.name + "': short read (file truncated while loading?)");
        }
        ggml_backend_tensor_set(t, staging.data(), 0, ti.nbytes);
    }

    return m;
}

}  // namespace dflash
