"""LoRA adapters on the target (llama_cpp.Llama's lora_path / lora_scale, llama-server's --lora-scaled): the
speculative output is what llama_cpp.Llama decodes with the same adapter and scale, the adapter really
changes it, scales change at run time (the context, computed with the old weights, is not reused), shared
weights keep the adapters, and bad adapters are refused by name."""

from __future__ import annotations

from typing import Any

import pytest

pytest.importorskip("llama_cpp", reason="llama-cpp-python is not installed")

from tinycode import N_CTX, TARGET, THREADS, drafter_gguf, lora_gguf, prompts  # noqa: E402

from dflash_gguf import DFlashError, SpeculativeLlama  # noqa: E402

PROMPTS = [p["text"] for p in prompts()[1:5]]
N_NEW = 32


def texts(llm: Any) -> list[str]:
    return [llm.create_completion(p, max_tokens=N_NEW, temperature=0.0)["choices"][0]["text"] for p in PROMPTS]


def llama_cpp_texts(**lora: Any) -> list[str]:
    import llama_cpp

    ref = llama_cpp.Llama(str(TARGET), n_ctx=N_CTX, n_threads=THREADS, verbose=False, **lora)
    try:
        return texts(ref)
    finally:
        ref.close()


@pytest.fixture(scope="module")
def base() -> list[str]:
    return llama_cpp_texts()


@pytest.mark.parametrize("scale", [1.0, 0.5])
def test_the_output_is_llama_cpp_s_with_the_adapter(base: list[str], scale: float) -> None:
    lora = str(lora_gguf())
    expected = llama_cpp_texts(lora_path=lora, lora_scale=scale)
    assert sum(a != b for a, b in zip(expected, base)) >= 2  # the adapter changes the text
    with SpeculativeLlama(
        str(TARGET), str(drafter_gguf("f32")), n_ctx=N_CTX, n_threads=THREADS, n_max=3, lora_path=lora, lora_scale=scale
    ) as llm:
        assert llm.lora_adapters == [{"id": 0, "path": lora, "scale": scale}]
        assert texts(llm) == expected
        assert llm.stats.accepted > 0


def test_scales_change_at_run_time_and_shared_weights_keep_them(base: list[str]) -> None:
    lora = str(lora_gguf())
    with_lora = llama_cpp_texts(lora_path=lora)
    two = [(lora, 0.0), (str(lora_gguf(seed=1)), 0.0)]
    with SpeculativeLlama(
        str(TARGET), str(drafter_gguf("f32")), n_ctx=N_CTX, n_threads=THREADS, lora_adapters=two
    ) as llm:
        assert texts(llm) == base  # scales 0: the base model
        llm.set_lora_scales([1.0, 0.0])
        # the prompt the context holds, computed by the base model: decoded again
        again = llm.create_completion(PROMPTS[-1], max_tokens=N_NEW, temperature=0.0)["choices"][0]["text"]
        assert llm.stats.reused_prompt_tokens == 0 and again == with_lora[-1]
        assert texts(llm) == with_lora
        with llm.share_weights() as shared:
            assert [a["scale"] for a in shared.lora_adapters] == [1.0, 0.0]
            assert texts(shared) == with_lora
        llm.set_lora_scales([0.0, 0.0])
        assert texts(llm) == base
        with pytest.raises(DFlashError, match="1 scales for 2 LoRA adapters"):
            llm.set_lora_scales([1.0])


def test_bad_adapters_are_refused_by_name(tmp_path: Any) -> None:
    def open_with(path: str) -> None:
        SpeculativeLlama(str(TARGET), str(drafter_gguf("f32")), n_ctx=N_CTX, n_threads=THREADS, lora_path=path)

    missing = str(tmp_path / "missing.gguf")
    with pytest.raises(DFlashError, match=f"{missing}: LoRA adapter file not found"):
        open_with(missing)
    other = str(lora_gguf(arch="llama"))
    with pytest.raises(DFlashError, match=f"{other}: libllama could not load this LoRA adapter"):
        open_with(other)
    with pytest.raises(ValueError, match="lora_adapters must be"):
        SpeculativeLlama(str(TARGET), str(drafter_gguf("f32")), lora_adapters=["x.gguf"])
