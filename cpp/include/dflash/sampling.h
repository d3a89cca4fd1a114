#pragma once
// Target distributions shaped exactly as plain decoding shapes them
// (temperature, top-k, top-p, min-p), and the exact rejection step of
// speculative sampling with the drafter's real q.
#include <cstdint>
#include <random>
#include <vector>

namespace dflash {

struct SamplingParams {
    float temperature = 0.0f;  // 0 = greedy
    int32_t top_k = 0;         // 0 = off
    float top_p = 1.0f;        // 1 = off
    float min_p = 0.0f;        // 0 = off
    bool greedy() const { return temperature <= 0.0f; }
};

using Rng = std::mt19937_64;

// A distribution on a subset of the vocabulary (ids with their probabilities).
struct SparseDist {
    std::vector<int32_t> ids;
    std::vector<float> probs;
    float prob_of(int32_t id) const;
};

int32_t argmax(const float * logits, uint32_t n_vocab);

// p = the target's sampling distribution for these logits (params.temperature > 0).
SparseDist target_distribution(const float * logits, uint32_t n_vocab, const SamplingParams & params);

// softmax(values / temperature) on the given ids
SparseDist softmax_on(const int32_t * ids, const float * values, uint32_t n, float temperature);

int32_t sample(const SparseDist & d, Rng & rng);

// One verification of a drafted token d ~ q against p: returns d when accepted,
// else a token drawn from normalize(max(p - q, 0)) (p itself if that is empty).
struct RejectionOutcome {
    int32_t token;
    bool accepted;
};
RejectionOutcome verify_draft_token(const SparseDist & p, const SparseDist & q, int32_t drafted, Rng & rng);

}  // namespace dflash
