"""gpt-oss's replies (OpenAI's harmony format) as llama-server's reader hands them out: the reply is a run
of messages, `<|channel|>CHANNEL<|message|>BODY<|end|>`, each after the first opened by
`<|start|>assistant`; the `analysis` channel is the thinking (`reasoning_content`), `commentary` without
a recipient and `final` are the text, and a message to `functions.NAME` is a call of that tool with the
body as its JSON arguments. Text that does not follow the format stays the reply's text as written
(llama-server answers it with an error)."""

from __future__ import annotations

import json
import re
import uuid
from typing import Any

from .text import partial_tag

# the markers the reply is read by: special tokens of gpt-oss's vocabulary whose text libllama always
# renders (it makes them user-defined tokens)
START, CHANNEL, MESSAGE, END, CONSTRAIN = "<|start|>assistant", "<|channel|>", "<|message|>", "<|end|>", "<|constrain|>"
MARKERS = (START.removesuffix("assistant"), CHANNEL, MESSAGE, END, CONSTRAIN)
CALL = "<|call|>"  # ends a call (an end-of-generation token: seldom in the text)
_HEADER = re.compile(
    r"(?:<\|channel\|>commentary(?: to=assistant)?)?"  # a stray commentary header gpt-oss-20b writes first
    r"(?: to=functions\.(?P<role_to>[^<\s]+))?"  # a call's recipient in the role header ...
    r"<\|channel\|>(?P<channel>analysis|commentary|final)"
    r"(?: to=functions\.(?P<to>[^<\s]+))?"  # ... or in the channel header
    r"(?:\s*(?:<\|constrain\|>)?[A-Za-z0-9_-]+)?"  # the body's type (json)
    r"<\|message\|>"
)
_LONGEST_HEADER = 256  # without <|message|> by then the text is no header


class HarmonyParser:
    """Feed the reply's text as it comes; get OpenAI chat deltas ({"reasoning_content"}, {"content"},
    {"tool_calls"}) for what is settled (ReplyParser's interface). `thinking`: the analysis channel is
    reasoning_content (else it stays in the text with its markers, as llama-server's reasoning format
    "none" leaves it)."""

    def __init__(self, thinking: bool, tools: dict[str, dict[str, Any]] | None = None) -> None:
        self.thinking = thinking
        self.tools = tools or {}
        self.mode = "header"  # header, body, next (after <|end|>), done (after the final message), raw
        self.pending = ""
        self.channel = ""
        self.header = ""  # the message's header as written
        self.to: str | None = None  # the tool a message calls
        self.calls: list[dict[str, Any]] = []

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
        text = self.pending
        if self.mode == "raw":
            self.pending = ""
            return _content(text)
        if self.mode == "done":  # what follows the final message is not read (llama-server's)
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
                if final or len(text) > _LONGEST_HEADER or not _may_open(text):
                    self.mode = "raw"
                return []
            header = _HEADER.fullmatch(text[: end + len(MESSAGE)])
            if header is None:
                self.mode = "raw"
                return []
            self.header, self.channel = header.group(0), header.group("channel")
            self.to = header.group("to") or header.group("role_to")
            self.pending, self.mode = text[end + len(MESSAGE) :], "body"
            if self.channel == "analysis" and not self.thinking:
                return _content(self.header)
            return []
        # the body of a message
        ends = [found for tag in (END, CALL) if (found := text.find(tag)) >= 0]
        if ends:
            cut = min(ends)
            body, self.pending = text[:cut], text[cut + len(END if text.startswith(END, cut) else CALL) :]
            self.mode = "done" if self.channel == "final" or self.to else "next"
            return self._body(body)
        if self.to is not None and not final:  # a call's arguments are read whole
            return []
        keep = 0 if final else max(partial_tag(text, END), partial_tag(text, CALL))
        self.pending = text[len(text) - keep :]
        if final:  # the reply ended inside this message
            self.mode = "done"
        return self._body(text[: len(text) - keep])

    def _body(self, text: str) -> list[dict[str, Any]]:
        if self.to is not None:
            try:
                arguments = json.loads(text)
            except ValueError:  # not a call after all: the message stays text, as written
                return _content(self.header + text)
            call = {
                "index": len(self.calls),
                "id": f"call_{uuid.uuid4().hex}",
                "type": "function",
                "function": {"name": self.to, "arguments": json.dumps(arguments, ensure_ascii=False)},
            }
            self.calls.append(call)
            return [{"tool_calls": [call]}]
        if self.channel == "analysis":
            if self.thinking:
                return [{"reasoning_content": text}] if text else []
            return _content(text + (END if self.mode == "next" else ""))  # its <|end|> read
        return _content(text)


def _content(text: str) -> list[dict[str, Any]]:
    return [{"content": text}] if text else []


def _may_open(text: str) -> bool:
    """`text` may still become a message's header."""
    return any(text.startswith(p) or p.startswith(text) for p in (CHANNEL, " to=functions."))
