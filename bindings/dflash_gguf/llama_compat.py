"""What SpeculativeLlama mirrors of llama_cpp.Llama's API beyond sampling: the options it accepts only
at their "off" values, and the shapes of `logprobs` in completions and chats."""

from __future__ import annotations

import codecs
from collections.abc import Callable
from typing import Any

# llama_cpp.Llama options SpeculativeLlama does not implement, each with the values that mean "off": taken
# at those values (frameworks such as LangChain's LlamaCpp pass them all on every call), a ValueError
# naming the option otherwise, rather than output that silently ignores it
OFF_VALUES: dict[str, tuple[Any, ...]] = {
    "suffix": (None,), "typical_p": (1.0,), "tfs_z": (1.0,),
    "mirostat_mode": (0,),
    "functions": (None,), "function_call": (None,), "tools": (None,), "tool_choice": (None,),
    "response_format": (None,),
}
_READ_ONLY_WITH_MIROSTAT = ("mirostat_tau", "mirostat_eta")
_COMPLETION_ONLY = ("suffix",)
_CHAT_ONLY = ("functions", "function_call", "tools", "tool_choice", "response_format")


def check_off(method: str, options: dict[str, Any]) -> None:
    excluded = _CHAT_ONLY if method == "create_completion" else _COMPLETION_ONLY
    for key, value in options.items():
        if key in _READ_ONLY_WITH_MIROSTAT:
            continue
        if key not in OFF_VALUES or key in excluded:
            raise TypeError(f"{method}() got an unexpected keyword argument {key!r}")
        off = OFF_VALUES[key]
        numeric = type(value) in (int, float)
        if not any(value is v or (numeric and type(v) in (int, float) and value == v) for v in off):
            raise ValueError(f"{method}: {key}={value!r} is not supported by SpeculativeLlama "
                             f"(only {' or '.join(map(repr, off))}, llama_cpp.Llama's 'off')")


def check_logprobs(n: int | None, echo: bool) -> None:
    if n is None:
        return
    if isinstance(n, bool) or not isinstance(n, int) or n < 0:
        raise ValueError(f"logprobs must be an int >= 0 (the most likely tokens to list) or None, got {n!r}")
    if echo:
        raise ValueError("logprobs with echo=True (the prompt's log-probabilities) is not supported by "
                         "SpeculativeLlama")


# (logprob, [(id, logprob) of the most likely]) of one generated token
TokenLogprob = tuple[float, list[tuple[int, float]]]


class LogprobCursor:
    """llama_cpp.Llama's `logprobs` of a completion's tokens, handed out as their text is released: a
    chunk that brings the released text to `upto` characters gets the tokens that start before that
    (so a stop string cuts tokens and text alike, and a streamed chunk carries its own tokens).
    `tokens` and `logprobs` are the generation's lists, read as they grow."""

    def __init__(self, tokens: list[int], logprobs: list[TokenLogprob], piece: Callable[[int], bytes],
                 text_offset: int) -> None:
        self._tokens, self._logprobs, self._piece = tokens, logprobs, piece
        self._base, self._next, self._chars = text_offset, 0, 0
        self._decoder = codecs.getincrementaldecoder("utf-8")(errors="ignore")

    def take(self, upto: int) -> dict[str, list[Any]]:
        out: dict[str, list[Any]] = {"tokens": [], "text_offset": [], "token_logprobs": [], "top_logprobs": []}
        while self._next < min(len(self._tokens), len(self._logprobs)) and self._chars < upto:
            tok, (lp, top) = self._tokens[self._next], self._logprobs[self._next]
            piece = self._piece(tok)
            token_str = piece.decode("utf-8", "ignore")
            best = {self._piece(i).decode("utf-8", "ignore"): v for i, v in top}
            best[token_str] = lp
            out["tokens"].append(token_str)
            out["text_offset"].append(self._base + self._chars)
            out["token_logprobs"].append(lp)
            out["top_logprobs"].append(best)
            self._chars += len(self._decoder.decode(piece))
            self._next += 1
        return out


def chat_logprobs(lp: dict[str, list[Any]]) -> dict[str, Any]:
    """A completion's logprobs in OpenAI's chat shape."""
    def entry(token: str, logprob: float) -> dict[str, Any]:
        return {"token": token, "logprob": logprob, "bytes": list(token.encode("utf-8"))}

    return {"content": [{**entry(t, v), "top_logprobs": [entry(a, b) for a, b in top.items()]}
                        for t, v, top in zip(lp["tokens"], lp["token_logprobs"], lp["top_logprobs"])],
            "refusal": None}
