"""Chat replies as llama-server hands them out: thinking apart (reasoning_content), tool calls parsed in
the template's syntax, and the lazy grammar that keeps a started call to the tools' schemas.

The parser on known texts (streamed character by character and whole); the lazy grammar through the
speculative loop on the bundled pair (free until the trigger, constrained after, lossless against plain
decoding); tool calls in a chat of the tinycode target dressed in Qwen3's real template. The same
target under the Qwen3 and DeepSeek-R1 templates against the real llama-server: test_llama_server.py."""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from typing import Any

import pytest
from tinycode import THREADS, chat_target_gguf, drafter_gguf, prompts

from dflash_gguf import SpeculativeLlama
from dflash_gguf.call_grammars import tool_call_grammar
from dflash_gguf.chat_reply import ReplySyntax, reply_message, reply_parser, reply_syntax

WEATHER = {
    "name": "get_weather",
    "parameters": {
        "type": "object",
        "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
        "required": ["city"],
    },
}
TOOLS = [{"type": "function", "function": WEATHER}]
GREEDY = {"temperature": 0.0, "seed": 0}


def parse(syntax: ReplySyntax, text: str, step: int, tools: dict[str, Any] | None = None) -> dict[str, Any]:
    parser = reply_parser(syntax, tools or {"get_weather": WEATHER})
    deltas = [d for i in range(0, len(text), step) for d in parser.feed(text[i : i + step])] + parser.finish()
    return reply_message(deltas)


def check_replies(syntax: ReplySyntax, replies: list[tuple[str, str, str]], step: int) -> None:
    """Each (reply, its reasoning_content, its content) comes apart so, fed `step` characters at a time."""
    for text, reasoning, content in replies:
        want = {"role": "assistant", "content": content, **({"reasoning_content": reasoning} if reasoning else {})}
        assert parse(syntax, text, step) == want, text


def without_ids(message: dict[str, Any]) -> dict[str, Any]:
    calls = [{k: v for k, v in c.items() if k != "id"} for c in message.get("tool_calls", [])]
    return {**message, "tool_calls": calls} if calls else message


@pytest.mark.parametrize("step", [1, 3, 10_000])
def test_thinking_and_hermes_calls_come_apart_whatever_the_chunks(step: int) -> None:
    text = (
        '<think>\nThe user wants weather.\n</think>\n\nLet me look.\n<tool_call>\n{"name": "get_weather", '
        '"arguments": {"city": "Paris", "days": 2}}\n</tool_call>\n<tool_call>\n{"name": "get_weather", '
        '"arguments": {"city":"Rome"}}\n</tool_call>'
    )
    # Qwen3's template writes "<think>\n" and "</think>\n\n": a reply that repeats them has them dropped
    message = parse(ReplySyntax(thinking=True, tool_format="hermes", after_open="\n", after_close="\n\n"), text, step)
    assert without_ids(message) == {
        "role": "assistant",
        "content": "Let me look.",
        "reasoning_content": "The user wants weather.\n",
        "tool_calls": [
            {"type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris", "days": 2}'}},
            {"type": "function", "function": {"name": "get_weather", "arguments": '{"city":"Rome"}'}},  # as written
        ],
    }
    ids = [c["id"] for c in message["tool_calls"]]
    assert len(set(ids)) == 2 and all(i.startswith("call_") for i in ids)


@pytest.mark.parametrize("step", [1, 4, 10_000])
def test_text_that_only_looks_like_a_tag_stays_as_written(step: int) -> None:
    hermes = ReplySyntax(tool_format="hermes")
    for text in ("if a < b and x <tool: pass\n", "x <tool_call> not json </tool_call> end\n", "<thin", "a\n\n"):
        assert parse(hermes, text, step) == {"role": "assistant", "content": text}
    # without a syntax nothing is touched, tags included
    assert (
        parse(ReplySyntax(), "<think>a</think><tool_call>{}</tool_call>", step)["content"]
        == "<think>a</think><tool_call>{}</tool_call>"
    )
    # a template that opened <think> itself: the reply starts in thinking; unclosed, it is all thinking
    assert parse(ReplySyntax(thinking=True, starts_thinking=True), "abc </thi", step) == {
        "role": "assistant",
        "content": "",
        "reasoning_content": "abc </thi",
    }


def test_qwen3_coder_calls_take_their_types_from_the_schema() -> None:
    """Tagged parameters become compact JSON, as llama-server joins them: a string parameter escaped, a
    number as written."""
    text = (
        'I\'ll check.\n<tool_call>\n<function=get_weather>\n<parameter=city>\nNew "York"\n</parameter>\n'
        "<parameter=days>\n3.0\n</parameter>\n</function>\n</tool_call>"
    )
    for step in (1, 5, 10_000):
        message = parse(ReplySyntax(tool_format="qwen3-coder"), text, step)
        assert message["content"] == "I'll check."
        assert [c["function"]["arguments"] for c in message["tool_calls"]] == ['{"city":"New \\"York\\"","days":3.0}']


@pytest.mark.parametrize(
    ("tool_format", "call", "arguments"),
    [
        (
            "hermes",
            '<tool_call>\n{"name": "get_weather", "arguments": {"city": "a\\"}b{", "days": 2}}\n</tool_call>',
            '{"city": "a\\"}b{", "days": 2}',
        ),
        ("llama3", '{"name": "get_weather", "parameters": {"city": "Oslo"}}', '{"city": "Oslo"}'),
        (
            "qwen3-coder",
            "<tool_call>\n<function=get_weather>\n<parameter=city>\nline 1\n</param\nx\n</parameter>\n"
            "<parameter=days>\n3\n</parameter>\n</function>\n</tool_call>",
            '{"city":"line 1\\n</param\\nx","days":3}',
        ),
        # cut short: closed as llama-server closes it
        ("qwen3-coder", "<tool_call>\n<function=get_weather>\n<parameter=city>\nOs", '{"city":"Os"}'),
        ("hermes", '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Os', '{"city": "Os"}'),
    ],
)
def test_calls_stream_as_they_are_read(tool_format: str, call: str, arguments: str) -> None:
    """A call is named as soon as its name is read and its arguments follow piece by piece (fed a character
    at a time: a delta per character or so), a string value's end held back until it is known; joined,
    the pieces are the arguments whole."""
    parser = reply_parser(ReplySyntax(tool_format=tool_format), {"get_weather": WEATHER})
    deltas = [d for c in call for d in parser.feed(c)] + parser.finish()
    pieces = [c for d in deltas for c in d.get("tool_calls", [])]
    assert pieces[0]["function"]["name"] == "get_weather" and pieces[0]["id"].startswith("call_")
    assert "".join(c["function"]["arguments"] for c in pieces) == arguments
    assert len(pieces) >= len(arguments) // 3 and all("id" not in c for c in pieces[1:])
    assert reply_message(deltas)["tool_calls"][0]["function"]["arguments"] == arguments


@pytest.mark.parametrize("step", [1, 4, 10_000])
def test_llama3_calls_end_the_reply(step: int) -> None:
    """Llama 3.x's call is a JSON object that ends the reply (its "type" optional), its arguments as
    written; a brace that opens no call to one of the tools leaves the reply as written."""
    llama3 = ReplySyntax(tool_format="llama3")
    call = '{"type": "function", "name": "get_weather",\n"parameters" :{"city" : "Paris", "days"\n: 3\n}\n}\n'
    message = parse(llama3, "Let me check.\n\n" + call, step)
    assert without_ids(message) == {
        "role": "assistant",
        "content": "Let me check.",
        "tool_calls": [
            {"type": "function", "function": {"name": "get_weather", "arguments": '{"city" : "Paris", "days"\n: 3\n}'}}
        ],
    }
    for text in (
        "def f():\n    return {1: 2}\n",  # code
        '{"name": "get_time", "parameters": {}}',  # no such tool
        '{"type": "object", "name": "get_weather", "parameters": {}}',
    ):
        assert parse(llama3, text, step) == {"role": "assistant", "content": text}, text
    # a brace whose first key opens no call: the text goes on streaming (not held until the end)
    parser = reply_parser(llama3, {"get_weather": WEATHER})
    text = 'd = {"a": 1, "b": {}}\nprint(d)\n# more'
    streamed = "".join(d.get("content", "") for i in range(0, len(text), step) for d in parser.feed(text[i : i + step]))
    assert streamed == text and parser.finish() == []
    # the call is streamed once named: text after it is the reply's, a call cut short is closed
    for text, content, arguments in [
        ('{"name": "get_weather", "parameters": {"city": "Rome"}} and more', "and more", '{"city": "Rome"}'),
        ('{"name": "get_weather", "parameters": {"city": "Ro', "", '{"city": "Ro"}'),
        ('{"a": {"b": 1}} {"name": "get_weather", "parameters": {}} x', '{"a": {"b": 1}}x', "{}"),
    ]:
        message = parse(llama3, text, step)
        assert message["content"] == content and message["tool_calls"][0]["function"]["arguments"] == arguments


@pytest.mark.parametrize("step", [1, 4, 10_000])
def test_mistral_calls_are_a_list_after_their_marker(step: int) -> None:
    """Mistral Nemo's calls: a JSON list after [TOOL_CALLS], each with its arguments as written and the id
    the reply gives it (llama-server's grammar lets a comma close a call that has none)."""
    mistral = ReplySyntax(tool_format="mistral")
    text = (
        'Sure. [TOOL_CALLS] [{"name": "get_weather", "arguments": {"city": "Oslo"}, "id": "a1b2c3d4e"},\n'
        '{"name": "get_weather",\n "arguments": {\n"city": "Rome", "days": 2},\n}]'
    )
    message = parse(mistral, text, step)
    assert message["content"] == "Sure."
    assert [(c["id"], c["function"]["arguments"]) for c in message["tool_calls"]][0] == (
        "a1b2c3d4e",
        '{"city": "Oslo"}',
    )
    assert message["tool_calls"][1]["function"]["arguments"] == '{\n"city": "Rome", "days": 2}'
    for text in ("[TOOL_CALLS] nothing", '[TOOL_CALLS][{"name": "get_time", "arguments": {}}]', "[TOOL_CALLS][]"):
        assert parse(mistral, text, step) == {"role": "assistant", "content": text}, text


# Qwen3.5's family (llama-server's Qwen3-Coder parser): replies to a prompt that opened <think>, and what
# llama-server makes of them (tests/test_llama_server.py::test_forced_replies_are_read_as_llama_server_reads_them)
XML_FAMILY_REPLIES = [
    ("abc\n</think>\n\nhello", "abc\n", "hello"),
    ("  abc  \n\n</think>\n\n  hello  ", "abc  \n\n", "hello  "),  # the thinking from its first non-space
    ("abc", "abc", ""),
    ("\n\n</think>\n\nx", "", "x"),
    # a call made while thinking ends the thinking (without tools the call is text)
    (
        "abc\n<tool_call>\n<function=f>\n</function>\n</tool_call>",
        "abc\n",
        "<tool_call>\n<function=f>\n</function>\n</tool_call>",
    ),
]


@pytest.mark.parametrize("step", [1, 3, 10_000])
def test_qwen35_thinking_starts_at_its_first_non_space_and_ends_at_a_call(step: int) -> None:
    syntax = ReplySyntax(thinking=True, starts_thinking=True, xml_family=True, lstrip=True)
    check_replies(syntax, XML_FAMILY_REPLIES, step)
    # with tools, the call that ended the thinking is parsed
    text = "I should look.\n<tool_call>\n<function=get_weather>\n<parameter=city>\nOslo\n</parameter>\n</function>\n</tool_call>"
    message = parse(ReplySyntax(True, True, "qwen3-coder", xml_family=True, lstrip=True), text, step)
    assert message["reasoning_content"] == "I should look.\n" and message["content"] == ""
    assert [json.loads(c["function"]["arguments"]) for c in message["tool_calls"]] == [{"city": "Oslo"}]


def test_the_syntax_comes_from_the_template() -> None:
    qwen3 = "{% if tools %}<tool_call>{% endif %}<think>\n\n</think>"
    # a template that can think: the reply from its first non-space
    assert reply_syntax(qwen3, "<|im_start|>assistant\n", "deepseek", True) == ReplySyntax(
        True, False, "hermes", lstrip=True
    )
    assert reply_syntax(qwen3, "<|im_start|>assistant\n<think>\n", "auto", False) == ReplySyntax(
        True, True, None, "\n"
    )  # the prompt's newline after <think> is thinking too
    assert reply_syntax(qwen3, "x", "none", True) == ReplySyntax(False, False, "hermes", lstrip=True)
    # thinking not read: the think block the prompt ends with is the reply's text
    for block in ("<think>\n", "<think>\n\n</think>\n\n"):
        assert reply_syntax(qwen3, f"<|im_start|>assistant\n{block}", "none", False) == ReplySyntax(opened=block)
    assert reply_syntax("<tool_call>\n<function=f>", "x", "none", True).tool_format == "qwen3-coder"
    assert reply_syntax(None, "x", "deepseek", True) == ReplySyntax()
    # Qwen3.5's: the newline after the <think> its prompt opened is not thinking
    qwen35 = "<tool_call>\n<function=x>\n<parameter=y>\n<think>\n"
    assert reply_syntax(qwen35, "<|im_start|>assistant\n<think>\n", "deepseek", False) == ReplySyntax(
        True, True, None, "", xml_family=True, lstrip=True
    )
    with pytest.raises(ValueError, match="reasoning_format"):
        reply_syntax(qwen3, "x", "deepseek-legacy", True)
    # llama.cpp's copies of the published templates: their call syntax, read where the chat has tools
    from tinycode import _template_text

    for name, tool_format in [
        ("meta-llama-Llama-3.1-8B-Instruct", "llama3"),
        ("meta-llama-Llama-3.2-3B-Instruct", "llama3"),
        ("meta-llama-Llama-3.3-70B-Instruct", "llama3"),
        ("mistralai-Mistral-Nemo-Instruct-2407", "mistral"),
        ("NousResearch-Hermes-3-Llama-3.1-8B-tool_use", "hermes"),
        ("Qwen3.5-4B", "qwen3-coder"),
        ("CohereForAI-c4ai-command-r-plus-tool_use", None),  # JSON calls in a syntax of its own: not read
    ]:
        template = _template_text(name)
        assert reply_syntax(template, "x", "auto", True).tool_format == tool_format, name
        assert reply_syntax(template, "x", "auto", False).tool_format is None, name


@pytest.fixture(scope="module")
def tiny() -> Iterator[SpeculativeLlama]:
    from tinycode import TARGET

    with SpeculativeLlama(str(TARGET), str(drafter_gguf("f32")), n_ctx=512, n_threads=THREADS, n_max=3) as m:
        yield m


def test_a_lazy_grammar_is_free_until_its_word_then_binds(tiny: SpeculativeLlama) -> None:
    """Before the trigger word the reply is the unconstrained greedy one; from the word on it follows
    the grammar (here: the rest of that line, then a comment "# end" and nothing more); drafted and plain
    decoding give the same tokens."""

    def a_word(text: str) -> str | None:  # one inside a line, not at the reply's start
        return next(
            (
                m.group(0)
                for m in re.finditer(r"[A-Za-z_]{4,}", text)
                if m.start() > 0 and "\n" not in text[m.start() : m.end() + 2]
            ),
            None,
        )

    for p in prompts():  # the first prompt whose greedy reply has such a word
        prompt = tiny.tokenize(p["text"].encode(), add_bos=False)
        free = tiny.detokenize(list(tiny.generate_tokens(prompt, max_tokens=64))).decode()
        if (word := a_word(free)) is not None:
            break
    grammar = f'root ::= "{word}" [^\\n]* "\\n" [ ]* "# end"'
    runs = {
        plain: list(tiny.generate_tokens(prompt, max_tokens=96, grammar=grammar, grammar_triggers=[word], plain=plain))
        for plain in (False, True)
    }
    assert runs[False] == runs[True]
    text = tiny.detokenize(runs[False]).decode()
    start = free.index(word)
    assert text[:start] == free[:start], (text, free)  # free until the word
    assert re.fullmatch(re.escape(word) + r"[^\n]*\n *# end", text[start:]), (text, free)  # bound from it on
    assert tiny.finish_reason == "stop"
    with pytest.raises(ValueError, match="grammar_triggers"):
        list(tiny.generate_tokens(prompt, max_tokens=4, grammar_triggers=[word]))  # no grammar to switch on
    with pytest.raises(ValueError, match="grammar_triggers"):
        list(tiny.generate_tokens(prompt, max_tokens=4, grammar=grammar, grammar_triggers=word))  # not a list


# a tool without string parameters: a string of Qwen3-Coder's XML ends only where the model ends it
CLOCK = {
    "name": "get_time",
    "parameters": {
        "type": "object",
        "properties": {"zone": {"type": "integer"}, "exact": {"type": "boolean"}},
        "required": ["zone", "exact"],
    },
}
TYPES = {"string": str, "integer": int, "boolean": bool}


@pytest.mark.parametrize(
    ("tool_format", "tool", "opener", "end"),
    [
        ("hermes", WEATHER, "<tool_call>", "</tool_call>"),
        ("mistral", WEATHER, "[TOOL_CALLS]", "}]"),
        ("qwen3-coder", CLOCK, "<tool_call>", "</tool_call>"),
        ("harmony", WEATHER, " to=functions.", "}"),
    ],
)
def test_the_tools_grammar_keeps_a_call_to_the_tools(
    tiny: SpeculativeLlama, tool_format: str, tool: dict[str, Any], opener: str, end: str
) -> None:
    """The grammar a started call is held to: bound from the start here, the reply is one call (or
    several) to a named tool with its required arguments, each of the type its schema says, which the
    parser takes apart."""
    syntax = ReplySyntax(tool_format=tool_format)
    gbnf, triggers = tool_call_grammar({tool["name"]: tool}, syntax)
    assert triggers == (opener,)
    text = tiny.create_completion(prompts()[1]["text"], max_tokens=160, grammar=gbnf, **GREEDY)["choices"][0]["text"]
    assert text.startswith(opener), text
    # the calls complete within max_tokens (Mistral's list closed after the last whole call)
    whole = text[: text.rindex(end) + len(end)] if end in text else text[: text.rindex("}}") + 2] + "]"
    if tool_format == "harmony":  # a call in a channel header: the header's start is before the word
        whole = ("" if "<|channel|>" in whole.split("<|message|>")[0] else "<|channel|>commentary") + whole
    message = parse(syntax, whole, 7, {tool["name"]: tool})
    counted = {"qwen3-coder": "<function=", "harmony": "<|message|>"}.get(tool_format, '"name"')
    calls = whole.count(counted)
    assert message["content"] == "" and len(message["tool_calls"]) == calls > 0, text
    properties = tool["parameters"]["properties"]
    for c in message["tool_calls"]:
        assert c["function"]["name"] == tool["name"]
        args = json.loads(c["function"]["arguments"])
        assert set(tool["parameters"]["required"]) <= set(args) <= set(properties), args
        assert all(isinstance(v, TYPES[properties[k]["type"]]) for k, v in args.items()), args
    assert tool_call_grammar({"get_weather": WEATHER}, ReplySyntax(tool_format="llama3")) is None


@pytest.mark.parametrize(
    ("tool_format", "tool", "opener"),
    [("hermes", WEATHER, "<tool_call>"), ("mistral", WEATHER, '"name"'), ("qwen3-coder", CLOCK, "<function=")],
)
def test_one_call_where_calls_may_not_be_parallel(
    tiny: SpeculativeLlama, tool_format: str, tool: dict[str, Any], opener: str
) -> None:
    """parallel_tool_calls false: the grammar ends the reply after one call (the same model writes
    several under the parallel grammar)."""
    texts = []
    for parallel in (True, False):
        gbnf, _ = tool_call_grammar({tool["name"]: tool}, ReplySyntax(tool_format=tool_format), parallel)
        out = tiny.create_completion(prompts()[1]["text"], max_tokens=300, grammar=gbnf, **GREEDY)["choices"][0]
        texts.append((out["text"], out["finish_reason"]))
    (several, _), (one, reason) = texts
    assert several.count(opener) > 1 and one.count(opener) == 1 and reason == "stop", texts


def test_an_xml_parameter_that_may_be_a_string_is_any_text() -> None:
    """In Qwen3-Coder's XML a value that may be a string is written bare: the grammar takes any text for
    it (as llama-server's), JSON only where no string is allowed."""
    props = {
        "a": {"type": "integer"},
        "b": {"anyOf": [{"type": "integer"}, {"type": "string"}]},
        "c": {"type": ["string", "null"]},
        "d": {"enum": [1, 2]},
        "e": {},
    }
    tool = {"name": "f", "parameters": {"type": "object", "properties": props}}
    gbnf, _ = tool_call_grammar({"f": tool}, ReplySyntax(tool_format="qwen3-coder"))
    text = {k: f'"<parameter={k}>\\n" xml-string' in gbnf for k in props}
    assert text == {"a": False, "b": True, "c": True, "d": False, "e": True}, gbnf


@pytest.fixture(scope="module")
def qwen3() -> Iterator[SpeculativeLlama]:
    with SpeculativeLlama(
        str(chat_target_gguf("Qwen-Qwen3-0.6B")), str(drafter_gguf("f32")), n_ctx=1024, n_threads=THREADS, n_max=3
    ) as m:
        yield m


def test_tool_calls_in_a_qwen3_chat(qwen3: SpeculativeLlama) -> None:
    """The tools reach Qwen3's template; a reply in its <tool_call> syntax (here forced by a grammar of
    the caller's: the tiny model was never taught tools) comes back as tool_calls, streamed too; a
    conversation that carries the call and its result back renders."""
    msgs = [{"role": "user", "content": "Weather in Paris?"}]
    grammar = (
        'root ::= "Checking.\\n<tool_call>\\n{\\"name\\": \\"get_weather\\", \\"arguments\\": '
        '{\\"city\\": \\"" [a-z]{1,8} "\\"}}\\n</tool_call>"'
    )
    out = qwen3.create_chat_completion(msgs, tools=TOOLS, grammar=grammar, max_tokens=80, **GREEDY)
    choice = out["choices"][0]
    assert choice["finish_reason"] == "tool_calls", choice
    message = choice["message"]
    assert message["content"] == "Checking."
    (call,) = message["tool_calls"]
    assert call["function"]["name"] == "get_weather"
    assert re.fullmatch(r"[a-z]{1,8}", json.loads(call["function"]["arguments"])["city"])
    chunks = [
        c["choices"][0]
        for c in qwen3.create_chat_completion(msgs, tools=TOOLS, grammar=grammar, max_tokens=80, stream=True, **GREEDY)
    ]
    deltas = [c["delta"] for c in chunks]
    assert "".join(d.get("content") or "" for d in deltas) == "Checking."
    # streamed as llama-server streams it: named first, then its arguments piece by piece
    streamed = [c for d in deltas for c in d.get("tool_calls", [])]
    assert streamed[0]["function"]["name"] == "get_weather" and "id" not in streamed[1] and len(streamed) > 2
    assert "".join(c["function"]["arguments"] for c in streamed) == call["function"]["arguments"]
    assert {c["index"] for c in streamed} == {0}
    assert chunks[-1]["finish_reason"] == "tool_calls"
    # tool_choice "none": the same reply is text
    assert qwen3.create_chat_completion(
        msgs, tools=TOOLS, tool_choice="none", grammar=grammar, max_tokens=80, **GREEDY
    )["choices"][0]["message"]["content"].startswith("Checking.\n<tool_call>")
    # the next turn: the assistant's call (OpenAI's null content) and the tool's answer
    turn = msgs + [
        {"role": "assistant", "content": None, "tool_calls": [call]},
        {"role": "tool", "tool_call_id": call["id"], "content": "18 C"},
    ]
    prompt, _ = qwen3._format_chat(turn, {"tools": TOOLS})
    assert "<tool_response>\n18 C\n</tool_response>" in prompt and call["function"]["arguments"] in prompt


def test_a_mistral_call_goes_back_into_its_template() -> None:
    """Mistral Nemo's template takes back only calls with ids of nine letters and digits: a call the reply
    gave no id gets one such, and the next turn renders with it."""
    msgs = [{"role": "user", "content": "Weather in Paris?"}]
    grammar = 'root ::= "[TOOL_CALLS][{\\"name\\": \\"get_weather\\", \\"arguments\\": {\\"city\\": \\"Paris\\"}}]"'
    with SpeculativeLlama(
        str(chat_target_gguf("mistralai-Mistral-Nemo-Instruct-2407")),
        str(drafter_gguf("f32")),
        n_ctx=1024,
        n_threads=THREADS,
        n_max=3,
    ) as llm:
        out = llm.create_chat_completion(msgs, tools=TOOLS, grammar=grammar, max_tokens=80, **GREEDY)
        (call,) = out["choices"][0]["message"]["tool_calls"]
        assert re.fullmatch(r"[A-Za-z0-9]{9}", call["id"]) and call["function"]["arguments"] == '{"city": "Paris"}'
        turn = msgs + [
            {"role": "assistant", "content": None, "tool_calls": [call]},
            {"role": "tool", "tool_call_id": call["id"], "content": "18 C"},
        ]
        prompt, _ = llm._format_chat(turn, {"tools": TOOLS})
    assert f'"id": "{call["id"]}"' in prompt and "18 C" in prompt


def test_server_requests_tell_the_template_what_llama_server_tells_it() -> None:
    from dflash_gguf.server import BadRequest, request_kwargs

    chat = {"messages": [{"role": "user", "content": "hi"}]}
    kw = request_kwargs("/v1/chat/completions", chat)
    assert kw["reasoning_format"] == "deepseek" and kw["chat_template_kwargs"] == {"enable_thinking": True}
    assert request_kwargs("/v1/chat/completions", chat, "none")["reasoning_format"] == "none"
    assert (
        request_kwargs("/v1/chat/completions", {**chat, "parallel_tool_calls": False})["parallel_tool_calls"] is False
    )
    assert request_kwargs("/v1/chat/completions", {**chat, "reasoning_format": "none"})["reasoning_format"] == "none"
    assert request_kwargs("/v1/chat/completions", {**chat, "reasoning_effort": "none"})["chat_template_kwargs"] == {
        "enable_thinking": False
    }
    assert request_kwargs("/v1/chat/completions", {**chat, "chat_template_kwargs": {"enable_thinking": False, "x": 1}})[
        "chat_template_kwargs"
    ] == {"enable_thinking": False, "x": 1}
    # the server's kwargs (--chat-template-kwargs) under the request's, reasoning_effort "none" over both
    server = {"enable_thinking": False, "x": 1, "y": 2}
    for body, want in (
        (chat, {"enable_thinking": False, "x": 1, "y": 2}),
        (
            {**chat, "chat_template_kwargs": {"enable_thinking": True, "x": 3}},
            {"enable_thinking": True, "x": 3, "y": 2},
        ),
        (
            {**chat, "chat_template_kwargs": {"enable_thinking": True}, "reasoning_effort": "none"},
            {**server, "enable_thinking": False},
        ),
    ):
        assert request_kwargs("/v1/chat/completions", body, "deepseek", server)["chat_template_kwargs"] == want, body
    tools = request_kwargs(
        "/v1/chat/completions", {**chat, "tools": [{"type": "function", "function": {"parameters": {}, "name": "f"}}]}
    )["tools"]
    assert tools == [{"type": "function", "function": {"name": "f", "description": "", "parameters": {}}}]
    assert list(tools[0]["function"]) == ["name", "description", "parameters"]  # the order the template prints
    assert "reasoning_format" not in request_kwargs("/apply-template", chat)
    for bad, match in (
        ({"chat_template_kwargs": [1]}, "chat_template_kwargs"),
        ({"tools": [{"type": "x"}]}, "tool"),
        ({"tools": [{"type": "function", "function": {}}]}, "name"),
    ):
        with pytest.raises(BadRequest, match=match):
            request_kwargs("/v1/chat/completions", {**chat, **bad})


def test_a_forced_call_in_a_thinking_template_is_still_a_call(qwen3: SpeculativeLlama) -> None:
    """tool_choice naming a tool, with reasoning_format deepseek (the server's default) on Qwen3's template:
    the grammar makes the reply the call's arguments, and they come back as tool_calls."""
    msgs = [{"role": "user", "content": "Weather in Paris?"}]
    choice = {"type": "function", "function": {"name": "get_weather"}}
    for stream in (False, True):
        out = qwen3.create_chat_completion(
            msgs, tools=TOOLS, tool_choice=choice, reasoning_format="deepseek", max_tokens=60, stream=stream, **GREEDY
        )
        if stream:
            calls = [c for chunk in out for c in chunk["choices"][0]["delta"].get("tool_calls") or []]
        else:
            assert out["choices"][0]["finish_reason"] == "tool_calls", out
            calls = out["choices"][0]["message"]["tool_calls"]
        assert calls and calls[0]["function"]["name"] == "get_weather"
        assert isinstance(json.loads("".join(c["function"]["arguments"] for c in calls))["city"], str)


# gpt-oss's replies (harmony) and what llama-server makes of them, whole and streamed
# (tests/test_llama_server.py::test_forced_replies_are_read_as_llama_server_reads_them)
HARMONY_REPLIES = [
    (
        "<|channel|>analysis<|message|>Think hard.<|end|><|start|>assistant<|channel|>final<|message|>The answer.",
        "Think hard.",
        "The answer.",
    ),
    (
        "<|channel|>analysis<|message|>a<|end|><|start|>assistant<|channel|>analysis<|message|>b<|end|>"
        "<|start|>assistant<|channel|>final<|message|>c",
        "ab",
        "c",
    ),
    # a preamble to the user in the commentary channel is text
    (
        "<|channel|>commentary<|message|>Let me see.<|end|><|start|>assistant<|channel|>final<|message|>Done.",
        "",
        "Let me see.Done.",
    ),
    ("<|channel|>analysis<|message|>x<|end|><|start|>assistant", "x", ""),
    (
        "<|channel|>commentary to=assistant<|channel|>analysis<|message|>r<|end|><|start|>assistant"
        "<|channel|>final<|message|>f",
        "r",
        "f",
    ),  # the stray header gpt-oss-20b writes
    ("<|channel|>final<|message|>a<|end|><|start|>assistant<|channel|>final<|message|>b", "", "a"),
]


@pytest.mark.parametrize("step", [1, 7, 10_000])
def test_gpt_oss_channels_come_apart_whatever_the_chunks(step: int) -> None:
    harmony = ReplySyntax(thinking=True, tool_format="harmony")
    check_replies(harmony, HARMONY_REPLIES, step)
    # reasoning_format "none": the thinking stays in the text with its markers
    text = HARMONY_REPLIES[0][0]
    assert parse(ReplySyntax(tool_format="harmony"), text, step) == {
        "role": "assistant",
        "content": "<|channel|>analysis<|message|>Think hard.<|end|>The answer.",
    }
    # text that is not harmony stays as written
    for text in ("hello", " <|channel|>final<|message|>a", "<|channel|>final"):
        assert parse(harmony, text, step) == {"role": "assistant", "content": text}, text


@pytest.mark.parametrize("step", [1, 10_000])
def test_gpt_oss_calls_name_their_tool_in_either_header(step: int) -> None:
    harmony = ReplySyntax(thinking=True, tool_format="harmony")
    think = "<|channel|>analysis<|message|>Need weather.<|end|><|start|>assistant"
    for call in (
        '<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>{"city": "Oslo"}',
        ' to=functions.get_weather<|channel|>commentary json<|message|>{"city": "Oslo"}<|call|>',
    ):
        message = parse(harmony, think + call, step)
        assert message["reasoning_content"] == "Need weather." and message["content"] == ""
        assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in message["tool_calls"]] == [
            ("get_weather", {"city": "Oslo"})
        ]
    # arguments that are no JSON: the message stays text
    bad = parse(harmony, "<|channel|>commentary to=functions.get_weather<|message|>{oops", step)
    assert bad == {"role": "assistant", "content": "<|channel|>commentary to=functions.get_weather<|message|>{oops"}


def test_a_qwen3_coder_call_may_leave_out_its_tool_call_tag() -> None:
    """Under Qwen3-Coder's template (llama-server's reader allows for its models leaving <tool_call> out of
    the first call), a reply that opens a call with <function=NAME> triggers the tools' grammar there and
    comes back as that call. The opening is forced; the grammar writes the rest."""
    from tinycode import _template_text

    assert reply_syntax(_template_text("Qwen3-Coder"), "x", "auto", True).bare_calls
    assert not reply_syntax(_template_text("Qwen3.5-4B"), "x", "auto", True).bare_calls
    opening = "Sure.\n<function=get_time>\n"
    with SpeculativeLlama(
        str(chat_target_gguf("Qwen3-Coder")), str(drafter_gguf("f32")), n_ctx=1024, n_threads=THREADS, n_max=3
    ) as llm:
        want = llm.tokenize(opening.encode(), add_bos=False, special=True)
        start: list[int] = []

        def force_opening(input_ids: Any, scores: Any) -> Any:
            start[:] = start or [len(input_ids)]
            if len(input_ids) - start[0] < len(want):
                scores[:] = -1e9
                scores[want[len(input_ids) - start[0]]] = 0.0
            return scores

        msgs = [{"role": "user", "content": "time?"}]
        tools = [{"type": "function", "function": CLOCK}]
        out = llm.create_chat_completion(msgs, tools=tools, max_tokens=200, logits_processor=force_opening, **GREEDY)
    message = out["choices"][0]["message"]
    assert message["content"] == "Sure." and message["tool_calls"][0]["function"]["name"] == "get_time", message
    args = json.loads(message["tool_calls"][0]["function"]["arguments"])
    assert isinstance(args["zone"], int) and isinstance(args["exact"], bool), args


def forcing(llm: SpeculativeLlama, text: str) -> Any:
    """A logits processor that makes the reply `text`'s tokens (special ones included), then the end of text."""
    want = [*llm.tokenize(text.encode(), add_bos=False, special=True), llm.token_eos()]
    start: list[int] = []

    def force(input_ids: Any, scores: Any) -> Any:
        start[:] = start or [len(input_ids)]
        scores[:] = -1e9
        scores[want[min(len(input_ids) - start[0], len(want) - 1)]] = 0.0
        return scores

    return force


def chat_deltas(llm: SpeculativeLlama, text: str, stream: bool, **kw: Any) -> tuple[list[dict[str, Any]], Any]:
    """The reply `text` (forced) to "hi" as (message or deltas, finish_reason)."""
    msgs = [{"role": "user", "content": "hi"}]
    out = llm.create_chat_completion(msgs, stream=stream, max_tokens=300, logits_processor=forcing(llm, text), **kw)
    if not stream:
        return [out["choices"][0]["message"]], out["choices"][0]["finish_reason"]
    chunks = list(out)
    return [c["choices"][0]["delta"] for c in chunks], chunks[-1]["choices"][0]["finish_reason"]


def joined(deltas: list[dict[str, Any]], key: str) -> str:
    return "".join(d.get(key) or "" for d in deltas)


@pytest.mark.parametrize(
    ("template", "markers", "reply", "call"),
    [
        (
            "openai-gpt-oss-120b",
            ("<|start|>", "<|channel|>", "<|message|>", "<|end|>", "<|constrain|>", "<|return|>", "<|call|>"),
            "<|channel|>analysis<|message|>Plan it.<|end|><|start|>assistant<|channel|>final<|message|>Done.",
            '<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>{"city": "Oslo"}',
        ),
        (
            "muse-glimmer",
            ("<|start|>", "<|message|>", "<|eom|>", "<|eot|>"),
            " to=self<|message|>Plan it.<|eom|><|start|>assistant to=user<|message|>Done.",
            ' to=get_weather<|message|><atem:function_calls>\n<atem:invoke name="get_weather">\n'
            '<atem:parameter name="city">Oslo</atem:parameter>\n</atem:invoke>\n</atem:function_calls>',
        ),
    ],
)
def test_message_runs_through_the_chat_with_their_markers_special(
    template: str, markers: tuple[str, ...], reply: str, call: str
) -> None:
    """gpt-oss's and Muse Glimmer's replies through the chat, on a target whose vocabulary has their
    markers as special tokens (libllama shows no special token's text unless asked; the chat asks for
    the markers'): reasoning and text apart, whole and streamed, and a call with finish_reason
    "tool_calls"."""
    from tinycode import special_tokens_target

    target = special_tokens_target(template, markers)
    with SpeculativeLlama(str(target), str(drafter_gguf("f32")), n_ctx=2048, n_threads=THREADS) as llm:
        for stream in (False, True):
            deltas, _ = chat_deltas(llm, reply, stream, reasoning_format="deepseek", **GREEDY)
            assert (joined(deltas, "reasoning_content"), joined(deltas, "content")) == ("Plan it.", "Done."), stream
        described = [{"type": "function", "function": {**WEATHER, "description": "The weather."}}]
        (message,), finish = chat_deltas(llm, call, False, tools=described, **GREEDY)
        assert finish == "tool_calls"
        assert json.loads(message["tool_calls"][0]["function"]["arguments"]) == {"city": "Oslo"}


# Muse Glimmer's replies and what llama-server makes of them
GLIMMER_REPLIES = [
    (" to=self<|message|>Think.<|eom|><|start|>assistant to=user<|message|>Answer.", "Think.", "Answer."),
    (" to=user<|message|>Just.", "", "Just."),
    ("<|message|>Bare.", "", "Bare."),
    (
        " to=self<|message|>a<|eom|><|start|>assistant to=self<|message|>b<|eom|><|start|>assistant<|message|>c",
        "ab",
        "c",
    ),
    (" to=self<|message|>x<|eom|>", "x", ""),
    (" to=user<|message|>done<|eom|>", "", "done"),
    (" to=user<|message|> sp \n", "", " sp \n"),
]


@pytest.mark.parametrize("step", [1, 6, 10_000])
def test_muse_glimmer_recipients_come_apart_whatever_the_chunks(step: int) -> None:
    glimmer = ReplySyntax(thinking=True, tool_format="glimmer")
    check_replies(glimmer, GLIMMER_REPLIES, step)
    # a call in ATEM markup after the thinking, its parameters typed by the tool's schema; another may follow
    invoke = (
        '<atem:function_calls>\n<atem:invoke name="get_weather">\n<atem:parameter name="city">Oslo</atem:parameter>\n'
        '<atem:parameter name="days">3</atem:parameter>\n</atem:invoke>\n</atem:function_calls>'
    )
    text = f" to=self<|message|>Weather first.<|eom|><|start|>assistant to=get_weather<|message|>{invoke}"
    message = parse(glimmer, f"{text}<|eom|><|start|>assistant to=get_weather<|message|>{invoke}", step)
    assert message["reasoning_content"] == "Weather first." and message["content"] == ""
    assert [json.loads(c["function"]["arguments"]) for c in message["tool_calls"]] == [{"city": "Oslo", "days": 3}] * 2
    # without tools a recipient other than self and user is no format of it: the text as written
    assert reply_syntax("<atem:function_calls><|eom|>", "x", "none", False) == ReplySyntax()
    no_tools = reply_parser(ReplySyntax(thinking=True, tool_format="glimmer"), {})
    assert reply_message(no_tools.feed(text) + no_tools.finish())["content"].endswith(invoke)
