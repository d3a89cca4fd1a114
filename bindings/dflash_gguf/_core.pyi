from collections.abc import Callable
from typing import Any, Literal, overload

import numpy as np
import numpy.typing as npt

class DFlashError(ValueError): ...

def inspect_draft(path: str) -> dict[str, Any]: ...
def load_draft(path: str) -> dict[str, Any]: ...

class Drafter:
    def __init__(
        self,
        draft: str,
        target: str = "",
        device: str = "auto",
        n_threads: int = 0,
        n_ctx: int = 4096,
        repack: bool = True,
        kv_type: str = "f16",
        draft_vocab: list[int] = ...,
    ) -> None: ...
    @property
    def hparams(self) -> dict[str, Any]: ...
    @property
    def n_vocab(self) -> int: ...
    @property
    def n_ctx(self) -> int: ...
    @property
    def n_cached(self) -> int: ...
    @property
    def device(self) -> str: ...
    @property
    def head_zero_copy(self) -> bool: ...
    @property
    def repacked_weights(self) -> int: ...
    @property
    def head_pad_from(self) -> int: ...
    @property
    def block_pad_from(self) -> int: ...
    @property
    def draft_vocab_size(self) -> int: ...
    @property
    def counters(self) -> dict[str, int | float]: ...
    def inject(self, features: npt.ArrayLike, positions: npt.ArrayLike) -> None: ...
    def truncate(self, n: int) -> None: ...
    def reset(self) -> None: ...
    @overload
    def draft(
        self,
        anchor: int,
        position: int,
        n: int = -1,
        details: bool = False,
        all_rows: bool | None = None,
        short_block: bool = False,
    ) -> list[int]: ...
    @overload
    def draft(
        self,
        anchor: int,
        position: int,
        n: int,
        details: bool,
        all_rows: bool | None = None,
        short_block: bool = False,
    ) -> dict[str, Any]: ...

def speculative_sample_histogram(
    p: npt.ArrayLike, q: npt.ArrayLike, n_draws: int, seed: int = 0
) -> tuple[npt.NDArray[np.int64], int]: ...
def gumbel_histogram(
    p: npt.ArrayLike, q: npt.ArrayLike, n_draws: int, seed: int = 0
) -> tuple[npt.NDArray[np.int64], npt.NDArray[np.int64], int]: ...
def is_argmax(logits: npt.ArrayLike, token: int) -> bool: ...
def target_distribution(
    logits: npt.ArrayLike,
    temperature: float,
    top_k: int = 0,
    top_p: float = 1.0,
    min_p: float = 0.0,
    typical_p: float = 1.0,
) -> npt.NDArray[np.float32]: ...
def mirostat_step(
    logits: npt.ArrayLike, mode: int, tau: float, eta: float, mu: float, token: int
) -> tuple[npt.NDArray[np.float32], float]: ...
def shape_logits(
    logits: npt.ArrayLike,
    generated: list[int],
    repeat_penalty: float = 1.0,
    frequency_penalty: float = 0.0,
    presence_penalty: float = 0.0,
    penalty_last_n: int = 64,
    logit_bias: dict[int, float] = ...,
) -> npt.NDArray[np.float32]: ...

class DraftLengthController:
    """The adaptive draft-length rule on its own (n_max="auto" uses it), for tests and tuning."""
    def __init__(self, cap: int, mode: str = "auto", n_max: int = 0) -> None: ...
    def choose(self) -> int: ...
    def reset_acceptance(self) -> None: ...
    def observe_draft(self, k: int, accepted: int, draft_ms: float, verify_ms: float, steady: bool = True) -> None: ...
    def observe_plain(self, ms: float, steady: bool = True) -> None: ...
    def observe_cost(self, k: int, draft_ms: float, verify_ms: float) -> None: ...
    def calibrate_cost(self, k: int, draft_ms: float, verify_ms: float) -> None: ...
    def expected_tokens(self, k: int) -> float: ...
    def expected_cost_ms(self, k: int) -> float: ...
    @property
    def acceptance(self) -> list[float]: ...

def release_openmp_threads() -> bool: ...
def default_cpu_threads() -> int: ...
def target_flash_attn(n_gpu_layers: int) -> int: ...
def target_weight_placement(
    path: str, n_gpu_layers: int = 0, repack: bool | Literal["no-amx"] | None = None
) -> tuple[bool, list[tuple[str, str, int]]]: ...

class Speculator:
    def __init__(
        self,
        target: str,
        draft: str,
        n_ctx: int = 4096,
        n_batch: int = 512,
        n_gpu_layers: int = 0,
        n_threads: int = 0,
        device: str = "auto",
        n_max: int = 0,
        adaptive: bool = False,
        draft_q: str = "logits",
        fallback: bool = True,
        repack: bool | Literal["no-amx"] | None = None,
        sampler: str = "gumbel",
        tensor_overrides: list[tuple[str, str]] = ...,
        draft_vocab: list[int] = ...,
    ) -> None: ...
    @staticmethod
    def adopt(
        model_ptr: int,
        ctx_ptr: int,
        target_path: str,
        draft: str,
        n_threads: int = 0,
        device: str = "auto",
        n_max: int = 0,
        adaptive: bool = False,
        draft_q: str = "logits",
        fallback: bool = True,
        sampler: str = "gumbel",
        draft_vocab: list[int] = ...,
    ) -> Speculator: ...
    def share_weights(
        self,
        n_max: int = 0,
        adaptive: bool = False,
        draft_q: str | None = None,
        fallback: bool | None = None,
        sampler: str = "gumbel",
        draft_vocab: list[int] | None = None,
    ) -> Speculator: ...
    @property
    def target_arch(self) -> str: ...
    @property
    def target_memory(self) -> str: ...
    @property
    def rollback_counters(self) -> dict[str, int]: ...
    def start(
        self,
        prompt: list[int],
        temperature: float = 0.0,
        top_k: int = 0,
        top_p: float = 1.0,
        min_p: float = 0.0,
        seed: int = 0,
        repeat_penalty: float = 1.0,
        frequency_penalty: float = 0.0,
        presence_penalty: float = 0.0,
        penalty_last_n: int = 64,
        logit_bias: dict[int, float] = ...,
        logprobs: int = -1,
        grammar: str = "",
        grammar_root: str = "root",
        logits_processor: Callable[[npt.NDArray[np.int32], npt.NDArray[np.float32]], npt.ArrayLike] | None = None,
        keep_logits: bool = False,
        prompt_logprobs: bool = False,
        grammar_full_pass: bool = False,
        typical_p: float = 1.0,
        mirostat_mode: int = 0,
        mirostat_tau: float = 5.0,
        mirostat_eta: float = 0.1,
        grammar_triggers: list[str] = ...,
    ) -> int: ...
    @property
    def last_logprobs(self) -> list[tuple[float, list[tuple[int, float]]]]: ...
    @property
    def prompt_logprobs(self) -> list[tuple[float, list[tuple[int, float]]]]: ...  # tokens 1..n-1
    @property
    def last_logits(self) -> npt.NDArray[np.float32]: ...  # [tokens, n_vocab] with keep_logits
    def step(self, max_tokens: int = ...) -> tuple[list[int], bool]: ...
    def step_plain(self) -> tuple[list[int], bool]: ...
    def set_n_max(self, n: int, adaptive: bool = False) -> None: ...
    @property
    def n_max(self) -> int: ...
    @property
    def adaptive(self) -> bool: ...
    @property
    def controller(self) -> dict[str, list[float]]: ...
    @property
    def n_past(self) -> int: ...
    @property
    def mirostat_mu(self) -> float: ...  # after every token emitted so far
    @property
    def cached_tokens(self) -> list[int]: ...
    def keep_cached_prefix(self, held: list[int]) -> None: ...
    def save_state(self) -> tuple[list[int], bytes, bytes]: ...
    def load_state(self, tokens: list[int], target: bytes, draft: bytes) -> None: ...
    def close(self) -> None: ...
    @property
    def closed(self) -> bool: ...
    @property
    def n_ctx(self) -> int: ...
    @property
    def n_vocab(self) -> int: ...
    @property
    def draft_vocab_size(self) -> int: ...
    @property
    def draft_hparams(self) -> dict[str, Any]: ...
    @property
    def draft_device(self) -> str: ...
    @property
    def draft_counters(self) -> dict[str, int | float]: ...
    @property
    def stats(self) -> dict[str, Any]: ...
    @property
    def chat_template(self) -> str | None: ...
    def tokenize(self, text: bytes, add_special: bool = False, parse_special: bool = True) -> list[int]: ...
    def token_to_piece(self, token: int, special: bool = False) -> bytes: ...
    def is_eog(self, token: int) -> bool: ...
    @property
    def eog_tokens(self) -> list[int]: ...  # every end-of-generation token of the vocabulary
    @property
    def token_eos(self) -> int: ...
    @property
    def token_bos(self) -> int: ...
    @property
    def add_bos(self) -> bool: ...  # the vocabulary asks for a BOS before a prompt
    @property
    def fim_tokens(self) -> dict[str, int]: ...  # pre, suf, mid, rep, sep: fill-in-the-middle token ids (-1: none)
