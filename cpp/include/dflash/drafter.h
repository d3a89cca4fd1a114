#pragma once
// The DFlash draft runtime on ggml: weights + the target's head on one device,
// the draft context cache, and the two graphs (inject and block) of
// shared/GGUF-DFLASH.md section 4, scheduled with CPU fallback.
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "dflash/draft_model.h"
#include "dflash/draft_vocab.h"
#include "dflash/target_head.h"

namespace dflash {

struct DrafterOptions {
    std::string device = "auto";  // "auto" (first GPU, else CPU), "cpu", or a ggml device name
    int n_threads = 0;            // CPU threads; 0 = default_cpu_threads() (physical cores we may use)
    uint32_t n_ctx = 4096;        // draft cache capacity in context rows
    bool repack = true;           // on the CPU, quantized matmul weights in ggml's repacked layouts where one exists
    // the draft cache's K/V: F16 as llama.cpp's default cache (half the memory, and the attention, which at a long
    // context is most of a draft step, reads half the bytes), or F32 (to match a reference exactly)
    ggml_type kv_type = GGML_TYPE_F16;
    // the tokens a draft may propose (draft_vocab.h), most frequent first; empty: the whole vocabulary
    std::vector<int32_t> draft_vocab;
    // sliding-window layers hold every row as the others do (llama.cpp's --swa-full), not a ring of their
    // last positions' (sliding_ring_rows): more memory, and a rollback however deep keeps their windows whole
    bool swa_full = false;
};

// Rows: a draft of n tokens computes the LM head and the selector for block rows 1..n only; with
// all_rows, for every row (0..B-1, the selector 1..B-1). R = the selector's rows, H = the head's.
struct DraftResult {
    uint32_t block_size = 0;
    uint32_t top_k = 0;           // DFlash2 selector k (0 for DFlash1)
    uint32_t first_row = 0;       // the block row of argmax[0] and of the first logits row (0 or 1)
    std::vector<int32_t> tokens;  // the draft: rows 1..n (walk for DFlash2, argmax for DFlash1)
    // DFlash2, rows 1..R, candidates sorted by logit (descending):
    std::vector<int32_t> candidates;  // [R][k]
    std::vector<float> scores;        // [R][k pred][k succ]; row 1's k pred rows all use the anchor
    std::vector<float> walk_q;        // [R][k] softmax of the walked row's scores (the sampler's q)
    std::vector<int32_t> walk_index;  // [R] index of the walked token in its row's candidates
    std::vector<int32_t> argmax;      // [H] per-row argmax of the logits (both versions)
    std::vector<float> logits;        // [H][n_vocab] when requested

    const float * row_logits(uint32_t block_row, uint32_t n_vocab) const {
        return &logits[(size_t)(block_row - first_row) * n_vocab];
    }
};

// Statistics that show the per-step work stays bounded: a block graph is built only when its
// attention window changes, and buffers are never re-reserved after the start.
struct DrafterCounters {
    uint64_t graphs_built = 0;
    uint64_t graph_allocs = 0;    // graphs placed in their compute buffers (a built graph is placed once)
    uint64_t sched_reallocs = 0;  // compute-buffer growth after the initial reservation
    int n_splits_last = 0;        // backend splits of the last graph (1 = all on one device)
    uint32_t window_last = 0;     // cache rows the last draft step attended to (its graph's fixed window)
    uint32_t swa_first_last = 0;  // the first of them its sliding-window layers attended to (0 with rings)
    uint32_t shapes = 0;          // block graph shapes (block rows, head rows) held, least recently used evicted
    size_t compute_bytes = 0;     // compute buffers of the inject graph and the shapes held (all backends)
    int draft_threads = 0;        // CPU threads of the last draft step's graph, picked per graph shape by timing
                                  // its first steps (0: still timing, or not on the CPU)
    double setup_ms_last = 0;     // of the last draft step: building / allocating its graph, writing pending
                                  // rows through the inject graph, copying the rings at a prompt's end (one-off
                                  // work, not the step's own cost)
    uint64_t rings_restored = 0;  // truncations whose ring windows came back from a keep_rings_at copy
};

// rows of a sliding-window layer's ring cache in a draft cache of n_ctx rows (0: no ring, that layer holds
// every row as the others do)
uint32_t sliding_ring_rows(uint32_t swa_window, uint32_t block_size, uint32_t n_ctx);

class Drafter {
public:
    Drafter(const std::string & draft_path, const std::string & target_path, const DrafterOptions & opts);
    ~Drafter();
    Drafter(const Drafter &) = delete;
    Drafter & operator=(const Drafter &) = delete;
    // Another drafter on this one's weights (the drafter's and the target head it read), on the same device
    // with the same options and an empty cache of its own; the weights are freed with the last of them.
    // draft_vocab: its own drafting vocabulary (empty: the whole vocabulary); null: this one's.
    std::unique_ptr<Drafter> share(const std::vector<int32_t> * draft_vocab = nullptr) const;

    const DraftHparams & hparams() const;
    const DraftFileInfo & info() const;
    uint32_t n_vocab() const;
    uint32_t n_ctx() const;
    uint32_t n_cached() const;  // context rows in the draft cache
    std::string device_name() const;
    bool head_zero_copy() const;
    size_t repacked_weights() const;  // weights held in a repacked CPU layout
    // with the head repacked, head rows left over after multiples of 4 from this many on run padded to the
    // next multiple (timed at load; DFLASH_HEAD_PAD_FROM=1..4 sets it); 4 = never
    uint32_t head_pad_from() const;
    // the same for a short block's rows through the layers (their weights repacked; DFLASH_BLOCK_PAD_FROM)
    uint32_t block_pad_from() const;
    uint32_t draft_vocab_size() const;  // tokens a draft may propose: the drafting vocabulary's, else n_vocab()
    // rows of a sliding-window layer's ring cache (0: those layers keep every context row, as the others do)
    uint32_t ring_rows() const;
    size_t cache_bytes() const;  // the draft cache's K/V, every layer
    const DrafterCounters & counters() const;

    // Appends context rows: features [n][n_target_layers * target_hidden] at
    // positions p_0..p_{n-1}, which must continue the cache (p_i = n_cached() + i).
    void inject(const float * features, const int32_t * positions, uint32_t n);
    // Rollback: keep the first n context rows. A sliding layer's ring keeps the rows of its last ring_rows()
    // positions written, so going back further than about ring_rows() - swa_window leaves that layer some of
    // its window's rows short until new rows take their places (drafts differ, verification keeps the output),
    // unless one of keep_rings_at's copies holds them.
    void truncate(uint32_t n);
    void reset() { truncate(0); }
    // whether the sliding layers hold every row of the window before n_cached() (true without rings)
    bool holds_window() const;
    // Keep a copy of the sliding layers' rings once the rows before n are written (a prompt's end; the last 3
    // are kept, as the target keeps prompt checkpoints): a later truncate to n or fewer rows restores the
    // window rows they have lost since. Nothing without rings.
    void keep_rings_at(uint32_t n);
    // The K/V of every context row (pending rows written first; a ring's rows of its last positions), and
    // back: load_cache replaces the cache with n rows of save_cache's bytes (throws when their size is not
    // that of n rows of this drafter).
    std::vector<uint8_t> save_cache();
    void load_cache(const std::vector<uint8_t> & bytes, uint32_t n);

    // Drafts the block [anchor, MASK...] at positions position..position+B-1
    // over the cached context; keeps n <= B-1 tokens. The graph is kept per
    // (attention window, block rows, head rows): alternating all_rows rebuilds it.
    // short_block drafts the block [anchor, MASK x n] (as llama.cpp does): cheaper,
    // and the missing MASK rows no longer take part in attention, so the draft
    // differs from the full block's (verification keeps the output exact).
    DraftResult draft(int32_t anchor, int32_t position, uint32_t n, bool want_logits = false, bool all_rows = false,
                      bool short_block = false);

private:
    struct Impl;
    explicit Drafter(std::unique_ptr<Impl> impl);
    std::unique_ptr<Impl> impl_;
};

}  // namespace dflash
