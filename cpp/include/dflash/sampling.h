#pragma once
// Target distributions shaped exactly as plain decoding shapes them
// (logit bias, repetition penalties, temperature, top-k, top-p, min-p), and the
// exact rejection step of speculative sampling with the drafter's real q.
#include <cstdint>
#include <deque>
#include <functional>
#include <random>
#include <string>
#include <unordered_map>
#include <utility>
#include <vector>

#include "dflash/reasoning_budget.h"

namespace dflash {

struct SamplingParams {
    float temperature = 0.0f;  // 0 = greedy
    int32_t top_k = 0;         // 0 = off
    float top_p = 1.0f;        // 1 = off
    float min_p = 0.0f;        // 0 = off
    float typical_p = 1.0f;    // 1 = off; locally typical sampling, between top-k and top-p
    // llama.cpp's Mirostat samplers (1 = v1, 2 = v2; 0 = off) as llama-cpp-python chains them: instead of
    // top-k .. temperature (the temperature only decides greedy vs sampled), with mu starting at 2 tau
    // and moved by eta per token towards a surprise of tau bits
    int32_t mirostat = 0;
    float mirostat_tau = 5.0f;
    float mirostat_eta = 0.1f;
    // llama.cpp's penalties sampler over the last penalty_last_n generated tokens (the prompt is not
    // counted, as in llama-cpp-python), applied in greedy decoding too
    float repeat_penalty = 1.0f;                        // 1 = off
    float frequency_penalty = 0.0f;                     // 0 = off
    float presence_penalty = 0.0f;                      // 0 = off
    int32_t penalty_last_n = 64;                        // 0 = off
    std::vector<std::pair<int32_t, float>> logit_bias;  // added to the raw logits first
    // a GBNF grammar the output must follow (empty: none), applied after the penalties as llama-cpp-python
    // does; every verified row is masked with the grammar's state after the tokens before it
    std::string grammar;
    std::string grammar_root = "root";
    // non-empty: the grammar is lazy (llama.cpp's tool-call grammars): it constrains nothing until the
    // output contains one of these literal words, then constrains the text from that word on
    std::vector<std::string> grammar_triggers;
    // tests: mask the whole vocabulary with the grammar for every row (otherwise the grammar is asked
    // about the most likely tokens first where that decides the row: greedy, and sampling with top-k)
    bool grammar_full_pass = false;
    // llama-server's reasoning budget (see reasoning_budget.h); with a lazy grammar it also holds the grammar
    // back while the model thinks
    ReasoningBudgetParams reasoning;
    // not sampling, what each emitted token reports: -1 = nothing, n >= 0 = its log-probability and
    // the n most likely tokens' (see TokenLogprob)
    int32_t n_logprobs = -1;
    // with n_logprobs >= 0, start() also reports prompt tokens 1..n-1 (each under the row before it): the
    // whole prompt is decoded again (no prefix reuse: reused rows have no logits) with every row's logits
    bool prompt_logprobs = false;
    // llama-cpp-python's logits_processor: rewrites a row of raw logits in place (before logit_bias and
    // the penalties) given the tokens before the one it chooses (prompt included). It is called once per
    // token the loop emits, in order, with the same tokens plain decoding would pass, so even a stateful
    // processor sees plain decoding's calls (a step may emit tokens the caller then drops, at its end).
    std::function<void(const std::vector<int32_t> & ids, float * logits, uint32_t n_vocab)> logits_processor;
    // each emitted token's raw logits row in StepOutput::logits (llama-cpp-python's stopping_criteria read it)
    bool keep_logits = false;
    bool greedy() const { return temperature <= 0.0f; }
    bool penalizes() const {
        return penalty_last_n != 0 && (repeat_penalty != 1.0f || frequency_penalty != 0.0f || presence_penalty != 0.0f);
    }
};

// Throws Error for GBNF text that libllama 0.3.36's grammar parser would never return from or crash
// on: a repetition {m,n} with m > n (it counts n - m optional copies in unsigned arithmetic), and
// groups nested deeper than kMaxGrammarNesting (it recurses per level: 20000 levels overflowed an
// 8 MB stack; threads may have far less). Other errors are the parser's to report.
constexpr uint32_t kMaxGrammarNesting = 256;
void check_grammar_text(const std::string & gbnf);

// The generated tokens a penalty sees: the last `n` of them, with their counts.
class TokenWindow {
public:
    explicit TokenWindow(int32_t n = 0) : n_(n) {}
    void push(int32_t token);
    const std::unordered_map<int32_t, int32_t> & counts() const { return counts_; }

private:
    int32_t n_;
    std::deque<int32_t> last_;
    std::unordered_map<int32_t, int32_t> counts_;
};

// The logits the sampler sees: the raw ones plus logit_bias, then penalized for the tokens in the window,
// in llama-cpp-python's order. Returns `logits` itself when nothing changes them, else scratch.data().
const float * shape_logits(const float * logits, uint32_t n_vocab, const SamplingParams & params,
                           const TokenWindow & window, std::vector<float> & scratch);

using Rng = std::mt19937_64;

// A distribution on a subset of the vocabulary (ids with their probabilities).
struct SparseDist {
    std::vector<int32_t> ids;
    std::vector<float> probs;
    float prob_of(int32_t id) const;
};

int32_t argmax(const float * logits, uint32_t n_vocab);
// argmax(logits, n_vocab) == token, in one pass that compilers vectorize (comparisons OR-ed, no float
// reduction): a greedy verify checks each accepted row this way, 3-4x faster than the argmax over 151,936
bool is_argmax(const float * logits, uint32_t n_vocab, int32_t token);

// A token's log-probability as llama-cpp-python reports it: log-softmax of the target's raw logits
// (before logit_bias, penalties and temperature), and the n_top most likely tokens', most likely first.
struct TokenLogprob {
    float logprob = 0.0f;
    std::vector<std::pair<int32_t, float>> top;
};
// scratch: reused between calls (it holds n_vocab ids while the top is selected)
TokenLogprob token_logprob(const float * logits, uint32_t n_vocab, int32_t token, uint32_t n_top,
                           std::vector<int32_t> & scratch);

// p = the target's sampling distribution for these logits (params.temperature > 0, no Mirostat).
SparseDist target_distribution(const float * logits, uint32_t n_vocab, const SamplingParams & params);

// Mirostat (params.mirostat 1 or 2): the distribution the next token is drawn from at this mu, and mu
// after `token` was drawn from it (d from mirostat_distribution).
SparseDist mirostat_distribution(const float * logits, uint32_t n_vocab, const SamplingParams & params, float mu);
float mirostat_update(const SparseDist & d, int32_t token, const SamplingParams & params, float mu);

// softmax(values / temperature) on the given ids
SparseDist softmax_on(const int32_t * ids, const float * values, uint32_t n, float temperature);

int32_t sample(const SparseDist & d, Rng & rng);

// The token at absolute sequence position `pos` drawn from d by the Gumbel-max trick, its noise a function
// of (seed, pos, token id) alone: argmax over d's ids of log d(id) + G(seed, pos, id). Exactly distributed
// as d, and the same whoever draws it: a draft drawn from q with the same noise at the same position is
// the target's own token exactly when they agree, so seeded speculative sampling emits, token for token,
// what seeded plain sampling emits, whatever the draft lengths.
int32_t gumbel_pick(const SparseDist & d, uint64_t seed, int32_t pos);

// One verification of a drafted token d ~ q against p: returns d when accepted,
// else a token drawn from normalize(max(p - q, 0)) (p itself if that is empty).
struct RejectionOutcome {
    int32_t token;
    bool accepted;
};
RejectionOutcome verify_draft_token(const SparseDist & p, const SparseDist & q, int32_t drafted, Rng & rng);

}  // namespace dflash
