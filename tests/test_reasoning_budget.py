"""llama-server's reasoning budget in the speculative loop, on the bundled pair: a thinking block runs its
budget of tokens as the model writes them, then the forced end follows, token for token what plain decoding
with the same budget emits (greedy and seeded sampling, any draft length); the thinking holds a lazy grammar
back; bad budgets are refused. The chat-level budget (the template's tags, the generation prompt, the
server's settings) is compared with llama-server's in test_llama_server.py."""

from __future__ import annotations

import json
from typing import Any

import pytest

pytest.importorskip("llama_cpp", reason="llama-cpp-python is not installed")

from tinycode import N_CTX, TARGET, THREADS, drafter_gguf, prompts  # noqa: E402

from dflash_gguf import DFlashError, SpeculativeLlama  # noqa: E402
from dflash_gguf.sampling import ReasoningBudget  # noqa: E402

N_NEW = 40
FORCED = (5, 6, 7)
SEED = 3


@pytest.fixture(scope="module")
def llm() -> SpeculativeLlama:
    return SpeculativeLlama(str(TARGET), str(drafter_gguf("f32")), n_ctx=N_CTX, n_threads=THREADS, n_max=7)


@pytest.fixture(scope="module")
def prompt(llm: SpeculativeLlama) -> list[int]:
    return llm.tokenize(prompts()[0]["text"].encode(), add_bos=False)


def opened_by_prompt(prompt: list[int], tokens: int, llm: SpeculativeLlama) -> ReasoningBudget:
    """A thinking the prompt's last token opened (as a template's <think> does), closed by a tag the model
    never writes (two of the vocabulary's last tokens)."""
    never = (llm.n_vocab() - 1, llm.n_vocab() - 2)
    return ReasoningBudget(tokens, (prompt[-1],), (never,), FORCED, (prompt[-1],))


def run(llm: SpeculativeLlama, prompt: list[int], plain: bool = False, **kw: Any) -> list[int]:
    return list(llm.generate_tokens(prompt, max_tokens=N_NEW, plain=plain, seed=SEED, **kw))


@pytest.mark.parametrize("temperature", [0.0, 0.8])
@pytest.mark.parametrize("budget", [0, 1, 10])
def test_the_budget_forces_the_end_as_plain_decoding_does(
    llm: SpeculativeLlama, prompt: list[int], temperature: float, budget: int
) -> None:
    free = run(llm, prompt, temperature=temperature)
    reasoning = opened_by_prompt(prompt, budget, llm)
    plain = run(llm, prompt, plain=True, temperature=temperature, reasoning=reasoning)
    # the thinking is the model's up to the budget, then the forced end
    assert plain[:budget] == free[:budget]
    assert tuple(plain[budget : budget + len(FORCED)]) == FORCED
    assert run(llm, prompt, temperature=temperature, reasoning=reasoning) == plain
    with llm.share_weights(n_max=3) as three:
        assert run(three, prompt, temperature=temperature, reasoning=reasoning) == plain


def test_the_forced_rows_are_drafted_as_forced(llm: SpeculativeLlama, prompt: list[int]) -> None:
    """Rows the budget forces once the drafts before them are accepted are drafted as the forced tokens:
    the forced end costs no verify of its own."""
    reasoning = opened_by_prompt(prompt, 0, llm)
    out = list(llm.generate_tokens(prompt, max_tokens=len(FORCED) + 1, reasoning=reasoning))
    assert tuple(out[: len(FORCED)]) == FORCED
    # the first forced token comes with the prompt; one step drafts the rest, all accepted
    assert llm.stats.steps == 1 and llm.stats.accepted == len(FORCED) - 1


def test_a_thinking_holds_a_lazy_grammar_back(llm: SpeculativeLlama, prompt: list[int]) -> None:
    """A trigger word written while thinking starts no grammar (llama-server's: a call inside the thinking
    is none); without the thinking the same word does."""
    free = run(llm, prompt)
    word = llm.detokenize(free[:2]).decode()
    lazy = {"grammar": f"root ::= {json.dumps(word)} [Z]+", "grammar_triggers": [word]}
    assert run(llm, prompt, **lazy) != free  # the grammar starts at the word
    held = opened_by_prompt(prompt, -1, llm)
    assert run(llm, prompt, reasoning=held, **lazy) == free


def test_a_forced_end_the_grammar_refuses_is_an_error(llm: SpeculativeLlama, prompt: list[int]) -> None:
    free = run(llm, prompt)
    allowed = llm.detokenize(free[:3]).decode()
    grammar = f"root ::= {json.dumps(allowed)} [a-z]*"
    with pytest.raises(DFlashError, match="reasoning budget forces"):
        run(llm, prompt, grammar=grammar, reasoning=opened_by_prompt(prompt, 1, llm))
    assert run(llm, prompt) == free  # the model goes on serving


def test_bad_budgets_are_refused(llm: SpeculativeLlama, prompt: list[int]) -> None:
    outside = ReasoningBudget(3, (prompt[-1],), ((llm.n_vocab(),),), FORCED)
    with pytest.raises(DFlashError, match="closing tag is outside the vocabulary"):
        run(llm, prompt, reasoning=outside)
    messages = [{"role": "user", "content": "hi"}]
    with pytest.raises(ValueError, match="reasoning_budget_tokens must be an int >= 0"):
        llm.create_chat_completion(messages, reasoning_budget_tokens=-2)


def test_a_budget_spent_inside_a_character_waits_for_its_end(llm: SpeculativeLlama, prompt: list[int]) -> None:
    """As llama-server's: the end is forced only after a token whose text ends a UTF-8 character (a byte
    token that opens a three-byte character never does)."""
    piece = {t: llm._spec.token_to_piece(t, False) for t in range(llm.n_vocab())}
    lead = next(t for t, b in piece.items() if b == b"\xe2")
    letter = next(t for t, b in piece.items() if b == b"a")
    reasoning = opened_by_prompt(prompt, 2, llm)
    for token, ends in ((letter, True), (lead, False)):
        out = run(llm, prompt, logit_bias={token: 100.0}, reasoning=reasoning)
        assert out[:2] == [token, token]
        assert (tuple(out[2 : 2 + len(FORCED)]) == FORCED) is ends
        assert not ends or set(out[:2] + out[2 + len(FORCED) :]) == {token}
        assert ends or set(out) == {token}  # never a whole character: the forced end never comes
        assert run(llm, prompt, plain=True, logit_bias={token: 100.0}, reasoning=reasoning) == out


THINKING_TEMPLATE = (  # opens the thinking, as Qwen3.5's and DeepSeek-R1's templates do
    "{% for m in messages %}[{{ m.role }}] {{ m.content }}\n{% endfor %}"
    "{% if add_generation_prompt %}[assistant]\n<think>\n{% endif %}"
)


def test_end_reasoning_ends_a_streamed_thinking_as_a_budget_would() -> None:
    """end_reasoning() during a chat streamed with reasoning_control ends its thinking at the next step: the
    reply is the one some reasoning budget gives (the thinking cut, the message and </think>, the answer);
    without reasoning_control, or with no generation under way, it does nothing and says so."""
    messages = [{"role": "user", "content": "import os"}]
    kw: dict[str, Any] = {"max_tokens": 40, "temperature": 0.0, "reasoning_format": "deepseek"}
    with SpeculativeLlama(
        str(TARGET), str(drafter_gguf("f32")), n_ctx=N_CTX, n_threads=THREADS, chat_template=THINKING_TEMPLATE
    ) as chat:

        def streamed(**options: Any) -> tuple[dict[str, str], list[bool]]:
            joined, answers = {"reasoning_content": "", "content": ""}, []
            for i, chunk in enumerate(chat.create_chat_completion(messages, stream=True, **kw, **options)):
                for key in joined:
                    joined[key] += chunk["choices"][0]["delta"].get(key) or ""
                if i == 3:
                    answers.append(chat.end_reasoning())
            return joined, answers

        free = chat.create_chat_completion(messages, **kw)["choices"][0]["message"]
        assert free["reasoning_content"] and not free["content"]  # the model never ends a thinking itself
        assert streamed() == ({"reasoning_content": free["reasoning_content"], "content": ""}, [False])
        ended, answers = streamed(reasoning_control=True, reasoning_budget_message=" ok")
        assert answers == [True] and ended["content"] and ended["reasoning_content"].endswith(" ok")
        budgeted = [
            chat.create_chat_completion(messages, reasoning_budget_tokens=n, reasoning_budget_message=" ok", **kw)[
                "choices"
            ][0]["message"]
            for n in range(1, 20)
        ]
        assert {"role": "assistant", **ended} in budgeted
        assert not chat.end_reasoning()
