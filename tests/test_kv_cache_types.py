"""The target's K/V cache types (llama_cpp.Llama's type_k / type_v, llama-server's --cache-type-k / -v):
the speculative output is what llama_cpp.Llama decodes with the same cache types (a quantized V cache with
flash attention, as both turn it on), the type is really used, shared weights keep it, and an unknown type
is refused by name."""

from __future__ import annotations

import subprocess
import sys

import pytest

pytest.importorskip("llama_cpp", reason="llama-cpp-python is not installed")

from tinycode import N_CTX, TARGET, THREADS, drafter_gguf, prompts  # noqa: E402

from dflash_gguf import DFlashError, SpeculativeLlama  # noqa: E402

PROMPTS = [p["text"] for p in prompts()[:3]]
GGML = {"f16": 1, "q4_0": 2, "q8_0": 8}


def texts(llm: object) -> list[str]:
    return [llm.create_completion(p, max_tokens=32, temperature=0.0)["choices"][0]["text"] for p in PROMPTS]  # type: ignore[attr-defined]


def llama_cpp_texts(type_k: str, type_v: str) -> list[str]:
    import llama_cpp

    ref = llama_cpp.Llama(
        str(TARGET),
        n_ctx=N_CTX,
        n_threads=THREADS,
        type_k=GGML[type_k],
        type_v=GGML[type_v],
        flash_attn=type_v != "f16",
        verbose=False,
    )
    try:
        return texts(ref)
    finally:
        ref.close()


@pytest.mark.parametrize(("type_k", "type_v"), [("q8_0", "q8_0"), ("q4_0", "q4_0"), ("q8_0", "f16")])
def test_the_output_is_llama_cpp_s_with_the_same_cache(type_k: str, type_v: str) -> None:
    expected = llama_cpp_texts(type_k, type_v)
    with SpeculativeLlama(
        str(TARGET),
        str(drafter_gguf("f32")),
        n_ctx=N_CTX,
        n_threads=THREADS,
        n_max=3,
        type_k=type_k,
        type_v=GGML[type_v],
    ) as llm:
        assert texts(llm) == expected
        assert llm.stats.accepted > 0
        with llm.share_weights() as shared:
            assert texts(shared) == expected
    if type_k == "q4_0":  # a 4-bit cache changes the text: the type is used
        assert expected != llama_cpp_texts("f16", "f16")


def test_an_unknown_type_is_refused() -> None:
    with pytest.raises(DFlashError, match="K/V cache type must be one of .*got 'q3_k'"):
        SpeculativeLlama(str(TARGET), str(drafter_gguf("f32")), n_ctx=N_CTX, type_v="q3_k")
    with pytest.raises(ValueError, match="999 is no GGML type"):
        SpeculativeLlama(str(TARGET), str(drafter_gguf("f32")), n_ctx=N_CTX, type_k=999)


def test_the_cli_options() -> None:
    cmd = [sys.executable, "-m", "dflash_gguf.cli", "generate", "-m", str(TARGET), "-d", str(drafter_gguf("f32"))]
    cmd += ["-c", str(N_CTX), "-t", str(THREADS), "-n", "32", "--no-stream", "-p", PROMPTS[0]]
    out = subprocess.run([*cmd, "-ctk", "q4_0", "-ctv", "q4_0"], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout == PROMPTS[0] + llama_cpp_texts("q4_0", "q4_0")[0] + "\n"
