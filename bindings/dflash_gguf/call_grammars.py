"""The lazy grammars that hold a tool call the model starts, in its template's syntax, to the tools' names
and parameter schemas, as llama-server's do: free text until the call's opening word, constrained from
it on."""

from __future__ import annotations

import json
import re
from typing import Any

from .chat_calls import TAIL_OPENERS
from .chat_reply import CALL_CLOSE, CALL_OPEN, ReplySyntax

# the whitespace between calls is bounded: a small model may otherwise emit newlines for ever
_GAP = "[ \\n]{0,2}"
_NL = "\n"
HARMONY_RECIPIENT = " to=functions."  # where a gpt-oss call names its tool
_MAX_ANY_ORDER = 6


def tool_call_grammar(
    tools: dict[str, dict[str, Any]], syntax: ReplySyntax, parallel: bool = True
) -> tuple[str, tuple[str, ...]] | None:
    """(GBNF, trigger words) of the lazy grammar for calls in `syntax`; None where it has none here
    (Llama 3.x's calls begin with no word of their own). Not `parallel`: one call, then the end (OpenAI's
    parallel_tool_calls false)."""
    more = "*" if parallel else "{0}"  # the calls after the first
    if not tools or syntax.tool_format not in ("hermes", "mistral", "qwen3-coder", "harmony"):
        return None
    if syntax.tool_format == "harmony":
        return _harmony_call(tools), (HARMONY_RECIPIENT,)
    if syntax.tool_format == "qwen3-coder":
        bare = tuple(f"<function={name}>" for name in tools) if syntax.bare_calls else ()
        return _xml_calls(tools, bool(bare), more), (CALL_OPEN, *bare)
    from .llama_compat import any_tool_grammar

    call = any_tool_grammar(tools)
    rules = re.sub(r"^root\s*::=", "tool-call-json ::=", call._grammar, count=1, flags=re.MULTILINE)
    if syntax.tool_format == "mistral":  # [TOOL_CALLS][{call}, ...]
        opener = TAIL_OPENERS["mistral"]
        calls = f'tool-call-json ({_GAP} "," {_GAP} tool-call-json){more}'
        return f'root ::= "{opener}" {_GAP} "[" {calls} "]"\n{rules}', (opener,)
    block = f'"{CALL_OPEN}" {_GAP} tool-call-json {_GAP} "{CALL_CLOSE}"'
    return f"root ::= {block} ({_GAP} {block}){more}\n{rules}", (CALL_OPEN,)


def _harmony_call(tools: dict[str, dict[str, Any]]) -> str:
    """gpt-oss's call from its recipient on, in either header: ` to=functions.NAME`, the rest of the role
    header's channel (`<|channel|>commentary`) where it is there, the body's type (` <|constrain|>json`),
    `<|message|>` and the arguments, JSON of the tool's schema (the end of the call, <|call|>, is an end of
    generation: the grammar lets it come once the arguments are whole)."""
    converter = _schema_converter()
    calls = []
    for i, (name, function) in enumerate(tools.items()):
        schema = converter.resolve_refs(function.get("parameters") or {"type": "object"}, name)
        args = converter.visit(schema, f"tool-{i}-args")
        calls.append(f'{_literal(name)} ("<|channel|>" ("commentary" | "analysis"))? body-type? "<|message|>" {args}')
    rules = [
        f"root ::= {_literal(HARMONY_RECIPIENT)} ({' | '.join(calls)})",
        # the type after a space or <|constrain|> (never run on from the name), short: "json" in practice
        'body-type ::= (" "? "<|constrain|>" | " ") [A-Za-z0-9_-]{1,16}',
    ]
    return "\n".join(rules) + "\n" + _schema_rules(converter)


def _xml_calls(tools: dict[str, dict[str, Any]], bare: bool, more: str) -> str:
    """Qwen3-Coder's (and Qwen3.5's) calls, as their templates write them: <tool_call>\\n<function=NAME>\\n,
    then <parameter=P>\\nVALUE\\n</parameter>\\n for any of the tool's parameters, </function>\\n</tool_call>;
    a string parameter's value any text without "\\n</parameter>", any other's JSON of its schema; `bare`:
    the first call may leave out its <tool_call> (ReplySyntax.bare_calls); `more`: how many calls may follow
    it (a GBNF repetition)."""
    converter = _schema_converter()
    close = "\n</parameter>\n"
    rules = _without("xml-string", close.rstrip())
    functions = []
    for i, (name, function) in enumerate(tools.items()):
        schema = converter.resolve_refs(function.get("parameters") or {}, name)
        required, optional = {}, []
        for j, (key, prop) in enumerate((schema.get("properties") or {}).items()):
            value = "xml-string" if _takes_text(prop) else converter.visit(prop, f"tool-{i}-arg-{j}")
            argument = f"{_literal(f'<parameter={key}>' + _NL)} {value} {_literal(close)}"
            if key in (schema.get("required") or ()):
                required[key] = argument
            else:
                optional.append(argument)
        rest = f"({' | '.join(optional)})*" if optional else ""
        rules += _in_any_order(f"tool-{i}-args", list(required.values()), rest)
        opening, closing = _literal(f"<function={name}>" + _NL), _literal("</function>" + _NL)
        rules.append(f"tool-{i} ::= {opening} tool-{i}-args {closing}")
        functions.append(f"tool-{i}")
    block = f'{_literal(CALL_OPEN + _NL)} ({" | ".join(functions)}) "{CALL_CLOSE}"'
    first = f'({block} | ({" | ".join(functions)}) "{CALL_CLOSE}")' if bare else block
    rules.insert(0, f"root ::= {first} ({_GAP} {block}){more}")
    return "\n".join(rules) + "\n" + _schema_rules(converter)


def _takes_text(schema: dict[str, Any]) -> bool:
    """A parameter of this schema may be a string: its value is then any text (llama-server's grammar keeps
    only the text rule where a string is one of the types)."""
    kind = schema.get("type")
    if isinstance(kind, str):
        return kind == "string"
    if isinstance(kind, list):
        return "string" in kind
    choices = schema.get("anyOf", schema.get("oneOf"))
    if choices is not None:
        return any(_takes_text(c) for c in choices if isinstance(c, dict))
    values = schema.get("enum", [schema["const"]] if "const" in schema else None)
    return values is None or any(isinstance(v, str) for v in values)


def _in_any_order(name: str, parts: list[str], rest: str) -> list[str]:
    """GBNF rules: `name` is every one of `parts` once, in any order (Qwen does not always keep its
    parameters' order, llama-server's grammar allows for it), then `rest`. A rule per set of parts still to
    come (2^n of them: beyond _MAX_ANY_ORDER parts, in the given order)."""
    if len(parts) > _MAX_ANY_ORDER:
        return [f"{name} ::= {' '.join(parts)} {rest}"]
    rules = []
    for left in range(1 << len(parts)):
        options = [f"{p} {name}-{left & ~(1 << i)}" for i, p in enumerate(parts) if left & (1 << i)]
        body = " | ".join(options) if options else rest or '""'
        rules.append(f"{name}-{left} ::= {body}")
    return [f"{name} ::= {name}-{(1 << len(parts)) - 1}", *rules]


def _schema_converter() -> Any:
    """llama_cpp's JSON-schema-to-GBNF converter, for rules named by the caller."""
    from llama_cpp.llama_grammar import SchemaConverter

    return SchemaConverter(prop_order={}, allow_fetch=False, dotall=False, raw_pattern=False)


def _schema_rules(converter: Any) -> str:
    """The rules `converter` made, strings without raw control characters (llama_compat.schema_grammar)."""
    from .llama_compat import JSON_CHAR, LOOSE_CHAR

    return str(converter.format_grammar()).replace(LOOSE_CHAR, JSON_CHAR)


def _literal(text: str) -> str:
    return json.dumps(text)  # a GBNF string literal is a JSON one


def _without(name: str, word: str) -> list[str]:
    """GBNF rules: `name` is any text in which `word` does not occur (`word`'s first character occurs in
    it only there first). A rule per state of matching `word`: name-K after its first K characters; a
    character that breaks the match starts again from nothing, or from one if it is the first."""
    first = word[0]
    rules = [f"{name} ::= ([^{_class(first)}] {name} | {_literal(first)} {name}-1)?"]
    for k in range(1, len(word)):
        ahead = f"{_literal(word[k])} {name}-{k + 1} | " if k + 1 < len(word) else ""
        others = f"[^{_class(first + word[k])}] {name}"
        rules.append(f"{name}-{k} ::= ({ahead}{_literal(first)} {name}-1 | {others})?")
    return rules


def _class(chars: str) -> str:
    """`chars` inside a GBNF character class."""
    return "".join("\\n" if c == "\n" else ("\\" + c if c in "]\\^-" else c) for c in chars)
