"""An OpenAI-compatible HTTP server over one SpeculativeLlama (`dflash serve`), standard library only.

/v1/completions and /v1/chat/completions take the request fields SpeculativeLlama's create_completion
and create_chat_completion take (OpenAI's, plus llama.cpp's top_k, min_p, repeat_penalty, grammar)
and return their results; `"stream": true` sends the chunks as server-sent events ending with
`data: [DONE]`. llama-server's native /completion, /infill (fill in the middle, for code editors),
/tokenize and /detokenize take its request fields and answer in its shapes. /v1/models and /health
answer at once. One generation runs at a time (requests wait their turn; the C++ loop releases the
GIL, so the server stays responsive); a client that disconnects mid-stream ends its generation. Bad
requests get a 400 with OpenAI's error shape, the server keeps serving.
"""

from __future__ import annotations

import contextlib
import hmac
import itertools
import json
import math
import threading
import time
from collections.abc import Callable, Iterator
from http import HTTPStatus
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from ._core import DFlashError
from .speculative import GenerationStats, SpeculativeLlama

# request fields passed on (anything else an OpenAI client sends, e.g. "user" or "stream_options", is
# ignored, as llama-server does)
_COMMON = {
    "max_tokens",
    "temperature",
    "top_p",
    "top_k",
    "min_p",
    "stop",
    "seed",
    "stream",
    "repeat_penalty",
    "frequency_penalty",
    "presence_penalty",
    "logit_bias",
    "logprobs",
    "grammar",
    "typical_p",
    "tfs_z",
    "mirostat_mode",
    "mirostat_tau",
    "mirostat_eta",
}
_FIELDS = {
    "/v1/completions": ("create_completion", "prompt", _COMMON | {"echo", "suffix"}),
    "/apply-template": ("apply_chat_template", "messages", {"tools", "chat_template_kwargs"}),
    "/v1/chat/completions": (
        "create_chat_completion",
        "messages",
        _COMMON
        | {
            "top_logprobs",
            "response_format",
            "tools",
            "tool_choice",
            "functions",
            "function_call",
            "reasoning_format",
            "chat_template_kwargs",
        },
    ),
}


class BadRequest(ValueError):
    pass


def request_kwargs(path: str, body: Any, reasoning_format: str = "deepseek") -> dict[str, Any]:
    """The create_* keyword arguments of a request body; BadRequest names what is wrong. A chat's
    reasoning_format is the server's unless the request names one (llama-server's rule)."""
    _, required, fields = _FIELDS[path]
    if not isinstance(body, dict):
        raise BadRequest("the request body must be a JSON object")
    if required not in body:
        raise BadRequest(f"'{required}' is required")
    if body.get("n", 1) != 1:
        raise BadRequest("only n = 1 is supported")
    kw = {k: v for k, v in body.items() if k in fields or k == required}
    # OpenAI's newer name, and llama-server's
    for theirs, ours in (("max_completion_tokens", "max_tokens"), ("mirostat", "mirostat_mode")):
        if theirs in body and ours not in body:
            kw[ours] = body[theirs]
    if path == "/v1/chat/completions":
        kw.setdefault("reasoning_format", reasoning_format)
    if path in ("/v1/chat/completions", "/apply-template"):  # llama-server's rules for the template's inputs
        kwargs = kw.get("chat_template_kwargs", {})
        if not isinstance(kwargs, dict):
            raise BadRequest("chat_template_kwargs must be a JSON object")
        thinking = body.get("reasoning_effort") != "none"  # OpenAI's "no thinking"
        kw["chat_template_kwargs"] = {"enable_thinking": thinking, **kwargs}
        if isinstance(kw.get("tools"), list):  # the template sees each tool as llama-server rebuilds it
            kw["tools"] = [template_tool(t) for t in kw["tools"]]
    bias = kw.get("logit_bias")
    if bias is not None:  # JSON object keys are strings
        try:
            kw["logit_bias"] = {int(k): float(v) for k, v in bias.items()}
        except (AttributeError, TypeError, ValueError):
            raise BadRequest("logit_bias must map token ids to numbers") from None
    return kw


def template_tool(tool: Any) -> Any:
    """A request's tool as llama-server hands it to the chat template: name, description ("" when
    absent) and parameters, in that order."""
    if not isinstance(tool, dict) or tool.get("type") != "function" or not isinstance(tool.get("function"), dict):
        raise BadRequest(f"each tool must be {{'type': 'function', 'function': {{'name': ...}}}}, got {tool!r:.80}")
    f = tool["function"]
    if not isinstance(f.get("name"), str):
        raise BadRequest(f"a tool's function needs a 'name', got {f!r:.80}")
    return {
        "type": "function",
        "function": {"name": f["name"], "description": f.get("description", ""), "parameters": f.get("parameters", {})},
    }


# llama-server's native routes (/completion, /infill: the format editor plugins such as llama.vim and
# llama.vscode speak): its field names for the sampling options create_completion takes
_NATIVE_FIELDS = {
    "temperature",
    "top_k",
    "top_p",
    "min_p",
    "typical_p",
    "seed",
    "stop",
    "repeat_penalty",
    "frequency_penalty",
    "presence_penalty",
    "mirostat",
    "mirostat_tau",
    "mirostat_eta",
    "grammar",
    "stream",
}


def native_kwargs(body: Any, required: tuple[str, ...]) -> dict[str, Any]:
    """create_completion's keyword arguments of a native request body (llama-server's names: n_predict,
    mirostat, ...); BadRequest names what is wrong."""
    if not isinstance(body, dict):
        raise BadRequest("the request body must be a JSON object")
    for name in required:
        if name not in body:
            raise BadRequest(f'"{name}" is required')
    n_predict = body.get("n_predict", -1)
    if isinstance(n_predict, bool) or not isinstance(n_predict, int):
        raise BadRequest(f'"n_predict" must be an integer (-1: until the end of the text), got {n_predict!r}')
    kw = {k: v for k, v in body.items() if k in _NATIVE_FIELDS}
    if "mirostat" in kw:
        kw["mirostat_mode"] = kw.pop("mirostat")
    kw["max_tokens"] = None if n_predict < 0 else n_predict
    return kw


def no_end_of_text(llm: SpeculativeLlama) -> dict[int, float]:
    """llama-server's ignore_eos: every end-of-generation token's logit at -inf."""
    return dict.fromkeys(llm._spec.eog_tokens, -math.inf)


def completion_request(llm: SpeculativeLlama, body: Any) -> tuple[list[int], dict[str, Any]]:
    """The prompt tokens and create_completion keyword arguments of a /completion request body: its
    `prompt` text (BOS added where the vocabulary asks, special tokens parsed, as llama-server) or ids;
    `ignore_eos` as llama-server's."""
    kw = native_kwargs(body, ("prompt",))
    if body.get("ignore_eos"):
        kw["logit_bias"] = no_end_of_text(llm)
    prompt = body["prompt"]
    if isinstance(prompt, str):
        return llm.tokenize(prompt.encode(), add_bos=True, special=True), kw
    if isinstance(prompt, list) and prompt and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
        return prompt, kw
    raise BadRequest('"prompt" must be a string or a non-empty array of token ids')


def infill_request(llm: SpeculativeLlama, body: Any) -> tuple[list[int], dict[str, Any]]:
    """The prompt tokens and create_completion keyword arguments of an /infill request body (llama-server's
    fields: input_prefix, input_suffix, input_extra, prompt, n_predict, ...)."""
    kw = native_kwargs(body, ("input_prefix", "input_suffix"))
    extra = body.get("input_extra", [])
    if not isinstance(extra, list):
        raise BadRequest('"input_extra" must be an array of {"filename": string, "text": string}')
    # llama-server's prompt layout takes ITS -n, not the request's: a server started without one has -1
    return llm.infill_tokens(body["input_prefix"], body["input_suffix"], body.get("prompt", ""), extra), kw


# llama-server's native generation routes: how each makes its prompt
_NATIVE = {"/completion": completion_request, "/completions": completion_request, "/infill": infill_request}


def tokenize_response(llm: SpeculativeLlama, body: Any) -> dict[str, Any]:
    """llama-server's /tokenize: {"tokens": ids}, or with with_pieces [{"id", "piece"}] (a piece that is
    not UTF-8 as its byte values)."""
    if not isinstance(body, dict) or not isinstance(body.get("content", ""), str):
        raise BadRequest('"content" must be a string')
    tokens = llm.tokenize(
        body.get("content", "").encode(),
        add_bos=bool(body.get("add_special", False)),
        special=bool(body.get("parse_special", True)),
    )
    if not body.get("with_pieces", False):
        return {"tokens": tokens}
    out = []
    for t in tokens:
        piece = llm.detokenize([t], special=True)
        try:
            out.append({"id": t, "piece": piece.decode("utf-8")})
        except UnicodeDecodeError:
            out.append({"id": t, "piece": list(piece)})
    return {"tokens": out}


def detokenize_response(llm: SpeculativeLlama, body: Any) -> dict[str, Any]:
    """llama-server's /detokenize: the tokens' pieces (special tokens' text included) joined."""
    tokens = body.get("tokens", []) if isinstance(body, dict) else None
    if not isinstance(tokens, list) or not all(isinstance(t, int) and 0 <= t < llm.n_vocab() for t in tokens):
        raise BadRequest(f'"tokens" must be an array of token ids below {llm.n_vocab()}')
    return {"content": b"".join(llm.detokenize([t], special=True) for t in tokens).decode("utf-8", "replace")}


def native_response(text: str, model: str, last: tuple[str, GenerationStats] | None) -> dict[str, Any]:
    """One /completion or /infill answer or stream chunk in llama-server's native shape; the last (`last`: the prompt as
    text and the generation's figures) with stop true and the figures."""
    out: dict[str, Any] = {"content": text, "stop": last is not None, "model": model}
    if last is not None:
        prompt, s = last
        out.update(
            prompt=prompt,
            tokens_predicted=s.generated_tokens,
            tokens_evaluated=s.prompt_tokens,
            tokens_cached=s.prompt_tokens + max(s.generated_tokens - 1, 0),  # what the context holds
            truncated=False,
            timings=timings(s),
        )
    return out


def timings(s: GenerationStats) -> dict[str, Any]:
    """llama-server's `timings` of a response (its names), from the generation's statistics: cache_n prompt
    tokens came from the context already (or a saved state), prompt_n were decoded; draft_n tokens drafted,
    draft_n_accepted of them accepted."""
    return {
        "cache_n": s.reused_prompt_tokens,
        "prompt_n": s.prompt_tokens - s.reused_prompt_tokens,
        "prompt_ms": s.prefill_ms,
        "predicted_n": s.generated_tokens,
        "predicted_ms": s.decode_ms,
        "predicted_per_second": s.tokens_per_second,
        "draft_n": s.drafted,
        "draft_n_accepted": s.accepted,
        "mean_accepted_length": s.mean_accepted_length,
    }


def openai_last_events(held: dict[str, Any], s: GenerationStats, usage: dict[str, Any] | None) -> list[dict[str, Any]]:
    """A stream's last chunk with the generation's timings, then (stream_options.include_usage) OpenAI's
    usage chunk with `usage`."""
    events = [{**held, "timings": timings(s)}]
    if usage is not None:
        events.append(
            {
                **{k: held[k] for k in ("id", "object", "created", "model", "system_fingerprint")},
                "choices": [],
                "usage": usage,
            }
        )
    return events


def _error(status: HTTPStatus, message: str) -> dict[str, Any]:
    kind = "invalid_request_error" if status < 500 else "server_error"
    return {"error": {"message": message, "type": kind, "param": None, "code": None}}


def make_server(
    llm: SpeculativeLlama,
    host: str = "127.0.0.1",
    port: int = 8080,
    model_name: str = "dflash",
    api_key: str | None = None,
    reasoning_format: str = "deepseek",
) -> ThreadingHTTPServer:
    """A server for `llm` (not started: call serve_forever(), shutdown() from another thread). With an
    `api_key`, every route but /health needs `Authorization: Bearer <api_key>` (llama-server's --api-key).
    `reasoning_format`: chats' default (llama-server's --reasoning-format; "deepseek": a reasoning model's
    thinking in `reasoning_content`)."""
    turn = threading.Lock()  # one generation at a time; the others wait
    created = int(time.time())

    class Handler(BaseHTTPRequestHandler):
        server_version = "dflash-gguf"
        # keep-alive: clients (the openai SDK's pool) reuse one connection; every answer but a stream has a
        # Content-Length, and a stream closes its connection at its end
        protocol_version = "HTTP/1.1"

        def log_message(self, format: str, *args: Any) -> None:
            pass  # quiet, as the rest of the CLI; errors reach the client

        def end_headers(self) -> None:
            # browser front ends on another origin (a chat UI page) may call us, as llama-server allows
            self.send_header("Access-Control-Allow-Origin", "*")
            super().end_headers()

        def _send_json(self, status: HTTPStatus, obj: Any) -> None:
            data = json.dumps(obj).encode()
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def do_OPTIONS(self) -> None:  # a browser's CORS preflight
            self.send_response(HTTPStatus.NO_CONTENT)
            self.send_header("Access-Control-Allow-Methods", "GET, POST, OPTIONS")
            self.send_header("Access-Control-Allow-Headers", "Content-Type, Authorization")
            self.end_headers()

        def _authorized(self) -> bool:
            given = self.headers.get("Authorization", "")
            if (
                api_key is None
                or self.path == "/health"
                or hmac.compare_digest(given.encode(), f"Bearer {api_key}".encode())
            ):
                return True
            self._send_json(
                HTTPStatus.UNAUTHORIZED,
                _error(HTTPStatus.UNAUTHORIZED, "invalid or missing API key (Authorization: Bearer ...)"),
            )
            return False

        def do_GET(self) -> None:
            if not self._authorized():
                return
            if self.path == "/health":
                self._send_json(HTTPStatus.OK, {"status": "ok"})
            elif self.path == "/v1/models":
                self._send_json(
                    HTTPStatus.OK,
                    {
                        "object": "list",
                        "data": [{"id": model_name, "object": "model", "created": created, "owned_by": "dflash-gguf"}],
                    },
                )
            else:
                self._send_json(HTTPStatus.NOT_FOUND, _error(HTTPStatus.NOT_FOUND, f"no route GET {self.path}"))

        def do_POST(self) -> None:
            if not self._authorized():
                return
            tokens = {"/tokenize": tokenize_response, "/detokenize": detokenize_response}.get(self.path)
            if self.path not in _FIELDS and self.path not in _NATIVE and tokens is None:
                self._send_json(HTTPStatus.NOT_FOUND, _error(HTTPStatus.NOT_FOUND, f"no route POST {self.path}"))
                return
            try:
                length = int(self.headers.get("Content-Length", "0"))
                body = json.loads(self.rfile.read(length) or b"null")
                kw = request_kwargs(self.path, body, reasoning_format) if self.path in _FIELDS else {}
                if tokens is not None:  # no generation: no turn to wait for
                    self._send_json(HTTPStatus.OK, tokens(llm, body))
                    return
                if self.path == "/apply-template":
                    self._send_json(HTTPStatus.OK, {"prompt": llm.apply_chat_template(**kw)})
                    return
            except (ValueError, json.JSONDecodeError) as e:  # BadRequest is a ValueError
                self._send_json(HTTPStatus.BAD_REQUEST, _error(HTTPStatus.BAD_REQUEST, f"bad request: {e}"))
                return
            with turn:
                if self.path in _NATIVE:
                    self._native(body, _NATIVE[self.path])
                    return
                # OpenAI's stream_options.include_usage: one more chunk, without choices, with the usage
                options = body.get("stream_options")
                usage = isinstance(options, dict) and bool(options.get("include_usage"))
                method = getattr(llm, _FIELDS[self.path][0])
                # a chat stream's first chunk (the role) comes before the prefill, a completion's after it
                n_before_prefill = 2 if self.path == "/v1/chat/completions" else 1
                self._generate(
                    lambda: method(**kw, model=model_name),
                    bool(kw.get("stream")),
                    n_before_prefill,
                    lambda out: {**out, "timings": timings(llm.stats)},
                    lambda held: openai_last_events(held, llm.stats, llm.last_usage if usage else None),
                    done=True,
                )

        def _native(self, body: Any, make_request: Callable[[SpeculativeLlama, Any], Any]) -> None:
            """llama-server's /completion or /infill, answered in its native shape (no [DONE] after a stream)."""
            stream = isinstance(body, dict) and bool(body.get("stream"))
            prompt: list[str] = []  # the prompt as text, once made

            def start() -> Any:
                tokens, kw = make_request(llm, body)
                prompt.append(llm.detokenize(tokens, special=True).decode("utf-8", "replace"))
                out = llm.create_completion(tokens, **kw, model=model_name)
                return native(out) if stream else out

            def native(chunks: Iterator[dict[str, Any]]) -> Iterator[dict[str, Any]]:
                try:
                    for c in chunks:
                        yield native_response(c["choices"][0]["text"], model_name, None)
                finally:
                    chunks.close()  # type: ignore[attr-defined]

            self._generate(
                start,
                stream,
                1,
                lambda out: native_response(out["choices"][0]["text"], model_name, (prompt[0], llm.stats)),
                lambda held: [native_response(held["content"], model_name, (prompt[0], llm.stats))],
                done=False,
            )

        def _generate(
            self,
            start: Callable[[], Any],
            stream: bool,
            n_before_prefill: int,
            reply: Callable[[dict[str, Any]], dict[str, Any]],
            last: Callable[[dict[str, Any]], list[dict[str, Any]]],
            done: bool,
        ) -> None:
            """start() -> a result, or a stream of chunks of which `last` makes the final events; `reply`
            makes the response of a result; `done`: a stream ends with OpenAI's [DONE]."""
            try:
                # settings errors raise here; a stream's prefill (a grammar that does not parse, a prompt
                # longer than the context) in its first chunks: both before any byte is sent
                result = start()
                first = list(itertools.islice(result, n_before_prefill)) if stream else []
            except (ValueError, TypeError, DFlashError) as e:
                self._send_json(HTTPStatus.BAD_REQUEST, _error(HTTPStatus.BAD_REQUEST, str(e)))
                return
            except Exception as e:  # noqa: BLE001 (the server outlives the request)
                self._send_json(
                    HTTPStatus.INTERNAL_SERVER_ERROR,
                    _error(HTTPStatus.INTERNAL_SERVER_ERROR, f"{type(e).__name__}: {e}"),
                )
                return
            if not stream:
                self._send_json(HTTPStatus.OK, reply(result))
                return
            self._send_events(first, result, last, done)

        def _send_events(
            self,
            first: list[dict[str, Any]],
            rest: Iterator[dict[str, Any]],
            last: Callable[[dict[str, Any]], list[dict[str, Any]]],
            done: bool,
        ) -> None:
            self.send_response(HTTPStatus.OK)
            self.send_header("Content-Type", "text/event-stream")
            self.send_header("Cache-Control", "no-cache")
            self.send_header("Connection", "close")  # the stream ends when the connection closes
            self.close_connection = True
            self.end_headers()
            held: dict[str, Any] | None = None  # each chunk goes out when the next exists: the last gets timings
            try:
                try:
                    for chunk in itertools.chain(first, rest):
                        if held is not None:
                            self._event(held)
                        held = chunk
                except (BrokenPipeError, ConnectionResetError):
                    raise
                except Exception as e:  # noqa: BLE001 (mid-stream: the status is sent; say it in the stream)
                    if held is not None:
                        self._event(held)
                    self._event(_error(HTTPStatus.INTERNAL_SERVER_ERROR, f"{type(e).__name__}: {e}"))
                else:
                    for event in last(held) if held is not None else []:
                        self._event(event)
                if done:
                    self.wfile.write(b"data: [DONE]\n\n")
            except (BrokenPipeError, ConnectionResetError):
                pass  # the client left: closing the generator below ends the generation
            finally:
                rest.close()  # type: ignore[attr-defined]

        def _event(self, obj: Any) -> None:
            self.wfile.write(b"data: " + json.dumps(obj).encode() + b"\n\n")
            self.wfile.flush()

    server = ThreadingHTTPServer((host, port), Handler)
    server.daemon_threads = True
    return server


@contextlib.contextmanager
def serving(
    llm: SpeculativeLlama,
    model_name: str = "dflash",
    api_key: str | None = None,
    host: str = "127.0.0.1",
    port: int = 0,
    reasoning_format: str = "deepseek",
) -> Iterator[int]:
    """make_server served from a daemon thread for the `with` block (an app that embeds the server, a
    test): yields the port (port 0: any free one), shuts the server down after."""
    server = make_server(llm, host, port, model_name, api_key, reasoning_format)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        yield server.server_address[1]
    finally:
        server.shutdown()
        server.server_close()
