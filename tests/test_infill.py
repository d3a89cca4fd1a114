"""Fill in the middle: create_completion's `suffix`, `infill_tokens` (llama-server's /infill layout) and
our server's /infill, on the tinycode target with FIM token ids set (tinycode.fim_target_gguf). The
comparison with llama-server's own /infill is in test_llama_server.py."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import pytest

pytest.importorskip("llama_cpp", reason="llama-cpp-python is not installed")

from test_server import request  # noqa: E402
from tinycode import FIM_IDS, N_CTX, TARGET, THREADS, drafter_gguf, fim_target_gguf  # noqa: E402

from dflash_gguf import SpeculativeLlama  # noqa: E402
from dflash_gguf.infill import server_infill_prompt  # noqa: E402
from dflash_gguf.server import serving  # noqa: E402

GREEDY = {"temperature": 0.0}
BEFORE = "import os\n\n\ndef read_config(path):\n    "
AFTER = "\n    return config\n\n\ndef main():\n    print(read_config('a.ini'))\n"


@pytest.fixture(scope="module")
def llm() -> Iterator[SpeculativeLlama]:
    with SpeculativeLlama(
        str(fim_target_gguf()), str(drafter_gguf("f32")), n_ctx=N_CTX, n_threads=THREADS, n_max=3
    ) as m:
        yield m


def test_suffix_fills_the_middle_losslessly(llm: SpeculativeLlama) -> None:
    """suffix= puts the prompt and the suffix around the FIM tokens ([FIM_PRE] prompt [FIM_SUF] suffix
    [FIM_MID]; this vocabulary asks for no BOS) and continues there exactly as plain decoding of that
    token list does, drafting as it goes."""

    def tok(text: str) -> list[int]:
        return llm.tokenize(text.encode(), add_bos=False)

    layout = [FIM_IDS["pre"], *tok(BEFORE), FIM_IDS["suf"], *tok(AFTER), FIM_IDS["mid"]]
    out = llm.create_completion(BEFORE, suffix=AFTER, max_tokens=40, **GREEDY)
    assert out["usage"]["prompt_tokens"] == len(layout)
    assert llm.stats.drafted > 0
    plain = list(llm.generate_tokens(layout, max_tokens=40, plain=True))
    assert out["choices"][0]["text"] == llm.detokenize(plain).decode("utf-8", "replace")
    assert llm.create_completion(layout, max_tokens=40, **GREEDY)["choices"] == out["choices"]
    # without the suffix the same prompt is a different request
    assert llm.create_completion(BEFORE, max_tokens=40, **GREEDY)["choices"][0]["text"] != out["choices"][0]["text"]
    echoed = llm.create_completion(BEFORE, suffix=AFTER, max_tokens=40, echo=True, **GREEDY)
    assert echoed["choices"][0]["text"] == BEFORE + out["choices"][0]["text"]
    streamed = llm.create_completion(BEFORE, suffix=AFTER, max_tokens=40, stream=True, **GREEDY)
    assert "".join(c["choices"][0]["text"] for c in streamed) == out["choices"][0]["text"]
    with pytest.raises(ValueError, match="suffix must be a string"):
        llm.create_completion(BEFORE, suffix=3)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="echo with logprobs"):
        llm.create_completion(BEFORE, suffix=AFTER, echo=True, logprobs=2)


def test_a_target_without_fim_tokens_is_told_so() -> None:
    with SpeculativeLlama(str(TARGET), str(drafter_gguf("f32")), n_ctx=N_CTX, n_threads=THREADS) as plain:
        for call in (
            lambda: plain.create_completion(BEFORE, suffix=AFTER, max_tokens=4),
            lambda: plain.infill_tokens(BEFORE, AFTER),
        ):
            with pytest.raises(ValueError, match="tokenizer.ggml.fim_pre_token_id") as e:
                call()
            assert str(TARGET) in str(e.value)


def test_server_layout_keeps_what_llama_server_keeps() -> None:
    """llama-server's cuts, on a tokenizer of one token per character: the prefix's last 3/4 of a batch,
    the suffix's first quarter less the middle prompt and two, the extra context's last
    n_ctx - n_batch - 2 n_predict tokens before everything (its BOS included), separators by vocabulary."""
    fim = {"pre": 1002, "suf": 1003, "mid": 1004, "rep": 1005, "sep": 1006}  # shown as <2> .. <6>, BOS <1>

    def tokenize(text: str, special: bool) -> list[int]:
        return [ord(c) for c in text]

    def chars(tokens: list[int]) -> str:
        return "".join(chr(t) if t < 1000 else f"<{t - 1000}>" for t in tokens)

    extra = [{"filename": "a.py", "text": "A"}, {"text": "B"}]
    full = server_infill_prompt(
        fim, [1001], tokenize, "p" * 500, "s" * 500, "m" * 10, extra, n_batch=256, n_ctx=4096, n_predict=-1
    )
    assert chars(full) == (
        "<5>myproject\n<6>a.py\nA<6>tmp\nB<6>filename\n<1><2>" + "p" * 192 + "m" * 10 + "<3>" + "s" * (64 - 12) + "<4>"
    )
    no_sep = server_infill_prompt(
        {**fim, "rep": -1, "sep": -1}, [], tokenize, "pp", "ss", "", extra, n_batch=256, n_ctx=4096
    )
    assert chars(no_sep) == "\n\n--- snippet ---\n\nA\n\n--- snippet ---\n\nB<2>pp<3>ss<4>"
    # a full context keeps only the end of the extra context: here 1024 - 256 - 2 * 380 = 8 tokens
    tight = server_infill_prompt(fim, [], tokenize, "pp", "ss", "", extra, n_batch=256, n_ctx=1024, n_predict=380)
    assert chars(tight) == "ilename\n<2>pp<3>ss<4>"


@pytest.fixture(scope="module")
def port(llm: SpeculativeLlama) -> Iterator[int]:
    with serving(llm, "fim") as p:
        yield p


def test_server_infill_and_suffix(llm: SpeculativeLlama, port: int) -> None:
    """/infill answers in llama-server's native shape with infill_tokens' prompt, streamed or not;
    /v1/completions takes OpenAI's `suffix`; bad bodies get a 400 naming the field."""
    body: dict[str, Any] = {
        "input_prefix": BEFORE,
        "input_suffix": AFTER,
        "prompt": "with",
        "input_extra": [{"filename": "util.py", "text": "X = 1\n"}],
        "n_predict": 24,
        **GREEDY,
    }
    tokens = llm.infill_tokens(BEFORE, AFTER, "with", body["input_extra"])
    direct = llm.create_completion(tokens, max_tokens=24, **GREEDY)["choices"][0]["text"]
    status, out = request(port, "POST", "/infill", body)
    assert status == 200 and out["content"] == direct and out["stop"] is True
    assert out["tokens_evaluated"] == len(tokens) and out["tokens_predicted"] == 24
    assert out["prompt"] == llm.detokenize(tokens, special=True).decode()
    assert out["timings"]["predicted_n"] == 24
    status, payload = request(port, "POST", "/infill", {**body, "stream": True})
    chunks = events_native(payload)
    assert status == 200 and "".join(c["content"] for c in chunks) == direct
    assert chunks[-1]["stop"] is True and not any(c["stop"] for c in chunks[:-1])
    assert chunks[-1]["tokens_predicted"] == 24

    status, oai = request(
        port, "POST", "/v1/completions", {"prompt": BEFORE, "suffix": AFTER, "max_tokens": 16, **GREEDY}
    )
    assert status == 200
    assert (
        oai["choices"][0]["text"]
        == llm.create_completion(BEFORE, suffix=AFTER, max_tokens=16, **GREEDY)["choices"][0]["text"]
    )
    for bad, message in (
        ({"input_suffix": AFTER}, "input_prefix"),
        ({"input_prefix": BEFORE}, "input_suffix"),
        ({**body, "input_extra": {"text": "x"}}, "input_extra"),
        ({**body, "input_extra": [{"filename": "a"}]}, "input_extra"),
        ({**body, "n_predict": "many"}, "n_predict"),
        ({**body, "prompt": 7}, "prompt"),
    ):
        status, out = request(port, "POST", "/infill", bad)
        assert status == 400 and message in out["error"]["message"], (bad, out)
    assert request(port, "POST", "/infill", body)[1]["content"] == direct  # still serving


def events_native(payload: bytes) -> list[dict[str, Any]]:
    """llama-server's native stream: data events, no [DONE]"""
    parts = [p[len(b"data: ") :] for p in payload.split(b"\n\n") if p]
    assert parts and parts[-1] != b"[DONE]"
    return [json.loads(p) for p in parts]
