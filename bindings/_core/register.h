#pragma once
#include <pybind11/pybind11.h>

namespace py = pybind11;

namespace dflash {
struct DraftHparams;
}
py::dict hparams_dict(const dflash::DraftHparams & h);
namespace dflash {
struct DrafterCounters;
}
py::dict counters_dict(const dflash::DrafterCounters & c);

void register_model(py::module_ & m);
void register_drafter(py::module_ & m);
void register_speculator(py::module_ & m);
void register_sampling(py::module_ & m);
void register_draft_length(py::module_ & m);
