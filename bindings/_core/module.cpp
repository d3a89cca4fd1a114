// dflash_gguf._core: the C++ library exposed to Python, one register_*.cpp per area.
#include "dflash/error.h"
#include "register.h"

PYBIND11_MODULE(_core, m) {
    m.doc() = "dflash-gguf native core (ggml draft graph, drafter GGUF loader)";
    // dflash::Error -> DFlashError, a ValueError: bad input, never a crash
    static py::exception<dflash::Error> error(m, "DFlashError", PyExc_ValueError);
    py::register_exception_translator([](std::exception_ptr p) {
        try {
            if (p) std::rethrow_exception(p);
        } catch (const dflash::Error & e) {
            // messages quote names and strings from the file, which need not be UTF-8:
            // decode with backslashreplace, or Python would raise UnicodeDecodeError instead
            const std::string msg = e.what();
            PyObject * text = PyUnicode_DecodeUTF8(msg.data(), (Py_ssize_t)msg.size(), "backslashreplace");
            if (!text) return;  // MemoryError is set
            py::set_error(error, py::reinterpret_steal<py::str>(text));
        }
    });
    register_model(m);
    register_drafter(m);
    register_speculator(m);
    register_sampling(m);
    register_draft_length(m);
}
