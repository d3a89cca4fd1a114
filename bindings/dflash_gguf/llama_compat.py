"""What SpeculativeLlama mirrors of llama_cpp.Llama's API beyond sampling: the shapes of `logprobs` in
completions and chats, and what its chat handlers make of `response_format` and `tools` (grammars, and
a forced call's shape)."""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from .text import utf8_decoder


def check_logprobs(n: int | None) -> None:
    if n is None:
        return
    if isinstance(n, bool) or not isinstance(n, int) or n < 0:
        raise ValueError(f"logprobs must be an int >= 0 (the most likely tokens to list) or None, got {n!r}")


# (logprob, [(id, logprob) of the most likely]) of one generated token
TokenLogprob = tuple[float, list[tuple[int, float]]]


@dataclass(frozen=True)
class LogprobEntry:
    """One token of a completion's logprobs: `token` is the text it completes (its piece decoded after the
    bytes before it; "" for the leading bytes of a character split over several tokens), `piece` its
    bytes; `top`: (key, bytes, logprob) of the most likely, the token itself under `token`; `id` the token's
    id and `best` (id, logprob) of the most likely."""

    token: str
    piece: bytes
    offset: int
    logprob: float | None
    top: list[tuple[str, bytes, float]] | None
    id: int = -1
    best: tuple[tuple[int, float], ...] = ()


class LogprobCursor:
    """llama_cpp.Llama's `logprobs` of a completion's tokens, handed out as their text is released: a
    chunk that brings the released text to `upto` characters gets the tokens that start before that
    (so a stop string cuts tokens and text alike, and a streamed chunk carries its own tokens).
    `tokens` and `logprobs` are the generation's lists, read as they grow (with echo, the prompt's tokens
    first, the first of them with None: OpenAI's shape); the first `n_special` tokens are rendered with
    their special text (an echoed text prompt's <|im_start|>). The tokens' texts join to the text
    exactly, multi-byte characters split over byte tokens included; see `top_keys` for the others."""

    def __init__(
        self,
        tokens: list[int],
        logprobs: list[TokenLogprob | None],
        piece: Callable[[int, bool], bytes],
        text_offset: int,
        n_special: int = 0,
    ) -> None:
        self._tokens, self._logprobs, self._piece = tokens, logprobs, piece
        self._base, self._next, self._chars, self._n_special = text_offset, 0, 0, n_special
        self._decoder = utf8_decoder()  # TextStream's decoding, so the texts add up to the text

    def take(self, upto: int, end: int | None = None) -> list[LogprobEntry]:
        """The entries of the tokens that start before `upto` characters; with `end`, the completion's
        last: and the end-of-generation token it ended at (text "", the entry after the tokens')."""
        out: list[LogprobEntry] = []
        pending = b""
        while self._next < min(len(self._tokens), len(self._logprobs)) and self._chars < upto:
            tok, entry = self._tokens[self._next], self._logprobs[self._next]
            piece = self._piece(tok, self._next < self._n_special)
            pending = self._decoder.getstate()[0]
            text = self._decoder.decode(piece)
            out.append(self._entry(tok, text, piece, pending, entry))
            self._chars += len(text)
            self._next += 1
        if out and self._chars < upto and self._next == len(self._tokens):
            # the text's end: an incomplete character the last token left, replaced as TextStream flushes it
            tail = self._decoder.decode(b"", final=True)
            last, tok = out[-1], self._tokens[self._next - 1]
            out[-1] = self._entry(tok, last.token + tail, last.piece, pending, self._logprobs[self._next - 1])
            self._chars += len(tail)
        if end is not None and self._next == len(self._tokens) < len(self._logprobs):
            out.append(
                self._entry(end, "", self._piece(end, False), self._decoder.getstate()[0], self._logprobs[self._next])
            )
            self._next += 1
        return out

    def _entry(self, tok: int, text: str, piece: bytes, pending: bytes, entry: TokenLogprob | None) -> LogprobEntry:
        offset = self._base + self._chars
        if entry is None:
            return LogprobEntry(text, piece, offset, None, None, tok)
        lp, best = entry
        top = top_keys(tok, text, piece, lp, best, pending, self._piece)
        return LogprobEntry(text, piece, offset, lp, top, tok, tuple(best))


def top_keys(
    tok: int,
    text: str,
    piece: bytes,
    logprob: float,
    best: list[tuple[int, float]],
    pending: bytes,
    piece_of: Callable[[int, bool], bytes],
) -> list[tuple[str, bytes, float]]:
    """The most likely tokens at one place as (key, bytes, logprob), the chosen one (`tok`, keyed by its
    text) in its rank or last. Keys are distinct: another token is keyed by the text it would complete
    there (after the `pending` bytes of an unfinished character) or else its own text, when whole; a special
    token by its text; otherwise by its bytes, as OpenAI writes a token that is no text by itself
    ("bytes:\\xe2")."""
    taken = {text}
    out: list[tuple[str, bytes, float]] = []
    for i, v in best:
        if i == tok:
            out.append((text, piece, logprob))
            continue
        p = piece_of(i, False)
        candidates: list[tuple[str, bytes]] = []
        if p:
            for whole in (pending + p, p) if pending else (p,):
                with contextlib.suppress(UnicodeDecodeError):
                    candidates.append((whole.decode("utf-8"), p))
            candidates.append(("bytes:" + "".join(f"\\x{b:02x}" for b in p), p))
        else:
            special = piece_of(i, True)
            if special:
                candidates.append((special.decode("utf-8", "replace"), special))
        key, raw = next(((k, b) for k, b in candidates if k not in taken), (f"token:{i}", p))
        while key in taken:
            key += "'"
        taken.add(key)
        out.append((key, raw, v))
    if all(i != tok for i, _ in best):
        out.append((text, piece, logprob))
    return out


def completion_logprobs(entries: list[LogprobEntry]) -> dict[str, list[Any]]:
    """A completion's logprobs in llama_cpp.Llama's (OpenAI's) shape."""
    return {
        "tokens": [e.token for e in entries],
        "text_offset": [e.offset for e in entries],
        "token_logprobs": [e.logprob for e in entries],
        "top_logprobs": [None if e.top is None else {k: v for k, _, v in e.top} for e in entries],
    }


def chat_logprobs(entries: list[LogprobEntry]) -> dict[str, Any]:
    """A chat reply's logprobs in OpenAI's chat shape: each token's `bytes` are its own (a character split
    over several tokens: their bytes joined)."""
    return {
        "content": [
            {
                "token": e.token,
                "logprob": e.logprob,
                "bytes": list(e.piece),
                "top_logprobs": [{"token": k, "logprob": v, "bytes": list(b)} for k, b, v in e.top or []],
            }
            for e in entries
        ],
        "refusal": None,
    }


def sum_usage(usages: list[dict[str, Any]]) -> dict[str, Any]:
    """The usage of several completions answered as one (a list of prompts)."""
    return {
        k: sum_usage([u[k] for u in usages]) if isinstance(v, dict) else sum(u[k] for u in usages)
        for k, v in usages[0].items()
    }


def system_fingerprint(version: str, target: str, draft: str, sampler: str) -> str:
    """OpenAI's `system_fingerprint` (llama-server's is its build, "b<build>-<commit>"): this package's
    version and a hash of what decides its outputs: libllama's version (llama-cpp-python), the target and
    drafter files (path, size, modification time) and the sampler. The same for a given setup, across
    restarts; another file or build, another fingerprint."""
    import llama_cpp

    def identity(path: str) -> list[Any]:
        try:
            st = os.stat(path)
        except OSError:
            return [path]
        return [os.path.realpath(path), st.st_size, st.st_mtime_ns]

    what = [getattr(llama_cpp, "__version__", ""), identity(target), identity(draft), sampler]
    return f"dflash-gguf-{version}-{hashlib.sha256(json.dumps(what).encode()).hexdigest()[:12]}"


def response_format_grammar(response_format: Any) -> Any:
    """The llama_cpp.LlamaGrammar a chat's response_format asks for, as llama_cpp.Llama's chat handlers
    read it: {"type": "json_object"} any JSON object, with "schema": one that follows the JSON schema;
    also OpenAI's {"type": "json_schema", "json_schema": {"schema": ...}}; None or {"type": "text"}: none.
    A schema that cannot become a grammar is a ValueError (llama_cpp.Llama falls back to any JSON)."""
    from llama_cpp import llama_grammar

    if response_format is None:
        return None
    kind = response_format.get("type") if isinstance(response_format, dict) else None
    if kind == "text":
        return None
    if kind == "json_object":
        schema = response_format.get("schema")
    elif kind == "json_schema":
        spec = response_format.get("json_schema")
        if not isinstance(spec, dict) or "schema" not in spec:
            raise ValueError('response_format {"type": "json_schema"} needs "json_schema": {"schema": {...}}')
        schema = spec["schema"]
    else:
        raise ValueError(
            f"response_format must be {{'type': 'text' | 'json_object' | 'json_schema', ...}}, got {response_format!r}"
        )
    if schema is None:
        return llama_grammar.LlamaGrammar.from_string(llama_grammar.JSON_GBNF, verbose=False)
    return schema_grammar(schema, "response_format")


# llama-cpp-python's converter lets raw control characters into JSON strings, which strict JSON parsers
# refuse; llama.cpp's own converter (json-schema-to-grammar.cpp) keeps them out, as this rule does
LOOSE_CHAR = r'char ::= [^"\\] |'
JSON_CHAR = r'char ::= [^"\\\x7F\x00-\x1F] |'


def schema_grammar(schema: Any, what: str) -> Any:
    from llama_cpp import llama_grammar

    try:
        gbnf = llama_grammar.json_schema_to_gbnf(json.dumps(schema))
        return llama_grammar.LlamaGrammar.from_string(gbnf.replace(LOOSE_CHAR, JSON_CHAR), verbose=False)
    except Exception as e:  # the converter raises whatever it meets first
        raise ValueError(f"{what}: the JSON schema cannot be turned into a grammar: {e}") from e


def tool_functions(tools: Any, functions: Any) -> dict[str, dict[str, Any]]:
    """{name: function} of a chat's tools (or legacy functions)."""
    if functions is not None:
        tools = [{"type": "function", "function": f} for f in functions]
    try:
        return {t["function"]["name"]: t["function"] for t in tools or []}
    except (TypeError, KeyError) as e:
        raise ValueError(
            f"tools must be [{{'type': 'function', 'function': {{'name': ...}}}}, ...], got {tools!r}"
        ) from e


def any_tool_grammar(functions: dict[str, dict[str, Any]]) -> Any:
    """The llama_cpp.LlamaGrammar of one call to any of the tools: {"name": ..., "arguments": {...}}, the
    arguments following that tool's parameter schema."""
    return schema_grammar(
        {
            "oneOf": [
                {
                    "type": "object",
                    "properties": {"name": {"const": n}, "arguments": f.get("parameters", {})},
                    "required": ["name", "arguments"],
                }
                for n, f in functions.items()
            ]
        },
        "the tools' parameters",
    )


def forced_tool(named: dict[str, dict[str, Any]], tool_choice: Any, function_call: Any) -> ToolCall | None:
    """The call a chat reply is forced to make, or None, as llama_cpp.Llama's chat handlers read the
    arguments: `named` is tool_functions(tools, functions); legacy function_call becomes tool_choice; a
    tool_choice naming a function forces a call to it; "required" (OpenAI's; llama_cpp.Llama ignores it)
    a call to one of the tools; otherwise the tools only reach the chat template."""
    if function_call in ("none", "auto"):
        tool_choice = function_call
    elif isinstance(function_call, dict) and "name" in function_call:
        tool_choice = {"type": "function", "function": {"name": function_call["name"]}}
    elif function_call is not None:
        raise ValueError(f"function_call must be 'none', 'auto' or {{'name': ...}}, got {function_call!r}")
    if tool_choice is None or tool_choice in ("none", "auto"):
        return None
    if tool_choice == "required":
        if not named:
            raise ValueError("tool_choice='required' needs tools")
        return ToolCall(named, None)
    try:
        name = tool_choice["function"]["name"]
    except (TypeError, KeyError) as e:
        raise ValueError(
            "tool_choice must be 'none', 'auto', 'required' or {'type': 'function', 'function': "
            f"{{'name': ...}}}}, got {tool_choice!r}"
        ) from e
    if name not in named:
        raise ValueError(f"tool_choice names {name!r}, which is not among the tools")
    return ToolCall(named, name)


class ToolCall:
    """A chat reply forced to call a tool, in llama_cpp.Llama's shapes: a named one (the reply is its
    arguments, following its parameter schema) or, for tool_choice="required", any of them (the reply is
    {"name": ..., "arguments": {...}}, one of the tools with its schema)."""

    def __init__(self, functions: dict[str, dict[str, Any]], name: str | None) -> None:
        self.name = name
        self.id = f"call_{uuid.uuid4().hex}"
        self._named_in_stream = False
        if name is not None:
            self.grammar = schema_grammar(functions[name].get("parameters", {}), f"tool {name!r}'s parameters")
        else:
            self.grammar = any_tool_grammar(functions)

    def call(self, text: str) -> dict[str, str] | None:
        """{"name", "arguments"} of a reply (None: a reply to any tool the grammar did not finish)"""
        if self.name is not None:
            return {"name": self.name, "arguments": text}
        try:
            reply = json.loads(text)
        except ValueError:
            return None
        return {"name": reply["name"], "arguments": json.dumps(reply["arguments"])}

    def message(self, text: str) -> dict[str, Any]:
        call = self.call(text)
        if call is None:
            return {"role": "assistant", "content": text}
        return {
            "role": "assistant",
            "content": None,
            "function_call": call,
            "tool_calls": [{"id": self.id, "type": "function", "function": call}],
        }

    def delta(self, text: str) -> dict[str, Any]:
        """A streamed chunk of the call: as OpenAI streams them, the first names it (id, type, name) and
        the later ones add to its arguments only (clients concatenate every field they are sent)."""
        call = self.call(text)
        if call is None:
            return {"content": text}
        if self._named_in_stream:
            more = {"arguments": call["arguments"]}
            return {
                "role": None,
                "content": None,
                "function_call": more,
                "tool_calls": [{"index": 0, "function": more}],
            }
        self._named_in_stream = True
        return {
            "role": None,
            "content": None,
            "function_call": call,
            "tool_calls": [{"index": 0, "id": self.id, "type": "function", "function": call}],
        }
