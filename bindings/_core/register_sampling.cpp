// The sampler pieces exposed for statistical tests of exactness.
#include <pybind11/numpy.h>
#include <pybind11/stl.h>

#include <map>
#include <utility>

#include "dflash/error.h"
#include "dflash/sampling.h"
#include "register.h"

namespace {

dflash::SparseDist dense_to_sparse(const py::array_t<float, py::array::c_style | py::array::forcecast> & a) {
    dflash::SparseDist d;
    for (py::ssize_t i = 0; i < a.shape(0); ++i) {
        if (a.at(i) > 0.0f) {
            d.ids.push_back((int32_t)i);
            d.probs.push_back(a.at(i));
        }
    }
    return d;
}

using DenseArray = py::array_t<float, py::array::c_style | py::array::forcecast>;

// p and q of a test over the same vocabulary, as the sampler takes them
std::pair<dflash::SparseDist, dflash::SparseDist> target_and_draft(const DenseArray & p, const DenseArray & q) {
    if (p.ndim() != 1 || q.ndim() != 1 || p.shape(0) != q.shape(0)) {
        throw dflash::Error("p and q must be 1-D arrays of the same length");
    }
    auto pq = std::make_pair(dense_to_sparse(p), dense_to_sparse(q));
    if (pq.first.ids.empty() || pq.second.ids.empty()) throw dflash::Error("p and q need positive mass");
    return pq;
}

py::array_t<float> dense(const dflash::SparseDist & d, py::ssize_t n) {
    py::array_t<float> out(n);
    std::fill(out.mutable_data(), out.mutable_data() + n, 0.0f);
    for (size_t i = 0; i < d.ids.size(); ++i) out.mutable_data()[d.ids[i]] = d.probs[i];
    return out;
}

}  // namespace

void register_sampling(py::module_ & m) {
    m.def(
        "speculative_sample_histogram",
        [](py::array_t<float, py::array::c_style | py::array::forcecast> p,
           py::array_t<float, py::array::c_style | py::array::forcecast> q, uint64_t n_draws, uint64_t seed) {
            const auto [ps, qs] = target_and_draft(p, q);
            py::array_t<int64_t> counts(p.shape(0));
            std::fill(counts.mutable_data(), counts.mutable_data() + p.shape(0), 0);
            uint64_t accepted = 0;
            {
                py::gil_scoped_release nogil;
                dflash::Rng rng(seed);
                int64_t * c = counts.mutable_data();
                for (uint64_t i = 0; i < n_draws; ++i) {
                    const int32_t d = dflash::sample(qs, rng);
                    const auto o = dflash::verify_draft_token(ps, qs, d, rng);
                    c[o.token]++;
                    accepted += o.accepted;
                }
            }
            return py::make_tuple(counts, accepted);
        },
        py::arg("p"), py::arg("q"), py::arg("n_draws"), py::arg("seed") = 0,
        "Draw d ~ q, verify it against p with the rejection step; histogram of the emitted token and the accept "
        "count.");
    m.def(
        "gumbel_histogram",
        [](py::array_t<float, py::array::c_style | py::array::forcecast> p,
           py::array_t<float, py::array::c_style | py::array::forcecast> q, uint64_t n_draws, uint64_t seed) {
            const auto [ps, qs] = target_and_draft(p, q);
            py::array_t<int64_t> target(p.shape(0)), drafted(p.shape(0));
            std::fill(target.mutable_data(), target.mutable_data() + p.shape(0), 0);
            std::fill(drafted.mutable_data(), drafted.mutable_data() + p.shape(0), 0);
            uint64_t agreed = 0;
            {
                py::gil_scoped_release nogil;
                for (uint64_t i = 0; i < n_draws; ++i) {
                    const int32_t x = dflash::gumbel_pick(ps, seed, (int32_t)i);
                    const int32_t d = dflash::gumbel_pick(qs, seed, (int32_t)i);
                    target.mutable_data()[x]++;
                    drafted.mutable_data()[d]++;
                    agreed += x == d;
                }
            }
            return py::make_tuple(target, drafted, agreed);
        },
        py::arg("p"), py::arg("q"), py::arg("n_draws"), py::arg("seed") = 0,
        "Positions 0..n_draws-1 drawn from p and from q with the same seeded Gumbel noise: both histograms and "
        "how often the two draws agree.");
    m.def(
        "is_argmax",
        [](py::array_t<float, py::array::c_style | py::array::forcecast> logits, int32_t token) {
            if (logits.ndim() != 1) throw dflash::Error("logits must be a 1-D array");
            return dflash::is_argmax(logits.data(), (uint32_t)logits.shape(0), token);
        },
        py::arg("logits"), py::arg("token"),
        "Whether token is greedy decoding's choice of these logits (the first of the largest), as the verify "
        "checks an accepted row.");
    m.def(
        "target_distribution",
        [](py::array_t<float, py::array::c_style | py::array::forcecast> logits, float temperature, int32_t top_k,
           float top_p, float min_p, float typical_p) {
            dflash::SamplingParams sp{temperature, top_k, top_p, min_p, typical_p};
            if (sp.greedy()) throw dflash::Error("temperature must be > 0 for a distribution");
            return dense(dflash::target_distribution(logits.data(), (uint32_t)logits.shape(0), sp), logits.shape(0));
        },
        py::arg("logits"), py::arg("temperature"), py::arg("top_k") = 0, py::arg("top_p") = 1.0f,
        py::arg("min_p") = 0.0f, py::arg("typical_p") = 1.0f);
    m.def(
        "mirostat_step",
        [](py::array_t<float, py::array::c_style | py::array::forcecast> logits, int32_t mode, float tau, float eta,
           float mu, int32_t token) {
            dflash::SamplingParams sp;
            sp.mirostat = mode;
            sp.mirostat_tau = tau;
            sp.mirostat_eta = eta;
            const auto d = dflash::mirostat_distribution(logits.data(), (uint32_t)logits.shape(0), sp, mu);
            const float next_mu = dflash::mirostat_update(d, token, sp, mu);
            return py::make_tuple(dense(d, logits.shape(0)), next_mu);
        },
        py::arg("logits"), py::arg("mode"), py::arg("tau"), py::arg("eta"), py::arg("mu"), py::arg("token"),
        "Mirostat's distribution at mu, and mu after `token` was drawn from it.");
    m.def(
        "shape_logits",
        [](py::array_t<float, py::array::c_style | py::array::forcecast> logits, const std::vector<int32_t> & generated,
           float repeat_penalty, float frequency_penalty, float presence_penalty, int32_t penalty_last_n,
           const std::map<int32_t, float> & logit_bias) {
            if (logits.ndim() != 1) throw dflash::Error("logits must be a 1-D array");
            dflash::SamplingParams sp;
            sp.repeat_penalty = repeat_penalty;
            sp.frequency_penalty = frequency_penalty;
            sp.presence_penalty = presence_penalty;
            sp.penalty_last_n = penalty_last_n;
            sp.logit_bias.assign(logit_bias.begin(), logit_bias.end());
            dflash::TokenWindow window(sp.penalizes() ? penalty_last_n : 0);
            for (int32_t t : generated) window.push(t);
            std::vector<float> scratch;
            const float * out = dflash::shape_logits(logits.data(), (uint32_t)logits.shape(0), sp, window, scratch);
            return py::array_t<float>(logits.shape(0), out);
        },
        py::arg("logits"), py::arg("generated"), py::arg("repeat_penalty") = 1.0f, py::arg("frequency_penalty") = 0.0f,
        py::arg("presence_penalty") = 0.0f, py::arg("penalty_last_n") = 64,
        py::arg("logit_bias") = std::map<int32_t, float>{},
        "The logits the sampler sees after `generated` (logit bias, then llama.cpp's penalties over the last "
        "penalty_last_n tokens).");
}
