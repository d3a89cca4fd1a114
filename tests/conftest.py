"""Shared pytest setup: keep minimal (other parts add their own fixtures)."""

from __future__ import annotations

import sys
from pathlib import Path

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
