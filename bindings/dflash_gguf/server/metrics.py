"""llama-server's /metrics: the server's counters since it started, in Prometheus' text format under
llama-server's names (`llamacpp:...`), so that dashboards and alerts made for llama-server read ours."""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass

from ..stats import GenerationStats


@dataclass
class _Rate:
    """Tokens and the seconds they took: a counter's pair, or a gauge's window between two scrapes."""

    tokens: int = 0
    seconds: float = 0.0

    def add(self, tokens: int, seconds: float) -> None:
        self.tokens += tokens
        self.seconds += seconds

    def per_second(self) -> float:
        return self.tokens / self.seconds if self.seconds > 0 else 0.0


class ServerMetrics:
    """Every slot's generations, counted as each ends (GenerationStats through SpeculativeLlama.on_generation,
    on the slots' threads); `positions`: the draft positions the per-position counter lists (the server's
    longest draft)."""

    def __init__(self, positions: int) -> None:
        self.started = time.time()
        self._lock = threading.Lock()
        self._positions = positions
        self._prompt, self._predicted = _Rate(), _Rate()  # since the start
        self._prompt_window, self._predicted_window = _Rate(), _Rate()  # since the last scrape
        self._cached = 0
        self._longest = 0
        self._decodes = 0
        self._drafted = 0
        self._accepted = 0
        self._drafted_steps = 0
        self._accepted_by_position = [0] * positions

    def add(self, s: GenerationStats) -> None:
        prompt_n = s.prompt_tokens - s.reused_prompt_tokens
        # llama-server's generation rate leaves out the first token, which comes with the prompt's logits
        steps = max(s.generated_tokens - 1, 0)
        with self._lock:
            for rate in (self._prompt, self._prompt_window):
                rate.add(prompt_n, s.prefill_ms / 1e3)
            self._predicted.add(s.generated_tokens, s.decode_ms / 1e3)
            self._predicted_window.add(steps, s.decode_ms / 1e3)
            self._cached += s.reused_prompt_tokens
            self._longest = max(self._longest, s.prompt_tokens + steps)  # the last token is never decoded
            self._decodes += s.target_decodes
            self._drafted += s.drafted
            self._accepted += s.accepted
            self._drafted_steps += s.steps - s.plain_steps
            for i, n in enumerate(s.accepted_by_position[: self._positions]):
                self._accepted_by_position[i] += n

    def render(self, processing: int, deferred: int) -> str:
        """The exposition text; `processing` / `deferred`: requests in a slot / waiting for one. The two
        rate gauges cover the time since the previous call (llama-server's window) and restart here."""
        with self._lock:
            counters = [
                (
                    "prompt_tokens_total",
                    "Number of prompt tokens processed, excluding cached tokens",
                    self._prompt.tokens,
                ),
                ("prompt_tokens_cached_total", "Number of prompt tokens reused from the cache", self._cached),
                ("prompt_seconds_total", "Total time spent processing prompts", self._prompt.seconds),
                ("tokens_predicted_total", "Number of generation tokens processed", self._predicted.tokens),
                ("tokens_predicted_seconds_total", "Total time spent generating tokens", self._predicted.seconds),
                ("n_decode_total", "Total number of llama_decode() calls on the target's context", self._decodes),
                ("n_tokens_max", "Largest observed sequence length (prompt + generation)", self._longest),
                ("spec_decode_num_draft_tokens_total", "Speculative: Total draft tokens generated", self._drafted),
                (
                    "spec_decode_num_accepted_tokens_total",
                    "Speculative: Total draft tokens accepted by the target model",
                    self._accepted,
                ),
                (
                    "spec_decode_num_drafts_total",
                    "Speculative: Total speculative decoding verification steps",
                    self._drafted_steps,
                ),
            ]
            gauges = [
                ("prompt_tokens_seconds", "Average prompt throughput in tokens/s", self._prompt_window.per_second()),
                (
                    "predicted_tokens_seconds",
                    "Average generation throughput in tokens/s",
                    self._predicted_window.per_second(),
                ),
                ("requests_processing", "Number of requests processing", processing),
                ("requests_deferred", "Number of requests deferred", deferred),
                # a slot decodes in its own context: each llama_decode() serves one slot
                (
                    "n_busy_slots_per_decode",
                    "Average number of busy slots per llama_decode() call",
                    int(self._decodes > 0),
                ),
            ]
            by_position = list(self._accepted_by_position)
            self._prompt_window, self._predicted_window = _Rate(), _Rate()
        lines: list[str] = []
        for kind, items in (("counter", counters), ("gauge", gauges)):
            for name, text, value in items:
                lines += [
                    f"# HELP llamacpp:{name} {text}",
                    f"# TYPE llamacpp:{name} {kind}",
                    f"llamacpp:{name} {value}",
                ]
        name = "llamacpp:spec_decode_num_accepted_tokens_per_pos_total"
        lines += [f"# HELP {name} Accepted tokens per draft position", f"# TYPE {name} counter"]
        lines += [f'{name}{{position="{i}"}} {n}' for i, n in enumerate(by_position)]
        return "\n".join(lines) + "\n"
