"""How the next token is chosen: the sampling options of a generation, checked once."""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, fields
from typing import Any


@dataclass(frozen=True)
class ReasoningBudget:
    """llama-server's reasoning budget, in token ids: a thinking block (opened by `start`) may run `tokens`
    tokens, then `forced` is written (a message, then a closing tag); any of `ends` closes it before. `prompt`:
    the template's opening of the reply, read first (it may open the thinking). `tokens` -1: no budget, the
    thinking only holds a lazy grammar back (a call written while thinking is none)."""

    tokens: int
    start: tuple[int, ...]
    ends: tuple[tuple[int, ...], ...]
    forced: tuple[int, ...]
    prompt: tuple[int, ...] = ()

    def start_kwargs(self) -> dict[str, Any]:
        return {
            "reasoning_budget": self.tokens,
            "reasoning_start": list(self.start),
            "reasoning_ends": [list(e) for e in self.ends],
            "reasoning_forced": list(self.forced),
            "reasoning_prompt": list(self.prompt),
        }


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
    reasoning: ReasoningBudget | None = None

    def __post_init__(self) -> None:
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0 (0 = greedy), got {self.temperature}")
        # 0 keeps the one most likely token (most typical, for typical_p), as libllama's samplers, llama-server
        # and OpenAI's API take it
        if not 0.0 <= self.top_p <= 1.0:
            raise ValueError(f"top_p must be in [0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0 (0 = off), got {self.top_k}")
        if not 0.0 <= self.min_p <= 1.0:
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p}")
        if not 0.0 <= self.typical_p <= 1.0:
            raise ValueError(f"typical_p must be in [0, 1], got {self.typical_p}")
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
        kw = {f.name: getattr(self, f.name) for f in fields(self) if f.name != "reasoning"}
        kw["logit_bias"] = self.logit_bias or {}
        return kw | (self.reasoning.start_kwargs() if self.reasoning is not None else {})
