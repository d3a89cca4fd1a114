// dflash_gguf._core.Speculator: the C++ speculative loop driven step by step
// from Python (streaming, stop strings and finish reasons live in Python).
#include <pybind11/numpy.h>
#include <pybind11/stl.h>

#include <algorithm>
#include <cmath>
#include <functional>
#include <map>
#include <optional>

#include "busy.h"
#include "dflash/cpu_threads.h"
#include "dflash/speculator.h"
#include "dflash/target.h"
#include "register.h"

namespace {

struct PySpeculator {
    std::unique_ptr<dflash::Speculator> s;  // null once closed
    std::mutex mu;
    // of the tokens the last start() or step returned, when asked for
    std::vector<dflash::TokenLogprob> last_logprobs;
    std::vector<float> last_logits;
    void keep(dflash::StepOutput & o) {
        last_logprobs = std::move(o.logprobs);
        last_logits = std::move(o.logits);
    }
};

dflash::Speculator & live(PySpeculator & p) {
    if (!p.s) throw dflash::Error("this SpeculativeLlama is closed");
    return *p.s;
}

dflash::DraftQ parse_q(const std::string & q) {
    if (q == "logits") return dflash::DraftQ::Logits;
    if (q == "selector") return dflash::DraftQ::Selector;
    throw dflash::Error("draft_q must be 'logits' or 'selector', got '" + q + "'");
}

// One step without the GIL; (emitted tokens, context_full).
template <typename Step>
py::tuple run_step(PySpeculator & p, Step step) {
    Busy busy(p.mu, "this SpeculativeLlama");
    dflash::StepOutput o;
    {
        py::gil_scoped_release nogil;
        o = step(live(p));
    }
    p.keep(o);
    return py::make_tuple(o.tokens, o.context_full);
}

// [(logprob, [(id, logprob) of the most likely])]
py::list logprob_list(const std::vector<dflash::TokenLogprob> & v) {
    py::list out;
    for (const auto & t : v) out.append(py::make_tuple(t.logprob, t.top));
    return out;
}

// llama-cpp-python's logits_processor(input_ids, scores) -> scores, called by the loop, which runs
// without the GIL: the call takes it, and so does releasing the callable, wherever the parameters
// holding it go. A bad return value is a ValueError (a NaN logit would make the choice arbitrary).
std::function<void(const std::vector<int32_t> &, float *, uint32_t)> wrap_logits_processor(py::object fn) {
    if (fn.is_none()) return {};
    if (!PyCallable_Check(fn.ptr())) {
        throw py::value_error("logits_processor must be callable (input_ids, scores) -> scores, got " +
                              py::str(py::type::of(fn).attr("__name__")).cast<std::string>());
    }
    std::shared_ptr<py::object> held(new py::object(std::move(fn)), [](py::object * o) {
        py::gil_scoped_acquire gil;
        delete o;
    });
    return [held](const std::vector<int32_t> & ids, float * logits, uint32_t n_vocab) {
        py::gil_scoped_acquire gil;
        py::object r = (*held)(py::array_t<int32_t>((py::ssize_t)ids.size(), ids.data()),
                               py::array_t<float>((py::ssize_t)n_vocab, logits));
        auto out = py::array_t<float, py::array::c_style | py::array::forcecast>::ensure(r);
        if (!out || out.ndim() != 1 || out.shape(0) != (py::ssize_t)n_vocab) {
            std::string got = py::str(py::type::of(r).attr("__name__"));
            if (out) got += " of shape " + std::string(py::str(out.attr("shape")));
            throw py::value_error("logits_processor must return n_vocab = " + std::to_string(n_vocab) +
                                  " scores (a 1-D array), got " + got);
        }
        const float * v = out.data();
        for (uint32_t i = 0; i < n_vocab; ++i) {
            if (std::isnan(v[i])) throw py::value_error("logits_processor returned NaN for token " + std::to_string(i));
        }
        std::copy(v, v + n_vocab, logits);
    };
}

bool is_gumbel(const std::string & sampler) {
    if (sampler != "rejection" && sampler != "gumbel") {
        throw py::value_error("sampler must be 'rejection' or 'gumbel', got '" + sampler + "'");
    }
    return sampler == "gumbel";
}

dflash::SpeculatorOptions spec_options(uint32_t n_max, bool adaptive, const std::string & draft_q, bool fallback,
                                       const std::string & sampler) {
    dflash::SpeculatorOptions o;
    o.n_max = n_max;
    o.adaptive = adaptive;
    o.draft_q = parse_q(draft_q);
    o.fallback = fallback;
    o.gumbel = is_gumbel(sampler);
    return o;
}

// The most drafted tokens a verify holds at the n_max asked for: what libllama's snapshots (each a copy of
// the recurrent state) must cover; a later, longer n_max rolls back by checkpoint instead.
uint32_t most_drafted(const dflash::SpeculatorOptions & sopt, uint32_t block_size) {
    return sopt.n_max > 0 ? std::min(sopt.n_max, block_size - 1) : block_size - 1;
}

// The drafter shares the target's embedding and LM head, read from the target's GGUF file.
// Call without the GIL; the drafter is validated before the target is loaded (a bad drafter
// should not cost a target load).
// open_target gets most_drafted().
std::unique_ptr<PySpeculator> make_speculator(
    const std::function<std::unique_ptr<dflash::Target>(uint32_t max_draft)> & open_target,
    const std::string & target_path, const std::string & draft, const std::string & device, int n_threads, bool repack,
    bool swa_full, const std::vector<int32_t> & draft_vocab, const dflash::SpeculatorOptions & sopt) {
    const dflash::DraftFileInfo info = dflash::inspect_draft_file(draft);
    auto t = open_target(most_drafted(sopt, info.hparams.block_size));
    dflash::DrafterOptions dopt;
    dopt.device = device;
    dopt.n_threads = n_threads;
    dopt.n_ctx = t->n_ctx() + 64;
    dopt.repack = repack;
    dopt.swa_full = swa_full;
    dopt.draft_vocab = draft_vocab;
    auto d = std::make_unique<dflash::Drafter>(draft, target_path, dopt);
    auto p = std::make_unique<PySpeculator>();
    p->s = std::make_unique<dflash::Speculator>(std::move(t), std::move(d), sopt);
    return p;
}

// Python's repack=: None (auto), True, False, or "no-amx" (ggml's repacked layouts, never AMX's)
dflash::Repack to_repack(const py::object & repack) {
    if (repack.is_none()) return dflash::Repack::Auto;
    if (py::isinstance<py::bool_>(repack)) return repack.cast<bool>() ? dflash::Repack::On : dflash::Repack::Off;
    if (py::isinstance<py::str>(repack) && repack.cast<std::string>() == "no-amx") return dflash::Repack::WithoutAmx;
    throw py::value_error("repack must be None, True, False or \"no-amx\", not " +
                          py::repr(repack).cast<std::string>());
}

}  // namespace

void register_speculator(py::module_ & m) {
    m.def("release_openmp_threads", &dflash::release_openmp_threads,
          "Hand back the calling thread's OpenMP worker pool (see dflash/cpu_threads.h); false without OpenMP");
    m.def("default_cpu_threads", &dflash::default_cpu_threads,
          "The CPU threads n_threads = 0 means: the physical cores this process may run on");
    m.def(
        "target_flash_attn", [](int n_gpu_layers) { return (int)dflash::target_flash_attn(n_gpu_layers); },
        py::arg("n_gpu_layers"),
        "The llama_context_params.flash_attn_type the target's context gets with n_gpu_layers offloaded");
    m.def(
        "target_weight_placement",
        [](const std::string & path, int n_gpu_layers, const py::object & repack) {
            dflash::TargetOptions opts;
            opts.n_gpu_layers = n_gpu_layers;
            opts.repack = to_repack(repack);
            const dflash::WeightPlacement p = dflash::target_weight_placement(path, opts);
            py::list overrides;
            for (const auto & [pattern, buft] : p.overrides) {
                overrides.append(py::make_tuple(pattern, ggml_backend_buft_name(buft), (uintptr_t)buft));
            }
            return py::make_tuple(p.use_extra_bufts, overrides);
        },
        py::arg("path"), py::arg("n_gpu_layers") = 0, py::arg("repack") = py::none(),
        "(use_extra_bufts, [(pattern, buffer type name, ggml_backend_buffer_type_t address)]): how a target "
        "loads its weights for these options (dflash::target_weight_placement)");
    py::class_<PySpeculator>(m, "Speculator")
        .def(py::init([](const std::string & target, const std::string & draft, uint32_t n_ctx, uint32_t n_batch,
                         int n_gpu_layers, int n_threads, const std::string & device, uint32_t n_max, bool adaptive,
                         const std::string & draft_q, bool fallback, const py::object & repack,
                         const std::string & sampler,
                         const std::vector<std::pair<std::string, std::string>> & tensor_overrides,
                         const std::vector<int32_t> & draft_vocab, bool swa_full,
                         const std::vector<std::pair<std::string, float>> & loras, const std::string & type_k,
                         const std::string & type_v) {
                 const auto sopt = spec_options(n_max, adaptive, draft_q, fallback, sampler);
                 dflash::TargetOptions topt;
                 topt.n_ctx = n_ctx;
                 topt.n_batch = n_batch;
                 topt.n_gpu_layers = n_gpu_layers;
                 topt.n_threads = n_threads;
                 topt.repack = to_repack(repack);
                 topt.tensor_overrides = tensor_overrides;
                 topt.swa_full = swa_full;
                 topt.loras = loras;
                 topt.type_k = dflash::kv_cache_type(type_k);
                 topt.type_v = dflash::kv_cache_type(type_v);
                 py::gil_scoped_release nogil;
                 return make_speculator(
                     [&](uint32_t max_draft) {
                         topt.n_rs_seq = max_draft;
                         return std::make_unique<dflash::Target>(target, topt);
                     },
                     target, draft, device, n_threads, topt.repack != dflash::Repack::Off, swa_full, draft_vocab,
                     sopt);
             }),
             py::arg("target"), py::arg("draft"), py::arg("n_ctx") = 4096, py::arg("n_batch") = 512,
             py::arg("n_gpu_layers") = 0, py::arg("n_threads") = 0, py::arg("device") = "auto", py::arg("n_max") = 0,
             py::arg("adaptive") = false, py::arg("draft_q") = "logits", py::arg("fallback") = true,
             py::arg("repack") = py::none(), py::arg("sampler") = "gumbel",
             py::arg("tensor_overrides") = std::vector<std::pair<std::string, std::string>>{},
             py::arg("draft_vocab") = std::vector<int32_t>{}, py::arg("swa_full") = false,
             py::arg("loras") = std::vector<std::pair<std::string, float>>{}, py::arg("type_k") = "f16",
             py::arg("type_v") = "f16")
        .def_property_readonly(
            "loras",
            [](PySpeculator & p) {
                Busy busy(p.mu, "this SpeculativeLlama");
                return live(p).target().loras();
            },
            "The target's LoRA adapters: [(file, scale in this context)]")
        .def(
            "end_reasoning",
            [](PySpeculator & p) {
                Busy busy(p.mu, "this SpeculativeLlama");
                return live(p).end_reasoning();
            },
            "The thinking under way ends now: its reasoning budget's forced end comes next (between steps). "
            "False without a budget or a thinking being counted.")
        .def(
            "set_lora_scales",
            [](PySpeculator & p, const std::vector<float> & scales) {
                Busy busy(p.mu, "this SpeculativeLlama");
                py::gil_scoped_release nogil;
                live(p).set_lora_scales(scales);
            },
            py::arg("scales"),
            "The LoRA adapters' scales in this context (one per adapter, 0 leaves one out); a change empties "
            "the context (the next prompt is prefilled whole)")
        .def_static(
            "adopt",
            [](uintptr_t model_ptr, uintptr_t ctx_ptr, const std::string & target_path, const std::string & draft,
               int n_threads, const std::string & device, uint32_t n_max, bool adaptive, const std::string & draft_q,
               bool fallback, const std::string & sampler, const std::vector<int32_t> & draft_vocab) {
                const auto sopt = spec_options(n_max, adaptive, draft_q, fallback, sampler);
                py::gil_scoped_release nogil;
                return make_speculator(
                    [&](uint32_t) {
                        return std::make_unique<dflash::Target>((llama_model *)model_ptr, (llama_context *)ctx_ptr);
                    },
                    target_path, draft, device, n_threads, /*repack=*/true, /*swa_full=*/false, draft_vocab, sopt);
            },
            py::arg("model_ptr"), py::arg("ctx_ptr"), py::arg("target_path"), py::arg("draft"),
            py::arg("n_threads") = 0, py::arg("device") = "auto", py::arg("n_max") = 0, py::arg("adaptive") = false,
            py::arg("draft_q") = "logits", py::arg("fallback") = true, py::arg("sampler") = "gumbel",
            py::arg("draft_vocab") = std::vector<int32_t>{},
            "Use the model and context of an existing llama_cpp.Llama as the target (they stay owned by it).")
        .def(
            "share_weights",
            [](PySpeculator & p, uint32_t n_max, bool adaptive, std::optional<std::string> draft_q,
               std::optional<bool> fallback, const std::string & sampler,
               const std::optional<std::vector<int32_t>> & draft_vocab) {
                Busy busy(p.mu, "this SpeculativeLlama");
                dflash::Speculator & s = live(p);
                dflash::SpeculatorOptions sopt = s.options();
                sopt.n_max = n_max;
                sopt.adaptive = adaptive;
                if (draft_q) sopt.draft_q = parse_q(*draft_q);
                if (fallback) sopt.fallback = *fallback;
                sopt.gumbel = is_gumbel(sampler);
                py::gil_scoped_release nogil;
                auto t = s.target().share(most_drafted(sopt, s.drafter().hparams().block_size));
                auto out = std::make_unique<PySpeculator>();
                auto d = s.drafter().share(draft_vocab ? &*draft_vocab : nullptr);
                out->s = std::make_unique<dflash::Speculator>(std::move(t), std::move(d), sopt);
                return out;
            },
            py::arg("n_max") = 0, py::arg("adaptive") = false, py::arg("draft_q") = py::none(),
            py::arg("fallback") = py::none(), py::arg("sampler") = "gumbel", py::arg("draft_vocab") = py::none(),
            "Another Speculator on this one's loaded target and drafter weights, with a target context, draft cache "
            "and draft-length controller of its own (made with the same options; draft_q, fallback and draft_vocab: "
            "this one's unless given, draft_vocab [] for the whole vocabulary).")
        .def(
            "start",
            [](PySpeculator & p, const std::vector<int32_t> & prompt, float temperature, int32_t top_k, float top_p,
               float min_p, uint64_t seed, float repeat_penalty, float frequency_penalty, float presence_penalty,
               int32_t penalty_last_n, const std::map<int32_t, float> & logit_bias, int32_t logprobs,
               const std::string & grammar, const std::string & grammar_root, py::object logits_processor,
               bool keep_logits, bool prompt_logprobs, bool grammar_full_pass, float typical_p, int32_t mirostat_mode,
               float mirostat_tau, float mirostat_eta, const std::vector<std::string> & grammar_triggers,
               int32_t reasoning_budget, const dflash::TokenSeq & reasoning_start,
               const std::vector<dflash::TokenSeq> & reasoning_ends, const dflash::TokenSeq & reasoning_forced,
               const dflash::TokenSeq & reasoning_prompt) {
                Busy busy(p.mu, "this SpeculativeLlama");
                dflash::SamplingParams sp;
                sp.temperature = temperature;
                sp.top_k = top_k;
                sp.top_p = top_p;
                sp.min_p = min_p;
                sp.typical_p = typical_p;
                sp.mirostat = mirostat_mode;
                sp.mirostat_tau = mirostat_tau;
                sp.mirostat_eta = mirostat_eta;
                sp.repeat_penalty = repeat_penalty;
                sp.frequency_penalty = frequency_penalty;
                sp.presence_penalty = presence_penalty;
                sp.penalty_last_n = penalty_last_n;
                sp.logit_bias.assign(logit_bias.begin(), logit_bias.end());
                sp.n_logprobs = logprobs;
                sp.grammar = grammar;
                sp.grammar_root = grammar_root;
                sp.grammar_triggers = grammar_triggers;
                sp.logits_processor = wrap_logits_processor(std::move(logits_processor));
                sp.keep_logits = keep_logits;
                sp.prompt_logprobs = prompt_logprobs;
                sp.grammar_full_pass = grammar_full_pass;
                sp.reasoning = {reasoning_start, reasoning_ends, reasoning_forced, reasoning_budget, reasoning_prompt};
                dflash::StepOutput first;
                {
                    py::gil_scoped_release nogil;
                    live(p).start(prompt, sp, seed);
                    first = live(p).start_output();
                }
                p.keep(first);
                return first.tokens[0];
            },
            py::arg("prompt"), py::arg("temperature") = 0.0f, py::arg("top_k") = 0, py::arg("top_p") = 1.0f,
            py::arg("min_p") = 0.0f, py::arg("seed") = 0, py::arg("repeat_penalty") = 1.0f,
            py::arg("frequency_penalty") = 0.0f, py::arg("presence_penalty") = 0.0f, py::arg("penalty_last_n") = 64,
            py::arg("logit_bias") = std::map<int32_t, float>{}, py::arg("logprobs") = -1, py::arg("grammar") = "",
            py::arg("grammar_root") = "root", py::arg("logits_processor") = py::none(), py::arg("keep_logits") = false,
            py::arg("prompt_logprobs") = false, py::arg("grammar_full_pass") = false, py::arg("typical_p") = 1.0f,
            py::arg("mirostat_mode") = 0, py::arg("mirostat_tau") = 5.0f, py::arg("mirostat_eta") = 0.1f,
            py::arg("grammar_triggers") = std::vector<std::string>{}, py::arg("reasoning_budget") = -1,
            py::arg("reasoning_start") = dflash::TokenSeq{}, py::arg("reasoning_ends") = std::vector<dflash::TokenSeq>{},
            py::arg("reasoning_forced") = dflash::TokenSeq{}, py::arg("reasoning_prompt") = dflash::TokenSeq{})
        .def_property_readonly("last_logprobs",
                               [](PySpeculator & p) {
                                   Busy busy(p.mu, "this SpeculativeLlama");
                                   return logprob_list(p.last_logprobs);
                               })
        .def_property_readonly("prompt_logprobs",
                               [](PySpeculator & p) {
                                   Busy busy(p.mu, "this SpeculativeLlama");
                                   return logprob_list(live(p).prompt_logprobs());
                               })
        .def_property_readonly("last_logits",
                               [](PySpeculator & p) {
                                   Busy busy(p.mu, "this SpeculativeLlama");
                                   const py::ssize_t V = live(p).target().n_vocab();
                                   py::array_t<float> a({(py::ssize_t)p.last_logits.size() / V, V});
                                   std::copy(p.last_logits.begin(), p.last_logits.end(), a.mutable_data());
                                   return a;
                               })
        .def(
            "step",
            [](PySpeculator & p, uint32_t max_tokens) {
                return run_step(p, [&](dflash::Speculator & s) { return s.step(max_tokens); });
            },
            py::arg("max_tokens") = UINT32_MAX)
        .def("step_plain",
             [](PySpeculator & p) { return run_step(p, [](dflash::Speculator & s) { return s.step_plain(); }); })
        .def_property_readonly("n_max", [](PySpeculator & p) { return live(p).n_max(); })
        .def_property_readonly("adaptive", [](PySpeculator & p) { return live(p).adaptive(); })
        .def(
            "set_n_max",
            [](PySpeculator & p, uint32_t n, bool adaptive) {
                Busy busy(p.mu, "this SpeculativeLlama");
                live(p).set_n_max(n, adaptive);
            },
            py::arg("n"), py::arg("adaptive") = false)
        .def_property_readonly("controller",
                               [](PySpeculator & p) {
                                   py::dict d;
                                   d["acceptance"] = live(p).acceptance_estimate();
                                   std::vector<double> cost;
                                   for (uint32_t k = 0; k <= live(p).drafter().hparams().block_size - 1; ++k) {
                                       cost.push_back(live(p).expected_step_ms(k));
                                   }
                                   d["expected_step_ms"] = cost;
                                   return d;
                               })
        .def_property_readonly("n_past", [](PySpeculator & p) { return live(p).n_past(); })
        .def_property_readonly("mirostat_mu", [](PySpeculator & p) { return live(p).mirostat_mu(); })
        .def_property_readonly("cached_tokens",
                               [](PySpeculator & p) {
                                   Busy busy(p.mu, "this SpeculativeLlama");
                                   return live(p).cached_tokens();
                               })
        .def(
            "keep_cached_prefix",
            [](PySpeculator & p, const std::vector<int32_t> & held) {
                Busy busy(p.mu, "this SpeculativeLlama");
                live(p).keep_cached_prefix(held);
            },
            py::arg("held"))
        .def("save_state",
             [](PySpeculator & p) {
                 Busy busy(p.mu, "this SpeculativeLlama");
                 dflash::SpeculatorState st;
                 {
                     py::gil_scoped_release nogil;
                     st = live(p).save_state();
                 }
                 return py::make_tuple(st.tokens, py::bytes((const char *)st.target.data(), st.target.size()),
                                       py::bytes((const char *)st.draft.data(), st.draft.size()));
             })
        .def(
            "load_state",
            [](PySpeculator & p, std::vector<int32_t> tokens, const py::bytes & target, const py::bytes & draft) {
                Busy busy(p.mu, "this SpeculativeLlama");
                const std::string_view t = target, d = draft;
                dflash::SpeculatorState st{std::move(tokens), {t.begin(), t.end()}, {d.begin(), d.end()}};
                py::gil_scoped_release nogil;
                live(p).load_state(st);
            },
            py::arg("tokens"), py::arg("target"), py::arg("draft"))
        .def_property_readonly("n_ctx", [](PySpeculator & p) { return live(p).target().n_ctx(); })
        .def_property_readonly("target_arch", [](PySpeculator & p) { return live(p).target().arch(); })
        .def_property_readonly(
            "target_memory",
            [](PySpeculator & p) { return std::string(dflash::memory_name(live(p).target().memory())); },
            "How the target goes back on a rejected draft: attention, recurrent-snapshots, recurrent-checkpoint")
        .def_property_readonly("rollback_counters",
                               [](PySpeculator & p) {
                                   const auto & c = live(p).target().rollback_counters();
                                   py::dict d;
                                   d["seq_rm"] = c.seq_rm;
                                   d["snapshot"] = c.snapshot;
                                   d["restored"] = c.restored;
                                   d["replayed_tokens"] = c.replayed_tokens;
                                   d["checkpoints"] = c.checkpoints;
                                   d["checkpoint_bytes"] = c.checkpoint_bytes;
                                   d["n_rs_seq"] = live(p).target().n_rs_seq();
                                   return d;
                               })
        .def_property_readonly("n_vocab", [](PySpeculator & p) { return live(p).target().n_vocab(); })
        .def_property_readonly("n_embd", [](PySpeculator & p) { return live(p).target().n_embd(); })
        .def_property_readonly("token_nl",
                               [](PySpeculator & p) { return llama_vocab_nl(live(p).target().vocab()); })
        .def_property_readonly("draft_vocab_size",
                               [](PySpeculator & p) { return live(p).drafter().draft_vocab_size(); })
        .def_property_readonly("draft_hparams",
                               [](PySpeculator & p) { return hparams_dict(live(p).drafter().hparams()); })
        .def_property_readonly("draft_device", [](PySpeculator & p) { return live(p).drafter().device_name(); })
        .def_property_readonly("draft_counters",
                               [](PySpeculator & p) { return counters_dict(live(p).drafter().counters()); })
        .def_property_readonly("stats",
                               [](PySpeculator & p) {
                                   const dflash::SpecStats s = live(p).stats();
                                   py::dict d;
                                   d["steps"] = s.steps;
                                   d["plain_steps"] = s.steps_by_length.empty() ? 0 : s.steps_by_length[0];
                                   d["drafted"] = s.drafted;
                                   d["accepted"] = s.accepted;
                                   d["emitted"] = s.emitted;
                                   d["pos_reached"] = s.pos_reached;
                                   d["pos_accepted"] = s.pos_accepted;
                                   d["steps_by_length"] = s.steps_by_length;
                                   d["prefill_ms"] = s.prefill_ms;
                                   d["calibration_ms"] = s.calibration_ms;
                                   d["draft_ms"] = s.draft_ms;
                                   d["verify_ms"] = s.verify_ms;
                                   d["inject_ms"] = s.inject_ms;
                                   d["sample_ms"] = s.sample_ms;
                                   d["rollback_ms"] = s.rollback_ms;
                                   d["prompt_tokens"] = s.prompt_tokens;
                                   d["reused_tokens"] = s.reused_tokens;
                                   d["target_decodes"] = s.target_decodes;
                                   return d;
                               })
        .def(
            "tokenize",
            [](PySpeculator & p, const std::string & text, bool add_special, bool parse_special) {
                const llama_vocab * v = live(p).target().vocab();
                std::vector<int32_t> out(text.size() + 16);
                int32_t n = llama_tokenize(v, text.data(), (int32_t)text.size(), out.data(), (int32_t)out.size(),
                                           add_special, parse_special);
                if (n < 0) {
                    out.resize((size_t)-n);
                    n = llama_tokenize(v, text.data(), (int32_t)text.size(), out.data(), (int32_t)out.size(),
                                       add_special, parse_special);
                }
                if (n < 0) throw dflash::Error("tokenization failed");
                out.resize((size_t)n);
                return out;
            },
            py::arg("text"), py::arg("add_special") = false, py::arg("parse_special") = true)
        .def(
            "token_to_piece",
            [](PySpeculator & p, int32_t tok, bool special) {
                if (tok < 0 || (uint32_t)tok >= live(p).target().n_vocab())
                    throw dflash::Error("token id out of range");
                std::string buf(256, '\0');
                int32_t n =
                    llama_token_to_piece(live(p).target().vocab(), tok, buf.data(), (int32_t)buf.size(), 0, special);
                if (n < 0) {
                    buf.resize((size_t)-n);
                    n = llama_token_to_piece(live(p).target().vocab(), tok, buf.data(), (int32_t)buf.size(), 0,
                                             special);
                }
                buf.resize((size_t)std::max(n, 0));
                return py::bytes(buf);
            },
            py::arg("token"), py::arg("special") = false)
        .def("is_eog", [](PySpeculator & p, int32_t tok) { return live(p).target().is_eog(tok); })
        .def_property_readonly("eog_tokens",
                               [](PySpeculator & p) {
                                   std::vector<int32_t> out;
                                   for (uint32_t t = 0; t < live(p).target().n_vocab(); ++t) {
                                       if (live(p).target().is_eog((int32_t)t)) out.push_back((int32_t)t);
                                   }
                                   return out;
                               })
        .def_property_readonly("token_eos", [](PySpeculator & p) { return llama_vocab_eos(live(p).target().vocab()); })
        .def_property_readonly("token_bos", [](PySpeculator & p) { return llama_vocab_bos(live(p).target().vocab()); })
        .def_property_readonly("add_bos",
                               [](PySpeculator & p) { return llama_vocab_get_add_bos(live(p).target().vocab()); })
        .def_property_readonly("fim_tokens",
                               [](PySpeculator & p) {
                                   const llama_vocab * v = live(p).target().vocab();
                                   py::dict d;  // -1 where the vocabulary has none
                                   d["pre"] = llama_vocab_fim_pre(v);
                                   d["suf"] = llama_vocab_fim_suf(v);
                                   d["mid"] = llama_vocab_fim_mid(v);
                                   d["rep"] = llama_vocab_fim_rep(v);
                                   d["sep"] = llama_vocab_fim_sep(v);
                                   return d;
                               })
        .def("close",
             [](PySpeculator & p) {
                 Busy busy(p.mu, "this SpeculativeLlama");
                 p.s.reset();  // frees the target (or hands an adopted context back) and the drafter now
             })
        .def_property_readonly("closed", [](PySpeculator & p) { return !p.s; })
        .def_property_readonly("chat_template", [](PySpeculator & p) -> py::object {
            const char * t = llama_model_chat_template(live(p).target().model(), nullptr);
            if (!t) return py::none();
            return py::str(t);
        })
        .def_property_readonly("target_metadata", [](PySpeculator & p) {
            // the target's GGUF key/values as libllama renders them (llama_cpp.Llama's metadata); a file's
            // strings need not be UTF-8, hence backslashreplace
            const llama_model * model = live(p).target().model();
            auto text = [](const std::string & s) {
                PyObject * o = PyUnicode_DecodeUTF8(s.data(), (Py_ssize_t)s.size(), "backslashreplace");
                if (!o) throw py::error_already_set();  // MemoryError
                return py::reinterpret_steal<py::str>(o);
            };
            py::dict d;
            std::string key(256, '\0'), val(1024, '\0');
            auto read = [](std::string & buf, auto get) {  // snprintf-like: retry with the length it reports
                int32_t n = get(buf.data(), buf.size());
                if (n >= 0 && (size_t)n >= buf.size()) {
                    buf.resize((size_t)n + 1);
                    n = get(buf.data(), buf.size());
                }
                return n < 0 ? std::string() : std::string(buf.data(), (size_t)n);
            };
            for (int32_t i = 0; i < llama_model_meta_count(model); ++i) {
                const std::string k = read(key, [&](char * b, size_t n) {
                    return llama_model_meta_key_by_index(model, i, b, n);
                });
                const std::string v = read(val, [&](char * b, size_t n) {
                    return llama_model_meta_val_str_by_index(model, i, b, n);
                });
                if (!k.empty()) d[text(k)] = text(v);
            }
            return d;
        });
}
