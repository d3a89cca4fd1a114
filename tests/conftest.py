"""Shared pytest setup: keep minimal (other parts add their own fixtures)."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parent.parent
TESTS = ROOT / "tests"
TINYCODE = ROOT / "examples" / "tinycode"

# tests import their helpers as `from factories import ...`
if str(TESTS) not in sys.path:
    sys.path.insert(0, str(TESTS))
# before `pip install -e .`, make the converter importable from the source tree
try:
    import dflash_convert  # noqa: F401
except ImportError:
    sys.path.insert(0, str(ROOT / "converter"))


@pytest.fixture(scope="session")
def repo_root() -> Path:
    return ROOT


@pytest.fixture(scope="session")
def tinycode() -> Path:
    """The bundled trained pair: target-f16.gguf, target/, drafter-dflash2/."""
    return TINYCODE


@pytest.fixture(scope="session", autouse=True)
def _llama_cpp_places_weights_as_our_runtime() -> Any:
    """Every llama_cpp.Llama the tests open (plain-decoding references) loads its weights as our runtime's
    target does: on a CPU with AMX libllama 0.3.36 crashes on a quantized model's first decode (SIGILL or
    SIGSEGV in ggml_backend_amx_mul_mat) and llama_cpp.Llama has no switch for it; elsewhere nothing
    changes (libllama's own choice)."""
    from llama_cpp import _internals

    from dflash_gguf.bench.verify_timing import place_weights_as_runtime

    load = _internals.LlamaModel.__init__

    def placed_load(self: Any, *, path_model: str, params: Any, verbose: bool = True) -> None:
        try:
            overrides = place_weights_as_runtime(params, path_model, params.n_gpu_layers)  # noqa: F841 (kept alive)
        except ValueError:  # not a readable GGUF: libllama's load says so itself
            pass
        load(self, path_model=path_model, params=params, verbose=verbose)

    _internals.LlamaModel.__init__ = placed_load
    yield
    _internals.LlamaModel.__init__ = load
