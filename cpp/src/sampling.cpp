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
    if ((int32_t)last_.size() == n_) {
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
        if (id >= 0 && (uint32_t)id < n_vocab) scratch[(size_t)id] += bias;
    }
    if (penalize) {
        // as llama.cpp: a positive logit is divided by the repeat penalty, a negative one multiplied
        for (const auto & [id, count] : window.counts()) {
            if (id < 0 || (uint32_t)id >= n_vocab) continue;
            float & l = scratch[(size_t)id];
            l = l <= 0.0f ? l * params.repeat_penalty : l / params.repeat_penalty;
            l -= (float)count * params.frequency_penalty + params.presence_penalty;
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
        while (i < n && gbnf[i] >= '0' && gbnf[i] <= '9' && i - start < 19)
            value = value * 10 + (uint64_t)(gbnf[i++] - '0');
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
                throw Error("grammar: the repetition " +
                            gbnf.substr(i, (end < n && gbnf[end] == '}' ? end + 1 : j) - i) +
                            " has its minimum above its maximum");
            }
        }
    }
}

int32_t argmax(const float * logits, uint32_t n_vocab) {
    return (int32_t)(std::max_element(logits, logits + n_vocab) - logits);
}

bool is_argmax(const float * logits, uint32_t n_vocab, int32_t token) {
    if (token < 0 || (uint32_t)token >= n_vocab) return false;
    const float t = logits[token];
    // argmax is the first of the largest: nothing before the token as large, nothing after it larger
    uint32_t beaten = 0;
    for (uint32_t i = 0; i < (uint32_t)token; ++i) beaten |= (uint32_t)(logits[i] >= t);
    for (uint32_t i = (uint32_t)token + 1; i < n_vocab; ++i) beaten |= (uint32_t)(logits[i] > t);
    return beaten == 0;
}

TokenLogprob token_logprob(const float * logits, uint32_t n_vocab, int32_t token, uint32_t n_top,
                           std::vector<int32_t> & scratch) {
    const float mx = *std::max_element(logits, logits + n_vocab);
    double z = 0.0;
    for (uint32_t i = 0; i < n_vocab; ++i) z += std::exp((double)logits[i] - mx);
    const double log_z = mx + std::log(z);
    TokenLogprob out;
    out.logprob = (float)(logits[token] - log_z);
    n_top = std::min(n_top, n_vocab);
    if (n_top > 0) {
        scratch.resize(n_vocab);
        std::iota(scratch.begin(), scratch.end(), 0);
        // ties by id, so that the order does not depend on the partial sort
        auto higher = [&](int32_t a, int32_t b) { return logits[a] > logits[b] || (logits[a] == logits[b] && a < b); };
        std::partial_sort(scratch.begin(), scratch.begin() + n_top, scratch.end(), higher);
        for (uint32_t i = 0; i < n_top; ++i) out.top.emplace_back(scratch[i], (float)(logits[scratch[i]] - log_z));
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
    const float inv = (float)(1.0 / z);
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

// exp(logit - max) of the given ids, indexed by id (other entries are left as they were)
void weights_of(const float * logits, const std::vector<int32_t> & ids, std::vector<float> & w, uint32_t n_vocab) {
    float mx = -INFINITY;
    for (int32_t id : ids) mx = std::max(mx, logits[id]);
    w.resize(n_vocab);
    for (int32_t id : ids) w[(size_t)id] = std::exp(logits[id] - mx);
}

// The shortest head of ids in the `before` order whose weight reaches `fraction` of the ids' total weight
// (exceeds it, when strict), moved to ids[0..n) in no particular order; returns n >= 1. Quickselect on that
// order, O(n) expected: sorting even a head of 256 costs a 152k vocabulary milliseconds per verified row,
// and a flat distribution's nucleus (tens of thousands of tokens) tens of milliseconds.
template <typename Before>
size_t head_with_mass(const std::vector<float> & w, std::vector<int32_t> & ids, double fraction, bool strict,
                      Before before) {
    double z = 0.0;
    for (int32_t id : ids) z += w[(size_t)id];
    auto reached = [strict](double mass, double need) { return strict ? mass > need : mass >= need; };
    double need = fraction * z;  // mass still to take, from ids[lo..hi)
    size_t lo = 0, hi = ids.size();
    uint64_t state = 0x9E3779B97F4A7C15ull;  // pivots: fixed pseudo-random, so the result does not depend on luck
    while (hi - lo > 32) {
        state = state * 6364136223846793005ull + 1442695040888963407ull;
        const int32_t pivot = ids[lo + (size_t)((state >> 33) % (hi - lo))];
        // [lo, mid): before the pivot; then the pivot; then (mid + 1, hi): after it
        const auto mid_it = std::partition(ids.begin() + (ptrdiff_t)lo, ids.begin() + (ptrdiff_t)hi,
                                           [&](int32_t id) { return before(id, pivot); });
        const size_t mid = (size_t)(mid_it - ids.begin());
        std::iter_swap(mid_it, std::find(mid_it, ids.begin() + (ptrdiff_t)hi, pivot));
        double mass = 0.0;
        for (size_t i = lo; i < mid; ++i) mass += w[(size_t)ids[i]];
        if (reached(mass, need)) {
            hi = mid;  // the head ends before the pivot
        } else if (reached(mass + w[(size_t)pivot], need)) {
            return mid + 1;  // ... at the pivot
        } else {
            need -= mass + w[(size_t)pivot];
            lo = mid + 1;
        }
    }
    std::sort(ids.begin() + (ptrdiff_t)lo, ids.begin() + (ptrdiff_t)hi, before);
    double mass = 0.0;
    for (size_t i = lo; i < hi; ++i) {
        mass += w[(size_t)ids[i]];
        if (reached(mass, need)) return i + 1;
    }
    return std::max<size_t>(1, hi);  // rounding: the whole rest
}

// llama.cpp's locally typical sampling: the tokens whose surprise -ln p is closest to the entropy H of p
// (p over ids), the fewest whose mass exceeds typical_p; kept in ids[0..n), returns n
size_t typical_set(const float * logits, std::vector<int32_t> & ids, float typical_p, uint32_t n_vocab) {
    std::vector<float> w;
    weights_of(logits, ids, w, n_vocab);
    double z = 0.0;
    for (int32_t id : ids) z += w[(size_t)id];
    double entropy = 0.0;
    for (int32_t id : ids) {
        const double p = w[(size_t)id] / z;
        if (p > 0.0) entropy -= p * std::log(p);  // p ln p -> 0 (libllama's float gives NaN at p = 0)
    }
    std::vector<float> score(n_vocab);
    for (int32_t id : ids) score[(size_t)id] = (float)std::fabs(-std::log(w[(size_t)id] / z) - entropy);
    auto more_typical = [&](int32_t a, int32_t b) { return score[a] != score[b] ? score[a] < score[b] : a < b; };
    return head_with_mass(w, ids, typical_p, /*strict=*/true, more_typical);
}

SparseDist target_distribution(const float * logits, uint32_t n_vocab, const SamplingParams & params) {
    // llama-cpp-python's chain: top-k, typical, top-p, min-p on the raw logits, then the
    // temperature on what survives, then the softmax that is sampled
    const bool cut_k = params.top_k > 0 && (uint32_t)params.top_k < n_vocab;
    const bool cut_typical = params.typical_p < 1.0f;
    const bool cut_p = params.top_p < 1.0f;
    std::vector<int32_t> ids;
    std::vector<float> vals;
    if (!cut_k && !cut_typical && !cut_p) {
        // no ordering needed (a real vocabulary has 150k entries: no sort per verified row);
        // min-p keeps p_i >= min_p * p_max  <=>  l_i >= l_max + ln(min_p)
        const float mx = *std::max_element(logits, logits + n_vocab);
        const double thr = params.min_p > 0.0f ? (double)mx + std::log((double)params.min_p) : -INFINITY;
        ids.reserve(n_vocab);
        vals.reserve(n_vocab);
        for (uint32_t i = 0; i < n_vocab; ++i) {
            if ((double)logits[i] >= thr) {
                ids.push_back((int32_t)i);
                vals.push_back(logits[i]);
            }
        }
        return softmax_on(ids.data(), vals.data(), (uint32_t)ids.size(), params.temperature);
    }
    ids.resize(n_vocab);
    std::iota(ids.begin(), ids.end(), 0);
    auto by_logit = [&](int32_t a, int32_t b) { return logits[a] != logits[b] ? logits[a] > logits[b] : a < b; };
    bool sorted = false;  // ids in by_logit order
    if (cut_k) {
        std::partial_sort(ids.begin(), ids.begin() + params.top_k, ids.end(), by_logit);
        ids.resize((size_t)params.top_k);
        sorted = true;
    }
    if (cut_typical) {
        ids.resize(typical_set(logits, ids, params.typical_p, n_vocab));
        sorted = false;
    }
    if (cut_p && sorted) {
        const SparseDist raw = softmax_on(ids.data(), logits_of(logits, ids).data(), (uint32_t)ids.size(), 1.0f);
        double cum = 0.0;
        size_t i = 0;
        while (i < ids.size() && cum < params.top_p) cum += raw.probs[i++];
        ids.resize(std::max<size_t>(1, i));
    } else if (cut_p) {
        std::vector<float> w;
        weights_of(logits, ids, w, n_vocab);
        ids.resize(head_with_mass(w, ids, params.top_p, /*strict=*/false, by_logit));
    }
    size_t n = ids.size();
    vals = logits_of(logits, ids);
    if (params.min_p > 0.0f) {  // p_i >= min_p * p_max among the survivors (the most likely always survives)
        const double thr = (double)*std::max_element(vals.begin(), vals.end()) + std::log((double)params.min_p);
        size_t kept = 0;
        for (size_t i = 0; i < n; ++i) {
            if ((double)vals[i] >= thr) {
                ids[kept] = ids[i];
                vals[kept++] = vals[i];
            }
        }
        n = kept;
    }
    return softmax_on(ids.data(), vals.data(), (uint32_t)n, params.temperature);
}

SparseDist mirostat_distribution(const float * logits, uint32_t n_vocab, const SamplingParams & params, float mu) {
    std::vector<int32_t> ids;
    if (params.mirostat == 2) {
        // v2: the tokens whose surprise -log2 p is at most mu (the most likely one at least):
        // p_i >= 2^-mu  <=>  l_i >= l_max + ln z - mu ln 2
        const float mx = *std::max_element(logits, logits + n_vocab);
        double z = 0.0;
        for (uint32_t i = 0; i < n_vocab; ++i) z += std::exp((double)logits[i] - mx);
        const double thr = (double)mx + std::log(z) - (double)mu * std::log(2.0);
        for (uint32_t i = 0; i < n_vocab; ++i) {
            if ((double)logits[i] >= thr) ids.push_back((int32_t)i);
        }
        if (ids.empty()) ids.push_back(argmax(logits, n_vocab));
    } else {
        // v1: the Zipf exponent s of the 100 most likely tokens' probabilities (least squares of
        // ln(p_i / p_i+1) on ln((i + 2) / (i + 1))), then the top k that makes the expected surprise mu
        constexpr uint32_t kZipfTokens = 100;
        const uint32_t m = std::min(kZipfTokens, n_vocab);
        ids.resize(n_vocab);
        std::iota(ids.begin(), ids.end(), 0);
        auto by_logit = [&](int32_t a, int32_t b) { return logits[a] != logits[b] ? logits[a] > logits[b] : a < b; };
        std::partial_sort(ids.begin(), ids.begin() + m, ids.end(), by_logit);
        float sum_tb = 0.0f, sum_tt = 0.0f;
        for (uint32_t i = 0; i + 1 < m; ++i) {
            const float t = std::log((float)(i + 2) / (float)(i + 1));
            const float b = logits[ids[i]] - logits[ids[i + 1]];  // ln(p_i / p_i+1)
            sum_tb += t * b;
            sum_tt += t * t;
        }
        const float s = sum_tb / sum_tt, eps = s - 1.0f;
        const float k = std::pow(eps * std::pow(2.0f, mu) / (1.0f - std::pow((float)n_vocab, -eps)), 1.0f / s);
        // libllama takes int(k); a k that does not fit (inf, NaN: a flat or degenerate head) converts to
        // INT_MIN on x86, which its max(k, 1) turns into greedy decoding: the same here on every CPU
        const bool fits = std::isfinite(k) && k < 2147483648.0f && k > -2147483649.0f;
        const uint32_t keep = std::min<uint32_t>(n_vocab, (uint32_t)std::max(fits ? (int64_t)k : 0, (int64_t)1));
        if (keep > m) std::partial_sort(ids.begin() + m, ids.begin() + keep, ids.end(), by_logit);
        ids.resize(keep);
    }
    const std::vector<float> vals = logits_of(logits, ids);
    return softmax_on(ids.data(), vals.data(), (uint32_t)ids.size(), 1.0f);
}

float mirostat_update(const SparseDist & d, int32_t token, const SamplingParams & params, float mu) {
    const float surprise = -std::log2(d.prob_of(token));
    return mu - params.mirostat_eta * (surprise - params.mirostat_tau);
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

namespace {

uint64_t splitmix64(uint64_t x) {
    x += 0x9E3779B97F4A7C15ull;
    x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9ull;
    x = (x ^ (x >> 27)) * 0x94D049BB133111EBull;
    return x ^ (x >> 31);
}

}  // namespace

int32_t gumbel_pick(const SparseDist & d, uint64_t seed, int32_t pos) {
    // argmax log p + G = argmin E / p with E = -log(u) ~ Exp(1); u from a hash of (seed, pos, id)
    const uint64_t key = splitmix64(seed ^ splitmix64((uint64_t)(uint32_t)pos));
    const auto uniform = [key](int32_t id) {  // in (0, 1)
        return ((double)(splitmix64(key ^ (uint64_t)(uint32_t)id) >> 11) + 0.5) * 0x1.0p-53;
    };
    // start from the most likely token, whose score bounds the rest: since -log(u) >= 1 - u, a token with
    // 1 - u >= best * p cannot win, and most tokens of a large vocabulary are ruled out so, without a log
    size_t first = 0;
    for (size_t i = 1; i < d.ids.size(); ++i) {
        if (d.probs[i] > d.probs[first]) first = i;
    }
    if (d.ids.empty() || !(d.probs[first] > 0.0f)) return d.ids.empty() ? 0 : d.ids[0];
    int32_t best = d.ids[first];
    double best_score = -std::log(uniform(best)) / d.probs[first];
    for (size_t i = 0; i < d.ids.size(); ++i) {
        if (i == first || !(d.probs[i] > 0.0f)) continue;
        const double u = uniform(d.ids[i]);
        const double bound = best_score * d.probs[i];
        if (1.0 - u >= bound) continue;
        const double score = -std::log(u) / d.probs[i];
        if (score < best_score) {
            best_score = score;
            best = d.ids[i];
        }
    }
    return best;
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
    std::vector<float> q_dense((size_t)max_id + 1, 0.0f);
    for (size_t i = 0; i < q.ids.size(); ++i) q_dense[(size_t)q.ids[i]] = q.probs[i];
    SparseDist r;
    r.ids.reserve(p.ids.size());
    r.probs.reserve(p.ids.size());
    double mass = 0.0;
    for (size_t i = 0; i < p.ids.size(); ++i) {
        const int32_t id = p.ids[i];
        const float diff = p.probs[i] - (id <= max_id ? q_dense[(size_t)id] : 0.0f);
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
