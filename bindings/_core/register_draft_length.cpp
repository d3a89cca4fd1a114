// dflash_gguf._core.DraftLengthController: the adaptive draft-length rule on its own, so that tests
// can drive it with chosen costs and acceptance (e.g. a GPU's, where verifying is nearly free).
#include <pybind11/stl.h>

#include "dflash/draft_length.h"
#include "dflash/error.h"
#include "register.h"

void register_draft_length(py::module_ & m) {
    using C = dflash::DraftLengthController;
    py::class_<C>(m, "DraftLengthController")
        .def(py::init([](uint32_t cap, const std::string & mode, uint32_t n_max) {
                 if (cap == 0) throw dflash::Error("cap must be >= 1");
                 auto c = std::make_unique<C>(cap);
                 if (mode == "auto")
                     c->configure(C::Mode::Auto, n_max);
                 else if (mode == "fixed")
                     c->configure(C::Mode::Fixed, n_max);
                 else if (mode == "fixed_no_fallback")
                     c->configure(C::Mode::FixedNoFallback, n_max);
                 else
                     throw dflash::Error("mode must be 'auto', 'fixed' or 'fixed_no_fallback', not '" + mode + "'");
                 return c;
             }),
             py::arg("cap"), py::arg("mode") = "auto", py::arg("n_max") = 0)
        .def("choose", &C::choose, "Drafted tokens to verify in the next step (0 = a plain step).")
        .def("reset_acceptance", &C::reset_acceptance, "A new sequence begins.")
        .def("observe_draft", &C::observe_draft, py::arg("k"), py::arg("accepted"), py::arg("draft_ms"),
             py::arg("verify_ms"), py::arg("steady") = true)
        .def("observe_plain", &C::observe_plain, py::arg("ms"), py::arg("steady") = true)
        .def("observe_cost", &C::observe_cost, py::arg("k"), py::arg("draft_ms"), py::arg("verify_ms"))
        .def("calibrate_cost", &C::calibrate_cost, py::arg("k"), py::arg("draft_ms"), py::arg("verify_ms"))
        .def("expected_tokens", &C::expected_tokens, py::arg("k"))
        .def("expected_cost_ms", &C::expected_cost_ms, py::arg("k"))
        .def_property_readonly("acceptance", &C::acceptance);
}
