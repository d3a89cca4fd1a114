"""What SpeculativeLlama mirrors of llama_cpp.Llama's API beyond sampling: the shapes of `logprobs` in
completions and chats, and what its chat handlers make of `response_format` and `tools` (grammars, and
a forced call's shape)."""

from __future__ import annotations

import codecs
import json
import uuid
from collections.abc import Callable
from typing import Any


def check_logprobs(n: int | None) -> None:
    if n is None:
        return
    if isinstance(n, bool) or not isinstance(n, int) or n < 0:
        raise ValueError(f"logprobs must be an int >= 0 (the most likely tokens to list) or None, got {n!r}")


# (logprob, [(id, logprob) of the most likely]) of one generated token
TokenLogprob = tuple[float, list[tuple[int, float]]]


class LogprobCursor:
    """llama_cpp.Llama's `logprobs` of a completion's tokens, handed out as their text is released: a
    chunk that brings the released text to `upto` characters gets the tokens that start before that
    (so a stop string cuts tokens and text alike, and a streamed chunk carries its own tokens).
    `tokens` and `logprobs` are the generation's lists, read as they grow (with echo, the prompt's tokens
    first, the first of them with None: OpenAI's shape)."""

    def __init__(self, tokens: list[int], logprobs: list[TokenLogprob | None], piece: Callable[[int], bytes],
                 text_offset: int) -> None:
        self._tokens, self._logprobs, self._piece = tokens, logprobs, piece
        self._base, self._next, self._chars = text_offset, 0, 0
        self._decoder = codecs.getincrementaldecoder("utf-8")(errors="ignore")

    def take(self, upto: int) -> dict[str, list[Any]]:
        out: dict[str, list[Any]] = {"tokens": [], "text_offset": [], "token_logprobs": [], "top_logprobs": []}
        while self._next < min(len(self._tokens), len(self._logprobs)) and self._chars < upto:
            tok, entry = self._tokens[self._next], self._logprobs[self._next]
            piece = self._piece(tok)
            token_str = piece.decode("utf-8", "ignore")
            lp, best = None, None
            if entry is not None:
                lp, top = entry
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
        raise ValueError("response_format must be {'type': 'text' | 'json_object' | 'json_schema', ...}, "
                         f"got {response_format!r}")
    if schema is None:
        return llama_grammar.LlamaGrammar.from_string(llama_grammar.JSON_GBNF, verbose=False)
    return schema_grammar(schema, "response_format")


# llama-cpp-python's converter lets raw control characters into JSON strings, which strict JSON parsers
# refuse; llama.cpp's own converter (json-schema-to-grammar.cpp) keeps them out, as this rule does
_LOOSE_CHAR = r'char ::= [^"\\] |'
_JSON_CHAR = r'char ::= [^"\\\x7F\x00-\x1F] |'


def schema_grammar(schema: Any, what: str) -> Any:
    from llama_cpp import llama_grammar

    try:
        gbnf = llama_grammar.json_schema_to_gbnf(json.dumps(schema))
        return llama_grammar.LlamaGrammar.from_string(gbnf.replace(_LOOSE_CHAR, _JSON_CHAR), verbose=False)
    except Exception as e:  # the converter raises whatever it meets first
        raise ValueError(f"{what}: the JSON schema cannot be turned into a grammar: {e}") from e


def tool_functions(tools: Any, functions: Any) -> dict[str, dict[str, Any]]:
    """{name: function} of a chat's tools (or legacy functions)."""
    if functions is not None:
        tools = [{"type": "function", "function": f} for f in functions]
    try:
        return {t["function"]["name"]: t["function"] for t in tools or []}
    except (TypeError, KeyError) as e:
        raise ValueError(f"tools must be [{{'type': 'function', 'function': {{'name': ...}}}}, ...], got {tools!r}") from e


def any_tool_grammar(functions: dict[str, dict[str, Any]]) -> Any:
    """The llama_cpp.LlamaGrammar of one call to any of the tools: {"name": ..., "arguments": {...}}, the
    arguments following that tool's parameter schema."""
    return schema_grammar({"oneOf": [
        {"type": "object", "properties": {"name": {"const": n}, "arguments": f.get("parameters", {})},
         "required": ["name", "arguments"]} for n, f in functions.items()]}, "the tools' parameters")


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
        raise ValueError("tool_choice must be 'none', 'auto', 'required' or {'type': 'function', 'function': "
                         f"{{'name': ...}}}}, got {tool_choice!r}") from e
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
        return {"role": "assistant", "content": None, "function_call": call,
                "tool_calls": [{"id": self.id, "type": "function", "function": call}]}

    def delta(self, text: str) -> dict[str, Any]:
        """A streamed chunk of the call: as OpenAI streams them, the first names it (id, type, name) and
        the later ones add to its arguments only (clients concatenate every field they are sent)."""
        call = self.call(text)
        if call is None:
            return {"content": text}
        if self._named_in_stream:
            more = {"arguments": call["arguments"]}
            return {"role": None, "content": None, "function_call": more,
                    "tool_calls": [{"index": 0, "function": more}]}
        self._named_in_stream = True
        return {"role": None, "content": None, "function_call": call,
                "tool_calls": [{"index": 0, "id": self.id, "type": "function", "function": call}]}
