"""Incremental detokenization with stop strings, for streaming and plain calls."""

from __future__ import annotations

from collections.abc import Sequence


class TextStream:
    """Turns token pieces (bytes) into text deltas.

    Holds back an incomplete UTF-8 sequence, and while stop strings are set,
    the tail that could still become the start of one, so a streamed stop
    string never leaks out.
    """

    def __init__(self, stop: Sequence[str]) -> None:
        self.stop = [s for s in stop if s]
        self._hold = max((len(s) for s in self.stop), default=1) - 1
        self._bytes = b""
        self._text = ""  # decoded, not yet released
        self.stopped = False

    def feed(self, piece: bytes) -> str:
        """Adds a piece; returns the text that is now safe to release."""
        if self.stopped:
            return ""
        self._bytes += piece
        try:
            self._text += self._bytes.decode("utf-8")
            self._bytes = b""
        except UnicodeDecodeError as e:
            if e.reason == "unexpected end of data" and len(self._bytes) - e.start < 4:
                self._text += self._bytes[: e.start].decode("utf-8")
                self._bytes = self._bytes[e.start :]
            else:
                self._text += self._bytes.decode("utf-8", errors="replace")
                self._bytes = b""
        for s in self.stop:
            i = self._text.find(s)
            if i >= 0:
                self.stopped = True
                out, self._text = self._text[:i], ""
                return out
        cut = max(0, len(self._text) - self._hold) if self.stop else len(self._text)
        out, self._text = self._text[:cut], self._text[cut:]
        return out

    def flush(self) -> str:
        if self.stopped:
            return ""
        out = self._text + self._bytes.decode("utf-8", errors="replace")
        self._text, self._bytes = "", b""
        return out
