"""End to end with upstream: llama-server drafts with our converted DFlash2 drafter.

``llama-server`` built from the llama-cpp-python 0.3.36 source distribution
(``scripts/build_llama_server.sh``) is started on loopback with the bundled
tinycode target, once alone and once with our converted drafter and
``--spec-type draft-dflash``. Greedy completions must be identical, and the
drafted run must report accepted draft tokens in its response timings.

The binary comes from ``$DFLASH_LLAMA_SERVER`` or the build script's cache
(``${DFLASH_CACHE:-~/.cache/dflash-gguf}/llama-server-0.3.36/bin/llama-server``).
Without it the test is skipped, except under ``CI`` where it fails.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest
from tinycode import sse_events

from dflash_convert import Options, convert

VERSION = "0.3.36"
N_PREDICT = 48
N_PROMPTS = 3
STARTUP_TIMEOUT_S = 180
REQUEST_TIMEOUT_S = 180
# llama.cpp 0.3.36's AMX weight-repack path segfaults on Q8_0/Q4_0/K-quant weights on CPUs with
# AMX (any model, the plain target included: not a drafter issue); --no-repack avoids it
QUANTIZED_ARGS = ["--no-repack"]


def server_binary() -> Path | None:
    env = os.environ.get("DFLASH_LLAMA_SERVER")
    if env:
        return Path(env)
    cache = Path(os.environ.get("DFLASH_CACHE", Path.home() / ".cache" / "dflash-gguf"))
    path = cache / f"llama-server-{VERSION}" / "bin" / "llama-server"
    return path if path.is_file() else None


def in_ci() -> bool:
    return os.environ.get("CI", "").strip().lower() not in ("", "0", "false", "no")


@pytest.fixture(scope="module")
def llama_server() -> Path:
    binary = server_binary()
    if binary is None or not binary.is_file() or not os.access(binary, os.X_OK):
        reason = (
            f"llama-server {VERSION} not found (set DFLASH_LLAMA_SERVER, or build it with "
            "scripts/build_llama_server.sh)"
        )
        if in_ci():
            pytest.fail(f"{reason}; CI is set, so this is an error")
        pytest.skip(reason)
    return binary


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def http_json(url: str, payload: dict[str, Any] | None = None, timeout: float = REQUEST_TIMEOUT_S) -> tuple[int, Any]:
    data = json.dumps(payload).encode() if payload is not None else None
    req = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            return resp.status, json.loads(resp.read() or b"null")
    except urllib.error.HTTPError as exc:
        body = exc.read()
        try:
            return exc.code, json.loads(body or b"null")
        except json.JSONDecodeError:
            return exc.code, body.decode(errors="replace")


@contextmanager
def running_server(
    binary: Path, target: Path, log: Path, draft: Path | None = None, extra_args: list[str] | None = None
) -> Iterator[str]:
    port = free_port()
    cmd = [
        str(binary),
        "-m",
        str(target),
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "-c",
        "1024",
        "-np",
        "1",
        "-t",
        "2",
        "--seed",
        "0",
        *(extra_args or []),
    ]
    if draft is not None:
        cmd += ["-md", str(draft), "--spec-type", "draft-dflash", "--spec-draft-n-max", "7"]
    with open(log, "wb") as logf:
        proc = subprocess.Popen(cmd, stdout=logf, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
        base = f"http://127.0.0.1:{port}"
        try:
            deadline = time.monotonic() + STARTUP_TIMEOUT_S
            while True:
                if proc.poll() is not None:
                    raise AssertionError(f"llama-server exited with {proc.returncode} during startup:\n{_tail(log)}")
                try:
                    status, _ = http_json(base + "/health", timeout=5)
                    if status == 200:
                        break
                except (urllib.error.URLError, ConnectionError, TimeoutError, OSError):
                    pass
                if time.monotonic() > deadline:
                    raise AssertionError(f"llama-server not healthy after {STARTUP_TIMEOUT_S} s:\n{_tail(log)}")
                time.sleep(0.25)
            yield base
        finally:
            proc.terminate()
            try:
                proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(timeout=15)


def _tail(log: Path, n: int = 40) -> str:
    try:
        return "\n".join(log.read_text(errors="replace").splitlines()[-n:])
    except OSError:
        return "(no log)"


def complete(base: str, prompt: str) -> dict[str, Any]:
    status, body = http_json(
        base + "/completion",
        {
            "prompt": prompt,
            "n_predict": N_PREDICT,
            "temperature": 0.0,
            "top_k": 1,
            "seed": 0,
            "cache_prompt": False,
            "ignore_eos": True,
        },
    )
    assert status == 200, body
    return body


def prompts(tinycode: Path) -> list[str]:
    lines = (tinycode / "prompts.jsonl").read_text().splitlines()[:N_PROMPTS]
    return [json.loads(line)["text"] for line in lines]


@pytest.fixture(scope="module")
def plain_completions(
    llama_server: Path, tinycode: Path, tmp_path_factory: pytest.TempPathFactory
) -> list[dict[str, Any]]:
    """The target alone (no drafter), greedy."""
    log = tmp_path_factory.mktemp("server") / "server-plain.log"
    with running_server(llama_server, tinycode / "target-f16.gguf", log) as base:
        return [complete(base, p) for p in prompts(tinycode)]


@pytest.mark.parametrize("variant", ["f16", "q4_k_m", "f16+embed-target-head"])
def test_llama_server_drafts_with_converted_drafter(
    llama_server: Path, tinycode: Path, tmp_path: Path, plain_completions: list[dict[str, Any]], variant: str
) -> None:
    outtype, _, embed = variant.partition("+")
    draft = tmp_path / f"tinycode-dflash2-{outtype}.gguf"
    convert(
        Options(
            draft_dir=tinycode / "drafter-dflash2",
            target=tinycode / "target-f16.gguf",
            outfile=draft,
            outtype=outtype,
            progress=False,
            embed_target_head=bool(embed),
        )
    )
    extra = QUANTIZED_ARGS if outtype not in ("f32", "f16", "bf16") else []
    check_drafted_run(llama_server, tinycode, tmp_path, plain_completions, draft, extra)


def test_llama_server_drafts_with_sliding_window_drafter(
    llama_server: Path, tinycode: Path, tmp_path: Path, plain_completions: list[dict[str, Any]]
) -> None:
    """llama-server loads and drafts with a sliding-window drafter as we convert it (that upstream's libllama
    computes its window as ours does: tests/test_upstream_parity.py)."""
    from tinycode import sliding_drafter_gguf

    check_drafted_run(llama_server, tinycode, tmp_path, plain_completions, sliding_drafter_gguf(16, "f16"), [])


def check_drafted_run(
    llama_server: Path,
    tinycode: Path,
    tmp_path: Path,
    plain_completions: list[dict[str, Any]],
    draft: Path,
    extra: list[str],
) -> None:
    """llama-server with `draft` decodes what it decodes alone, and accepts some of its drafts."""
    log = tmp_path / "server-draft.log"
    with running_server(llama_server, tinycode / "target-f16.gguf", log, draft=draft, extra_args=extra) as base:
        drafted = [complete(base, p) for p in prompts(tinycode)]
    assert "draft-dflash" in log.read_text(errors="replace"), _tail(log)

    accepted = 0
    drafted_total = 0
    for p, a, b in zip(prompts(tinycode), plain_completions, drafted):
        assert a["tokens_predicted"] == N_PREDICT
        assert b["tokens_predicted"] == N_PREDICT
        assert b["content"] == a["content"], f"prompt {p[:40]!r}: drafted output differs from the target's"
        timings = b.get("timings", {})
        drafted_total += int(timings.get("draft_n", 0))
        accepted += int(timings.get("draft_n_accepted", 0))
        assert "draft_n" not in a.get("timings", {})
    assert drafted_total > 0, f"llama-server drafted nothing: {[b.get('timings') for b in drafted]}"
    assert accepted > 0, f"no draft token accepted: {[b.get('timings') for b in drafted]}"


def test_infill_is_llama_server_s(llama_server: Path, tinycode: Path, tmp_path: Path) -> None:
    """llama-server's /infill and ours (`dflash serve`), the same FIM-capable target, context and batch: the
    same prompt (llama-server echoes it as text), token count and greedy middle, with the repository
    context of input_extra, and with a prefix and a suffix longer than the batch lets either keep."""
    from tinycode import drafter_gguf, fim_target_gguf

    from dflash_gguf import SpeculativeLlama
    from dflash_gguf.server import serving

    texts = prompts(tinycode) + [
        json.loads(line)["text"]
        for line in (tinycode / "prompts.jsonl").read_text().splitlines()[N_PROMPTS : N_PROMPTS + 3]
    ]
    bodies = [
        {
            "input_prefix": "import os\n\n\ndef read_config(path):\n    ",
            "input_suffix": "\n    return config\n",
            "prompt": "with",
            "input_extra": [{"filename": "util.py", "text": texts[0]}, {"text": texts[1]}],
        },
        {"input_prefix": "".join(texts[:4]), "input_suffix": "".join(texts[4:])},  # > 3/4 and > 1/4 of 256
    ]
    target = fim_target_gguf()
    batch = ["-b", "256", "-ub", "256"]
    with (
        running_server(llama_server, target, tmp_path / "infill.log", extra_args=batch) as base,
        SpeculativeLlama(str(target), str(drafter_gguf("f32")), n_ctx=1024, n_batch=256, n_threads=2, n_max=3) as llm,
    ):
        with serving(llm, "ours") as port:
            ours_base = f"http://127.0.0.1:{port}"
            for body in bodies:
                req = {**body, "n_predict": N_PREDICT, "temperature": 0.0, "top_k": 1, "cache_prompt": False}
                status, theirs = http_json(base + "/infill", req)
                assert status == 200, theirs
                status, ours = http_json(ours_base + "/infill", req)
                assert status == 200, ours
                assert ours["tokens_evaluated"] == theirs["tokens_evaluated"]
                tokens = llm.infill_tokens(
                    body["input_prefix"], body["input_suffix"], body.get("prompt", ""), body.get("input_extra", ())
                )
                assert len(tokens) == ours["tokens_evaluated"]
                # llama-server echoes its prompt through llama_detokenize (which cleans spaces: " 'm" -> "'m")
                assert libllama_text(target, tokens) == theirs["prompt"]
                assert ours["content"] == theirs["content"]
    assert bodies[1]["input_prefix"] not in ours["prompt"]  # the long one was cut, as llama-server cuts it


def libllama_text(model: Path, tokens: list[int]) -> str:
    """llama-server's text of a prompt: llama_detokenize of the whole list, special tokens rendered."""
    import ctypes

    import llama_cpp
    from llama_cpp import llama_cpp as llc

    vocab_model = llama_cpp.Llama(str(model), vocab_only=True, verbose=False)
    try:
        vocab = llc.llama_model_get_vocab(vocab_model._model.model)
        arr = (llc.llama_token * len(tokens))(*tokens)
        buf = ctypes.create_string_buffer(64 * len(tokens) + 64)
        n = llc.llama_detokenize(vocab, arr, len(tokens), buf, len(buf), False, True)
    finally:
        vocab_model.close()
    assert n >= 0
    return buf.raw[:n].decode("utf-8")


def test_native_routes_are_llama_server_s(llama_server: Path, tinycode: Path, tmp_path: Path) -> None:
    """llama-server's /completion, /tokenize and /detokenize and ours on the same target: the same tokens,
    pieces and text, and the same greedy completion and token counts."""
    from tinycode import drafter_gguf

    from dflash_gguf import SpeculativeLlama
    from dflash_gguf.server import serving

    target = tinycode / "target-f16.gguf"
    with (
        running_server(llama_server, target, tmp_path / "native.log") as base,
        SpeculativeLlama(str(target), str(drafter_gguf("f32")), n_ctx=1024, n_threads=2, n_max=3) as llm,
    ):
        with serving(llm, "ours") as port:
            ours_base = f"http://127.0.0.1:{port}"
            for text in prompts(tinycode):
                for path, body in (
                    ("/tokenize", {"content": text}),
                    ("/tokenize", {"content": text + "<|endoftext|>", "with_pieces": True}),
                    ("/tokenize", {"content": "<|endoftext|>x", "parse_special": False}),
                ):
                    assert http_json(ours_base + path, body) == http_json(base + path, body), (path, body)
                ids = http_json(base + "/tokenize", {"content": text})[1]["tokens"]
                body = {"tokens": ids + [0]}
                assert http_json(ours_base + "/detokenize", body) == http_json(base + "/detokenize", body)
                for ignore_eos in (False, True):
                    req = {
                        "prompt": text,
                        "n_predict": N_PREDICT,
                        "temperature": 0.0,
                        "cache_prompt": False,
                        "ignore_eos": ignore_eos,
                    }
                    _, theirs = http_json(base + "/completion", req)
                    # a stop string from the middle of the text, and two that never come
                    word = theirs["content"][len(theirs["content"]) // 2 :][:3]
                    _, ours = http_json(ours_base + "/completion", req)
                    for stops in ([], ["\x00never", word, "\x01never"]):
                        if stops:
                            theirs, ours = (
                                http_json(b + "/completion", {**req, "stop": stops})[1] for b in (base, ours_base)
                            )
                        assert ours["content"] == theirs["content"]
                        for key in ("tokens_predicted", "tokens_evaluated", "stop", "stop_type", "stopping_word"):
                            assert ours[key] == theirs[key], key
                    assert theirs["stop_type"] == "word" and theirs["stopping_word"] == word
            # a prompt whose greedy continuation ends the text early: ignore_eos goes on past it
            short = {"prompt": 'if __name__ == "__main__":\n    main()\n', "n_predict": 200, "temperature": 0.0}
            for server_base in (base, ours_base):
                ended = http_json(server_base + "/completion", short)[1]
                assert ended["tokens_predicted"] < 200 and ended["stop_type"] == "eos", ended
                _, out = http_json(server_base + "/completion", {**short, "ignore_eos": True})
                assert out["tokens_predicted"] == 200 and out["stop_type"] == "limit", server_base


def test_completion_probabilities_are_llama_server_s(llama_server: Path, tinycode: Path, tmp_path: Path) -> None:
    """/completion's n_probs: each generated token's id, text, bytes and log-probability and the most likely
    tokens' as llama-server lists them (an end of text the target sampled among them), whole and streamed
    (the chunks' lists joined)."""
    from tinycode import drafter_gguf

    from dflash_gguf import SpeculativeLlama
    from dflash_gguf.server import serving

    def same(a: list[dict[str, Any]], b: list[dict[str, Any]]) -> bool:
        """The same lists, the log-probabilities within 0.01 (the two servers' logits differ in the last bits)."""
        rows = [[(p, *p["top_logprobs"]) for p in probs] for probs in (a, b)]
        pairs = [(s, t) for r, q in zip(*rows) for s, t in zip(r, q)]
        return (
            [len(r) for r in rows[0]] == [len(r) for r in rows[1]]
            and all(s["id"] == t["id"] and s["token"] == t["token"] and s["bytes"] == t["bytes"] for s, t in pairs)
            and all(abs(s["logprob"] - t["logprob"]) < 0.01 for s, t in pairs)
        )

    target = tinycode / "target-f16.gguf"
    requests = [
        {"prompt": prompts(tinycode)[0], "n_predict": 8, "n_probs": 3},
        {"prompt": 'if __name__ == "__main__":\n    main()\n', "n_predict": 40, "n_probs": 2},  # ends the text
    ]
    with (
        running_server(llama_server, target, tmp_path / "probs.log") as base,
        SpeculativeLlama(str(target), str(drafter_gguf("f32")), n_ctx=1024, n_threads=2, n_max=3) as llm,
        serving(llm, "ours") as port,
    ):
        for req in requests:
            req = {**req, "temperature": 0.0, "cache_prompt": False}
            (_, ours), (_, theirs) = (http_json(b + "/completion", req) for b in (f"http://127.0.0.1:{port}", base))
            assert ours["content"] == theirs["content"]
            probs = theirs["completion_probabilities"]
            assert same(ours["completion_probabilities"], probs), (ours["completion_probabilities"], probs)
            streamed = [
                [
                    p
                    for _, e in sse_events(b + "/completion", {**req, "stream": True}, REQUEST_TIMEOUT_S)
                    for p in e.get("completion_probabilities", [])
                ]
                for b in (f"http://127.0.0.1:{port}", base)
            ]
            assert same(streamed[0], probs) and same(streamed[1], probs), streamed
        assert theirs["stop_type"] == "eos"


@pytest.mark.parametrize("template", [None, "Qwen-Qwen3-0.6B"])
def test_props_and_health_are_llama_server_s(
    llama_server: Path, tinycode: Path, tmp_path: Path, template: str | None
) -> None:
    """GET /props: every field ours gives is one of llama-server's, with its value (the native routes'
    sampling defaults, the context a slot holds, the chat template, or llama-server's ChatML where the GGUF
    has none, BOS / EOS text); /v1/health as /health."""
    from tinycode import chat_target_gguf, drafter_gguf

    from dflash_gguf import SpeculativeLlama
    from dflash_gguf.server import serving

    target = chat_target_gguf(template) if template else tinycode / "target-f16.gguf"
    with (
        running_server(llama_server, target, tmp_path / "props.log") as base,
        SpeculativeLlama(str(target), str(drafter_gguf("f32")), n_ctx=1024, n_threads=2) as llm,
        serving(llm, "ours") as port,
    ):
        ours_base = f"http://127.0.0.1:{port}"
        _, theirs = http_json(base + "/props")
        status, ours = http_json(ours_base + "/props")
        assert status == 200
        assert set(ours) <= set(theirs), set(ours) - set(theirs)
        # named and built otherwise
        ours_only = {"model_alias", "model_path", "build_info"}
        for key in set(ours) - ours_only - {"default_generation_settings"}:
            assert ours[key] == theirs[key], key
        assert ours["model_alias"] == "ours" and ours["model_path"] == str(target)
        settings = ours["default_generation_settings"]
        assert settings["params"]["seed"] == 4294967295  # llama.cpp's LLAMA_DEFAULT_SEED: random
        assert settings["n_ctx"] == theirs["default_generation_settings"]["n_ctx"] == 1024
        their_params = theirs["default_generation_settings"]["params"]
        for key, value in settings["params"].items():
            # a chat default of the server / ours alone / theirs runs with --seed 0, ours draws one per request
            if key in ("reasoning_format", "speculative.n_max", "seed"):
                continue
            assert value == pytest.approx(their_params[key], rel=1e-6), key
        for path in ("/health", "/v1/health"):
            assert http_json(ours_base + path) == http_json(base + path) == (200, {"status": "ok"})


@pytest.mark.parametrize("template", [None, "deepseek-ai-DeepSeek-R1-Distill-Qwen-32B"])
def test_responses_are_llama_server_s(llama_server: Path, tinycode: Path, tmp_path: Path, template: str | None) -> None:
    """POST /v1/responses: the same output items (type and text) and token counts as llama-server's, for text
    input with instructions and for a conversation given as items; under a template that opens <think> the
    reply is a reasoning item. Streamed, ours' deltas join to the same texts."""
    from tinycode import chat_target_gguf, drafter_gguf

    from dflash_gguf import SpeculativeLlama
    from dflash_gguf.server import serving

    target = chat_target_gguf(template) if template else tinycode / "target-f16.gguf"
    requests = [
        {"instructions": "Be brief.", "input": "def add(a, b):"},
        {
            "input": [
                {"role": "user", "content": "import os"},
                {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "import sys"}]},
                {"role": "user", "content": [{"type": "input_text", "text": "class A:"}]},
            ]
        },
    ]

    def items(response: dict[str, Any]) -> list[tuple[str, str]]:
        return [(o["type"], "".join(c["text"] for c in o["content"])) for o in response["output"]]

    with (
        running_server(llama_server, target, tmp_path / "responses.log") as base,
        SpeculativeLlama(str(target), str(drafter_gguf("f32")), n_ctx=1024, n_threads=2, n_max=3) as llm,
        serving(llm, "ours") as port,
    ):
        for req in requests:
            body = {**req, "max_output_tokens": N_PREDICT, "temperature": 0.0}
            status, theirs = http_json(base + "/v1/responses", body)
            assert status == 200, theirs
            status, ours = http_json(f"http://127.0.0.1:{port}/v1/responses", body)
            assert status == 200, ours
            assert items(ours) == items(theirs) and items(ours), (items(ours), items(theirs))
            assert items(ours)[0][0] == ("reasoning" if template else "message")
            for key in ("input_tokens", "output_tokens"):
                assert ours["usage"][key] == theirs["usage"][key], key
            kinds = {"response.reasoning_text.delta": "reasoning", "response.output_text.delta": "message"}
            for server in (f"http://127.0.0.1:{port}", base):  # streamed: the deltas join to the same texts
                joined: dict[str, str] = {}
                for _, e in sse_events(server + "/v1/responses", {**body, "stream": True}, REQUEST_TIMEOUT_S):
                    if e.get("type") in kinds:
                        joined[kinds[e["type"]]] = joined.get(kinds[e["type"]], "") + e["delta"]
                assert list(joined.items()) == items(ours), server


@pytest.mark.parametrize("template", [None, "deepseek-ai-DeepSeek-R1-Distill-Qwen-32B"])
def test_anthropic_messages_are_llama_server_s(
    llama_server: Path, tinycode: Path, tmp_path: Path, template: str | None
) -> None:
    """POST /v1/messages: the same content blocks (type and text; under a template that opens <think> a
    thinking block), stop reason and token counts as llama-server's, whole and streamed (the deltas join to
    the same texts); /v1/messages/count_tokens the same count."""
    from tinycode import chat_target_gguf, drafter_gguf

    from dflash_gguf import SpeculativeLlama
    from dflash_gguf.server import serving

    target = chat_target_gguf(template) if template else tinycode / "target-f16.gguf"
    body = {
        "max_tokens": N_PREDICT,
        "temperature": 0.0,
        "system": [{"type": "text", "text": "Be brief."}],
        "messages": [
            {"role": "user", "content": "import os"},
            {"role": "assistant", "content": [{"type": "text", "text": "import sys"}]},
            {"role": "user", "content": [{"type": "text", "text": "class A:"}]},
        ],
    }

    def blocks(message: dict[str, Any]) -> list[tuple[str, str]]:
        return [(b["type"], b.get("text", b.get("thinking", ""))) for b in message["content"]]

    deltas = {"text_delta": ("text", "text"), "thinking_delta": ("thinking", "thinking")}
    with (
        running_server(llama_server, target, tmp_path / "messages.log") as base,
        SpeculativeLlama(str(target), str(drafter_gguf("f32")), n_ctx=1024, n_threads=2, n_max=3) as llm,
        serving(llm, "ours") as port,
    ):
        ours_base = f"http://127.0.0.1:{port}"
        answers = [http_json(server + "/v1/messages", body) for server in (ours_base, base)]
        assert [a[0] for a in answers] == [200, 200], answers
        (_, ours), (_, theirs) = answers
        assert blocks(ours) == blocks(theirs) and blocks(ours)[0][0] == ("thinking" if template else "text")
        assert ours["stop_reason"] == theirs["stop_reason"] == "max_tokens"
        # the prompt's tokens: those decoded and those reused (what each server's cache held may differ)
        prompt = [a["usage"]["input_tokens"] + a["usage"]["cache_read_input_tokens"] for a in (ours, theirs)]
        assert (
            prompt[0] == prompt[1] and ours["usage"]["output_tokens"] == theirs["usage"]["output_tokens"] == N_PREDICT
        )
        counts = [http_json(server + "/v1/messages/count_tokens", body) for server in (ours_base, base)]
        assert counts[0] == counts[1] == (200, {"input_tokens": prompt[0]})
        for server in (ours_base, base):
            joined: dict[str, str] = {}
            for _, e in sse_events(server + "/v1/messages", {**body, "stream": True}, REQUEST_TIMEOUT_S):
                kind, key = deltas.get(e.get("delta", {}).get("type"), (None, None))
                if kind is not None:
                    joined[kind] = joined.get(kind, "") + e["delta"][key]
            assert list(joined.items()) == blocks(ours), server


WEATHER_TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "The weather in a city.",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
        },
    }
]


@pytest.mark.parametrize(
    ("template", "extra"),
    [
        ("deepseek-ai-DeepSeek-R1-Distill-Qwen-32B", {}),  # the template opens <think>: the reply is thinking
        ("Qwen-Qwen3-0.6B", {}),
        ("Qwen-Qwen3-0.6B", {"chat_template_kwargs": {"enable_thinking": False}}),  # <think></think> in the prompt
        ("Qwen-Qwen3-0.6B", {"reasoning_effort": "none"}),
        ("Qwen-Qwen3-0.6B", {"tools": WEATHER_TOOLS}),
        # a chat with tools is read from the reply's first non-space (Llama 3.x, Mistral: their replies begin
        # with whitespace here)
        ("meta-llama-Llama-3.1-8B-Instruct", {"tools": WEATHER_TOOLS}),
        ("mistralai-Mistral-Nemo-Instruct-2407", {"tools": WEATHER_TOOLS}),
        ("google-gemma-2-2b-it", {}),  # no system role: the system text joins the user's
    ],
)
def test_chat_replies_are_llama_server_s(
    llama_server: Path, template: str, extra: dict[str, Any], tmp_path: Path
) -> None:
    """The tinycode target dressed in real model chat templates: llama-server (--jinja, its default
    reasoning format) and `dflash serve` render the same prompt (token count) and hand out the same greedy
    reply, thinking in reasoning_content, for each template option a client sends."""
    from tinycode import chat_target_gguf, drafter_gguf

    from dflash_gguf import SpeculativeLlama
    from dflash_gguf.server import serving

    target = chat_target_gguf(template)
    req = {
        "messages": [
            {"role": "system", "content": "You write Python."},
            {"role": "user", "content": "def parse_args(argv):"},
        ],
        "max_tokens": N_PREDICT,
        "temperature": 0.0,
        **extra,
    }
    with (
        running_server(llama_server, target, tmp_path / "chat.log") as base,
        SpeculativeLlama(str(target), str(drafter_gguf("f32")), n_ctx=1024, n_threads=2, n_max=3) as llm,
        serving(llm, "ours") as port,
    ):
        ours_base = f"http://127.0.0.1:{port}"
        assert http_json(ours_base + "/apply-template", req) == http_json(base + "/apply-template", req)
        status, theirs = http_json(base + "/v1/chat/completions", req)
        assert status == 200, theirs
        status, ours = http_json(ours_base + "/v1/chat/completions", req)
        assert status == 200, ours
        streams = [sse_deltas(b + "/v1/chat/completions", {**req, "stream": True}) for b in (ours_base, base)]
    assert ours["usage"]["prompt_tokens"] == theirs["usage"]["prompt_tokens"]
    assert ours["usage"]["completion_tokens"] == theirs["usage"]["completion_tokens"]
    mine, upstream = ours["choices"][0]["message"], theirs["choices"][0]["message"]
    for key in ("content", "reasoning_content", "tool_calls"):
        assert mine.get(key) == upstream.get(key), (key, mine, upstream)
    assert ours["choices"][0]["finish_reason"] == theirs["choices"][0]["finish_reason"]
    if template.startswith("deepseek"):
        assert mine["reasoning_content"] and not mine["content"]  # all of it thinking: the case is exercised
    # streamed: the same thinking and content, delta by delta joined
    assert streams[0] == streams[1]
    assert streams[0]["content"] == (mine["content"] or "")
    assert streams[0]["reasoning_content"] == mine.get("reasoning_content", "")


# a request's budget over the server's (--reasoning-budget 6 --reasoning-budget-message " Enough."): llama-server's
# field, its other name, -1 (the server's), a message of the request's or none
BUDGET_REQUESTS = [
    {},
    {"reasoning_budget_tokens": 0},
    {"thinking_budget_tokens": 3, "reasoning_budget_message": ""},
    {"reasoning_budget_tokens": -1},
    {"reasoning_budget_tokens": 12, "reasoning_budget_message": " Stop."},
    {"reasoning_budget_tokens": 5, "tools": WEATHER_TOOLS},  # the tools' lazy grammar waits while it thinks
]


@pytest.mark.parametrize("template", ["deepseek-ai-DeepSeek-R1-Distill-Qwen-32B", "Qwen3.5-4B"])
def test_reasoning_budgets_are_llama_server_s(llama_server: Path, template: str, tmp_path: Path) -> None:
    """A reasoning budget ends the thinking where llama-server's ends it (the template's <think> tags, its
    opening of the reply counted as llama-server counts it; the server's budget and message unless a request
    gives its own; Anthropic's thinking.budget_tokens): the same reasoning_content, content and token counts,
    whole and streamed. The tinycode model never ends a thinking itself: each budget is what ends it."""
    from tinycode import chat_target_gguf, drafter_gguf

    from dflash_gguf import SpeculativeLlama
    from dflash_gguf.server import serving

    target = chat_target_gguf(template)
    budget = {"reasoning_budget": 6, "reasoning_budget_message": " Enough."}
    server_args = ["--reasoning-budget", "6", "--reasoning-budget-message", " Enough."]
    chat = {"messages": [{"role": "user", "content": "def parse_args(argv):"}], "max_tokens": 40, "temperature": 0.0}
    with (
        running_server(llama_server, target, tmp_path / "budget.log", extra_args=server_args) as base,
        SpeculativeLlama(str(target), str(drafter_gguf("f32")), n_ctx=1024, n_threads=2, n_max=3) as llm,
        serving(llm, "ours", **budget) as port,
    ):
        ours_base = f"http://127.0.0.1:{port}"
        for extra in BUDGET_REQUESTS:
            req = {**chat, **extra}
            (_, ours), (_, theirs) = (http_json(b + "/v1/chat/completions", req) for b in (ours_base, base))
            mine, upstream = ours["choices"][0]["message"], theirs["choices"][0]["message"]
            for key in ("content", "reasoning_content"):
                assert mine.get(key) == upstream.get(key), (extra, key, mine, upstream)
            assert ours["usage"]["completion_tokens"] == theirs["usage"]["completion_tokens"], extra
            assert mine["content"], (extra, mine)  # the budget ended the thinking: the answer follows
            streams = [sse_deltas(b + "/v1/chat/completions", {**req, "stream": True}) for b in (ours_base, base)]
            assert streams[0] == streams[1], extra
        # llama-server's control route's answers where no generation is under way, and to bad requests
        for control in ({"id": "chatcmpl-x", "action": "reasoning_end"}, {"action": "reasoning_end"}, {"id": "x"}):
            answers = [http_json(b + "/v1/chat/completions/control", control) for b in (ours_base, base)]
            # (an error in OpenAI's shape, llama-server's with its code: the same status and message)
            said = [(status, a.get("error", {}).get("message", a)) for status, a in answers]
            assert said[0] == said[1], (control, answers)
        messages = {**chat, "thinking": {"type": "enabled", "budget_tokens": 4}}
        answers = [http_json(b + "/v1/messages", messages)[1]["content"] for b in (ours_base, base)]
        blocks = [[(b["type"], b.get("text", b.get("thinking"))) for b in a] for a in answers]
        assert blocks[0] == blocks[1] and [kind for kind, _ in blocks[0]] == ["thinking", "text"], blocks


def sse_deltas(url: str, payload: dict[str, Any]) -> dict[str, Any]:
    """The joined content and reasoning_content deltas of a streamed chat, and its tool calls' (name,
    arguments) each joined from its deltas."""
    joined = {"content": "", "reasoning_content": ""}
    calls: dict[int, list[str]] = {}
    for _, chunk in sse_events(url, payload, REQUEST_TIMEOUT_S):
        for choice in chunk.get("choices", []):
            delta = choice.get("delta", {})
            for key in joined:
                joined[key] += delta.get(key) or ""
            for call in delta.get("tool_calls") or []:
                name_args = calls.setdefault(call["index"], ["", ""])
                name_args[0] += call.get("function", {}).get("name") or ""
                name_args[1] += call.get("function", {}).get("arguments") or ""
    return {**joined, "tool_calls": [tuple(calls[i]) for i in sorted(calls)]}


def test_openai_usage_is_llama_server_s(llama_server: Path, tinycode: Path, tmp_path: Path) -> None:
    """/v1/completions and /v1/chat/completions usage as llama-server counts it, request after request on
    a fresh server each: completion_tokens with an end of text the target sampled (the first token or a
    later one), prompt_tokens_details.cached_tokens of a repeated or continued prompt and of one an earlier
    request left in the prompt cache (llama-server's --cache-ram is on by default, ours given one);
    streamed usage (stream_options.include_usage) and the native tokens_predicted alike; a
    system_fingerprint each."""
    from tinycode import drafter_gguf

    from dflash_gguf import SpeculativeLlama
    from dflash_gguf.server import serving

    target = tinycode / "target-f16.gguf"
    ends_now = 'if __name__ == "__main__":\n    main()\n'  # greedy: the end of text at once
    ends_soon = 'def main():\n    pass\n\n\nif __name__ == "__main__":\n    main'  # "()\n", then the end
    greedy = {"temperature": 0.0, "max_tokens": 24}
    requests = [
        ("/v1/completions", {"prompt": ends_now, **greedy}),
        ("/v1/completions", {"prompt": ends_now, **greedy}),
        ("/v1/completions", {"prompt": ends_soon, **greedy}),
        ("/v1/completions", {"prompt": ends_soon + "()\n", **greedy}),
        ("/v1/completions", {"prompt": prompts(tinycode)[0], **greedy}),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "def add(a, b):"}], **greedy}),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "def add(a, b):"}], **greedy}),
    ]
    with (
        running_server(llama_server, target, tmp_path / "usage.log") as base,
        SpeculativeLlama(str(target), str(drafter_gguf("f32")), n_ctx=1024, n_threads=2, n_max=3) as llm,
        serving(llm, "ours") as port,
    ):
        import llama_cpp

        llm.set_cache(llama_cpp.LlamaRAMCache(capacity_bytes=256 << 20))  # `dflash serve --cache-ram 256`
        answers: dict[str, list[Any]] = {}
        for server_base in (base, f"http://127.0.0.1:{port}"):
            got = answers.setdefault(server_base, [])
            for path, body in requests:
                status, out = http_json(server_base + path, body)
                assert status == 200, out
                assert isinstance(out["system_fingerprint"], str) and out["system_fingerprint"]
                got.append((out["usage"], out["choices"][0]["finish_reason"]))
            usage_chunks = sse_usage(
                server_base + "/v1/completions",
                {"prompt": ends_soon, **greedy, "stream": True, "stream_options": {"include_usage": True}},
            )
            got.append(usage_chunks)
            got.append(
                {
                    k: http_json(
                        server_base + "/completion", {"prompt": ends_now, "n_predict": 24, "temperature": 0.0}
                    )[1][k]
                    for k in ("tokens_predicted", "tokens_evaluated")
                }
            )
        ours, theirs = answers[f"http://127.0.0.1:{port}"], answers[base]
    assert ours == theirs
    assert ours[0][0]["completion_tokens"] == 1 and ours[1][0]["prompt_tokens_details"]["cached_tokens"] > 0
    assert llm.system_fingerprint.startswith("dflash-gguf-")


def sse_usage(url: str, payload: dict[str, Any]) -> list[Any]:
    """The usage of each chunk of an OpenAI stream that has one, and the system_fingerprint's presence."""
    out = [
        ("system_fingerprint" in chunk, chunk.get("usage")) for _, chunk in sse_events(url, payload, REQUEST_TIMEOUT_S)
    ]
    return [u for u in out if u[1] is not None] + [all(f for f, _ in out)]


def test_metrics_are_llama_server_s(llama_server: Path, tinycode: Path, tmp_path: Path) -> None:
    """GET /metrics: without --metrics a 501 from both servers; with it the same metrics of the same types,
    and after the same greedy requests, drafted with the same file, the same counts of prompt and generated
    tokens; on both, the accepted drafts per position add up to the accepted drafts."""
    from tinycode import drafter_gguf, scrape_metrics

    from dflash_gguf import SpeculativeLlama
    from dflash_gguf.server import serving

    target, draft = tinycode / "target-f16.gguf", drafter_gguf("f16")
    with (
        running_server(llama_server, target, tmp_path / "plain.log") as base,
        SpeculativeLlama(str(target), str(draft), n_ctx=1024, n_threads=2, n_max=7) as llm,
        serving(llm) as port,
    ):
        theirs, ours = http_json(base + "/metrics"), http_json(f"http://127.0.0.1:{port}/metrics")
        assert theirs[0] == ours[0] == 501
        assert theirs[1]["error"]["type"] == ours[1]["error"]["type"] == "not_supported_error"

    texts = prompts(tinycode)[:2]
    with (
        running_server(llama_server, target, tmp_path / "draft.log", draft=draft, extra_args=["--metrics"]) as base,
        SpeculativeLlama(str(target), str(draft), n_ctx=1024, n_threads=2, n_max=7) as llm,
        serving(llm, metrics=True) as port,
    ):
        ours_base = f"http://127.0.0.1:{port}"
        scraped = {}
        for name, url in (("theirs", base), ("ours", ours_base)):
            replies = [complete(url, text) for text in texts]
            assert [r["tokens_predicted"] for r in replies] == [N_PREDICT] * len(texts), name
            scraped[name] = scrape_metrics(url)
    (theirs, their_types, _), (ours, our_types, _) = scraped["theirs"], scraped["ours"]
    assert our_types == their_types
    assert set(ours) == set(theirs), set(ours) ^ set(theirs)
    for m in (theirs, ours):
        assert m["llamacpp:tokens_predicted_total"] == len(texts) * N_PREDICT
        drafted, accepted = (
            m["llamacpp:spec_decode_num_draft_tokens_total"],
            m["llamacpp:spec_decode_num_accepted_tokens_total"],
        )
        assert 0 < accepted <= drafted and m["llamacpp:spec_decode_num_drafts_total"] > 0
        per_position = [v for k, v in m.items() if k.startswith("llamacpp:spec_decode_num_accepted_tokens_per_pos")]
        assert len(per_position) == 7 and sum(per_position) == accepted
        assert m["llamacpp:n_decode_total"] >= m["llamacpp:spec_decode_num_drafts_total"]
        assert m["llamacpp:requests_processing"] == m["llamacpp:requests_deferred"] == 0
    prompt_total = "llamacpp:prompt_tokens_total", "llamacpp:prompt_tokens_cached_total"
    assert sum(ours[k] for k in prompt_total) == sum(theirs[k] for k in prompt_total)
    assert ours["llamacpp:n_tokens_max"] == theirs["llamacpp:n_tokens_max"]


def test_slots_are_llama_server_s(llama_server: Path, tinycode: Path, tmp_path: Path) -> None:
    """GET /slots before and after the same greedy completion on one slot, drafted with the same file: each
    field ours gives is one of llama-server's, with its value (the task's number aside), the tokens the
    slot's context holds included."""
    from tinycode import drafter_gguf

    from dflash_gguf import SpeculativeLlama
    from dflash_gguf.server import serving

    target, draft = tinycode / "target-f16.gguf", drafter_gguf("f16")
    with (
        running_server(llama_server, target, tmp_path / "slots.log", draft=draft) as base,
        SpeculativeLlama(str(target), str(draft), n_ctx=1024, n_threads=2, n_max=7) as llm,
        serving(llm) as port,
    ):
        ours_base = f"http://127.0.0.1:{port}"
        before = http_json(base + "/slots"), http_json(ours_base + "/slots")
        for url in (base, ours_base):
            complete(url, prompts(tinycode)[0])
        after = http_json(base + "/slots"), http_json(ours_base + "/slots")
    for (_, [theirs]), (status, [ours]) in (before, after):
        assert status == 200 and set(ours) <= set(theirs), set(ours) - set(theirs)
        for key in set(ours) - {"id_task"}:
            assert ours[key] == theirs[key], key
    assert after[1][1][0]["n_prompt_tokens"] > 0


# replies to force: whitespace before, inside and after a thinking the reply opens or the prompt opened
FORCED_REPLIES = [
    "  abc  ",
    "\n\nabc\n",
    "<think>plan</think>\n\n  ok",
    "<think>\n\nplan</think>\n ok",
    "<think>plan</think>\n\n\nok",
    "x</think>\n\n  y",
    " \n</think>z",
]
NO_THINKING = {"chat_template_kwargs": {"enable_thinking": False}}
NOT_READ = {"reasoning_format": "none"}  # the thinking stays in the text


# a tool whose call a grammar fixes up to its whitespace: llama-server's grammar for tool_choice "required"
# then writes the call once a logit bias has it begin
FIXED_CALL_TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "parameters": {
                "type": "object",
                "properties": {"city": {"type": "string", "enum": ["Paris"]}, "days": {"type": "integer", "enum": [3]}},
                "required": ["city", "days"],
                "additionalProperties": False,
            },
        },
    }
]


@pytest.mark.parametrize(
    ("template", "opener", "biases"),
    [
        ("meta-llama-Llama-3.1-8B-Instruct", "{", (8, 15)),  # "\n{...}" and "{...}"
        ("mistralai-Mistral-Nemo-Instruct-2407", "[TOOL_CALLS]", (50,)),
    ],
)
def test_tool_calls_are_read_as_llama_server_reads_them(
    llama_server: Path, tmp_path: Path, template: str, opener: str, biases: tuple[int, ...]
) -> None:
    """Calls in Llama 3.x's and Mistral Nemo's syntax come apart as llama-server's reader takes them apart
    (name, arguments as written, content), whole and streamed: llama-server writes a call under its grammar
    for tool_choice "required" (the call's opener favoured by a logit bias, the end of text once it may
    come), ours is made to write the same text by a grammar. Mistral's marker is a special token, as in
    its own vocabulary."""
    import gguf
    from tinycode import chat_target_gguf, drafter_gguf, special_tokens_target

    from dflash_gguf import SpeculativeLlama
    from dflash_gguf.server import serving

    target = special_tokens_target(template, (opener,)) if opener.startswith("[") else chat_target_gguf(template)
    vocab = gguf.GGUFReader(target, "r").fields["tokenizer.ggml.tokens"].contents()
    chat = {"messages": [{"role": "user", "content": "weather in Paris?"}], "max_tokens": 300, "temperature": 0.0}
    with (
        running_server(llama_server, target, tmp_path / "calls.log") as base,
        SpeculativeLlama(str(target), str(drafter_gguf("f32")), n_ctx=1024, n_threads=2, n_max=3) as llm,
        serving(llm, "ours") as port,
    ):
        for bias in biases:
            forcing = {"tool_choice": "required", "logit_bias": [[vocab.index(opener), bias], [0, 100]]}
            req = {**chat, "tools": FIXED_CALL_TOOLS, **forcing, "verbose": True}
            _, theirs = http_json(base + "/v1/chat/completions", req)
            written = theirs["__verbose"]["content"]
            ours_req = {**chat, "tools": FIXED_CALL_TOOLS, "grammar": "root ::= " + json.dumps(written)}
            _, ours = http_json(f"http://127.0.0.1:{port}/v1/chat/completions", ours_req)
            mine, upstream = ours["choices"][0], theirs["choices"][0]
            assert mine["finish_reason"] == upstream["finish_reason"] == "tool_calls", written
            assert mine["message"]["content"] == upstream["message"]["content"], written
            assert [c["function"] for c in mine["message"]["tool_calls"]] == [
                c["function"] for c in upstream["message"]["tool_calls"]
            ], written
            streams = (
                sse_deltas(f"http://127.0.0.1:{port}/v1/chat/completions", {**ours_req, "stream": True}),
                sse_deltas(base + "/v1/chat/completions", {**req, "stream": True}),
            )
            assert streams[0] == streams[1], written


@pytest.mark.parametrize(
    ("template", "extra"),
    [
        ("Qwen3.5-4B", {}),
        ("Qwen3.5-4B", NO_THINKING),
        ("Qwen3.5-4B", NOT_READ),
        ("Qwen-Qwen3-0.6B", {}),
        ("Qwen-Qwen3-0.6B", NO_THINKING),
        ("Qwen-Qwen3-0.6B", NOT_READ),
        ("Qwen-Qwen3-0.6B", {**NOT_READ, **NO_THINKING}),
        ("deepseek-ai-DeepSeek-R1-Distill-Qwen-32B", {}),
        ("deepseek-ai-DeepSeek-R1-Distill-Qwen-32B", NOT_READ),
        ("Qwen3-Coder", {}),
        ("HuggingFaceTB-SmolLM3-3B", {}),
        ("HuggingFaceTB-SmolLM3-3B", NOT_READ),
        ("meta-llama-Llama-3.1-8B-Instruct", {}),
        ("openai-gpt-oss-120b", {}),
        ("openai-gpt-oss-120b", NOT_READ),
        ("muse-glimmer", {}),
        ("muse-glimmer", NOT_READ),
    ],
)
def test_forced_replies_are_read_as_llama_server_reads_them(
    llama_server: Path, tmp_path: Path, template: str, extra: dict[str, Any]
) -> None:
    """Replies a grammar forces (the same text from both servers: thinking closed or not, whitespace around
    it, a call begun while thinking; gpt-oss's channels, Muse Glimmer's recipients) come apart into the same content and
    reasoning_content, whole and streamed, as each template's reader in llama-server makes of them."""
    from test_chat_reply import GLIMMER_REPLIES, HARMONY_REPLIES, XML_FAMILY_REPLIES
    from tinycode import chat_target_gguf, drafter_gguf

    from dflash_gguf import SpeculativeLlama
    from dflash_gguf.server import serving

    target = chat_target_gguf(template)
    with (
        running_server(llama_server, target, tmp_path / "forced.log") as base,
        SpeculativeLlama(str(target), str(drafter_gguf("f32")), n_ctx=1024, n_threads=2, n_max=3) as llm,
        serving(llm, "ours") as port,
    ):
        ours_base = f"http://127.0.0.1:{port}"
        replies = {"openai-gpt-oss-120b": HARMONY_REPLIES, "muse-glimmer": GLIMMER_REPLIES}.get(
            template, XML_FAMILY_REPLIES
        )
        for text in [r[0] for r in replies] + FORCED_REPLIES * (replies is XML_FAMILY_REPLIES):
            req = {
                "messages": [{"role": "user", "content": "hi"}],
                "max_tokens": 300,
                "temperature": 0.0,
                "grammar": "root ::= " + json.dumps(text),
                **extra,
            }
            _, theirs = http_json(base + "/v1/chat/completions", req)
            _, ours = http_json(ours_base + "/v1/chat/completions", req)
            mine, upstream = ours["choices"][0]["message"], theirs["choices"][0]["message"]
            for key in ("content", "reasoning_content"):
                assert mine.get(key) == upstream.get(key), (text, key, mine, upstream)
            streams = [sse_deltas(b + "/v1/chat/completions", {**req, "stream": True}) for b in (ours_base, base)]
            assert streams[0] == streams[1], text


def test_lora_adapters_are_llama_server_s(llama_server: Path, tinycode: Path, tmp_path: Path) -> None:
    """--lora / --lora-scaled: GET /lora-adapters lists the same adapters and scales, the greedy text is the
    same at the server's scales, at a request's own `lora` scales (the adapters it leaves out at 0) and
    after POST /lora-adapters set new ones."""
    from tinycode import drafter_gguf, lora_gguf, prompts

    from dflash_gguf import SpeculativeLlama
    from dflash_gguf.server import serving

    target = tinycode / "target-f16.gguf"
    first, second = str(lora_gguf()), str(lora_gguf(seed=1))
    args = ["--lora", first, "--lora-scaled", f"{second}:0.5"]
    # a prompt whose greedy text under each of the scales below is not near a tie (the random adapters leave
    # many), so that the verify's batches and llama-server's single tokens choose alike
    # (llama-server recomputed: after POST /lora-adapters it reuses a prompt its slot computed at the old
    # scales, where ours computes it again)
    prompt = {"prompt": prompts()[13]["text"], "max_tokens": 12, "temperature": 0.0, "cache_prompt": False}
    with (
        running_server(llama_server, target, tmp_path / "lora.log", extra_args=args) as base,
        SpeculativeLlama(
            str(target), str(drafter_gguf("f32")), n_ctx=1024, n_threads=2, lora_adapters=[(first, 1.0), (second, 0.5)]
        ) as llm,
        serving(llm, "ours") as port,
    ):
        servers = (f"http://127.0.0.1:{port}", base)

        def same(path: str, payload: Any = None) -> Any:
            answers = [http_json(s + path, payload) for s in servers]
            assert answers[0] == answers[1], (path, payload, answers)
            return answers[0][1]

        def text(extra: dict[str, Any]) -> str:
            answers = [http_json(s + "/v1/completions", {**prompt, **extra})[1] for s in servers]
            texts = [a["choices"][0]["text"] for a in answers]
            assert texts[0] == texts[1], (extra, texts)
            return texts[0]

        listed = same("/lora-adapters")
        assert [(a["path"], a["scale"]) for a in listed] == [(first, 1.0), (second, 0.5)]
        both = text({})
        alone = text({"lora": [{"id": 0, "scale": 1.0}]})
        assert alone != both  # the second adapter, at 0 for that request, counted before
        assert same("/lora-adapters", [{"id": 1, "scale": 1.0}]) == {"success": True}
        assert [a["scale"] for a in same("/lora-adapters")] == [0.0, 1.0]
        assert text({}) not in (both, alone)
        assert text({"lora": [{"id": 0, "scale": 1.0}]}) == alone


def test_slot_actions_are_llama_server_s(llama_server: Path, tinycode: Path, tmp_path: Path) -> None:
    """POST /slots/{id}?action=save|restore|erase: the same answers as llama-server's (fields, token counts;
    the bytes and times are each server's own, the files each one's format) and the same refusals (a slot id
    past the last is refused here, where llama-server 0.3.36 answers as for an empty slot)."""
    from tinycode import drafter_gguf

    from dflash_gguf import SpeculativeLlama
    from dflash_gguf.server import serving

    target = tinycode / "target-f16.gguf"
    theirs_dir, ours_dir = tmp_path / "theirs", tmp_path / "ours"
    theirs_dir.mkdir()
    ours_dir.mkdir()
    req = {"prompt": prompts(tinycode)[0], "n_predict": 16, "temperature": 0.0}
    with (
        running_server(
            llama_server, target, tmp_path / "slots.log", extra_args=["--slot-save-path", f"{theirs_dir}/"]
        ) as base,
        SpeculativeLlama(str(target), str(drafter_gguf("f32")), n_ctx=1024, n_threads=2) as llm,
        serving(llm, slot_save_path=str(ours_dir)) as port,
    ):
        servers = (f"http://127.0.0.1:{port}", base)

        def both(path: str, body: Any = None) -> list[tuple[int, Any]]:
            return [http_json(s + path, body) for s in servers]

        both("/completion", req)
        saved = both("/slots/0?action=save", {"filename": "s.bin"})
        assert [s[0] for s in saved] == [200, 200]
        assert saved[0][1].keys() == saved[1][1].keys()
        assert saved[0][1]["n_saved"] == saved[1][1]["n_saved"], saved
        erased = both("/slots/0?action=erase", {})
        assert erased[0] == erased[1] == (200, {"id_slot": 0, "n_erased": saved[0][1]["n_saved"]})
        restored = both("/slots/0?action=restore", {"filename": "s.bin"})
        assert restored[0][1].keys() == restored[1][1].keys()
        assert restored[0][1]["n_restored"] == restored[1][1]["n_restored"] == saved[0][1]["n_saved"]
        for path, body in (
            ("/slots/0?action=save", {"filename": "../s.bin"}),
            ("/slots/0?action=copy", {"filename": "s.bin"}),
        ):
            answers = both(path, body)
            said = [(status, a["error"]["message"]) for status, a in answers]
            assert said[0] == said[1], (path, answers)
