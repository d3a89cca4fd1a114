"""scripts/demo.py (`make demo`): the target's greedy continuation, decoded plainly and speculatively, with
both speeds, the mean accepted length and whether the two outputs are identical (exit 1 when not)."""

from __future__ import annotations

import functools
import importlib.util
import re
import subprocess
import sys

import pytest

pytest.importorskip("llama_cpp", reason="llama-cpp-python is not installed")
from tinycode import N_CTX, ROOT, TARGET, THREADS, GreedyReference, drafter_gguf, prompts  # noqa: E402

SCRIPT = ROOT / "scripts" / "demo.py"
N = 48


@functools.cache
def demo_module():
    spec = importlib.util.spec_from_file_location("demo", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    sys.modules["demo"] = module  # a dataclass looks its module up there
    spec.loader.exec_module(module)
    return module


def demo_args(*more: str) -> list[str]:
    return [
        "--target",
        str(TARGET),
        "--draft",
        str(drafter_gguf("q4_0")),
        "-n",
        str(N),
        "-t",
        str(THREADS),
        "-c",
        str(N_CTX),
        *more,
    ]


def figures(out: str) -> dict[str, float]:
    plain = re.search(r"^plain +([0-9.]+) tok/s +(\d+) target passes", out, re.M)
    spec = re.search(
        r"^speculative +([0-9.]+) tok/s +(\d+) target passes, mean accepted length ([0-9.]+) "
        r"\((\d+)/(\d+) drafted tokens accepted\)",
        out,
        re.M,
    )
    ratio = re.search(r"^speculative / plain decode speed: ([0-9.]+)x", out, re.M)
    assert plain and spec and ratio, out
    return {
        "plain_tps": float(plain[1]),
        "plain_passes": int(plain[2]),
        "spec_tps": float(spec[1]),
        "spec_passes": int(spec[2]),
        "mean_accepted": float(spec[3]),
        "accepted": int(spec[4]),
        "drafted": int(spec[5]),
        "ratio": float(ratio[1]),
    }


def test_demo_reports_identical_outputs_and_the_figures() -> None:
    """The printed continuation is the target's own greedy one (llama_cpp.Llama, one token per decode),
    both speeds are measured, and the speculative run needed fewer target passes, as its mean accepted
    length says."""
    res = subprocess.run([sys.executable, str(SCRIPT), *demo_args()], capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stdout + res.stderr
    out = res.stdout
    assert f"outputs identical: yes ({N} tokens)" in out

    prompt = next(p for p in prompts() if p["id"] == demo_module().DEFAULT_PROMPT)
    ref = GreedyReference()
    want = ref.greedy(ref.tokenize(prompt["text"]), N).tokens
    assert len(want) == N  # no end of text within N tokens: the demo generates all N
    from dflash_gguf import SpeculativeLlama

    with SpeculativeLlama(str(TARGET), str(drafter_gguf("q4_0")), n_ctx=N_CTX, n_threads=THREADS) as llm:
        text = llm.detokenize(want).decode("utf-8")
    head = f"(the same from both runs)\n{text}\n== plain vs speculative"
    assert head in out, out
    assert out.startswith(f"== prompt {prompt['id']} ")
    assert prompt["text"] in out

    f = figures(out)
    assert f["plain_tps"] > 0 and f["spec_tps"] > 0
    assert f["ratio"] == pytest.approx(f["spec_tps"] / f["plain_tps"], abs=0.01)
    assert f["plain_passes"] == N - 1  # the prefill gives the first token, each pass one more
    assert 0 < f["accepted"] <= f["drafted"]
    # every pass drafted (no "of them drafting"): each gives its accepted drafts plus the target's own token
    assert f["mean_accepted"] == pytest.approx((f["accepted"] + f["spec_passes"]) / f["spec_passes"], abs=0.01)
    assert f["mean_accepted"] > 1.5
    assert f["spec_passes"] < f["plain_passes"]


def test_a_drafted_output_that_differs_fails_the_demo(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """A speculative run whose output is not the plain run's: exit status 1, the mismatch named."""
    from dflash_gguf import SpeculativeLlama

    generate_tokens = SpeculativeLlama.generate_tokens

    def wrong_when_drafting(self, tokens, **kw):
        out = list(generate_tokens(self, tokens, **kw))
        if not kw.get("plain") and len(out) > 5:
            out[5] = (out[5] + 1) % 2048
        return iter(out)

    monkeypatch.setattr(SpeculativeLlama, "generate_tokens", wrong_when_drafting)
    assert demo_module().main(demo_args()) == 1
    out = capsys.readouterr().out
    assert "outputs identical: NO, they differ from token 5 on" in out
    assert "outputs identical: yes" not in out
    assert "(the same from both runs)" not in out


def test_first_difference() -> None:
    first_difference = demo_module().first_difference
    assert first_difference([1, 2, 3], [1, 2, 3]) is None
    assert first_difference([1, 2, 3], [1, 9, 3]) == 1
    assert first_difference([1, 2, 3], [1, 2]) == 2  # a speculative run that stopped early differs too


def test_bad_prompt_id_is_a_usage_error() -> None:
    res = subprocess.run(
        [sys.executable, str(SCRIPT), *demo_args("--prompt-id", "no-such-prompt")],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert res.returncode == 2 and res.stdout == ""
    assert "no prompt with id 'no-such-prompt'" in res.stderr
