#include "dflash/drafter.h"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdlib>
#include <initializer_list>
#include <map>
#include <numeric>
#include <set>

#include "dflash/cpu_threads.h"
#include "dflash/error.h"
#include "ggml-cpu.h"
#include "node_dump.h"
#include "op_profile.h"
#include "packed_tensors.h"
#include "cpu_conv.h"
#include "cpu_repack.h"
#include "thread_pick.h"

namespace dflash {

namespace {

constexpr int kGraphSize = 4096;
constexpr uint32_t kInjectChunk = 256;  // rows per inject graph; longer prompts are chunked
// A sliding-window layer reads only its last swa_window positions' rows, so where the cache is longer its
// rows are a ring of swa_window + block_size + kRingSlack rows (rounded up to 64): position p in row
// p % ring. The slack keeps a rollback of up to about that many rows (a conversation's next turn or a
// regenerated reply reusing a cached prefix) from costing the window any of its rows; and an injection
// chunk fits in it, so no graph writes one ring row twice.
constexpr uint32_t kRingSlack = 256;
static_assert(kRingSlack >= kInjectChunk);
// Granularity of the block's attention window (cache rows). A window change rebuilds and re-plans every
// block graph in use (about 1 ms on a CPU for the bundled drafter), while an attended row costs little
// next to the block rows' matmuls (128 extra rows: ~2% of a tinycode draft step), so windows are wide; a GPU,
// which replays an unchanged graph as a device graph, even more so.
constexpr uint32_t kWindowGpu = 256;
constexpr uint32_t kWindowCpu = 128;
// Off the CPU a short block's rows are padded up to one of these (capped at the block size), so that few
// graphs (and device graphs) cover every draft length: a padding row costs a GPU next to nothing. A CPU is
// compute-bound and pays for every row (at Qwen3-1.7B width on an EPYC Zen 2 a draft of 4 costs 40 ms as 5
// rows, 50 ms padded to 6), except that ggml's repacked kernels take rows 4 at a time and the rest one by
// one: there rows left over after multiples of 4 from `cpu_pad_from` on are padded (on a Xeon with AMX a
// 1.7B-shaped drafter's layers cost about as much for 4 rows as for 2, and 40% more for 3).
constexpr uint32_t kShortBlockRows[] = {2, 3, 4, 6, 8, 12, 16, 24};
uint32_t short_block_rows(uint32_t needed, uint32_t block_size, bool on_cpu, uint32_t cpu_pad_from) {
    if (on_cpu) return std::min(needed % 4 >= cpu_pad_from ? (needed + 3) / 4 * 4 : needed, block_size);
    for (uint32_t r : kShortBlockRows) {
        if (r >= needed) return std::min(r, block_size);
    }
    return block_size;
}
// Block graph shapes kept at once: every short block's of the drafter's block size and one more (a full
// block), so that a loop or a bench going through every draft length builds each shape once; beyond that
// the least recently used goes. Each holds compute buffers reserved for a window of the whole cache (e.g.
// ~70 MB of attention scores for 16 rows x 32 heads over 32k rows; the smaller shapes less).
size_t max_block_shapes(uint32_t block_size, bool on_cpu) {
    if (on_cpu) return block_size;  // a shape per draft length (its head rows: the drafted ones) and the full block
    std::set<uint32_t> rows;
    for (uint32_t n = 1; n < block_size; ++n) rows.insert(short_block_rows(n + 1, block_size, false, 4));
    return rows.size() + 1;
}

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

// the CPU backend's thread setter, looked up once; set() touches the backend only when the count changes
// (the draft step and the injections may want different counts)
class CpuThreads {
public:
    void bind(ggml_backend_t backend) {
        backend_ = backend;
        ggml_backend_dev_t dev = ggml_backend_get_device(backend);
        ggml_backend_reg_t reg = dev ? ggml_backend_dev_backend_reg(dev) : nullptr;
        fn_ = reg ? (ggml_backend_set_n_threads_t)ggml_backend_reg_get_proc_address(reg, "ggml_backend_set_n_threads")
                  : nullptr;
        now_ = 0;
    }
    void set(int n) {
        if (fn_ && n != now_) fn_(backend_, n);
        now_ = n;
    }

private:
    ggml_backend_t backend_ = nullptr;
    ggml_backend_set_n_threads_t fn_ = nullptr;
    int now_ = 0;
};

}  // namespace

struct Drafter::Impl {
    // the weights, held once by every drafter share() made from the one that loaded them
    std::shared_ptr<DraftModel> model;
    std::shared_ptr<TargetHead> head;
    ggml_tensor * tok_embd = nullptr;         // drafter's own or the target's
    ggml_tensor * full_output = nullptr;      // the LM head: drafter's own or the target's
    ggml_tensor * output = nullptr;           // full_output, or the drafting vocabulary's rows of it
    std::shared_ptr<const DraftVocab> vocab;  // null: drafts range over the whole vocabulary
    std::vector<float> subset_logits;         // scratch: a step's logits over the drafting vocabulary's rows
    // With the head in a repacked CPU layout, head rows left over after multiples of 4 (n % 4) from this
    // many on are padded to the next multiple of 4 (timed_pad_rows_from; 4: never)
    uint32_t head_pad_from = 4;
    // the same for the block's rows through the layers, timed on the first layer's repacked matmul weights
    uint32_t block_pad_from = 4;

    ggml_backend_dev_t dev = nullptr;
    ggml_backend_ptr backend;      // the chosen device
    ggml_backend_ptr backend_cpu;  // fallback for ops the device lacks (null when dev is the CPU)
    // The inject graph's scheduler; every block graph shape has its own (BlockVariant), so that neither a
    // long injection nor another draft length evicts a block graph's allocation.
    ggml_backend_sched_ptr sched_inject;
    std::vector<ggml_backend_t> backends;  // the device, then the CPU fallback when the device is not the CPU
    // DFlash2's convs as one CPU op each (cpu_conv.h); DFLASH_PORTABLE_GRAPH=1 builds the graph every
    // backend runs instead (the CPU op's twin, for comparing the two)
    bool cpu_conv_op = false;

    // draft context cache per layer: K [head_dim, n_head_kv, rows + 1], V transposed [rows + 1, head_dim,
    // n_head_kv], rows = layer_rows(il); row `rows` is a scratch row that padded writes go to and that no
    // attention window reaches
    ggml_context_ptr cache_ctx;
    ggml_backend_buffer_ptr cache_buf;
    std::vector<ggml_tensor *> cache_k, cache_v;
    uint32_t n_ctx = 0;
    uint32_t n_cached = 0;  // rows whose K/V are in the cache
    // the sliding-window layers' ring rows (0: no rings, every layer holds n_ctx rows); a write of position p
    // takes the row of p - ring, so positions from ring_from on are those the rings still hold
    uint32_t ring = 0;
    uint32_t ring_from = 0;
    bool in_ring(uint32_t il) const { return ring != 0 && hp().is_swa(il); }
    // the first position a sliding layer's window reaches from a block at n
    uint32_t window_from(uint32_t n) const { return n > hp().swa_window ? n - hp().swa_window : 0; }
    uint32_t layer_rows(uint32_t il) const { return in_ring(il) ? ring : n_ctx; }
    bool any_full_layer() const {
        for (uint32_t il = 0; il < hp().n_layer; ++il) {
            if (!in_ring(il)) return true;
        }
        return false;
    }
    void ring_written(uint64_t end) {  // positions up to `end` were written
        if (ring != 0 && end > ring) ring_from = (uint32_t)std::max<uint64_t>(ring_from, end - ring);
        if (rings_mark != 0 && n_cached >= rings_mark) keep_rings();
    }
    // Copies of the ring layers' K/V (host memory) holding positions [from, end), taken once the rows before
    // rings_mark (a prompt's end) were written: a rollback to one of the last prompts after a reply longer
    // than the rings' slack (a regenerated reply, a template that re-renders the last reply, an edited
    // earlier turn) gets their windows back. As many as the target keeps prompt checkpoints.
    struct RingsCopy {
        uint32_t from = 0, end = 0;
        std::vector<std::vector<uint8_t>> k, v;
    };
    static constexpr size_t kMaxRingsCopies = 3;
    std::vector<RingsCopy> rings_copies;  // oldest first
    uint32_t rings_mark = 0;              // 0: no copy due
    void keep_rings();
    void restore_rings(uint32_t n);        // after a truncation to n rows
    uint32_t ring_held(uint32_t n) const;  // the last positions before n a ring layer holds
    // layer il's K/V of positions [lo, hi) in save_cache's order, as (tensor, byte offset, bytes) runs
    template <typename F>
    void each_run(uint32_t il, uint32_t lo, uint32_t hi, F && copy) const;

    // context rows accepted but not yet written: the next draft step writes them in its own graph
    std::vector<float> pending;
    uint32_t n_pending = 0;

    // one built block graph and its input/output tensors
    struct BlockGraph {
        ggml_cgraph * gf = nullptr;
        uint32_t window = 0;     // attended cache rows; 0 = not built
        uint32_t swa_first = 0;  // the sliding-window layers attend to rows [swa_first, window) only
        ggml_tensor * ctx_feat;  // pending context rows, padded to the block's rows (scratch row)
        // per K/V row, the block's rows then the pending context rows: position, cache row, V elements.
        // Block first so that pos, the block's part of kv_pos, starts at offset 0: ggml-vulkan's ROPE reads
        // positions from a view's start aligned down to the device's storage alignment (a view 8 bytes in
        // rotated the block by the pending rows' positions); the rows and V elements of the layers holding
        // every row, and of the ring layers (each null where no layer is of that kind)
        ggml_tensor *kv_pos, *kv_idx, *kv_vidx, *ring_idx, *ring_vidx;
        ggml_tensor *tokens, *pos, *anchor;
        // the attention masks the layers use, by [causal][sliding window]: [window, B], a sliding layer's
        // [window - swa_first, B] or, with rings, [min(window, ring), B]; null where no layer uses one
        ggml_tensor * mask[2][2];
        ggml_tensor *logits, *argmax;
        ggml_tensor *cand, *unary, *scores;  // DFlash2
    };
    // One block graph shape (block rows, head rows) with its own scheduler, metadata arena and transfer
    // buffers: built and allocated once per attention window, so a draft step is set inputs, compute,
    // read back even when the loop alternates draft lengths (and CUDA keeps one device graph per shape).
    struct BlockVariant {
        ggml_backend_sched_ptr sched;
        size_t reserved_bytes = 0;  // its compute buffers after the worst-case (whole cache) reservation
        std::vector<uint8_t> meta;
        ggml_context_ptr ctx;
        BlockGraph bg;
        Packed in, out;                  // the inputs and the small outputs, each moved in one transfer
        ThreadPick * threads = nullptr;  // its shape's entry in thread_picks
        uint64_t last_use = 0;
    };
    std::map<uint32_t, std::unique_ptr<BlockVariant>> variants;
    size_t max_shapes = 0;  // max_block_shapes(block size, on the CPU)
    // per shape, its CPU threads (what pays depends on the graph's size), kept when the shape's graph is
    // evicted: a rebuilt shape timing its steps again would run half of them with the wrong count
    std::map<uint32_t, ThreadPick> thread_picks;
    uint64_t shape_uses = 0;  // the clock of BlockVariant::last_use
    // metadata arena of one graph (tensors + graph), for the inject graph and each block graph
    static size_t meta_bytes() {
        return ggml_tensor_overhead() * kGraphSize + ggml_graph_overhead_custom(kGraphSize, false);
    }
    std::vector<uint8_t> inject_meta = std::vector<uint8_t>(meta_bytes());
    DrafterCounters counters;
    size_t inject_reserved = 0;
    DrafterOptions opts;     // what share() opens its drafter with
    int n_threads = 1;       // CPU threads of injections; block graphs pick theirs (BlockVariant::threads)
    CpuThreads cpu_threads;  // the CPU backend's: the device when it is the CPU, else the fallback
    bool on_cpu() const { return ggml_backend_dev_type(dev) == GGML_BACKEND_DEVICE_TYPE_CPU; }

    const DraftHparams & hp() const { return model->hp(); }

    static ggml_context_ptr new_ctx(std::vector<uint8_t> & meta) {
        ggml_init_params p{meta.size(), meta.data(), /*no_alloc =*/true};
        return ggml_context_ptr(ggml_init(p));
    }

    static ggml_tensor * input(ggml_context * ctx, ggml_type type, int64_t n0, int64_t n1, const char * name) {
        ggml_tensor * t = n1 > 0 ? ggml_new_tensor_2d(ctx, type, n0, n1) : ggml_new_tensor_1d(ctx, type, n0);
        ggml_set_name(t, name);
        ggml_set_input(t);
        return t;
    }

    ggml_tensor * rms_norm(ggml_context * ctx, ggml_tensor * x, ggml_tensor * w) const {
        return ggml_mul(ctx, ggml_rms_norm(ctx, x, hp().rms_eps), w);
    }

    ggml_tensor * activation(ggml_context * ctx, ggml_tensor * x) const {
        switch (hp().hidden_act) {
            case DraftHparams::Activation::gelu_tanh: {
                // 0.5 x (1 + tanh(z)) = x sigmoid(2z), z = sqrt(2/pi) (x + 0.044715 x^3), in f32 ops: ggml_gelu
                // on the CPU reads a table indexed by x rounded to f16
                const float c = 2.0f * std::sqrt(2.0f / (float)M_PI);
                ggml_tensor * z = ggml_mul(ctx, x, ggml_scale_bias(ctx, ggml_sqr(ctx, x), c * 0.044715f, c));
                return ggml_mul(ctx, x, ggml_sigmoid(ctx, z));
            }
            case DraftHparams::Activation::gelu_erf:
                return ggml_gelu_erf(ctx, x);
            case DraftHparams::Activation::silu:
                break;
        }
        return ggml_silu(ctx, x);
    }

    ggml_tensor * rope(ggml_context * ctx, ggml_tensor * x, ggml_tensor * pos) const {
        return ggml_rope_ext(ctx, x, pos, nullptr, (int)hp().n_rot, GGML_ROPE_TYPE_NEOX, (int)hp().n_ctx_train,
                             hp().rope_freq_base, hp().rope_freq_scale, 0.0f, 1.0f, 0.0f, 0.0f);
    }

    // per layer K = rope(k_norm(W_k h)) and V = W_v h of n rows, written to cache rows idx[0..n);
    // V is stored transposed (token-fastest) so that attention multiplies by it directly: its elements go
    // one by one to vidx (element e of row r to e * (n_ctx + 1) + idx[r]), computed on the host
    void store_kv(ggml_context * ctx, ggml_cgraph * gf, uint32_t il, ggml_tensor * h, ggml_tensor * pos,
                  ggml_tensor * idx, ggml_tensor * vidx) {
        const DraftLayer & l = model->layers[il];
        const int64_t n = h->ne[1], width = kv_width(), rows = layer_rows(il);
        ggml_tensor * k = ggml_reshape_3d(ctx, ggml_mul_mat(ctx, l.wk, h), hp().head_dim, hp().n_head_kv, n);
        k = rope(ctx, rms_norm(ctx, k, l.k_norm), pos);
        ggml_tensor * v = ggml_mul_mat(ctx, l.wv, h);
        ggml_tensor * kc = ggml_reshape_2d(ctx, cache_k[il], width, rows + 1);
        ggml_tensor * vc = ggml_reshape_2d(ctx, cache_v[il], 1, width * (rows + 1));
        ggml_build_forward_expand(gf, ggml_set_rows(ctx, kc, ggml_reshape_2d(ctx, k, width, n), idx));
        ggml_build_forward_expand(gf, ggml_set_rows(ctx, vc, ggml_reshape_2d(ctx, v, 1, width * n), vidx));
    }

    int64_t kv_width() const { return (int64_t)hp().head_dim * hp().n_head_kv; }

    // store_kv's inputs for n rows going to cache rows rows[0..n) (n_ctx: the scratch row): for the layers
    // holding every row idx = rows, vidx[r][e] = e * (n_ctx + 1) + rows[r]; for the ring layers the same with
    // ring rows (row % ring, the scratch row `ring`). A null pair is skipped (no layer of that kind).
    void fill_rows(int64_t * idx, int64_t * vidx, int64_t * ring_idx, int64_t * ring_vidx, const int64_t * rows,
                   size_t n) const {
        const int64_t width = kv_width();
        for (size_t r = 0; r < n; ++r) {
            if (idx) {
                idx[r] = rows[r];
                for (int64_t e = 0; e < width; ++e) vidx[r * width + e] = e * (n_ctx + 1) + rows[r];
            }
            if (ring_idx) {
                const int64_t row = rows[r] == n_ctx ? ring : rows[r] % ring;
                ring_idx[r] = row;
                for (int64_t e = 0; e < width; ++e) ring_vidx[r * width + e] = e * (ring + 1) + row;
            }
        }
    }

    // context rows: g = hidden_norm(fc(features)) [E, n], whose K/V each layer stores
    ggml_tensor * context_rows(ggml_context * ctx, ggml_tensor * feat) const {
        return rms_norm(ctx, ggml_mul_mat(ctx, model->fc, feat), model->hidden_norm);
    }

    struct InjectGraph {
        ggml_cgraph * gf;
        ggml_tensor *feat, *pos, *idx, *vidx, *ring_idx, *ring_vidx;  // as BlockGraph's
    };

    // store_kv's row inputs of n rows (null where no layer is of the kind)
    void row_inputs(ggml_context * ctx, int64_t n, ggml_tensor ** idx, ggml_tensor ** vidx, ggml_tensor ** ring_idx,
                    ggml_tensor ** ring_vidx) const {
        *idx = *vidx = *ring_idx = *ring_vidx = nullptr;
        if (any_full_layer()) {
            *idx = input(ctx, GGML_TYPE_I64, n, 0, "inp_kv_rows");
            *vidx = input(ctx, GGML_TYPE_I64, kv_width() * n, 0, "inp_kv_v_elems");
        }
        if (ring != 0) {
            *ring_idx = input(ctx, GGML_TYPE_I64, n, 0, "inp_ring_rows");
            *ring_vidx = input(ctx, GGML_TYPE_I64, kv_width() * n, 0, "inp_ring_v_elems");
        }
    }

    InjectGraph build_inject(ggml_context * ctx, uint32_t n) {
        InjectGraph ig{};
        ig.gf = ggml_new_graph_custom(ctx, kGraphSize, false);
        ig.feat = input(ctx, GGML_TYPE_F32, hp().n_target_features(), n, "inp_features");
        ig.pos = input(ctx, GGML_TYPE_I32, n, 0, "inp_pos");
        row_inputs(ctx, n, &ig.idx, &ig.vidx, &ig.ring_idx, &ig.ring_vidx);
        ggml_tensor * g = context_rows(ctx, ig.feat);
        for (uint32_t il = 0; il < hp().n_layer; ++il) {
            const bool r = in_ring(il);
            store_kv(ctx, ig.gf, il, g, ig.pos, r ? ig.ring_idx : ig.idx, r ? ig.ring_vidx : ig.vidx);
        }
        return ig;
    }

    // DFlash2 dynamic conv coefficients of one conv module for every block row:
    // coef[:, tap, side, t] = base[:, tap, side] + c[t, side, tap, group(channel)].
    struct ConvCoef {
        ggml_tensor * c;     // the projection's output [2 K G, B]
        ggml_tensor * base;  // [E, K, 2]
        ggml_tensor * coef;  // the portable graph's: as [E, K, 2, B]; null where cpu_dynamic_conv forms them
    };
    // The portable graph spreads the group values over their channels once here, so the convs below are
    // plain products: the base is repeated over the rows (whole rows copied) and the add broadcasts c over
    // each group's channels on all threads (repeating c itself, ggml-cpu copies one float at a time on one
    // thread while the others wait, which slows the bundled drafter's drafts).
    ConvCoef conv_coef(ggml_context * ctx, ggml_tensor * h, ggml_tensor * proj, ggml_tensor * base) const {
        const int64_t E = hp().n_embd, B = h->ne[1], K = hp().conv_kernel, G = hp().n_conv_groups();
        ggml_tensor * c = ggml_mul_mat(ctx, proj, h);
        if (cpu_conv_op) return {c, base, nullptr};
        ggml_tensor * base_rows = ggml_repeat_4d(ctx, ggml_reshape_2d(ctx, base, E * 2 * K, 1), E * 2 * K, B, 1, 1);
        ggml_tensor * coef = ggml_add(ctx, ggml_reshape_4d(ctx, base_rows, hp().conv_group, G, 2 * K, B),
                                      ggml_reshape_4d(ctx, c, 1, G, 2 * K, B));  // c as [1, G, (tap, side), B]
        return {c, base, ggml_reshape_4d(ctx, coef, E, K, 2, B)};
    }

    // y'[t] = sum_tap coef[:, tap, side, t] * y[t - tap], block-local (rows before 0 are zero)
    ggml_tensor * conv(ggml_context * ctx, ggml_tensor * y, const ConvCoef & cc, int side) const {
        static const int kSide[2] = {0, 1};  // cpu_dynamic_conv's argument, alive for every graph
        if (!cc.coef)
            return ggml_map_custom3(ctx, y, cc.c, cc.base, cpu_dynamic_conv, GGML_N_TASKS_MAX, (void *)&kSide[side]);
        ggml_tensor * coef = cc.coef;
        const int64_t E = hp().n_embd, B = y->ne[1], K = hp().conv_kernel;
        auto coef_rows = [&](int64_t tap, int64_t t0) {
            return ggml_view_2d(ctx, coef, E, B - t0, coef->nb[3],
                                side * coef->nb[2] + tap * coef->nb[1] + t0 * coef->nb[3]);
        };
        ggml_tensor * out = ggml_mul(ctx, y, coef_rows(0, 0));
        for (int64_t tap = 1; tap < std::min<int64_t>(K, B); ++tap) {
            ggml_tensor * earlier = ggml_view_2d(ctx, y, E, B - tap, y->nb[1], 0);  // y[t - tap] for t >= tap
            ggml_tensor * term = ggml_mul(ctx, earlier, coef_rows(tap, tap));
            out = ggml_acc_inplace(ctx, out, term, out->nb[1], out->nb[2], out->nb[3], tap * out->nb[1]);
        }
        return out;
    }

    // The block [anchor, MASK x n_rows-1] at positions n.. attends to cache rows [0, window) (a sliding layer:
    // [swa_first, window)) through a mask (the context, the block itself, never the stale rows after it);
    // each layer writes the rows still pending with the block's K/V before it attends.
    void build_block(BlockVariant & v, uint32_t window, uint32_t swa_first, uint32_t n_rows, uint32_t head_first,
                     uint32_t head_rows) {
        const DraftHparams & h = hp();
        const uint32_t B = n_rows;
        v.meta.resize(meta_bytes());
        v.ctx = new_ctx(v.meta);
        ggml_context * ctx = v.ctx.get();
        BlockGraph & bg = v.bg;
        bg = BlockGraph{};
        bg.window = window;
        bg.swa_first = swa_first;
        bg.gf = ggml_new_graph_custom(ctx, kGraphSize, false);
        ggml_cgraph * gf = bg.gf;
        const uint32_t P = n_rows;  // pending context rows: at most as many as the block's (else flushed first)
        bg.ctx_feat = input(ctx, GGML_TYPE_F32, h.n_target_features(), P, "inp_ctx_features");
        bg.kv_pos = input(ctx, GGML_TYPE_I32, P + B, 0, "inp_kv_pos");
        row_inputs(ctx, P + B, &bg.kv_idx, &bg.kv_vidx, &bg.ring_idx, &bg.ring_vidx);
        bg.pos = ggml_view_1d(ctx, bg.kv_pos, B, 0);
        bg.tokens = input(ctx, GGML_TYPE_I32, B, 0, "inp_tokens");
        for (uint32_t il = 0; il < h.n_layer; ++il) {
            static const char * names[2][2] = {{"inp_mask", "inp_mask_swa"},
                                               {"inp_mask_causal", "inp_mask_causal_swa"}};
            const bool causal = h.is_causal(il), swa = h.is_swa(il);
            if (!bg.mask[causal][swa]) {
                bg.mask[causal][swa] =
                    input(ctx, GGML_TYPE_F16, attended(il, window, swa_first), B, names[causal][swa]);
            }
        }
        const float kq_scale = h.attn_scale != 0.0f ? h.attn_scale : 1.0f / std::sqrt((float)h.head_dim);

        ggml_tensor * ctx_rows = context_rows(ctx, bg.ctx_feat);

        ggml_tensor * x = ggml_get_rows(ctx, tok_embd, bg.tokens);  // [E, B]
        if (h.embedding_scale != 0.0f) x = ggml_scale(ctx, x, h.embedding_scale);

        for (uint32_t il = 0; il < h.n_layer; ++il) {
            const DraftLayer & l = model->layers[il];
            ggml_tensor * hcur = rms_norm(ctx, x, l.attn_norm);
            ConvCoef c_attn{};
            if (h.version == 2) {
                c_attn = conv_coef(ctx, hcur, l.attn_conv_proj, l.attn_conv_base);
                hcur = conv(ctx, hcur, c_attn, 0);
            }
            ggml_tensor * q = ggml_reshape_3d(ctx, ggml_mul_mat(ctx, l.wq, hcur), h.head_dim, h.n_head, B);
            q = rope(ctx, rms_norm(ctx, q, l.q_norm), bg.pos);
            // the block rows' K/V (to scratch rows after the context) and the pending context rows' in one
            // pass: half the small ops, which cost more in dispatch than in arithmetic here
            const bool r = in_ring(il);
            store_kv(ctx, gf, il, ggml_concat(ctx, hcur, ctx_rows, 1), bg.kv_pos, r ? bg.ring_idx : bg.kv_idx,
                     r ? bg.ring_vidx : bg.kv_vidx);

            ggml_tensor * kc = cache_k[il];
            ggml_tensor * vc = cache_v[il];
            const uint32_t first = h.is_swa(il) && !r ? swa_first : 0, n_keys = attended(il, window, swa_first);
            ggml_tensor * k_win = ggml_view_3d(ctx, kc, h.head_dim, n_keys, h.n_head_kv, kc->nb[2], kc->nb[1],
                                               first * kc->nb[2]);  // [hd, W, nkv]
            ggml_tensor * v_win = ggml_view_3d(ctx, vc, n_keys, h.head_dim, h.n_head_kv, vc->nb[1], vc->nb[2],
                                               first * vc->nb[0]);  // [W, hd, nkv]
            // GQA: the rep query heads that share a KV head (h = kv * rep + r) go through its keys and values in
            // one matmul, so each cached row is read once, not once per query head (at a long context the
            // attention is most of a draft step, and memory-bound)
            const int64_t hd = h.head_dim, nkv = h.n_head_kv, rep = h.n_head / h.n_head_kv;
            ggml_tensor * qg = ggml_cont(ctx, ggml_permute(ctx, ggml_reshape_4d(ctx, q, hd, rep, nkv, B), 0, 2, 3, 1));
            ggml_tensor * kq = ggml_mul_mat(ctx, k_win, ggml_reshape_3d(ctx, qg, hd, B * rep, nkv));  // [W, B*rep, nkv]
            ggml_prec_set_acc(kq, GGML_PREC_F32);
            // the mask [W, B] applies to every head alike
            kq = ggml_soft_max_ext(ctx, ggml_reshape_4d(ctx, kq, n_keys, B, rep, nkv),
                                   bg.mask[h.is_causal(il)][h.is_swa(il)], kq_scale, 0.0f);
            ggml_tensor * kqv = ggml_mul_mat(ctx, v_win, ggml_reshape_3d(ctx, kq, n_keys, B * rep, nkv));
            ggml_tensor * att =
                ggml_cont_2d(ctx, ggml_permute(ctx, ggml_reshape_4d(ctx, kqv, hd, B, rep, nkv), 0, 3, 1, 2),
                             h.n_embd_q(), B);               // [hd*nh, B]
            ggml_tensor * o = ggml_mul_mat(ctx, l.wo, att);  // [E, B]
            if (h.attn_value_scale != 0.0f) o = ggml_scale(ctx, o, h.attn_value_scale);
            if (h.version == 2) o = conv(ctx, o, c_attn, 1);
            x = ggml_add(ctx, x, o);

            hcur = rms_norm(ctx, x, l.ffn_norm);
            ConvCoef c_ffn{};
            if (h.version == 2) {
                c_ffn = conv_coef(ctx, hcur, l.ffn_conv_proj, l.ffn_conv_base);
                hcur = conv(ctx, hcur, c_ffn, 0);
            }
            ggml_tensor * m =
                ggml_mul(ctx, activation(ctx, ggml_mul_mat(ctx, l.ffn_gate, hcur)), ggml_mul_mat(ctx, l.ffn_up, hcur));
            m = ggml_mul_mat(ctx, l.ffn_down, m);
            if (h.version == 2) m = conv(ctx, m, c_ffn, 1);
            x = ggml_add(ctx, x, m);
        }

        // the LM head (the costliest matmul at a real vocabulary) only for the rows asked for
        ggml_tensor * h_final = rms_norm(ctx, x, model->output_norm);  // [E, B]
        ggml_tensor * h_head =
            ggml_view_2d(ctx, h_final, h.n_embd, head_rows, h_final->nb[1], head_first * h_final->nb[1]);
        const bool pad_rows = head_rows % 4 >= head_pad_from;
        if (pad_rows) h_head = ggml_pad(ctx, h_head, 0, 4 - head_rows % 4, 0, 0);
        ggml_tensor * logits = ggml_mul_mat(ctx, output, h_head);  // [V, head_rows (+ padding)]
        if (h.logit_scale != 0.0f) logits = ggml_scale(ctx, logits, h.logit_scale);
        if (h.logit_softcap > 0.0f) {
            logits = ggml_scale(ctx, ggml_tanh(ctx, ggml_scale(ctx, logits, 1.0f / h.logit_softcap)), h.logit_softcap);
        }
        if (pad_rows) {
            ggml_set_output(logits);  // keeps the allocator from reusing what the view below reads
            logits = ggml_view_2d(ctx, logits, logits->ne[0], head_rows, logits->nb[1], 0);
        }
        ggml_set_name(logits, "logits");
        ggml_set_output(logits);
        bg.logits = logits;
        bg.argmax = ggml_argmax(ctx, logits);  // [head_rows]
        ggml_set_output(bg.argmax);
        ggml_build_forward_expand(gf, bg.argmax);

        const int64_t rows = head_first + head_rows - 1;  // the selector's rows: 1..rows
        if (h.version == 2 && rows >= 1) {
            const int64_t V = logits->ne[0], k = h.selector_top_k, R = h.selector_rank;
            ggml_tensor * lg = ggml_view_2d(ctx, logits, V, rows, logits->nb[1], (1 - head_first) * logits->nb[1]);
            ggml_tensor * cand = ggml_top_k(ctx, lg, (int)k);                                           // [k, rows] i32
            ggml_tensor * unary_rows = ggml_get_rows(ctx, ggml_reshape_3d(ctx, lg, 1, V, rows), cand);  // [1, k, rows]
            ggml_tensor * unary = ggml_reshape_3d(ctx, unary_rows, k, 1, rows);
            ggml_tensor * hf = ggml_view_2d(ctx, h_final, h.n_embd, rows, h_final->nb[1], h_final->nb[1]);
            ggml_tensor * gate = ggml_reshape_3d(ctx, ggml_mul_mat(ctx, model->sel_hidden, hf), R, 1, rows);
            // candidates are rows of the head: with a drafting vocabulary, rows of its codebooks too
            ggml_tensor * sel_next = vocab ? vocab->sel_next : model->sel_next;
            ggml_tensor * sel_prev = vocab ? vocab->sel_prev : model->sel_prev;
            ggml_tensor * succ =
                ggml_reshape_3d(ctx, ggml_get_rows(ctx, sel_next, ggml_reshape_1d(ctx, cand, k * rows)), R, k, rows);
            bg.anchor = input(ctx, GGML_TYPE_I32, 1, 0, "inp_anchor");
            ggml_tensor * pred =
                ggml_repeat_4d(ctx, ggml_get_rows(ctx, model->sel_prev, bg.anchor), R, k, 1, 1);  // row 1
            if (rows > 1) {
                ggml_tensor * prev_ids = ggml_view_1d(ctx, cand, k * (rows - 1), 0);  // candidates of rows 1..rows-1
                ggml_tensor * p = ggml_reshape_3d(ctx, ggml_get_rows(ctx, sel_prev, prev_ids), R, k, rows - 1);
                pred = ggml_concat(ctx, pred, p, 2);  // [R, k, rows]
            }
            ggml_tensor * cond = ggml_mul(ctx, pred, gate);        // [R, k pred, rows]
            ggml_tensor * scores = ggml_mul_mat(ctx, succ, cond);  // [k succ, k pred, rows]
            scores = ggml_add(ctx, scores, unary);
            for (ggml_tensor * t : {cand, unary_rows, scores}) {
                ggml_set_output(t);
                ggml_build_forward_expand(gf, t);
            }
            bg.cand = cand;
            bg.unary = unary_rows;
            bg.scores = scores;
        }
    }

    uint32_t window_unit() const { return on_cpu() ? kWindowCpu : kWindowGpu; }

    // the cache rows layer il attends to in a block graph's window: [0, window), a sliding layer's
    // [swa_first, window), a ring's first min(window, ring) rows (whichever positions they hold)
    uint32_t attended(uint32_t il, uint32_t window, uint32_t swa_first) const {
        if (in_ring(il)) return std::min(window, ring);
        return window - (hp().is_swa(il) ? swa_first : 0);
    }

    // the attention window for a block ending at row `end`, in whole units
    uint32_t window_for(uint32_t end) const {
        const uint32_t unit = window_unit();
        return std::min(n_ctx, (end + unit - 1) / unit * unit);
    }

    // The first cache row a sliding-window layer attends to in the window window_for(ctx_end + block_size):
    // every row before it lies swa_window or more positions before the block (at `position` >= ctx_end, so
    // >= window - unit - block_size + 1). Derived from the window, it moves only when the window does (no
    // more graph rebuilds); 64-row aligned (256-byte view offsets, which ggml-vulkan wants).
    uint32_t swa_first_for(uint32_t window, int32_t position) const {
        const int64_t S = hp().swa_window;
        if (S == 0 || ring != 0) return 0;
        const int64_t first =
            std::min<int64_t>((int64_t)window - window_unit() - hp().block_size - S + 2, (int64_t)position - S + 1);
        return first <= 0 ? 0 : (uint32_t)(first / 64 * 64);
    }

    ggml_backend_sched_ptr new_sched() {
        std::vector<ggml_backend_buffer_type_t> bufts;
        for (ggml_backend_t b : backends) bufts.push_back(ggml_backend_get_default_buffer_type(b));
        ggml_backend_sched_ptr s(
            ggml_backend_sched_new(backends.data(), bufts.data(), (int)backends.size(), kGraphSize, false, true));
        if (std::getenv("DFLASH_PROFILE"))
            ggml_backend_sched_set_eval_callback(s.get(), &OpProfile::callback, &profile);
        if (dump.on()) ggml_backend_sched_set_eval_callback(s.get(), &NodeDump::callback, &dump);
        return s;
    }

    // the block graph of a shape for a window: its scheduler is made (and reserved for the whole cache) at
    // the shape's first use, its graph built and allocated when the window changes; otherwise nothing to do
    BlockVariant & ensure_block(uint32_t window, uint32_t swa_first, uint32_t n_rows, uint32_t head_first,
                                uint32_t head_rows) {
        const uint32_t key = n_rows << 16 | head_first << 8 | head_rows;
        if (!variants.count(key) && variants.size() >= max_shapes) {
            auto lru = std::min_element(variants.begin(), variants.end(), [](const auto & a, const auto & b) {
                return a.second->last_use < b.second->last_use;
            });
            variants.erase(lru);
        }
        std::unique_ptr<BlockVariant> & v = variants[key];
        if (!v) {
            v = std::make_unique<BlockVariant>();
            v->sched = new_sched();
            v->threads = &thread_picks.try_emplace(key, on_cpu() ? n_threads : 1).first->second;
            build_block(*v, n_ctx, 0, n_rows, head_first, head_rows);
            if (!ggml_backend_sched_reserve(v->sched.get(), v->bg.gf)) throw Error("cannot reserve the block graph");
            v->reserved_bytes = buffer_bytes(v->sched.get());
            v->bg.window = 0;  // reserved, not allocated: built again below
        }
        if (v->bg.window != window || v->bg.swa_first != swa_first) {
            build_block(*v, window, swa_first, n_rows, head_first, head_rows);
            const BlockGraph & bg = v->bg;
            ggml_backend_buffer_type_t buft = ggml_backend_dev_buffer_type(dev);
            std::vector<ggml_tensor *> in = {bg.ctx_feat, bg.kv_pos, bg.tokens};
            for (ggml_tensor * t : {bg.kv_idx, bg.kv_vidx, bg.ring_idx, bg.ring_vidx, bg.mask[0][0], bg.mask[0][1],
                                    bg.mask[1][0], bg.mask[1][1]}) {
                if (t) in.push_back(t);
            }
            if (bg.anchor) in.push_back(bg.anchor);
            v->in = Packed();
            v->out = Packed();  // stays unplaced when the device cannot compute every output
            v->in.place(v->ctx.get(), buft, in);
            std::vector<ggml_tensor *> out = {bg.argmax};
            if (bg.cand) out.insert(out.end(), {bg.cand, bg.unary, bg.scores});
            // an output placed on the device must be computed there: only pack them when the device runs them all
            if (std::all_of(out.begin(), out.end(),
                            [&](ggml_tensor * t) { return ggml_backend_dev_supports_op(dev, t); })) {
                v->out.place(v->ctx.get(), buft, out);
            }
            counters.graphs_built++;
            alloc(v->sched.get(), v->bg.gf, v->reserved_bytes);
            // shapes come and go, and buffers grow, only here: not counted again on every step
            counters.shapes = (uint32_t)variants.size();
            counters.compute_bytes = inject_reserved;
            for (const auto & kv : variants) counters.compute_bytes += kv.second->reserved_bytes;
        }
        counters.n_splits_last = ggml_backend_sched_get_n_splits(v->sched.get());
        v->last_use = ++shape_uses;
        return *v;
    }

    // allocates gf in sched; growth past `reserved` (its compute buffers after the worst-case reservation)
    // is counted, as it means a re-allocation at draft time
    void alloc(ggml_backend_sched_t sched, ggml_cgraph * gf, size_t & reserved) {
        ggml_backend_sched_reset(sched);
        if (!ggml_backend_sched_alloc_graph(sched, gf)) {
            throw Error("draft graph allocation failed on " + std::string(ggml_backend_dev_name(dev)));
        }
        counters.graph_allocs++;
        counters.n_splits_last = ggml_backend_sched_get_n_splits(sched);
        const size_t now = buffer_bytes(sched);
        if (now > reserved) {
            counters.sched_reallocs++;
            reserved = now;
        }
    }

    void run(ggml_backend_sched_t sched, ggml_cgraph * gf) {
        profile.start();
        if (ggml_backend_sched_graph_compute(sched, gf) != GGML_STATUS_SUCCESS) {
            throw Error("draft graph compute failed on " + std::string(ggml_backend_dev_name(dev)));
        }
    }

    size_t buffer_bytes(ggml_backend_sched_t sched) const {
        size_t total = 0;
        for (ggml_backend_t b : backends) total += ggml_backend_sched_get_buffer_size(sched, b);
        return total;
    }

    void reserve() {
        // worst cases: a full inject chunk, and the full block (every row) over the whole cache
        auto ctx = new_ctx(inject_meta);
        InjectGraph ig = build_inject(ctx.get(), std::min(kInjectChunk, n_ctx));
        if (!ggml_backend_sched_reserve(sched_inject.get(), ig.gf)) throw Error("cannot reserve the inject graph");
        inject_reserved = buffer_bytes(sched_inject.get());
        max_shapes = max_block_shapes(hp().block_size, on_cpu());
        ensure_block(n_ctx, 0, hp().block_size, 0, hp().block_size);
    }

    // writes rows through the inject graph in chunks (long prompts, or more rows than a block carries)
    void inject_now(const float * features, uint32_t n) {
        const size_t width = hp().n_target_features();
        for (uint32_t done = 0; done < n;) {
            const uint32_t chunk = std::min(kInjectChunk, n - done);
            auto ctx = new_ctx(inject_meta);
            InjectGraph ig = build_inject(ctx.get(), chunk);
            counters.graphs_built++;
            alloc(sched_inject.get(), ig.gf, inject_reserved);
            if (on_cpu()) cpu_threads.set(n_threads);
            std::vector<int32_t> pos(chunk);
            std::vector<int64_t> rows(chunk);
            std::iota(pos.begin(), pos.end(), (int32_t)n_cached);
            std::iota(rows.begin(), rows.end(), (int64_t)n_cached);
            // store_kv's row inputs: only those of the kinds of layer this drafter has
            ggml_tensor * inputs[4] = {ig.idx, ig.vidx, ig.ring_idx, ig.ring_vidx};
            std::vector<int64_t> values[4];
            int64_t * at[4] = {};
            for (int i = 0; i < 4; ++i) {
                if (inputs[i]) values[i].resize(ggml_nelements(inputs[i])), at[i] = values[i].data();
            }
            fill_rows(at[0], at[1], at[2], at[3], rows.data(), chunk);
            ggml_backend_tensor_set(ig.feat, features + done * width, 0, chunk * width * sizeof(float));
            ggml_backend_tensor_set(ig.pos, pos.data(), 0, chunk * sizeof(int32_t));
            for (int i = 0; i < 4; ++i) {
                if (inputs[i]) ggml_backend_tensor_set(inputs[i], at[i], 0, values[i].size() * sizeof(int64_t));
            }
            run(sched_inject.get(), ig.gf);
            n_cached += chunk;
            ring_written(n_cached);
            done += chunk;
        }
    }

    void flush_pending() {
        if (n_pending == 0) return;
        const uint32_t n = n_pending;
        n_pending = 0;
        inject_now(pending.data(), n);
        pending.clear();
    }

    void open_device(ggml_backend_dev_t device, const DrafterOptions & o) {
        opts = o;
        dev = device;
        backend.reset(ggml_backend_dev_init(dev, nullptr));
        if (!backend) throw Error(std::string("cannot initialise device ") + ggml_backend_dev_name(dev));
        n_threads = o.n_threads > 0 ? o.n_threads : default_cpu_threads();
        backends = {backend.get()};
        if (!on_cpu()) {
            backend_cpu.reset(ggml_backend_init_by_type(GGML_BACKEND_DEVICE_TYPE_CPU, nullptr));
            backends.push_back(backend_cpu.get());
        }
        cpu_conv_op = on_cpu() && !std::getenv("DFLASH_PORTABLE_GRAPH");
        cpu_threads.bind(backends.back());
        cpu_threads.set(n_threads);
    }

    // the CPU's extra buffer types a quantized matmul weight is repacked into (none off the CPU or with !repack)
    std::vector<ggml_backend_buffer_type_t> repacking() const {
        return on_cpu() && opts.repack ? repacking_bufts(dev) : std::vector<ggml_backend_buffer_type_t>{};
    }

    // The head the block graph multiplies: opts.draft_vocab's rows of the full head (and of the selector's
    // codebooks), read from the files, or the full head when it is empty.
    void open_vocab() {
        vocab.reset();
        output = full_output;
        const std::vector<ggml_backend_buffer_type_t> bufts = repacking();
        if (!opts.draft_vocab.empty()) {
            const std::string & path = model->info.path;
            auto in_drafter = [&](const char * name, const ggml_tensor * t) {
                for (const TensorInfo & ti : model->info.tensors)
                    if (ti.name == name) return RowSource{path, ti.offset, t};
                throw Error(path + ": no tensor '" + name + "'");
            };
            const RowSource head_rows = full_output == model->output
                                            ? in_drafter("output.weight", full_output)
                                            : RowSource{head->path, head->output_offset, full_output};
            const bool v2 = hp().version == 2;
            RowSource prev, next;
            if (v2) {
                prev = in_drafter("selector_predecessor.weight", model->sel_prev);
                next = in_drafter("selector_successor.weight", model->sel_next);
            }
            vocab =
                make_draft_vocab(opts.draft_vocab, hp().n_vocab, v2 ? hp().selector_top_k : 1, head_rows,
                                 v2 ? &prev : nullptr, v2 ? &next : nullptr, ggml_backend_dev_buffer_type(dev), bufts);
            output = vocab->output;
        }
        head_pad_from = pad_rows_from("DFLASH_HEAD_PAD_FROM", {output});
    }

    // From how many rows left over after multiples of 4 on padding them pays for the matmuls with ws:
    // timed on those of ws held in a repacked layout (4, never, where none is). `env` (1-4) sets it, for tests.
    uint32_t pad_rows_from(const char * env, std::initializer_list<ggml_tensor *> ws) const {
        const std::vector<ggml_backend_buffer_type_t> bufts = repacking();
        std::vector<ggml_tensor *> repacked;
        for (ggml_tensor * w : ws) {
            if (w && w->buffer &&
                std::find(bufts.begin(), bufts.end(), ggml_backend_buffer_get_type(w->buffer)) != bufts.end())
                repacked.push_back(w);
        }
        if (repacked.empty()) return 4;
        const char * forced = std::getenv(env);
        return forced ? std::clamp(std::atoi(forced), 1, 4) : timed_pad_rows_from(backend.get(), repacked);
    }

    // the block's rows go through every layer alike: the first one's matmuls stand for them
    void time_block_padding() {
        const DraftLayer & l = model->layers[0];
        block_pad_from = pad_rows_from("DFLASH_BLOCK_PAD_FROM", {l.wq, l.wk, l.wv, l.wo, l.ffn_gate, l.ffn_up,
                                                                 l.ffn_down, l.attn_conv_proj, l.ffn_conv_proj});
    }

    // the draft cache of opts.n_ctx rows and the schedulers, once the weights are there
    void open_cache() {
        const DraftHparams & h = hp();
        if (opts.n_ctx < 2 * h.block_size || opts.n_ctx > (1u << 20)) {
            throw Error("n_ctx " + std::to_string(opts.n_ctx) + " is out of range (" +
                        std::to_string(2 * h.block_size) + "..1048576)");
        }
        n_ctx = opts.n_ctx;
        if (opts.kv_type != GGML_TYPE_F16 && opts.kv_type != GGML_TYPE_F32) {
            throw Error(std::string("the draft cache's type must be f16 or f32, not ") + ggml_type_name(opts.kv_type));
        }
        ring = opts.swa_full ? 0 : sliding_ring_rows(h.swa_window, h.block_size, n_ctx);
        ggml_init_params ip{2 * h.n_layer * ggml_tensor_overhead(), nullptr, true};
        cache_ctx.reset(ggml_init(ip));
        for (uint32_t il = 0; il < h.n_layer; ++il) {
            const int64_t rows = layer_rows(il) + 1;
            cache_k.push_back(ggml_new_tensor_3d(cache_ctx.get(), opts.kv_type, h.head_dim, h.n_head_kv, rows));
            cache_v.push_back(ggml_new_tensor_3d(cache_ctx.get(), opts.kv_type, rows, h.head_dim, h.n_head_kv));
        }
        cache_buf.reset(ggml_backend_alloc_ctx_tensors_from_buft(cache_ctx.get(), ggml_backend_dev_buffer_type(dev)));
        if (!cache_buf) throw Error("cannot allocate the draft cache (" + std::to_string(n_ctx) + " rows)");
        ggml_backend_buffer_clear(cache_buf.get(), 0);
        sched_inject = new_sched();
        reserve();
    }

    OpProfile profile;  // DFLASH_PROFILE=1 only
    NodeDump dump{std::getenv("DFLASH_DUMP_NODES")};
};

uint32_t sliding_ring_rows(uint32_t swa_window, uint32_t block_size, uint32_t n_ctx) {
    const uint64_t rows = ((uint64_t)swa_window + block_size + kRingSlack + 63) / 64 * 64;
    return swa_window != 0 && rows < n_ctx ? (uint32_t)rows : 0;
}

Drafter::Drafter(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}

Drafter::Drafter(const std::string & draft_path, const std::string & target_path, const DrafterOptions & opts) :
    impl_(std::make_unique<Impl>()) {
    Impl & m = *impl_;
    m.open_device(pick_device(opts.device), opts);

    m.model =
        std::make_shared<DraftModel>(load_draft_model(draft_path, ggml_backend_dev_buffer_type(m.dev), m.repacking()));
    const DraftHparams & h = m.hp();
    if (m.model->tok_embd && m.model->output) {
        m.tok_embd = m.model->tok_embd;
        m.full_output = m.model->output;
    }
    if (!target_path.empty()) {
        m.head = load_target_head(target_path, m.dev);
        if (m.head->n_embd != h.target_hidden) {
            throw Error(target_path + ": target hidden size is " + std::to_string(m.head->n_embd) +
                        " but the drafter " + draft_path + " expects target features of width " +
                        std::to_string(h.target_hidden) + " (fc.weight input / number of target layers)");
        }
        if (m.head->n_embd != h.n_embd && !m.tok_embd) {
            throw Error(draft_path + ": drafter hidden size " + std::to_string(h.n_embd) +
                        " differs from the target's " + std::to_string(m.head->n_embd) +
                        ", so it cannot use the target's embedding and LM head");
        }
        if (h.n_vocab != 0 && h.n_vocab != m.head->n_vocab) {
            throw Error(draft_path + ": drafter vocabulary has " + std::to_string(h.n_vocab) +
                        " tokens but the target " + target_path + " has " + std::to_string(m.head->n_vocab));
        }
        const int32_t max_layer = h.target_layers.back();
        if ((uint32_t)max_layer >= m.head->n_layer + 1 || max_layer < 1) {
            throw Error(draft_path + ": dflash.target_layers asks for layer " + std::to_string(max_layer) +
                        " but the target " + target_path + " has " + std::to_string(m.head->n_layer) + " layers");
        }
        if (!m.tok_embd) {
            m.tok_embd = m.head->tok_embd;
            m.full_output = m.head->output;
        }
        m.model->hp().n_vocab = m.head->n_vocab;
    }
    if (!m.tok_embd) {
        throw Error(draft_path + ": the drafter carries no token embedding / LM head, so a target GGUF is required");
    }
    if (m.model->hp().n_vocab == 0) m.model->hp().n_vocab = (uint32_t)m.full_output->ne[1];
    if ((uint32_t)h.mask_token_id >= m.model->hp().n_vocab) {
        throw Error(draft_path + ": tokenizer.ggml.mask_token_id " + std::to_string(h.mask_token_id) +
                    " is outside the vocabulary (" + std::to_string(m.model->hp().n_vocab) + ")");
    }
    m.open_vocab();
    m.time_block_padding();

    m.open_cache();
}

std::unique_ptr<Drafter> Drafter::share(const std::vector<int32_t> * draft_vocab) const {
    const Impl & src = *impl_;
    auto m = std::make_unique<Impl>();
    DrafterOptions o = src.opts;
    if (draft_vocab) o.draft_vocab = *draft_vocab;
    m->open_device(src.dev, o);
    m->model = src.model;
    m->head = src.head;
    m->tok_embd = src.tok_embd;
    m->full_output = src.full_output;
    if (draft_vocab) {
        m->open_vocab();
    } else {
        m->output = src.output;
        m->vocab = src.vocab;
        m->head_pad_from = src.head_pad_from;
    }
    m->block_pad_from = src.block_pad_from;
    m->open_cache();
    return std::unique_ptr<Drafter>(new Drafter(std::move(m)));
}

Drafter::~Drafter() = default;

const DraftHparams & Drafter::hparams() const { return impl_->hp(); }
const DraftFileInfo & Drafter::info() const { return impl_->model->info; }
uint32_t Drafter::n_vocab() const { return impl_->hp().n_vocab; }
uint32_t Drafter::n_ctx() const { return impl_->n_ctx; }
uint32_t Drafter::ring_rows() const { return impl_->ring; }
size_t Drafter::cache_bytes() const { return ggml_backend_buffer_get_size(impl_->cache_buf.get()); }
uint32_t Drafter::n_cached() const { return impl_->n_cached + impl_->n_pending; }
std::string Drafter::device_name() const { return ggml_backend_dev_name(impl_->dev); }
bool Drafter::head_zero_copy() const { return impl_->head && impl_->head->zero_copy; }
size_t Drafter::repacked_weights() const { return impl_->model->repacked_weights; }
uint32_t Drafter::head_pad_from() const { return impl_->head_pad_from; }
uint32_t Drafter::block_pad_from() const { return impl_->block_pad_from; }
uint32_t Drafter::draft_vocab_size() const {
    return impl_->vocab ? (uint32_t)impl_->vocab->ids.size() : impl_->hp().n_vocab;
}
const DrafterCounters & Drafter::counters() const { return impl_->counters; }

void Drafter::inject(const float * features, const int32_t * positions, uint32_t n) {
    Impl & m = *impl_;
    if (n == 0) return;
    const uint32_t first = m.n_cached + m.n_pending;
    if ((uint64_t)first + n + m.hp().block_size > m.n_ctx) {
        throw Error("draft cache full: " + std::to_string(first) + " + " + std::to_string(n) +
                    " rows (+ one block) exceed n_ctx = " + std::to_string(m.n_ctx));
    }
    for (uint32_t i = 0; i < n; ++i) {
        if (positions[i] != (int32_t)(first + i)) {
            throw Error("inject: position " + std::to_string(positions[i]) + " at row " + std::to_string(i) +
                        " does not continue the draft cache (expected " + std::to_string(first + i) + ")");
        }
    }
    const size_t width = m.hp().n_target_features();
    if (m.n_pending + n <= m.hp().block_size) {  // few rows (a speculative step's): the next draft writes them
        m.pending.insert(m.pending.end(), features, features + n * width);
        m.n_pending += n;
        return;
    }
    m.flush_pending();
    m.inject_now(features, n);
}

void Drafter::truncate(uint32_t n) {
    Impl & m = *impl_;
    if (n > m.n_cached + m.n_pending) {
        throw Error("truncate: cannot keep " + std::to_string(n) + " rows, the cache holds " +
                    std::to_string(m.n_cached + m.n_pending));
    }
    if (n <= m.n_cached) {
        m.n_cached = n;
        m.n_pending = 0;
    } else {
        m.n_pending = n - m.n_cached;
    }
    m.pending.resize((size_t)m.n_pending * m.hp().n_target_features());
    m.ring_from = std::min(m.ring_from, n);  // the rows written from n on are new
    m.restore_rings(n);
}

bool Drafter::holds_window() const {
    const Impl & m = *impl_;
    return m.ring == 0 || m.ring_from <= m.window_from(m.n_cached);
}

void Drafter::keep_rings_at(uint32_t n) {
    Impl & m = *impl_;
    if (m.ring == 0 || n == 0) return;
    m.rings_mark = n;
    if (m.n_cached >= n) m.keep_rings();
}

// K rows are contiguous per position ([width] each); V is stored transposed (positions innermost per
// channel), so its rows are copied channel by channel. Layers in order, K then V, in the cache's type: a
// layer holding every row its first n, a ring layer the positions it still holds of the last `ring` (the
// same count in every ring layer; load_cache reads it off the size).
template <typename F>
void Drafter::Impl::each_run(uint32_t il, uint32_t lo, uint32_t hi, F && copy) const {
    const size_t elem = ggml_type_size(cache_k[il]->type), row_bytes = (size_t)kv_width() * elem;
    const uint32_t rows = layer_rows(il), first = lo % rows, n = hi - lo;
    // the positions' rows: one run, or two where a ring wraps
    const std::pair<uint32_t, uint32_t> runs[2] = {{first, std::min(n, rows - first)},
                                                   {0, n - std::min(n, rows - first)}};
    for (const auto & [row, count] : runs) copy(cache_k[il], row * row_bytes, count * row_bytes);
    for (int64_t c = 0; c < kv_width(); ++c) {
        for (const auto & [row, count] : runs) copy(cache_v[il], c * cache_v[il]->nb[1] + row * elem, count * elem);
    }
}

void Drafter::Impl::keep_rings() {
    const auto t0 = std::chrono::steady_clock::now();
    rings_mark = 0;
    RingsCopy c;
    // the copy it replaces lends its buffers: one of the same prompt's end or later (rows since rolled back),
    // else the oldest once there are as many as kept
    auto old = std::find_if(rings_copies.begin(), rings_copies.end(),
                            [this](const RingsCopy & k) { return k.end >= n_cached; });
    if (old == rings_copies.end() && rings_copies.size() >= kMaxRingsCopies) old = rings_copies.begin();
    if (old != rings_copies.end()) {
        c = std::move(*old);
        rings_copies.erase(old);
    }
    c.k.resize(hp().n_layer);
    c.v.resize(hp().n_layer);
    for (uint32_t il = 0; il < hp().n_layer; ++il) {
        if (!in_ring(il)) continue;
        // whole tensors: one transfer each (V is transposed, so a range of positions would be one per channel)
        for (auto [t, out] : {std::pair{cache_k[il], &c.k[il]}, std::pair{cache_v[il], &c.v[il]}}) {
            out->resize(ggml_nbytes(t));
            ggml_backend_tensor_get(t, out->data(), 0, out->size());
        }
    }
    c.from = ring_from;
    c.end = n_cached;
    rings_copies.push_back(std::move(c));
    // one-off work: taken inside a draft step (the one writing a prompt's last rows), not that step's cost
    counters.setup_ms_last += std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count();
}

void Drafter::Impl::restore_rings(uint32_t n) {
    if (rings_mark > n) rings_mark = 0;  // that prompt is gone
    // where the rings lost rows of n's window: the copy reaching furthest back among those that hold the
    // context's rows up to n (a rollback clips every copy's end; rows from n on are rewritten before use)
    const RingsCopy * best = nullptr;
    for (const RingsCopy & c : rings_copies) {
        if (n <= c.end && c.from < ring_from && (!best || c.from < best->from)) best = &c;
    }
    if (best && ring_from > window_from(n)) {
        for (uint32_t il = 0; il < hp().n_layer; ++il) {
            if (!in_ring(il)) continue;
            ggml_backend_tensor_set(cache_k[il], best->k[il].data(), 0, best->k[il].size());
            ggml_backend_tensor_set(cache_v[il], best->v[il].data(), 0, best->v[il].size());
        }
        ring_from = best->from;
        ++counters.rings_restored;
    }
    // positions from n on will be written again with other rows
    for (RingsCopy & c : rings_copies) c.end = std::min(c.end, n);
    rings_copies.erase(
        std::remove_if(rings_copies.begin(), rings_copies.end(), [](const RingsCopy & c) { return c.end <= c.from; }),
        rings_copies.end());
}

uint32_t Drafter::Impl::ring_held(uint32_t n) const {
    return ring == 0 ? 0 : n - std::max(ring_from, n > ring ? n - ring : 0);
}

std::vector<uint8_t> Drafter::save_cache() {
    Impl & m = *impl_;
    m.flush_pending();
    const uint32_t n = m.n_cached, in_ring = m.ring_held(n);
    const size_t row_bytes = (size_t)m.kv_width() * ggml_type_size(m.cache_k[0]->type);
    size_t rows = 0;
    for (uint32_t il = 0; il < m.hp().n_layer; ++il) rows += m.in_ring(il) ? in_ring : n;
    std::vector<uint8_t> bytes(2 * rows * row_bytes);
    uint8_t * out = bytes.data();
    for (uint32_t il = 0; il < m.hp().n_layer; ++il) {
        m.each_run(il, n - (m.in_ring(il) ? in_ring : n), n, [&](ggml_tensor * t, size_t offset, size_t size) {
            ggml_backend_tensor_get(t, out, offset, size);
            out += size;
        });
    }
    return bytes;
}

void Drafter::load_cache(const std::vector<uint8_t> & bytes, uint32_t n) {
    Impl & m = *impl_;
    const size_t row_bytes = (size_t)m.kv_width() * ggml_type_size(m.cache_k[0]->type);
    if ((uint64_t)n + m.hp().block_size > m.n_ctx) {
        throw Error("the saved draft cache holds " + std::to_string(n) + " rows; this drafter's n_ctx = " +
                    std::to_string(m.n_ctx) + " holds " + std::to_string(m.n_ctx - m.hp().block_size) + " and a block");
    }
    uint32_t ring_layers = 0;
    for (uint32_t il = 0; il < m.hp().n_layer; ++il) ring_layers += m.in_ring(il);
    const size_t full = 2 * (m.hp().n_layer - ring_layers) * (size_t)n * row_bytes,
                 per_ring_row = 2 * ring_layers * row_bytes;
    // the rows each ring layer holds: what the bytes beyond the other layers' come to
    const size_t in_ring = ring_layers && bytes.size() >= full ? (bytes.size() - full) / per_ring_row : 0;
    if (bytes.size() != full + in_ring * per_ring_row || in_ring > std::min(n, m.ring)) {
        const std::string expected = ring_layers ? std::to_string(full) + " + " + std::to_string(per_ring_row) +
                                                       " per row its rings hold (at most " +
                                                       std::to_string(std::min(n, m.ring)) + ")"
                                                 : std::to_string(full);
        throw Error("the saved draft cache has " + std::to_string(bytes.size()) + " bytes, not the " + expected +
                    " of " + std::to_string(n) + " rows of this drafter (saved with another drafter?)");
    }
    const uint8_t * in = bytes.data();
    for (uint32_t il = 0; il < m.hp().n_layer; ++il) {
        m.each_run(il, n - (m.in_ring(il) ? (uint32_t)in_ring : n), n,
                   [&](ggml_tensor * t, size_t offset, size_t size) {
                       ggml_backend_tensor_set(t, in, offset, size);
                       in += size;
                   });
    }
    m.n_cached = n;
    m.ring_from = n - (uint32_t)in_ring;
    m.rings_copies.clear();  // of another sequence
    m.rings_mark = 0;
    m.n_pending = 0;
    m.pending.clear();
}

DraftResult Drafter::draft(int32_t anchor, int32_t position, uint32_t n, bool want_logits, bool all_rows,
                           bool short_block) {
    Impl & m = *impl_;
    const DraftHparams & h = m.hp();
    const uint32_t B = h.block_size;
    if (n > B - 1) {
        throw Error("draft: n = " + std::to_string(n) + " exceeds block_size - 1 = " + std::to_string(B - 1));
    }
    if (anchor < 0 || (uint32_t)anchor >= h.n_vocab) {
        throw Error("draft: anchor token " + std::to_string(anchor) + " is outside the vocabulary (" +
                    std::to_string(h.n_vocab) + ")");
    }
    if (position < 0 || (uint64_t)position + B > (uint64_t)INT32_MAX) throw Error("draft: invalid position");

    if (m.n_cached + m.n_pending + B > m.n_ctx) {
        throw Error("draft: the draft cache is full (n_ctx = " + std::to_string(m.n_ctx) + ")");
    }

    const uint32_t ctx_end = m.n_cached + m.n_pending;  // the block's rows follow the context
    // Block rows and head rows. A short block is [anchor, MASK x n] (as llama.cpp's draft-dflash runs it):
    // the MASK rows after the draft take no part. Its graph's rows may be padded (short_block_rows): no real
    // row attends to a padding row (the mask) and the conv reads only earlier rows, so they change nothing. A full
    // block computes all B rows and the head for rows 1..n rounded up to a power of two.
    uint32_t head_first = 0, head_rows = B, R = B, seen_rows = B, out_rows = B;
    if (short_block && !all_rows) {
        head_first = 1;
        out_rows = std::max(n, 1u);
        seen_rows = out_rows + 1;
        R = short_block_rows(seen_rows, B, m.on_cpu(), m.block_pad_from);
        head_rows = m.on_cpu() ? out_rows : R - 1;  // the CPU's head pads its rows itself (head_pad_from)
    } else if (!all_rows) {
        head_first = 1;
        for (head_rows = 1; head_rows < n; head_rows *= 2) {}
        head_rows = std::min(head_rows, B - 1);
        out_rows = head_rows;
    }
    const auto t_setup = std::chrono::steady_clock::now();
    if (m.n_pending > R) m.flush_pending();  // the block graph writes at most R pending rows itself
    const uint32_t window = m.window_for(ctx_end + B);
    Impl::BlockVariant & v = m.ensure_block(window, m.swa_first_for(window, position), R, head_first, head_rows);
    m.counters.setup_ms_last =
        std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t_setup).count();
    m.counters.window_last = v.bg.window;
    m.counters.swa_first_last = v.bg.swa_first;
    const Impl::BlockGraph & bg = v.bg;
    // the inputs, written straight into the one upload
    Packed & in = v.in;
    {
        // pending context rows; the padding rows up to R write the scratch row (their features: whatever
        // the buffer held, finite)
        std::copy(m.pending.begin(), m.pending.end(), in.host<float>(bg.ctx_feat));
        int32_t * pos = in.host<int32_t>(bg.kv_pos);
        int32_t * tokens = in.host<int32_t>(bg.tokens);
        int64_t rows[2 * kMaxBlockSize];
        for (uint32_t i = 0; i < R; ++i) {
            const bool real = i < m.n_pending;
            pos[i] = position + (int32_t)i;
            rows[i] = (int64_t)(ctx_end + i);
            tokens[i] = i == 0 ? anchor : h.mask_token_id;
            pos[R + i] = real ? (int32_t)(m.n_cached + i) : 0;
            rows[R + i] = real ? (int64_t)(m.n_cached + i) : (int64_t)m.n_ctx;
        }
        auto host_or_null = [&](ggml_tensor * t) { return t ? in.host<int64_t>(t) : nullptr; };
        m.fill_rows(host_or_null(bg.kv_idx), host_or_null(bg.kv_vidx), host_or_null(bg.ring_idx),
                    host_or_null(bg.ring_vidx), rows, 2 * R);
        if (bg.anchor) *in.host<int32_t>(bg.anchor) = anchor;
        // Row i sees the context and the block's real rows (all of them, or j <= i in a causal layer); nothing
        // after. In a sliding-window layer only those whose positions are less than swa_window from its own:
        // context rows from cache row position + i - swa_window + 1 (a context row's position is its index),
        // block rows from i - swa_window + 1 and, in a non-causal layer, before i + swa_window (z-lab's
        // reference and flash-attn's window slide both ways when not causal). A sliding layer's mask starts at
        // cache row swa_first; a ring's columns are its rows, position p's at p % ring, and of the context only
        // the positions from ring_from on are still there.
        const int64_t S = h.swa_window;
        const ggml_fp16_t zero = ggml_fp32_to_fp16(0.0f), ninf = ggml_fp32_to_fp16(-INFINITY);
        for (int causal = 0; causal < 2; ++causal) {
            for (int swa = 0; swa < 2; ++swa) {
                if (!bg.mask[causal][swa]) continue;
                ggml_fp16_t * mask = in.host<ggml_fp16_t>(bg.mask[causal][swa]);
                const bool ring = swa && m.ring != 0;
                const int64_t first = swa ? bg.swa_first : 0;
                const int64_t n_keys = ring ? std::min(bg.window, m.ring) : bg.window - first;
                for (uint32_t i = 0; i < R; ++i) {
                    int64_t ctx_lo = 0, lo = 0, hi = causal ? i + 1 : seen_rows;
                    if (swa) {
                        ctx_lo = std::clamp<int64_t>((int64_t)position + i - S + 1, 0, ctx_end);
                        lo = std::max<int64_t>(0, (int64_t)i - S + 1);
                        if (!causal) hi = std::min<int64_t>(hi, i + S);
                    }
                    if (hi <= lo) {  // a padding row past a narrow window: itself, never nothing
                        lo = i;
                        hi = i + 1;
                    }
                    ggml_fp16_t * row = mask + (size_t)i * n_keys;  // column c: cache row first + c
                    std::fill(row, row + n_keys, ninf);
                    if (ring) {
                        auto see = [&](int64_t a, int64_t b) {  // positions [a, b), fewer than m.ring
                            if (b <= a) return;
                            const int64_t c = a % m.ring, wrap = std::max<int64_t>(0, c + (b - a) - m.ring);
                            std::fill(row + c, row + c + (b - a) - wrap, zero);
                            std::fill(row, row + wrap, zero);
                        };
                        see(std::max<int64_t>(ctx_lo, m.ring_from), ctx_end);
                        see(ctx_end + lo, ctx_end + hi);
                        continue;
                    }
                    std::fill(row + (ctx_lo - first), row + (ctx_end - first), zero);
                    std::fill(row + (ctx_end + lo - first), row + (ctx_end + hi - first), zero);
                }
            }
        }
    }
    in.upload();
    const int threads = v.threads->next();
    if (m.on_cpu()) m.cpu_threads.set(threads);
    const auto t_run = std::chrono::steady_clock::now();
    m.run(v.sched.get(), bg.gf);
    v.threads->observe(threads,
                       std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t_run).count());
    if (m.on_cpu()) m.counters.draft_threads = v.threads->chosen();
    v.out.download();
    m.n_cached = ctx_end;
    m.ring_written(ctx_end + R);  // the block's rows went to the ring rows of positions ctx_end..ctx_end + R - 1
    m.n_pending = 0;
    m.pending.clear();

    DraftResult r;
    r.block_size = B;
    r.first_row = head_first;
    r.argmax.resize(out_rows);  // the graph's first out_rows head rows: the rest pad a short block
    v.out.get(bg.argmax, r.argmax.data(), out_rows * sizeof(int32_t));
    const DraftVocab * dv = m.vocab.get();
    if (dv)
        for (int32_t & t : r.argmax) t = dv->ids[t];
    if (want_logits) {
        const size_t V = dv ? dv->ids.size() : h.n_vocab;
        std::vector<float> & lg = dv ? m.subset_logits : r.logits;
        lg.resize((size_t)out_rows * V);
        ggml_backend_tensor_get(bg.logits, lg.data(), 0, lg.size() * sizeof(float));
        if (dv) {  // tokens outside the drafting vocabulary are never drafted: -inf
            r.logits.assign((size_t)out_rows * h.n_vocab, -INFINITY);
            for (uint32_t row = 0; row < out_rows; ++row)
                for (size_t j = 0; j < V; ++j) r.logits[(size_t)row * h.n_vocab + dv->ids[j]] = lg[row * V + j];
        }
    }
    if (h.version == 1) {
        r.tokens.assign(r.argmax.begin() + (1 - head_first), r.argmax.begin() + (1 - head_first) + n);
        return r;
    }

    // DFlash2: canonical candidate order (logit descending), then the greedy walk
    const uint32_t k = h.selector_top_k, rows = head_first + out_rows - 1;
    r.top_k = k;
    std::vector<int32_t> cand((size_t)k * rows);
    std::vector<float> unary((size_t)k * rows), raw((size_t)k * k * rows);
    v.out.get(bg.cand, cand.data(), cand.size() * sizeof(int32_t));
    v.out.get(bg.unary, unary.data(), unary.size() * sizeof(float));
    v.out.get(bg.scores, raw.data(), raw.size() * sizeof(float));
    if (dv)
        for (int32_t & c : cand) c = dv->ids[c];

    std::vector<uint32_t> perm((size_t)k * rows);  // perm[t][j] = raw index of sorted candidate j
    for (uint32_t t = 0; t < rows; ++t) {
        uint32_t * p = &perm[(size_t)t * k];
        std::iota(p, p + k, 0u);
        const float * u = &unary[(size_t)t * k];
        const int32_t * c = &cand[(size_t)t * k];
        std::sort(p, p + k, [&](uint32_t a, uint32_t b) { return u[a] != u[b] ? u[a] > u[b] : c[a] < c[b]; });
    }
    r.candidates.resize(cand.size());
    r.scores.resize(raw.size());
    for (uint32_t t = 0; t < rows; ++t) {
        for (uint32_t j = 0; j < k; ++j)
            r.candidates[(size_t)t * k + j] = cand[(size_t)t * k + perm[(size_t)t * k + j]];
        for (uint32_t i = 0; i < k; ++i) {
            const uint32_t raw_pred = t == 0 ? i : perm[(size_t)(t - 1) * k + i];
            for (uint32_t j = 0; j < k; ++j) {
                r.scores[((size_t)t * k + i) * k + j] = raw[((size_t)t * k + raw_pred) * k + perm[(size_t)t * k + j]];
            }
        }
    }
    r.walk_q.resize((size_t)k * rows);
    r.walk_index.resize(rows);
    uint32_t pred = 0;  // row 1: every predecessor row is the anchor
    for (uint32_t t = 0; t < rows; ++t) {
        const float * s = &r.scores[((size_t)t * k + pred) * k];
        uint32_t best = 0;
        for (uint32_t j = 1; j < k; ++j)
            if (s[j] > s[best]) best = j;
        float * q = &r.walk_q[(size_t)t * k];
        double z = 0.0;
        for (uint32_t j = 0; j < k; ++j) z += std::exp((double)s[j] - s[best]);
        for (uint32_t j = 0; j < k; ++j) q[j] = (float)(std::exp((double)s[j] - s[best]) / z);
        r.walk_index[t] = (int32_t)best;
        pred = best;
    }
    for (uint32_t t = 0; t < n; ++t) r.tokens.push_back(r.candidates[(size_t)t * k + r.walk_index[t]]);
    return r;
}

}  // namespace dflash
