#include "dflash/drafter.h"

#include <algorithm>
#include <cmath>
#include <numeric>
#include <thread>

#include "dflash/error.h"
#include "ggml-cpu.h"

namespace dflash {

namespace {

constexpr int kGraphSize = 4096;
constexpr uint32_t kInjectChunk = 256;  // rows per inject graph; longer prompts are chunked

ggml_backend_dev_t pick_device(const std::string & want) {
    ggml_backend_load_all();  // no-op when the backends are linked in
    if (want == "auto") {
        if (auto * gpu = ggml_backend_dev_by_type(GGML_BACKEND_DEVICE_TYPE_GPU)) return gpu;
        if (auto * igpu = ggml_backend_dev_by_type(GGML_BACKEND_DEVICE_TYPE_IGPU)) return igpu;
        return ggml_backend_dev_by_type(GGML_BACKEND_DEVICE_TYPE_CPU);
    }
    if (want == "cpu" || want == "CPU") return ggml_backend_dev_by_type(GGML_BACKEND_DEVICE_TYPE_CPU);
    if (auto * d = ggml_backend_dev_by_name(want.c_str())) return d;
    std::string names;
    for (size_t i = 0; i < ggml_backend_dev_count(); ++i) {
        names += (i ? ", " : "") + std::string(ggml_backend_dev_name(ggml_backend_dev_get(i)));
    }
    throw Error("unknown device '" + want + "' (available: auto, cpu, " + names + ")");
}

void set_threads(ggml_backend_t backend, int n_threads) {
    ggml_backend_dev_t dev = ggml_backend_get_device(backend);
    ggml_backend_reg_t reg = dev ? ggml_backend_dev_backend_reg(dev) : nullptr;
    if (!reg) return;
    auto fn = (ggml_backend_set_n_threads_t) ggml_backend_reg_get_proc_address(reg, "ggml_backend_set_n_threads");
    if (fn) fn(backend, n_threads);
}

}  // namespace

struct Drafter::Impl {
    DraftModel model;
    std::unique_ptr<TargetHead> head;
    ggml_tensor * tok_embd = nullptr;  // drafter's own or the target's
    ggml_tensor * output = nullptr;

    ggml_backend_dev_t dev = nullptr;
    ggml_backend_ptr backend;      // the chosen device
    ggml_backend_ptr backend_cpu;  // fallback for ops the device lacks (null when dev is the CPU)
    ggml_backend_sched_ptr sched;

    // draft context cache: K [head_dim, n_head_kv, n_ctx], V [n_ctx, head_dim, n_head_kv] per layer
    ggml_context_ptr cache_ctx;
    ggml_backend_buffer_ptr cache_buf;
    std::vector<ggml_tensor *> cache_k, cache_v;
    uint32_t n_ctx = 0;
    uint32_t n_cached = 0;

    std::vector<uint8_t> graph_meta;  // reused metadata arena for per-call graphs
    DrafterCounters counters;
    size_t reserved_bytes = 0;

    const DraftHparams & hp() const { return model.hp(); }

    ggml_context_ptr new_graph_ctx() {
        ggml_init_params p{graph_meta.size(), graph_meta.data(), /*no_alloc =*/true};
        return ggml_context_ptr(ggml_init(p));
    }

    ggml_tensor * rms_norm(ggml_context * ctx, ggml_tensor * x, ggml_tensor * w) const {
        return ggml_mul(ctx, ggml_rms_norm(ctx, x, hp().rms_eps), w);
    }

    ggml_tensor * rope(ggml_context * ctx, ggml_tensor * x, ggml_tensor * pos) const {
        return ggml_rope_ext(ctx, x, pos, nullptr, (int) hp().n_rot, GGML_ROPE_TYPE_NEOX, (int) hp().n_ctx_train,
                             hp().rope_freq_base, hp().rope_freq_scale, 0.0f, 1.0f, 0.0f, 0.0f);
    }

    // g = hidden_norm(fc(features)); per layer K = rope(k_norm(W_k g)), V = W_v g into cache rows [n0, n0+n)
    ggml_cgraph * build_inject(ggml_context * ctx, uint32_t n0, uint32_t n, ggml_tensor ** inp_feat, ggml_tensor ** inp_pos) {
        ggml_cgraph * gf = ggml_new_graph_custom(ctx, kGraphSize, false);
        ggml_tensor * feat = ggml_new_tensor_2d(ctx, GGML_TYPE_F32, hp().n_target_features(), n);  // [F, n]
        ggml_set_name(feat, "inp_features");
        ggml_set_input(feat);
        ggml_tensor * pos = ggml_new_tensor_1d(ctx, GGML_TYPE_I32, n);
        ggml_set_name(pos, "inp_pos");
        ggml_set_input(pos);
        ggml_tensor * g = rms_norm(ctx, ggml_mul_mat(ctx, model.fc, feat), model.hidden_norm);  // [E, n]
        for (uint32_t il = 0; il < hp().n_layer; ++il) {
            const DraftLayer & l = model.layers[il];
            ggml_tensor * k = ggml_reshape_3d(ctx, ggml_mul_mat(ctx, l.wk, g), hp().head_dim, hp().n_head_kv, n);
            k = rope(ctx, rms_norm(ctx, k, l.k_norm), pos);                                         // [hd, nkv, n]
            ggml_tensor * v = ggml_reshape_3d(ctx, ggml_mul_mat(ctx, l.wv, g), hp().head_dim, hp().n_head_kv, n);
            store_kv(ctx, gf, il, n0, n, k, v);
        }
        *inp_feat = feat;
        *inp_pos = pos;
        return gf;
    }

    void store_kv(ggml_context * ctx, ggml_cgraph * gf, uint32_t il, uint32_t n0, uint32_t n, ggml_tensor * k, ggml_tensor * v) {
        ggml_tensor * kc = cache_k[il];
        ggml_tensor * vc = cache_v[il];
        ggml_tensor * k_dst = ggml_view_3d(ctx, kc, hp().head_dim, hp().n_head_kv, n, kc->nb[1], kc->nb[2], n0 * kc->nb[2]);
        ggml_build_forward_expand(gf, ggml_cpy(ctx, k, k_dst));
        // V is stored token-fastest so that attention can multiply by it without a transpose
        ggml_tensor * v_dst = ggml_view_3d(ctx, vc, n, hp().head_dim, hp().n_head_kv, vc->nb[1], vc->nb[2], n0 * vc->nb[0]);
        ggml_build_forward_expand(gf, ggml_cpy(ctx, ggml_permute(ctx, v, 1, 2, 0, 3), v_dst));
    }

    // DFlash2 block-local two-tap dynamic conv: y'[t] = sum_tap (base[side, tap] + c[t, side, tap, group]) * y[t - tap]
    // The per-group coefficients broadcast over their channels ([1, G, B] against [gs, G, B]) instead of being repeated.
    ggml_tensor * conv(ggml_context * ctx, ggml_tensor * y, ggml_tensor * c, ggml_tensor * base, int side) const {
        const int64_t E = hp().n_embd, B = y->ne[1];
        const int64_t K = hp().conv_kernel, G = hp().n_conv_groups(), gs = hp().conv_group;
        ggml_tensor * c4 = ggml_reshape_4d(ctx, c, G, K, 2, B);  // [group, tap, side, row]
        ggml_tensor * out = nullptr;
        for (int64_t tap = 0; tap < std::min<int64_t>(K, B); ++tap) {
            ggml_tensor * coef = ggml_view_2d(ctx, c4, G, B, c4->nb[3], side * c4->nb[2] + tap * c4->nb[1]);  // [G, B]
            coef = ggml_reshape_3d(ctx, ggml_cont(ctx, coef), 1, G, B);
            ggml_tensor * base_row = ggml_view_1d(ctx, base, E, (size_t) (side * K + tap) * base->nb[1]);
            ggml_tensor * shifted = y;
            if (tap > 0) {
                shifted = ggml_view_2d(ctx, y, E, B - tap, y->nb[1], 0);
                shifted = ggml_pad_ext(ctx, shifted, 0, 0, (int) tap, 0, 0, 0, 0, 0);  // zeros before row 0
            } else if (!ggml_is_contiguous(y)) {
                shifted = ggml_cont(ctx, y);
            }
            ggml_tensor * dyn = ggml_reshape_2d(ctx, ggml_mul(ctx, ggml_reshape_3d(ctx, shifted, gs, G, B), coef), E, B);
            ggml_tensor * term = ggml_add(ctx, dyn, ggml_mul(ctx, shifted, base_row));
            out = out ? ggml_add(ctx, out, term) : term;
        }
        return out;
    }

    struct BlockGraph {
        ggml_cgraph * gf;
        ggml_tensor * tokens, * pos, * anchor, * mask;
        ggml_tensor * logits, * argmax;
        ggml_tensor * cand, * unary, * scores;  // DFlash2
    };

    BlockGraph build_block(ggml_context * ctx, uint32_t n_past, uint32_t B) {
        BlockGraph bg{};
        const DraftHparams & h = hp();
        const uint32_t n_kv = n_past + B;
        bg.gf = ggml_new_graph_custom(ctx, kGraphSize, false);
        ggml_cgraph * gf = bg.gf;
        bg.tokens = ggml_new_tensor_1d(ctx, GGML_TYPE_I32, B);
        ggml_set_name(bg.tokens, "inp_tokens");
        ggml_set_input(bg.tokens);
        bg.pos = ggml_new_tensor_1d(ctx, GGML_TYPE_I32, B);
        ggml_set_name(bg.pos, "inp_pos");
        ggml_set_input(bg.pos);
        if (h.causal) {
            bg.mask = ggml_new_tensor_2d(ctx, GGML_TYPE_F32, n_kv, B);
            ggml_set_name(bg.mask, "inp_mask");
            ggml_set_input(bg.mask);
        }
        const float kq_scale = h.attn_scale != 0.0f ? h.attn_scale : 1.0f / std::sqrt((float) h.head_dim);

        ggml_tensor * x = ggml_get_rows(ctx, tok_embd, bg.tokens);  // [E, B]
        if (h.embedding_scale != 0.0f) x = ggml_scale(ctx, x, h.embedding_scale);

        for (uint32_t il = 0; il < h.n_layer; ++il) {
            const DraftLayer & l = model.layers[il];
            ggml_tensor * hcur = rms_norm(ctx, x, l.attn_norm);
            ggml_tensor * c_attn = nullptr;
            if (h.version == 2) {
                c_attn = ggml_mul_mat(ctx, l.attn_conv_proj, hcur);  // [2*K*G, B]
                hcur = conv(ctx, hcur, c_attn, l.attn_conv_base, 0);
            }
            ggml_tensor * q = ggml_reshape_3d(ctx, ggml_mul_mat(ctx, l.wq, hcur), h.head_dim, h.n_head, B);
            q = rope(ctx, rms_norm(ctx, q, l.q_norm), bg.pos);
            ggml_tensor * k = ggml_reshape_3d(ctx, ggml_mul_mat(ctx, l.wk, hcur), h.head_dim, h.n_head_kv, B);
            k = rope(ctx, rms_norm(ctx, k, l.k_norm), bg.pos);
            ggml_tensor * v = ggml_reshape_3d(ctx, ggml_mul_mat(ctx, l.wv, hcur), h.head_dim, h.n_head_kv, B);
            // block rows go to scratch slots after the context; they are never committed
            store_kv(ctx, gf, il, n_past, B, k, v);

            ggml_tensor * kc = cache_k[il];
            ggml_tensor * vc = cache_v[il];
            ggml_tensor * k_all = ggml_view_3d(ctx, kc, h.head_dim, n_kv, h.n_head_kv, kc->nb[2], kc->nb[1], 0);  // [hd, n_kv, nkv]
            ggml_tensor * v_all = ggml_view_3d(ctx, vc, n_kv, h.head_dim, h.n_head_kv, vc->nb[1], vc->nb[2], 0);  // [n_kv, hd, nkv]
            ggml_tensor * qp = ggml_permute(ctx, q, 0, 2, 1, 3);                                          // [hd, B, nh]
            ggml_tensor * kq = ggml_mul_mat(ctx, k_all, qp);                                              // [n_kv, B, nh]
            ggml_mul_mat_set_prec(kq, GGML_PREC_F32);
            kq = ggml_soft_max_ext(ctx, kq, bg.mask, kq_scale, 0.0f);
            ggml_tensor * kqv = ggml_mul_mat(ctx, v_all, kq);                                             // [hd, B, nh]
            kqv = ggml_cont_2d(ctx, ggml_permute(ctx, kqv, 0, 2, 1, 3), h.n_embd_q(), B);                 // [hd*nh, B]
            ggml_tensor * o = ggml_mul_mat(ctx, l.wo, kqv);                                               // [E, B]
            if (h.attn_value_scale != 0.0f) o = ggml_scale(ctx, o, h.attn_value_scale);
            if (h.version == 2) o = conv(ctx, o, c_attn, l.attn_conv_base, 1);
            x = ggml_add(ctx, x, o);

            hcur = rms_norm(ctx, x, l.ffn_norm);
            ggml_tensor * c_ffn = nullptr;
            if (h.version == 2) {
                c_ffn = ggml_mul_mat(ctx, l.ffn_conv_proj, hcur);
                hcur = conv(ctx, hcur, c_ffn, l.ffn_conv_base, 0);
            }
            ggml_tensor * m = ggml_mul(ctx, ggml_silu(ctx, ggml_mul_mat(ctx, l.ffn_gate, hcur)), ggml_mul_mat(ctx, l.ffn_up, hcur));
            m = ggml_mul_mat(ctx, l.ffn_down, m);
            if (h.version == 2) m = conv(ctx, m, c_ffn, l.ffn_conv_base, 1);
            x = ggml_add(ctx, x, m);
        }

        ggml_tensor * h_final = rms_norm(ctx, x, model.output_norm);  // [E, B]
        ggml_tensor * logits = ggml_mul_mat(ctx, output, h_final);     // [V, B]
        if (h.logit_scale != 0.0f) logits = ggml_scale(ctx, logits, h.logit_scale);
        if (h.logit_softcap > 0.0f) {
            logits = ggml_scale(ctx, ggml_tanh(ctx, ggml_scale(ctx, logits, 1.0f / h.logit_softcap)), h.logit_softcap);
        }
        ggml_set_name(logits, "logits");
        ggml_set_output(logits);
        bg.logits = logits;
        bg.argmax = ggml_argmax(ctx, logits);  // [B]
        ggml_set_output(bg.argmax);
        ggml_build_forward_expand(gf, bg.argmax);

        if (h.version == 2 && B >= 2) {
            const int64_t V = logits->ne[0], k = h.selector_top_k, R = h.selector_rank, rows = B - 1;
            ggml_tensor * lg = ggml_view_2d(ctx, logits, V, rows, logits->nb[1], logits->nb[1]);  // rows 1..B-1
            ggml_tensor * cand = ggml_top_k(ctx, lg, (int) k);                                      // [k, rows] i32
            ggml_tensor * unary = ggml_get_rows(ctx, ggml_reshape_3d(ctx, lg, 1, V, rows), cand);   // [1, k, rows]
            unary = ggml_reshape_3d(ctx, unary, k, 1, rows);
            ggml_tensor * hf = ggml_view_2d(ctx, h_final, h.n_embd, rows, h_final->nb[1], h_final->nb[1]);
            ggml_tensor * gate = ggml_reshape_3d(ctx, ggml_mul_mat(ctx, model.sel_hidden, hf), R, 1, rows);
            ggml_tensor * succ = ggml_reshape_3d(ctx, ggml_get_rows(ctx, model.sel_next, ggml_reshape_1d(ctx, cand, k * rows)), R, k, rows);
            bg.anchor = ggml_new_tensor_1d(ctx, GGML_TYPE_I32, 1);
            ggml_set_name(bg.anchor, "inp_anchor");
            ggml_set_input(bg.anchor);
            ggml_tensor * pred = ggml_repeat_4d(ctx, ggml_get_rows(ctx, model.sel_prev, bg.anchor), R, k, 1, 1);  // row 1
            if (rows > 1) {
                ggml_tensor * prev_ids = ggml_view_1d(ctx, cand, k * (rows - 1), 0);  // candidates of rows 1..B-2
                ggml_tensor * p = ggml_reshape_3d(ctx, ggml_get_rows(ctx, model.sel_prev, prev_ids), R, k, rows - 1);
                pred = ggml_concat(ctx, pred, p, 2);  // [R, k, rows]
            }
            ggml_tensor * cond = ggml_mul(ctx, pred, gate);         // [R, k pred, rows]
            ggml_tensor * scores = ggml_mul_mat(ctx, succ, cond);    // [k succ, k pred, rows]
            scores = ggml_add(ctx, scores, unary);
            for (ggml_tensor * t : {cand, unary, scores}) {
                ggml_set_output(t);
                ggml_build_forward_expand(gf, t);
            }
            bg.cand = cand;
            bg.unary = unary;
            bg.scores = scores;
        }
        return bg;
    }

    void alloc(ggml_cgraph * gf) {
        counters.graphs_built++;
        ggml_backend_sched_reset(sched.get());
        if (!ggml_backend_sched_alloc_graph(sched.get(), gf)) {
            throw Error("draft graph allocation failed on " + std::string(ggml_backend_dev_name(dev)));
        }
        counters.n_splits_last = ggml_backend_sched_get_n_splits(sched.get());
    }

    void run(ggml_cgraph * gf) {
        if (ggml_backend_sched_graph_compute(sched.get(), gf) != GGML_STATUS_SUCCESS) {
            throw Error("draft graph compute failed on " + std::string(ggml_backend_dev_name(dev)));
        }
    }

    size_t compute_buffer_bytes() const {
        size_t total = 0;
        for (ggml_backend_t b : {backend.get(), backend_cpu.get()}) {
            if (b) total += ggml_backend_sched_get_buffer_size(sched.get(), b);
        }
        return total;
    }

    void reserve() {
        // worst cases: a full inject chunk and a block over a full cache
        {
            auto ctx = new_graph_ctx();
            ggml_tensor * f, * p;
            ggml_cgraph * gf = build_inject(ctx.get(), 0, std::min(kInjectChunk, n_ctx), &f, &p);
            if (!ggml_backend_sched_reserve(sched.get(), gf)) throw Error("cannot reserve the inject graph");
        }
        {
            auto ctx = new_graph_ctx();
            BlockGraph bg = build_block(ctx.get(), n_ctx - hp().block_size, hp().block_size);
            if (!ggml_backend_sched_reserve(sched.get(), bg.gf)) throw Error("cannot reserve the block graph");
        }
        reserved_bytes = compute_buffer_bytes();
    }

    void note_reallocs() {
        const size_t now = compute_buffer_bytes();
        if (now > reserved_bytes) {
            counters.sched_reallocs++;
            reserved_bytes = now;
        }
    }
};

Drafter::Drafter(const std::string & draft_path, const std::string & target_path, const DrafterOptions & opts)
    : impl_(std::make_unique<Impl>()) {
    Impl & m = *impl_;
    m.dev = pick_device(opts.device);
    m.backend.reset(ggml_backend_dev_init(m.dev, nullptr));
    if (!m.backend) throw Error(std::string("cannot initialise device ") + ggml_backend_dev_name(m.dev));
    const int n_threads = opts.n_threads > 0 ? opts.n_threads : (int) std::max(1u, std::thread::hardware_concurrency());
    std::vector<ggml_backend_t> backends = {m.backend.get()};
    if (ggml_backend_dev_type(m.dev) != GGML_BACKEND_DEVICE_TYPE_CPU) {
        m.backend_cpu.reset(ggml_backend_init_by_type(GGML_BACKEND_DEVICE_TYPE_CPU, nullptr));
        backends.push_back(m.backend_cpu.get());
        set_threads(m.backend_cpu.get(), n_threads);
    } else {
        set_threads(m.backend.get(), n_threads);
    }

    m.model = load_draft_model(draft_path, ggml_backend_dev_buffer_type(m.dev));
    const DraftHparams & h = m.hp();

    if (m.model.tok_embd && m.model.output) {
        m.tok_embd = m.model.tok_embd;
        m.output = m.model.output;
    }
    if (!target_path.empty()) {
        m.head = load_target_head(target_path, m.dev);
        if (m.head->n_embd != h.target_hidden) {
            throw Error(target_path + ": target hidden size is " + std::to_string(m.head->n_embd) + " but the drafter " +
                        draft_path + " expects target features of width " + std::to_string(h.target_hidden) +
                        " (fc.weight input / number of target layers)");
        }
        if (m.head->n_embd != h.n_embd && !m.tok_embd) {
            throw Error(draft_path + ": drafter hidden size " + std::to_string(h.n_embd) + " differs from the target's " +
                        std::to_string(m.head->n_embd) + ", so it cannot use the target's embedding and LM head");
        }
        if (h.n_vocab != 0 && h.n_vocab != m.head->n_vocab) {
            throw Error(draft_path + ": drafter vocabulary has " + std::to_string(h.n_vocab) + " tokens but the target " +
                        target_path + " has " + std::to_string(m.head->n_vocab));
        }
        const int32_t max_layer = h.target_layers.back();
        if ((uint32_t) max_layer >= m.head->n_layer + 1 || max_layer < 1) {
            throw Error(draft_path + ": dflash.target_layers asks for layer " + std::to_string(max_layer) +
                        " but the target " + target_path + " has " + std::to_string(m.head->n_layer) + " layers");
        }
        if (!m.tok_embd) {
            m.tok_embd = m.head->tok_embd;
            m.output = m.head->output;
        }
        m.model.hp().n_vocab = m.head->n_vocab;
    }
    if (!m.tok_embd) {
        throw Error(draft_path + ": the drafter carries no token embedding / LM head, so a target GGUF is required");
    }
    if (m.model.hp().n_vocab == 0) m.model.hp().n_vocab = (uint32_t) m.output->ne[1];
    if ((uint32_t) h.mask_token_id >= m.model.hp().n_vocab) {
        throw Error(draft_path + ": tokenizer.ggml.mask_token_id " + std::to_string(h.mask_token_id) +
                    " is outside the vocabulary (" + std::to_string(m.model.hp().n_vocab) + ")");
    }

    if (opts.n_ctx < 2 * h.block_size || opts.n_ctx > (1u << 20)) {
        throw Error("n_ctx " + std::to_string(opts.n_ctx) + " is out of range (" + std::to_string(2 * h.block_size) +
                    "..1048576)");
    }
    m.n_ctx = opts.n_ctx;
    {
        ggml_init_params ip{2 * h.n_layer * ggml_tensor_overhead(), nullptr, true};
        m.cache_ctx.reset(ggml_init(ip));
        for (uint32_t il = 0; il < h.n_layer; ++il) {
            m.cache_k.push_back(ggml_new_tensor_3d(m.cache_ctx.get(), GGML_TYPE_F32, h.head_dim, h.n_head_kv, m.n_ctx));
            m.cache_v.push_back(ggml_new_tensor_3d(m.cache_ctx.get(), GGML_TYPE_F32, m.n_ctx, h.head_dim, h.n_head_kv));
        }
        m.cache_buf.reset(ggml_backend_alloc_ctx_tensors_from_buft(m.cache_ctx.get(), ggml_backend_dev_buffer_type(m.dev)));
        if (!m.cache_buf) throw Error("cannot allocate the draft cache (" + std::to_string(m.n_ctx) + " rows)");
        ggml_backend_buffer_clear(m.cache_buf.get(), 0);
    }

    std::vector<ggml_backend_buffer_type_t> bufts;
    for (ggml_backend_t b : backends) bufts.push_back(ggml_backend_get_default_buffer_type(b));
    m.sched.reset(ggml_backend_sched_new(backends.data(), bufts.data(), (int) backends.size(), kGraphSize, false, true));
    m.graph_meta.resize(ggml_tensor_overhead() * kGraphSize + ggml_graph_overhead_custom(kGraphSize, false));
    m.reserve();
}

Drafter::~Drafter() = default;

const DraftHparams & Drafter::hparams() const { return impl_->hp(); }
const DraftFileInfo & Drafter::info() const { return impl_->model.info; }
uint32_t Drafter::n_vocab() const { return impl_->hp().n_vocab; }
uint32_t Drafter::n_ctx() const { return impl_->n_ctx; }
uint32_t Drafter::n_cached() const { return impl_->n_cached; }
std::string Drafter::device_name() const { return ggml_backend_dev_name(impl_->dev); }
bool Drafter::head_zero_copy() const { return impl_->head && impl_->head->zero_copy; }
const DrafterCounters & Drafter::counters() const { return impl_->counters; }

void Drafter::inject(const float * features, const int32_t * positions, uint32_t n) {
    Impl & m = *impl_;
    if (n == 0) return;
    if ((uint64_t) m.n_cached + n + m.hp().block_size > m.n_ctx) {
        throw Error("draft cache full: " + std::to_string(m.n_cached) + " + " + std::to_string(n) +
                    " rows (+ one block) exceed n_ctx = " + std::to_string(m.n_ctx));
    }
    for (uint32_t i = 0; i < n; ++i) {
        if (positions[i] != (int32_t) (m.n_cached + i)) {
            throw Error("inject: position " + std::to_string(positions[i]) + " at row " + std::to_string(i) +
                        " does not continue the draft cache (expected " + std::to_string(m.n_cached + i) + ")");
        }
    }
    const size_t width = m.hp().n_target_features();
    for (uint32_t done = 0; done < n;) {
        const uint32_t chunk = std::min(kInjectChunk, n - done);
        auto ctx = m.new_graph_ctx();
        ggml_tensor * feat, * pos;
        ggml_cgraph * gf = m.build_inject(ctx.get(), m.n_cached, chunk, &feat, &pos);
        m.alloc(gf);
        ggml_backend_tensor_set(feat, features + done * width, 0, chunk * width * sizeof(float));
        ggml_backend_tensor_set(pos, positions + done, 0, chunk * sizeof(int32_t));
        m.run(gf);
        m.note_reallocs();
        m.n_cached += chunk;
        done += chunk;
    }
}

void Drafter::truncate(uint32_t n) {
    if (n > impl_->n_cached) {
        throw Error("truncate: cannot keep " + std::to_string(n) + " rows, the cache holds " +
                    std::to_string(impl_->n_cached));
    }
    impl_->n_cached = n;
}

DraftResult Drafter::draft(int32_t anchor, int32_t position, uint32_t n, bool want_logits) {
    Impl & m = *impl_;
    const DraftHparams & h = m.hp();
    const uint32_t B = h.block_size;
    if (n > B - 1) {
        throw Error("draft: n = " + std::to_string(n) + " exceeds block_size - 1 = " + std::to_string(B - 1));
    }
    if (anchor < 0 || (uint32_t) anchor >= h.n_vocab) {
        throw Error("draft: anchor token " + std::to_string(anchor) + " is outside the vocabulary (" +
                    std::to_string(h.n_vocab) + ")");
    }
    if (position < 0 || (uint64_t) position + B > (uint64_t) INT32_MAX) throw Error("draft: invalid position");
    if (m.n_cached + B > m.n_ctx) throw Error("draft: the draft cache is full (n_ctx = " + std::to_string(m.n_ctx) + ")");

    auto ctx = m.new_graph_ctx();
    Impl::BlockGraph bg = m.build_block(ctx.get(), m.n_cached, B);
    m.alloc(bg.gf);
    std::vector<int32_t> tokens(B, h.mask_token_id), pos(B);
    tokens[0] = anchor;
    std::iota(pos.begin(), pos.end(), position);
    ggml_backend_tensor_set(bg.tokens, tokens.data(), 0, B * sizeof(int32_t));
    ggml_backend_tensor_set(bg.pos, pos.data(), 0, B * sizeof(int32_t));
    if (bg.anchor) ggml_backend_tensor_set(bg.anchor, &anchor, 0, sizeof(int32_t));
    if (bg.mask) {
        const uint32_t n_kv = m.n_cached + B;
        std::vector<float> mask((size_t) n_kv * B, 0.0f);
        for (uint32_t i = 0; i < B; ++i)
            for (uint32_t j = i + 1; j < B; ++j) mask[(size_t) i * n_kv + m.n_cached + j] = -INFINITY;
        ggml_backend_tensor_set(bg.mask, mask.data(), 0, mask.size() * sizeof(float));
    }
    m.run(bg.gf);
    m.note_reallocs();

    DraftResult r;
    r.block_size = B;
    r.argmax.resize(B);
    ggml_backend_tensor_get(bg.argmax, r.argmax.data(), 0, B * sizeof(int32_t));
    if (want_logits) {
        r.logits.resize((size_t) B * h.n_vocab);
        ggml_backend_tensor_get(bg.logits, r.logits.data(), 0, r.logits.size() * sizeof(float));
    }
    if (h.version == 1) {
        r.tokens.assign(r.argmax.begin() + 1, r.argmax.begin() + 1 + n);
        return r;
    }

    // DFlash2: canonical candidate order (logit descending), then the greedy walk
    const uint32_t k = h.selector_top_k, rows = B - 1;
    r.top_k = k;
    std::vector<int32_t> cand((size_t) k * rows);
    std::vector<float> unary((size_t) k * rows), raw((size_t) k * k * rows);
    ggml_backend_tensor_get(bg.cand, cand.data(), 0, cand.size() * sizeof(int32_t));
    ggml_backend_tensor_get(bg.unary, unary.data(), 0, unary.size() * sizeof(float));
    ggml_backend_tensor_get(bg.scores, raw.data(), 0, raw.size() * sizeof(float));

    std::vector<uint32_t> perm((size_t) k * rows);  // perm[t][j] = raw index of sorted candidate j
    for (uint32_t t = 0; t < rows; ++t) {
        uint32_t * p = &perm[(size_t) t * k];
        std::iota(p, p + k, 0u);
        const float * u = &unary[(size_t) t * k];
        const int32_t * c = &cand[(size_t) t * k];
        std::sort(p, p + k, [&](uint32_t a, uint32_t b) { return u[a] != u[b] ? u[a] > u[b] : c[a] < c[b]; });
    }
    r.candidates.resize(cand.size());
    r.scores.resize(raw.size());
    for (uint32_t t = 0; t < rows; ++t) {
        for (uint32_t j = 0; j < k; ++j) r.candidates[(size_t) t * k + j] = cand[(size_t) t * k + perm[(size_t) t * k + j]];
        for (uint32_t i = 0; i < k; ++i) {
            const uint32_t raw_pred = t == 0 ? i : perm[(size_t) (t - 1) * k + i];
            for (uint32_t j = 0; j < k; ++j) {
                r.scores[((size_t) t * k + i) * k + j] = raw[((size_t) t * k + raw_pred) * k + perm[(size_t) t * k + j]];
            }
        }
    }
    r.walk_q.resize((size_t) k * rows);
    r.walk_index.resize(rows);
    uint32_t pred = 0;  // row 1: every predecessor row is the anchor
    for (uint32_t t = 0; t < rows; ++t) {
        const float * s = &r.scores[((size_t) t * k + pred) * k];
        uint32_t best = 0;
        for (uint32_t j = 1; j < k; ++j) if (s[j] > s[best]) best = j;
        float * q = &r.walk_q[(size_t) t * k];
        double z = 0.0;
        for (uint32_t j = 0; j < k; ++j) z += std::exp((double) s[j] - s[best]);
        for (uint32_t j = 0; j < k; ++j) q[j] = (float) (std::exp((double) s[j] - s[best]) / z);
        r.walk_index[t] = (int32_t) best;
        pred = best;
    }
    for (uint32_t t = 0; t < n; ++t) r.tokens.push_back(r.candidates[(size_t) t * k + r.walk_index[t]]);
    return r;
}

}  // namespace dflash
