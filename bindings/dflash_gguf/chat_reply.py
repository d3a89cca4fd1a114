"""A chat reply as llama-server (--jinja, its default) hands it out: a reasoning model's thinking
apart in `reasoning_content`, and tool calls parsed out of the text in the syntax the model's chat
template teaches (Qwen2.5/Qwen3/Hermes: <tool_call>{json}</tool_call>; Qwen3-Coder: <tool_call>
<function=name><parameter=p>value</parameter></function></tool_call>), streamed as deltas."""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass
from typing import Any

THINK_OPEN, THINK_CLOSE = "<think>", "</think>"
CALL_OPEN, CALL_CLOSE = "<tool_call>", "</tool_call>"
REASONING_FORMATS = ("none", "auto", "deepseek")


@dataclass(frozen=True)
class ReplySyntax:
    thinking: bool = False  # the reply may hold <think>...</think>: goes to reasoning_content
    starts_thinking: bool = False  # the prompt ends in an opened <think> (the template opened it)
    tool_format: str | None = None  # "hermes", "qwen3-coder" or None (no parsing)
    # what the prompt holds after the <think> it opened (its newline): llama-server counts it as thinking
    opened: str = ""


def reply_syntax(template: str | None, prompt: str, reasoning_format: str, tools: bool) -> ReplySyntax:
    """How to read the reply to `prompt`, rendered by `template` (the target's chat template)."""
    if reasoning_format not in REASONING_FORMATS:
        raise ValueError(f"reasoning_format must be one of {', '.join(REASONING_FORMATS)}, got {reasoning_format!r}")
    template = template or ""
    thinking = reasoning_format != "none" and THINK_OPEN in template
    tool_format = None
    if tools and CALL_OPEN in template:
        tool_format = "qwen3-coder" if "<function=" in template else "hermes"
    if thinking and prompt.rstrip().endswith(THINK_OPEN):
        return ReplySyntax(True, True, tool_format, prompt[prompt.rindex(THINK_OPEN) + len(THINK_OPEN) :])
    return ReplySyntax(thinking, False, tool_format)


def tool_call_grammar(tools: dict[str, dict[str, Any]], syntax: ReplySyntax) -> tuple[str, tuple[str, ...]] | None:
    """(GBNF, trigger words) of a lazy grammar that keeps a tool call the model starts to the tools' names
    and parameter schemas, as llama-server does; None where the syntax has none (Qwen3-Coder's XML)."""
    from .llama_compat import any_tool_grammar

    if syntax.tool_format != "hermes" or not tools:
        return None
    call = any_tool_grammar(tools)
    rules = re.sub(r"^root\s*::=", "tool-call-json ::=", call._grammar, count=1, flags=re.MULTILINE)
    # the whitespace around a call is bounded: a small model may otherwise emit newlines for ever
    block = f'"{CALL_OPEN}" [ \\n]{{0,2}} tool-call-json [ \\n]{{0,2}} "{CALL_CLOSE}"'
    return f"root ::= {block} ([ \\n]{{0,2}} {block})*\n{rules}", (CALL_OPEN,)


class ReplyParser:
    """Feed the reply's text as it comes; get OpenAI chat deltas ({"reasoning_content"}, {"content"},
    {"tool_calls"}) for what is settled. Text that may still become a tag is held back."""

    def __init__(self, syntax: ReplySyntax, tools: dict[str, dict[str, Any]] | None = None) -> None:
        self.syntax = syntax
        self.tools = tools or {}
        self.mode = "reasoning" if syntax.starts_thinking else ("start" if syntax.thinking else "content")
        self.pending = syntax.opened
        self.calls: list[dict[str, Any]] = []
        self.trim_start = False  # the content after </think> starts at its first non-space
        self.gap = ""  # the whitespace before a tool call's block, the reply's again if it is no call

    def feed(self, text: str) -> list[dict[str, Any]]:
        self.pending += text
        out: list[dict[str, Any]] = []
        while True:
            n_before, mode_before = len(self.pending), self.mode
            out += self._step(final=False)
            if len(self.pending) == n_before and self.mode == mode_before:
                return out

    def finish(self) -> list[dict[str, Any]]:
        out = self.feed("")
        while self.pending:
            out += self._step(final=True)
        return out

    def _step(self, final: bool) -> list[dict[str, Any]]:
        text = self.pending
        if self.mode == "start":  # a thinking model may open with <think>
            stripped = text.lstrip()
            if stripped.startswith(THINK_OPEN):
                self.pending, self.mode = stripped[len(THINK_OPEN) :], "reasoning"
            elif final or not THINK_OPEN.startswith(stripped):
                self.mode = "content"
            return []
        if self.mode == "reasoning":
            end = text.find(THINK_CLOSE)
            if end >= 0:
                self.pending, self.mode, self.trim_start = text[end + len(THINK_CLOSE) :], "content", True
                return self._reasoning(text[:end])
            keep = 0 if final else _partial_tag(text, THINK_CLOSE)
            self.pending = text[len(text) - keep :]
            return self._reasoning(text[: len(text) - keep])
        if self.mode == "content":
            if self.trim_start:
                text = self.pending = text.lstrip()
                self.trim_start = not text and not final
                if not text:
                    return []
            if self.syntax.tool_format is None:
                self.pending = ""
                return self._content(text)
            start = text.find(CALL_OPEN)
            if start >= 0:  # the whitespace before a call belongs to no part of the message
                before = text[:start].rstrip()
                self.pending, self.mode, self.gap = text[start:], "call", text[len(before) : start]
                return self._content(before)
            if final:  # the reply's own end is left as it is, unless calls came before it
                self.pending = ""
                return self._content(text.rstrip() if self.calls else text)
            settled = text[: len(text) - _partial_tag(text, CALL_OPEN)].rstrip()
            self.pending = text[len(settled) :]
            return self._content(settled)
        # mode "call": a tool call's block, whole before it is parsed
        end = text.find(CALL_CLOSE)
        if end < 0 and not final:
            return []
        block = text[len(CALL_OPEN) : end] if end >= 0 else text[len(CALL_OPEN) :]
        whole = len(text) if end < 0 else end + len(CALL_CLOSE)
        self.mode = "content"
        call = self._parse_call(block)
        if call is None:  # not a call after all: the text stays the reply's
            self.pending = text[whole:]
            return self._content(self.gap + text[:whole])
        self.pending = text[whole:].lstrip()
        call = {"index": len(self.calls), "id": f"call_{uuid.uuid4().hex}", "type": "function", "function": call}
        self.calls.append(call)
        return [{"tool_calls": [call]}]

    def _reasoning(self, text: str) -> list[dict[str, Any]]:
        return [{"reasoning_content": text}] if text else []

    def _content(self, text: str) -> list[dict[str, Any]]:
        return [{"content": text}] if text else []

    def _parse_call(self, block: str) -> dict[str, str] | None:
        if self.syntax.tool_format == "qwen3-coder":
            return self._parse_xml_call(block)
        try:
            call = json.loads(block)
        except ValueError:
            return None
        if not isinstance(call, dict) or not isinstance(call.get("name"), str):
            return None
        args = call.get("arguments", call.get("parameters", {}))
        return {
            "name": call["name"],
            "arguments": args if isinstance(args, str) else json.dumps(args, ensure_ascii=False),
        }

    def _parse_xml_call(self, block: str) -> dict[str, str] | None:
        m = re.fullmatch(r"\s*<function=([^>\n]+)>(.*?)</function>\s*", block, flags=re.DOTALL)
        if m is None:
            return None
        name, body = m.group(1).strip(), m.group(2)
        props = self.tools.get(name, {}).get("parameters", {}).get("properties", {})
        args: dict[str, Any] = {}
        for p in re.finditer(r"<parameter=([^>\n]+)>\n?(.*?)\n?</parameter>", body, flags=re.DOTALL):
            key, value = p.group(1).strip(), p.group(2)
            if props.get(key, {}).get("type", "string") != "string":
                try:
                    value = json.loads(value)
                except ValueError:
                    pass
            args[key] = value
        return {"name": name, "arguments": json.dumps(args, ensure_ascii=False)}


def _partial_tag(text: str, tag: str) -> int:
    """The length of the longest end of `text` that begins `tag` (it may become the tag)."""
    for n in range(min(len(tag) - 1, len(text)), 0, -1):
        if tag.startswith(text[-n:]):
            return n
    return 0


def reply_message(deltas: list[dict[str, Any]]) -> dict[str, Any]:
    """The non-streamed message of a reply's deltas, in llama-server's shape."""
    message: dict[str, Any] = {"role": "assistant", "content": "".join(d.get("content", "") for d in deltas)}
    reasoning = "".join(d.get("reasoning_content", "") for d in deltas)
    if reasoning:
        message["reasoning_content"] = reasoning
    calls = [{k: v for k, v in c.items() if k != "index"} for d in deltas for c in d.get("tool_calls", [])]
    if calls:
        message["tool_calls"] = calls
    return message
