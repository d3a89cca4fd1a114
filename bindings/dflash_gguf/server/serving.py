"""The server object: a threading HTTP server holding the model and its settings, and `serving` for
embedding one in an application or a test."""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from http.server import ThreadingHTTPServer
from pathlib import Path
from typing import Any

import llama_cpp

from ..speculative import SpeculativeLlama
from .lora import adapter_list, listed_scales
from .metrics import ServerMetrics
from .routes import Handler


class DFlashServer(ThreadingHTTPServer):
    """What every request's handler reads (`self.server`): the model, its name, the key, the chat default,
    the slots generations take and the metrics of what they did."""

    daemon_threads = True

    def __init__(
        self,
        address: tuple[str, int],
        llm: SpeculativeLlama,
        model_name: str,
        api_key: str | None,
        reasoning_format: str,
        parallel: int = 1,
        metrics: bool = False,
        slots_route: bool = True,
        chat_template_kwargs: dict[str, Any] | None = None,
        sampling: dict[str, Any] | None = None,
        reasoning_budget: int = -1,
        reasoning_budget_message: str | None = None,
        lora_init_without_apply: bool = False,
        slot_save_path: str | None = None,
    ) -> None:
        if isinstance(parallel, bool) or not isinstance(parallel, int) or parallel < 1:
            raise ValueError(f"parallel must be an int >= 1, got {parallel!r}")
        self.llm = llm
        self.model_name = model_name
        self.api_key = api_key
        self.reasoning_format = reasoning_format
        self.chat_template_kwargs = dict(chat_template_kwargs or {})  # under each request's
        self.sampling = dict(sampling or {})  # create_* arguments under each request's
        # every chat's reasoning budget, unless its request gives one
        self.reasoning_budget: dict[str, Any] = {"reasoning_budget_tokens": reasoning_budget}
        if reasoning_budget_message:
            self.reasoning_budget["reasoning_budget_message"] = reasoning_budget_message
        # the target's LoRA adapters at the scales generations use unless their request gives its own
        # (POST /lora-adapters sets them; llama-server's --lora-init-without-apply: all 0 at first)
        self.lora = adapter_list(llm)
        for adapter in self.lora if lora_init_without_apply else ():
            adapter["scale"] = 0.0
        self.slot_save_path = None if slot_save_path is None else Path(slot_save_path)  # POST /slots/{id}'s files
        self.created = int(time.time())
        self.slots = [llm]
        self._callers_hook = llm.on_generation  # server_close gives it back, from a failed bind too
        super().__init__(address, Handler)  # binds first: a port in use costs no slot a context
        try:
            # one decoder per slot, all on llm's weights; a generation takes a free one or waits for one
            self.slots += [llm.share_weights(n_max=llm.n_max) for _ in range(parallel - 1)]
        except BaseException:
            self.server_close()
            raise
        if parallel > 1 and llm.cache is not None:
            shared = _LockedCache(llm.cache)  # llama_cpp's caches are not safe to use from several threads
            for s in self.slots:
                s.cache = shared
        self._free = list(reversed(self.slots))  # the slot freed last at the end
        self._freed = threading.Condition()
        self._waiting = 0  # requests waiting for a free slot
        self._tasks = 0  # generations given a slot so far
        self._task_of: dict[int, int] = {}  # id(slot) -> its latest generation's number
        self.slots_route = slots_route
        # counted whether or not /metrics is served (llama-server's --metrics only opens the route)
        self.metrics_route = metrics
        self.metrics = ServerMetrics(llm._spec.n_max)  # the longest draft, "auto"'s included
        for s in self.slots:
            s.on_generation = self.metrics.add

    def generating(self, completion_id: str) -> SpeculativeLlama | None:
        """The slot generating the chat completion of this id, if any."""
        with self._freed:
            return next((s for s in self.slots if s not in self._free and s.completion_id == completion_id), None)

    def lora_scales(self, body: Any) -> list[float]:
        """The adapters' scales a request's generation uses: its `lora` list's, else the server's."""
        entries = body.get("lora") if isinstance(body, dict) else None
        if entries is None or entries == []:
            return [a["scale"] for a in self.lora]
        return listed_scales(entries, len(self.lora))

    def metrics_text(self) -> str:
        """/metrics' text: the counters, and the requests in a slot and waiting for one now."""
        with self._freed:
            processing, waiting = len(self.slots) - len(self._free), self._waiting
        return self.metrics.render(processing, waiting)

    def slots_json(self) -> list[dict[str, Any]]:
        """llama-server's GET /slots: each slot's context size, whether it generates now, the number of its
        latest generation and, while free, the tokens its context holds (what a conversation coming back to
        it reuses). Nothing is read from a busy slot, whose thread is changing it."""
        out = []
        with self._freed:  # no slot is taken meanwhile
            for i, s in enumerate(self.slots):
                busy = s not in self._free
                slot: dict[str, Any] = {"id": i, "n_ctx": s.n_ctx(), "speculative": True, "is_processing": busy}
                if id(s) in self._task_of:
                    slot["id_task"] = self._task_of[id(s)]
                    if not busy:
                        slot["n_prompt_tokens"] = len(s._spec.cached_tokens)
                out.append(slot)
        return out

    @contextlib.contextmanager
    def slot(self, prompt: Sequence[int] | None = None) -> Iterator[tuple[SpeculativeLlama, Callable[[], None]]]:
        """A free decoder for one generation and the call that frees it (at the latest on leaving), waiting
        for one when every slot is busy: the one whose context holds the longest prefix of `prompt`
        (llama-server's choice by prompt similarity), so that conversations that take turns each come back to
        their own; among equals, the one freed last."""
        held = llama_cpp.Llama.longest_token_prefix

        def pick() -> SpeculativeLlama | None:
            if not self._free:
                return None
            return max(reversed(self._free), key=lambda s: held(s._spec.cached_tokens, prompt) if prompt else 0)

        with self._taken(pick) as (llm, release):
            with self._freed:
                self._task_of[id(llm)] = self._tasks
                self._tasks += 1
            yield llm, release

    @contextlib.contextmanager
    def slot_at(self, i: int) -> Iterator[SpeculativeLlama]:
        """Slot `i`, once free (after the generation it may be running), for what is done to it by id."""
        with self._taken(lambda: self.slots[i] if self.slots[i] in self._free else None) as (llm, _):
            yield llm

    @contextlib.contextmanager
    def _taken(
        self, pick: Callable[[], SpeculativeLlama | None]
    ) -> Iterator[tuple[SpeculativeLlama, Callable[[], None]]]:
        """The free slot `pick` chooses (waiting until it chooses one) and the call that frees it (at the
        latest on leaving). Every waiter is woken by a freed slot: each wants its own kind of slot."""
        with self._freed:
            self._waiting += 1
            while (llm := pick()) is None:
                self._freed.wait()
            self._waiting -= 1
            self._free.remove(llm)
        freed = False

        def release() -> None:
            nonlocal freed
            if not freed:
                freed = True
                with self._freed:
                    self._free.append(llm)
                    self._freed.notify_all()

        try:
            yield llm, release
        finally:
            release()

    def server_close(self) -> None:
        super().server_close()
        self.llm.on_generation = self._callers_hook  # llm is the caller's
        for s in self.slots[1:]:
            s.close()


class _LockedCache:
    """A cache of saved contexts (llama_cpp.LlamaRAMCache) used by several slots' threads, one call at a time."""

    def __init__(self, cache: Any) -> None:
        self.cache = cache
        self._lock = threading.Lock()

    def __getitem__(self, key: Sequence[int]) -> Any:
        with self._lock:
            return self.cache[key]

    def __setitem__(self, key: Sequence[int], value: Any) -> None:
        with self._lock:
            self.cache[key] = value


def make_server(
    llm: SpeculativeLlama,
    host: str = "127.0.0.1",
    port: int = 8080,
    model_name: str = "dflash",
    api_key: str | None = None,
    reasoning_format: str = "deepseek",
    parallel: int = 1,
    metrics: bool = False,
    slots: bool = True,
    chat_template_kwargs: dict[str, Any] | None = None,
    sampling: dict[str, Any] | None = None,
    reasoning_budget: int = -1,
    reasoning_budget_message: str | None = None,
    lora_init_without_apply: bool = False,
    slot_save_path: str | None = None,
) -> DFlashServer:
    """A server for `llm` (not started: call serve_forever(), shutdown() from another thread). With an
    `api_key`, every route but /health needs `Authorization: Bearer <api_key>` (llama-server's --api-key).
    `reasoning_format`: chats' default (llama-server's --reasoning-format; "deepseek": a reasoning model's
    thinking in `reasoning_content`). `parallel`: generations served at once (llama-server's --parallel),
    each in a slot of its own: a decoder on llm's weights (`share_weights`) with its own context; llm's
    cache, if set, is shared by them all. `metrics`: serve GET /metrics (llama-server's --metrics), the
    generations' counters in Prometheus' text format. `slots`: serve GET /slots (llama-server's default; its
    --no-slots turns it off). `chat_template_kwargs`: every chat's, under a request's own (llama-server's
    --chat-template-kwargs). `sampling`: create_* arguments (temperature, top_k, ..., max_tokens) every
    generation takes unless its request names them (llama-server's --temp, ..., -n). `reasoning_budget`,
    `reasoning_budget_message`: every chat's reasoning budget unless its request gives one (llama-server's
    --reasoning-budget, --reasoning-budget-message; -1: none). `lora_init_without_apply`: the target's LoRA
    adapters at scale 0 until POST /lora-adapters or a request's `lora` sets one (llama-server's).
    `slot_save_path`: a directory POST /slots/{id}?action=save|restore writes slot files to and reads them
    from (llama-server's --slot-save-path)."""
    return DFlashServer(
        (host, port),
        llm,
        model_name,
        api_key,
        reasoning_format,
        parallel,
        metrics,
        slots,
        chat_template_kwargs,
        sampling,
        reasoning_budget,
        reasoning_budget_message,
        lora_init_without_apply,
        slot_save_path,
    )


@contextlib.contextmanager
def serving(
    llm: SpeculativeLlama,
    model_name: str = "dflash",
    api_key: str | None = None,
    host: str = "127.0.0.1",
    port: int = 0,
    **options: Any,
) -> Iterator[int]:
    """make_server served from a daemon thread for the `with` block (an app that embeds the server, a
    test): yields the port (port 0: any free one), shuts the server down after. `options`: make_server's
    others (reasoning_format, parallel, metrics, ...)."""
    with running(make_server(llm, host, port, model_name, api_key, **options)) as bound:
        yield bound


@contextlib.contextmanager
def running(server: DFlashServer) -> Iterator[int]:
    """A server made by make_server, served from a daemon thread for the `with` block: yields its port,
    shuts it down and closes it after (its own slots too)."""
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        yield server.server_address[1]
    finally:
        server.shutdown()
        server.server_close()
