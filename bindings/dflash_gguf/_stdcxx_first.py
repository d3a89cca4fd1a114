"""Puts libstdc++ into the process's global symbol scope before libllama loads (imported first by
dflash_gguf, before llama_cpp).

A CUDA build of llama-cpp-python made with nvcc 13 links a libllama without libstdc++ among its NEEDED
libraries, and a libggml-cuda that exports ~1600 std:: symbols: libllama's std::ostream calls then bind to
libggml-cuda's copies, which crash (SIGSEGV in llama_model::print_info at the first model load) once torch
was imported. With libstdc++ in the global scope (as LD_PRELOAD puts it there, which makes those loads
pass) it is searched before libllama's own dependencies. Only an import of dflash_gguf before the first
import of llama_cpp can do this.
"""

from __future__ import annotations

import ctypes
import sys

if sys.platform.startswith("linux"):
    try:
        ctypes.CDLL("libstdc++.so.6", mode=ctypes.RTLD_GLOBAL)
    except OSError:  # no libstdc++ by that name (another C++ runtime): nothing to put first
        pass
