"""The HTTP plumbing every route shares: JSON answers, CORS, and a generation answered whole or as
server-sent events (errors before the first byte become a status, after it an event in the stream)."""

from __future__ import annotations

import itertools
import json
from collections.abc import Callable, Iterator
from http import HTTPStatus
from http.server import BaseHTTPRequestHandler
from typing import Any

from .._core import DFlashError
from .responses import error_body


class JSONEventHandler(BaseHTTPRequestHandler):
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

    def _generate(
        self,
        start: Callable[[], Any],
        stream: bool,
        n_before_prefill: int,
        reply: Callable[[dict[str, Any]], dict[str, Any]],
        last: Callable[[dict[str, Any]], list[dict[str, Any]]],
        done: bool,
        release: Callable[[], None],
    ) -> None:
        """start() -> a result, or a stream of chunks of which `last` makes the final events; `reply`
        makes the response of a result; `done`: a stream ends with OpenAI's [DONE]. `release` frees the
        generation's slot once the generation is over and its answer made, before the answer's last bytes
        are sent (as llama-server does): a client's next request, a conversation's next turn, then finds
        the slot that holds its prefix free."""
        try:
            # settings errors raise here; a stream's prefill (a grammar that does not parse, a prompt
            # longer than the context) in its first chunks: both before any byte is sent
            result = start()
            first = list(itertools.islice(result, n_before_prefill)) if stream else []
        except (ValueError, TypeError, DFlashError) as e:
            self._send_json(HTTPStatus.BAD_REQUEST, error_body(HTTPStatus.BAD_REQUEST, str(e)))
            return
        except Exception as e:  # noqa: BLE001 (the server outlives the request)
            self._send_json(
                HTTPStatus.INTERNAL_SERVER_ERROR,
                error_body(HTTPStatus.INTERNAL_SERVER_ERROR, f"{type(e).__name__}: {e}"),
            )
            return
        if not stream:
            answer = reply(result)
            release()
            self._send_json(HTTPStatus.OK, answer)
            return
        self._send_events(first, result, last, done, release)

    def _send_events(
        self,
        first: list[dict[str, Any]],
        rest: Iterator[dict[str, Any]],
        last: Callable[[dict[str, Any]], list[dict[str, Any]]],
        done: bool,
        release: Callable[[], None],
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
                end = [] if held is None else [held]
                # an event of type "error" (Anthropic's shape), which both OpenAI's and Anthropic's SDKs raise
                failure = error_body(HTTPStatus.INTERNAL_SERVER_ERROR, f"{type(e).__name__}: {e}")
                end.append({"type": "error", **failure})
            else:
                end = last(held) if held is not None else []
            release()  # the generation is over (its stream exhausted): only sending is left
            for event in end:
                self._event(event)
            if done:
                self.wfile.write(b"data: [DONE]\n\n")
        except (BrokenPipeError, ConnectionResetError):
            pass  # the client left: closing the generator below ends the generation
        finally:
            rest.close()  # type: ignore[attr-defined]

    def _event(self, obj: Any) -> None:
        # an event that says its type (the Responses and Messages APIs') is named by it in the stream too, as
        # OpenAI's, Anthropic's and llama-server's streams name them
        kind = obj.get("type") if isinstance(obj, dict) else None
        name = f"event: {kind}\n".encode() if isinstance(kind, str) else b""
        self.wfile.write(name + b"data: " + json.dumps(obj).encode() + b"\n\n")
        self.wfile.flush()
