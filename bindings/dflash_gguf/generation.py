"""The generation loop: a prompt and sampling options in, tokens out as the C++ speculator emits them,
with stopping criteria, logprobs, the cache, a shared llama_cpp.Llama context and the call's figures."""

from __future__ import annotations

import random
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import fields
from typing import Any

import numpy as np

from ._core import release_openmp_threads
from .sampling import ReasoningBudget, Sampling
from .stats import GenerationStats

# llama_cpp.Llama's stopping_criteria: (input_ids, logits of the token about to be emitted) -> stop before it
StoppingCriteria = Callable[[Any, Any], bool]

# Sampling's fields that a generation's caller gives by the same name (the rest: the object's window and
# the grammar, which the caller gives in another form)
CALLER_OPTIONS = tuple(
    f.name
    for f in fields(Sampling)
    if f.name not in ("penalty_last_n", "grammar", "grammar_root", "grammar_triggers", "reasoning")
)


def zero_is_no_limit(max_tokens: int | None) -> int | None:
    """llama_cpp.Llama's max_tokens: 0 (and below) generates up to the end of the context."""
    return None if max_tokens == 0 else max_tokens


class GenerationMixin:
    """SpeculativeLlama's generate_tokens and the loop every completion runs on."""

    def generate_tokens(
        self,
        prompt_tokens: Sequence[int],
        *,
        max_tokens: int | None = 16,
        temperature: float = 0.0,
        top_p: float = 1.0,
        top_k: int = 0,
        min_p: float = 0.0,
        repeat_penalty: float = 1.0,
        frequency_penalty: float = 0.0,
        presence_penalty: float = 0.0,
        logit_bias: dict[int, float] | None = None,
        seed: int | None = None,
        plain: bool = False,
        grammar: Any = None,
        logits_processor: Callable[[Any, Any], Any] | None = None,
        stopping_criteria: StoppingCriteria | None = None,
        typical_p: float = 1.0,
        mirostat_mode: int = 0,
        mirostat_tau: float = 5.0,
        mirostat_eta: float = 0.1,
        grammar_triggers: Sequence[str] = (),
        reasoning: ReasoningBudget | None = None,
    ) -> Iterator[int]:
        """Token ids as the loop emits them; stops at an end-of-generation token or when
        stopping_criteria says so (then `self.finish_reason` is "stop"), at max_tokens or a full
        context ("length"). With `grammar_triggers` the grammar is lazy (llama-server's grammar_lazy):
        it waits for one of these words in the output and constrains the text from that word on.
        `reasoning`: a reasoning budget in token ids (sampling.ReasoningBudget; create_chat_completion's
        reasoning_budget_tokens makes one from the chat template's thinking tags)."""
        sampling = self._sampling(max_tokens, grammar, locals(), grammar_triggers, reasoning)
        return self._generate(
            list(prompt_tokens),
            zero_is_no_limit(max_tokens),
            sampling,
            seed,
            plain,
            stopping_criteria=stopping_criteria,
        )

    def generate(
        self,
        tokens: Sequence[int],
        top_k: int = 40,
        top_p: float = 0.95,
        min_p: float = 0.05,
        typical_p: float = 1.0,
        temp: float = 0.80,
        repeat_penalty: float = 1.0,
        reset: bool = True,
        frequency_penalty: float = 0.0,
        presence_penalty: float = 0.0,
        tfs_z: float = 1.0,
        mirostat_mode: int = 0,
        mirostat_tau: float = 5.0,
        mirostat_eta: float = 0.1,
        penalize_nl: bool = True,
        logits_processor: Callable[[Any, Any], Any] | None = None,
        stopping_criteria: StoppingCriteria | None = None,
        grammar: Any = None,
    ) -> Iterator[int]:
        """llama_cpp.Llama.generate: the tokens sampled after `tokens`, up to and including an end-of-generation
        token (which llama_cpp.Llama yields too), or to the context's end. `reset`, `tfs_z` and `penalize_nl`
        are taken and ignored as llama_cpp.Llama 0.3.36 ignores the last two (the context's common prefix is
        reused either way); the seed is set_seed's (random without one)."""
        yield from self.generate_tokens(
            tokens,
            max_tokens=None,
            temperature=temp,
            top_p=top_p,
            top_k=top_k,
            min_p=min_p,
            typical_p=typical_p,
            repeat_penalty=repeat_penalty,
            frequency_penalty=frequency_penalty,
            presence_penalty=presence_penalty,
            mirostat_mode=mirostat_mode,
            mirostat_tau=mirostat_tau,
            mirostat_eta=mirostat_eta,
            logits_processor=logits_processor,
            stopping_criteria=stopping_criteria,
            grammar=grammar,
            seed=self._seed,
        )
        if self._end_token is not None:
            yield self._end_token

    def set_seed(self, seed: int) -> None:
        """llama_cpp.Llama.set_seed: generate()'s seed, and where a completion or chat names none, the start of
        the chain their seeds are drawn from (each the next of a random.Random seeded with the last)."""
        self._seed = None if seed < 0 or seed == 0xFFFFFFFF else seed  # llama.cpp's default seed: random

    def _sampling(
        self,
        max_tokens: int | None,
        grammar: Any,
        options: dict[str, Any],
        grammar_triggers: Sequence[str] = (),
        reasoning: ReasoningBudget | None = None,
    ) -> Sampling:
        """`options`: a generation's arguments (its locals()), of which those named as Sampling's fields
        are taken; `grammar` a llama_cpp.LlamaGrammar or GBNF text."""
        if max_tokens is not None and not isinstance(max_tokens, int):
            raise ValueError(f"max_tokens must be an int or None, got {max_tokens!r}")
        # a llama_cpp.LlamaGrammar (its GBNF text and root rule) or GBNF text
        text, root = (grammar._grammar, grammar._root) if hasattr(grammar, "_grammar") else (grammar or "", "root")
        taken = {name: options[name] for name in CALLER_OPTIONS}
        return Sampling(
            **taken,
            penalty_last_n=self.last_n_tokens_size,
            grammar=text,
            grammar_root=root,
            grammar_triggers=grammar_triggers,
            reasoning=reasoning,
        )

    def _generate(
        self,
        prompt: list[int],
        max_tokens: int | None,
        sampling: Sampling,
        seed: int | None,
        plain: bool,
        logprobs: int | None = None,
        stopping_criteria: StoppingCriteria | None = None,
        prompt_logprobs: bool = False,
    ) -> Iterator[int]:
        if stopping_criteria is not None and not callable(stopping_criteria):
            raise ValueError(
                f"stopping_criteria must be callable (input_ids, logits) -> bool, got {stopping_criteria!r}"
            )
        with self._idle():
            yield from self._generate_locked(
                prompt, max_tokens, sampling, seed, plain, logprobs, stopping_criteria, prompt_logprobs
            )

    def _generate_locked(
        self,
        prompt: list[int],
        max_tokens: int | None,
        sampling: Sampling,
        seed: int | None,
        plain: bool,
        logprobs: int | None,
        stopping_criteria: StoppingCriteria | None,
        prompt_logprobs: bool,
    ) -> Iterator[int]:
        room = self.n_ctx() - len(prompt)  # as llama_cpp.Llama: the completion fits the context with its prompt
        # below 0 no limit (the public calls turn llama_cpp.Llama's 0 into None); 0 scores the prompt alone
        limit = room if max_tokens is None or max_tokens < 0 else min(max_tokens, room)
        if seed is None or seed < 0:  # set_seed's chain, as llama_cpp.Llama's, else a random one
            seed = random.getrandbits(63) if self._seed is None else random.Random(self._seed).randint(0, 2**32)
            self._seed = None if self._seed is None else seed
        self.finish_reason = "length"
        self._end_token: int | None = None  # the end-of-generation token it ended at
        self._end_reasoning = False
        self._reasoning_armed = sampling.reasoning is not None  # end_reasoning() can end its thinking
        t0 = time.perf_counter()
        self._take_context_from_llama()
        try:
            if self.cache is not None and not prompt_logprobs:
                self._load_cached(prompt)
            first = self._spec.start(
                prompt,
                seed=seed,
                logprobs=-1 if logprobs is None else logprobs,
                keep_logits=stopping_criteria is not None,
                prompt_logprobs=prompt_logprobs,
                **sampling.start_kwargs(),
            )
        except BaseException:
            self._give_context_to_llama()
            raise
        if self._llama is not None:
            self._llama.n_tokens = 0  # while we stream: if it decodes, it starts from scratch and we notice
        self._token_logprobs.clear()
        if prompt_logprobs:
            skip = self._bos_skip(prompt)
            self._token_logprobs.extend([None, *self._spec.prompt_logprobs[skip:]][: len(prompt) - skip])
        if logprobs is not None:
            self._token_logprobs.extend(self._spec.last_logprobs)
        t_decode = time.perf_counter()
        n_out, end_of_text = 0, False
        pending = [first]
        if stopping_criteria is not None:
            # as llama_cpp.Llama asks it: before each token, with the prompt and output before it (a view
            # of one buffer) and the raw logits that chose the token
            ids = np.empty(len(prompt) + limit, dtype=np.intc)
            ids[: len(prompt)] = prompt
            logits = self._spec.last_logits
        failed = False
        try:
            while True:
                for i, tok in enumerate(pending):
                    if n_out >= limit:  # max_tokens 0: the prompt alone
                        return
                    if stopping_criteria is not None:
                        if stopping_criteria(ids[: len(prompt) + n_out], logits[i]):
                            self.finish_reason = "stop"
                            return
                        ids[len(prompt) + n_out] = tok
                    if self._spec.is_eog(tok):
                        self.finish_reason, end_of_text, self._end_token = "stop", True, tok
                        return
                    n_out += 1
                    yield tok
                    if n_out >= limit:
                        self.finish_reason = "length"
                        return
                if self._llama is not None and self._llama.n_tokens:
                    raise RuntimeError(
                        "the adopted llama_cpp.Llama decoded in the shared context while this "
                        "generation was streaming; its K/V is gone (finish or close a stream first)"
                    )
                if self._end_reasoning:  # asked for by end_reasoning(), from any thread
                    self._end_reasoning = False
                    self._spec.end_reasoning()
                # a step drafts no further than the tokens still wanted
                pending, full = self._spec.step_plain() if plain else self._spec.step(limit - n_out)
                if logprobs is not None:
                    self._token_logprobs.extend(self._spec.last_logprobs)
                if stopping_criteria is not None:
                    logits = self._spec.last_logits
                if full:
                    self.finish_reason = "length"
                    return
        except GeneratorExit:  # the caller closed the stream: what was generated stands
            raise
        except BaseException:
            failed = True
            raise
        finally:
            if not self._spec.closed:  # closed while a stream was open: nothing left to record
                if self._llama is not None and self._llama.n_tokens:  # it decoded while we streamed
                    self._take_context_from_llama()
                self._give_context_to_llama()
                self._record_stats(n_out, end_of_text, time.perf_counter() - t_decode, t0)
                if self.cache is not None and not failed:
                    state = self._save_state()
                    self.cache[state.input_ids.tolist()] = state
                # a pool of OpenMP workers left on this thread would slow every other thread's decoding
                # 5-8x (dflash/cpu_threads.h): the next generation, on any thread, starts its own
                release_openmp_threads()

    # An adopted llama_cpp.Llama shares our target context and reuses whatever its record
    # (input_ids[:n_tokens]) says the context holds; so do we with ours. Each side's record is made
    # true before the other decodes.
    def _take_context_from_llama(self) -> None:
        """Of what we put in the context, keep what the Llama's record still agrees with (it may have
        decoded since)."""
        llm = self._llama
        if llm is not None:
            self._spec.keep_cached_prefix(llm.input_ids[: llm.n_tokens].tolist())

    def _give_context_to_llama(self) -> None:
        llm = self._llama
        if llm is None:
            return
        held = self._spec.cached_tokens
        llm.input_ids[: len(held)] = held
        llm.n_tokens = len(held)
        llm._requires_eval = True  # its stored logits are not for this context's last token

    def _record_stats(self, n_out: int, end_of_text: bool, decode_s: float, t0: float) -> None:
        s = self._spec.stats
        reached, acc = s["pos_reached"], s["pos_accepted"]
        drafted_steps = s["steps"] - s["plain_steps"]
        self.stats = GenerationStats(
            prompt_tokens=s["prompt_tokens"],
            reused_prompt_tokens=s["reused_tokens"],
            completion_tokens=n_out,
            end_of_text=end_of_text,
            steps=s["steps"],
            plain_steps=s["plain_steps"],
            drafted=s["drafted"],
            accepted=s["accepted"],
            mean_accepted_length=(s["accepted"] + drafted_steps) / drafted_steps if drafted_steps else 1.0,
            per_position_acceptance=[a / r if r else 0.0 for a, r in zip(acc, reached)],
            accepted_by_position=list(acc),
            steps_by_length=list(s["steps_by_length"]),
            prefill_ms=s["prefill_ms"],
            calibration_ms=s["calibration_ms"],
            decode_ms=decode_s * 1e3,
            draft_ms=s["draft_ms"],
            verify_ms=s["verify_ms"],
            inject_ms=s["inject_ms"],
            rollback_ms=s["rollback_ms"],
            target_decodes=s["target_decodes"],
            tokens_per_second=n_out / decode_s if decode_s > 0 else 0.0,
        )
        if self.on_generation is not None:
            self.on_generation(self.stats)

    def _bos_skip(self, prompt: Sequence[int]) -> int:
        """llama_cpp.Llama lists an echoed prompt's logprobs without its leading BOS"""
        return 1 if prompt and prompt[0] == self._spec.token_bos else 0
