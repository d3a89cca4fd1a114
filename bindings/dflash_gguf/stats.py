"""The figures of a generation, as SpeculativeLlama.stats gives them."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


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
    accepted_by_position: list[int] = field(default_factory=list)  # steps whose drafts were accepted up to i + 1
    steps_by_length: list[int] = field(default_factory=list)  # steps per draft length 0..n_max ([0]: plain)
    prefill_ms: float = 0.0
    calibration_ms: float = 0.0  # n_max="auto": timing each draft length, once, before the first prefill
    decode_ms: float = 0.0
    draft_ms: float = 0.0
    verify_ms: float = 0.0
    inject_ms: float = 0.0
    rollback_ms: float = 0.0  # a recurrent target's state checkpoints and restores
    target_decodes: int = 0  # llama_decode calls on the target's context (prefill chunks, verifies, restores)
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
