"""Every name of the public API that the README and docs/python-api.md show exists: the imports, the
methods and attributes used on a `SpeculativeLlama` (`llm.`), and the statistics (`llm.stats.`)."""

from __future__ import annotations

import importlib
import re

from tinycode import ROOT, TARGET, THREADS, drafter_gguf

from dflash_gguf import SpeculativeLlama

DOCS = [ROOT / "README.md", ROOT / "docs" / "python-api.md"]


def _text() -> str:
    return "\n".join(p.read_text() for p in DOCS)


def test_imports_shown_exist() -> None:
    found = re.findall(r"^from (dflash_gguf[\w.]*|dflash_convert[\w.]*) import ([\w, ]+)$", _text(), re.M)
    assert found, "the docs show how to import the API"
    for module, names in found:
        mod = importlib.import_module(module)
        for name in (n.strip() for n in names.split(",")):
            assert hasattr(mod, name), f"{module}.{name}"


def test_methods_and_statistics_shown_exist() -> None:
    text = _text()
    methods = set(re.findall(r"\b(?:llm|SpeculativeLlama)\.(\w+)", text)) - {"stats"}
    stats = set(re.findall(r"\bllm\.stats\.(\w+)", text))
    assert {"create_completion", "create_chat_completion", "from_llama"} <= methods
    llm = SpeculativeLlama(str(TARGET), str(drafter_gguf("q4_0")), n_ctx=256, n_threads=THREADS)
    try:
        missing = [m for m in sorted(methods) if not hasattr(llm, m)]
        assert not missing, f"the docs show llm.{missing} that SpeculativeLlama lacks"
        missing = [s for s in sorted(stats) if not hasattr(llm.stats, s)]
        assert not missing, f"the docs show llm.stats.{missing} that the statistics lack"
    finally:
        llm.close()
