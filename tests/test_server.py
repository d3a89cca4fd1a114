"""`dflash serve`: the OpenAI-compatible HTTP server over the bundled tinycode pair, spoken to over real
sockets. Its answers must be what the Python API answers for the same request, streamed or not; bad
requests get a 400 (before any byte of a stream) and the server keeps serving."""

from __future__ import annotations

import http.client
import json
import re
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("llama_cpp", reason="llama-cpp-python is not installed")

from tinycode import TARGET, THREADS, drafter_gguf, prompts  # noqa: E402

from dflash_gguf import SpeculativeLlama  # noqa: E402
from dflash_gguf.server import make_server, running, serving  # noqa: E402

GREEDY = {"temperature": 0.0}
CHAT = [{"role": "user", "content": "def add(a, b):"}]


@pytest.fixture(scope="module")
def llm() -> Iterator[SpeculativeLlama]:
    with SpeculativeLlama(str(TARGET), str(drafter_gguf("f32")), n_ctx=512, n_threads=THREADS, n_max=7) as m:
        yield m


@pytest.fixture(scope="module")
def port(llm: SpeculativeLlama) -> Iterator[int]:
    with serving(llm, "tiny") as p:
        yield p


def request(
    port: int, method: str, path: str, body: Any = None, raw: bytes | None = None, headers: dict[str, str] | None = None
) -> tuple[int, Any]:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
    data = raw if raw is not None else (json.dumps(body).encode() if body is not None else None)
    conn.request(method, path, body=data, headers={"Content-Type": "application/json", **(headers or {})})
    resp = conn.getresponse()
    payload = resp.read()
    conn.close()
    if resp.getheader("Content-Type") == "text/event-stream":
        return resp.status, payload
    return resp.status, json.loads(payload)


def events(payload: bytes) -> list[Any]:
    """The data of each event of an OpenAI stream (which ends with [DONE])."""
    parts = [p.split(b"data: ", 1)[1] for p in payload.split(b"\n\n") if p]
    assert parts[-1] == b"[DONE]", parts[-1]
    return [json.loads(p) for p in parts[:-1]]


def test_answers_are_the_python_api_s(llm: SpeculativeLlama, port: int) -> None:
    assert request(port, "GET", "/health") == (200, {"status": "ok"})
    status, models = request(port, "GET", "/v1/models")
    assert status == 200 and [m["id"] for m in models["data"]] == ["tiny"]
    prompt = prompts()[0]["text"]
    direct = llm.create_completion(prompt, max_tokens=40, **GREEDY)
    status, out = request(
        port,
        "POST",
        "/v1/completions",
        {"prompt": prompt, "max_tokens": 40, "user": "someone", "stream_options": {}, **GREEDY},
    )
    assert status == 200 and out["model"] == "tiny" and out["object"] == "text_completion"
    assert out["choices"] == direct["choices"] and out["system_fingerprint"] == llm.system_fingerprint
    t = out["timings"]  # llama-server's names, from the generation's statistics
    assert t["predicted_n"] == 40 and t["cache_n"] + t["prompt_n"] == out["usage"]["prompt_tokens"]
    assert t["cache_n"] == out["usage"]["prompt_tokens"] - 1  # the same prompt as the direct call's
    # the usage is the Python API's, the prompt's tokens reused from the direct call as cached_tokens
    assert out["usage"] == {**direct["usage"], "prompt_tokens_details": {"cached_tokens": t["cache_n"]}}
    assert 0 < t["draft_n_accepted"] <= t["draft_n"] and t["predicted_per_second"] > 0
    # streamed: the same text, chunk by chunk
    status, payload = request(
        port, "POST", "/v1/completions", {"prompt": prompt, "max_tokens": 40, "stream": True, **GREEDY}
    )
    chunks = events(payload)
    assert status == 200 and len(chunks) > 2
    assert "".join(c["choices"][0]["text"] for c in chunks) == direct["choices"][0]["text"]
    assert chunks[-1]["choices"][0]["finish_reason"] == "length" and chunks[-1]["timings"]["predicted_n"] == 40
    assert not any("timings" in c for c in chunks[:-1])
    # OpenAI's stream_options.include_usage: a last chunk with the usage and no choices
    status, payload = request(
        port,
        "POST",
        "/v1/completions",
        {"prompt": prompt, "max_tokens": 40, "stream": True, "stream_options": {"include_usage": True}, **GREEDY},
    )
    with_usage = events(payload)
    assert with_usage[-1]["choices"] == [] and with_usage[-1]["usage"] == out["usage"]
    assert with_usage[-1]["id"] == with_usage[0]["id"] and len(with_usage) == len(chunks) + 1
    assert {c["system_fingerprint"] for c in with_usage} == {llm.system_fingerprint}
    # a list of prompts: the usage chunk sums theirs, as the answer without a stream does
    pair = [prompt, prompts()[1]["text"]]
    status, whole = request(port, "POST", "/v1/completions", {"prompt": pair, "max_tokens": 8, **GREEDY})
    status, payload = request(
        port,
        "POST",
        "/v1/completions",
        {"prompt": pair, "max_tokens": 8, "stream": True, "stream_options": {"include_usage": True}, **GREEDY},
    )
    summed = events(payload)[-1]["usage"]
    assert {k: summed[k] for k in ("prompt_tokens", "completion_tokens")} == {
        k: whole["usage"][k] for k in ("prompt_tokens", "completion_tokens")
    }
    assert whole["usage"]["completion_tokens"] == 16 and whole["usage"]["prompt_tokens"] == sum(
        len(llm.tokenize(t, special=True)) for t in pair
    )
    # sampling options by llama-server's names ("mirostat") and llama_cpp.server's ("mirostat_mode")
    sampled = {"temperature": 1.0, "seed": 3, "mirostat_tau": 2.0, "mirostat_eta": 0.5, "typical_p": 0.9}
    direct = llm.create_completion(prompt, max_tokens=16, mirostat_mode=2, **sampled)
    for name in ("mirostat", "mirostat_mode"):
        status, out = request(port, "POST", "/v1/completions", {"prompt": prompt, "max_tokens": 16, name: 2, **sampled})
        assert status == 200 and out["choices"] == direct["choices"]
    # chat, streamed and not; max_completion_tokens is OpenAI's newer name for max_tokens
    direct = llm.create_chat_completion(CHAT, max_tokens=24, **GREEDY)
    status, out = request(
        port, "POST", "/v1/chat/completions", {"messages": CHAT, "max_completion_tokens": 24, **GREEDY}
    )
    assert status == 200 and out["choices"] == direct["choices"]
    status, payload = request(
        port, "POST", "/v1/chat/completions", {"messages": CHAT, "max_tokens": 24, "stream": True, **GREEDY}
    )
    chunks = events(payload)
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant"}
    assert out["system_fingerprint"] == llm.system_fingerprint
    assert {c["system_fingerprint"] for c in chunks} == {llm.system_fingerprint}
    text = "".join(c["choices"][0]["delta"].get("content", "") for c in chunks)
    assert text == direct["choices"][0]["message"]["content"]
    # logit_bias arrives with string keys (JSON): banning the greedy first token changes it as it does directly
    first = llm.tokenize(direct["choices"][0]["message"]["content"].encode(), add_bos=False)[0]
    banned = llm.create_chat_completion(CHAT, max_tokens=8, logit_bias={first: -100.0}, **GREEDY)
    status, out = request(
        port,
        "POST",
        "/v1/chat/completions",
        {"messages": CHAT, "max_tokens": 8, "logit_bias": {str(first): -100}, **GREEDY},
    )
    assert out["choices"] == banned["choices"] != direct["choices"]


def test_llama_server_native_routes(llm: SpeculativeLlama, port: int) -> None:
    """/completion (and /completions), /tokenize, /detokenize in llama-server's shapes: the text is the
    Python API's, streamed as native events ending with stop true (no [DONE]); bad bodies get a 400.
    (test_llama_server.py compares them with llama-server's own answers.)"""
    prompt = prompts()[2]["text"]
    direct = llm.create_completion(prompt, max_tokens=24, **GREEDY)["choices"][0]["text"]
    for path in ("/completion", "/completions"):
        status, out = request(port, "POST", path, {"prompt": prompt, "n_predict": 24, **GREEDY})
        assert status == 200 and out["content"] == direct and out["stop"] is True, out
        assert out["tokens_predicted"] == 24 and out["timings"]["predicted_n"] == 24
    ids = llm.tokenize(prompt.encode())
    assert request(port, "POST", "/completion", {"prompt": ids, "n_predict": 24, **GREEDY})[1]["content"] == direct
    status, payload = request(
        port, "POST", "/completion", {"prompt": prompt, "n_predict": 24, "stream": True, **GREEDY}
    )
    parts = [json.loads(p[len(b"data: ") :]) for p in payload.split(b"\n\n") if p]
    assert "".join(p["content"] for p in parts) == direct
    assert parts[-1]["stop"] is True and not any(p["stop"] for p in parts[:-1])

    assert request(port, "POST", "/tokenize", {"content": prompt}) == (200, {"tokens": ids})
    status, pieces = request(port, "POST", "/tokenize", {"content": "def f(x):", "with_pieces": True})
    assert "".join(p["piece"] for p in pieces["tokens"]) == "def f(x):"
    assert request(port, "POST", "/detokenize", {"tokens": ids}) == (200, {"content": prompt})
    for path, bad, message in (
        ("/completion", {"n_predict": 4}, "prompt"),
        ("/completion", {"prompt": [1.5]}, "prompt"),
        ("/completion", {"prompt": "x", "n_predict": "many"}, "n_predict"),
        ("/tokenize", {"content": 5}, "content"),
        ("/detokenize", {"tokens": [10**9]}, "tokens"),
    ):
        status, out = request(port, "POST", path, bad)
        assert status == 400 and message in out["error"]["message"], (path, bad, out)


def test_bad_requests_get_a_400_and_the_server_keeps_serving(llm: SpeculativeLlama, port: int) -> None:
    long_chat = [{"role": "user", "content": "x " * 600}]  # longer than n_ctx = 512
    cases = [
        ("POST", "/v1/completions", None, b"{not json", "bad request"),
        ("POST", "/v1/completions", {"max_tokens": 4}, None, "'prompt' is required"),
        ("POST", "/v1/completions", {"prompt": "x", "max_tokens": "many"}, None, "max_tokens"),
        ("POST", "/v1/completions", {"prompt": "x", "n": 2}, None, "n = 1"),
        ("POST", "/v1/completions", {"prompt": "x", "logit_bias": {"a": 1}}, None, "logit_bias"),
        ("POST", "/v1/completions", {"prompt": "x", "stream": True, "grammar": "root ::= nope"}, None, "grammar"),
        ("POST", "/v1/chat/completions", {"messages": long_chat, "stream": True}, None, "context"),
        ("POST", "/v1/chat/completions", {"messages": CHAT, "mirostat": 3}, None, "mirostat_mode"),
        ("POST", "/v1/completions", {"prompt": "x", "suffix": "y"}, None, "suffix"),
    ]
    for method, path, body, raw, message in cases:
        status, out = request(port, method, path, body, raw)
        assert status == 400, (body, out)
        assert out["error"]["type"] == "invalid_request_error" and message in out["error"]["message"], out
    assert request(port, "GET", "/v2/nothing")[0] == 404
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=60)  # answered at once, not after a timeout
    conn.request("POST", "/v1/completions", body=b"{}", headers={"Content-Length": "-1"})
    resp = conn.getresponse()
    assert resp.status == 400 and "Content-Length" in json.loads(resp.read())["error"]["message"]
    conn.close()
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=60)  # a browser's CORS preflight
    conn.request("OPTIONS", "/v1/chat/completions")
    resp = conn.getresponse()
    assert resp.status == 204 and resp.getheader("Access-Control-Allow-Origin") == "*"
    assert "POST" in resp.getheader("Access-Control-Allow-Methods", "")
    conn.close()
    assert request(port, "POST", "/v1/embeddings", {"input": "x"})[0] == 404
    direct = llm.create_completion("x = 1", max_tokens=8, **GREEDY)["choices"]
    assert (
        request(port, "POST", "/v1/completions", {"prompt": "x = 1", "max_tokens": 8, **GREEDY})[1]["choices"] == direct
    )


def test_requests_take_turns_and_a_client_may_leave_mid_stream(llm: SpeculativeLlama, port: int) -> None:
    texts = {
        i: llm.create_completion(prompts()[i]["text"], max_tokens=32, **GREEDY)["choices"][0]["text"] for i in (2, 3, 4)
    }
    # a client reads one event of a long stream and leaves: its generation ends, the next requests are served
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
    body = {"prompt": prompts()[1]["text"], "max_tokens": 400, "stream": True, **GREEDY}
    conn.request("POST", "/v1/completions", body=json.dumps(body))
    resp = conn.getresponse()
    assert resp.status == 200 and resp.fp.readline().startswith(b"data: ")
    resp.close()
    conn.close()
    deadline = time.monotonic() + 60
    while llm._lock.locked() and time.monotonic() < deadline:  # the abandoned generation is still under way
        time.sleep(0.01)
    assert llm.stats.completion_tokens < 200, llm.stats  # it stopped at a failed write, not at max_tokens
    # concurrent requests wait for each other and each gets its own answer
    got: dict[int, str] = {}

    def ask(i: int) -> None:
        got[i] = request(port, "POST", "/v1/completions", {"prompt": prompts()[i]["text"], "max_tokens": 32, **GREEDY})[
            1
        ]["choices"][0]["text"]

    threads = [threading.Thread(target=ask, args=(i,)) for i in texts]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert got == texts


def test_a_query_does_not_change_the_route(llm: SpeculativeLlama, port: int) -> None:
    """Routes are paths: a query (Claude Code's /v1/messages?beta=true) leaves the route and its answer as
    they are."""
    body = {"max_tokens": 6, "messages": [{"role": "user", "content": "x = 1"}], **GREEDY}
    plain, queried = (request(port, "POST", path, body) for path in ("/v1/messages", "/v1/messages?beta=true"))
    assert plain[0] == queried[0] == 200 and plain[1]["content"] == queried[1]["content"]
    assert request(port, "GET", "/health?probe=1") == (200, {"status": "ok"})


def test_a_failure_mid_stream_is_told_in_the_stream(llm: SpeculativeLlama) -> None:
    """Once a stream's 200 is sent, an error can only be an event: the chunks before it all arrive."""

    class FailsAfterThreeChunks:  # the real model, whose stream breaks down after three chunks
        def __getattr__(self, name: str) -> Any:
            return getattr(llm, name)

        def create_completion(self, *args: Any, **kw: Any) -> Iterator[dict[str, Any]]:
            chunks = llm.create_completion(*args, **kw)
            for i, chunk in enumerate(chunks):
                if i == 3:
                    chunks.close()
                    raise RuntimeError("the disk is on fire")
                yield chunk

    with serving(FailsAfterThreeChunks(), "tiny") as port:  # type: ignore[arg-type]
        body = {"prompt": prompts()[2]["text"], "max_tokens": 40, "stream": True, **GREEDY}
        status, payload = request(port, "POST", "/v1/completions", body)
        *chunks, failure = events(payload)
        assert status == 200 and len(chunks) == 3 and "the disk is on fire" in failure["error"]["message"]
        # named "error", as the openai and anthropic SDKs take an error event
        assert failure["type"] == "error" and b"\nevent: error\ndata: " in payload
        direct = llm.create_completion(prompts()[2]["text"], max_tokens=40, **GREEDY)["choices"][0]["text"]
        assert direct.startswith("".join(c["choices"][0]["text"] for c in chunks))


def test_an_api_key_guards_every_route_but_health(llm: SpeculativeLlama) -> None:
    with serving(llm, "tiny", api_key="s3cret") as port:
        for path in ("/health", "/v1/health"):
            assert request(port, "GET", path)[0] == 200  # a liveness probe needs no key
        body = {"prompt": "x = 1", "max_tokens": 4, **GREEDY}
        for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": "s3cret"}, {"X-Api-Key": "wrong"}):
            status, out = request(port, "POST", "/v1/completions", body, headers=headers)
            assert status == 401 and "API key" in out["error"]["message"], (headers, out)
        for path in ("/v1/models", "/props"):
            assert request(port, "GET", path, headers={"Authorization": "Bearer wrong"})[0] == 401, path
        for path, native in (
            ("/completion", {"prompt": "x = 1", "n_predict": 4}),
            ("/tokenize", {"content": "x"}),
            ("/detokenize", {"tokens": [5]}),
        ):
            assert request(port, "POST", path, native)[0] == 401, path
        ok = {"Authorization": "Bearer s3cret"}
        assert request(port, "GET", "/v1/models", headers=ok)[0] == 200
        # Anthropic's clients send the key as X-Api-Key
        messages = {"max_tokens": 4, "messages": [{"role": "user", "content": "x = 1"}], **GREEDY}
        assert request(port, "POST", "/v1/messages", messages)[0] == 401
        assert request(port, "POST", "/v1/messages", messages, headers={"X-Api-Key": "s3cret"})[0] == 200
        assert request(port, "GET", "/props", headers=ok)[1]["default_generation_settings"]["n_ctx"] == llm.n_ctx()
        status, out = request(port, "POST", "/v1/completions", body, headers=ok)
        assert status == 200 and out["choices"] == llm.create_completion("x = 1", max_tokens=4, **GREEDY)["choices"]


def test_cli_serves_until_interrupted(tmp_path: Path) -> None:
    vocab = tmp_path / "vocab.json"  # drafts from the first 1024 ids, in every slot
    vocab.write_text(json.dumps({"format": "dflash-draft-vocab", "n_vocab": 2048, "tokens": list(range(1024))}))
    template = tmp_path / "tagged.jinja"
    template.write_text(
        "{% for m in messages %}[{{ m.role }}] {{ m.content }}\n{% endfor %}"
        "[assistant{{ mark }}{{ enable_thinking }}{{ reasoning_effort }}] "
    )
    args = [
        sys.executable,
        "-m",
        "dflash_gguf.cli",
        "serve",
        "-m",
        str(TARGET),
        "-d",
        str(drafter_gguf("f32")),
        "-c",
        "256",
        "-t",
        str(THREADS),
        "--alias",
        "tiny-cli",
        "--cache-ram",
        "16",
        "-np",
        "2",
        "--draft-vocab",
        str(vocab),
        "--chat-template-file",
        str(template),
        "--chat-template-kwargs",
        '{"mark": "!", "enable_thinking": true}',
        "-rea",
        "off",
        "--reasoning-effort",
        "low",
        "--temp",
        "0",
        "-n",
        "6",
        "--port",
    ]
    # SIGINT at its default: a suite started in the background (CI) passes it on ignored
    proc = subprocess.Popen(
        [*args, "0"], stderr=subprocess.PIPE, text=True, preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL)
    )
    try:
        line = proc.stderr.readline()  # type: ignore[union-attr]
        found = re.search(r"http://127\.0\.0\.1:(\d+)/v1 \(2 slots; drafts from 1024 of 2048 tokens;", line)
        assert found, line
        port = int(found.group(1))
        status, models = request(port, "GET", "/v1/models")
        assert status == 200 and models["data"][0]["id"] == "tiny-cli"
        # chats in the given template, with the given kwargs (-rea and --reasoning-effort over them) under a
        # request's own
        chat = {"messages": [{"role": "user", "content": "hi"}]}
        assert request(port, "POST", "/apply-template", chat)[1]["prompt"] == "[user] hi\n[assistant!Falselow] "
        mine = {**chat, "chat_template_kwargs": {"mark": "?", "reasoning_effort": "high"}}
        assert request(port, "POST", "/apply-template", mine)[1]["prompt"] == "[user] hi\n[assistant?Falsehigh] "
        # --temp 0 -n 6: what a request does not say (greedy: the same text twice; 6 tokens), its own over them
        text = prompts()[1]["text"]
        bare = [request(port, "POST", "/v1/completions", {"prompt": text})[1] for _ in range(2)]
        assert (
            bare[0]["choices"][0]["text"] == bare[1]["choices"][0]["text"]
            and bare[0]["usage"]["completion_tokens"] == 6
        )
        assert (
            request(port, "POST", "/v1/completions", {"prompt": text, "max_tokens": 3})[1]["usage"]["completion_tokens"]
            == 3
        )
        assert request(port, "POST", "/completion", {"prompt": text})[1]["tokens_predicted"] == 6
        params = request(port, "GET", "/props")[1]["default_generation_settings"]["params"]
        assert (params["temperature"], params["n_predict"], params["top_k"]) == (0.0, 6, 40)  # top_k: not given
        assert request(port, "GET", "/props")[1]["chat_template"] == template.read_text()

        # with --cache-ram a conversation that comes back starts from its saved context: same answer
        def ask(prompt: str) -> str:
            out = request(port, "POST", "/v1/completions", {"prompt": prompt, "max_tokens": 24, **GREEDY})[1]
            return str(out["choices"][0]["text"])

        first = ask(prompts()[0]["text"])
        assert ask(prompts()[1]["text"]) != first
        again = request(port, "POST", "/v1/completions", {"prompt": prompts()[0]["text"], "max_tokens": 24, **GREEDY})[
            1
        ]
        assert again["choices"][0]["text"] == first
        assert again["timings"]["prompt_n"] == 1  # the rest of the prompt came from the cache
        # a port that is taken: a one-line error naming why, exit 2
        taken = subprocess.run([*args, found.group(1)], capture_output=True, text=True, timeout=120)
        assert taken.returncode == 2 and taken.stderr.startswith("dflash: error:") and "in use" in taken.stderr
        proc.send_signal(signal.SIGINT)
        assert proc.wait(30) == 0
    finally:
        if proc.poll() is None:
            proc.kill()


def test_connections_are_kept_alive(port: int) -> None:
    """HTTP/1.1: answers carry their length and one connection serves request after request (a stream
    closes its own at its end)."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
    for _ in range(3):
        conn.request(
            "POST",
            "/v1/completions",
            body=json.dumps({"prompt": "x = ", "max_tokens": 3, **GREEDY}),
            headers={"Content-Type": "application/json"},
        )
        resp = conn.getresponse()
        assert resp.version == 11 and resp.status == 200
        assert json.loads(resp.read())["choices"]
        assert not resp.will_close
    conn.request(
        "POST",
        "/v1/completions",
        body=json.dumps({"prompt": "x = ", "max_tokens": 3, "stream": True}),
        headers={"Content-Type": "application/json"},
    )
    resp = conn.getresponse()
    assert resp.will_close and resp.read().endswith(b"data: [DONE]\n\n")
    conn.close()


def _complete(port: int, i: int, out: dict[int, Any]) -> None:
    out[i] = request(port, "POST", "/v1/completions", {"prompt": prompts()[i]["text"], "max_tokens": 24, **GREEDY})[1]


@pytest.mark.parametrize("parallel", [1, 2])
def test_a_request_waits_only_while_every_slot_is_busy(parallel: int) -> None:
    """--parallel N: N generations at once, each in a slot with a context of its own on the one model."""
    with SpeculativeLlama(str(TARGET), str(drafter_gguf("f32")), n_ctx=512, n_threads=THREADS, n_max=3) as llm:
        want = llm.create_completion(prompts()[5]["text"], max_tokens=24, **GREEDY)["choices"][0]["text"]
        server = make_server(llm, port=0, parallel=parallel)
        assert len(server.slots) == parallel and all(s.n_max == 3 and s.n_ctx() == 512 for s in server.slots)
        with running(server) as port:
            got: dict[int, Any] = {}
            with server.slot() as (busy, _):  # a generation under way in one slot (the first: llm)
                asker = threading.Thread(target=_complete, args=(port, 5, got))
                asker.start()
                asker.join(30 if parallel > 1 else 1)
                assert (5 in got) == (parallel > 1)  # served by the other slot, or waiting for this one
            asker.join(60)
            assert busy is llm and got[5]["choices"][0]["text"] == want
        assert parallel == 1 or server.slots[1]._spec.closed  # the server's own slots go with it, llm stays
        assert not llm._spec.closed


def test_slots_share_the_saved_contexts_and_serve_concurrent_requests() -> None:
    from llama_cpp import LlamaRAMCache

    with SpeculativeLlama(str(TARGET), str(drafter_gguf("f32")), n_ctx=512, n_threads=THREADS, n_max=3) as llm:
        want = {
            i: llm.create_completion(prompts()[i]["text"], max_tokens=24, **GREEDY)["choices"][0]["text"]
            for i in range(6)
        }
        llm.set_cache(LlamaRAMCache(capacity_bytes=64 << 20))
        server = make_server(llm, port=0, parallel=2)
        with running(server) as port:
            assert request(port, "GET", "/props")[1]["total_slots"] == 2
            got: dict[int, Any] = {}
            _complete(port, 0, got)  # in the first slot, which saves its context to the cache
            with server.slot() as (busy, _):  # that slot busy: the same prompt again goes to the other one
                assert busy is llm
                _complete(port, 0, got)
            assert got[0]["choices"][0]["text"] == want[0]
            assert got[0]["timings"]["prompt_n"] == 1  # the other slot's context came from the shared cache
            threads = [threading.Thread(target=_complete, args=(port, i, got)) for i in range(6)]
            for t in threads:
                t.start()
            for t in threads:
                t.join(120)
            assert {i: r["choices"][0]["text"] for i, r in got.items()} == want


def test_a_conversation_comes_back_to_the_slot_that_holds_it() -> None:
    """Two conversations taking turns on two slots: each turn goes to the slot whose context holds most of its
    prompt (llama-server's slot choice by prompt similarity), not to the one freed last, so its prefix is
    reused, chat and completion alike."""
    with SpeculativeLlama(str(TARGET), str(drafter_gguf("f32")), n_ctx=512, n_threads=THREADS, n_max=3) as llm:
        server = make_server(llm, port=0, parallel=2)
        with running(server) as port:

            def chat(messages: list[dict[str, str]]) -> dict[str, Any]:
                body = {"messages": messages, "max_tokens": 8, **GREEDY}
                return request(port, "POST", "/v1/chat/completions", body)[1]

            first = [{"role": "user", "content": prompts()[0]["text"]}]
            chat(first)  # into the slot freed last: llm
            # llm busy (freed before its answer was sent): the other conversation goes to the other slot
            with server.slot():
                text = prompts()[1]["text"]
                other = request(port, "POST", "/v1/completions", {"prompt": text, "max_tokens": 8, **GREEDY})[1]
            # the other slot is now the one freed last; the first conversation's next turn still goes to llm
            turn = chat([*first, {"role": "assistant", "content": "ok"}, {"role": "user", "content": "and?"}])
            assert turn["timings"]["cache_n"] > 20, turn["timings"]
            again = request(
                port,
                "POST",
                "/v1/completions",
                {"prompt": text + other["choices"][0]["text"], "max_tokens": 8, **GREEDY},
            )[1]
            assert again["timings"]["cache_n"] > 20, again["timings"]


def test_a_slot_is_free_before_its_answer_is_sent() -> None:
    """As in llama-server, a generation's slot is freed before the last bytes of its answer are sent, streamed
    or not: a client's next request (a conversation's next turn) finds the slot that holds its prefix free,
    rather than racing the handler for it and landing, with a cold context, in another slot."""
    from dflash_gguf.server.routes import Handler

    with SpeculativeLlama(str(TARGET), str(drafter_gguf("f32")), n_ctx=512, n_threads=THREADS, n_max=3) as llm:
        server = make_server(llm, port=0, parallel=2)
        free_at_write: list[bool] = []  # per write of an answer: was the serving slot (llm) free then

        class Watched(Handler):
            def _send_json(self, status: Any, obj: Any) -> None:
                free_at_write.append(llm in server._free)
                super()._send_json(status, obj)

            def _event(self, obj: Any) -> None:
                free_at_write.append(llm in server._free)
                super()._event(obj)

        server.RequestHandlerClass = Watched
        text = prompts()[0]["text"]
        with running(server) as port:
            for path, body in [
                ("/v1/completions", {"prompt": text}),
                ("/v1/completions", {"prompt": text, "stream": True}),
                ("/v1/chat/completions", {"messages": CHAT, "stream": True}),
                ("/completion", {"prompt": text, "stream": True}),
            ]:
                free_at_write.clear()
                status, _ = request(port, "POST", path, {**body, "max_tokens": 4, **GREEDY})
                assert status == 200 and free_at_write[-1], (path, free_at_write)
                if body.get("stream"):  # busy while it streams
                    assert not free_at_write[0], (path, free_at_write)
                # with no prompt to match, the slot freed last: the one that served
                with server.slot() as (free, _):
                    assert free is llm, path


def test_metrics_count_every_generation_of_every_slot() -> None:
    """GET /metrics (--metrics): llama-server's counters, each the sum of what the generations of both slots
    did (a list of prompts is two generations), the two rate gauges over the time since the previous scrape,
    the requests in a slot and waiting for one; a 501 without --metrics."""
    from tinycode import scrape_metrics

    with SpeculativeLlama(
        str(TARGET), str(drafter_gguf("f32")), n_ctx=512, n_batch=8, n_threads=THREADS, n_max=3
    ) as llm:
        with running(make_server(llm, port=0)) as port:
            assert request(port, "GET", "/metrics")[0] == 501
            assert request(port, "GET", "/props")[1]["endpoint_metrics"] is False
        server = make_server(llm, port=0, parallel=2, metrics=True)
        seen: list[Any] = []  # every generation's statistics, beside the server's own count of them
        by_slot: list[SpeculativeLlama] = []
        for s in server.slots:
            count = s.on_generation
            s.on_generation = lambda stats, count=count, s=s: (seen.append(stats), by_slot.append(s), count(stats))
        with running(server) as port:
            base = f"http://127.0.0.1:{port}"
            assert request(port, "GET", "/props")[1]["endpoint_metrics"] is True
            idle, types, headers = scrape_metrics(base)
            assert headers["Content-Type"] == "text/plain; version=0.0.4"
            assert abs(int(headers["Process-Start-Time-Unix"]) - time.time()) < 600
            assert idle["llamacpp:tokens_predicted_total"] == 0 and types["llamacpp:n_decode_total"] == "counter"
            texts = [p["text"] for p in prompts()[:3]]

            def usage(prompt: Any) -> dict[str, Any]:
                return request(port, "POST", "/v1/completions", {"prompt": prompt, "max_tokens": 16, **GREEDY})[1][
                    "usage"
                ]

            usages = [usage(texts[:2])]  # in the slot freed last, llm
            with server.slot() as (busy, _):  # llm busy: the other slot's generations
                usages += [usage(texts[2]), usage(texts[2])]  # the second's prefix comes from the context
            got, _, _ = scrape_metrics(base)
            assert busy is llm and by_slot == [llm, llm, server.slots[1], server.slots[1]]
            m = {k.removeprefix("llamacpp:"): v for k, v in got.items()}
            assert m["tokens_predicted_total"] == sum(u["completion_tokens"] for u in usages)
            assert m["prompt_tokens_cached_total"] == sum(u["prompt_tokens_details"]["cached_tokens"] for u in usages)
            assert m["prompt_tokens_total"] + m["prompt_tokens_cached_total"] == sum(u["prompt_tokens"] for u in usages)
            assert m["prompt_tokens_cached_total"] > 0
            # each prefill decodes its new tokens 8 (n_batch) at a time, each step verifies once
            assert all(s.target_decodes == -(-(s.prompt_tokens - s.reused_prompt_tokens) // 8) + s.steps for s in seen)
            assert m["n_decode_total"] == sum(s.target_decodes for s in seen)
            assert m["spec_decode_num_draft_tokens_total"] == sum(s.drafted for s in seen)
            assert m["spec_decode_num_accepted_tokens_total"] == sum(s.accepted for s in seen) > 0
            assert m["spec_decode_num_drafts_total"] == sum(s.steps - s.plain_steps for s in seen)
            per_position = [m[f'spec_decode_num_accepted_tokens_per_pos_total{{position="{i}"}}'] for i in range(3)]
            assert sum(per_position) == m["spec_decode_num_accepted_tokens_total"]
            assert per_position == sorted(per_position, reverse=True)  # a draft is accepted up to a position
            assert m["n_tokens_max"] == max(s.prompt_tokens + s.generated_tokens - 1 for s in seen)  # what was decoded
            assert m["prompt_seconds_total"] == pytest.approx(sum(s.prefill_ms for s in seen) / 1e3)
            assert m["prompt_tokens_seconds"] > 0 and m["predicted_tokens_seconds"] > 0
            assert m["requests_processing"] == m["requests_deferred"] == 0
            again, _, _ = scrape_metrics(base)  # no generation since: the rates' window is empty
            assert again["llamacpp:predicted_tokens_seconds"] == again["llamacpp:prompt_tokens_seconds"] == 0
            assert again["llamacpp:tokens_predicted_total"] == m["tokens_predicted_total"]

            with server.slot(), server.slot():  # both slots busy: a request waits
                assert scrape_metrics(base)[0]["llamacpp:requests_processing"] == 2
                asker = threading.Thread(target=_complete, args=(port, 5, {}))
                asker.start()
                deadline = time.monotonic() + 30
                while scrape_metrics(base)[0]["llamacpp:requests_deferred"] != 1:
                    assert time.monotonic() < deadline
                    time.sleep(0.05)
            asker.join(60)
            after = scrape_metrics(base)[0]
            assert after["llamacpp:requests_deferred"] == after["llamacpp:requests_processing"] == 0
            assert len(seen) == 5
    assert llm.on_generation is None  # the server's count leaves the caller's object as it found it


def test_slots_say_which_slot_is_busy_and_what_each_holds() -> None:
    """GET /slots (llama-server's, on by default): per slot its context size, whether it generates, its latest
    generation's number and, once free, the tokens its context holds; `?fail_on_no_slot=1` is a 503 while
    every slot is busy; with slots=False (--no-slots) a 501."""
    with SpeculativeLlama(str(TARGET), str(drafter_gguf("f32")), n_ctx=512, n_threads=THREADS, n_max=3) as llm:
        server = make_server(llm, port=0, parallel=2)
        with running(server) as port:
            idle = {"n_ctx": 512, "speculative": True, "is_processing": False}
            assert request(port, "GET", "/slots") == (200, [{"id": 0, **idle}, {"id": 1, **idle}])
            text = prompts()[0]["text"]
            out = request(port, "POST", "/v1/completions", {"prompt": text, "max_tokens": 8, **GREEDY})[1]
            again = request(port, "POST", "/v1/completions", {"prompt": text, "max_tokens": 8, **GREEDY})[1]
            first, second = request(port, "GET", "/slots")[1]
            assert second == {"id": 1, **idle}  # the prompt came back to the slot that held it
            assert again["timings"]["cache_n"] == out["usage"]["prompt_tokens"] - 1
            # what was decoded: the prompt and every generated token but the last
            held = again["usage"]["total_tokens"] - 1
            assert (
                first == {"id": 0, **idle, "id_task": 1, "n_prompt_tokens": held}
                and len(llm._spec.cached_tokens) == held
            )
            assert request(port, "GET", "/slots?fail_on_no_slot=1")[0] == 200
            with server.slot(), server.slot():
                status, body = request(port, "GET", "/slots?fail_on_no_slot=1")
                assert status == 503 and body["error"]["type"] == "unavailable_error"
                busy = request(port, "GET", "/slots")[1]
                assert busy == [{"id": i, **idle, "is_processing": True, "id_task": 2 + i} for i in range(2)]
        with running(make_server(llm, port=0, slots=False)) as port:
            assert request(port, "GET", "/slots")[0] == 501
            assert request(port, "GET", "/props")[1]["endpoint_slots"] is False


def test_a_streamed_thinking_is_ended_on_request() -> None:
    """POST /v1/chat/completions/control {"id", "action": "reasoning_end"} (llama-server's) during a chat
    streamed with reasoning_control: the thinking ends (the budget's message, then the answer), the stream
    goes on; an id no generation has, or a completion made without reasoning_control, says so."""
    from test_reasoning_budget import THINKING_TEMPLATE

    chat = {
        "messages": [{"role": "user", "content": "import os"}],
        "max_tokens": 2000,  # the model never ends a thinking itself: long enough to be under way
        "temperature": 0.0,
        "stream": True,
        "reasoning_budget_message": " ok",
    }
    with (
        SpeculativeLlama(str(TARGET), str(drafter_gguf("f32")), n_ctx=4096, chat_template=THINKING_TEMPLATE) as llm,
        serving(llm) as port,
    ):
        control = {"id": "chatcmpl-none", "action": "reasoning_end"}
        assert request(port, "POST", "/v1/chat/completions/control", control) == (
            200,
            {"success": False, "message": "no active completion for this id"},
        )
        for armed in (True, False):
            conn = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
            body = json.dumps({**chat, "reasoning_control": armed})
            conn.request("POST", "/v1/chat/completions", body=body, headers={"Content-Type": "application/json"})
            stream = conn.getresponse()
            joined, answer = {"reasoning_content": "", "content": ""}, None
            for line in stream:
                if not line.startswith(b"data: {"):
                    continue
                chunk = json.loads(line[len(b"data: ") :])
                for key in joined:
                    joined[key] += (chunk["choices"] or [{}])[0].get("delta", {}).get(key) or ""
                if answer is None and joined["reasoning_content"]:
                    _, answer = request(port, "POST", "/v1/chat/completions/control", {**control, "id": chunk["id"]})
            conn.close()
            if armed:
                assert answer == {"success": True}
                assert joined["reasoning_content"].endswith(" ok") and joined["content"], joined
            else:
                assert answer == {"success": False, "message": "reasoning control not enabled for this completion"}
                assert not joined["content"], joined
        for bad in ({"action": "reasoning_end"}, {"id": "x", "action": "stop"}):
            assert request(port, "POST", "/v1/chat/completions/control", bad)[0] == 400


def test_slots_are_saved_restored_and_erased(tmp_path: Path) -> None:
    """POST /slots/{id}?action=save|restore|erase (llama-server's, with --slot-save-path): a slot's context
    saved to a file comes back after an erase (the next request reuses it and answers as before); bad
    requests are refused by name; without a directory the route is off."""
    prompt = {"prompt": prompts()[0]["text"], "max_tokens": 16, **GREEDY}
    with SpeculativeLlama(str(TARGET), str(drafter_gguf("f32")), n_ctx=1024, n_threads=THREADS) as llm:
        with serving(llm) as port:
            assert request(port, "POST", "/slots/0?action=save", {"filename": "a"})[0] == 501
        with serving(llm, slot_save_path=str(tmp_path)) as port:
            first = request(port, "POST", "/v1/completions", prompt)[1]
            held = first["usage"]["prompt_tokens"] + 15  # the prompt and the tokens decoded after it
            status, saved = request(port, "POST", "/slots/0?action=save", {"filename": "chat.bin"})
            assert status == 200 and (saved["id_slot"], saved["filename"], saved["n_saved"]) == (0, "chat.bin", held)
            assert saved["n_written"] == (tmp_path / "chat.bin").stat().st_size and "save_ms" in saved["timings"]
            assert request(port, "POST", "/slots/0?action=erase")[1] == {"id_slot": 0, "n_erased": held}
            cold = request(port, "POST", "/v1/completions", prompt)[1]
            assert cold["timings"]["cache_n"] == 0  # erased: the prompt decoded again
            request(port, "POST", "/slots/0?action=erase")
            status, restored = request(port, "POST", "/slots/0?action=restore", {"filename": "chat.bin"})
            assert status == 200 and (restored["n_restored"], restored["n_read"]) == (held, saved["n_written"])
            again = request(port, "POST", "/v1/completions", prompt)[1]
            assert again["timings"]["cache_n"] == first["usage"]["prompt_tokens"] - 1  # the restored context
            assert again["choices"][0]["text"] == first["choices"][0]["text"]
            (tmp_path / "junk.bin").write_bytes(b"not a slot")
            for path, body, why in (
                ("/slots/0?action=save", {"filename": "../escape"}, "Invalid filename"),
                ("/slots/7?action=save", {"filename": "a"}, "Invalid slot ID"),
                ("/slots/0?action=load", {"filename": "a"}, "Invalid action"),
                ("/slots/0?action=restore", {"filename": "missing.bin"}, "Unable to restore slot: missing.bin"),
                ("/slots/0?action=restore", {"filename": "junk.bin"}, "not a slot file"),
            ):
                status, answer = request(port, "POST", path, body)
                assert status == 400 and why in answer["error"]["message"], (path, answer)
            assert not (tmp_path.parent / "escape").exists()
            # the server goes on serving, the slot usable
            assert (
                request(port, "POST", "/v1/completions", prompt)[1]["choices"][0]["text"] == first["choices"][0]["text"]
            )
