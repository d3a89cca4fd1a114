#include "dflash/sampling.h"

#include <algorithm>
#include <cmath>
#include <numeric>

#include "dflash/error.h"

namespace dflash {

float SparseDist::prob_of(int32_t id) const {
    for (size_t i = 0; i < ids.size(); ++i) {
        if (ids[i] == id) return probs[i];
    }
    return 0.0f;
}

void TokenWindow::push(int32_t token) {
    if (n_ <= 0) return;
    if ((int32_t) last_.size() == n_) {
        const auto old = counts_.find(last_.front());
        if (--old->second == 0) counts_.erase(old);
        last_.pop_front();
    }
    last_.push_back(token);
    counts_[token]++;
}

const float * shape_logits(const float * logits, uint32_t n_vocab, const SamplingParams & params,
                           const TokenWindow & window, std::vector<float> & scratch) {
    const bool penalize = params.penalizes() && !window.counts().empty();
    if (params.logit_bias.empty() && !penalize) return logits;
    scratch.assign(logits, logits + n_vocab);
    for (const auto & [id, bias] : params.logit_bias) {
        if (id >= 0 && (uint32_t) id < n_vocab) scratch[(size_t) id] += bias;
    }
    if (penalize) {
        // as llama.cpp: a positive logit is divided by the repeat penalty, a negative one multiplied
        for (const auto & [id, count] : window.counts()) {
            if (id < 0 || (uint32_t) id >= n_vocab) continue;
            float & l = scratch[(size_t) id];
            l = l <= 0.0f ? l * params.repeat_penalty : l / params.repeat_penalty;
            l -= (float) count * params.frequency_penalty + params.presence_penalty;
        }
    }
    return scratch.data();
}

void check_grammar_text(const std::string & gbnf) {
    const size_t n = gbnf.size();
    auto skip_space = [&](size_t i) {
        while (i < n && (gbnf[i] == ' ' || gbnf[i] == '\t' || gbnf[i] == '\n' || gbnf[i] == '\r')) ++i;
        return i;
    };
    auto number = [&](size_t & i, uint64_t & value) {  // false when there are no digits (or too many)
        const size_t start = i;
        value = 0;
        while (i < n && gbnf[i] >= '0' && gbnf[i] <= '9' && i - start < 19) value = value * 10 + (uint64_t) (gbnf[i++] - '0');
        return i > start;
    };
    uint32_t depth = 0;
    for (size_t i = 0; i < n; ++i) {
        const char c = gbnf[i];
        if (c == '(' && ++depth > kMaxGrammarNesting) {
            throw Error("grammar: groups nested more than " + std::to_string(kMaxGrammarNesting) +
                        " deep (libllama's parser recurses per level)");
        } else if (c == ')' && depth > 0) {
            --depth;
        } else if (c == '"' || c == '[') {  // a literal or a character class: skip it, escapes included
            const char close = c == '"' ? '"' : ']';
            for (++i; i < n && gbnf[i] != close; ++i) {
                if (gbnf[i] == '\\') ++i;
            }
        } else if (c == '#') {
            while (i < n && gbnf[i] != '\n') ++i;
        } else if (c == '{') {
            size_t j = skip_space(i + 1);
            uint64_t lo = 0, hi = 0;
            if (!number(j, lo)) continue;
            j = skip_space(j);
            if (j >= n || gbnf[j] != ',') continue;
            j = skip_space(j + 1);
            // the parser treats a maximum above 2000 as none
            if (number(j, hi) && hi <= 2000 && lo > hi) {
                const size_t end = skip_space(j);
                throw Error("grammar: the repetition " + gbnf.substr(i, (end < n && gbnf[end] == '}' ? end + 1 : j) - i) +
                            " has its minimum above its maximum");
            }
        }
    }
}

int32_t argmax(const float * logits, uint32_t n_vocab) {
    return (int32_t) (std::max_element(logits, logits + n_vocab) - logits);
}

TokenLogprob token_logprob(const float * logits, uint32_t n_vocab, int32_t token, uint32_t n_top,
                           std::vector<int32_t> & scratch) {
    const float mx = *std::max_element(logits, logits + n_vocab);
    double z = 0.0;
    for (uint32_t i = 0; i < n_vocab; ++i) z += std::exp((double) logits[i] - mx);
    const double log_z = mx + std::log(z);
    TokenLogprob out;
    out.logprob = (float) (logits[token] - log_z);
    n_top = std::min(n_top, n_vocab);
    if (n_top > 0) {
        scratch.resize(n_vocab);
        std::iota(scratch.begin(), scratch.end(), 0);
        // ties by id, so that the order does not depend on the partial sort
        auto higher = [&](int32_t a, int32_t b) { return logits[a] > logits[b] || (logits[a] == logits[b] && a < b); };
        std::partial_sort(scratch.begin(), scratch.begin() + n_top, scratch.end(), higher);
        for (uint32_t i = 0; i < n_top; ++i) out.top.emplace_back(scratch[i], (float) (logits[scratch[i]] - log_z));
    }
    return out;
}

SparseDist softmax_on(const int32_t * ids, const float * values, uint32_t n, float temperature) {
    SparseDist d;
    d.ids.assign(ids, ids + n);
    d.probs.resize(n);
    const float mx = *std::max_element(values, values + n), inv_t = 1.0f / temperature;
    // float exp (a row of a 152k vocabulary in ~0.3 ms instead of ~1 ms in double), summed in double
    for (uint32_t i = 0; i < n; ++i) d.probs[i] = std::exp((values[i] - mx) * inv_t);
    double z = 0.0;
    for (uint32_t i = 0; i < n; ++i) z += d.probs[i];
    const float inv = (float) (1.0 / z);
    for (float & p : d.probs) p *= inv;
    return d;
}

namespace {
std::vector<float> logits_of(const float * logits, const std::vector<int32_t> & ids) {
    std::vector<float> v(ids.size());
    for (size_t i = 0; i < ids.size(); ++i) v[i] = logits[ids[i]];
    return v;
}
}  // namespace

// Top-p over the whole vocabulary: the first n ids in the `before` order (most likely first, ties by id)
// whose probability mass reaches top_p, moved to ids[0..n) in no particular order. Quickselect on that
// order, O(n_vocab) expected: sorting even a head of 256 costs a 152k vocabulary milliseconds per verified
// row, and a flat distribution's nucleus (tens of thousands of tokens) tens of milliseconds.
template <typename Before>
size_t nucleus(const float * logits, std::vector<int32_t> & ids, float top_p, Before before) {
    const size_t V = ids.size();
    const float mx = *std::max_element(logits, logits + V);
    std::vector<float> p(V);
    for (size_t i = 0; i < V; ++i) p[i] = std::exp(logits[i] - mx);
    double z = 0.0;
    for (size_t i = 0; i < V; ++i) z += p[i];
    double need = (double) top_p * z;  // mass still to take, from ids[lo..hi)
    size_t lo = 0, hi = V;
    uint64_t state = 0x9E3779B97F4A7C15ull;  // pivots: fixed pseudo-random, so the result does not depend on luck
    while (hi - lo > 32) {
        state = state * 6364136223846793005ull + 1442695040888963407ull;
        const int32_t pivot = ids[lo + (size_t) ((state >> 33) % (hi - lo))];
        // [lo, mid): before the pivot; then the pivot; then (mid + 1, hi): after it
        const auto mid_it = std::partition(ids.begin() + (ptrdiff_t) lo, ids.begin() + (ptrdiff_t) hi,
                                           [&](int32_t id) { return before(id, pivot); });
        const size_t mid = (size_t) (mid_it - ids.begin());
        std::iter_swap(mid_it, std::find(mid_it, ids.begin() + (ptrdiff_t) hi, pivot));
        double mass = 0.0;
        for (size_t i = lo; i < mid; ++i) mass += p[(size_t) ids[i]];
        if (mass >= need) {
            hi = mid;  // the nucleus ends before the pivot
        } else if (mass + p[(size_t) pivot] >= need) {
            return mid + 1;  // ... at the pivot
        } else {
            need -= mass + p[(size_t) pivot];
            lo = mid + 1;
        }
    }
    std::sort(ids.begin() + (ptrdiff_t) lo, ids.begin() + (ptrdiff_t) hi, before);
    for (size_t i = lo; i < hi; ++i) {
        need -= p[(size_t) ids[i]];
        if (need <= 0.0) return i + 1;
    }
    return std::max<size_t>(1, hi);  // rounding: the whole rest
}

SparseDist target_distribution(const float * logits, uint32_t n_vocab, const SamplingParams & params) {
    // llama-cpp-python's chain: top-k, top-p, min-p on the raw logits, then the
    // temperature on what survives, then the softmax that is sampled
    const bool cut_k = params.top_k > 0 && (uint32_t) params.top_k < n_vocab;
    const bool cut_p = params.top_p < 1.0f;
    std::vector<int32_t> ids;
    std::vector<float> vals;
    if (!cut_k && !cut_p) {
        // no ordering needed (a real vocabulary has 150k entries: no sort per verified row);
        // min-p keeps p_i >= min_p * p_max  <=>  l_i >= l_max + ln(min_p)
        const float mx = *std::max_element(logits, logits + n_vocab);
        const double thr = params.min_p > 0.0f ? (double) mx + std::log((double) params.min_p) : -INFINITY;
        ids.reserve(n_vocab);
        vals.reserve(n_vocab);
        for (uint32_t i = 0; i < n_vocab; ++i) {
            if ((double) logits[i] >= thr) {
                ids.push_back((int32_t) i);
                vals.push_back(logits[i]);
            }
        }
        return softmax_on(ids.data(), vals.data(), (uint32_t) ids.size(), params.temperature);
    }
    ids.resize(n_vocab);
    std::iota(ids.begin(), ids.end(), 0);
    auto by_logit = [&](int32_t a, int32_t b) { return logits[a] != logits[b] ? logits[a] > logits[b] : a < b; };
    size_t n = 0;
    if (cut_k) {
        n = (size_t) params.top_k;
        std::partial_sort(ids.begin(), ids.begin() + n, ids.end(), by_logit);
        ids.resize(n);
        if (cut_p) {
            const SparseDist raw = softmax_on(ids.data(), logits_of(logits, ids).data(), (uint32_t) n, 1.0f);
            double cum = 0.0;
            size_t i = 0;
            while (i < n && cum < params.top_p) cum += raw.probs[i++];
            n = std::max<size_t>(1, i);
        }
    } else {
        n = nucleus(logits, ids, params.top_p, by_logit);
    }
    ids.resize(n);
    vals = logits_of(logits, ids);
    if (params.min_p > 0.0f) {  // p_i >= min_p * p_max among the survivors (the most likely always survives)
        const double thr = (double) *std::max_element(vals.begin(), vals.end()) + std::log((double) params.min_p);
        size_t kept = 0;
        for (size_t i = 0; i < n; ++i) {
            if ((double) vals[i] >= thr) {
                ids[kept] = ids[i];
                vals[kept++] = vals[i];
            }
        }
        n = kept;
    }
    return softmax_on(ids.data(), vals.data(), (uint32_t) n, params.temperature);
}

int32_t sample(const SparseDist & d, Rng & rng) {
    std::uniform_real_distribution<double> uni(0.0, 1.0);
    const double total = std::accumulate(d.probs.begin(), d.probs.end(), 0.0);
    double u = uni(rng) * total;
    for (size_t i = 0; i < d.ids.size(); ++i) {
        u -= d.probs[i];
        if (u < 0.0) return d.ids[i];
    }
    // rounding: the last id with mass
    for (size_t i = d.ids.size(); i-- > 0;) {
        if (d.probs[i] > 0.0f) return d.ids[i];
    }
    return d.ids.empty() ? 0 : d.ids[0];
}

RejectionOutcome verify_draft_token(const SparseDist & p, const SparseDist & q, int32_t drafted, Rng & rng) {
    const double pd = p.prob_of(drafted);
    const double qd = q.prob_of(drafted);
    std::uniform_real_distribution<double> uni(0.0, 1.0);
    if (qd > 0.0 && uni(rng) * qd < pd) {  // u < p/q, written without dividing
        return {drafted, true};
    }
    // residual max(p - q, 0) lives on p's support; q looked up densely (q may span the vocabulary)
    int32_t max_id = 0;
    for (int32_t id : q.ids) max_id = std::max(max_id, id);
    std::vector<float> q_dense((size_t) max_id + 1, 0.0f);
    for (size_t i = 0; i < q.ids.size(); ++i) q_dense[(size_t) q.ids[i]] = q.probs[i];
    SparseDist r;
    r.ids.reserve(p.ids.size());
    r.probs.reserve(p.ids.size());
    double mass = 0.0;
    for (size_t i = 0; i < p.ids.size(); ++i) {
        const int32_t id = p.ids[i];
        const float diff = p.probs[i] - (id <= max_id ? q_dense[(size_t) id] : 0.0f);
        if (diff > 0.0f) {
            r.ids.push_back(id);
            r.probs.push_back(diff);
            mass += diff;
        }
    }
    if (mass <= 0.0) return {sample(p, rng), false};
    return {sample(r, rng), false};
}

}  // namespace dflash
