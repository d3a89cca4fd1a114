"""The llama-cpp-python-shaped API of SpeculativeLlama on the bundled tinycode pair.

Completions (streaming and not), stop strings, finish reasons, result shapes
(compared key for key with llama_cpp.Llama's), chat (ChatML when the GGUF has
no template), from_llama, argument errors (a clear ValueError, and the object
and process keep working), and threads (one generation at a time per object,
independent objects in parallel).
"""

from __future__ import annotations

import itertools
import json
import os
import threading
from pathlib import Path
from typing import Any

import numpy as np
import pytest

llama_cpp = pytest.importorskip("llama_cpp", reason="llama-cpp-python is not installed")

from tinycode import (  # noqa: E402
    N_CTX,
    TARGET,
    THREADS,
    GreedyReference,
    _target_copy,
    compare_greedy,
    drafter_gguf,
    mismatched_drafter_gguf,
    prompts,
)

from dflash_gguf import DFlashError, SpeculativeLlama  # noqa: E402

EPS = 1e-2
GREEDY = {"temperature": 0.0}


@pytest.fixture(scope="module")
def draft() -> str:
    return str(drafter_gguf("f32"))


@pytest.fixture(scope="module")
def spec(draft: str) -> SpeculativeLlama:
    return SpeculativeLlama(str(TARGET), draft, n_ctx=N_CTX, n_threads=THREADS, n_max=7)  # fixed: seeded runs repeat


@pytest.fixture(scope="module")
def ref() -> GreedyReference:
    return GreedyReference(TARGET, n_ctx=N_CTX, n_threads=THREADS)


@pytest.fixture(scope="module")
def llm() -> Any:
    """llama-cpp-python's own Llama on the target, for result shapes."""
    return llama_cpp.Llama(
        str(TARGET), n_ctx=N_CTX, n_threads=THREADS, n_threads_batch=THREADS, verbose=False, chat_format="chatml"
    )


def _text(i: int) -> str:
    return prompts()[i]["text"]


def _toks(spec: SpeculativeLlama, i: int) -> list[int]:
    return spec.tokenize(_text(i), add_special=False, parse_special=False)


def _llama_usage(usage: dict[str, Any]) -> dict[str, Any]:
    """Our usage as llama_cpp.Llama's (which has no prompt_tokens_details: the cached tokens are
    test_cached_tokens_are_the_reused_prompt_s)."""
    details = usage["prompt_tokens_details"]
    assert set(details) == {"cached_tokens"} and 0 <= details["cached_tokens"] < usage["prompt_tokens"]
    return {k: v for k, v in usage.items() if k != "prompt_tokens_details"}


@pytest.fixture(scope="module")
def baseline(spec: SpeculativeLlama) -> dict[int, list[int]]:
    """Greedy token outputs (64 tokens) for a few prompts, taken before anything else runs on the object."""
    return {i: list(spec.generate_tokens(_toks(spec, i), max_tokens=64)) for i in (0, 4, 6, 10)}


def _still_works(spec: SpeculativeLlama, baseline: dict[int, list[int]]) -> None:
    assert list(spec.generate_tokens(_toks(spec, 4), max_tokens=64)) == baseline[4]


# --------------------------------------------------------------------------- #
# completions
# --------------------------------------------------------------------------- #


def test_stream_and_plain_completion_give_the_same_text(spec: SpeculativeLlama) -> None:
    prompt = _text(1)
    full = spec.create_completion(prompt, max_tokens=64, **GREEDY)
    chunks = list(spec.create_completion(prompt, max_tokens=64, stream=True, **GREEDY))
    streamed = "".join(c["choices"][0]["text"] for c in chunks)
    assert streamed == full["choices"][0]["text"]
    assert len(chunks) > 5  # really streamed
    assert [c["choices"][0]["finish_reason"] for c in chunks[:-1]] == [None] * (len(chunks) - 1)
    assert chunks[-1]["choices"][0]["finish_reason"] == full["choices"][0]["finish_reason"] == "length"
    assert len({c["id"] for c in chunks}) == 1
    # and it is the detokenized token stream
    toks = list(spec.generate_tokens(spec.tokenize(prompt, special=True), max_tokens=64, **GREEDY))
    assert full["choices"][0]["text"] == spec.detokenize(toks).decode("utf-8", errors="replace")
    assert _llama_usage(full["usage"]) == {
        "prompt_tokens": len(spec.tokenize(prompt, special=True)),
        "completion_tokens": 64,
        "total_tokens": len(spec.tokenize(prompt, special=True)) + 64,
    }


def test_stop_strings_cut_the_text(spec: SpeculativeLlama) -> None:
    prompt = _text(3)
    full = spec.create_completion(prompt, max_tokens=64, **GREEDY)["choices"][0]["text"]
    # a stop string from the middle of the text (first occurrence decides)
    stop = next(full[i : i + 4] for i in range(len(full) // 2, len(full) - 4) if full[i : i + 4].strip())
    want = full[: full.index(stop)]
    for stream in (False, True):
        if stream:
            chunks = list(spec.create_completion(prompt, max_tokens=64, stop=[stop], stream=True, **GREEDY))
            text = "".join(c["choices"][0]["text"] for c in chunks)
            reason = chunks[-1]["choices"][0]["finish_reason"]
            assert all(stop not in c["choices"][0]["text"] for c in chunks)
        else:
            out = spec.create_completion(prompt, max_tokens=64, stop=stop, **GREEDY)
            text, reason = out["choices"][0]["text"], out["choices"][0]["finish_reason"]
            assert out["usage"]["completion_tokens"] < 64
        assert text == want, (stream, stop)
        assert reason == "stop" and spec.stopping_word == stop
    # a stop string that never occurs changes nothing
    out = spec.create_completion(prompt, max_tokens=64, stop=["\x00never\x00"], **GREEDY)
    assert out["choices"][0]["text"] == full and out["choices"][0]["finish_reason"] == "length"
    assert spec.stopping_word == ""


def test_the_stop_string_that_begins_first_ends_the_text() -> None:
    """Of several stop strings in one piece, the one that begins first (on a tie the one listed first, as
    llama-server chooses) cuts the text and is the one reported."""
    from dflash_gguf.text import TextStream

    for stops, piece, text, word in (
        (["cd", "b"], b"abcde", "a", "b"),
        (["abc", "ab"], b"xabcd", "x", "abc"),
        (["ab", "abc"], b"xabcd", "x", "ab"),
        (["zz"], b"xabcd", "xabc", ""),  # the last character held: a stop string may begin there
    ):
        stream = TextStream(stops)
        assert (stream.feed(piece), stream.stopped_by, stream.stopped) == (text, word, bool(word)), stops


def test_max_tokens_gives_length(spec: SpeculativeLlama) -> None:
    prompt = _text(2)
    for n in (1, 5, 17):
        out = spec.create_completion(prompt, max_tokens=n, **GREEDY)
        assert out["choices"][0]["finish_reason"] == "length"
        assert out["usage"]["completion_tokens"] == n
        assert spec.stats.completion_tokens == n
    # sampled too (seeded: reproducible)
    a = spec.create_completion(prompt, max_tokens=12, temperature=0.8, seed=3)
    b = spec.create_completion(prompt, max_tokens=12, temperature=0.8, seed=3)
    assert a["choices"][0]["text"] == b["choices"][0]["text"]
    assert a["choices"][0]["finish_reason"] in ("length", "stop")


def test_max_tokens_beyond_the_context_stops_where_llama_cpp_does(draft: str) -> None:
    # a completion and its prompt fit the context (llama_cpp.Llama caps max_tokens so): one token more
    # could be sampled from the last logits, but usage would then count more tokens than n_ctx holds
    ours = SpeculativeLlama(str(TARGET), draft, n_ctx=256, n_threads=THREADS, n_max=7)
    llm = llama_cpp.Llama(str(TARGET), n_ctx=256, n_threads=THREADS, verbose=False)
    try:
        for max_tokens in (500, None):
            a = ours.create_completion("def add(a, b):\n", max_tokens=max_tokens, **GREEDY)
            b = llm.create_completion("def add(a, b):\n", max_tokens=max_tokens, **GREEDY)
            assert _llama_usage(a["usage"]) == b["usage"] and a["usage"]["total_tokens"] == 256
            assert a["choices"][0]["text"] == b["choices"][0]["text"]
            assert a["choices"][0]["finish_reason"] == "length"
    finally:
        ours.close()
        llm.close()


def _keys(d: dict[str, Any]) -> set[str]:
    return set(d)


def test_result_shapes_match_llama_cpp(spec: SpeculativeLlama, llm: Any) -> None:
    """Key for key llama_cpp.Llama's, plus what OpenAI and llama-server send and it does not:
    system_fingerprint, and usage.prompt_tokens_details."""
    prompt = _text(0)
    ours, theirs = (
        spec.create_completion(prompt, max_tokens=4, **GREEDY),
        llm.create_completion(prompt, max_tokens=4, **GREEDY),
    )
    assert (
        _keys(ours) - {"system_fingerprint"}
        == _keys(theirs)
        == {"id", "object", "created", "model", "choices", "usage"}
    )
    assert ours["object"] == theirs["object"] == "text_completion"
    assert _keys(ours["choices"][0]) == _keys(theirs["choices"][0])
    assert _keys(ours["usage"]) - {"prompt_tokens_details"} == _keys(theirs["usage"])
    assert isinstance(ours["created"], int) and isinstance(ours["id"], str) and ours["id"].startswith("cmpl-")
    assert ours["usage"]["prompt_tokens"] == theirs["usage"]["prompt_tokens"]

    o_chunks = list(spec.create_completion(prompt, max_tokens=4, stream=True, **GREEDY))
    t_chunks = list(llm.create_completion(prompt, max_tokens=4, stream=True, **GREEDY))
    assert _keys(o_chunks[0]) - {"system_fingerprint"} == _keys(t_chunks[0])
    assert _keys(o_chunks[0]["choices"][0]) == _keys(t_chunks[0]["choices"][0])

    msgs = [{"role": "user", "content": "def add(a, b):"}]
    oc, tc = (
        spec.create_chat_completion(msgs, max_tokens=4, **GREEDY),
        llm.create_chat_completion(msgs, max_tokens=4, **GREEDY),
    )
    assert _keys(oc) - {"system_fingerprint"} == _keys(tc) == {"id", "object", "created", "model", "choices", "usage"}
    assert oc["object"] == tc["object"] == "chat.completion"
    assert _keys(oc["choices"][0]) == _keys(tc["choices"][0])
    assert _keys(oc["choices"][0]["message"]) == _keys(tc["choices"][0]["message"])
    assert oc["choices"][0]["message"]["role"] == "assistant"
    # llama-server's ChatML (no template in the GGUF): llama-cpp-python's "chatml" format adds an empty
    # system turn before it
    empty_system = len(spec.tokenize("<|im_start|>system\n<|im_end|>\n", special=True))
    assert oc["usage"]["prompt_tokens"] == tc["usage"]["prompt_tokens"] - empty_system

    ocs = list(spec.create_chat_completion(msgs, max_tokens=4, stream=True, **GREEDY))
    tcs = list(llm.create_chat_completion(msgs, max_tokens=4, stream=True, **GREEDY))
    for o, t in ((ocs[0], tcs[0]), (ocs[1], tcs[1]), (ocs[-1], tcs[-1])):
        assert _keys(o) - {"system_fingerprint"} == _keys(t)
        assert _keys(o["choices"][0]) == _keys(t["choices"][0])
        assert _keys(o["choices"][0]["delta"]) == _keys(t["choices"][0]["delta"])
    assert ocs[0]["choices"][0]["delta"] == {"role": "assistant"}
    assert ocs[-1]["choices"][0]["finish_reason"] is not None
    for out in (ours, *o_chunks, oc, *ocs):
        assert out["system_fingerprint"] == spec.system_fingerprint


# what LangChain's LlamaCpp (and other wrappers) pass to llama_cpp.Llama on every call
WRAPPER_DEFAULTS = {
    "suffix": None,
    "logprobs": None,
    "typical_p": 1.0,
    "tfs_z": 1.0,
    "mirostat_mode": 0,
    "mirostat_tau": 5.0,
    "mirostat_eta": 0.1,
    "grammar": None,
    "stopping_criteria": None,
    "logits_processor": None,
}


def test_llama_cpp_options_are_taken(spec: SpeculativeLlama, llm: Any) -> None:
    """Every option llama_cpp.Llama's completions take is taken (a framework passing all of them works):
    typical_p and Mirostat sample (tests/test_sampling.py checks their distributions), tfs_z is ignored as
    llama_cpp.Llama 0.3.36 ignores it, suffix (whose token ids llama_cpp.Llama 0.3.36 leaves at 0) is
    refused unless None; echo and model work as in llama_cpp.Llama."""
    prompt = _text(0)
    plain = spec(prompt, max_tokens=8, **GREEDY)["choices"][0]["text"]
    wrapped = spec(prompt, max_tokens=8, echo=False, model=None, **WRAPPER_DEFAULTS, **GREEDY)
    assert wrapped["choices"][0]["text"] == plain
    sampled = dict(max_tokens=24, temperature=1.0, top_k=0, top_p=1.0, min_p=0.0)
    texts = {}
    for name, opts in (
        ("plain", {}),
        ("tfs_z", {"tfs_z": 0.5}),
        ("typical", {"typical_p": 0.3}),
        ("mirostat1", {"mirostat_mode": 1, "mirostat_tau": 1.0}),
        ("mirostat2", {"mirostat_mode": 2, "mirostat_tau": 1.0}),
    ):
        texts[name] = [spec(prompt, seed=s, **sampled, **opts)["choices"][0]["text"] for s in range(4)]
        assert texts[name] == [spec(prompt, seed=s, **sampled, **opts)["choices"][0]["text"] for s in range(4)]
    assert texts["tfs_z"] == texts["plain"]
    assert all(texts[k] != texts["plain"] for k in ("typical", "mirostat1", "mirostat2"))
    # greedy stays greedy, as in llama_cpp.Llama (temperature 0 comes before Mirostat in its chain)
    assert spec(prompt, max_tokens=8, mirostat_mode=2, **GREEDY)["choices"][0]["text"] == plain
    with pytest.raises(ValueError, match="suffix"):
        spec(prompt, max_tokens=8, suffix="x")
    with pytest.raises(TypeError, match="tools"):
        spec(prompt, max_tokens=8, tools=None)  # a chat option
    with pytest.raises(TypeError, match="bogus"):
        spec(prompt, max_tokens=8, bogus=1)

    echoed = spec(prompt, max_tokens=8, echo=True, model="named", **GREEDY)
    assert echoed["choices"][0]["text"] == prompt + plain and echoed["model"] == "named"
    theirs = llm(prompt, max_tokens=8, echo=True, **GREEDY)["choices"][0]["text"]
    assert theirs.startswith(prompt)  # llama_cpp.Llama's echo means the same
    chunks = list(spec(prompt, max_tokens=8, echo=True, stream=True, **GREEDY))
    assert "".join(c["choices"][0]["text"] for c in chunks) == prompt + plain
    toks = _toks(spec, 0)
    assert spec.create_completion(toks, max_tokens=8, echo=True, **GREEDY)["choices"][0]["text"] == prompt + plain

    msgs = [{"role": "user", "content": "def add(a, b):"}]
    chat = spec.create_chat_completion(msgs, max_tokens=4, **GREEDY)
    off = {
        "tools": None,
        "tool_choice": None,
        "functions": None,
        "function_call": None,
        "response_format": None,
        "logprobs": False,
        "top_logprobs": None,
        "typical_p": 1.0,
        "grammar": None,
    }
    again = spec.create_chat_completion(msgs, max_tokens=4, model="named", **off, **GREEDY)
    assert again["choices"] == chat["choices"] and again["model"] == "named"
    with pytest.raises(TypeError, match="suffix"):
        spec.create_chat_completion(msgs, max_tokens=4, suffix=None)  # a completion option, as in llama_cpp


def test_logprobs_are_llama_cpp_s(spec: SpeculativeLlama) -> None:
    """logprobs=n gives what llama_cpp.Llama (logits_all=True) gives for the same greedy completion:
    the token strings, text offsets, log-softmax of the raw logits and the n most likely; a stop
    string cuts tokens and text alike; chat gets OpenAI's shape."""

    theirs_llm = llama_cpp.Llama(
        str(TARGET), n_ctx=N_CTX, n_threads=THREADS, n_threads_batch=THREADS, logits_all=True, verbose=False
    )
    prompt = _text(3)
    ours = spec(prompt, max_tokens=24, logprobs=3, **GREEDY)["choices"][0]
    theirs = theirs_llm(prompt, max_tokens=24, logprobs=3, **GREEDY)["choices"][0]
    assert ours["text"] == theirs["text"]
    a, b = ours["logprobs"], theirs["logprobs"]
    assert a["tokens"] == b["tokens"] and a["text_offset"] == b["text_offset"] and len(a["tokens"]) == 24
    np.testing.assert_allclose(a["token_logprobs"], np.asarray(b["token_logprobs"], dtype=float), atol=2e-3)
    for mine, want in zip(a["top_logprobs"], b["top_logprobs"]):
        assert 3 <= len(mine) <= 4 and all(isinstance(v, float) for v in mine.values())
        common = set(mine) & set(want)
        assert len(common) >= 3  # a near-tie at the 3rd place may swap one
        for k in common:
            assert abs(mine[k] - float(want[k])) <= 2e-3
    assert "".join(a["tokens"]) == ours["text"]

    stop = ours["text"][10:14]
    cut = spec(prompt, max_tokens=24, logprobs=0, stop=stop, **GREEDY)["choices"][0]
    assert cut["finish_reason"] == "stop" and "".join(cut["logprobs"]["tokens"]).startswith(cut["text"])
    assert len(cut["logprobs"]["tokens"]) < 24 and all(len(t) == 1 for t in cut["logprobs"]["top_logprobs"])

    sampled = spec(prompt, max_tokens=16, logprobs=2, temperature=1.0, seed=5)["choices"][0]["logprobs"]
    for lp, top in zip(sampled["token_logprobs"], sampled["top_logprobs"]):
        assert lp <= 0.0 and sum(np.exp(list(top.values()))) <= 1.0 + 1e-5

    msgs = [{"role": "user", "content": "def add(a, b):"}]
    chat = spec.create_chat_completion(msgs, max_tokens=8, logprobs=True, top_logprobs=2, **GREEDY)["choices"][0]
    content = chat["logprobs"]["content"]
    assert "".join(c["token"] for c in content) == chat["message"]["content"]
    assert all(len(c["top_logprobs"]) in (2, 3) and c["bytes"] == list(c["token"].encode()) for c in content)
    assert spec.create_chat_completion(msgs, max_tokens=8, **GREEDY)["choices"][0]["logprobs"] is None

    streamed = [c["choices"][0] for c in spec(prompt, max_tokens=24, logprobs=3, stream=True, **GREEDY)]
    merged = {k: [v for c in streamed if c["logprobs"] for v in c["logprobs"][k]] for k in a}
    assert merged == a  # each chunk carries its own tokens, together what the whole completion has
    assert all(c["logprobs"] is None or "".join(c["logprobs"]["tokens"]) == c["text"] for c in streamed)
    chat_chunks = list(
        spec.create_chat_completion(msgs, max_tokens=8, logprobs=True, top_logprobs=2, stream=True, **GREEDY)
    )
    assert [
        e for c in chat_chunks if c["choices"][0]["logprobs"] for e in c["choices"][0]["logprobs"]["content"]
    ] == content

    for bad in (-1, True, 1.5):
        with pytest.raises(ValueError, match="logprobs"):
            spec(prompt, max_tokens=4, logprobs=bad)


def test_echo_logprobs_cover_the_prompt(spec: SpeculativeLlama) -> None:
    """echo=True with logprobs lists the prompt's tokens too, each under the target's row before it (the
    first None, OpenAI's shape), then the completion's as without echo; streamed alike. llama_cpp.Llama
    reads each prompt token from the row after it and drops the last completion token, so its own
    logits (logits_all=True) are the reference here."""

    prompt = _text(7)
    toks = _toks(spec, 7)
    plain = spec(prompt, max_tokens=12, logprobs=2, **GREEDY)["choices"][0]
    ours = spec(prompt, max_tokens=12, logprobs=2, echo=True, **GREEDY)["choices"][0]
    lp = ours["logprobs"]
    assert ours["text"] == prompt + plain["text"] and "".join(lp["tokens"]) == ours["text"]
    assert len(lp["tokens"]) == len(toks) + 12 and lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
    assert lp["text_offset"] == [len("".join(lp["tokens"][:k])) for k in range(len(lp["tokens"]))]
    n = len(toks)
    np.testing.assert_allclose(lp["token_logprobs"][n:], plain["logprobs"]["token_logprobs"], atol=1e-5)
    assert lp["tokens"][n:] == plain["logprobs"]["tokens"]

    theirs = llama_cpp.Llama(
        str(TARGET), n_ctx=N_CTX, n_threads=THREADS, n_threads_batch=THREADS, logits_all=True, verbose=False
    )
    theirs.eval(toks)
    rows = np.asarray(theirs.scores[: n - 1], dtype=np.float64)
    log_softmax = rows - rows.max(1, keepdims=True)
    log_softmax -= np.log(np.exp(log_softmax).sum(1, keepdims=True))
    want = log_softmax[np.arange(n - 1), toks[1:]]
    np.testing.assert_allclose(lp["token_logprobs"][1:n], want, atol=2e-3)
    for k in range(1, n):  # the most likely at each prompt position, and the token itself
        top = lp["top_logprobs"][k]
        best = spec.detokenize([int(np.argmax(rows[k - 1]))]).decode("utf-8", "ignore")
        assert best in top and lp["tokens"][k] in top and 2 <= len(top) <= 3

    streamed = [c["choices"][0] for c in spec(prompt, max_tokens=12, logprobs=2, echo=True, stream=True, **GREEDY)]
    assert "".join(c["text"] for c in streamed) == ours["text"]
    assert {k: [v for c in streamed if c["logprobs"] for v in c["logprobs"][k]] for k in lp} == lp
    with SpeculativeLlama(str(TARGET), spec.draft_path, n_ctx=N_CTX, n_batch=16, n_threads=THREADS, n_max=3) as small:
        chunked = small(prompt, max_tokens=12, logprobs=2, echo=True, **GREEDY)["choices"][0]  # prefill in chunks
    assert chunked["logprobs"]["tokens"] == lp["tokens"]
    np.testing.assert_allclose(chunked["logprobs"]["token_logprobs"][1:], lp["token_logprobs"][1:], atol=1e-4)
    again = spec(prompt, max_tokens=12, logprobs=2, **GREEDY)["choices"][0]  # and on as before
    assert again["text"] == plain["text"] and again["logprobs"]["tokens"] == plain["logprobs"]["tokens"]
    # the prompt is reused but for its last token, decoded alone: libllama's one-token kernels round
    # otherwise than a whole prompt's (the same call twice differs by up to 7e-4 on an AVX2 EPYC)
    np.testing.assert_allclose(again["logprobs"]["token_logprobs"], plain["logprobs"]["token_logprobs"], atol=2e-3)


def test_grammar_constrains_as_in_llama_cpp(spec: SpeculativeLlama, llm: Any) -> None:
    """A GBNF grammar (llama_cpp.LlamaGrammar or its text) masks every verified row with its state after
    the tokens before it: greedy output equals llama_cpp.Llama's with the same grammar (which also ends
    it: finish reason stop when the grammar is complete), sampled output follows it, and a grammar that
    does not parse is an error that leaves the object working."""
    import re

    from llama_cpp import LlamaGrammar

    # GBNF -> (the whole output's pattern when the grammar ended it, a pattern any cut-off output matches)
    grammars = {
        "root ::= [a-z \\n]+": (r"[a-z \n]+", r"[a-z \n]*"),
        'root ::= "return " [a-z_]+ "(" [a-z_, ]* ")\\n"': (
            r"return [a-z_]+\([a-z_, ]*\)\n",
            r"return [a-z_]*(\([a-z_, ]*)?",
        ),
    }

    def follows(out: dict[str, Any], whole: str, cut: str) -> bool:
        return bool(re.fullmatch(whole if out["finish_reason"] == "stop" else cut, out["text"]))

    scorer = llama_cpp.Llama(str(TARGET), n_ctx=N_CTX, n_threads=THREADS, verbose=False, logits_all=True)

    def near_tie(prefix: list[int], a: int, b: int) -> bool:
        """Plain decoding's logits of tokens a and b after prefix are within EPS: a batched verify may
        round either way (as compare_greedy allows for unconstrained output)."""
        scorer.reset()
        scorer.eval(prefix)
        row = np.asarray(scorer.scores[scorer.n_tokens - 1])
        return abs(float(row[a]) - float(row[b])) < EPS

    for gbnf, (whole, cut) in grammars.items():
        g = LlamaGrammar.from_string(gbnf, verbose=False)
        for i in (0, 3):
            ours = spec(_text(i), max_tokens=40, grammar=g, **GREEDY)["choices"][0]
            theirs = llm(_text(i), max_tokens=40, grammar=g, **GREEDY)["choices"][0]
            if (ours["text"], ours["finish_reason"]) != (theirs["text"], theirs["finish_reason"]):
                toks = _toks(spec, i)
                mine = list(spec.generate_tokens(toks, max_tokens=40, grammar=g))
                their = list(itertools.islice(llm.generate(toks, temp=0.0, grammar=g, reset=True), len(mine)))
                k = next(k for k, (x, y) in enumerate(zip(mine, their)) if x != y)
                assert near_tie(toks + mine[:k], mine[k], their[k]), (gbnf, i, ours["text"], theirs["text"])
            assert follows(ours, whole, cut), ours
        assert (
            spec(_text(0), max_tokens=40, grammar=gbnf, **GREEDY)["choices"][0]
            == spec(_text(0), max_tokens=40, grammar=g, **GREEDY)["choices"][0]
        )
        for seed in (3, 4):
            sampled = spec(_text(5), max_tokens=60, grammar=g, temperature=0.9, seed=seed)["choices"][0]
            assert follows(sampled, whole, cut), sampled
    # the chain's order: logit_bias, penalties, then the grammar
    g = LlamaGrammar.from_string("root ::= [a-z \\n().=_]+", verbose=False)
    for kw in ({"repeat_penalty": 1.3}, {"logit_bias": {200: 5.0, 4: -3.0}, "presence_penalty": 0.5}):
        assert (
            spec(_text(1), max_tokens=32, grammar=g, **kw, **GREEDY)["choices"][0]["text"]
            == llm(_text(1), max_tokens=32, grammar=g, **kw, **GREEDY)["choices"][0]["text"]
        ), kw
    msgs = [{"role": "user", "content": "def add(a, b):"}]
    reply = spec.create_chat_completion(msgs, max_tokens=30, grammar="root ::= [a-z ]+", **GREEDY)
    assert re.fullmatch(r"[a-z ]+", reply["choices"][0]["message"]["content"])

    with pytest.raises(DFlashError, match="grammar"):
        spec(_text(0), max_tokens=8, grammar="root ::= [a-z")
    # libllama's parser never returns from a repetition whose minimum exceeds its maximum: caught first
    with pytest.raises(DFlashError, match=r"repetition \{ 5 , 1 \} has its minimum above its maximum"):
        spec(_text(0), max_tokens=8, grammar='root ::= "a" { 5 , 1 }')
    # ... nor from groups nested deeper than its recursion can take (20000 levels: a segfault)
    with pytest.raises(DFlashError, match="nested more than 256"):
        spec(_text(0), max_tokens=8, grammar="root ::= " + "(" * 20000 + '"a"' + ")" * 20000)
    deepest = "root ::= " + "(" * 256 + '"a"' + ")" * 256
    assert spec(_text(0), max_tokens=4, grammar=deepest)["choices"][0]["text"] == "a"
    # the same characters inside a literal, a class or a comment are not a repetition
    quoted = '# {9,1}\nroot ::= "{3,2}" [{]{2,3}'
    assert spec(_text(0), max_tokens=8, grammar=quoted, **GREEDY)["choices"][0]["text"].startswith("{3,2}{{")
    with pytest.raises(ValueError, match="grammar"):
        spec(_text(0), max_tokens=8, grammar=42)
    assert spec(_text(0), max_tokens=8, **GREEDY)["choices"][0]["text"]  # still works


def test_logits_processor_and_stopping_criteria_are_llama_cpp_s(
    spec: SpeculativeLlama, llm: Any, baseline: dict[int, list[int]]
) -> None:
    """logits_processor(input_ids, scores) shapes every verified row with the prompt and output before
    it, so greedy output and even the processor's calls are llama_cpp.Llama's (drafts accepted on the
    way); stopping_criteria(input_ids, logits) is asked before each token with the raw logits that chose
    it, and ends the completion before that token as llama_cpp.Llama does."""

    def no_repeat(calls: list[list[int]]) -> Any:
        def proc(ids: Any, scores: Any) -> Any:  # depends on the ids: a wrong history changes the output
            calls.append(ids.tolist())
            scores = scores.copy()
            scores[ids[-1]] = -np.inf
            return scores

        return llama_cpp.LogitsProcessorList([proc])

    changed = 0
    for i in (0, 3):
        ours_calls: list[list[int]] = []
        theirs_calls: list[list[int]] = []
        ours = spec(_text(i), max_tokens=40, logits_processor=no_repeat(ours_calls), **GREEDY)["choices"][0]["text"]
        assert spec.stats.accepted > 0  # the processor shaped rows of drafted steps, not just plain ones
        theirs = llm(_text(i), max_tokens=40, logits_processor=no_repeat(theirs_calls), **GREEDY)["choices"][0]
        assert ours == theirs["text"]
        assert ours_calls[: len(theirs_calls)] == theirs_calls and len(theirs_calls) == 40
        changed += ours != llm(_text(i), max_tokens=40, **GREEDY)["choices"][0]["text"]
    assert changed  # the processor mattered

    def odd_only(ids: Any, scores: Any) -> Any:
        scores[::2] = -np.inf  # in place, as processors may
        return scores

    for seed in (1, 2):
        toks = list(
            spec.generate_tokens(_toks(spec, 5), max_tokens=48, temperature=1.0, seed=seed, logits_processor=odd_only)
        )
        assert len(toks) == 48 and all(t % 2 == 1 for t in toks)
    msgs = [{"role": "user", "content": "def add(a, b):"}]
    reply = spec.create_chat_completion(msgs, max_tokens=12, logits_processor=odd_only, **GREEDY)
    assert all(t % 2 == 1 for t in spec.tokenize(reply["choices"][0]["message"]["content"], add_special=False))

    prompt, n_prompt = _text(2), len(_toks(spec, 2))

    def after(n: int) -> Any:
        return llama_cpp.StoppingCriteriaList([lambda ids, logits: len(ids) >= n_prompt + n])

    ours_c = spec(prompt, max_tokens=40, stopping_criteria=after(7), **GREEDY)
    theirs_c = llm(prompt, max_tokens=40, stopping_criteria=after(7), **GREEDY)
    assert ours_c["choices"][0] == theirs_c["choices"][0] and _llama_usage(ours_c["usage"]) == theirs_c["usage"]
    assert ours_c["choices"][0]["finish_reason"] == "stop" and ours_c["usage"]["completion_tokens"] == 7
    streamed = list(spec(prompt, max_tokens=40, stopping_criteria=after(7), stream=True, **GREEDY))
    assert "".join(c["choices"][0]["text"] for c in streamed) == ours_c["choices"][0]["text"]
    assert streamed[-1]["choices"][0]["finish_reason"] == "stop"
    assert spec(prompt, max_tokens=40, stopping_criteria=after(0), **GREEDY)["choices"][0]["text"] == ""

    seen: list[tuple[list[int], Any]] = []
    out = list(
        spec.generate_tokens(
            _toks(spec, 2), max_tokens=24, stopping_criteria=lambda ids, lg: seen.append((ids.tolist(), lg.copy()))
        )
    )
    assert len(out) == 24 and spec.finish_reason == "length"
    for k, (ids, lg) in enumerate(seen):
        assert ids == _toks(spec, 2) + out[:k] and lg.shape == (spec.n_vocab(),)
        assert int(np.argmax(lg)) == out[k]  # the row that chose the token (greedy)

    def broken_on(n: int) -> Any:
        calls = []

        def proc(ids: Any, scores: Any) -> Any:
            calls.append(1)
            if len(calls) == n:
                raise KeyError("from the processor")
            return scores

        return proc

    for n in (1, 6):  # in start(), and inside a drafted step
        with pytest.raises(KeyError, match="from the processor"):
            spec(prompt, max_tokens=20, logits_processor=broken_on(n), **GREEDY)
        _still_works(spec, baseline)
    with pytest.raises(ValueError, match="logits_processor must return n_vocab = 2048 scores"):
        spec(prompt, max_tokens=4, logits_processor=lambda ids, s: s[:5])
    with pytest.raises(ValueError, match="NaN"):
        spec(prompt, max_tokens=4, logits_processor=lambda ids, s: s * np.nan)
    for key in ("logits_processor", "stopping_criteria"):
        with pytest.raises(ValueError, match=key):
            spec(prompt, max_tokens=4, **{key: 42})
    _still_works(spec, baseline)


def test_json_mode_and_forced_tool_calls_are_llama_cpp_s(
    spec: SpeculativeLlama, llm: Any, baseline: dict[int, list[int]]
) -> None:
    """Chat's response_format and a tool_choice naming a function turn into grammars as in llama_cpp.Llama's
    chat handlers: the same replies (greedy), JSON that follows the schema, a forced call in the
    tool_calls shape, streamed too; contradictory or malformed requests are ValueErrors."""
    import json

    # with a system turn, llama_cpp.Llama's ChatML is llama-server's (without one it adds an empty one)
    msgs = [{"role": "system", "content": "You write Python."}, {"role": "user", "content": "def add(a, b):"}]
    schema = {
        "type": "object",
        "properties": {"name": {"type": "string"}, "n": {"type": "integer"}},
        "required": ["name", "n"],
    }
    for rf in ({"type": "json_object"}, {"type": "json_object", "schema": schema}):
        ours = spec.create_chat_completion(msgs, max_tokens=60, response_format=rf, **GREEDY)["choices"][0]
        theirs = llm.create_chat_completion(msgs, max_tokens=60, response_format=rf, **GREEDY)["choices"][0]
        assert ours["message"] == theirs["message"] and ours["finish_reason"] == theirs["finish_reason"]
    assert ours["finish_reason"] == "stop"
    reply = json.loads(ours["message"]["content"])
    assert isinstance(reply["name"], str) and isinstance(reply["n"], int)
    openai_shape = {"type": "json_schema", "json_schema": {"name": "r", "schema": schema}}
    assert (
        spec.create_chat_completion(msgs, max_tokens=60, response_format=openai_shape, **GREEDY)["choices"][0] == ours
    )
    assert (
        spec.create_chat_completion(msgs, max_tokens=8, response_format={"type": "text"}, **GREEDY)["choices"][0]
        == spec.create_chat_completion(msgs, max_tokens=8, **GREEDY)["choices"][0]
    )

    tools = [
        {
            "type": "function",
            "function": {
                "name": "get_weather",
                "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
            },
        },
        {
            "type": "function",
            "function": {
                "name": "add",
                "parameters": {
                    "type": "object",
                    "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
                    "required": ["a", "b"],
                },
            },
        },
    ]
    choice = {"type": "function", "function": {"name": "get_weather"}}
    ours = spec.create_chat_completion(msgs, max_tokens=60, tools=tools, tool_choice=choice, **GREEDY)["choices"][0]
    theirs = llm.create_chat_completion(msgs, max_tokens=60, tools=tools, tool_choice=choice, **GREEDY)["choices"][0]
    assert ours["finish_reason"] == theirs["finish_reason"] == "tool_calls"
    call, their_call = ours["message"]["tool_calls"][0], theirs["message"]["tool_calls"][0]
    assert call["function"] == their_call["function"] and call["type"] == "function"
    assert {k: v for k, v in ours["message"].items() if k != "tool_calls"} == {
        k: v for k, v in theirs["message"].items() if k != "tool_calls"
    }
    assert isinstance(json.loads(call["function"]["arguments"])["city"], str)
    legacy = spec.create_chat_completion(
        msgs, max_tokens=60, functions=[tools[0]["function"]], function_call={"name": "get_weather"}, **GREEDY
    )["choices"][0]
    assert legacy["message"]["function_call"] == ours["message"]["function_call"]
    chunks = [
        c["choices"][0]
        for c in spec.create_chat_completion(
            msgs, max_tokens=60, tools=tools, tool_choice=choice, stream=True, **GREEDY
        )
    ]
    assert (
        "".join(c["delta"]["tool_calls"][0]["function"]["arguments"] for c in chunks if c["delta"].get("tool_calls"))
        == call["function"]["arguments"]
    )
    # named in the first delta only: a client concatenating every field (the openai SDK's stream helper,
    # LangChain) must read the name once, not "get_weatherget_weather..."
    streamed_calls = [c["delta"]["tool_calls"][0] for c in chunks if c["delta"].get("tool_calls")]
    assert len(streamed_calls) > 1
    assert streamed_calls[0]["function"]["name"] == "get_weather" and streamed_calls[0]["id"].startswith("call_")
    assert all(c == {"index": 0, "function": {"arguments": c["function"]["arguments"]}} for c in streamed_calls[1:])
    assert [c["delta"]["function_call"].get("name") for c in chunks if c["delta"].get("function_call")][1:] == [
        None
    ] * (len(streamed_calls) - 1)
    assert chunks[-1]["finish_reason"] == "tool_calls"
    # "required" (OpenAI's; llama_cpp.Llama ignores it): a call to one of the tools, named by the model
    for kwargs in ({"tools": tools}, {"functions": [t["function"] for t in tools]}):
        anyone = spec.create_chat_completion(msgs, max_tokens=60, tool_choice="required", **kwargs, **GREEDY)
        anyone = anyone["choices"][0]
        assert anyone["finish_reason"] == "tool_calls", anyone
        call = anyone["message"]["tool_calls"][0]["function"]
        schema = next(t["function"]["parameters"] for t in tools if t["function"]["name"] == call["name"])
        assert set(json.loads(call["arguments"])) == set(schema["required"])
    streamed = [
        c["choices"][0]
        for c in spec.create_chat_completion(
            msgs, max_tokens=60, tools=tools, tool_choice="required", stream=True, **GREEDY
        )
    ]
    assert [c["delta"]["tool_calls"][0]["function"] for c in streamed if c["delta"].get("tool_calls")] == [call]
    assert streamed[-1]["finish_reason"] == "tool_calls"
    plain = spec.create_chat_completion(msgs, max_tokens=8, **GREEDY)["choices"][0]
    assert (
        spec.create_chat_completion(msgs, max_tokens=8, tools=tools, tool_choice="auto", **GREEDY)["choices"][0]
        == plain
    )  # ChatML shows no tools: the template's business

    for kwargs, match in (
        ({"response_format": {"type": "xml"}}, "response_format"),
        ({"response_format": {"type": "json_schema"}}, "json_schema"),
        ({"response_format": {"type": "json_object", "schema": {"type": "bogus"}}}, "cannot be turned into a grammar"),
        ({"response_format": {"type": "json_object"}, "grammar": "root ::= [a-z]+"}, "grammar and response_format"),
        (
            {"tools": tools, "tool_choice": {"type": "function", "function": {"name": "nope"}}},
            "'nope', which is not among the tools",
        ),
        ({"tool_choice": "required"}, "needs tools"),
        ({"tools": [{"type": "function"}], "tool_choice": "auto"}, "tools must be"),
        ({"function_call": 7}, "function_call"),
    ):
        with pytest.raises(ValueError, match=match):
            spec.create_chat_completion(msgs, max_tokens=8, **kwargs)
    _still_works(spec, baseline)


def test_tools_reach_the_chat_template(draft: str, tmp_path: Path) -> None:
    """With a GGUF chat template, tools (tool_choice "auto") are rendered by it as llama_cpp.Llama renders
    them: the same prompt, hence the same reply."""
    import subprocess
    import sys

    template = (
        "{% for m in messages %}<|{{ m.role }}|>{{ m.content }}\n{% endfor %}"
        "{% if tools %}<|tools|>{{ tools | tojson }}\n{% endif %}<|assistant|>"
    )
    target = tmp_path / "target-with-template.gguf"
    subprocess.run(
        [sys.executable, "-m", "gguf.scripts.gguf_new_metadata", str(TARGET), str(target), "--chat-template", template],
        check=True,
        capture_output=True,
    )
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}]
    msgs = [{"role": "user", "content": "def add(a, b):"}]
    with SpeculativeLlama(str(target), draft, n_ctx=N_CTX, n_threads=THREADS, n_max=3) as ours:
        prompt, _ = ours._format_chat(msgs, {"tools": tools})
        assert '<|tools|>[{"type": "function", "function": {"name": "get_weather"' in prompt
        reply = ours.create_chat_completion(msgs, max_tokens=24, tools=tools, tool_choice="auto", **GREEDY)
        without = ours.create_chat_completion(msgs, max_tokens=24, **GREEDY)
    theirs_llm = llama_cpp.Llama(str(target), n_ctx=N_CTX, n_threads=THREADS, n_threads_batch=THREADS, verbose=False)
    theirs = theirs_llm.create_chat_completion(msgs, max_tokens=24, tools=tools, tool_choice="auto", **GREEDY)
    assert reply["choices"][0]["message"] == theirs["choices"][0]["message"]
    assert reply["usage"]["prompt_tokens"] == theirs["usage"]["prompt_tokens"] > without["usage"]["prompt_tokens"]


def test_tokenize_and_detokenize_are_llama_cpp_s(spec: SpeculativeLlama, llm: Any) -> None:
    """llama_cpp.Llama.tokenize(text, add_bos, special) and detokenize(tokens, prev_tokens, special): same
    arguments, same defaults, same results (special-token text is text unless special=True)."""
    text = "x = 1<|endoftext|>\ny"
    for kwargs in ({}, {"add_bos": False}, {"special": True}, {"add_bos": True, "special": True}):
        ours = spec.tokenize(text.encode(), **kwargs)
        assert ours == llm.tokenize(text.encode(), **kwargs), kwargs
        assert spec.tokenize(text, **kwargs) == ours
        for special in (False, True):
            assert spec.detokenize(ours, special=special) == llm.detokenize(ours, special=special)
    assert spec.tokenize(text, special=True) == spec.tokenize(text, parse_special=True)
    assert 0 in spec.tokenize(text, special=True) and 0 not in spec.tokenize(text)
    assert spec.detokenize([5, 0, 6], prev_tokens=[1]) == llm.detokenize([5, 0, 6], prev_tokens=[1])


def test_a_step_drafts_no_further_than_the_tokens_wanted(spec: SpeculativeLlama) -> None:
    """step(max_tokens) emits at most max_tokens tokens and drafts at most max_tokens - 1 (one token left:
    a plain step), so the last step of a short generation verifies no drafts past its end; the output is
    the longer generation's first tokens either way."""
    core = spec._spec
    prompt = _toks(spec, 1)
    full = list(spec.generate_tokens(prompt, max_tokens=24, temperature=0.0))
    for max_tokens in (2, 3, 5):
        out = list(spec.generate_tokens(prompt, max_tokens=max_tokens, temperature=0.0))
        assert out == full[:max_tokens]
        assert spec.stats.drafted <= max_tokens - 2  # start() gave the first token: one step, max_tokens - 1 left
        assert spec.stats.plain_steps == 1 if max_tokens == 2 else spec.stats.plain_steps <= 1
    core.start(prompt, temperature=0.0)
    drafted = {}
    for cap in (1, 2, 4):
        before = dict(core.stats)
        toks, context_full = core.step(cap)
        drafted[cap] = core.stats["drafted"] - before["drafted"]
        assert not context_full and 1 <= len(toks) <= cap and drafted[cap] <= cap - 1
    assert drafted[4] > 0  # n_max 7: capped, not turned off
    with pytest.raises(DFlashError, match="max_tokens = 0"):
        core.step(0)


def test_grammar_shortcuts_change_nothing(spec: SpeculativeLlama) -> None:
    """With a grammar, greedy decoding and sampling with top-k ask it about the most likely tokens first
    (what decides the row) instead of masking the whole vocabulary: token for token the same output as
    whole-vocabulary masking (seeded, fixed n_max), for grammars that allow many tokens, few (the
    shortcut finds too few and falls back) and JSON."""
    from llama_cpp.llama_grammar import JSON_GBNF

    core = spec._spec
    eos = spec.token_eos()

    def run(prompt: list[int], gbnf: str, full: bool, **kw: Any) -> list[int]:
        out = [core.start(prompt, grammar=gbnf, grammar_full_pass=full, **kw)]
        while len(out) < 40 and eos not in out:
            toks, context_full = core.step()
            out += toks
            assert not context_full
        return out[: out.index(eos) + 1] if eos in out else out[:40]

    prompt = _toks(spec, 3)
    for gbnf in ("root ::= [a-z \n]+", 'root ::= [0-9]+ "\n" [a-z]+', JSON_GBNF):
        for kw in (
            {"temperature": 0.0},
            {"temperature": 0.8, "top_k": 40, "top_p": 0.95, "min_p": 0.05, "seed": 1},
            {"temperature": 1.2, "top_k": 5, "seed": 2},
            {"temperature": 1.0, "top_k": 200, "seed": 3},
        ):
            assert run(prompt, gbnf, False, **kw) == run(prompt, gbnf, True, **kw), (gbnf[:20], kw)


TAGGED = "{% for m in messages %}[{{ m.role }}] {{ m.content }}\n{% endfor %}[assistant] "


def test_a_chat_template_of_the_caller_s_replaces_the_target_s() -> None:
    """chat_template= (llama-server's --chat-template-file): chats are rendered in it, by the decoders that
    share the weights too; one that does not compile is refused before anything loads, naming its line."""
    with SpeculativeLlama(
        str(TARGET), str(drafter_gguf("f32")), n_ctx=N_CTX, n_threads=THREADS, chat_template=TAGGED
    ) as llm:
        msgs = [{"role": "user", "content": "import os"}]
        for m in (llm, llm.share_weights()):
            assert m.apply_chat_template(msgs) == "[user] import os\n[assistant] "
        out = llm.create_chat_completion(msgs, max_tokens=8, **GREEDY)
        assert out["usage"]["prompt_tokens"] == len(llm.tokenize(b"[user] import os\n[assistant] ", add_bos=False))
    with pytest.raises(ValueError, match="chat template: line 2"):
        SpeculativeLlama("/nonexistent.gguf", "/nonexistent.gguf", chat_template="ok\n{% for m in %}")


def test_chat_completion_uses_chatml_without_a_template(spec: SpeculativeLlama) -> None:
    assert not spec._spec.chat_template  # the tinycode GGUF has none
    msgs = [{"role": "system", "content": "You write Python."}, {"role": "user", "content": "import os\n"}]
    prompt, stops = spec._format_chat(msgs)
    assert prompt.startswith("<|im_start|>system\nYou write Python.<|im_end|>")
    assert prompt.endswith("<|im_start|>assistant\n")
    assert "<|im_end|>" in stops
    out = spec.create_chat_completion(msgs, max_tokens=24, **GREEDY)
    choice = out["choices"][0]
    assert choice["message"]["role"] == "assistant"
    assert isinstance(choice["message"]["content"], str)
    assert "<|im_end|>" not in choice["message"]["content"]
    assert choice["finish_reason"] in ("stop", "length")
    assert out["usage"]["prompt_tokens"] == len(spec.tokenize(prompt, special=True))
    # it is the completion of the ChatML prompt, cut at the template's stop string
    plain = spec.create_completion(prompt, max_tokens=24, stop=stops, **GREEDY)
    assert plain["choices"][0]["text"] == choice["message"]["content"]
    streamed = list(spec.create_chat_completion(msgs, max_tokens=24, stream=True, **GREEDY))
    assert "".join(c["choices"][0]["delta"].get("content", "") for c in streamed) == choice["message"]["content"]
    assert streamed[-1]["choices"][0]["finish_reason"] == choice["finish_reason"]


def test_metadata_is_llama_cpp_s(draft: str) -> None:
    """`metadata` as llama_cpp.Llama's, on a target whose name is longer than the first buffer libllama
    is asked to fill and not ASCII."""
    import gguf

    name = "tinycode é → 🙂 " * 200  # ~4 KB of UTF-8
    target = _target_copy("long-name", {"general.name": (gguf.GGUFValueType.STRING, name)})
    llm = llama_cpp.Llama(str(target), n_ctx=64, verbose=False)
    with SpeculativeLlama(str(target), draft, n_ctx=64) as spec:
        assert spec.metadata == llm.metadata
        assert spec.metadata["general.name"] == name and spec.metadata["general.architecture"] == "qwen3"
    llm.close()


def test_from_llama(draft: str, ref: GreedyReference, spec: SpeculativeLlama, baseline: dict[int, list[int]]) -> None:
    llm = llama_cpp.Llama(str(TARGET), n_ctx=N_CTX, n_threads=THREADS, n_threads_batch=THREADS, verbose=False)
    # a fixed n_max: "auto" may rightly decode plainly on a CPU where drafting does not pay (this pair on
    # a 2-core AMD EPYC), and this test is about drafting through an adopted context
    adopted = SpeculativeLlama.from_llama(llm, draft=draft, n_max=3)
    assert adopted.n_ctx() == N_CTX == llm.n_ctx()
    assert (adopted.n_vocab(), adopted.token_eos(), adopted.token_bos()) == (
        llm.n_vocab(),
        llm.token_eos(),
        llm.token_bos(),
    )
    for i in (0, 6, 10):
        toks = _toks(adopted, i)
        ours = list(adopted.generate_tokens(toks, max_tokens=64))
        assert adopted.stats.mean_accepted_length > 1.5, adopted.stats.line()
        problems, _ = compare_greedy(ref, toks, ours, 64, EPS, name=f"from_llama {i}")
        assert not problems, problems
    text = adopted.create_completion(_text(0), max_tokens=16, **GREEDY)["choices"][0]["text"]
    assert text == spec.create_completion(_text(0), max_tokens=16, **GREEDY)["choices"][0]["text"]
    with pytest.raises(ValueError, match="Llama"):
        SpeculativeLlama.from_llama(object(), draft=draft)
    closed = llama_cpp.Llama(str(TARGET), n_ctx=64, n_threads=THREADS, verbose=False)
    closed.close()
    with pytest.raises(ValueError, match="closed"):
        SpeculativeLlama.from_llama(closed, draft=draft)


def test_adopted_llama_and_ours_take_turns(draft: str, spec: SpeculativeLlama, baseline: dict[int, list[int]]) -> None:
    """One context, two writers: llama_cpp.Llama reuses what its record says its context holds, and
    so do we. Both records must stay true: otherwise the Llama's first call after ours would continue
    the K/V of our prompt (its text changed), and ours could reuse rows the Llama had overwritten."""
    own = llama_cpp.Llama(str(TARGET), n_ctx=N_CTX, n_threads=THREADS, n_threads_batch=THREADS, verbose=False)
    adopted = SpeculativeLlama.from_llama(own, draft=draft, n_max=7)

    def theirs(i: int) -> str:
        return own(_text(i), max_tokens=24, **GREEDY)["choices"][0]["text"]

    def ours(i: int) -> str:
        return adopted(_text(i), max_tokens=24, **GREEDY)["choices"][0]["text"]

    want = {("theirs", i): theirs(i) for i in (0, 5)}  # the Llama alone
    want.update({("ours", i): spec(_text(i), max_tokens=24, **GREEDY)["choices"][0]["text"] for i in (0, 5)})
    prev = None
    for turn in [("ours", 5), ("theirs", 0), ("ours", 5), ("theirs", 5), ("ours", 5), ("ours", 0), ("theirs", 0)]:
        who, i = turn
        assert (ours(i) if who == "ours" else theirs(i)) == want[turn], f"{turn} after {prev}"
        if prev == ("theirs", i) and who == "ours":  # the prompt the Llama just decoded is reused, not prefilled
            assert adopted.stats.reused_prompt_tokens == len(_toks(adopted, i)) - 1, adopted.stats
        prev = turn
    # the Llama decoding while a stream of ours is open: an error at our next step, not a wrong token
    stream = adopted.generate_tokens(_toks(adopted, 5), max_tokens=24)
    next(stream)
    assert theirs(0) == want[("theirs", 0)]
    with pytest.raises(RuntimeError, match="decoded in the shared context while this generation was streaming"):
        list(stream)
    assert ours(5) == want[("ours", 5)] and theirs(0) == want[("theirs", 0)]


def test_close(draft: str) -> None:
    """close() frees now and later calls raise a clear error (an open stream's next step too); a
    `with` block closes."""
    with SpeculativeLlama(str(TARGET), draft, n_ctx=256, n_threads=THREADS, n_max=3) as own:
        toks = _toks(own, 0)
        stream = own.generate_tokens(toks, max_tokens=16)
        next(stream)
    with pytest.raises(DFlashError, match="closed"):
        list(stream)
    with pytest.raises(DFlashError, match="closed"):
        own(_text(0), max_tokens=4)
    own.close()  # twice is fine


def test_closing_either_side_of_an_adoption(draft: str) -> None:
    """Ours closed: the Llama gets its context back as it was and decodes as before. The Llama closed:
    we let go of its context before it is freed (calls raise, no crash). And at exit, where the
    garbage collector finalizes the Llama's context and us in any order (this aborted the process in
    libllama's set_embeddings_layer_inp about half the time), the process ends cleanly."""
    import subprocess
    import sys

    def theirs(own: Any) -> str:
        return own(_text(0), max_tokens=16, **GREEDY)["choices"][0]["text"]

    own = llama_cpp.Llama(str(TARGET), n_ctx=256, n_threads=THREADS, n_threads_batch=THREADS, verbose=False)
    want = theirs(own)
    adopted = SpeculativeLlama.from_llama(own, draft=draft, n_max=3)
    adopted(_text(5), max_tokens=16)
    adopted.close()
    assert theirs(own) == want

    # in a subprocess: a regression here is a use after free
    script = (
        "import llama_cpp\n"
        "from dflash_gguf import DFlashError, SpeculativeLlama\n"
        f"def pair():\n"
        f"    llm = llama_cpp.Llama({str(TARGET)!r}, n_ctx=256, n_threads=1, verbose=False)\n"
        f"    return llm, SpeculativeLlama.from_llama(llm, {draft!r}, n_max=3)\n"
        "llm, sp = pair()\n"
        "llm.close()\n"
        "try:\n"
        f"    sp({_text(5)!r}, max_tokens=4)\n"
        "    raise SystemExit('no error')\n"
        "except DFlashError as e:\n"
        "    assert 'closed' in str(e), e\n"
        "llm, sp = pair()  # left to the exit, with a stream of ours open\n"
        f"llm({_text(0)!r}, max_tokens=8); sp({_text(5)!r}, max_tokens=8); llm({_text(0)!r}, max_tokens=8)\n"
        f"stream = sp.generate_tokens(sp.tokenize({_text(1)!r}), max_tokens=8); next(stream)\n"
        "print('ok')\n"
    )
    for _ in range(3):
        r = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120, check=False)
        assert r.returncode == 0 and r.stdout.strip() == "ok", (r.returncode, r.stdout[-300:], r.stderr[-1500:])
        assert "Exception ignored" not in r.stderr and "Traceback" not in r.stderr, r.stderr[-1500:]


# --------------------------------------------------------------------------- #
# bad arguments
# --------------------------------------------------------------------------- #


@pytest.mark.parametrize("cut", ["top_p", "typical_p"])
def test_a_cut_of_zero_keeps_one_token(spec: SpeculativeLlama, baseline: dict[int, list[int]], cut: str) -> None:
    """top_p 0 (as OpenAI clients send it for determinism) keeps only the most likely token, as libllama's
    sampler does: sampling at temperature 1 then decodes greedily, whatever the seed. typical_p 0 keeps only
    the most typical one: one token per step too, so two seeds agree."""
    toks = _toks(spec, 6)
    runs = [list(spec.generate_tokens(toks, max_tokens=64, temperature=1.0, seed=s, **{cut: 0.0})) for s in (1, 2)]
    assert runs[0] == runs[1]
    if cut == "top_p":
        assert runs[0] == baseline[6]


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"temperature": -0.5}, "temperature"),
        ({"top_p": -0.1}, "top_p"),
        ({"top_p": 1.5}, "top_p"),
        ({"top_k": -1}, "top_k"),
        ({"min_p": 2.0}, "min_p"),
        ({"typical_p": -0.1}, "typical_p"),
        ({"mirostat_mode": 3}, "mirostat_mode"),
        ({"mirostat_mode": True}, "mirostat_mode"),
        ({"mirostat_mode": 2, "mirostat_eta": -0.1}, "mirostat_eta"),
        ({"mirostat_mode": 1, "mirostat_tau": float("nan")}, "mirostat_tau"),
    ],
)
def test_bad_sampling_arguments(
    spec: SpeculativeLlama, baseline: dict[int, list[int]], kwargs: dict[str, Any], match: str
) -> None:
    toks = _toks(spec, 4)
    with pytest.raises(ValueError, match=match):
        list(spec.generate_tokens(toks, max_tokens=4, **kwargs))
    with pytest.raises(ValueError, match=match):
        spec.create_completion(_text(4), max_tokens=4, **kwargs)
    with pytest.raises(ValueError, match=match):
        spec.create_chat_completion([{"role": "user", "content": "x"}], max_tokens=4, **kwargs)
    _still_works(spec, baseline)


def test_bad_prompts(spec: SpeculativeLlama, baseline: dict[int, list[int]]) -> None:
    with pytest.raises(ValueError, match="empty"):
        list(spec.generate_tokens([], max_tokens=4))
    with pytest.raises(ValueError, match="vocabulary"):
        list(spec.generate_tokens([5, 99999, 7], max_tokens=4))
    with pytest.raises(ValueError, match="n_ctx"):
        list(spec.generate_tokens(list(range(10, 10 + N_CTX + 8)), max_tokens=4))
    with pytest.raises(ValueError, match="messages"):
        spec.create_chat_completion("hello")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="each needs a 'role' and a 'content'"):
        spec.create_chat_completion([{"role": "user"}])
    for bad in (["a", 3], None, [1.5], 7):  # e.g. from JSON: a mixed list, a null
        with pytest.raises(ValueError, match="prompt must be a string or a sequence of token ids"):
            spec.create_completion(bad, max_tokens=2)  # type: ignore[arg-type]
    assert (
        spec.create_completion(np.array(_toks(spec, 4)), max_tokens=64, **GREEDY)["choices"][0]["text"]
        == spec.detokenize(baseline[4]).decode()
    )
    _still_works(spec, baseline)


def _not_a_gguf(tmp_path: Path) -> str:
    p = tmp_path / "not-a-drafter.gguf"
    p.write_text("this is not a GGUF file\n" * 10)
    return str(p)


@pytest.mark.parametrize(
    "what, match",
    [
        ("missing_target", "not found"),
        ("missing_draft", "nonexistent-draft"),
        ("draft_not_gguf", "not a GGUF"),
        ("target_as_draft", "dflash"),
        ("vocab", "vocabulary"),
        ("hidden", "hidden"),
        ("layers", "layer"),
        ("draft_q", "draft_q"),
        ("device", "device"),
        ("n_ctx", "n_ctx"),
        ("n_max", "n_max"),
    ],
)
def test_bad_construction(
    what: str, match: str, draft: str, tmp_path: Path, spec: SpeculativeLlama, baseline: dict[int, list[int]]
) -> None:
    target, kw = str(TARGET), {"n_ctx": N_CTX, "n_threads": THREADS}
    if what == "missing_target":
        target = str(tmp_path / "nonexistent-target.gguf")
    elif what == "missing_draft":
        draft = str(tmp_path / "nonexistent-draft.gguf")
    elif what == "draft_not_gguf":
        draft = _not_a_gguf(tmp_path)
    elif what == "target_as_draft":
        draft = str(TARGET)
    elif what in ("vocab", "hidden", "layers"):
        draft = str(mismatched_drafter_gguf(what))
    elif what == "draft_q":
        kw["draft_q"] = "bogus"
    elif what == "device":
        kw["device"] = "no-such-device"
    elif what == "n_ctx":
        kw["n_ctx"] = 8
    elif what == "n_max":
        kw["n_max"] = -1
    with pytest.raises(ValueError, match=match):
        SpeculativeLlama(target, draft, **kw)
    _still_works(spec, baseline)


# --------------------------------------------------------------------------- #
# threads
# --------------------------------------------------------------------------- #


def test_one_object_two_threads(spec: SpeculativeLlama, baseline: dict[int, list[int]]) -> None:
    """While one thread generates, a second generation on the same object raises RuntimeError."""
    started, tried = threading.Event(), threading.Event()
    results: dict[str, Any] = {}

    def first() -> None:
        out = []
        try:
            for tok in spec.generate_tokens(_toks(spec, 4), max_tokens=64):
                out.append(tok)
                if len(out) == 1:
                    started.set()
                    tried.wait(30)
        except BaseException as e:  # pragma: no cover - reported below
            results["first_error"] = e
        results["first"] = out

    def second() -> None:
        started.wait(30)
        try:
            results["second"] = list(spec.generate_tokens(_toks(spec, 6), max_tokens=16))
        except BaseException as e:
            results["second_error"] = e
        finally:
            tried.set()

    threads = [threading.Thread(target=first), threading.Thread(target=second)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not any(t.is_alive() for t in threads)
    assert "first_error" not in results, results.get("first_error")
    assert isinstance(results.get("second_error"), RuntimeError), results
    assert "already" in str(results["second_error"])
    assert results["first"] == baseline[4]  # undisturbed
    _still_works(spec, baseline)


def test_two_objects_two_threads(draft: str, spec: SpeculativeLlama, baseline: dict[int, list[int]]) -> None:
    """Independent objects generate in parallel, each exactly as it would alone."""
    objs = [SpeculativeLlama(str(TARGET), draft, n_ctx=N_CTX, n_threads=THREADS, n_max=7) for _ in range(2)]
    jobs = [(0, 10), (6, 4)]
    sampled_kw = {"temperature": 1.0, "top_k": 0, "top_p": 1.0, "min_p": 0.0, "seed": 99}
    want_sampled = {i: list(spec.generate_tokens(_toks(spec, i), max_tokens=48, **sampled_kw)) for i in (0, 6)}
    results: dict[int, Any] = {}

    def work(k: int) -> None:
        try:
            s = objs[k]
            out = {}
            for rep in range(2):
                for i in jobs[k]:
                    out[(i, "greedy", rep)] = list(s.generate_tokens(_toks(s, i), max_tokens=64))
                out[(jobs[k][0], "sampled", rep)] = list(
                    s.generate_tokens(_toks(s, jobs[k][0]), max_tokens=48, **sampled_kw)
                )
            results[k] = out
        except BaseException as e:  # pragma: no cover - reported below
            results[k] = e

    threads = [threading.Thread(target=work, args=(k,)) for k in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert not any(t.is_alive() for t in threads)
    for k in range(2):
        assert not isinstance(results[k], BaseException), results[k]
        for (i, mode, _), toks in results[k].items():
            assert toks == (baseline[i] if mode == "greedy" else want_sampled[i]), (k, i, mode)


_POOL_PROBE = """
import json, os, sys, threading, time
import llama_cpp
from dflash_gguf import SpeculativeLlama, _core
def tasks():
    return len(os.listdir("/proc/self/task"))
def tasks_after_release(expected):  # released workers exit on their own time: a loaded machine lags
    for _ in range(100):
        if tasks() <= expected:
            break
        time.sleep(0.02)
    return tasks()
llm = SpeculativeLlama(sys.argv[1], sys.argv[2], n_ctx=256, n_threads=2, n_max=3)
raw = llama_cpp.Llama(sys.argv[1], n_ctx=64, n_threads=2, verbose=False)
out = {"has_openmp": _core.release_openmp_threads(), "before": tasks()}
raw.create_completion("x", max_tokens=2)            # llama_cpp.Llama leaves this thread's pool behind
out["after_llama_cpp"] = tasks()
_core.release_openmp_threads()
out["released"] = tasks_after_release(out["before"])
llm.create_completion("def f(x):", max_tokens=16, temperature=0)
out["after_ours"] = tasks_after_release(out["before"])
print(json.dumps(out))
"""


def test_a_generation_leaves_no_openmp_pool_behind(draft: str) -> None:
    """libgomp keeps a pool of workers per thread that ran a parallel region; with more of them than
    CPUs, every ggml barrier sleeps in the kernel and decoding on another thread runs 5-8x slower
    (llama_cpp.Llama after a main-thread warm-up: 1600 -> 160 tok/s here). Ours hand the calling
    thread's pool back at the end of each generation: the thread count shows it."""
    import subprocess
    import sys

    r = subprocess.run(
        [sys.executable, "-c", _POOL_PROBE, str(TARGET), draft], capture_output=True, text=True, timeout=120
    )
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout.strip().splitlines()[-1])
    if not out["has_openmp"]:
        pytest.skip("this ggml has no OpenMP runtime")
    assert out["after_llama_cpp"] == out["before"] + 1  # n_threads 2: one worker kept
    assert out["released"] == out["after_ours"] == out["before"]


def test_default_threads_are_the_cores_we_may_run_on() -> None:
    """n_threads = 0: the physical cores in the affinity mask (taskset / cpuset), never more than it allows."""
    import subprocess
    import sys

    if not hasattr(os, "sched_setaffinity"):
        pytest.skip("no CPU affinity on this OS")
    probe = (
        "import os; from dflash_gguf import _core; n = _core.default_cpu_threads(); "
        "os.sched_setaffinity(0, {min(os.sched_getaffinity(0))}); print(n, _core.default_cpu_threads())"
    )
    r = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    full, pinned = map(int, r.stdout.split())
    cpus = sorted(os.sched_getaffinity(0))
    cores = {Path(f"/sys/devices/system/cpu/cpu{c}/topology/thread_siblings_list").read_text() for c in cpus}
    assert pinned == 1 and full == len(cores) <= len(cpus)


def test_default_draft_device_follows_the_target() -> None:
    """device="auto" puts the drafter where the target's layers are: the CPU when none are offloaded
    (a CPU-only run never wakes a GPU), ggml's first GPU when some are; a named device is kept."""
    from dflash_gguf.speculative import draft_device_for

    assert draft_device_for("auto", 0) == "cpu"
    assert draft_device_for("auto", 99) == "auto"
    assert draft_device_for("auto", -1) == "auto"
    assert draft_device_for("CUDA0", 0) == "CUDA0"
    assert draft_device_for("cpu", 99) == "cpu"


def _quantized_target(folder: Path, ftype: str) -> Path:
    """The bundled target quantized by libllama's quantizer."""
    from dflash_convert.quantize import llama_quantize, parse_outtype

    out = folder / f"target-{ftype}.gguf"
    llama_quantize(TARGET, out, parse_outtype(ftype))
    return out


def _assert_lossless_in_subprocess(target: Path, draft: str, repack: bool | str | None) -> None:
    """Speculative decoding of `target` with `repack` equals its plain decoding, drafts accepted; in a
    subprocess, so that a crash in libllama fails the test instead of the suite."""
    import subprocess
    import sys

    script = (
        "from dflash_gguf import SpeculativeLlama\n"
        f"llm = SpeculativeLlama({str(target)!r}, {draft!r}, n_ctx=512, n_threads=1, n_max=3, repack={repack!r})\n"
        f"toks = llm.tokenize({_text(0)!r}, add_special=False, parse_special=False)\n"
        "spec = list(llm.generate_tokens(toks, max_tokens=48))\n"
        "assert llm.stats.accepted > 0, llm.stats\n"
        "plain = list(llm.generate_tokens(toks, max_tokens=48, plain=True))\n"
        "assert spec == plain, (spec, plain)\n"
        "print('ok', len(spec))\n"
    )
    r = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0 and "ok 48" in r.stdout, (r.returncode, r.stdout[-500:], r.stderr[-2000:])


@pytest.mark.parametrize("repack", [None, False], ids=["default", "off"])
def test_quantized_target_runs(repack: bool | None, draft: str, tmp_path: Path) -> None:
    """A Q8_0 target: by default (repack=None) out of libllama's extra CPU buffers on CPUs with AMX, where
    libllama 0.3.36 segfaults in ggml_backend_amx_mul_mat on its first decode (seen on this project's
    Xeon, with repack=True), and lossless against plain decoding of that target. In a subprocess, so
    that a crash fails this test instead of the suite."""

    q8 = _quantized_target(tmp_path, "q8_0")
    _assert_lossless_in_subprocess(q8, draft, repack)


def test_repacked_target_without_amx(draft: str, tmp_path: Path) -> None:
    """repack="no-amx", what repack=None does for a quantized target on a CPU with AMX (libllama 0.3.36 crashes in
    its AMX kernels there): libllama's extra CPU buffers off, and each layer weight and the output head that
    ggml's repacked layout takes placed there by name: exactly the Q4_0 matrices with rows in multiples of 8
    (ggml's x86 rule), never token_embd, whose rows libllama reads. Decoding is lossless against plain
    decoding of that target; in a subprocess, so that a crash fails this test instead of the suite."""
    import re

    import gguf

    from dflash_gguf import _core

    cpuinfo = Path("/proc/cpuinfo")
    if not cpuinfo.is_file() or "avx2" not in cpuinfo.read_text(errors="replace").split():
        pytest.skip("asserts ggml's x86 Q4_0 repack, which needs AVX2 (read from Linux's /proc/cpuinfo)")
    q4 = _quantized_target(tmp_path, "q4_0")

    use_extra_bufts, placed = _core.target_weight_placement(str(q4), repack="no-amx")
    assert use_extra_bufts is False
    assert {name for _, name, _ in placed} == {"CPU_REPACK"}
    tensors = gguf.GGUFReader(q4).tensors
    want = {
        t.name
        for t in tensors
        if (t.name.startswith("blk.") or t.name == "output.weight")
        and t.tensor_type == gguf.GGMLQuantizationType.Q4_0
        and len(t.shape) == 2
        and t.shape[1] % 8 == 0
    }
    assert want and any(t.name == "token_embd.weight" for t in tensors)
    got = {t.name for t in tensors if any(re.search(p, t.name) for p, _, _ in placed)}
    assert got == want
    assert _core.target_weight_placement(str(q4), repack=False) == (False, [])
    assert _core.target_weight_placement(str(TARGET), repack="no-amx")[1] == []  # F16: no repacked layout
    with pytest.raises(ValueError, match="no-amx"):
        _core.target_weight_placement(str(q4), repack="amx")
    with pytest.raises(DFlashError, match=re.escape(str(q4)) + ".*n_gpu_layers = 0"):
        _core.target_weight_placement(str(q4), n_gpu_layers=1, repack="no-amx")

    _assert_lossless_in_subprocess(q4, draft, "no-amx")


def test_a_list_of_prompts_gives_one_choice_each(spec: SpeculativeLlama) -> None:
    """OpenAI's and llama-server's list `prompt` (LangChain's OpenAI class sends ["..."], lm-eval several):
    choice i is what prompt i alone gives, streamed too, echo and logprobs included."""
    texts = ["def add(a, b):", "import os\n"]
    alone = [spec.create_completion(t, max_tokens=6, echo=True, logprobs=1, **GREEDY) for t in texts]
    many = spec.create_completion(texts, max_tokens=6, echo=True, logprobs=1, **GREEDY)
    assert [c["index"] for c in many["choices"]] == [0, 1]
    for i, one in enumerate(alone):
        assert {**many["choices"][i], "index": 0} == one["choices"][0]
    assert many["usage"]["completion_tokens"] == sum(o["usage"]["completion_tokens"] for o in alone)
    assert (
        spec.create_completion(texts[:1], max_tokens=6, **GREEDY)["choices"][0]["text"]
        == spec.create_completion(texts[0], max_tokens=6, **GREEDY)["choices"][0]["text"]
    )
    chunks = list(spec.create_completion(texts, max_tokens=6, stream=True, **GREEDY))
    assert len({c["id"] for c in chunks}) == 1
    for i, one in enumerate(alone):
        streamed = "".join(c["choices"][0]["text"] for c in chunks if c["choices"][0]["index"] == i)
        assert texts[i] + streamed == one["choices"][0]["text"]
    with pytest.raises(ValueError, match="sequence of token ids, or a non-empty list of those"):
        spec.create_completion(["ok", 3], max_tokens=2)


def test_chat_messages_as_llama_server_reads_them(spec: SpeculativeLlama) -> None:
    """Content as a list of text parts is their text joined by newlines, `developer` is `system`, and the
    ChatML fallback has no system turn of its own (llama-server's CHATML_TEMPLATE_SRC), on both the ChatML
    and a Jinja template path."""
    parts = [
        {"role": "developer", "content": "Be brief."},
        {"role": "user", "content": [{"type": "text", "text": "def add(a, b):"}, {"type": "text", "text": "x"}]},
    ]
    plain = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "def add(a, b):\nx"}]
    prompt, _ = spec._format_chat(parts)
    assert (
        prompt
        == spec._format_chat(plain)[0]
        == (
            "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\ndef add(a, b):\nx<|im_end|>\n"
            "<|im_start|>assistant\n"
        )
    )
    assert spec._format_chat([plain[1]])[0].startswith("<|im_start|>user\n")
    assert (
        spec.create_chat_completion(parts, max_tokens=6, **GREEDY)["choices"][0]
        == spec.create_chat_completion(plain, max_tokens=6, **GREEDY)["choices"][0]
    )
    with pytest.raises(ValueError, match="text only"):
        spec._format_chat([{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}])


def test_echo_with_max_tokens_0_scores_the_prompt_alone(spec: SpeculativeLlama) -> None:
    """OpenAI's way to score a prompt: the prompt's text and logprobs, no completion (without echo, 0 keeps
    llama_cpp.Llama's meaning: no limit)."""
    text = "def add(a, b):\n    return a + b\n"
    out = spec.create_completion(text, max_tokens=0, echo=True, logprobs=1, **GREEDY)
    choice = out["choices"][0]
    assert choice["text"] == text and choice["finish_reason"] == "length"
    assert out["usage"]["completion_tokens"] == 0
    n = len(spec.tokenize(text.encode(), add_bos=False))
    lp = choice["logprobs"]["token_logprobs"]
    assert len(lp) == n and lp[0] is None and all(isinstance(x, float) for x in lp[1:])
    one_more = spec.create_completion(text, max_tokens=1, echo=True, logprobs=1, **GREEDY)["choices"][0]["logprobs"]
    assert lp == one_more["token_logprobs"][:n]
    assert spec.create_completion(text, max_tokens=0, echo=True, **GREEDY)["choices"][0]["text"] == text
    assert len(spec.create_completion(text, max_tokens=0, **GREEDY)["choices"][0]["text"]) > 0


def test_forced_tool_arguments_are_strict_json(spec: SpeculativeLlama) -> None:
    """No raw control characters inside JSON strings (strict parsers refuse them), sampled hot."""
    import json

    from llama_cpp import llama_grammar

    from dflash_gguf.llama_compat import LOOSE_CHAR, schema_grammar

    schema = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
    assert LOOSE_CHAR in llama_grammar.json_schema_to_gbnf(json.dumps(schema))  # what the fix replaces
    assert LOOSE_CHAR not in schema_grammar(schema, "test")._grammar
    tools = [{"type": "function", "function": {"name": "where", "parameters": schema}}]
    choice = {"type": "function", "function": {"name": "where"}}
    finished = 0
    for seed in range(6):
        out = spec.create_chat_completion(
            [{"role": "user", "content": "x"}],
            max_tokens=48,
            tools=tools,
            tool_choice=choice,
            temperature=1.5,
            top_k=0,
            top_p=1.0,
            min_p=0.0,
            seed=seed,
        )
        if out["choices"][0]["finish_reason"] == "tool_calls":  # a call cut at max_tokens is no JSON yet
            call = out["choices"][0]["message"]["tool_calls"][0]["function"]
            assert isinstance(json.loads(call["arguments"])["city"], str)
            finished += 1
    assert finished > 0


def test_cached_tokens_are_the_reused_prompt_s(spec: SpeculativeLlama) -> None:
    """usage.prompt_tokens_details.cached_tokens (OpenAI's and llama-server's): the prompt's tokens taken from
    what the context held, not decoded again: 0 for a fresh context, all but the last for a repeated prompt,
    the shared prefix for one that goes on from the last call; chats and lists of prompts alike."""
    prompt = _text(5)
    spec.reset()
    fresh = spec.create_completion(prompt, max_tokens=8, **GREEDY)["usage"]
    assert fresh["prompt_tokens_details"] == {"cached_tokens": 0}
    again = spec.create_completion(prompt, max_tokens=8, **GREEDY)["usage"]
    n = again["prompt_tokens"]
    assert again["prompt_tokens_details"] == {"cached_tokens": n - 1} and spec.stats.reused_prompt_tokens == n - 1
    longer = spec.create_completion(prompt + "\n\n# more\n", max_tokens=8, **GREEDY)["usage"]
    held = spec.tokenize(prompt, special=True)
    mine = spec.tokenize(prompt + "\n\n# more\n", special=True)
    common = next((i for i, (a, b) in enumerate(zip(held, mine)) if a != b), len(held))
    assert 0 < longer["prompt_tokens_details"]["cached_tokens"] <= common
    assert longer["prompt_tokens_details"]["cached_tokens"] >= common - 2  # a merge at the seam may differ

    msgs = [{"role": "user", "content": "def add(a, b):"}]
    spec.reset()
    first = spec.create_chat_completion(msgs, max_tokens=6, **GREEDY)["usage"]
    second = spec.create_chat_completion(msgs, max_tokens=6, **GREEDY)["usage"]
    assert first["prompt_tokens_details"]["cached_tokens"] == 0
    assert second["prompt_tokens_details"]["cached_tokens"] == second["prompt_tokens"] - 1
    streamed = list(spec.create_chat_completion(msgs, max_tokens=6, stream=True, **GREEDY))
    assert streamed[-1]["choices"][0]["finish_reason"] and spec.stats.usage() == second

    spec.reset()
    many = spec.create_completion([prompt, prompt], max_tokens=4, **GREEDY)["usage"]
    assert many["prompt_tokens"] == 2 * n and many["prompt_tokens_details"] == {"cached_tokens": n - 1}


def test_end_of_text_counts_as_a_generated_token(spec: SpeculativeLlama, llm: Any) -> None:
    """An end-of-generation token the target samples is no text but is counted in usage.completion_tokens,
    as llama-server counts it (llama_cpp.Llama does not: README, differences); streamed usage alike. A
    completion's logprobs list it last, as the token "" (a scorer that drops the one token it asked for,
    lm-eval, drops it and not the prompt's last)."""
    from tinycode import EOS

    prompt = _text(2)
    now = spec.create_completion(prompt, max_tokens=16, logit_bias={EOS: 100.0}, **GREEDY)
    assert now["choices"][0]["text"] == "" and now["choices"][0]["finish_reason"] == "stop"
    n_prompt = now["usage"]["prompt_tokens"]
    assert now["usage"]["completion_tokens"] == 1 and now["usage"]["total_tokens"] == n_prompt + 1
    assert spec.stats.completion_tokens == 0 and spec.stats.end_of_text and spec.stats.generated_tokens == 1
    theirs = llm.create_completion(prompt, max_tokens=16, logit_bias={EOS: 100.0}, **GREEDY)
    assert theirs["choices"][0]["text"] == "" and theirs["usage"]["completion_tokens"] == 0
    chat = spec.create_chat_completion(
        [{"role": "user", "content": "x"}], max_tokens=16, logit_bias={EOS: 100.0}, **GREEDY
    )
    assert chat["choices"][0]["message"]["content"] == "" and chat["usage"]["completion_tokens"] == 1

    # a text that ends itself: its tokens and the end of text; one cut by max_tokens or a stop string: its tokens
    short = 'def main():\n    pass\n\n\nif __name__ == "__main__":\n    main'
    ended = spec.create_completion(short, max_tokens=200, **GREEDY)
    assert ended["choices"][0]["finish_reason"] == "stop" and spec.stats.end_of_text
    n_text = spec.stats.completion_tokens
    assert ended["usage"]["completion_tokens"] == n_text + 1 and n_text >= 2
    streamed = list(spec.create_completion(short, max_tokens=200, stream=True, **GREEDY))
    assert (
        streamed[-1]["choices"][0]["finish_reason"] == "stop" and spec.stats.usage()["completion_tokens"] == n_text + 1
    )
    lp = spec.create_completion(short, max_tokens=200, logprobs=2, **GREEDY)["choices"][0]["logprobs"]
    assert (
        len(lp["tokens"]) == n_text + 1
        and lp["tokens"][-1] == ""
        and "".join(lp["tokens"]) == "".join(c["choices"][0]["text"] for c in streamed)
    )
    assert lp["top_logprobs"][-1][""] == lp["token_logprobs"][-1] and len(set(lp["top_logprobs"][-1])) >= 2
    parts = list(spec.create_completion(short, max_tokens=200, logprobs=2, stream=True, **GREEDY))
    assert {
        k: [v for c in parts if c["choices"][0]["logprobs"] for v in c["choices"][0]["logprobs"][k]] for k in lp
    } == lp
    whole = short + ended["choices"][0]["text"]
    scored = spec.create_completion(whole, max_tokens=1, logprobs=1, echo=True, **GREEDY)
    n_whole = len(spec.tokenize(whole, special=True))
    assert scored["usage"]["completion_tokens"] == 1 and spec.stats.end_of_text
    assert len(scored["choices"][0]["logprobs"]["tokens"]) == n_whole + 1
    none = spec.create_completion(prompt, max_tokens=16, logit_bias={EOS: 100.0}, logprobs=1, **GREEDY)["choices"][0]
    assert none["logprobs"]["tokens"] == [""] and len(none["logprobs"]["token_logprobs"]) == 1
    cut = spec.create_completion(short, max_tokens=n_text, **GREEDY)
    assert cut["usage"]["completion_tokens"] == n_text and not spec.stats.end_of_text
    stopped = spec.create_completion(short, max_tokens=200, stop=ended["choices"][0]["text"][-1], **GREEDY)
    assert stopped["choices"][0]["finish_reason"] == "stop" and not spec.stats.end_of_text
    assert stopped["usage"]["completion_tokens"] == spec.stats.completion_tokens <= n_text


def test_system_fingerprint_names_the_build_and_files(spec: SpeculativeLlama, draft: str) -> None:
    """OpenAI's system_fingerprint: this package's version and a hash of libllama's version, the target and
    drafter files and the sampler; the same for the same setup, another for another drafter or sampler."""
    import re

    from dflash_gguf import __version__

    fp = spec.system_fingerprint
    assert re.fullmatch(rf"dflash-gguf-{re.escape(__version__)}-[0-9a-f]{{12}}", fp), fp
    with SpeculativeLlama(str(TARGET), draft, n_ctx=64, n_threads=THREADS, n_max=3) as same:
        assert same.system_fingerprint == fp
        assert same.create_completion("x", max_tokens=1)["system_fingerprint"] == fp
    with SpeculativeLlama(str(TARGET), draft, n_ctx=64, n_threads=THREADS, n_max=3, sampler="rejection") as other:
        assert other.system_fingerprint != fp
    with SpeculativeLlama(str(TARGET), str(drafter_gguf("f16")), n_ctx=64, n_threads=THREADS, n_max=3) as f16:
        assert f16.system_fingerprint != fp
    adopted_llm = llama_cpp.Llama(str(TARGET), n_ctx=64, n_threads=THREADS, verbose=False)
    try:
        assert SpeculativeLlama.from_llama(adopted_llm, draft, n_max=3).system_fingerprint == fp
    finally:
        adopted_llm.close()


MULTIBYTE = "# café → 😀, naïve\ndef f(x):"


def test_logprobs_of_characters_split_over_byte_tokens(spec: SpeculativeLlama) -> None:
    """The tinycode vocabulary spells é, → and emoji in byte tokens: each token's string is the text it
    completes (the leading bytes ""), so the strings join to the text and the offsets follow it; the
    top_logprobs keys stay distinct (a token that is no text by itself there is keyed "bytes:\\xNN", as
    OpenAI writes one), so every listed alternative survives; a chat's bytes are each token's own."""
    toks = spec.tokenize(MULTIBYTE, special=True)
    assert any(not _whole(spec._spec.token_to_piece(t)) for t in toks)  # byte tokens: the case is exercised
    n = len(toks)
    out = spec.create_completion(MULTIBYTE, max_tokens=12, logprobs=3, echo=True, **GREEDY)["choices"][0]
    lp = out["logprobs"]
    assert "".join(lp["tokens"]) == out["text"] and out["text"].startswith(MULTIBYTE)
    assert lp["text_offset"] == [len("".join(lp["tokens"][:k])) for k in range(len(lp["tokens"]))]
    assert len(lp["tokens"]) == n + 12
    k = toks.index(spec.tokenize("é", add_bos=False)[0])
    assert lp["tokens"][k : k + 2] == ["", "é"]

    theirs = llama_cpp.Llama(
        str(TARGET), n_ctx=N_CTX, n_threads=THREADS, n_threads_batch=THREADS, logits_all=True, verbose=False
    )
    theirs.eval(toks)
    rows = np.asarray(theirs.scores[: n - 1], dtype=np.float64)
    rows = rows - rows.max(1, keepdims=True)
    rows -= np.log(np.exp(rows).sum(1, keepdims=True))
    for i in range(1, n):
        top = lp["top_logprobs"][i]
        assert top[lp["tokens"][i]] == lp["token_logprobs"][i]
        best = np.sort(rows[i - 1])[::-1][:3]
        listed = sorted(top.values(), reverse=True)
        # all three most likely are there under their own keys (and the token itself, when not among them)
        assert len(top) == 3 + (lp["token_logprobs"][i] < best[2] - 1e-3)
        np.testing.assert_allclose(listed[:3], best, atol=2e-3)
    # byte tokens and the end of text among the alternatives (the tiny model ranks them low: listed by
    # hand, with the vocabulary's own pieces): each under a key of its own
    from tinycode import EOS

    from dflash_gguf.llama_compat import top_keys

    lead = {b: spec.tokenize(c, add_bos=False)[0] for b, c in ((0xC3, "é"), (0xE2, "→"), (0xF0, "😀"))}
    tail = spec.tokenize("é", add_bos=False)[1]  # \xa9
    whole = spec.tokenize(" a", add_bos=False)[0]
    best = [(lead[0xC3], -1.0), (tail, -1.5), (lead[0xE2], -2.0), (EOS, -2.5), (lead[0xF0], -3.0), (whole, -3.5)]
    keys = top_keys(lead[0xE2], "", b"\xe2", -2.0, best, b"\xc3", spec._spec.token_to_piece)
    assert [k for k, _, _ in keys] == ["bytes:\\xc3", "é", "", "<|endoftext|>", "bytes:\\xf0", " a"]
    assert [b for _, b, _ in keys] == [b"\xc3", b"\xa9", b"\xe2", b"<|endoftext|>", b"\xf0", b" a"]
    chosen_last = top_keys(tail, "é", b"\xa9", -9.0, best[:1] + best[2:], b"\xc3", spec._spec.token_to_piece)
    assert [k for k, _, _ in chosen_last][-1] == "é" and len({k for k, _, _ in chosen_last}) == len(best)

    streamed = [c["choices"][0] for c in spec(MULTIBYTE, max_tokens=12, logprobs=3, echo=True, stream=True, **GREEDY)]
    assert {key: [v for c in streamed if c["logprobs"] for v in c["logprobs"][key]] for key in lp} == lp

    # generated: a grammar makes the target write them; a character cut by max_tokens ends as U+FFFD
    grammar = 'root ::= "é→😀 naïve"'
    gen = spec.create_completion("x = '", max_tokens=24, logprobs=2, grammar=grammar, **GREEDY)["choices"][0]
    assert gen["text"] == "é→😀 naïve" and "".join(gen["logprobs"]["tokens"]) == gen["text"]
    assert "" in gen["logprobs"]["tokens"]
    for top in gen["logprobs"]["top_logprobs"]:
        assert len(top) in (2, 3)
    parts = [c["choices"][0] for c in spec("x = '", max_tokens=24, logprobs=2, grammar=grammar, stream=True, **GREEDY)]
    assert [t for c in parts if c["logprobs"] for t in c["logprobs"]["tokens"]] == gen["logprobs"]["tokens"]
    assert all(c["logprobs"] is None or "".join(c["logprobs"]["tokens"]) == c["text"] for c in parts)
    cut = spec.create_completion("x = '", max_tokens=3, logprobs=1, grammar=grammar, **GREEDY)["choices"][0]
    assert cut["text"] == "é\ufffd" and "".join(cut["logprobs"]["tokens"]) == cut["text"]
    cut_parts = [
        c["choices"][0] for c in spec("x = '", max_tokens=3, logprobs=1, grammar=grammar, stream=True, **GREEDY)
    ]
    assert [t for c in cut_parts if c["logprobs"] for t in c["logprobs"]["tokens"]] == cut["logprobs"]["tokens"]

    # chat: each token's bytes are its own; together the reply's
    msgs = [{"role": "user", "content": "x"}]
    reply = spec.create_chat_completion(msgs, max_tokens=24, logprobs=True, top_logprobs=2, grammar=grammar, **GREEDY)[
        "choices"
    ][0]
    content = reply["logprobs"]["content"]
    assert "".join(c["token"] for c in content) == reply["message"]["content"] == "é→😀 naïve"
    assert bytes(b for c in content for b in c["bytes"]) == "é→😀 naïve".encode()
    assert all(len({t["token"] for t in c["top_logprobs"]}) == len(c["top_logprobs"]) for c in content)

    # an echoed text prompt's special tokens are in its text, and in its tokens
    special = "x = 1<|endoftext|>y = 2\n"
    echoed = spec.create_completion(special, max_tokens=0, logprobs=1, echo=True)["choices"][0]
    assert echoed["text"] == special and "".join(echoed["logprobs"]["tokens"]) == special


def _whole(piece: bytes) -> bool:
    try:
        piece.decode("utf-8")
    except UnicodeDecodeError:
        return False
    return True


def test_generate_and_the_other_llama_cpp_accessors() -> None:
    """llama_cpp.Llama.generate's arguments and tokens (greedy, with a repeat penalty: the same as
    llama_cpp.Llama's own, the end-of-text token yielded as it yields it), set_seed fixing a sampled text,
    n_embd and token_nl as llama_cpp.Llama's."""
    import llama_cpp

    ref = llama_cpp.Llama(str(TARGET), n_ctx=N_CTX, n_threads=THREADS, verbose=False)
    with SpeculativeLlama(str(TARGET), str(drafter_gguf("f32")), n_ctx=N_CTX, n_threads=THREADS) as llm:
        assert (llm.n_embd(), llm.token_nl()) == (ref.n_embd(), ref.token_nl())
        for text, n in ((prompts()[0]["text"], 24), ('if __name__ == "__main__":\n    main()\n', 200)):
            tokens = llm.tokenize(text.encode(), add_bos=False)
            kw = {"temp": 0.0, "repeat_penalty": 1.1}
            ours = list(itertools.islice(llm.generate(tokens, **kw), n))
            theirs = list(itertools.islice(ref.generate(tokens, **kw), len(ours) + 1))
            assert ours == theirs[: len(ours)]
        assert ours[-1] == llm.token_eos() and len(ours) < 200  # the second text ends: its end token comes last

        def sampled() -> list[int]:
            return list(itertools.islice(llm.generate(tokens, temp=0.9, top_k=0, top_p=1.0, min_p=0.0), 24))

        llm.set_seed(5)
        first = sampled()
        llm.set_seed(6)
        other = sampled()
        llm.set_seed(5)
        assert sampled() == first != other
    ref.close()
