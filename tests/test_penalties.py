"""Repeat / frequency / presence penalties and logit_bias in the speculative loop, greedy.

Penalties make each verified row's target distribution depend on the drafted
tokens before it, so the loop must shape row j's logits with the window that
includes d_1..d_j. Asserted on the bundled pair: the speculative loop emits
token for token what our plain loop and llama_cpp.Llama (its own penalties
sampler) emit with the same settings, drafts are still accepted, and the
settings really change the output (a loop that ignored them would fail).
The sampled (T > 0) case is in test_sampling.py.
"""

from __future__ import annotations

import subprocess
import sys
from collections import Counter
from typing import Any

import pytest

pytest.importorskip("llama_cpp", reason="llama-cpp-python is not installed")

from tinycode import EOS, N_CTX, TARGET, THREADS, GreedyReference, drafter_gguf, prompts  # noqa: E402

from dflash_gguf import SpeculativeLlama  # noqa: E402

N_NEW = 64
N_PROMPTS = 6
PENALTIES = dict(repeat_penalty=1.3, frequency_penalty=0.2, presence_penalty=0.2)


@pytest.fixture(scope="module")
def spec() -> SpeculativeLlama:
    return SpeculativeLlama(str(TARGET), str(drafter_gguf("f32")), n_ctx=N_CTX, n_threads=THREADS, n_max=3)


@pytest.fixture(scope="module")
def llm() -> Any:
    return GreedyReference(TARGET, n_ctx=N_CTX, n_threads=THREADS).llm


@pytest.fixture(scope="module")
def ptoks(llm: Any) -> list[list[int]]:
    return [llm.tokenize(p["text"].encode(), add_bos=False, special=False) for p in prompts()[:N_PROMPTS]]


def llama_cpp_greedy(llm: Any, toks: list[int], n: int, **penalties: float) -> list[int]:
    out: list[int] = []
    for t in llm.generate(toks, temp=0.0, reset=True, **penalties):
        if t == EOS or len(out) == n:
            break
        out.append(int(t))
    return out


def test_penalized_greedy_is_what_plain_decoding_emits(
    spec: SpeculativeLlama, llm: Any, ptoks: list[list[int]]
) -> None:
    changed = accepted = 0
    for i, toks in enumerate(ptoks):
        ours = list(spec.generate_tokens(toks, max_tokens=N_NEW, temperature=0.0, **PENALTIES))
        accepted += spec.stats.accepted
        plain = list(spec.generate_tokens(toks, max_tokens=N_NEW, temperature=0.0, plain=True, **PENALTIES))
        assert ours == plain, f"prompt {i}: speculative vs our plain loop"
        assert ours == llama_cpp_greedy(llm, toks, N_NEW, **PENALTIES), f"prompt {i}: vs llama_cpp.Llama"
        changed += ours != list(spec.generate_tokens(toks, max_tokens=N_NEW, temperature=0.0))
    assert changed >= N_PROMPTS // 2, f"the penalties changed only {changed} of {N_PROMPTS} outputs"
    assert accepted > 0


def test_each_penalty_alone(spec: SpeculativeLlama, llm: Any, ptoks: list[list[int]]) -> None:
    for one in (dict(repeat_penalty=1.5), dict(frequency_penalty=0.5), dict(presence_penalty=1.0)):
        toks = ptoks[0]
        ours = list(spec.generate_tokens(toks, max_tokens=N_NEW, temperature=0.0, **one))
        assert ours == llama_cpp_greedy(llm, toks, N_NEW, **one), one


def test_logit_bias(spec: SpeculativeLlama, ptoks: list[list[int]]) -> None:
    """A banned token never appears; the biased loop emits what plain decoding with the same bias emits."""
    toks = ptoks[1]
    free = list(spec.generate_tokens(toks, max_tokens=N_NEW))
    banned = Counter(free).most_common(1)[0][0]
    bias = {banned: -float("inf")}
    ours = list(spec.generate_tokens(toks, max_tokens=N_NEW, logit_bias=bias))
    assert banned not in ours and ours != free
    assert ours == list(spec.generate_tokens(toks, max_tokens=N_NEW, logit_bias=bias, plain=True))
    assert spec.stats.completion_tokens == len(ours)


def test_completion_takes_llama_cpp_arguments(spec: SpeculativeLlama, llm: Any, ptoks: list[list[int]]) -> None:
    """create_completion with penalties and logit_bias gives llama_cpp.Llama.create_completion's text."""
    kw: dict[str, Any] = dict(max_tokens=48, temperature=0.0, logit_bias={220: 1.5}, **PENALTIES)
    ours = spec.create_completion(ptoks[2], **kw)["choices"][0]["text"]
    theirs = llm.create_completion(ptoks[2], **kw)["choices"][0]["text"]
    assert ours == theirs


@pytest.mark.parametrize(
    "bad",
    [
        dict(repeat_penalty=0.0),
        dict(repeat_penalty=-1.0),
        dict(frequency_penalty=float("nan")),
        dict(logit_bias={"x": 1.0}),
        dict(logit_bias={5: float("nan")}),
        dict(logit_bias={10**6: 1.0}),
        dict(logit_bias={-1: 1.0}),
    ],
)
def test_bad_values_raise(spec: SpeculativeLlama, ptoks: list[list[int]], bad: dict[str, Any]) -> None:
    with pytest.raises(ValueError):
        list(spec.generate_tokens(ptoks[0], max_tokens=4, **bad))
    assert len(list(spec.generate_tokens(ptoks[0], max_tokens=4))) == 4  # and the object still works


def test_bad_window_raises() -> None:
    with pytest.raises(ValueError, match="last_n_tokens_size"):
        SpeculativeLlama(str(TARGET), str(drafter_gguf("f32")), n_ctx=N_CTX, last_n_tokens_size=-1)


def run_generate(*args: str) -> subprocess.CompletedProcess[str]:
    cmd = [
        sys.executable,
        "-m",
        "dflash_gguf.cli",
        "generate",
        "-m",
        str(TARGET),
        "-d",
        str(drafter_gguf("f32")),
        "-c",
        str(N_CTX),
        "-t",
        str(THREADS),
        "--n-max",
        "3",
        *args,
    ]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=120)


def test_cli_penalties(spec: SpeculativeLlama) -> None:
    """`dflash generate --repeat-penalty/--presence-penalty/--frequency-penalty/--repeat-last-n` print what
    create_completion gives with the same settings; a bad value is a one-line error, before any text."""
    prompt = prompts()[3]["text"]
    pen = [
        "--repeat-penalty",
        "1.3",
        "--presence-penalty",
        "0.2",
        "--frequency-penalty",
        "0.2",
        "--repeat-last-n",
        "32",
    ]
    r = run_generate("-p", prompt, "-n", "40", "--no-stream", *pen)
    assert r.returncode == 0, r.stderr
    assert "[dflash] " in r.stderr and "Traceback" not in r.stderr
    spec.last_n_tokens_size = 32
    try:
        want = spec.create_completion(
            prompt, max_tokens=40, temperature=0.0, repeat_penalty=1.3, presence_penalty=0.2, frequency_penalty=0.2
        )["choices"][0]["text"]
    finally:
        spec.last_n_tokens_size = 64
    assert r.stdout == prompt + want + "\n"
    plain = run_generate("-p", prompt, "-n", "40", "--no-stream")
    assert plain.returncode == 0 and plain.stdout != r.stdout

    bad = run_generate("-p", prompt, "-n", "4", "--repeat-penalty", "0")
    assert bad.returncode == 2 and bad.stdout == ""
    assert bad.stderr.strip() == "dflash: error: repeat_penalty must be > 0 (1 = off), got 0.0"
