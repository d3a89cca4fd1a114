"""Tool calls read out of a reply's text, their arguments as llama-server hands them out: a call written
as JSON keeps its arguments object as written; one written as tagged parameters (Qwen3-Coder's XML, Muse
Glimmer's ATEM) gets them joined into compact JSON, a string parameter escaped, any other as written."""

from __future__ import annotations

import json
import re
import secrets
import string
import uuid
from typing import Any

from .text import partial_tag

# the calls that run to the reply's end, after the marker that opens them: Llama 3.x writes one JSON
# object {"name": ..., "parameters": {...}} (its marker is the object's own brace), Mistral Nemo a JSON list
# of {"name": ..., "arguments": {...}, "id": ...} after [TOOL_CALLS]
TAIL_OPENERS = {"llama3": "{", "mistral": "[TOOL_CALLS]"}
_SPACE = re.compile(r"[ \t\n\r]*")
_DECODER = json.JSONDecoder()


def tool_call(index: int, name: str, arguments: str, call_id: str | None = None) -> dict[str, Any]:
    """A call in the shape of OpenAI's chat deltas; `call_id`: the one the reply gave it (Mistral's)."""
    return {
        "index": index,
        "id": call_id or f"call_{uuid.uuid4().hex}",
        "type": "function",
        "function": {"name": name, "arguments": arguments},
    }


def json_object(text: str, at: int = 0) -> tuple[dict[str, tuple[Any, str]], int] | None:
    """The JSON object that begins at `text[at]` (after whitespace): each key's value and the value's text
    as written, and where the object ends; None where none begins there. A comma before the closing brace
    is allowed (llama-server's grammar for Mistral's calls writes one where no id follows)."""
    i = _SPACE.match(text, at).end()
    if not text.startswith("{", i):
        return None
    members: dict[str, tuple[Any, str]] = {}
    i = _SPACE.match(text, i + 1).end()
    try:
        while not text.startswith("}", i):
            key, i = _DECODER.raw_decode(text, i)
            i = _SPACE.match(text, i).end()
            if not isinstance(key, str) or not text.startswith(":", i):
                return None
            begin = _SPACE.match(text, i + 1).end()
            value, i = _DECODER.raw_decode(text, begin)
            members[key] = (value, text[begin:i])
            i = _SPACE.match(text, i).end()
            if text.startswith(",", i):
                i = _SPACE.match(text, i + 1).end()
            elif not text.startswith("}", i):
                return None
    except ValueError:
        return None
    return members, i + 1


def json_call(text: str, args_keys: tuple[str, ...], others: tuple[str, ...] | None = None) -> tuple[str, str] | None:
    """(name, arguments) of a call written as one JSON object, whitespace around it aside (call_members)."""
    read = json_object(text)
    if read is None or not _at_end(text, read[1]):
        return None
    return call_members(read[0], args_keys, others)


def call_members(
    members: dict[str, tuple[Any, str]], args_keys: tuple[str, ...], others: tuple[str, ...] | None = ()
) -> tuple[str, str] | None:
    """(name, arguments) of a call's JSON object: its "name", its arguments under the first of `args_keys`
    it has (an object: as written; a string: that string) and no keys but `others` (None: any); None if
    it is no such call."""
    name = members.get("name", (None, ""))[0]
    key = next((k for k in args_keys if k in members), None)
    if not isinstance(name, str) or key is None:
        return None
    if others is not None and not set(members) <= {"name", key, *others}:
        return None
    value, written = members[key]
    if isinstance(value, str):
        return name, value
    return (name, written) if isinstance(value, dict) else None


def tail_calls(tool_format: str, text: str, tools: dict[str, Any]) -> list[tuple[str, str, str | None]] | None:
    """(name, arguments, id) of each call in `text`, the reply from its TAIL_OPENERS marker on; None where
    it is not calls to `tools` in the format (the text stays the reply's)."""
    if tool_format == "llama3":
        read = json_object(text)
        if read is None or not _at_end(text, read[1]) or read[0].get("type", ("function",))[0] != "function":
            return None
        call = call_members(read[0], ("parameters",), ("type",))
        return [(*call, None)] if call is not None and call[0] in tools else None
    at = _SPACE.match(text, len(TAIL_OPENERS["mistral"])).end()
    if not text.startswith("[", at):
        return None
    calls: list[tuple[str, str, str | None]] = []
    at += 1
    while (read := json_object(text, at)) is not None:
        members, at = read
        call = call_members(members, ("arguments",), ("id",))
        if call is None or call[0] not in tools:
            return None
        # the id as llama-server takes it (the value's text without its quotes); one of nine letters and
        # digits where the reply gave none: Mistral's template refuses other ids in the calls it is given back
        calls.append((*call, members["id"][1].strip('"') if "id" in members else _nine_characters()))
        at = _SPACE.match(text, at).end()
        if not text.startswith(",", at):
            break
        at += 1
    at = _SPACE.match(text, at).end()
    return calls if calls and text.startswith("]", at) and _at_end(text, at + 1) else None


def _nine_characters() -> str:
    return "".join(secrets.choice(string.ascii_letters + string.digits) for _ in range(9))


def _at_end(text: str, at: int) -> bool:
    """Only whitespace follows `text[at]`."""
    return _SPACE.match(text, at).end() == len(text)


def tagged_arguments(parameters: list[tuple[str, str]], schema: dict[str, Any]) -> str:
    """The compact JSON object of a call's (name, value as written) parameters: a value the tool's
    parameter `schema` types as string (or does not type) is the string, any other its JSON as written (a
    string where it is no JSON)."""
    properties = schema.get("properties") or {}
    members = (
        json.dumps(key, ensure_ascii=False) + ":" + json_value(value, is_typed(properties, key))
        for key, value in parameters
    )
    return "{" + ",".join(members) + "}"


def is_typed(properties: dict[str, Any], key: str) -> bool:
    """A tagged parameter's value is JSON: its schema types it, not as a string."""
    return properties.get(key, {}).get("type", "string") != "string"


class CallReader:
    """One call's deltas as its text comes, as llama-server streams them: the call named (with an id) once
    its name is read, then its arguments piece by piece. `read` takes the text so far each time, the call's
    own from `at` on (after its opening tag); once `started`, the text is that call whatever follows, and
    `call` holds it whole so far. Each read scans only what came since the last."""

    def __init__(self, index: int, at: int = 0) -> None:
        self.index = index
        self.call: dict[str, Any] | None = None
        self.at = at  # how much of the text is read
        self.done = False  # its arguments are whole: what follows in the block is not read

    @property
    def started(self) -> bool:
        return self.call is not None

    def read(self, text: str, final: bool) -> list[dict[str, Any]]:
        raise NotImplementedError

    def _name(self, name: str) -> None:
        self.call = tool_call(self.index, name, "")

    def _deltas(self, arguments: str, named: bool) -> list[dict[str, Any]]:
        """The deltas of `arguments` added to the call (`named`: it was named just now)."""
        assert self.call is not None
        self.call["function"]["arguments"] += arguments
        if named:
            return [{"tool_calls": [{**self.call, "function": {**self.call["function"], "arguments": arguments}}]}]
        return [{"tool_calls": [{"index": self.index, "function": {"arguments": arguments}}]}] if arguments else []


# a JSON call's opening up to its arguments object: {"name": ..., "arguments" (or "parameters"): {
_JSON_HEAD = re.compile(
    r'\s*\{\s*(?:"type"\s*:\s*"function"\s*,\s*)?"name"\s*:\s*("(?:[^"\\]|\\.)*")\s*,\s*"(arguments|parameters)"\s*:\s*\{'
)


def opens_no_call(text: str) -> bool:
    """`text`, from a "{" on, is no call's opening (_JSON_HEAD) however it goes on: its first key is not
    "name" or "type"."""
    rest = text[1:].lstrip()
    end = rest.find('"', 1)
    return bool(rest) and (rest[0] != '"' or (end > 0 and rest[1:end] not in ("name", "type")))


class JsonCallReader(CallReader):
    """A call written as {"name": ..., ARGS_KEY: {...}}: streamed from its arguments' opening brace to their
    closing one (as written); `tools`: the names it may call (None: any)."""

    def __init__(self, index: int, args_keys: tuple[str, ...], tools: dict[str, Any] | None, at: int = 0) -> None:
        super().__init__(index, at)
        self.args_keys, self.tools = args_keys, tools
        self.depth, self.in_string, self.escaped = 0, False, False

    def read(self, text: str, final: bool) -> list[dict[str, Any]]:
        named = False
        if self.call is None:
            m = _JSON_HEAD.match(text, self.at)
            if m is None or m.group(2) not in self.args_keys:
                return []
            name = json.loads(m.group(1))
            if self.tools is not None and name not in self.tools:
                return []
            self._name(name)
            self.at, named = m.end() - 1, True
        start = self.at
        while not self.done and self.at < len(text):
            self._scan(text[self.at])
            self.at += 1
        piece = text[start : self.at]
        if final and not self.done:  # cut short: closed, as llama-server closes it
            piece += '"' * self.in_string + "}" * self.depth
            self.done = True
        return self._deltas(piece, named)

    def _scan(self, c: str) -> None:
        if self.in_string:
            self.escaped, self.in_string = (False, True) if self.escaped else (c == "\\", c != '"')
        elif c == '"':
            self.in_string = True
        elif c in "{[":
            self.depth += 1
        elif c in "}]":
            self.depth -= 1
            self.done = self.depth == 0


_FUNCTION_OPEN = re.compile(r"\s*<function=([^>\n]+)>")
_PARAMETER_OPEN = re.compile(r"<parameter=([^>\n]+)>\n?")
_XML_TAGS = ("</function>", "<parameter=")
PARAMETER_CLOSE = "</parameter>"


class XmlCallReader(CallReader):
    """A call in Qwen3-Coder's XML, <function=NAME> then <parameter=P>\\nVALUE\\n</parameter> each: its
    arguments as compact JSON (tagged_arguments), a string value streamed as it comes, a typed one whole."""

    def __init__(self, index: int, tools: dict[str, Any], at: int = 0) -> None:
        super().__init__(index, at)
        self.tools = tools
        self.properties: dict[str, Any] = {}  # the called tool's parameters
        self.key: str | None = None  # the parameter whose value is being read
        self.typed = False  # ... and whether it is JSON (its schema's type is not string)
        self.count = 0  # the parameters read

    def read(self, text: str, final: bool) -> list[dict[str, Any]]:
        out, named = "", False
        if self.call is None:
            m = _FUNCTION_OPEN.match(text, self.at)
            if m is None:
                return []
            name = m.group(1).strip()
            self._name(name)
            self.properties = (self.tools.get(name, {}).get("parameters") or {}).get("properties") or {}
            self.at, named, out = m.end(), True, "{"
        while not self.done and (piece := self._step(text, final)) is not None:
            out += piece
        if final and not self.done:  # cut short: closed, as llama-server closes it
            if self.key is not None:
                out += json_value(text[self.at :], True) if self.typed else _escaped(text[self.at :]) + '"'
            out += "}"
            self.done = True
        return self._deltas(out, named)

    def _step(self, text: str, final: bool) -> str | None:
        """The arguments' text of what can be read from self.at on; None: nothing yet."""
        if self.key is not None:  # a value, up to </parameter> (the newline before it is the tag's)
            end = text.find(PARAMETER_CLOSE, self.at)
            if end < 0:  # a string's text so far, short of what may become its end
                if self.typed or final:
                    return None
                safe = len(text) - partial_tag(text, PARAMETER_CLOSE)
                safe = max(self.at, safe - text.endswith("\n", 0, safe))
                piece, self.at = text[self.at : safe], safe
                return _escaped(piece) or None
            value = text[self.at : end - text.endswith("\n", 0, end)]
            self.at, self.key = end + len(PARAMETER_CLOSE), None
            return json_value(value, True) if self.typed else _escaped(value) + '"'
        rest = text[self.at :].lstrip()
        self.at = len(text) - len(rest)
        if rest.startswith("</function>"):
            self.done = True
            return "}"
        m = _PARAMETER_OPEN.match(rest)
        if m is not None and (m.group(0).endswith("\n") or len(rest) > m.end() or final):
            self.key, self.at = m.group(1).strip(), self.at + m.end()
            self.typed = is_typed(self.properties, self.key)
            self.count += 1
            return "," * (self.count > 1) + json.dumps(self.key, ensure_ascii=False) + ":" + '"' * (not self.typed)
        if not rest or (not final and any(tag.startswith(rest[: len(tag)]) for tag in _XML_TAGS)):
            return None
        skip = rest.find("<", 1)  # text that is neither tag: passed over
        self.at = len(text) if skip < 0 else self.at + skip
        return ""


def json_value(value: str, typed: bool) -> str:
    """A tagged parameter's value as JSON: a typed one as written where it is JSON, else the string."""
    if typed:
        try:
            json.loads(value)
            return value.strip()
        except ValueError:
            pass
    return json.dumps(value, ensure_ascii=False)


def _escaped(text: str) -> str:
    """`text` as the inside of a JSON string."""
    return json.dumps(text, ensure_ascii=False)[1:-1]
