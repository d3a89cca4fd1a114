"""Ordered, bounded parallel map: numpy releases the GIL, so chunks convert on all cores."""

from __future__ import annotations

import os
from collections import deque
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from typing import TypeVar

A = TypeVar("A")
R = TypeVar("R")


def default_workers() -> int:
    env = os.environ.get("DFLASH_CONVERT_THREADS")
    if env and env.isdigit() and int(env) > 0:
        return int(env)
    # one core is left to the thread that reads and writes files; with 2 cores or
    # fewer, threads only add contention (measured), so work serially
    cpus = os.cpu_count() or 1
    return 0 if cpus <= 2 else min(8, cpus - 1)


def ordered_map(fn: Callable[[A], R], items: Iterable[A], workers: int | None = None) -> Iterator[R]:
    """Yield fn(item) in input order, computing at most ``2 * workers`` items ahead.

    ``workers=0`` runs serially in the calling thread; otherwise the calling
    thread only consumes (e.g. writes) while the workers compute.
    """
    n = workers if workers is not None else default_workers()
    if n <= 0:
        for item in items:
            yield fn(item)
        return
    window = 2 * n
    with ThreadPoolExecutor(max_workers=n, thread_name_prefix="dflash-convert") as pool:
        pending: deque[Future[R]] = deque()
        try:
            for item in items:
                pending.append(pool.submit(fn, item))
                if len(pending) >= window:
                    yield pending.popleft().result()
            while pending:
                yield pending.popleft().result()
        finally:
            for fut in pending:
                fut.cancel()
