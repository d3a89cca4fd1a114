"""SpeculativeLlama: llama-cpp-python-shaped completions, decoded speculatively.

The target runs in libllama and the DFlash drafter in our ggml graph; the
C++ speculator does one draft/verify/accept step per call with the GIL
released, and this module turns steps into completions: streaming, stop
strings, finish reasons and statistics.
"""

from __future__ import annotations

import contextlib
import json
import math
import operator
import random
import threading
import time
import uuid
import warnings
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field, fields
from typing import TYPE_CHECKING, Any

import numpy as np

from ._core import DFlashError, Speculator, release_openmp_threads
from .chat_reply import ReplyParser, reply_message, reply_syntax, tool_call_grammar
from .infill import fim_prompt, require_fim, server_infill_prompt
from .llama_compat import (
    LogprobCursor,
    TokenLogprob,
    chat_logprobs,
    check_logprobs,
    completion_logprobs,
    forced_tool,
    response_format_grammar,
    sum_usage,
    system_fingerprint,
    tool_functions,
)
from .state import SpeculativeState, cached_state_for
from .text import TextStream

if TYPE_CHECKING:
    from typing_extensions import Self

# llama_cpp.Llama's stopping_criteria: (input_ids, logits of the token about to be emitted) -> stop before it
StoppingCriteria = Callable[[Any, Any], bool]


@dataclass
class GenerationStats:
    """Figures of the last call, all measured."""

    prompt_tokens: int = 0
    reused_prompt_tokens: int = 0
    completion_tokens: int = 0  # the text's tokens
    end_of_text: bool = False  # it ended at an end-of-generation token the target sampled (not in the text)
    steps: int = 0  # target verify passes
    plain_steps: int = 0  # of which without drafting (fallback)
    drafted: int = 0
    accepted: int = 0
    mean_accepted_length: float = 0.0  # tokens per target pass, bonus token included
    per_position_acceptance: list[float] = field(default_factory=list)
    prefill_ms: float = 0.0
    calibration_ms: float = 0.0  # n_max="auto": timing each draft length, once, before the first prefill
    decode_ms: float = 0.0
    draft_ms: float = 0.0
    verify_ms: float = 0.0
    inject_ms: float = 0.0
    rollback_ms: float = 0.0  # a recurrent target's state checkpoints and restores
    tokens_per_second: float = 0.0  # completion tokens / decode time (prefill excluded)

    def line(self) -> str:
        return (
            f"{self.completion_tokens} tokens, {self.tokens_per_second:.1f} tok/s, "
            f"mean accepted length {self.mean_accepted_length:.2f} over {self.steps} steps "
            f"({self.accepted}/{self.drafted} drafts accepted), draft {self.draft_ms:.1f} ms, "
            f"verify {self.verify_ms:.1f} ms, prefill {self.prefill_ms:.1f} ms"
        )

    @property
    def generated_tokens(self) -> int:
        """The tokens the target sampled: the text's and a final end-of-generation token (llama-server's
        count, its usage.completion_tokens and tokens_predicted)."""
        return self.completion_tokens + self.end_of_text

    def usage(self) -> dict[str, Any]:
        """OpenAI's `usage` of the call, as llama-server gives it: prompt_tokens_details.cached_tokens are
        the prompt's tokens reused from what the context held (or a saved state), not decoded again."""
        n = self.generated_tokens
        return {
            "prompt_tokens": self.prompt_tokens,
            "completion_tokens": n,
            "total_tokens": self.prompt_tokens + n,
            "prompt_tokens_details": {"cached_tokens": self.reused_prompt_tokens},
        }


def draft_device_for(device: str, n_gpu_layers: int) -> str:
    """device="auto": the drafter goes where the target's layers are (the first GPU when any are
    offloaded, else the CPU), so a CPU-only run never wakes a GPU; a named device is kept."""
    if device == "auto" and n_gpu_layers == 0:
        return "cpu"
    return device


def _parse_n_max(n_max: int | str) -> tuple[int, bool]:
    """n_max as (cap, adaptive): "auto" lets the loop choose per step (cap block_size - 1)."""
    if n_max == "auto":
        return 0, True
    if isinstance(n_max, bool) or not isinstance(n_max, int) or n_max < 0:
        raise ValueError(f"n_max must be 'auto' or an int >= 0 (0 = block_size - 1), got {n_max!r}")
    return n_max, False


@dataclass(frozen=True)
class Sampling:
    """How the next token is chosen, with llama_cpp.Llama's meanings: logit_bias is added to the raw logits,
    then llama.cpp's repeat / frequency / presence penalties over the last penalty_last_n generated tokens
    (the prompt not counted, in greedy decoding too), then top-k, typical-p, top-p, min-p and the
    temperature; or, with mirostat_mode 1 or 2, llama.cpp's Mirostat sampler instead of those (as in
    llama_cpp.Llama, the temperature then only tells greedy (0) from sampled).
    A logits_processor (llama_cpp.Llama's: `(input_ids, scores) -> scores`) rewrites the raw logits first,
    once per generated token, with the prompt and output before it."""

    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    repeat_penalty: float = 1.0
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    penalty_last_n: int = 64
    logit_bias: dict[int, float] | None = None
    grammar: str = ""  # GBNF, applied after the penalties (as llama-cpp-python's sampler chain does)
    grammar_root: str = "root"
    logits_processor: Callable[[Any, Any], Any] | None = None
    typical_p: float = 1.0
    mirostat_mode: int = 0
    mirostat_tau: float = 5.0
    mirostat_eta: float = 0.1
    # non-empty: the grammar waits for one of these words in the output, then constrains the rest from it
    # on (llama.cpp's lazy grammars: a tool call may start anywhere in a free reply)
    grammar_triggers: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0 (0 = greedy), got {self.temperature}")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0 (0 = off), got {self.top_k}")
        if not 0.0 <= self.min_p <= 1.0:
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p}")
        if not 0.0 < self.typical_p <= 1.0:
            raise ValueError(f"typical_p must be in (0, 1], got {self.typical_p}")
        if self.mirostat_mode not in (0, 1, 2) or isinstance(self.mirostat_mode, bool):
            raise ValueError(f"mirostat_mode must be 0 (off), 1 or 2, got {self.mirostat_mode!r}")
        if not math.isfinite(self.mirostat_tau):
            raise ValueError(f"mirostat_tau must be finite, got {self.mirostat_tau}")
        if not (math.isfinite(self.mirostat_eta) and self.mirostat_eta >= 0):
            raise ValueError(f"mirostat_eta must be >= 0, got {self.mirostat_eta}")
        if not (math.isfinite(self.repeat_penalty) and self.repeat_penalty > 0):
            raise ValueError(f"repeat_penalty must be > 0 (1 = off), got {self.repeat_penalty}")
        for name in ("frequency_penalty", "presence_penalty"):
            if not math.isfinite(getattr(self, name)):
                raise ValueError(f"{name} must be finite (0 = off), got {getattr(self, name)}")
        if isinstance(self.penalty_last_n, bool) or not isinstance(self.penalty_last_n, int) or self.penalty_last_n < 0:
            raise ValueError(f"penalty_last_n (last_n_tokens_size) must be an int >= 0, got {self.penalty_last_n!r}")
        if not isinstance(self.grammar, str) or not isinstance(self.grammar_root, str):
            msg = f"grammar must be a llama_cpp.LlamaGrammar or GBNF text, got {self.grammar!r}"
            raise ValueError(msg)  # noqa: TRY004 - a ValueError, as every other bad argument of a generation
        if self.grammar_triggers:  # any sequence of words (a str is one word mistaken for a list: refused)
            words = () if isinstance(self.grammar_triggers, str) else tuple(self.grammar_triggers)
            if not words or not all(isinstance(w, str) and w for w in words):
                raise ValueError(f"grammar_triggers must be non-empty words, got {self.grammar_triggers!r}")
            if not self.grammar:
                raise ValueError("grammar_triggers wait to switch a grammar on: give a grammar too")
            object.__setattr__(self, "grammar_triggers", words)
        if self.logit_bias is not None:
            try:
                bias = {int(k): float(v) for k, v in dict(self.logit_bias).items()}
            except (TypeError, ValueError) as e:
                raise ValueError(f"logit_bias must map token ids to numbers, got {self.logit_bias!r}") from e
            if any(math.isnan(v) for v in bias.values()):
                raise ValueError(f"logit_bias values must not be NaN, got {self.logit_bias!r}")
            object.__setattr__(self, "logit_bias", bias)

    def start_kwargs(self) -> dict[str, Any]:
        """The sampling keywords of _core.Speculator.start."""
        # not asdict: it deep-copies, and a stateful logits processor must be the caller's own object
        kw = {f.name: getattr(self, f.name) for f in fields(self)}
        kw["logit_bias"] = self.logit_bias or {}
        return kw


class SpeculativeLlama:
    """A target GGUF plus a DFlash drafter GGUF, used like `llama_cpp.Llama`."""

    def __init__(
        self,
        target: str,
        draft: str,
        *,
        n_ctx: int = 4096,
        n_batch: int = 512,
        n_gpu_layers: int = 0,
        n_threads: int = 0,
        n_max: int | str = "auto",
        draft_q: str = "logits",
        device: str = "auto",
        fallback: bool = True,
        repack: bool | None = None,
        last_n_tokens_size: int = 64,
        verbose: bool = False,
        sampler: str = "gumbel",
        _core: Speculator | None = None,
    ) -> None:
        # libllama logs through llama-cpp-python's logger; like llama_cpp.Llama, quiet unless verbose
        from llama_cpp import _logger

        _logger.set_verbose(verbose)
        Sampling(penalty_last_n=last_n_tokens_size)  # raises for a bad window before anything loads
        if _core is None:
            for what, path in (("target", target), ("draft", draft)):
                if not isinstance(path, str) or not path:
                    raise ValueError(f"{what} must be a GGUF file path, got {path!r}")
            if n_ctx < 16:
                raise ValueError(f"n_ctx must be >= 16, got {n_ctx}")
            cap, adaptive = _parse_n_max(n_max)
            _core = Speculator(
                target,
                draft,
                n_ctx=n_ctx,
                n_batch=n_batch,
                n_gpu_layers=n_gpu_layers,
                n_threads=n_threads,
                device=draft_device_for(device, n_gpu_layers),
                n_max=cap,
                adaptive=adaptive,
                draft_q=draft_q,
                fallback=fallback,
                repack=repack,
                sampler=sampler,
            )
        self._spec = _core
        self.sampler = sampler
        self._fingerprint: str | None = None
        self.last_n_tokens_size = last_n_tokens_size  # the penalties' window, as llama_cpp.Llama's
        self.model_path = target
        self.draft_path = draft
        self.n_batch = n_batch
        self._lock = threading.Lock()
        self._llama: Any = None  # an adopted llama_cpp.Llama, kept alive
        self.cache: Any = None  # set_cache's
        # the generation under way (one at a time): its tokens and, when asked for, their logprobs as
        # (logprob, [(id, logprob) of the most likely]); with echo, the prompt's tokens first (the first
        # of them with None)
        self._completion_tokens: list[int] = []
        self._token_logprobs: list[TokenLogprob | None] = []
        self._end_token: int | None = None
        self.stats = GenerationStats()
        # OpenAI's usage of the last completion or chat, streamed ones too (a list of prompts: summed)
        self.last_usage: dict[str, Any] = self.stats.usage()
        block = self._spec.draft_hparams["block_size"]
        if isinstance(n_max, int) and n_max > block - 1:
            warnings.warn(f"n_max {n_max} clamped to block_size - 1 = {block - 1}", stacklevel=2)

    @classmethod
    def from_llama(
        cls,
        llm: Any,
        draft: str,
        *,
        n_max: int | str = "auto",
        draft_q: str = "logits",
        device: str = "auto",
        fallback: bool = True,
        sampler: str = "gumbel",
    ) -> SpeculativeLlama:
        """Adopt an existing llama_cpp.Llama as the target (its model and context are reused)."""
        try:
            model, ctx, path = llm._model.model, llm._ctx.ctx, llm.model_path
        except AttributeError as e:
            raise ValueError(f"from_llama needs a llama_cpp.Llama instance, got {type(llm).__name__}") from e
        if model is None or ctx is None:
            raise ValueError("from_llama: this llama_cpp.Llama is closed (it has no model or context left)")
        model_ptr, ctx_ptr = int(model), int(ctx)
        cap, adaptive = _parse_n_max(n_max)
        n_gpu_layers = int(getattr(getattr(llm, "model_params", None), "n_gpu_layers", 0))
        core = Speculator.adopt(
            model_ptr,
            ctx_ptr,
            path,
            draft,
            n_threads=int(llm.n_threads or 0),
            device=draft_device_for(device, n_gpu_layers),
            n_max=cap,
            adaptive=adaptive,
            draft_q=draft_q,
            fallback=fallback,
            sampler=sampler,
        )
        window = int(getattr(llm, "last_n_tokens_size", 64))
        obj = cls(path, draft, n_max=n_max, last_n_tokens_size=window, sampler=sampler, _core=core)
        obj.n_batch = int(getattr(llm, "n_batch", obj.n_batch))
        obj._llama = llm
        # Whatever frees the Llama's context (its close(), or the garbage collector finalizing its
        # LlamaContext, in any order with us), let go of the context first: the context's own exit
        # stack runs this before the free registered earlier. It holds the native core only, which
        # holds no Python object: no cycle.
        llm._ctx._exit_stack.callback(core.close)
        return obj

    def close(self) -> None:
        """Free the target and the drafter now (an adopted Llama's context is handed back as it was
        found, and the Llama stays usable); calls on this object raise after. `with SpeculativeLlama(...)
        as llm:` closes at the end of the block."""
        self._spec.close()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __del__(self) -> None:
        # before the attributes go, so that an adopted Llama (one of them) still holds its context
        spec = getattr(self, "_spec", None)
        if spec is not None and not spec.closed:
            spec.close()

    # --- tokens and text -------------------------------------------------

    def tokenize(
        self,
        text: str | bytes,
        add_bos: bool = True,
        special: bool = False,
        *,
        add_special: bool | None = None,
        parse_special: bool | None = None,
    ) -> list[int]:
        """llama_cpp.Llama.tokenize: `add_bos` adds the model's BOS (where its vocabulary asks for one),
        `special` reads special-token text such as <|im_start|> as those tokens (completions and chats
        tokenize their prompts so). `add_special` / `parse_special`: the same by libllama's names."""
        if isinstance(text, str):
            text = text.encode("utf-8")
        return self._spec.tokenize(
            text, add_bos if add_special is None else add_special, special if parse_special is None else parse_special
        )

    def detokenize(
        self, tokens: Sequence[int], prev_tokens: Sequence[int] | None = None, special: bool = False
    ) -> bytes:
        """llama_cpp.Llama.detokenize (which ignores prev_tokens too): `special` renders special tokens'
        text; a leading space after a BOS is dropped."""
        out = b"".join(self._spec.token_to_piece(t, special) for t in tokens)
        return out[1:] if tokens and tokens[0] == self._spec.token_bos and out[:1] == b" " else out

    @property
    def system_fingerprint(self) -> str:
        """What completions and chats answer as OpenAI's `system_fingerprint`: this package's version and a
        hash of libllama's version, the target and drafter files and the sampler (llama_compat)."""
        if self._fingerprint is None:
            from . import __version__

            self._fingerprint = system_fingerprint(__version__, self.model_path, self.draft_path, self.sampler)
        return self._fingerprint

    # llama_cpp.Llama's accessors, as methods like theirs
    def n_ctx(self) -> int:
        return self._spec.n_ctx

    def n_vocab(self) -> int:
        return self._spec.n_vocab

    def token_eos(self) -> int:
        return self._spec.token_eos

    def token_bos(self) -> int:
        return self._spec.token_bos

    def infill_tokens(
        self,
        input_prefix: str,
        input_suffix: str,
        prompt: str = "",
        input_extra: Sequence[dict[str, Any]] = (),
        n_predict: int = -1,
    ) -> list[int]:
        """The prompt llama-server's /infill makes of these fields (its names) with this object's n_batch
        and n_ctx: pass it to create_completion. `input_extra`: [{"filename": ..., "text": ...}], other
        files of the project, kept as far as the context allows after n_predict tokens. ValueError when
        the target has no fill-in-the-middle tokens."""
        fim = self._fim()
        for chunk in input_extra:
            if (
                not isinstance(chunk, dict)
                or not isinstance(chunk.get("text"), str)
                or not isinstance(chunk.get("filename", ""), str)
            ):
                msg = f'input_extra chunks must be {{"filename": string, "text": string}}, got {chunk!r:.80}'
                raise ValueError(msg)
        for name, value in (("input_prefix", input_prefix), ("input_suffix", input_suffix), ("prompt", prompt)):
            if not isinstance(value, str):
                raise ValueError(f"{name} must be a string, got {value!r:.80}")

        def tokenize(text: str, special: bool) -> list[int]:
            return self.tokenize(text.encode(), add_bos=False, special=special)

        return server_infill_prompt(
            fim,
            self._bos(),
            tokenize,
            input_prefix,
            input_suffix,
            prompt,
            input_extra,
            self.n_batch,
            self.n_ctx(),
            n_predict,
        )

    def _fim(self) -> dict[str, int]:
        fim = self._spec.fim_tokens
        require_fim(fim, self.model_path)
        return fim

    def _bos(self) -> list[int]:
        return [self._spec.token_bos] if self._spec.add_bos else []

    @property
    def n_max(self) -> int | str:
        """Drafted tokens verified per step: an int, or "auto" (chosen per step from measured costs)."""
        return "auto" if self._spec.adaptive else self._spec.n_max

    @n_max.setter
    def n_max(self, n: int | str) -> None:
        self._spec.set_n_max(*_parse_n_max(n))

    # --- saved contexts --------------------------------------------------

    def save_state(self) -> SpeculativeState:
        """What the context holds now (the target's K/V and the drafter's, for `state.input_ids`): a
        later generation whose prompt continues those tokens, after load_state, prefills only the rest."""
        with self._idle():
            self._take_context_from_llama()
            try:
                return self._save_state()
            finally:
                self._give_context_to_llama()

    def load_state(self, state: SpeculativeState) -> None:
        """Make the context hold what save_state saved (from this object, or another one over the same
        target and drafter files and a context at least as long). A state that does not fit raises
        DFlashError and leaves an empty context."""
        if not isinstance(state, SpeculativeState):
            raise TypeError(f"load_state takes a SpeculativeState (from save_state), got {type(state).__name__}")
        with self._idle():
            try:
                self._load_state(state)
            finally:
                self._give_context_to_llama()

    def reset(self) -> None:
        """llama_cpp.Llama.reset: forget what the context holds (the next prompt is prefilled whole)."""
        with self._idle():
            self._spec.keep_cached_prefix([])
            self._give_context_to_llama()

    def set_cache(self, cache: Any) -> None:
        """llama_cpp.Llama.set_cache: with a cache (`llama_cpp.LlamaRAMCache(capacity_bytes)`,
        `LlamaDiskCache`, or None to stop), each generation starts from the saved state sharing the longest
        prefix with its prompt when that beats what the context holds, and leaves its own state there
        (keyed by the tokens it holds: a chat's next turn finds it). Saving copies the whole context."""
        self.cache = cache

    def _load_cached(self, prompt: list[int]) -> None:
        state = cached_state_for(self.cache, prompt, self._spec.cached_tokens)
        if state is None:
            return
        try:
            self._load_state(state)
        except DFlashError as e:  # a cache entry that does not fit is a miss: the prompt is prefilled whole
            warnings.warn(f"set_cache: a cached state was not usable ({e}); prefilling instead", stacklevel=4)

    def _save_state(self) -> SpeculativeState:
        tokens, target, draft = self._spec.save_state()
        return SpeculativeState(np.asarray(tokens, dtype=np.intc), target, draft)

    def _load_state(self, state: SpeculativeState) -> None:
        self._spec.load_state(state.input_ids.tolist(), state.target, state.draft)

    @contextlib.contextmanager
    def _idle(self) -> Iterator[None]:
        if not self._lock.acquire(blocking=False):
            raise RuntimeError("this SpeculativeLlama is already generating (one generation at a time per object)")
        try:
            yield
        finally:
            self._lock.release()

    # --- generation ------------------------------------------------------

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
    ) -> Iterator[int]:
        """Token ids as the loop emits them; stops at an end-of-generation token or when
        stopping_criteria says so (then `self.finish_reason` is "stop"), at max_tokens or a full
        context ("length"). With `grammar_triggers` the grammar is lazy (llama-server's grammar_lazy):
        it waits for one of these words in the output and constrains the text from that word on."""
        sampling = self._sampling(
            max_tokens,
            temperature,
            top_p,
            top_k,
            min_p,
            repeat_penalty,
            frequency_penalty,
            presence_penalty,
            logit_bias,
            grammar,
            logits_processor,
            typical_p=typical_p,
            mirostat_mode=mirostat_mode,
            mirostat_tau=mirostat_tau,
            mirostat_eta=mirostat_eta,
            grammar_triggers=grammar_triggers,
        )
        return self._generate(
            list(prompt_tokens),
            zero_is_no_limit(max_tokens),
            sampling,
            seed,
            plain,
            stopping_criteria=stopping_criteria,
        )

    def _sampling(
        self,
        max_tokens: int | None,
        temperature: float,
        top_p: float,
        top_k: int,
        min_p: float,
        repeat_penalty: float,
        frequency_penalty: float,
        presence_penalty: float,
        logit_bias: dict[int, float] | None,
        grammar: Any = None,
        logits_processor: Callable[[Any, Any], Any] | None = None,
        **more: Any,
    ) -> Sampling:
        """`more`: typical_p and the mirostat_* options."""
        if max_tokens is not None and not isinstance(max_tokens, int):
            raise ValueError(f"max_tokens must be an int or None, got {max_tokens!r}")
        # a llama_cpp.LlamaGrammar (its GBNF text and root rule) or GBNF text
        text, root = (grammar._grammar, grammar._root) if hasattr(grammar, "_grammar") else (grammar or "", "root")
        return Sampling(
            temperature,
            top_p,
            top_k,
            min_p,
            repeat_penalty,
            frequency_penalty,
            presence_penalty,
            self.last_n_tokens_size,
            logit_bias,
            text,
            root,
            logits_processor,
            **more,
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
        if seed is None or seed < 0:
            seed = random.getrandbits(63)
        self.finish_reason = "length"
        self._end_token: int | None = None  # the end-of-generation token it ended at
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
        step = self._spec.step_plain if plain else self._spec.step
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
                pending, full = step()
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
            prefill_ms=s["prefill_ms"],
            calibration_ms=s["calibration_ms"],
            decode_ms=decode_s * 1e3,
            draft_ms=s["draft_ms"],
            verify_ms=s["verify_ms"],
            inject_ms=s["inject_ms"],
            rollback_ms=s["rollback_ms"],
            tokens_per_second=n_out / decode_s if decode_s > 0 else 0.0,
        )

    def _bos_skip(self, prompt: Sequence[int]) -> int:
        """llama_cpp.Llama lists an echoed prompt's logprobs without its leading BOS"""
        return 1 if prompt and prompt[0] == self._spec.token_bos else 0

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
    ) -> Iterator[tuple[str, str | None]]:
        """(text delta, finish_reason or None); the tokens go to self._completion_tokens as they come
        (after the prompt's, with prompt_logprobs); self.stats are the call's when the last one comes."""
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
                delta = stream.feed(self._spec.token_to_piece(tok))
                if delta:
                    yield delta, None
                if stream.stopped:
                    break
        finally:
            generation.close()  # a stop string ends it here: its figures are recorded before the last chunk
        self.last_usage = self.stats.usage()
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
        sampling = self._sampling(
            max_tokens,
            temperature,
            top_p,
            top_k,
            min_p,
            repeat_penalty,
            frequency_penalty,
            presence_penalty,
            logit_bias,
            grammar,
            logits_processor,
            typical_p=typical_p,
            mirostat_mode=mirostat_mode,
            mirostat_tau=mirostat_tau,
            mirostat_eta=mirostat_eta,
        )
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

    def create_chat_completion(
        self,
        messages: list[dict[str, Any]],
        max_tokens: int | None = None,
        temperature: float = 0.2,
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
        model: str | None = None,
        logprobs: bool | None = None,
        top_logprobs: int | None = None,
        grammar: Any = None,
        logits_processor: Callable[[Any, Any], Any] | None = None,
        response_format: dict[str, Any] | None = None,
        tools: list[dict[str, Any]] | None = None,
        tool_choice: str | dict[str, Any] | None = None,
        functions: list[dict[str, Any]] | None = None,
        function_call: str | dict[str, Any] | None = None,
        typical_p: float = 1.0,
        mirostat_mode: int = 0,
        mirostat_tau: float = 5.0,
        mirostat_eta: float = 0.1,
        tfs_z: float = 1.0,  # ignored, as in create_completion
        reasoning_format: str = "none",
        chat_template_kwargs: dict[str, Any] | None = None,
    ) -> dict[str, Any] | Iterator[dict[str, Any]]:
        """Chat with the target GGUF's chat template (ChatML when it has none), as llama_cpp.Llama's
        template-based chat handlers do. `grammar` and `logits_processor` as in create_completion.
        `response_format={"type": "json_object"}` (with "schema": a JSON schema; or OpenAI's
        {"type": "json_schema", "json_schema": {"schema": ...}}) constrains the reply to JSON through a
        grammar. `tools` (and the legacy `functions`) reach the chat template; a `tool_choice` naming one
        of them (`{"type": "function", "function": {"name": ...}}`) forces a call: its arguments follow
        the function's parameter schema and come back as `tool_calls` with finish_reason "tool_calls";
        `tool_choice="required"` forces a call to one of them (named by the model; streamed as one
        delta at the end). With tools and tool_choice "auto" (or none given) the model may call them in
        its template's own syntax, as llama-server reads it (Qwen2.5/Qwen3/Hermes `<tool_call>` JSON,
        kept to the tools' schemas by a grammar that starts at `<tool_call>`; Qwen3-Coder's XML): the
        calls come back as `tool_calls` (finish_reason "tool_calls"), the text around them as content.
        `reasoning_format="deepseek"` (llama-server's default; "none" here, as llama_cpp.Llama):
        a reasoning model's `<think>...</think>` comes back as `reasoning_content`, apart from the content.
        `chat_template_kwargs` reach the template (e.g. {"enable_thinking": False} for Qwen3).
        `logprobs=True` (with `top_logprobs=n`): the reply's tokens' log-probabilities in OpenAI's shape.
        Sampling options as in create_completion."""
        n_logprobs = (top_logprobs or 0) if logprobs else None
        check_logprobs(n_logprobs)
        named = tool_functions(tools, functions)
        call = forced_tool(named, tool_choice, function_call)
        may_call = call is None and bool(named) and "none" not in (tool_choice, function_call)
        model_name = model if model is not None else self.model_path
        prompt, template_stops = self._format_chat(
            messages, template_arguments(tools, tool_choice, functions, function_call, chat_template_kwargs)
        )
        syntax = reply_syntax(self._spec.chat_template, prompt, reasoning_format, may_call)
        lazy = tool_call_grammar(named, syntax)
        grammars = {
            "grammar": grammar,
            "response_format": response_format_grammar(response_format),
            "tool_choice": call.grammar if call is not None else None,
        }
        given = [k for k, g in grammars.items() if g is not None]
        if len(given) > 1:
            raise ValueError(f"{' and '.join(given)} each constrain the reply with a grammar: give one of them")
        triggers: tuple[str, ...] = ()
        if lazy is not None and not given:  # a grammar of the caller's own wins over the tools'
            grammars["tools"], triggers = lazy
            given = ["tools"]
        stops = ([stop] if isinstance(stop, str) else list(stop or [])) + template_stops
        sampling = self._sampling(
            max_tokens,
            temperature,
            top_p,
            top_k,
            min_p,
            repeat_penalty,
            frequency_penalty,
            presence_penalty,
            logit_bias,
            grammars[given[0]] if given else None,
            logits_processor,
            typical_p=typical_p,
            mirostat_mode=mirostat_mode,
            mirostat_tau=mirostat_tau,
            mirostat_eta=mirostat_eta,
            grammar_triggers=triggers,
        )
        cid, created = f"chatcmpl-{uuid.uuid4()}", int(time.time())
        chunks = self._completion_chunks(prompt, zero_is_no_limit(max_tokens), sampling, stops, seed, n_logprobs)
        cursor = None
        if n_logprobs is not None:
            cursor = LogprobCursor(self._completion_tokens, self._token_logprobs, self._spec.token_to_piece, 0)
        fingerprint = self.system_fingerprint
        # a forced call's grammar makes the whole reply the call: nothing to take apart
        parser = ReplyParser(syntax, named) if call is None and (syntax.thinking or syntax.tool_format) else None

        def finish(reason: str | None, content: str) -> str | None:
            if reason != "stop":
                return reason
            called = call.call(content) if call is not None else parser is not None and parser.calls
            return "tool_calls" if called else reason

        def deltas(text: str, reason: str | None, content: str) -> list[dict[str, Any]]:
            """The chat deltas of the reply's text so far (`content`), of which `text` is new."""
            if parser is not None:
                return parser.feed(text) + (parser.finish() if reason else [])
            if call is not None and call.name is None:  # a call to any tool: named at the end
                text = content if reason else ""
            if not text:
                return []
            return [call.delta(text) if call else {"content": text}]

        if stream:

            def gen() -> Iterator[dict[str, Any]]:
                def chunk(delta: dict[str, Any], lp: dict[str, Any] | None, reason: str | None) -> dict[str, Any]:
                    return {
                        "id": cid,
                        "object": "chat.completion.chunk",
                        "created": created,
                        "model": model_name,
                        "system_fingerprint": fingerprint,
                        "choices": [{"index": 0, "delta": delta, "logprobs": lp, "finish_reason": reason}],
                    }

                yield chunk({"role": "assistant"}, None, None)
                content = ""
                for text, reason in chunks:
                    content += text
                    for i, delta in enumerate(deltas(text, reason, content)):
                        lp = chat_logprobs(cursor.take(len(content))) if cursor is not None and i == 0 else None
                        yield chunk(delta, lp, None)
                    if reason:
                        yield chunk({}, None, finish(reason, content))

            return gen()
        parts, reason = [], None
        for text, reason in chunks:
            parts.append(text)
        content = "".join(parts)
        reply_logprobs = chat_logprobs(cursor.take(len(content))) if cursor is not None else None
        if parser is not None:
            message = reply_message(parser.feed(content) + parser.finish())
        else:
            message = call.message(content) if call else {"role": "assistant", "content": content}
        return {
            "id": cid,
            "object": "chat.completion",
            "created": created,
            "model": model_name,
            "system_fingerprint": fingerprint,
            "choices": [
                {"index": 0, "message": message, "logprobs": reply_logprobs, "finish_reason": finish(reason, content)}
            ],
            "usage": self.stats.usage(),
        }

    def apply_chat_template(
        self,
        messages: list[dict[str, Any]],
        tools: list[dict[str, Any]] | None = None,
        chat_template_kwargs: dict[str, Any] | None = None,
    ) -> str:
        """The prompt text create_chat_completion makes of these messages (llama-server's /apply-template)."""
        return self._format_chat(messages, template_arguments(tools, None, None, None, chat_template_kwargs))[0]

    def _format_chat(
        self, messages: list[dict[str, Any]], template_args: dict[str, Any] | None = None
    ) -> tuple[str, list[str]]:
        import jinja2
        from llama_cpp import llama_chat_format

        if not isinstance(messages, list) or not all(isinstance(m, dict) and "role" in m for m in messages):
            raise ValueError("messages must be a list of {'role': ..., 'content': ...} dicts")
        template = self._spec.chat_template
        messages = [replayed_call(as_template_message(m), "arguments|items" in (template or "")) for m in messages]
        try:
            if template:
                eos, bos = (
                    self._spec.token_to_piece(t, True).decode("utf-8", "replace") if t >= 0 else ""
                    for t in (self._spec.token_eos, self._spec.token_bos)
                )
                fmt = llama_chat_format.Jinja2ChatFormatter(template=template, eos_token=eos, bos_token=bos)
                resp = fmt(messages=messages, **(template_args or {}))
                if bos and self._spec.add_bos and resp.prompt.startswith(bos):  # tokenizing adds it back
                    resp.prompt = resp.prompt[len(bos) :]
            else:
                resp = chatml(messages)
        except (KeyError, TypeError, AttributeError, jinja2.TemplateError) as e:  # a message the template rejects
            raise ValueError(
                f"the messages do not fit the chat template ({type(e).__name__}: {e}); each "
                "needs a 'role' and a 'content'"
            ) from e
        stop = resp.stop if isinstance(resp.stop, list) else ([resp.stop] if resp.stop else [])
        return resp.prompt, stop


def template_arguments(
    tools: Any, tool_choice: Any, functions: Any, function_call: Any, chat_template_kwargs: Any
) -> dict[str, Any]:
    """What a chat template is rendered with besides the messages."""
    if chat_template_kwargs is not None and not isinstance(chat_template_kwargs, dict):
        raise ValueError(f"chat_template_kwargs must be a dict, got {chat_template_kwargs!r:.80}")
    return {
        "tools": tools,
        "tool_choice": tool_choice,
        "functions": functions,
        "function_call": function_call,
        **(chat_template_kwargs or {}),
    }


def zero_is_no_limit(max_tokens: int | None) -> int | None:
    """llama_cpp.Llama's max_tokens: 0 (and below) generates up to the end of the context."""
    return None if max_tokens == 0 else max_tokens


def as_template_message(message: dict[str, Any]) -> dict[str, Any]:
    """A message as llama-server hands it to a chat template: the `developer` role (OpenAI's newer name)
    as `system`, and content given as a list of parts as their texts joined by newlines."""
    out = dict(message)
    if out.get("role") == "developer":
        out["role"] = "system"
    content = out.get("content")
    if isinstance(content, list):
        texts = []
        for part in content:
            if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                kind = part.get("type") if isinstance(part, dict) else type(part).__name__
                raise ValueError(
                    f"message content parts must be {{'type': 'text', 'text': ...}} (text only), "
                    f"got a part of type {kind!r}"
                )
            texts.append(part["text"])
        out["content"] = "\n".join(texts)
    return out


def chatml(messages: list[dict[str, Any]]) -> Any:
    """llama-server's ChatML for a model without a chat template: every message as
    <|im_start|>role\ncontent<|im_end|>\n, then the assistant's turn opened (no system turn of its own)."""
    from llama_cpp.llama_chat_format import ChatFormatterResponse

    for m in messages:  # a KeyError for a message without content, as templates raise it
        if not isinstance(m["content"], (str, type(None))):
            raise ValueError(f"a message's content must be text, got {m['content']!r:.80}")
    turns = "".join(f"<|im_start|>{m['role']}\n{m['content'] or ''}<|im_end|>\n" for m in messages)
    return ChatFormatterResponse(prompt=turns + "<|im_start|>assistant\n", stop=["<|im_end|>"])


def replayed_call(message: dict[str, Any], object_arguments: bool) -> dict[str, Any]:
    """An assistant message with tool_calls, as chat templates read it (llama-server's rules): its null
    content (OpenAI's) as "", and for templates that walk the arguments (Qwen3-Coder's), the calls'
    JSON argument strings as objects."""
    if message.get("role") != "assistant" or not message.get("tool_calls"):
        return message
    message = {**message, "content": message.get("content") or ""}
    if object_arguments:
        calls = []
        for c in message["tool_calls"]:
            args = c.get("function", {}).get("arguments") if isinstance(c, dict) else None
            if isinstance(args, str):
                try:
                    c = {**c, "function": {**c["function"], "arguments": json.loads(args)}}
                except ValueError as e:
                    raise ValueError(f"a tool call's arguments are not JSON: {args!r:.80}") from e
            calls.append(c)
        message["tool_calls"] = calls
    return message


__all__ = ["DFlashError", "GenerationStats", "SpeculativeLlama"]
