"""`dflash serve` as the client libraries nobody here wrote speak to it, over real sockets: the openai SDK
(its stream() helper accumulates tool-call deltas), LangChain (ChatOpenAI's tools and structured output,
the OpenAI completions class that sends a list prompt). The bundled tinycode pair is no chat model: its
replies are code, but shapes, forced tool calls (a grammar) and the prompt handling do not need better."""

from __future__ import annotations

import json
from collections.abc import Iterator

import pytest

openai = pytest.importorskip("openai", reason="the test extras (scripts/install.sh --test) bring the clients")
pytest.importorskip("langchain_openai", reason="the test extras (scripts/install.sh --test) bring the clients")

from tinycode import TARGET, THREADS, drafter_gguf  # noqa: E402

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
