"""The HTTP routes: a handler object per request, reading the served model and settings from its server."""

from __future__ import annotations

import hmac
import json
import time
from collections.abc import Callable, Iterator
from http import HTTPStatus
from typing import TYPE_CHECKING, Any, NamedTuple
from urllib.parse import parse_qs, urlsplit

from .. import DFlashError
from ..llama_compat import LogprobCursor
from ..speculative import SpeculativeLlama
from . import anthropic_messages, openai_responses
from .lora import listed_scales
from .requests import FIELDS, NATIVE, BadRequest, request_kwargs
from .responses import (
    detokenize_response,
    error_body,
    native_probs,
    native_response,
    openai_last_events,
    props_response,
    timings,
    tokenize_response,
)
from .slot_files import read_slot, valid_filename, write_slot
from .streaming import JSONEventHandler

if TYPE_CHECKING:
    from .serving import DFlashServer


class _Dialect(NamedTuple):
    """An API whose request is a chat in other words: its body as a chat's, the chat's result as its answer,
    the chat's stream as its events (given the model's name and the slot, whose counts they read); `stop()`
    is the request's stop string that ended the reply, if one did."""

    chat_body: Callable[[Any], dict[str, Any]]
    answer: Callable[[dict[str, Any], str | None], dict[str, Any]]
    events: Callable[
        [Iterator[dict[str, Any]], str, SpeculativeLlama, Callable[[], str | None]], Iterator[dict[str, Any]]
    ]


_RESPONSES = _Dialect(
    openai_responses.chat_body,
    lambda chat, stop: openai_responses.response_object(chat),
    lambda chunks, model, llm, stop: openai_responses.response_events(chunks, model, lambda: llm.last_usage),
)
DIALECTS = {
    "/v1/responses": _RESPONSES,  # OpenAI's Responses API
    "/responses": _RESPONSES,
    "/v1/messages": _Dialect(  # Anthropic's Messages API; its message_start needs the prompt's counts
        anthropic_messages.chat_body,
        anthropic_messages.message_object,
        lambda chunks, model, llm, stop: anthropic_messages.message_events(
            chunks, model, lambda: prompt_counts(llm), lambda: llm.last_usage, stop
        ),
    ),
}


def prompt_counts(llm: SpeculativeLlama) -> tuple[int, int]:
    """The prompt tokens of the generation under way and those of them reused, once its prompt is decoded."""
    stats = llm._spec.stats
    return stats["prompt_tokens"], stats["reused_tokens"]


def chat_prompt_tokens(llm: SpeculativeLlama, kw: dict[str, Any]) -> list[int]:
    """The tokens a chat of create_chat_completion's arguments `kw` starts from."""
    return llm.tokenize(
        llm.apply_chat_template(kw["messages"], kw.get("tools"), kw.get("chat_template_kwargs")), special=True
    )


class Handler(JSONEventHandler):
    """The routes: OpenAI's (Responses API included), Anthropic's Messages API, llama-server's native ones,
    /health, /props and /v1/models; the model and settings are the server's (serving.DFlashServer)."""

    server: DFlashServer

    def parse_request(self) -> bool:
        ok = super().parse_request()
        # a route is a path: a query does not change it (the anthropic SDK's beta calls add ?beta=true)
        url = urlsplit(self.path)
        self.path, self._query = url.path, url.query
        return ok

    def _authorized(self) -> bool:
        key = self.server.api_key
        if key is None or self.path in ("/health", "/v1/health"):
            return True
        # OpenAI's clients send the key as a bearer token, Anthropic's as X-Api-Key (llama-server takes both)
        bearer = self.headers.get("Authorization", "").encode()
        if hmac.compare_digest(bearer, f"Bearer {key}".encode()) or hmac.compare_digest(
            self.headers.get("X-Api-Key", "").encode(), key.encode()
        ):
            return True
        self._send_json(
            HTTPStatus.UNAUTHORIZED,
            error_body(HTTPStatus.UNAUTHORIZED, "invalid or missing API key (Authorization: Bearer ... or X-Api-Key)"),
        )
        return False

    def do_GET(self) -> None:
        if not self._authorized():
            return
        if self.path in ("/health", "/v1/health"):
            self._send_json(HTTPStatus.OK, {"status": "ok"})
        elif self.path == "/props":
            server = self.server
            props = props_response(
                server.llm,
                server.model_name,
                len(server.slots),
                server.reasoning_format,
                server.metrics_route,
                server.slots_route,
                server.sampling,
            )
            self._send_json(HTTPStatus.OK, props)
        elif self.path == "/metrics":
            self._metrics()
        elif self.path == "/slots":
            self._slots()
        elif self.path == "/lora-adapters":
            self._send_json(HTTPStatus.OK, self.server.lora)
        elif self.path == "/v1/models":
            self._send_json(
                HTTPStatus.OK,
                {
                    "object": "list",
                    "data": [
                        {
                            "id": self.server.model_name,
                            "object": "model",
                            "created": self.server.created,
                            "owned_by": "dflash-gguf",
                        }
                    ],
                },
            )
        else:
            self._send_json(HTTPStatus.NOT_FOUND, error_body(HTTPStatus.NOT_FOUND, f"no route GET {self.path}"))

    def _turned_off(self, on: bool, route: str) -> bool:
        """A route the server was started without answers 501, as llama-server's."""
        if not on:
            message = f"This server does not support {route} endpoint. Start it with `--{route}`"
            self._send_json(HTTPStatus.NOT_IMPLEMENTED, error_body(HTTPStatus.NOT_IMPLEMENTED, message))
        return not on

    def _slots(self) -> None:
        if self._turned_off(self.server.slots_route, "slots"):
            return
        slots = self.server.slots_json()
        # a load balancer's question (llama-server's): is any slot free now?
        if "fail_on_no_slot" in parse_qs(self._query) and all(s["is_processing"] for s in slots):
            unavailable = HTTPStatus.SERVICE_UNAVAILABLE
            self._send_json(unavailable, error_body(unavailable, "no slot available"))
            return
        self._send_json(HTTPStatus.OK, slots)

    def _metrics(self) -> None:
        if self._turned_off(self.server.metrics_route, "metrics"):
            return
        data = self.server.metrics_text().encode()
        self.send_response(HTTPStatus.OK)
        self.send_header("Content-Type", "text/plain; version=0.0.4")  # Prometheus' text format
        self.send_header("Content-Length", str(len(data)))
        self.send_header("Process-Start-Time-Unix", str(int(self.server.metrics.started)))
        self.end_headers()
        self.wfile.write(data)

    def do_POST(self) -> None:
        if not self._authorized():
            return
        llm, model_name = self.server.llm, self.server.model_name
        tokens = {"/tokenize": tokenize_response, "/detokenize": detokenize_response}.get(self.path)
        dialect = DIALECTS.get(self.path)
        count = self.path == "/v1/messages/count_tokens"  # Anthropic's: the prompt's tokens
        if self.path == "/lora-adapters":
            self._set_lora()
            return
        if self.path == "/v1/chat/completions/control":
            self._control()
            return
        if self.path.startswith("/slots/"):
            self._slot_action(self.path[len("/slots/") :])
            return
        if self.path not in FIELDS and self.path not in NATIVE and tokens is None and dialect is None and not count:
            self._send_json(HTTPStatus.NOT_FOUND, error_body(HTTPStatus.NOT_FOUND, f"no route POST {self.path}"))
            return
        try:
            body = self._json_body()
            lora = self.server.lora_scales(body)
            route = "/v1/chat/completions" if dialect is not None or count else self.path
            if dialect is not None:
                body = dialect.chat_body(body)
            elif count:
                body = anthropic_messages.chat_body(body, need_max_tokens=False)
            server = self.server
            kw = (
                request_kwargs(
                    route, body, server.reasoning_format, server.chat_template_kwargs, server.reasoning_budget
                )
                if route in FIELDS
                else {}
            )
            # no generation: no slot to wait for
            if tokens is not None:
                self._send_json(HTTPStatus.OK, tokens(llm, body))
                return
            if count:
                self._send_json(HTTPStatus.OK, {"input_tokens": len(chat_prompt_tokens(llm, kw))})
                return
            if self.path == "/apply-template":
                self._send_json(HTTPStatus.OK, {"prompt": llm.apply_chat_template(**kw)})
                return
        except (ValueError, json.JSONDecodeError) as e:  # BadRequest is a ValueError
            self._send_json(HTTPStatus.BAD_REQUEST, error_body(HTTPStatus.BAD_REQUEST, f"bad request: {e}"))
            return
        kw = {**self.server.sampling, **kw}  # the server's sampling defaults under the request's
        with self.server.slot(self._prompt_tokens(llm, route, kw)) as (llm, release):
            llm.set_lora_scales(lora)
            if self.path in NATIVE:
                self._native(llm, release, body, NATIVE[self.path])
                return
            if dialect is not None:
                self._dialect(llm, release, kw, dialect)
                return
            # OpenAI's stream_options.include_usage: one more chunk, without choices, with the usage
            options = body.get("stream_options")
            usage = isinstance(options, dict) and bool(options.get("include_usage"))
            method = getattr(llm, FIELDS[self.path][0])
            # a chat stream's first chunk (the role) comes before the prefill, a completion's after it
            n_before_prefill = 2 if self.path == "/v1/chat/completions" else 1
            self._generate(
                lambda: method(**kw, model=model_name),
                bool(kw.get("stream")),
                n_before_prefill,
                lambda out: {**out, "timings": timings(llm.stats)},
                lambda held: openai_last_events(held, llm.stats, llm.last_usage if usage else None),
                done=True,
                release=release,
            )

    def _json_body(self) -> Any:
        length = int(self.headers.get("Content-Length", "0"))
        if length < 0:  # read(-1) would wait for the client to close its side
            raise BadRequest(f"Content-Length must be >= 0, got {length}")
        return json.loads(self.rfile.read(length) or b"null")

    def _control(self) -> None:
        """llama-server's control of a chat completion under way: {"id", "action": "reasoning_end"} ends the
        thinking of one made with reasoning_control (or a reasoning budget)."""
        try:
            body = self._json_body()
            if not isinstance(body, dict) or not body.get("id"):
                raise BadRequest("missing completion id")
            if body.get("action") != "reasoning_end":
                raise BadRequest("unknown control action")
        except (ValueError, json.JSONDecodeError) as e:
            self._send_json(HTTPStatus.BAD_REQUEST, error_body(HTTPStatus.BAD_REQUEST, str(e)))
            return
        llm = self.server.generating(body["id"])
        if llm is None:
            answer = {"success": False, "message": "no active completion for this id"}
        elif not llm.end_reasoning():
            answer = {"success": False, "message": "reasoning control not enabled for this completion"}
        else:
            answer = {"success": True}
        self._send_json(HTTPStatus.OK, answer)

    def _slot_action(self, id_slot: str) -> None:
        """llama-server's POST /slots/{id}?action=save|restore|erase: a slot's context to a file of the
        --slot-save-path directory, back from one, or forgotten (each once the slot is free)."""
        server = self.server
        if server.slot_save_path is None:
            message = "This server does not support slots action. Start it with `--slot-save-path`"
            self._send_json(HTTPStatus.NOT_IMPLEMENTED, error_body(HTTPStatus.NOT_IMPLEMENTED, message))
            return
        action = parse_qs(self._query).get("action", [""])[0]
        try:
            body = self._json_body() if action in ("save", "restore") else None
            if not id_slot.isdigit() or int(id_slot) >= len(server.slots):
                raise BadRequest("Invalid slot ID")
            if action not in ("save", "restore", "erase"):
                raise BadRequest("Invalid action")
            filename = body.get("filename") if isinstance(body, dict) else None
            if action != "erase" and not valid_filename(filename):
                raise BadRequest("Invalid filename")
            i = int(id_slot)
            t0 = time.perf_counter()
            with server.slot_at(i) as llm:
                if action == "save":
                    state = llm.save_state()
                    written = write_slot(server.slot_save_path / filename, state)
                    answer = {"id_slot": i, "filename": filename, "n_saved": state.n_tokens, "n_written": written}
                    answer["timings"] = {"save_ms": (time.perf_counter() - t0) * 1e3}
                elif action == "restore":
                    try:
                        state, read = read_slot(server.slot_save_path / filename)
                        llm.load_state(state)
                    except (ValueError, DFlashError) as e:
                        raise BadRequest(f"Unable to restore slot: {e}") from None
                    answer = {"id_slot": i, "filename": filename, "n_restored": state.n_tokens, "n_read": read}
                    answer["timings"] = {"restore_ms": (time.perf_counter() - t0) * 1e3}
                else:
                    answer = {"id_slot": i, "n_erased": len(llm._spec.cached_tokens)}
                    llm.reset()
        except (ValueError, json.JSONDecodeError) as e:
            self._send_json(HTTPStatus.BAD_REQUEST, error_body(HTTPStatus.BAD_REQUEST, str(e)))
            return
        except OSError:  # the directory is not writable, full, ...
            self._send_json(
                HTTPStatus.INTERNAL_SERVER_ERROR, error_body(HTTPStatus.INTERNAL_SERVER_ERROR, "Unable to save slot")
            )
            return
        self._send_json(HTTPStatus.OK, answer)

    def _set_lora(self) -> None:
        """POST /lora-adapters: the scales generations use from now on (llama-server's)."""
        try:
            body = self._json_body()
            if not isinstance(body, list):
                raise BadRequest("Request body must be an array")
            scales = listed_scales(body, len(self.server.lora))
        except (ValueError, json.JSONDecodeError) as e:
            self._send_json(HTTPStatus.BAD_REQUEST, error_body(HTTPStatus.BAD_REQUEST, f"bad request: {e}"))
            return
        for adapter, scale in zip(self.server.lora, scales):
            adapter["scale"] = scale
        self._send_json(HTTPStatus.OK, {"success": True})

    def _prompt_tokens(self, llm: SpeculativeLlama, route: str, kw: dict[str, Any]) -> list[int] | None:
        """The tokens an OpenAI route's generation will start from, for the server to pick the slot that holds
        most of them; None with one slot, or where only the generation can tell (llama-server's native
        routes, a list of prompts, a request the generation will refuse)."""
        if len(self.server.slots) == 1 or route not in FIELDS:
            return None
        try:
            if route == "/v1/chat/completions":
                return chat_prompt_tokens(llm, kw)
            if isinstance(kw.get("prompt"), str):
                return llm.tokenize(kw["prompt"], special=True)
        except Exception:  # noqa: BLE001 - the generation reports what is wrong with the request
            pass
        return None

    def _dialect(
        self, llm: SpeculativeLlama, release: Callable[[], None], kw: dict[str, Any], dialect: _Dialect
    ) -> None:
        """The chat of `kw` answered in another API's shapes, whole or as its stream of events."""
        model_name = self.server.model_name
        stream = bool(kw.get("stream"))
        stops = [kw["stop"]] if isinstance(kw.get("stop"), str) else list(kw.get("stop") or [])

        def stop() -> str | None:
            word = llm.stopping_word  # or a stop string of the chat template's: the end of the turn
            return word if word and word in stops else None

        def start() -> Any:
            out = llm.create_chat_completion(**kw, model=model_name)
            return dialect.events(out, model_name, llm, stop) if stream else out

        self._generate(
            start,
            stream,
            1,  # the stream's first event comes once the prompt is decoded
            lambda out: {**dialect.answer(out, stop()), "timings": timings(llm.stats)},
            lambda held: [{**held, "timings": timings(llm.stats)}],
            done=False,
            release=release,
        )

    def _native(
        self,
        llm: SpeculativeLlama,
        release: Callable[[], None],
        body: Any,
        make_request: Callable[[SpeculativeLlama, Any], Any],
    ) -> None:
        """llama-server's /completion or /infill, answered in its native shape (no [DONE] after a stream)."""
        model_name = self.server.model_name
        stream = isinstance(body, dict) and bool(body.get("stream"))
        prompt: list[str] = []  # the prompt as text, once made
        # n_probs: the generated tokens' probabilities, handed out with the text they bring
        cursor = LogprobCursor(llm._completion_tokens, llm._token_logprobs, llm._spec.token_to_piece, 0)
        released = 0

        def probs(text: str, last: bool, earlier: list[dict[str, Any]] | None = None) -> list[dict[str, Any]] | None:
            """The probabilities of the tokens that bring `text` (after `earlier`'s), the last: and the end of
            text the target sampled."""
            nonlocal released
            if not isinstance(body, dict) or not body.get("n_probs"):
                return None
            released += len(text)
            taken = cursor.take(released, llm._end_token if last else None)
            return (earlier or []) + native_probs(taken, llm._spec.token_to_piece)

        def start() -> Any:
            tokens, kw = make_request(llm, body)
            if "n_predict" not in body:  # the server's -n, else no limit
                kw["max_tokens"] = self.server.sampling.get("max_tokens")
            kw = {**self.server.sampling, **kw}
            prompt.append(llm.detokenize(tokens, special=True).decode("utf-8", "replace"))
            out = llm.create_completion(tokens, **kw, model=model_name)
            return native(out) if stream else out

        def native(chunks: Iterator[dict[str, Any]]) -> Iterator[dict[str, Any]]:
            try:
                for c in chunks:
                    text = c["choices"][0]["text"]
                    yield native_response(text, model_name, None, probs(text, False))
            finally:
                chunks.close()  # type: ignore[attr-defined]

        def final(text: str, held: dict[str, Any] | None = None) -> dict[str, Any]:
            """The last answer: the whole result, or the stream's last chunk (`held`, its tokens listed)."""
            listed = probs("", True, held.get("completion_probabilities")) if held else probs(text, True)
            return native_response(text, model_name, (prompt[0], llm), listed)

        self._generate(
            start,
            stream,
            1,
            lambda out: final(out["choices"][0]["text"]),
            lambda held: [final(held["content"], held)],
            done=False,
            release=release,
        )
