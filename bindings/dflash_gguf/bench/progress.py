"""Progress of a bench run: a live bar in a terminal, one line per prompt run elsewhere."""

from __future__ import annotations

import sys
from typing import Any


class _NoBar:
    def update(self, n: int = 1) -> None: ...
    def set_description(self, s: str) -> None: ...
    def close(self) -> None: ...


class _LineProgress:
    """Outside a terminal (CI, a log file): a line when the warm-up or a prompt run starts, and one at the end,
    instead of a bar whose every redraw would land in the log."""

    def __init__(self, total: int) -> None:
        self.total, self.done = total, 0

    def update(self, n: int = 1) -> None:
        self.done += n

    def set_description(self, s: str) -> None:
        print(f"[bench] {s}: {self.done}/{self.total} runs done", file=sys.stderr, flush=True)

    def close(self) -> None:
        print(f"[bench] {self.done}/{self.total} runs done", file=sys.stderr, flush=True)


def progress_bar(total: int, enabled: bool) -> Any:
    if not enabled:
        return _NoBar()
    if not sys.stderr.isatty():
        return _LineProgress(total)
    try:
        from tqdm import tqdm
    except ImportError:
        return _NoBar()
    return tqdm(total=total, unit="run", file=sys.stderr, dynamic_ncols=True, leave=False)
