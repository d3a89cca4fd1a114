"""The extension links the very libllama / libggml that llama-cpp-python ships: one ggml per process."""

from __future__ import annotations

import re
import subprocess
import sys

import pytest


def test_one_libggml_base_and_one_libllama_are_mapped() -> None:
    # a fresh interpreter, so that nothing else this test session loaded counts
    code = (
        "import llama_cpp, dflash_gguf, re\n"
        "maps = open('/proc/self/maps').read()\n"
        "paths = sorted({m.split()[-1] for m in maps.splitlines() if re.search(r'lib(ggml-base|llama)\\.so', m)})\n"
        "print('\\n'.join(paths))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.split()
    ggml_base = [p for p in out if re.search(r"/libggml-base\.so", p)]
    llama = [p for p in out if re.search(r"/libllama\.so", p)]
    assert len(ggml_base) == 1 and len(llama) == 1, out
    import llama_cpp

    # and they are llama-cpp-python's own copies
    lib_dir = str(__import__("pathlib").Path(llama_cpp.__file__).resolve().parent / "lib")
    assert ggml_base[0].startswith(lib_dir) and llama[0].startswith(lib_dir), (out, lib_dir)


def test_extension_works_after_llama_cpp_and_alone() -> None:
    # import order must not matter: dflash_gguf imports llama_cpp itself first
    code = "import dflash_gguf; print(dflash_gguf._core.Drafter.__name__)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "Drafter"


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's global symbol scope")
def test_libstdcxx_is_searched_before_libllamas_dependencies() -> None:
    # dflash_gguf puts libstdc++ into the global scope before libllama loads (dflash_gguf/_stdcxx_first.py):
    # a libggml-cuda exporting its own std::ostream copies must not serve libllama's calls
    code = (
        "import ctypes, dflash_gguf\n"
        "sym = '_ZNSo9_M_insertIlEERSoT_'  # std::ostream::_M_insert<long>, what llama_model::print_info calls\n"
        "print(ctypes.cast(ctypes.CDLL(None)[sym], ctypes.c_void_p).value"
        " == ctypes.cast(ctypes.CDLL('libstdc++.so.6')[sym], ctypes.c_void_p).value)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "True"
