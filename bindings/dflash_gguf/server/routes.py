"""The HTTP routes: a handler object per request, reading the served model and settings from its server."""

from __future__ import annotations

import hmac
import json
from collections.abc import Callable, Iterator
from http import HTTPStatus
from typing import TYPE_CHECKING, Any

from ..speculative import SpeculativeLlama
from .openai_responses import chat_body, response_events, response_object
from .requests import FIELDS, NATIVE, request_kwargs
from .responses import (
    detokenize_response,
    error_body,
    native_response,
    openai_last_events,
    props_response,
    timings,
    tokenize_response,
)
from .streaming import JSONEventHandler

if TYPE_CHECKING:
    from .serving import DFlashServer


class Handler(JSONEventHandler):
    """The routes: OpenAI's (the Responses API's too), llama-server's native ones, /health, /props and /v1/models; the model and settings are
    the server's (serving.DFlashServer)."""

    server: DFlashServer

    def _authorized(self) -> bool:
        given = self.headers.get("Authorization", "")
        if (
            self.server.api_key is None
            or self.path in ("/health", "/v1/health")
            or hmac.compare_digest(given.encode(), f"Bearer {self.server.api_key}".encode())
        ):
            return True
        self._send_json(
            HTTPStatus.UNAUTHORIZED,
            error_body(HTTPStatus.UNAUTHORIZED, "invalid or missing API key (Authorization: Bearer ...)"),
        )
        return False

    def do_GET(self) -> None:
        if not self._authorized():
            return
        if self.path in ("/health", "/v1/health"):
            self._send_json(HTTPStatus.OK, {"status": "ok"})
        elif self.path == "/props":
            server = self.server
            props = props_response(server.llm, server.model_name, len(server.slots), server.reasoning_format)
            self._send_json(HTTPStatus.OK, props)
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

    def do_POST(self) -> None:
        if not self._authorized():
            return
        llm, model_name = self.server.llm, self.server.model_name
        tokens = {"/tokenize": tokenize_response, "/detokenize": detokenize_response}.get(self.path)
        responses = self.path in ("/v1/responses", "/responses")  # OpenAI's Responses API: a chat in other words
        if self.path not in FIELDS and self.path not in NATIVE and tokens is None and not responses:
            self._send_json(HTTPStatus.NOT_FOUND, error_body(HTTPStatus.NOT_FOUND, f"no route POST {self.path}"))
            return
        try:
            length = int(self.headers.get("Content-Length", "0"))
            body = json.loads(self.rfile.read(length) or b"null")
            route = "/v1/chat/completions" if responses else self.path
            if responses:
                body = chat_body(body)
            kw = request_kwargs(route, body, self.server.reasoning_format) if route in FIELDS else {}
            if tokens is not None:  # no generation: no slot to wait for
                self._send_json(HTTPStatus.OK, tokens(llm, body))
                return
            if self.path == "/apply-template":
                self._send_json(HTTPStatus.OK, {"prompt": llm.apply_chat_template(**kw)})
                return
        except (ValueError, json.JSONDecodeError) as e:  # BadRequest is a ValueError
            self._send_json(HTTPStatus.BAD_REQUEST, error_body(HTTPStatus.BAD_REQUEST, f"bad request: {e}"))
            return
        with self.server.slot(self._prompt_tokens(llm, route, kw)) as (llm, release):
            if self.path in NATIVE:
                self._native(llm, release, body, NATIVE[self.path])
                return
            if responses:
                self._responses(llm, release, kw)
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

    def _prompt_tokens(self, llm: SpeculativeLlama, route: str, kw: dict[str, Any]) -> list[int] | None:
        """The tokens an OpenAI route's generation will start from, for the server to pick the slot that holds
        most of them; None with one slot, or where only the generation can tell (llama-server's native
        routes, a list of prompts, a request the generation will refuse)."""
        if len(self.server.slots) == 1 or route not in FIELDS:
            return None
        try:
            if route == "/v1/chat/completions":
                text = llm.apply_chat_template(kw["messages"], kw.get("tools"), kw.get("chat_template_kwargs"))
            else:
                text = kw.get("prompt")
            if isinstance(text, str):
                return llm.tokenize(text, special=True)
        except Exception:  # noqa: BLE001 - the generation reports what is wrong with the request
            pass
        return None

    def _responses(self, llm: SpeculativeLlama, release: Callable[[], None], kw: dict[str, Any]) -> None:
        """OpenAI's Responses API: the chat of `kw` answered as a response object or its stream of events."""
        model_name = self.server.model_name
        stream = bool(kw.get("stream"))

        def start() -> Any:
            out = llm.create_chat_completion(**kw, model=model_name)
            return response_events(out, model_name, lambda: llm.last_usage) if stream else out

        self._generate(
            start,
            stream,
            1,  # response.created: the prompt is decoded
            lambda out: {**response_object(out), "timings": timings(llm.stats)},
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
            release=release,
        )
