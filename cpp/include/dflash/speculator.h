#pragma once
// The speculative loop of shared/GGUF-DFLASH.md section 5 for one sequence:
// draft -> verify -> accept -> rollback -> inject, greedy (lossless) or with
// exact rejection sampling, with prompt-prefix reuse and a fallback to plain
// decoding when drafting does not pay.
#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "dflash/drafter.h"
#include "dflash/sampling.h"
#include "dflash/target.h"

namespace dflash {

enum class DraftQ {
    Selector,  // DFlash2: walk sampled from softmax(selector scores) on the row's top-k
    Logits,    // each row sampled from the softmax of its full logits
};

struct SpeculatorOptions {
    uint32_t n_max = 0;     // drafted tokens verified per step; 0 = block_size - 1
    bool adaptive = false;  // choose the draft length per step (n_max is then the cap)
    DraftQ draft_q = DraftQ::Logits;
    bool fallback = true;  // fixed n_max: stop drafting while it cannot pay
    // sampling: every draw keyed by (seed, position) and the drafter's draft coupled to the target's token
    // through the same Gumbel noise (gumbel_pick), so that a seed fixes the text whatever the draft lengths;
    // else exact rejection sampling with q, whose draws follow the drafts
    bool gumbel = false;
};

class DraftLengthController;

struct SpecStats {
    uint64_t steps = 0;  // target verify passes (including plain ones)
    uint64_t drafted = 0;
    uint64_t accepted = 0;
    uint64_t emitted = 0;                             // tokens produced by steps (excludes the prefill's first token)
    std::vector<uint64_t> pos_reached, pos_accepted;  // per draft position 1..n_max
    std::vector<uint64_t> steps_by_length;  // steps per draft length 0..n_max ([0]: the plain ones, no drafting)
    double prefill_ms = 0, draft_ms = 0, verify_ms = 0, inject_ms = 0, sample_ms = 0;
    double rollback_ms = 0;     // a recurrent target's checkpoints before verifies and restores after
    double calibration_ms = 0;  // the draft-length calibration run by this start(), if any
    uint32_t prompt_tokens = 0;
    uint32_t reused_tokens = 0;   // of the prompt's prefix, those the target did not decode again
    uint64_t target_decodes = 0;  // llama_decode calls on the target's context (prefill chunks, verifies, restores)
};

// What the target and the draft cache hold for a token prefix: with it a later start() on a prompt
// continuing `tokens` prefills only the rest (llama_cpp.Llama's save_state / LlamaState).
struct SpeculatorState {
    std::vector<int32_t> tokens;  // the tokens whose K/V both hold (positions 0..n-1)
    std::vector<uint8_t> target;  // Target::save_seq
    std::vector<uint8_t> draft;   // Drafter::save_cache, rows 0..n-1
};

struct StepOutput {
    std::vector<int32_t> tokens;  // emitted this step (>= 1 unless context_full)
    bool context_full = false;
    uint32_t drafted = 0, accepted = 0;
    std::vector<TokenLogprob> logprobs;  // one per token when SamplingParams::n_logprobs >= 0
    std::vector<float> logits;           // tokens.size() rows of n_vocab when SamplingParams::keep_logits
};

class Speculator {
public:
    Speculator(std::unique_ptr<Target> target, std::unique_ptr<Drafter> drafter, const SpeculatorOptions & opts);
    ~Speculator();

    // Prefills (reusing the longest common prefix with the previous sequence)
    // and returns the first generated token.
    int32_t start(const std::vector<int32_t> & prompt, const SamplingParams & params, uint64_t seed);
    // start()'s token with its logprobs and logits, when SamplingParams asks for them
    const StepOutput & start_output() const { return start_output_; }
    // prompt tokens 1..n-1's logprobs, when SamplingParams::prompt_logprobs asked start() for them
    const std::vector<TokenLogprob> & prompt_logprobs() const { return prompt_logprobs_; }
    // One verify pass. It emits at most max_tokens tokens (what the caller still wants): it drafts at most
    // max_tokens - 1, and decodes plainly when one token is left, as drafts past the end are verified for
    // nothing (a wasted draft and a wider verify on the last step of a short generation).
    StepOutput step(uint32_t max_tokens = UINT32_MAX);
    // Plain decoding (no drafter) of the same target, for baselines and tests; the draft-length
    // controller does not see these steps (a baseline run is no evidence about drafting).
    StepOutput step_plain();

    void set_n_max(uint32_t n, bool adaptive);
    uint32_t n_max() const { return n_max_; }
    bool adaptive() const { return opts_.adaptive; }
    const SpeculatorOptions & options() const { return opts_; }
    // the controller's current view: per-position acceptance and expected cost of k drafts
    std::vector<double> acceptance_estimate() const;
    double expected_step_ms(uint32_t k) const;
    SpecStats stats() const;
    Target & target() { return *target_; }
    Drafter & drafter() { return *drafter_; }
    uint32_t n_past() const { return (uint32_t)committed_.size(); }
    // Mirostat's mu after every token emitted so far (tests replay it from the tokens)
    float mirostat_mu() const { return mu_; }
    // the tokens whose K/V the target context holds (positions 0..n_past-1)
    const std::vector<int32_t> & cached_tokens() const { return committed_; }
    // Someone else decoded in the target context (an adopted llama_cpp.Llama): of what this object
    // put there, keep only the prefix that `held` (what the context holds now) still agrees with;
    // the next start() prefills the rest. step() needs a start() first.
    void keep_cached_prefix(const std::vector<int32_t> & held);
    // The context as it stands (cached_tokens()); load_state replaces it (a failed load leaves an empty
    // one). Either way the next step() needs a start() first.
    SpeculatorState save_state();
    void load_state(const SpeculatorState & state);
    // The target's LoRA adapters' scales (Target::set_lora_scales); a change empties the context, which
    // holds what the old weights computed (the next start() prefills the whole prompt).
    void set_lora_scales(const std::vector<float> & scales);
    // The thinking under way ends now: the reasoning budget's forced end comes next (between steps; false
    // without a budget or a thinking being counted).
    bool end_reasoning() { return budget_ && budget_->end_now(); }

private:
    // auto mode: times a plain decode and a draft + verify of every draft length on a context of
    // placeholder tokens (the state is reset after), so that the controller knows what each choice
    // costs before the first request instead of exploring it there
    void calibrate();
    // decodes prompt[from..] after the reused prefix (the features go to pending_, prompt logprobs to
    // prompt_logprobs_ when asked for); returns the target row of the last prompt token's logits
    uint32_t prefill(const std::vector<int32_t> & prompt, uint32_t from);
    void flush_features();
    // truncates the target, the draft cache and the pending features to committed_[0..n)
    void keep_prefix(size_t n);
    size_t prefix_to_keep(size_t n);  // n, or less where the target would re-decode tokens the drafter needs
    // q for drafted row `row` (0-based) given the index of its predecessor in the previous row's candidates
    SparseDist draft_distribution(const DraftResult & r, uint32_t row, int32_t pred_index) const;
    // the target's logits as the sampler sees them after the window's tokens (valid until the next call)
    const float * shaped(const float * logits, const TokenWindow & window);
    // the row masked by the grammar (invalid tokens at -inf), in shaped_
    const float * grammar_masked(const float * shaped_logits);
    // the first `want` tokens the grammar allows in the order (logit desc, id asc), asking it about the
    // 4 * want most likely one by one (a pass over a 150k vocabulary costs ~20 ms); fewer when fewer are
    // among those, and then only a whole pass can tell
    std::vector<int32_t> top_allowed(const float * shaped_logits, uint32_t want);
    // greedy decoding's choice: the argmax of the grammar-masked row is the shaped row's argmax whenever
    // the grammar allows that token, so the grammar only runs over the whole vocabulary when it does not
    // (a grammar pass over a 150k vocabulary costs milliseconds; llama.cpp's common sampler checks its
    // chosen token first for the same reason)
    // (guess: a token the row's argmax likely is, the verify's drafted one: checked in one vectorized
    // pass, which saves the argmax over the vocabulary on every accepted row)
    int32_t greedy_token(const float * logits, const TokenWindow & window, int32_t guess = -1);
    // the next token from the target's logits: plain decoding's choice (greedy or sampled)
    // (pos: the token's absolute position, which keys its draw in Gumbel mode)
    int32_t choose_token(const float * logits, const TokenWindow & window, int32_t pos);
    // a token drawn from d for position pos: the seeded Gumbel draw, or from the stream of draws
    int32_t draw(const SparseDist & d, int32_t pos);
    // what a sampled token is drawn from, given the shaped row and the output so far (Mirostat's mu)
    SparseDist sampling_distribution(const float * shaped_logits) const;
    // p of the token after the output so far: the shaped row's, or the token the reasoning budget forces
    SparseDist next_distribution(const float * logits, const TokenWindow & window);
    // the token the reasoning budget forces next, or -1
    int32_t forced_token();
    // the grammar constrains the next token (a lazy one waits while the model thinks)
    bool grammar_applies() const;
    // ReasoningBudget's test of a token's text
    bool ends_character(int32_t token) const;
    // a token drawn from p (directly or by the rejection step) is part of the output: Mirostat moves mu
    void sampled(const SparseDist & p, int32_t token);
    // the logprobs and logits rows of out.tokens that SamplingParams asks for, token i predicted by the
    // target's row first_row + i
    void describe(StepOutput & out, uint32_t first_row = 0);
    // the row after the user's logits processor (raw logits when there is none; valid until the next call)
    const float * processed(const float * logits);
    // a token is part of the output: the penalties' window, the grammar and the processor's ids see it
    void commit_token(int32_t token);

    std::unique_ptr<Target> target_;
    std::unique_ptr<Drafter> drafter_;
    SpeculatorOptions opts_;
    uint32_t n_max_ = 0;
    SamplingParams params_;
    Rng rng_;
    uint64_t seed_ = 0;
    uint64_t decodes_before_start_ = 0;  // the target's decode_calls() when start() began
    std::vector<int32_t> committed_;     // tokens whose K/V the target holds (positions 0..n-1)
    int32_t anchor_ = -1;                // newest token, not yet decoded
    TokenWindow generated_;              // this generation's tokens up to anchor_, as the penalties count them
    float mu_ = 0.0f;                    // Mirostat's surprise bound after the output up to anchor_
    std::vector<float> shaped_;          // scratch for shaped logits
    std::vector<int32_t> id_scratch_;    // scratch token ids: token_logprob's top, top_allowed's order
    struct SamplerFree {
        void operator()(llama_sampler * s) const { llama_sampler_free(s); }
    };
    std::unique_ptr<llama_sampler, SamplerFree> grammar_;  // params_.grammar's state after the output so far
    std::optional<ReasoningBudget> budget_;                // params_.reasoning's state after the output so far
    std::vector<llama_token_data> grammar_rows_;           // scratch: one row's candidates for the grammar
    StepOutput start_output_;
    std::vector<TokenLogprob> prompt_logprobs_;
    std::vector<int32_t> history_;  // the prompt and the output up to anchor_: the processor's ids
    std::vector<float> processed_;  // scratch for the processor's row
    std::vector<float> pending_;    // features of committed rows not yet in the draft cache
    uint32_t pending_rows_ = 0;
    SpecStats stats_;
    std::unique_ptr<DraftLengthController> length_;  // kept across calls: costs are the machine's
    bool calibrated_ = false;
    std::vector<int32_t> all_ids_;  // 0..n_vocab-1: the support of a full-vocabulary q
};

}  // namespace dflash
