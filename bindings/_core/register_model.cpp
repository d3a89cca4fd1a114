// Drafter GGUF inspection: the validated hyper-parameters and tensor table.
#include <pybind11/stl.h>

#include "dflash/draft_model.h"
#include "register.h"

py::dict hparams_dict(const dflash::DraftHparams & h) {
    py::dict d;
    d["version"] = h.version;
    d["context_length"] = h.n_ctx_train;
    d["n_embd"] = h.n_embd;
    d["n_layer"] = h.n_layer;
    d["n_ff"] = h.n_ff;
    d["n_head"] = h.n_head;
    d["n_head_kv"] = h.n_head_kv;
    d["head_dim"] = h.head_dim;
    d["n_rot"] = h.n_rot;
    d["rms_eps"] = h.rms_eps;
    d["rope_freq_base"] = h.rope_freq_base;
    d["rope_freq_scale"] = h.rope_freq_scale;
    d["rope_sections"] = h.rope_sections;
    d["block_size"] = h.block_size;
    d["target_layers"] = h.target_layers;
    d["mask_token_id"] = h.mask_token_id;
    d["n_vocab"] = h.n_vocab;
    d["target_hidden"] = h.target_hidden;
    d["logit_scale"] = h.logit_scale;
    d["final_logit_softcapping"] = h.logit_softcap;
    d["embedding_scale"] = h.embedding_scale;
    d["attention_value_scale"] = h.attn_value_scale;
    d["causal"] = h.causal;
    d["causal_layers"] = h.causal_layers;
    d["hidden_activation"] = h.hidden_act == dflash::DraftHparams::Activation::gelu_erf    ? "gelu"
                             : h.hidden_act == dflash::DraftHparams::Activation::gelu_tanh ? "gelu_pytorch_tanh"
                                                                                           : "silu";
    d["sliding_window"] = h.swa_window;
    d["sliding_window_layers"] = h.swa_layers;
    d["conv_kernel_size"] = h.conv_kernel;
    d["conv_group_size"] = h.conv_group;
    d["selector_rank"] = h.selector_rank;
    d["selector_top_k"] = h.selector_top_k;
    return d;
}

namespace {

py::dict info_dict(const dflash::DraftFileInfo & info) {
    py::dict d;
    d["path"] = info.path;
    d["file_size"] = info.file_size;
    d["gguf_version"] = info.gguf_version;
    d["hparams"] = hparams_dict(info.hparams);
    d["has_token_embd"] = info.has_token_embd;
    d["has_output"] = info.has_output;
    // metadata strings come from the file and need not be UTF-8
    py::dict meta;
    for (const auto & [k, v] : info.meta) {
        PyObject * text = PyUnicode_DecodeUTF8(v.data(), (Py_ssize_t)v.size(), "backslashreplace");
        if (!text) throw py::error_already_set();
        meta[py::str(k)] = py::reinterpret_steal<py::str>(text);
    }
    d["meta"] = meta;
    d["mask_embedding"] = info.mask_embedding;
    py::list tensors;
    for (const auto & t : info.tensors) {
        py::dict td;
        td["name"] = t.name;
        td["type"] = ggml_type_name(t.type);
        td["ne"] = t.ne;
        td["nbytes"] = t.nbytes;
        tensors.append(td);
    }
    d["tensors"] = tensors;
    return d;
}

}  // namespace

void register_model(py::module_ & m) {
    m.def(
        "inspect_draft",
        [](const std::string & path) {
            dflash::DraftFileInfo info;
            {
                py::gil_scoped_release nogil;
                info = dflash::inspect_draft_file(path);
            }
            return info_dict(info);
        },
        py::arg("path"),
        "Validate a drafter GGUF completely (keys, types, ranges, tensors) and describe it. Raises DFlashError.");
    m.def(
        "load_draft",
        [](const std::string & path) {
            dflash::DraftModel model;
            {
                py::gil_scoped_release nogil;
                model = dflash::load_draft_model(path, ggml_backend_cpu_buffer_type());
            }
            return info_dict(model.info);
        },
        py::arg("path"), "Validate and load a drafter's weights into a CPU buffer (then free them).");
}
