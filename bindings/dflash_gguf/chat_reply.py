"""A chat reply as llama-server (--jinja, its default) hands it out: a reasoning model's thinking
apart in `reasoning_content`, and tool calls parsed out of the text in the syntax the model's chat
template teaches (Qwen2.5/Qwen3/Hermes: <tool_call>{json}</tool_call>; Qwen3-Coder: <tool_call>
<function=name><parameter=p>value</parameter></function></tool_call>; Llama 3.x: a closing
{"name": ..., "parameters": {...}}; Mistral Nemo: [TOOL_CALLS][{"name": ..., "arguments": {...}}, ...]),
streamed as deltas."""

from __future__ import annotations

import dataclasses
import functools
import os
import re
from dataclasses import dataclass
from typing import Any

from .chat_calls import (
    TAIL_OPENERS,
    CallReader,
    JsonCallReader,
    XmlCallReader,
    json_call,
    opens_no_call,
    tail_calls,
    tool_call,
)
from .chat_messages import (
    CHANNEL,
    GLIMMER_MARKERS,
    HARMONY_MARKERS,
    MESSAGE,
    DeltaParser,
    GlimmerParser,
    HarmonyParser,
    content_delta,
)
from .chat_template import formatter
from .text import partial_tag

THINK_OPEN, THINK_CLOSE = "<think>", "</think>"
CALL_OPEN, CALL_CLOSE = "<tool_call>", "</tool_call>"
REASONING_FORMATS = ("none", "auto", "deepseek")
ALL = "all"  # ReplyParser.skip: every whitespace character


@dataclass(frozen=True)
class ReplySyntax:
    thinking: bool = False  # the reply may hold <think>...</think>: goes to reasoning_content
    starts_thinking: bool = False  # the prompt ends in an opened <think> (the template opened it)
    # "hermes", "qwen3-coder", calls that end the reply ("llama3", "mistral": chat_calls.TAIL_OPENERS), or
    # a format of messages read whole (thinking too): "harmony" (gpt-oss), "glimmer" (Muse Glimmer); None:
    # no calls read
    tool_format: str | None = None
    # what the prompt holds after the <think> it opened (its newline): llama-server counts it as thinking;
    # where thinking is not read, the prompt's whole think block, which it counts as text
    opened: str = ""
    # Qwen3-Coder's family (Qwen3.5 / 3.6 among it): the thinking and the text after it begin at their first
    # non-space, and a <tool_call> ends the thinking as </think> does (the call is then the reply's)
    xml_family: bool = False
    # the whitespace the template writes after <think> and after </think> around an earlier reply's
    # thinking: as much of it as a reply repeats is not part of its thinking or text (llama-server's
    # reader learns these markers from the template)
    after_open: str = ""
    after_close: str = ""
    # the reply's leading whitespace is dropped (llama-server's reader does so under a template that can
    # think, for a chat with tools, and in Qwen3-Coder's family)
    lstrip: bool = False
    # a reply's first call may open with <function=NAME> without its <tool_call> (Qwen3-Coder's template,
    # which cannot think: llama-server's reader allows for its models leaving the tag out)
    bare_calls: bool = False

    @property
    def parses(self) -> bool:
        """A reply in this syntax is not its text as written."""
        return self.thinking or self.tool_format is not None or self.xml_family or self.lstrip or bool(self.opened)


def reply_syntax(template: str | None, prompt: str, reasoning_format: str | None, tools: bool) -> ReplySyntax:
    """How to read the reply to `prompt`, rendered by `template` (the target's chat template), as
    llama-server reads it; `reasoning_format` None: as llama_cpp.Llama gives it (as written, tool calls
    aside)."""
    syntax = _reply_syntax(template or "", prompt, reasoning_format, tools)
    if syntax.tool_format == "qwen3-coder" and THINK_OPEN not in (template or ""):
        return dataclasses.replace(syntax, bare_calls=True)
    return syntax


def _reply_syntax(template: str, prompt: str, reasoning_format: str | None, tools: bool) -> ReplySyntax:
    if reasoning_format is not None and reasoning_format not in REASONING_FORMATS:
        raise ValueError(f"reasoning_format must be one of {', '.join(REASONING_FORMATS)}, got {reasoning_format!r}")
    reads_thinking = reasoning_format not in (None, "none")
    if CHANNEL in template:  # gpt-oss's harmony format (chat_messages), read for its calls at least
        return ReplySyntax(reads_thinking, tool_format="harmony")
    if "<atem:function_calls>" in template and "<|eom|>" in template:  # Muse Glimmer's (chat_messages)
        # neither thinking nor tools: the reply as written
        return ReplySyntax(reads_thinking, tool_format="glimmer" if reads_thinking or tools else None)
    tool_format = _call_format(template, tools)
    if reasoning_format is None:
        return ReplySyntax(tool_format=tool_format)
    can_think = THINK_OPEN in template
    # the think block the template ended the prompt with: opened (the reply is thinking) or closed
    # (enable_thinking false: the reply is text)
    tail = prompt.rstrip()
    block = prompt[prompt.rindex(THINK_OPEN) :] if can_think and tail.endswith((THINK_OPEN, THINK_CLOSE)) else ""
    thinking = reads_thinking and can_think and not tail.endswith(THINK_CLOSE)
    xml_family = _xml_family(template)
    if reasoning_format == "none" and block:  # the prompt's think block, then the reply, as written
        return ReplySyntax(tool_format=tool_format, opened=block)
    after_open, after_close = _think_spacing(template) if thinking else ("", "")
    starts_thinking = thinking and tail.endswith(THINK_OPEN)
    opened = block[len(THINK_OPEN) :] if starts_thinking and not xml_family else ""
    lstrip = xml_family or (can_think and not block) or (tools and "tools" in template)
    return ReplySyntax(thinking, starts_thinking, tool_format, opened, xml_family, after_open, after_close, lstrip)


def _xml_family(template: str) -> bool:
    """llama-server's test for the templates its Qwen3-Coder parser reads (Qwen3-Coder, Qwen3.5 / 3.6; the
    ones that put no newline between <tool_call> and <function= are not of them)."""
    return (
        all(tag in template for tag in (CALL_OPEN, "<function=", "<parameter="))
        and "'<tool_call><function=' ~ tool_call.name ~ '>'" not in template
    )


def _call_format(template: str, tools: bool) -> str | None:
    """The syntax of the tool calls `template` teaches, where a reply's calls are read (`tools`)."""
    if not tools:
        return None
    if CALL_OPEN in template:
        return "qwen3-coder" if "<function=" in template else "hermes"
    if TAIL_OPENERS["mistral"] + "[" in template:
        return "mistral"
    if '{"name": function name, "parameters": dictionary of argument name and its value}' in template:
        return "llama3"
    return None


@functools.lru_cache(maxsize=8)
def _think_spacing(template: str) -> tuple[str, str]:
    """The whitespace `template` writes after <think> and after </think> when it renders an earlier
    reply's thinking; none where it leaves thinking out of the conversation (DeepSeek-R1's)."""
    turns = [{"role": "user", "content": "U"}, {"role": "assistant", "content": "C", "reasoning_content": "R"}]
    try:
        rendered = formatter(template, "", "")(messages=turns).prompt
    except Exception:  # noqa: BLE001 - a template that needs more than this to render
        return "", ""
    found = re.search(r"<think>(\s*)R\s*</think>(\s*)C", rendered)
    return (found.group(1), found.group(2)) if found else ("", "")


def thinking_tags(template: str) -> tuple[str, tuple[str, ...]] | None:
    """The tag a reply's thinking opens with under `template` and those that close it, the first of them the
    one a reasoning budget writes, as llama-server's reads them (gpt-oss's analysis channel; <think>, which
    in Qwen3-Coder's family a call ends too, and whose closing tag there starts on a line of its own); None
    where the template does not think."""
    if CHANNEL in template:
        return CHANNEL + "analysis" + MESSAGE, ("<|end|>",)
    if THINK_OPEN not in template:
        return None
    return THINK_OPEN, ("\n" + THINK_CLOSE, THINK_CLOSE, CALL_OPEN) if _xml_family(template) else (THINK_CLOSE,)


def reply_parser(
    syntax: ReplySyntax, tools: dict[str, dict[str, Any]] | None = None
) -> ReplyParser | HarmonyParser | GlimmerParser:
    """The parser of replies in `syntax`; `tools`: those it may call."""
    if syntax.tool_format == "harmony":
        return HarmonyParser(syntax.thinking, tools)
    if syntax.tool_format == "glimmer":
        return GlimmerParser(syntax.thinking, tools)
    return ReplyParser(syntax, tools)


def reply_markers(syntax: ReplySyntax) -> tuple[str, ...]:
    """The tags replies in `syntax` are read by whose text is the reply's even where they are special
    tokens (llama-server's preserved tokens: libllama shows no special token's text otherwise)."""
    markers = {"harmony": HARMONY_MARKERS, "glimmer": GLIMMER_MARKERS, "mistral": (TAIL_OPENERS["mistral"],)}
    return markers.get(syntax.tool_format or "", ())


class ReplyParser(DeltaParser):
    """A reply of <think> tags and tool calls (chat_calls); text that may still become a tag is held back."""

    def __init__(self, syntax: ReplySyntax, tools: dict[str, dict[str, Any]] | None = None) -> None:
        self.syntax = syntax
        self.tools = tools or {}
        self.mode = "reasoning" if syntax.starts_thinking else ("start" if syntax.thinking else "content")
        self.pending = syntax.opened
        self.calls: list[dict[str, Any]] = []
        # whitespace to drop where the text is now: ALL of it, as much of a given string as the text repeats,
        # or None (ReplySyntax.lstrip, after_open, after_close)
        self.skip: str | None = ALL if syntax.lstrip else None
        self.held = ""  # the thinking so far, while it is only whitespace: dropped if it stays so
        self.thought = False  # some thinking was given out
        self.gap = ""  # the whitespace before a tool call's block, the reply's again if it is no call
        self.reader: CallReader | None = None  # the call being read
        self.opener = ""  # the tag that opened it
        self.searched = 0  # where the call's block may still hold its closing tag

    def _step(self, final: bool) -> list[dict[str, Any]]:
        if self.skip is not None:
            self.pending = self._skip_space(self.pending, final)
            if self.skip is not None:  # all whitespace so far: more may come
                return []
        text = self.pending
        if self.mode == "start":  # a thinking model may open with <think>
            if text.startswith(THINK_OPEN):
                self.pending, self.mode = text[len(THINK_OPEN) :], "reasoning"
                self.skip = ALL if self.syntax.xml_family else self.syntax.after_open
            elif final or not THINK_OPEN.startswith(text):
                self.mode = "content"
            return []
        if self.mode == "reasoning":
            ends = [THINK_CLOSE, CALL_OPEN] if self.syntax.xml_family else [THINK_CLOSE]
            found = [(i, tag) for tag in ends if (i := text.find(tag)) >= 0]
            if found:
                end, tag = min(found)
                if tag == THINK_CLOSE:
                    self.pending = text[end + len(THINK_CLOSE) :]
                    self.skip = ALL if self.syntax.xml_family else self.syntax.after_close
                else:  # a call made while thinking ends the thinking
                    self.pending = text[end:]
                self.mode = "content"
                return self._reasoning(text[:end])
            keep = 0 if final else max(partial_tag(text, tag) for tag in ends)
            self.pending = text[len(text) - keep :]
            return self._reasoning(text[: len(text) - keep])
        if self.mode == "content":
            if self.syntax.tool_format is None:
                self.pending = ""
                return content_delta(text)
            openers = [TAIL_OPENERS.get(self.syntax.tool_format, CALL_OPEN)]
            if self.syntax.bare_calls and not self.calls:
                openers += [f"<function={name}>" for name in self.tools]
            found = [(i, opener) for opener in openers if (i := text.find(opener)) >= 0]
            if found:  # the whitespace before a call belongs to no part of the message
                start, self.opener = min(found)
                before = text[:start].rstrip()
                self.pending, self.gap = text[start:], text[len(before) : start]
                self.mode = "tail" if self.opener in TAIL_OPENERS.values() else "call"
                return content_delta(before)
            if final:  # the reply's own end is left as it is, unless calls came before it
                self.pending = ""
                return content_delta(text.rstrip() if self.calls else text)
            settled = text[: len(text) - max(partial_tag(text, opener) for opener in openers)].rstrip()
            self.pending = text[len(settled) :]
            return content_delta(settled)
        if self.mode == "tail":  # calls that run to the reply's end
            return self._tail(text, final)
        return self._block(text, final)

    def _block(self, text: str, final: bool) -> list[dict[str, Any]]:
        """A <tool_call> block (or a bare <function=...> one, up to its </tool_call>): its call streamed as
        it is read, or read whole once the block has ended."""
        start = len(CALL_OPEN) if self.opener == CALL_OPEN else 0
        end = text.find(CALL_CLOSE, max(start, self.searched))
        closed = end >= 0 or final
        out = self._read(text[:end] if end >= 0 else text, closed, start)
        if not closed:
            self.searched = len(text) - len(CALL_CLOSE) + 1
            return out
        body = text[start : end if end >= 0 else len(text)]
        whole = len(text) if end < 0 else end + len(CALL_CLOSE)
        started, self.reader, self.mode, self.searched = self.reader.started, None, "content", 0
        call = None if started or self.syntax.tool_format != "hermes" else json_call(body, ("arguments", "parameters"))
        if not started and call is None:  # not a call after all: the text stays the reply's
            self.pending = text[whole:]
            return content_delta(self.gap + text[:whole])
        self.pending = text[whole:].lstrip()
        if call is not None:  # a call read whole (its members in another order)
            self.calls.append(tool_call(len(self.calls), *call))
            out = [{"tool_calls": [self.calls[-1]]}]
        return out

    def _tail(self, text: str, final: bool) -> list[dict[str, Any]]:
        """Calls that run to the reply's end: Llama 3.x's streamed as it is read, what follows its arguments
        not read; Mistral's list read whole at the end (each call's id follows its arguments)."""
        out: list[dict[str, Any]] = []
        if self.syntax.tool_format == "llama3":
            out = self._read(text, final)
            assert self.reader is not None
            if not self.reader.started and not final and opens_no_call(text):  # a brace of the text's own
                self.mode, self.pending, self.reader = "content", text[1:], None
                return out + content_delta(self.gap + text[:1])
            if self.reader.started:
                if not final:
                    return out
                # after the arguments, the call's closing brace; any text after that is the reply's
                # (llama-server refuses such a reply)
                rest = re.sub(r"^\s*\}?\s*", "", text[self.reader.at :])
                self.pending, self.mode, self.reader = "", "content", None
                return out + content_delta(rest)
        if not final:
            return out
        self.pending, self.mode, self.reader = "", "content", None
        calls = tail_calls(self.syntax.tool_format or "", text, self.tools)
        if calls is None:
            return content_delta(self.gap + text)
        self.calls += [tool_call(len(self.calls) + i, *call) for i, call in enumerate(calls)]
        return [{"tool_calls": self.calls[len(self.calls) - len(calls) :]}]

    def _read(self, text: str, final: bool, at: int = 0) -> list[dict[str, Any]]:
        """The deltas of the call being read, `text` its text so far from `at` on; a call named now is one of
        the reply's. A Hermes call may name any tool (as before llama-server's grammar), a Llama 3.x one only
        the tools."""
        if self.reader is None:
            if self.syntax.tool_format == "qwen3-coder":
                self.reader = XmlCallReader(len(self.calls), self.tools, at)
            elif self.syntax.tool_format == "llama3":
                self.reader = JsonCallReader(len(self.calls), ("parameters",), self.tools, at)
            else:
                self.reader = JsonCallReader(len(self.calls), ("arguments", "parameters"), None, at)
        out = self.reader.read(text, final)
        if self.reader.started and (not self.calls or self.calls[-1] is not self.reader.call):
            self.calls.append(self.reader.call)
        return out

    def _skip_space(self, text: str, final: bool) -> str:
        """`text` without the whitespace self.skip says to drop; self.skip None once that is settled."""
        how = self.skip
        if how == ALL:
            rest = text.lstrip()
            if rest or final:
                self.skip = None
            return rest
        assert how is not None
        n = len(os.path.commonprefix([text, how]))
        self.skip = how[n:] if n == len(text) and n < len(how) and not final else None
        return text[n:]

    def _reasoning(self, text: str) -> list[dict[str, Any]]:
        # thinking that is only whitespace is no thinking (llama-server's): held until the first non-space
        if not self.thought:
            text, self.held = self.held + text, ""
            if not text.strip():
                self.held = text
                return []
            self.thought = True
        return [{"reasoning_content": text}] if text else []


def reply_message(deltas: list[dict[str, Any]]) -> dict[str, Any]:
    """The non-streamed message of a reply's deltas, in llama-server's shape: a call's first delta names it
    (its id), the later ones add to its arguments."""
    message: dict[str, Any] = {"role": "assistant", "content": "".join(d.get("content", "") for d in deltas)}
    reasoning = "".join(d.get("reasoning_content", "") for d in deltas)
    if reasoning:
        message["reasoning_content"] = reasoning
    calls: dict[int, dict[str, Any]] = {}
    for c in (c for d in deltas for c in d.get("tool_calls", [])):
        if "id" in c:
            calls[c["index"]] = {"id": c["id"], "type": c["type"], "function": dict(c["function"])}
        else:
            calls[c["index"]]["function"]["arguments"] += c["function"]["arguments"]
    if calls:
        message["tool_calls"] = [calls[i] for i in sorted(calls)]
    return message
