"""The server object: a threading HTTP server holding the model and its settings, and `serving` for
embedding one in an application or a test."""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Iterator
from http.server import ThreadingHTTPServer

from ..speculative import SpeculativeLlama
from .routes import Handler


class DFlashServer(ThreadingHTTPServer):
    """What every request's handler reads (`self.server`): the model, its name, the key, the chat default,
    and the lock that makes generations take turns."""

    daemon_threads = True

    def __init__(
        self,
        address: tuple[str, int],
        llm: SpeculativeLlama,
        model_name: str,
        api_key: str | None,
        reasoning_format: str,
    ) -> None:
        self.llm = llm
        self.model_name = model_name
        self.api_key = api_key
        self.reasoning_format = reasoning_format
        self.turn = threading.Lock()  # one generation at a time; the others wait
        self.created = int(time.time())
        super().__init__(address, Handler)


def make_server(
    llm: SpeculativeLlama,
    host: str = "127.0.0.1",
    port: int = 8080,
    model_name: str = "dflash",
    api_key: str | None = None,
    reasoning_format: str = "deepseek",
) -> DFlashServer:
    """A server for `llm` (not started: call serve_forever(), shutdown() from another thread). With an
    `api_key`, every route but /health needs `Authorization: Bearer <api_key>` (llama-server's --api-key).
    `reasoning_format`: chats' default (llama-server's --reasoning-format; "deepseek": a reasoning model's
    thinking in `reasoning_content`)."""
    return DFlashServer((host, port), llm, model_name, api_key, reasoning_format)


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
