"""Replies written as a run of messages, each with a header naming its channel or recipient, as
llama-server's readers hand them out: gpt-oss's (OpenAI's harmony format) and Muse Glimmer's. A message's
body is thinking (`reasoning_content`), text (`content`) or a tool call; the messages after the first
open with `<|start|>assistant`. Text that does not follow the format stays the reply's text as written
(llama-server answers it with an error)."""

from __future__ import annotations

import re
from typing import Any

from .chat_calls import json_object, tagged_arguments, tool_call
from .text import partial_tag

START, MESSAGE = "<|start|>assistant", "<|message|>"
_LONGEST_HEADER = 256  # without <|message|> by then the text is no header


class DeltaParser:
    """Feed a reply's text as it comes; get OpenAI chat deltas ({"reasoning_content"}, {"content"},
    {"tool_calls"}) for what is settled. A reader is a subclass: its `_step` reads what it can of
    `self.pending` (`final`: no more text comes) and says so by changing `pending` or `mode`."""

    pending: str
    mode: str

    def feed(self, text: str) -> list[dict[str, Any]]:
        self.pending += text
        return self._run(final=False)

    def finish(self) -> list[dict[str, Any]]:
        return self._run(final=True)

    def _run(self, final: bool) -> list[dict[str, Any]]:
        out: list[dict[str, Any]] = []
        while True:
            before = (self.mode, len(self.pending))
            out += self._step(final)
            if (self.mode, len(self.pending)) == before:
                return out

    def _step(self, final: bool) -> list[dict[str, Any]]:
        raise NotImplementedError


class MessageRunParser(DeltaParser):
    """A reply as a run of messages. A format is a subclass: its headers, the tags that end a body, what
    follows each kind of message and how a call's body reads."""

    ENDS: tuple[str, ...] = ()

    def __init__(self, thinking: bool, tools: dict[str, dict[str, Any]] | None = None) -> None:
        self.thinking = thinking
        self.tools = tools or {}
        self.mode = "header"  # header, body, next (a message ended), done (the reply's last read), raw
        self.pending = ""
        self.kind = ""  # the message's: reasoning, content or call
        self.header = ""  # the message's header as written
        self.to = ""  # the recipient a call message names
        self.last = False  # nothing after this message is read
        self.calls: list[dict[str, Any]] = []

    # --- a format ------------------------------------------------------------------------------------
    def _header(self, header: str) -> tuple[str, str, bool] | None:
        """(kind, recipient, last) of a message whose header (up to <|message|>) is `header`: kind
        "reasoning", "content" or "call"; last: nothing after it is read. None: no header."""
        raise NotImplementedError

    def _may_open(self, text: str) -> bool:
        """`text` may still become a header."""
        raise NotImplementedError

    def _call(self, body: str) -> tuple[str, str] | None:
        """(tool name, arguments as JSON text) of a call's body; None: it is no call."""
        raise NotImplementedError

    def _opened(self) -> list[dict[str, Any]]:
        """The deltas of a header just read."""
        return []

    def _reasoning(self, text: str) -> list[dict[str, Any]]:
        return [{"reasoning_content": text}] if text else []

    # --- the run of messages ----------------------------------------------------------------------------
    def _step(self, final: bool) -> list[dict[str, Any]]:
        text = self.pending
        if self.mode == "raw":
            self.pending = ""
            return content_delta(text)
        if self.mode == "done":  # what follows the reply's last message is not read (llama-server's)
            self.pending = ""
            return []
        if self.mode == "next":
            if text.startswith(START):
                self.pending, self.mode = text[len(START) :], "header"
            elif final or not START.startswith(text):
                self.mode = "raw"
            return []
        if self.mode == "header":
            end = text.find(MESSAGE)
            if end < 0:
                if final or len(text) > _LONGEST_HEADER or not self._may_open(text):
                    self.mode = "raw"
                return []
            read = self._header(text[: end + len(MESSAGE)])
            if read is None:
                self.mode = "raw"
                return []
            self.header, (self.kind, self.to, self.last) = text[: end + len(MESSAGE)], read
            self.pending, self.mode = text[end + len(MESSAGE) :], "body"
            return self._opened()
        # a message's body: thinking and text as they come, a call whole
        ends = [(found, tag) for tag in self.ENDS if (found := text.find(tag)) >= 0]
        if ends:
            cut, tag = min(ends)
            self.pending, self.mode = text[cut + len(tag) :], "done" if self.last else "next"
            return self._body(text[:cut], tag)
        if self.kind == "call" and not final:
            return []
        keep = 0 if final else max(partial_tag(text, tag) for tag in self.ENDS)
        self.pending = text[len(text) - keep :]
        if final:  # the reply ended inside this message
            self.mode = "done"
        return self._body(text[: len(text) - keep], "")

    def _body(self, text: str, end: str) -> list[dict[str, Any]]:
        """The deltas of (more of) a body; `end`: the tag that ended it, if it did."""
        if self.kind == "reasoning":
            return self._reasoning(text)
        if self.kind == "content":
            return content_delta(text)
        read = self._call(text)
        if read is None:  # no call after all: the message stays text, as written
            return content_delta(self.header + text + end)
        self.calls.append(tool_call(len(self.calls), *read))
        return [{"tool_calls": [self.calls[-1]]}]


class HarmonyParser(MessageRunParser):
    """gpt-oss: `<|channel|>CHANNEL<|message|>BODY<|end|>`; the `analysis` channel is the thinking,
    `final` and `commentary` without a recipient the text, a message to `functions.NAME` a call with JSON
    arguments. Not thinking (reasoning format "none"): the analysis stays in the text with its markers."""

    ENDS = ("<|end|>", "<|call|>")  # <|call|> ends a call (an end-of-generation token: seldom in the text)
    _HEADER = re.compile(
        r"(?:<\|channel\|>commentary(?: to=assistant)?)?"  # a stray commentary header gpt-oss-20b writes first
        r"(?: to=functions\.(?P<role_to>[^<\s]+))?"  # a call's recipient in the role header ...
        r"<\|channel\|>(?P<channel>analysis|commentary|final)"
        r"(?: to=functions\.(?P<to>[^<\s]+))?"  # ... or in the channel header
        r"(?:\s*(?:<\|constrain\|>)?[A-Za-z0-9_-]+)?"  # the body's type (json)
        r"<\|message\|>"
    )

    def _header(self, header: str) -> tuple[str, str, bool] | None:
        m = self._HEADER.fullmatch(header)
        if m is None:
            return None
        if m.group("to") or m.group("role_to"):
            return "call", m.group("to") or m.group("role_to"), True
        channel = m.group("channel")
        return ("reasoning" if channel == "analysis" else "content"), "", channel == "final"

    def _may_open(self, text: str) -> bool:
        return any(text.startswith(p) or p.startswith(text) for p in (CHANNEL, " to=functions."))

    def _call(self, body: str) -> tuple[str, str] | None:
        read = json_object(body)
        if read is None or body[read[1] :].strip():
            return None
        return self.to, body.strip()  # the arguments as written

    def _opened(self) -> list[dict[str, Any]]:
        return [] if self.thinking or self.kind != "reasoning" else content_delta(self.header)

    def _reasoning(self, text: str) -> list[dict[str, Any]]:
        if self.thinking:
            return super()._reasoning(text)
        return content_delta(text + (self.ENDS[0] if self.mode == "next" else ""))  # with its <|end|>, once read


class GlimmerParser(MessageRunParser):
    """Muse Glimmer: ` to=RECIPIENT<|message|>BODY`, ended by <|eom|> (more follow) or <|eot|>; to `self`
    the thinking, to `user` (or no one) the text, to a tool (with tools only) a call in ATEM markup
    (`<atem:function_calls><atem:invoke name="NAME"><atem:parameter name="P">V</atem:parameter>...`, a
    string parameter as written, others JSON). Not thinking: the thinking's body is text."""

    ENDS = ("<|eom|>", "<|eot|>")
    _HEADER = re.compile(r"(?: to=(?P<to>[^<]*?))?<\|message\|>")
    _INVOKE = re.compile(
        r'<atem:function_calls>\s*<atem:invoke name="(?P<name>[^"]+)">(?P<args>.*?)</atem:invoke>\s*'
        r"</atem:function_calls>\s*",
        re.DOTALL,
    )
    _PARAMETER = re.compile(r'<atem:parameter name="([^"]+)">(.*?)</atem:parameter>', re.DOTALL)

    def _header(self, header: str) -> tuple[str, str, bool] | None:
        m = self._HEADER.fullmatch(header)
        if m is None:
            return None
        to = m.group("to")
        if to == "self":
            return "reasoning", "", False
        if to in (None, "user"):
            return "content", "", not self.tools  # with tools, calls may follow the text
        return ("call", to, False) if self.tools else None

    def _may_open(self, text: str) -> bool:
        return any(text.startswith(p) or p.startswith(text) for p in (" to=", MESSAGE))

    def _call(self, body: str) -> tuple[str, str] | None:
        m = self._INVOKE.fullmatch(body)
        if m is None:
            return None
        name = m.group("name")
        schema = self.tools.get(name, {}).get("parameters", {})
        return name, tagged_arguments(self._PARAMETER.findall(m.group("args")), schema)

    def _reasoning(self, text: str) -> list[dict[str, Any]]:
        return super()._reasoning(text) if self.thinking else content_delta(text)


CHANNEL = "<|channel|>"
# the markers each format's replies are read by (llama-server's preserved tokens: their text is the
# reply's even where they are special tokens)
HARMONY_MARKERS = ("<|start|>", CHANNEL, MESSAGE, "<|end|>", "<|constrain|>")
GLIMMER_MARKERS = (
    "<|start|>",
    MESSAGE,
    "<|eom|>",
    "<|eot|>",
    "<atem:function_calls>",
    "<atem:invoke",
    "<atem:parameter",
    "</atem:parameter>",
    "</atem:invoke>",
    "</atem:function_calls>",
)


def content_delta(text: str) -> list[dict[str, Any]]:
    return [{"content": text}] if text else []
