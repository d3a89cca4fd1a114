"""Completions in llama_cpp.Llama's shapes: text deltas cut at stop strings, streamed chunks or one
result, logprobs, echo, fill in the middle, lists of prompts."""

from __future__ import annotations

import operator
import time
import uuid
from collections.abc import Callable, Iterator, Sequence
from typing import Any

from .generation import StoppingCriteria, zero_is_no_limit
from .infill import fim_prompt
from .llama_compat import (
    LogprobCursor,
    check_logprobs,
    completion_logprobs,
    sum_usage,
)
from .sampling import Sampling
from .text import TextStream


class CompletionMixin:
    """SpeculativeLlama's create_completion and __call__, on its generation loop."""

    def _completion_chunks(
        self,
        prompt: str | Sequence[int],
        max_tokens: int | None,
        sampling: Sampling,
        stop: str | list[str] | None,
        seed: int | None,
        logprobs: int | None = None,
        stopping_criteria: StoppingCriteria | None = None,
        prompt_logprobs: bool = False,
        shown: frozenset[int] = frozenset(),
    ) -> Iterator[tuple[str, str | None]]:
        """(text delta, finish_reason or None); the tokens go to self._completion_tokens as they come
        (after the prompt's, with prompt_logprobs); self.stats are the call's when the last one comes.
        `shown`: special tokens whose text is the reply's (where others show none)."""
        if isinstance(prompt, str):
            tokens = self.tokenize(prompt, special=True)
        else:
            try:
                tokens = [operator.index(t) for t in prompt]  # ints or numpy integers
            except TypeError:
                raise ValueError(f"prompt must be a string or a sequence of token ids, got {prompt!r:.80}") from None
        stops = [stop] if isinstance(stop, str) else list(stop or [])
        stream = TextStream(stops)
        self._completion_tokens.clear()
        if prompt_logprobs:
            self._completion_tokens.extend(tokens[self._bos_skip(tokens) :])
        generation = self._generate(
            tokens,
            max_tokens,
            sampling,
            seed,
            plain=False,
            logprobs=logprobs,
            stopping_criteria=stopping_criteria,
            prompt_logprobs=prompt_logprobs,
        )
        try:
            for tok in generation:
                self._completion_tokens.append(tok)
                delta = stream.feed(self._spec.token_to_piece(tok, tok in shown))
                if delta:
                    yield delta, None
                if stream.stopped:
                    break
        finally:
            generation.close()  # a stop string ends it here: its figures are recorded before the last chunk
        self.last_usage = self.stats.usage()
        self.stopping_word = stream.stopped_by
        reason = "stop" if stream.stopped else self.finish_reason
        yield stream.flush(), reason

    def create_completion(
        self,
        prompt: str | Sequence[int],
        max_tokens: int | None = 16,
        temperature: float = 0.8,
        top_p: float = 0.95,
        top_k: int = 40,
        min_p: float = 0.05,
        stop: str | list[str] | None = None,
        seed: int | None = None,
        stream: bool = False,
        repeat_penalty: float = 1.0,
        frequency_penalty: float = 0.0,
        presence_penalty: float = 0.0,
        logit_bias: dict[int, float] | None = None,
        echo: bool = False,
        model: str | None = None,
        logprobs: int | None = None,
        grammar: Any = None,
        logits_processor: Callable[[Any, Any], Any] | None = None,
        stopping_criteria: StoppingCriteria | None = None,
        typical_p: float = 1.0,
        mirostat_mode: int = 0,
        mirostat_tau: float = 5.0,
        mirostat_eta: float = 0.1,
        tfs_z: float = 1.0,  # llama_cpp.Llama 0.3.36 takes it and ignores it (no tail-free sampler)
        suffix: str | None = None,
    ) -> dict[str, Any] | Iterator[dict[str, Any]]:
        """llama_cpp.Llama.create_completion's arguments and result shapes. `tfs_z` is ignored, as
        llama_cpp.Llama 0.3.36 ignores it. `suffix`: fill in the middle, the prompt being the text before
        the cursor and the suffix the text after it, in the target's FIM tokens ([BOS] <FIM_PRE> prompt
        <FIM_SUF> suffix <FIM_MID>; ValueError for a target without them). `grammar`: a
        llama_cpp.LlamaGrammar or GBNF text. `logprobs=n`: the generated tokens' log-probabilities under
        the target's raw logits and the n most likely at each; with echo the prompt's too (the first
        None, as in OpenAI's API; the whole prompt is decoded again for them). Each token's string is the
        text it completes, so they join to the text (a character split over byte tokens: "" for its
        leading bytes), with distinct top_logprobs keys (llama_compat.top_keys); an end of text the
        target sampled comes last as "" (usage counts it, as llama-server does).
        `logits_processor(input_ids, scores) -> scores` and `stopping_criteria(input_ids, logits) -> bool`
        (llama_cpp.LogitsProcessorList / StoppingCriteriaList, or any callable) are called as
        llama_cpp.Llama calls them: once per generated token, with the prompt and output before it;
        stopping_criteria gets the raw logits that chose the token and, when true, the completion ends
        before that token with finish_reason "stop". A list of prompts (texts or token lists, as OpenAI's
        API and llama-server take them) gives one choice per prompt, in order."""
        if isinstance(prompt, (list, tuple)) and not all(isinstance(t, int) for t in prompt):
            kw = {k: v for k, v in locals().items() if k not in ("self", "prompt")}
            return self._completions_of(prompt, kw)
        check_logprobs(logprobs)
        echo_logprobs = echo and logprobs is not None
        tokens: str | Sequence[int] = prompt
        if suffix is not None:
            if not isinstance(suffix, str):
                raise ValueError(f"suffix must be a string or None, got {suffix!r:.80}")
            if echo_logprobs:
                raise ValueError("echo with logprobs lists the prompt's tokens: not with a suffix (FIM tokens)")
            fim = self._fim()
            prefix = self.tokenize(prompt.encode(), add_bos=False) if isinstance(prompt, str) else prompt
            tokens = fim_prompt(fim, self._bos(), prefix, self.tokenize(suffix.encode(), add_bos=False))
        n_special = 0
        if echo_logprobs and isinstance(tokens, str):  # its special tokens are in its text: listed with it
            tokens = self.tokenize(tokens, special=True)
            n_special = len(tokens) - self._bos_skip(tokens)
        sampling = self._sampling(max_tokens, grammar, locals())
        cid, created = f"cmpl-{uuid.uuid4()}", int(time.time())
        # with echo, max_tokens 0 scores the prompt alone (what OpenAI clients ask for, lm-eval's loglikelihoods)
        chunks = self._completion_chunks(
            tokens,
            max_tokens if echo else zero_is_no_limit(max_tokens),
            sampling,
            stop,
            seed,
            logprobs,
            stopping_criteria,
            echo_logprobs,
        )
        model_name = model if model is not None else self.model_path
        prompt_text = ""
        if echo or logprobs is not None:  # the echoed text, or where the logprobs' text offsets start
            prompt_text = prompt if isinstance(prompt, str) else self.detokenize(prompt).decode("utf-8", "replace")
        head = prompt_text if echo else ""
        cursor = None
        if logprobs is not None:
            cursor = LogprobCursor(
                self._completion_tokens,
                self._token_logprobs,
                self._spec.token_to_piece,
                0 if echo else len(prompt_text),
                n_special,
            )
        fingerprint = self.system_fingerprint

        def shape(text: str, reason: str | None, upto: int | None = None) -> dict[str, Any]:
            """A result or chunk of `text`; its logprobs: the tokens up to `upto` characters released (the
            last: and an end of text the target sampled, as the token "", counted in usage as it is)."""
            lp = None
            if cursor is not None and upto is not None:
                lp = completion_logprobs(cursor.take(upto, self._end_token if reason else None))
            return {
                "id": cid,
                "object": "text_completion",
                "created": created,
                "model": model_name,
                "system_fingerprint": fingerprint,
                "choices": [{"text": text, "index": 0, "logprobs": lp, "finish_reason": reason}],
            }

        if stream:

            def gen() -> Iterator[dict[str, Any]]:
                if head and not echo_logprobs:
                    yield shape(head, None)
                released = len(head) if echo_logprobs else 0  # what the cursor has listed text for
                for i, (text, reason) in enumerate(chunks):
                    if i == 0 and echo_logprobs:  # after start(): the prompt's logprobs exist now
                        yield shape(head, None, released)
                    released += len(text)
                    if text or reason:
                        yield shape(text, reason, released if text or self._end_token is not None else None)

            return gen()
        parts, reason = [head], None
        for text, reason in chunks:
            parts.append(text)
        text = "".join(parts)
        out = shape(text, reason, len(text))
        out["usage"] = self.stats.usage()
        return out

    def _completions_of(self, prompts: Sequence[Any], kw: dict[str, Any]) -> dict[str, Any] | Iterator[dict[str, Any]]:
        """create_completion over several prompts: choice i is prompt i's, under the first one's id."""
        if not prompts or not all(
            isinstance(p, str)
            or (isinstance(p, (list, tuple)) and p and all(isinstance(t, int) and not isinstance(t, bool) for t in p))
            for p in prompts
        ):
            raise ValueError("prompt must be a string or a sequence of token ids, or a non-empty list of those")

        def indexed(out: dict[str, Any], i: int, cid: str) -> dict[str, Any]:
            return {**out, "id": cid, "choices": [{**c, "index": i} for c in out["choices"]]}

        if kw["stream"]:

            def gen() -> Iterator[dict[str, Any]]:
                cid, usages = None, []
                for i, p in enumerate(prompts):
                    for chunk in self.create_completion(p, **kw):
                        cid = cid or chunk["id"]
                        yield indexed(chunk, i, cid)
                    usages.append(self.last_usage)
                self.last_usage = sum_usage(usages)

            return gen()
        outs = [self.create_completion(p, **kw) for p in prompts]
        usage = self.last_usage = sum_usage([o["usage"] for o in outs])
        return {**outs[0], "choices": [{**o["choices"][0], "index": i} for i, o in enumerate(outs)], "usage": usage}

    def __call__(self, prompt: str, **kwargs: Any) -> dict[str, Any] | Iterator[dict[str, Any]]:
        return self.create_completion(prompt, **kwargs)
