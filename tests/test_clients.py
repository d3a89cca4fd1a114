"""`dflash serve` as the client libraries nobody here wrote speak to it, over real sockets: the openai SDK
(its stream() helpers accumulate tool-call deltas; its Responses API), the anthropic SDK (the Messages
API that agents written for Claude speak), LangChain (ChatOpenAI's tools and structured output,
the OpenAI completions class that sends a list prompt). The bundled tinycode pair is no chat model: its
replies are code, but shapes, forced tool calls (a grammar) and the prompt handling do not need better."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import pytest

openai = pytest.importorskip("openai", reason="the test extras (scripts/install.sh --test) bring the clients")
pytest.importorskip("langchain_openai", reason="the test extras (scripts/install.sh --test) bring the clients")

from tinycode import TARGET, THREADS, drafter_gguf, sse_events  # noqa: E402

from dflash_gguf import SpeculativeLlama  # noqa: E402
from dflash_gguf.server import serving  # noqa: E402

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "the weather in a city",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
    },
}


@pytest.fixture(scope="module")
def base_url() -> Iterator[str]:
    with (
        SpeculativeLlama(str(TARGET), str(drafter_gguf("f32")), n_ctx=1024, n_threads=THREADS, n_max=7) as llm,
        serving(llm, "tiny") as port,
    ):
        yield f"http://127.0.0.1:{port}/v1"


@pytest.fixture(scope="module")
def client(base_url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=base_url, api_key="none", max_retries=0)


def test_openai_stream_helper_accumulates_a_forced_tool_call(client: openai.OpenAI) -> None:
    kw = dict(
        model="tiny",
        messages=[{"role": "user", "content": "weather in Paris?"}],
        tools=[WEATHER],
        tool_choice={"type": "function", "function": {"name": "get_weather"}},
        max_tokens=40,
        temperature=0,
    )
    whole = client.chat.completions.create(**kw).choices[0].message.tool_calls[0]
    with client.chat.completions.stream(**kw) as stream:
        for _ in stream:
            pass
        final = stream.get_final_completion()
    call = final.choices[0].message.tool_calls[0]
    assert call.function.name == "get_weather"
    assert call.function.arguments == whole.function.arguments
    assert isinstance(json.loads(call.function.arguments)["city"], str)
    assert final.choices[0].finish_reason == "tool_calls"


def test_openai_list_prompt_and_content_parts(client: openai.OpenAI) -> None:
    texts = ["def add(a, b):", "import os\n"]
    many = client.completions.create(model="tiny", prompt=texts, max_tokens=6, temperature=0)
    assert [c.index for c in many.choices] == [0, 1]
    for i, t in enumerate(texts):
        alone = client.completions.create(model="tiny", prompt=t, max_tokens=6, temperature=0)
        assert many.choices[i].text == alone.choices[0].text
    parts = client.chat.completions.create(
        model="tiny",
        max_tokens=6,
        temperature=0,
        messages=[
            {"role": "developer", "content": "Be brief."},
            {"role": "user", "content": [{"type": "text", "text": "def add(a, b):"}]},
        ],
    )
    plain = client.chat.completions.create(
        model="tiny",
        max_tokens=6,
        temperature=0,
        messages=[{"role": "system", "content": "Be brief."}, {"role": "user", "content": "def add(a, b):"}],
    )
    assert parts.choices[0].message.content == plain.choices[0].message.content
    assert parts.usage.prompt_tokens == plain.usage.prompt_tokens
    # the same prompt again: all of it but the last token is reused, as usage says; a fingerprint each
    assert plain.usage.prompt_tokens_details.cached_tokens == plain.usage.prompt_tokens - 1
    assert parts.system_fingerprint == plain.system_fingerprint == many.system_fingerprint
    assert plain.system_fingerprint.startswith("dflash-gguf-")


BRIEF = ("Be brief.", "def add(a, b):")  # a system message and a user's


@pytest.fixture(scope="module")
def brief_chat(client: openai.OpenAI) -> Any:
    """The chat of BRIEF, greedy, cut at 12 tokens: what the other APIs' answers to the same turns must be."""
    system, user = BRIEF
    return client.chat.completions.create(
        model="tiny",
        messages=[{"role": "system", "content": system}, {"role": "user", "content": user}],
        max_tokens=12,
        temperature=0,
    )


def test_openai_responses_are_the_chat_s(client: openai.OpenAI, base_url: str, brief_chat: Any) -> None:
    """The Responses API (client.responses) gives the chat's reply, whole or streamed: the same text and token
    counts as the chat of the same messages; a reply cut at max_output_tokens is incomplete, as OpenAI's; the
    stream's events are named, numbered in order, and each item is added before its deltas and done after."""
    system, user = BRIEF
    chat = brief_chat
    kw = dict(model="tiny", instructions=system, input=user, max_output_tokens=12, temperature=0)
    whole = client.responses.create(**kw)
    assert whole.output_text == chat.choices[0].message.content and whole.output_text
    assert (whole.usage.input_tokens, whole.usage.output_tokens) == (chat.usage.prompt_tokens, 12)
    assert whole.status == "incomplete" and whole.incomplete_details.reason == "max_output_tokens"
    events = sse_events(base_url + "/responses", {**kw, "stream": True})
    assert [e["sequence_number"] for _, e in events] == list(range(len(events)))
    assert all(name == e["type"] for name, e in events)
    kinds = [e["type"] for _, e in events]
    assert kinds[:4] == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.content_part.added",
    ]
    assert kinds[-4:] == [
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
        "response.incomplete",
    ]
    deltas = "".join(e["delta"] for _, e in events if e["type"] == "response.output_text.delta")
    last = events[-1][1]["response"]
    assert deltas == whole.output_text == last["output"][0]["content"][0]["text"]
    assert last["usage"]["output_tokens"] == 12 and last["status"] == "incomplete"
    # a conversation given as items: the chat of the same turns
    items = [
        {"role": "user", "content": "import os"},
        {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "import sys"}]},
        {"role": "user", "content": [{"type": "input_text", "text": user}]},
    ]
    turns = [{"role": "user", "content": "import os"}, {"role": "assistant", "content": "import sys"}]
    chat = client.chat.completions.create(
        model="tiny", messages=[*turns, {"role": "user", "content": user}], max_tokens=12, temperature=0
    )
    out = client.responses.create(model="tiny", input=items, max_output_tokens=12, temperature=0)
    assert out.output_text == chat.choices[0].message.content


def test_responses_items_as_chat_messages() -> None:
    """A Responses input as the chat's messages: instructions as the system message, what the model said
    (reasoning, its message, its function calls) joined into one assistant turn, each function output a tool
    message, the format and effort under the chat's names; a hosted tool (web search) left out."""
    from dflash_gguf.server.openai_responses import chat_body

    body = {
        "instructions": "Be brief.",
        "input": [
            {"role": "user", "content": "weather?"},
            {"type": "reasoning", "summary": [], "content": [{"type": "reasoning_text", "text": "look it up"}]},
            {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "Checking."}]},
            {"type": "function_call", "call_id": "c1", "name": "get_weather", "arguments": '{"city": "Paris"}'},
            {"type": "function_call_output", "call_id": "c1", "output": "20"},
        ],
        "text": {"format": {"type": "json_schema", "name": "w", "schema": {"type": "object"}}},
        "reasoning": {"effort": "none"},
        "max_output_tokens": 7,
        "tools": [{"type": "web_search"}, {"type": "function", "name": "get_weather", "parameters": {}}],
    }
    call = {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}
    chat = chat_body(body)
    assert chat["messages"] == [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "weather?"},
        {
            "role": "assistant",
            "content": [{"type": "text", "text": "Checking."}],
            "reasoning_content": "look it up",
            "tool_calls": [call],
        },
        {"role": "tool", "tool_call_id": "c1", "content": "20"},
    ]
    assert chat["response_format"] == {
        "type": "json_schema",
        "json_schema": {"name": "w", "schema": {"type": "object"}},
    }
    assert (chat["reasoning_effort"], chat["max_tokens"]) == ("none", 7)
    assert chat["tools"] == [{"type": "function", "function": {"name": "get_weather", "parameters": {}}}]


def test_openai_responses_call_functions_and_take_their_output(client: openai.OpenAI) -> None:
    """A forced function tool comes back as a function_call item, whole and through the SDK's stream helper
    (which checks each item's identity from added to done); the call and its output sent back as items are
    the chat's assistant tool call and tool message."""
    tool = {"type": "function", **WEATHER["function"]}
    kw = dict(model="tiny", input="weather in Paris?", tools=[tool], max_output_tokens=40, temperature=0)
    whole = client.responses.create(**kw, tool_choice={"type": "function", "name": "get_weather"})
    (call,) = whole.output
    assert call.type == "function_call" and call.name == "get_weather" and whole.status == "completed"
    assert isinstance(json.loads(call.arguments)["city"], str)
    with client.responses.stream(**kw, tool_choice={"type": "function", "name": "get_weather"}) as stream:
        for _ in stream:
            pass
        final = stream.get_final_response()
    assert [(o.type, o.name, o.arguments) for o in final.output] == [("function_call", "get_weather", call.arguments)]
    result = json.dumps({"temp": 20})
    items = [
        {"role": "user", "content": "weather in Paris?"},
        {"type": "function_call", "call_id": call.call_id, "name": call.name, "arguments": call.arguments},
        {"type": "function_call_output", "call_id": call.call_id, "output": result},
    ]
    turns = [
        {"role": "user", "content": "weather in Paris?"},
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {"id": call.call_id, "type": "function", "function": {"name": call.name, "arguments": call.arguments}}
            ],
        },
        {"role": "tool", "tool_call_id": call.call_id, "content": result},
    ]
    chat = client.chat.completions.create(model="tiny", messages=turns, tools=[WEATHER], max_tokens=10, temperature=0)
    out = client.responses.create(model="tiny", input=items, tools=[tool], max_output_tokens=10, temperature=0)
    assert out.output_text == chat.choices[0].message.content


@pytest.mark.parametrize(
    ("body", "word"),
    [
        ({"input": "x", "previous_response_id": "resp_1"}, "previous_response_id"),
        ({"model": "tiny"}, "'input' is required"),
        ({"input": "x", "tools": [{"type": "function"}]}, "needs a name"),
        ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "u"}]}]}, "text only"),
        ({"input": [{"type": "item_reference", "id": "x"}]}, "input items"),
        ({"input": "x", "max_output_tokens": 0}, "max_output_tokens"),
    ],
)
def test_openai_responses_refuse_what_they_cannot_do(client: openai.OpenAI, body: dict, word: str) -> None:
    with pytest.raises(openai.BadRequestError, match=word):
        client.responses.create(**{"model": "tiny", **body})


@pytest.fixture(scope="module")
def claude(base_url: str) -> Any:
    anthropic = pytest.importorskip("anthropic", reason="the test extras (scripts/install.sh --test) bring the clients")
    return anthropic.Anthropic(base_url=base_url.removesuffix("/v1"), api_key="none", max_retries=0)


GREEDY_BODY = {"extra_body": {"temperature": 0}}  # the SDK leaves sampling fields to the request body


def test_anthropic_messages_are_the_chat_s(claude: Any, base_url: str, brief_chat: Any) -> None:
    """Anthropic's Messages API (the anthropic SDK) gives the chat's reply, whole or streamed: the same text and
    token counts as the chat of the same turns (input_tokens + cache_read_input_tokens its prompt), a reply
    cut at max_tokens stops for "max_tokens"; count_tokens counts that prompt; the stream's events are named."""
    system, user = BRIEF
    chat = brief_chat
    kw = dict(model="tiny", max_tokens=12, system=system, messages=[{"role": "user", "content": user}])
    whole = claude.messages.create(**kw, **GREEDY_BODY)
    assert [b.type for b in whole.content] == ["text"] and whole.content[0].text == chat.choices[0].message.content
    assert whole.stop_reason == "max_tokens" and whole.usage.output_tokens == 12
    assert whole.usage.input_tokens + whole.usage.cache_read_input_tokens == chat.usage.prompt_tokens
    assert claude.messages.count_tokens(model="tiny", system=system, messages=kw["messages"]).input_tokens == (
        chat.usage.prompt_tokens
    )
    with claude.messages.stream(**kw, **GREEDY_BODY) as stream:
        text = "".join(stream.text_stream)
        final = stream.get_final_message()
    assert text == final.content[0].text == whole.content[0].text
    assert final.stop_reason == "max_tokens" and final.usage.output_tokens == 12
    assert final.usage.input_tokens + final.usage.cache_read_input_tokens == chat.usage.prompt_tokens
    events = sse_events(base_url + "/messages", {**kw, "temperature": 0, "stream": True})
    assert all(name == e["type"] for name, e in events)
    # a stop sequence from the middle of the reply ends it there and is named (Anthropic's stop_reason)
    reply = whole.content[0].text
    word = reply[len(reply) // 2 :][:3]
    stops = {"stop_sequences": ["\x00never", word]}
    cut = claude.messages.create(**kw, **stops, **GREEDY_BODY)
    with claude.messages.stream(**kw, **stops, **GREEDY_BODY) as stream:
        cut_streamed = stream.get_final_message()
    for message in (cut, cut_streamed):
        assert message.content[0].text == reply[: reply.index(word)]
        assert (message.stop_reason, message.stop_sequence) == ("stop_sequence", word)
    assert (whole.stop_sequence, final.stop_sequence) == (None, None)
    kinds = [e["type"] for _, e in events]
    assert kinds[:2] == ["message_start", "content_block_start"]
    assert kinds[-3:] == ["content_block_stop", "message_delta", "message_stop"]


def test_anthropic_tool_use_and_results(claude: Any, client: openai.OpenAI) -> None:
    """A forced tool comes back as a tool_use block with its input parsed, whole and streamed (the SDK builds
    it from input_json_delta); the tool_use and its tool_result sent back are the chat's tool call and tool
    message."""
    tool = {
        "name": "get_weather",
        "description": "the weather in a city",
        "input_schema": WEATHER["function"]["parameters"],
    }
    kw = dict(
        model="tiny",
        max_tokens=40,
        messages=[{"role": "user", "content": "weather in Paris?"}],
        tools=[tool],
        tool_choice={"type": "tool", "name": "get_weather"},
    )
    whole = claude.messages.create(**kw, **GREEDY_BODY)
    (use,) = whole.content
    assert use.type == "tool_use" and use.name == "get_weather" and whole.stop_reason == "tool_use"
    assert isinstance(use.input["city"], str)
    with claude.messages.stream(**kw, **GREEDY_BODY) as stream:
        final = stream.get_final_message()
    assert [(b.type, b.name, b.input) for b in final.content] == [("tool_use", "get_weather", use.input)]
    turns = [
        {"role": "user", "content": "weather in Paris?"},
        {"role": "assistant", "content": [use.model_dump(include={"type", "id", "name", "input"})]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": use.id, "content": "20 degrees"}]},
    ]
    arguments = json.dumps(use.input, ensure_ascii=False)
    chat_turns = [
        {"role": "user", "content": "weather in Paris?"},
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [{"id": use.id, "type": "function", "function": {"name": use.name, "arguments": arguments}}],
        },
        {"role": "tool", "tool_call_id": use.id, "content": "20 degrees"},
    ]
    chat = client.chat.completions.create(
        model="tiny", messages=chat_turns, tools=[WEATHER], max_tokens=10, temperature=0
    )
    out = claude.messages.create(model="tiny", max_tokens=10, messages=turns, tools=[tool], **GREEDY_BODY)
    assert out.content[0].text == chat.choices[0].message.content


def test_anthropic_turns_as_chat_messages() -> None:
    """A Messages conversation as the chat's messages: the system text blocks joined, an assistant turn's
    thinking, text and tool_use as one message, and a user turn's tool_result answering those calls before
    the user's text (tool messages follow the calls they answer); a server tool (web search) left out."""
    from dflash_gguf.server.anthropic_messages import chat_body

    body = {
        "max_tokens": 8,
        "system": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}],
        "messages": [
            {"role": "user", "content": "weather?"},
            {
                "role": "assistant",
                "content": [
                    {"type": "thinking", "thinking": "look it up", "signature": ""},
                    {"type": "text", "text": "Checking."},
                    {"type": "tool_use", "id": "t1", "name": "get_weather", "input": {"city": "Paris"}},
                ],
            },
            {
                "role": "user",
                "content": [
                    {"type": "tool_result", "tool_use_id": "t1", "content": [{"type": "text", "text": "20"}]},
                    {"type": "text", "text": "and tomorrow?"},
                ],
            },
        ],
    }
    body["tools"] = [
        {"type": "web_search_20250305", "name": "web_search"},
        {"name": "get_weather", "description": "w", "input_schema": {"type": "object"}},
    ]
    call = {"id": "t1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}
    chat = chat_body(body)
    function = {"name": "get_weather", "description": "w", "parameters": {"type": "object"}}
    assert chat["tools"] == [{"type": "function", "function": function}]
    assert chat["messages"] == [
        {"role": "system", "content": "ab"},
        {"role": "user", "content": "weather?"},
        {
            "role": "assistant",
            "content": [{"type": "text", "text": "Checking."}],
            "tool_calls": [call],
            "reasoning_content": "look it up",
        },
        {"role": "tool", "tool_call_id": "t1", "content": "20"},
        {"role": "user", "content": [{"type": "text", "text": "and tomorrow?"}]},
    ]


@pytest.mark.parametrize(
    ("body", "word"),
    [
        ({"messages": [{"role": "user", "content": "x"}]}, "max_tokens"),
        ({"max_tokens": 4}, "messages"),
        ({"max_tokens": 0, "messages": [{"role": "user", "content": "x"}]}, "max_tokens"),
        ({"max_tokens": 4, "messages": [{"role": "user", "content": [{"type": "image", "source": {}}]}]}, "text only"),
        (
            {"max_tokens": 4, "messages": [{"role": "user", "content": "x"}], "tools": [{"description": "d"}]},
            "needs a name",
        ),
    ],
)
def test_anthropic_messages_refuse_what_they_cannot_do(base_url: str, body: dict, word: str) -> None:
    import urllib.error
    import urllib.request

    req = urllib.request.Request(
        base_url + "/messages", json.dumps(body).encode(), {"Content-Type": "application/json"}
    )
    with pytest.raises(urllib.error.HTTPError) as e:
        urllib.request.urlopen(req, timeout=60)
    assert e.value.code == 400 and word in json.loads(e.value.read())["error"]["message"]


def test_a_failure_mid_stream_reaches_both_sdks() -> None:
    """A generation that breaks down after its stream began: the anthropic and openai SDKs raise it (an event
    of type "error"), rather than ending the stream as if it were complete."""
    anthropic = pytest.importorskip("anthropic", reason="the test extras (scripts/install.sh --test) bring the clients")

    with SpeculativeLlama(str(TARGET), str(drafter_gguf("f32")), n_ctx=512, n_threads=THREADS, n_max=3) as llm:

        class FailsAfterFourChunks:  # the real model, whose chat stream breaks down after four chunks
            def __getattr__(self, name: str) -> Any:
                return getattr(llm, name)

            def create_chat_completion(self, *args: Any, **kw: Any) -> Any:
                chunks = llm.create_chat_completion(*args, **kw)
                if not kw.get("stream"):
                    return chunks
                return self._failing(chunks)

            @staticmethod
            def _failing(chunks: Iterator[Any]) -> Iterator[Any]:
                for i, chunk in enumerate(chunks):
                    if i == 4:
                        chunks.close()  # type: ignore[attr-defined]
                        raise RuntimeError("the disk is on fire")
                    yield chunk

        with serving(FailsAfterFourChunks(), "tiny") as port:  # type: ignore[arg-type]
            base = f"http://127.0.0.1:{port}"
            claude = anthropic.Anthropic(base_url=base, api_key="none", max_retries=0)
            kw = dict(model="tiny", max_tokens=20, messages=[{"role": "user", "content": "def f(x):"}])
            with pytest.raises(anthropic.APIError, match="the disk is on fire"):
                with claude.messages.stream(**kw, **GREEDY_BODY) as stream:
                    for _ in stream:
                        pass
            client = openai.OpenAI(base_url=base + "/v1", api_key="none", max_retries=0)
            with pytest.raises(openai.APIError, match="the disk is on fire"):
                for _ in client.responses.create(model="tiny", input="def f(x):", max_output_tokens=20, stream=True):
                    pass


def test_langchain_tools_and_structured_output(base_url: str) -> None:
    from langchain_openai import ChatOpenAI, OpenAI
    from pydantic import BaseModel

    class Person(BaseModel):
        name: str
        age: int

    chat = ChatOpenAI(base_url=base_url, api_key="none", model="tiny", temperature=0, max_tokens=40, max_retries=0)
    bound = chat.bind_tools([WEATHER], tool_choice="get_weather")
    streamed = None
    for chunk in bound.stream("weather in Paris?"):
        streamed = chunk if streamed is None else streamed + chunk
    assert streamed is not None and streamed.tool_calls[0]["name"] == "get_weather"
    whole = bound.invoke("weather in Paris?").tool_calls
    assert [{k: c[k] for k in ("name", "args")} for c in streamed.tool_calls] == [
        {k: c[k] for k in ("name", "args")} for c in whole
    ]
    structured = chat.with_structured_output(Person, method="function_calling")
    person = structured.invoke("who?")
    assert isinstance(person, Person)
    assert list(structured.stream("who?"))[-1] == person
    # LangChain reads usage.prompt_tokens_details.cached_tokens as its cache reads
    chat.invoke("def add(a, b):")
    again = chat.invoke("def add(a, b):").usage_metadata
    assert again is not None and again["input_token_details"]["cache_read"] == again["input_tokens"] - 1
    text = OpenAI(base_url=base_url, api_key="none", model="tiny", temperature=0, max_tokens=6, max_retries=0).invoke(
        "def add(a, b):"
    )  # sends prompt=["def add(a, b):"]
    assert isinstance(text, str) and text


def test_lm_eval_local_completions_scores_loglikelihoods(base_url: str) -> None:
    """lm-eval's `local-completions` (echo + logprobs, the HF tokenizer's ids as prompts), batch sizes 1 and
    2 (a list of prompts per request): the continuations' log-likelihoods a plain libllama decode gives, and
    whether each is the greedy one (read from the top_logprobs: a character split over byte tokens included)."""
    pytest.importorskip("lm_eval", reason="the test extras (scripts/install.sh --test) bring lm-eval")
    import numpy as np
    from lm_eval.api.instance import Instance
    from lm_eval.models.openai_completions import LocalCompletionsAPI
    from tinycode import TINY, GreedyReference

    pairs = [
        ("def add(a, b):\n", "    return a + b\n"),
        ("import os\n", "import sys\n"),
        ("x = 1\n", "y = 2\n"),
        ("s = 'caf", "é → ok'\n"),
        ('def main():\n    pass\n\n\nif __name__ == "__main__":\n    main', "()\n"),
    ]
    ref = GreedyReference(TARGET, n_ctx=1024, n_threads=THREADS)
    lms = {
        b: LocalCompletionsAPI(
            base_url=f"{base_url}/completions",
            model="tiny",
            tokenizer_backend="huggingface",
            tokenizer=str(TINY / "target"),
            batch_size=b,
            max_retries=1,
        )
        for b in (1, 2)
    }
    want, greedy = [], []
    for context, continuation in pairs:
        ctx, cont = lms[1]._encode_pair(context, continuation)  # lm-eval's own split of the tokens
        ref.llm.reset()
        ref.llm.eval(ctx + cont)
        rows = np.asarray(ref.llm.scores[len(ctx) - 1 : len(ctx) + len(cont) - 1], dtype=np.float64)
        logz = np.log(np.exp(rows - rows.max(1, keepdims=True)).sum(1)) + rows.max(1)
        want.append(float((rows[np.arange(len(cont)), cont] - logz).sum()))
        greedy.append(bool((rows.argmax(1) == cont).all()))
    assert any(greedy) and not all(greedy)
    for lm in lms.values():
        got = lm.loglikelihood(
            [Instance(request_type="loglikelihood", doc={}, arguments=p, idx=i) for i, p in enumerate(pairs)]
        )
        np.testing.assert_allclose([ll for ll, _ in got], want, atol=5e-3)
        assert [g for _, g in got] == greedy
