"""A streamed chat reply as the parts the Responses and Anthropic Messages APIs stream: its reasoning, its
text and each tool call, one part after the other, each opened, grown by deltas and closed."""

from __future__ import annotations

import itertools
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any


@dataclass
class Part:
    kind: str  # "reasoning", "text" or "call"
    text: str = ""  # so far: the reasoning, the text or the call's arguments
    call_id: str = ""
    name: str = ""


@dataclass
class Step:
    """What the reply did next: "open" a part, add a "delta" to it, "close" it, or "finish" (`reason`: the
    chat's finish_reason)."""

    action: str
    part: Part | None = None
    delta: str = ""
    reason: str = ""


def prefilled(chunks: Iterator[dict[str, Any]]) -> Iterator[dict[str, Any]]:
    """The chat stream with its first two chunks taken at once (the role, then the prompt's decode), so that
    what the prefill refuses (a prompt longer than the context, a grammar that does not parse) raises before
    a caller sends anything."""
    first = list(itertools.islice(chunks, 2))
    return itertools.chain(first, chunks)


def reply_steps(chunks: Iterator[dict[str, Any]]) -> Iterator[Step]:
    """The steps of a chat stream's reply, a part closed before the next opens, then "finish"."""
    current: Part | None = None
    reason = "stop"

    def switch(part: Part) -> Iterator[Step]:
        nonlocal current
        if current is not None:
            yield Step("close", current)
        current = part
        yield Step("open", part)

    for chunk in chunks:
        choice = chunk["choices"][0]
        delta, reason = choice["delta"], choice["finish_reason"] or reason
        for kind, key in (("reasoning", "reasoning_content"), ("text", "content")):
            if delta.get(key):
                if current is None or current.kind != kind:
                    yield from switch(Part(kind))
                current.text += delta[key]
                yield Step("delta", current, delta[key])
        for call in delta.get("tool_calls") or []:
            f = call.get("function") or {}
            if call.get("id"):  # a call's first delta names it
                yield from switch(Part("call", call_id=call["id"], name=f.get("name", "")))
            if f.get("arguments") and current is not None and current.kind == "call":
                current.text += f["arguments"]
                yield Step("delta", current, f["arguments"])
    if current is not None:
        yield Step("close", current)
    yield Step("finish", reason=reason)


def message_parts(message: dict[str, Any]) -> list[Part]:
    """A whole chat reply's message as its parts: the reasoning, the text, the tool calls."""
    parts = []
    if message.get("reasoning_content"):
        parts.append(Part("reasoning", message["reasoning_content"]))
    if message.get("content"):
        parts.append(Part("text", message["content"]))
    for call in message.get("tool_calls") or []:
        f = call["function"]
        parts.append(Part("call", f["arguments"], call["id"], f["name"]))
    return parts
