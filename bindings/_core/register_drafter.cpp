// dflash_gguf._core.Drafter: the draft graph usable on its own (inject, draft,
// rollback) with introspection for tests: logits, candidates, selector scores, q.
#include <pybind11/numpy.h>
#include <pybind11/stl.h>

#include "busy.h"
#include "dflash/drafter.h"
#include "register.h"

namespace {

template <typename T>
py::array_t<T> to_array(const std::vector<T> & v, std::vector<py::ssize_t> shape) {
    py::array_t<T> a(shape);
    if (!v.empty()) std::memcpy(a.mutable_data(), v.data(), v.size() * sizeof(T));
    return a;
}

struct PyDrafter {
    std::unique_ptr<dflash::Drafter> d;
    std::mutex mu;
};

}  // namespace

py::dict counters_dict(const dflash::DrafterCounters & c) {
    py::dict d;
    d["graphs_built"] = c.graphs_built;
    d["graph_allocs"] = c.graph_allocs;
    d["setup_ms_last"] = c.setup_ms_last;
    d["sched_reallocs"] = c.sched_reallocs;
    d["n_splits_last"] = c.n_splits_last;
    d["window_last"] = c.window_last;
    d["swa_first_last"] = c.swa_first_last;
    d["shapes"] = c.shapes;
    d["rings_restored"] = c.rings_restored;
    d["compute_bytes"] = c.compute_bytes;
    d["draft_threads"] = c.draft_threads;
    return d;
}

void register_drafter(py::module_ & m) {
    m.def("sliding_ring_rows", &dflash::sliding_ring_rows, py::arg("swa_window"), py::arg("block_size"),
          py::arg("n_ctx"),
          "Rows of a sliding-window layer's ring cache in a draft cache of n_ctx rows (0: none, it holds every row).");
    py::class_<PyDrafter>(m, "Drafter")
        .def(py::init([](const std::string & draft, const std::string & target, const std::string & device,
                         int n_threads, uint32_t n_ctx, bool repack, const std::string & kv_type,
                         const std::vector<int32_t> & draft_vocab, bool swa_full) {
                 dflash::DrafterOptions o;
                 o.device = device;
                 o.n_threads = n_threads;
                 o.n_ctx = n_ctx;
                 o.repack = repack;
                 if (kv_type != "f16" && kv_type != "f32") {
                     throw py::value_error("kv_type must be \"f16\" or \"f32\", got \"" + kv_type + "\"");
                 }
                 o.kv_type = kv_type == "f32" ? GGML_TYPE_F32 : GGML_TYPE_F16;
                 o.draft_vocab = draft_vocab;
                 o.swa_full = swa_full;
                 auto p = std::make_unique<PyDrafter>();
                 py::gil_scoped_release nogil;
                 p->d = std::make_unique<dflash::Drafter>(draft, target, o);
                 return p;
             }),
             py::arg("draft"), py::arg("target") = "", py::arg("device") = "auto", py::arg("n_threads") = 0,
             py::arg("n_ctx") = 4096, py::arg("repack") = true, py::arg("kv_type") = "f16",
             py::arg("draft_vocab") = std::vector<int32_t>{}, py::arg("swa_full") = false)
        .def_property_readonly("hparams", [](PyDrafter & p) { return hparams_dict(p.d->hparams()); })
        .def_property_readonly("n_vocab", [](PyDrafter & p) { return p.d->n_vocab(); })
        .def_property_readonly("n_ctx", [](PyDrafter & p) { return p.d->n_ctx(); })
        .def_property_readonly("n_cached", [](PyDrafter & p) { return p.d->n_cached(); })
        .def_property_readonly("device", [](PyDrafter & p) { return p.d->device_name(); })
        .def_property_readonly("head_zero_copy", [](PyDrafter & p) { return p.d->head_zero_copy(); })
        .def_property_readonly("repacked_weights", [](PyDrafter & p) { return p.d->repacked_weights(); })
        .def_property_readonly("head_pad_from", [](PyDrafter & p) { return p.d->head_pad_from(); })
        .def_property_readonly("block_pad_from", [](PyDrafter & p) { return p.d->block_pad_from(); })
        .def_property_readonly("draft_vocab_size", [](PyDrafter & p) { return p.d->draft_vocab_size(); })
        .def_property_readonly("ring_rows", [](PyDrafter & p) { return p.d->ring_rows(); })
        .def_property_readonly("cache_bytes", [](PyDrafter & p) { return p.d->cache_bytes(); })
        .def_property_readonly("counters", [](PyDrafter & p) { return counters_dict(p.d->counters()); })
        .def(
            "inject",
            [](PyDrafter & p, py::array_t<float, py::array::c_style | py::array::forcecast> features,
               py::array_t<int32_t, py::array::c_style | py::array::forcecast> positions) {
                Busy busy(p.mu, "this Drafter");
                const size_t width = p.d->hparams().n_target_features();
                if (features.ndim() != 2 || (size_t)features.shape(1) != width) {
                    throw dflash::Error("inject: features must have shape [n, " + std::to_string(width) + "]");
                }
                if (positions.ndim() != 1 || positions.shape(0) != features.shape(0)) {
                    throw dflash::Error("inject: positions must have shape [n] matching features");
                }
                py::gil_scoped_release nogil;
                p.d->inject(features.data(), positions.data(), (uint32_t)features.shape(0));
            },
            py::arg("features"), py::arg("positions"))
        .def(
            "truncate",
            [](PyDrafter & p, uint32_t n) {
                Busy busy(p.mu, "this Drafter");
                p.d->truncate(n);
            },
            py::arg("n"))
        .def(
            "keep_rings_at",
            [](PyDrafter & p, uint32_t n) {
                Busy busy(p.mu, "this Drafter");
                p.d->keep_rings_at(n);
            },
            py::arg("n"))
        .def("save_cache",
             [](PyDrafter & p) {
                 Busy busy(p.mu, "this Drafter");
                 const std::vector<uint8_t> bytes = p.d->save_cache();
                 return py::bytes((const char *)bytes.data(), bytes.size());
             })
        .def(
            "load_cache",
            [](PyDrafter & p, const py::bytes & bytes, uint32_t n) {
                Busy busy(p.mu, "this Drafter");
                const std::string_view view = bytes;
                p.d->load_cache(std::vector<uint8_t>(view.begin(), view.end()), n);
            },
            py::arg("bytes"), py::arg("n"))
        .def("reset",
             [](PyDrafter & p) {
                 Busy busy(p.mu, "this Drafter");
                 p.d->reset();
             })
        .def(
            "draft",
            [](PyDrafter & p, int32_t anchor, int32_t position, int n, bool details, py::object all_rows,
               bool short_block) -> py::object {
                Busy busy(p.mu, "this Drafter");
                const uint32_t B = p.d->hparams().block_size;
                const uint32_t n_draft = n < 0 ? B - 1 : (uint32_t)n;
                const bool every_row = all_rows.is_none() ? details : all_rows.cast<bool>();
                dflash::DraftResult r;
                {
                    py::gil_scoped_release nogil;
                    r = p.d->draft(anchor, position, n_draft, details, every_row, short_block);
                }
                if (!details) return py::cast(r.tokens);
                py::dict d;
                const py::ssize_t head = (py::ssize_t)r.argmax.size(), rows = (py::ssize_t)r.walk_index.size();
                const py::ssize_t k = r.top_k, V = p.d->n_vocab();
                d["tokens"] = r.tokens;
                d["first_row"] = r.first_row;
                d["argmax"] = to_array(r.argmax, {head});
                d["logits"] = to_array(r.logits, {head, V});
                if (k > 0) {
                    d["candidates"] = to_array(r.candidates, {rows, k});
                    d["scores"] = to_array(r.scores, {rows, k, k});
                    d["walk_q"] = to_array(r.walk_q, {rows, k});
                    d["walk_index"] = to_array(r.walk_index, {rows});
                }
                return d;
            },
            py::arg("anchor"), py::arg("position"), py::arg("n") = -1, py::arg("details") = false,
            py::arg("all_rows") = py::none(), py::arg("short_block") = false,
            "Draft the block [anchor, MASK...] at position..; returns n tokens, or a dict with logits, "
            "candidates, selector scores and the walk's q when details=True. The LM head and the selector "
            "run for block rows 1..n only, or for every row with all_rows (default: details); first_row "
            "says which block row argmax[0] and logits[0] are. short_block computes the block [anchor, MASK x n] "
            "only (what the speculative loop and llama.cpp draft), not all block_size rows; all_rows overrides it.");
}
