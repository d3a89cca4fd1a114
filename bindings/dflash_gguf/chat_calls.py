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


def json_call(text: str, args_keys: tuple[str, ...], others: tuple[str, ...] | None = ()) -> tuple[str, str] | None:
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
    properties = schema.get("properties", {})
    members = []
    for key, value in parameters:
        text = json.dumps(value, ensure_ascii=False)
        if properties.get(key, {}).get("type", "string") != "string":
            try:
                json.loads(value)
                text = value.strip()
            except ValueError:
                pass
        members.append(f"{json.dumps(key, ensure_ascii=False)}:{text}")
    return "{" + ",".join(members) + "}"
