"""Incremental detokenization with stop strings, for streaming and plain calls."""

from __future__ import annotations

import codecs
from collections.abc import Sequence


def utf8_decoder() -> codecs.IncrementalDecoder:
    """How token pieces become text: UTF-8, an incomplete sequence held until the bytes that complete it
    come, an invalid one replaced by U+FFFD."""
    return codecs.getincrementaldecoder("utf-8")(errors="replace")


def partial_tag(text: str, tag: str) -> int:
    """The length of the longest end of `text` that begins `tag` (it may become the tag)."""
    for n in range(min(len(tag) - 1, len(text)), 0, -1):
        if tag.startswith(text[-n:]):
            return n
    return 0


class TextStream:
    """Turns token pieces (bytes) into text deltas.

    Holds back an incomplete UTF-8 sequence, and while stop strings are set,
    the tail that could still become the start of one, so a streamed stop
    string never leaks out.
    """

    def __init__(self, stop: Sequence[str]) -> None:
        self.stop = [s for s in stop if s]
        self._hold = max((len(s) for s in self.stop), default=1) - 1
        self._decoder = utf8_decoder()
        self._text = ""  # decoded, not yet released
        self.stopped = False
        self.stopped_by = ""  # the stop string that ended the text

    def feed(self, piece: bytes) -> str:
        """Adds a piece; returns the text that is now safe to release."""
        if self.stopped:
            return ""
        self._text += self._decoder.decode(piece)
        # the stop string that begins first (a piece may bring several); of those that begin there, the first
        # listed (llama-server's choice)
        found = [(i, k) for k, s in enumerate(self.stop) if (i := self._text.find(s)) >= 0]
        if found:
            i, k = min(found)
            self.stopped_by = self.stop[k]
            self.stopped = True
            out, self._text = self._text[:i], ""
            return out
        cut = max(0, len(self._text) - self._hold) if self.stop else len(self._text)
        out, self._text = self._text[:cut], self._text[cut:]
        return out

    def flush(self) -> str:
        if self.stopped:
            return ""
        out = self._text + self._decoder.decode(b"", final=True)
        self._text = ""
        return out
