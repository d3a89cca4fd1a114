"""SpeculativeLlama: llama-cpp-python-shaped completions, decoded speculatively.

The target runs in libllama and the DFlash drafter in our ggml graph; the C++ speculator does one
draft/verify/accept step per call with the GIL released. This module builds the pair and holds its
tokens and text; the class's other parts each have a module: the generation loop (generation.py),
completions (completion.py), chats (chat.py), saved contexts and caching (state.py).
"""

from __future__ import annotations

import contextlib
import os
import threading
import warnings
from collections.abc import Callable, Iterator, Sequence
from typing import TYPE_CHECKING, Any, Literal

from ._core import DFlashError, Speculator
from .chat import ChatMixin
from .chat_template import check_template
from .completion import CompletionMixin
from .draft_vocab import check_made_for, draft_vocab_ids, target_vocab_size
from .generation import GenerationMixin
from .infill import require_fim, server_infill_prompt
from .llama_compat import (
    TokenLogprob,
    system_fingerprint,
)
from .sampling import Sampling
from .state import StateMixin
from .stats import GenerationStats

if TYPE_CHECKING:
    from typing_extensions import Self


def draft_device_for(device: str, n_gpu_layers: int) -> str:
    """device="auto": the drafter goes where the target's layers are (the first GPU when any are
    offloaded, else the CPU), so a CPU-only run never wakes a GPU; a named device is kept."""
    if device == "auto" and n_gpu_layers == 0:
        return "cpu"
    return device


def kv_cache_type(t: int | str | None) -> str:
    """A K/V cache type as llama-server names it: a name ("q8_0"), or llama_cpp.Llama's GGML type number
    (type_k=8); None: f16."""
    if t is None:
        return "f16"
    if isinstance(t, int) and not isinstance(t, bool):
        import gguf

        try:
            return gguf.GGMLQuantizationType(t).name.lower()
        except ValueError:
            raise ValueError(f"type_k / type_v: {t} is no GGML type") from None
    return str(t)


def lora_list(adapters: Sequence[tuple[str, float]] | None, path: str | None, scale: float) -> list[tuple[str, float]]:
    """The LoRA adapters to load, (file, scale) each: `adapters` (llama-server's --lora-scaled), then
    llama_cpp.Llama's `lora_path` at `lora_scale`."""
    out = []
    for item in adapters or ():
        try:
            file, s = item
            out.append((os.fspath(file), float(s)))
        except (TypeError, ValueError) as e:
            raise ValueError(f"lora_adapters must be (path, scale) pairs, got {item!r}") from e
    return out + ([(os.fspath(path), float(scale))] if path else [])


def _parse_n_max(n_max: int | str) -> tuple[int, bool]:
    """n_max as (cap, adaptive): "auto" lets the loop choose per step (cap block_size - 1)."""
    if n_max == "auto":
        return 0, True
    if isinstance(n_max, bool) or not isinstance(n_max, int) or n_max < 0:
        raise ValueError(f"n_max must be 'auto' or an int >= 0 (0 = block_size - 1), got {n_max!r}")
    return n_max, False


def _loop_options(
    n_max: int | str, draft_q: str, device: str, n_gpu_layers: int, fallback: bool, sampler: str
) -> dict[str, Any]:
    """The speculative loop's keyword arguments, which a loaded and an adopted target's Speculator share."""
    cap, adaptive = _parse_n_max(n_max)
    return dict(
        device=draft_device_for(device, n_gpu_layers),
        n_max=cap,
        adaptive=adaptive,
        draft_q=draft_q,
        fallback=fallback,
        sampler=sampler,
    )


# a MoE's routed experts, by libllama's tensor names (ffn_{gate,up,down}_exps, a fused ffn_gate_up_exps, and
# the chexps of archs that keep experts in chunks); shared experts (shexp) stay with their layer, as
# llama-server's --cpu-moe leaves them
_EXPERTS = r"\.ffn_(gate_up|gate|up|down)_(ch)?exps"


def tensor_overrides(
    override_tensor: str | Sequence[str] | None, cpu_moe: bool = False, n_cpu_moe: int = 0
) -> list[tuple[str, str]]:
    """(regex over tensor names, buffer type) pairs, first match first, from llama-server's
    `--override-tensor PATTERN=TYPE[,...]`, `--cpu-moe` (every layer's experts on the CPU) and
    `--n-cpu-moe N` (those of the first N layers)."""
    items = [override_tensor] if isinstance(override_tensor, str) else list(override_tensor or [])
    out = []
    for entry in (e.strip() for item in items for e in str(item).split(",")):
        if not entry:
            continue
        pattern, eq, buft = entry.rpartition("=")
        if not eq or not pattern or not buft:
            raise ValueError(f"override_tensor: {entry!r}: expected PATTERN=BUFFER_TYPE (e.g. 'exps=CPU')")
        out.append((pattern, buft))
    if isinstance(n_cpu_moe, bool) or not isinstance(n_cpu_moe, int) or n_cpu_moe < 0:
        raise ValueError(f"n_cpu_moe must be an int >= 0, got {n_cpu_moe!r}")
    if cpu_moe:
        out.append((_EXPERTS, "CPU"))
    out += [(rf"blk\.{i}{_EXPERTS}", "CPU") for i in range(0 if cpu_moe else n_cpu_moe)]
    return out


def _open_with_vocab(
    draft_vocab: str | os.PathLike[str] | Sequence[int] | None,
    open_core: Callable[[list[int] | None], Speculator],
    target: str | None = None,
) -> Speculator:
    """open_core with draft_vocab's token ids (None when not given). A file's recorded vocabulary size must
    be the target's: checked against the `target` file's header before anything loads (a target of many GB
    should not load only to be refused), and against the loaded target after."""
    ids, path, made_for = draft_vocab_ids(draft_vocab)
    if path is not None and target is not None and (n_vocab := target_vocab_size(target)) is not None:
        check_made_for(path, made_for, n_vocab)
    core = open_core(None if draft_vocab is None else ids)
    if path is not None:
        try:
            check_made_for(path, made_for, core.n_vocab)
        except ValueError:
            core.close()
            raise
    return core


class SpeculativeLlama(GenerationMixin, CompletionMixin, ChatMixin, StateMixin):
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
        repack: bool | Literal["no-amx"] | None = None,
        override_tensor: str | Sequence[str] | None = None,
        cpu_moe: bool = False,
        n_cpu_moe: int = 0,
        draft_vocab: str | os.PathLike[str] | Sequence[int] | None = None,
        swa_full: bool = False,
        last_n_tokens_size: int = 64,
        verbose: bool = False,
        sampler: str = "gumbel",
        chat_template: str | None = None,
        lora_path: str | None = None,
        lora_scale: float = 1.0,
        lora_adapters: Sequence[tuple[str, float]] | None = None,
        type_k: int | str | None = None,
        type_v: int | str | None = None,
        _core: Speculator | None = None,
    ) -> None:
        # libllama logs through llama-cpp-python's logger; like llama_cpp.Llama, quiet unless verbose
        from llama_cpp import _logger

        _logger.set_verbose(verbose)
        Sampling(penalty_last_n=last_n_tokens_size)  # raises for a bad window before anything loads
        if chat_template is not None:
            check_template(chat_template)  # ... as does a template that does not compile
        if _core is None:
            for what, path in (("target", target), ("draft", draft)):
                if not isinstance(path, str) or not path:
                    raise ValueError(f"{what} must be a GGUF file path, got {path!r}")
            if n_ctx < 16:
                raise ValueError(f"n_ctx must be >= 16, got {n_ctx}")
            loop = _loop_options(n_max, draft_q, device, n_gpu_layers, fallback, sampler)
            overrides = tensor_overrides(override_tensor, cpu_moe, n_cpu_moe)
            loras = lora_list(lora_adapters, lora_path, lora_scale)
            _core = _open_with_vocab(
                draft_vocab,
                lambda ids: Speculator(
                    target,
                    draft,
                    n_ctx=n_ctx,
                    n_batch=n_batch,
                    n_gpu_layers=n_gpu_layers,
                    n_threads=n_threads,
                    repack=repack,
                    tensor_overrides=overrides,
                    draft_vocab=ids or [],
                    swa_full=swa_full,
                    loras=loras,
                    type_k=kv_cache_type(type_k),
                    type_v=kv_cache_type(type_v),
                    **loop,
                ),
                target,
            )
        self._spec = _core
        # the chats' Jinja template: the given one (llama-server's --chat-template-file), else the target's
        self.chat_template: str | None = self._spec.chat_template if chat_template is None else chat_template
        self.sampler = sampler
        self._fingerprint: str | None = None
        self._metadata: dict[str, str] | None = None
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
        self._end_reasoning = False  # end_reasoning()'s request, read by the generation between steps
        self._reasoning_armed = False  # the generation under way has a reasoning budget end_reasoning() can use
        self.completion_id: str | None = None  # the id of the chat completion under way, or the last one
        self._seed: int | None = None  # set_seed's
        self.stats = GenerationStats()
        # called with each generation's statistics as it ends, on the generating thread (a server's /metrics)
        self.on_generation: Callable[[GenerationStats], None] | None = None
        # OpenAI's usage of the last completion or chat, streamed ones too (a list of prompts: summed)
        self.last_usage: dict[str, Any] = self.stats.usage()
        self.stopping_word = ""  # the stop string that ended the last completion or chat ("" if none did)
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
        draft_vocab: str | os.PathLike[str] | Sequence[int] | None = None,
    ) -> SpeculativeLlama:
        """Adopt an existing llama_cpp.Llama as the target (its model and context are reused)."""
        try:
            model, ctx, path = llm._model.model, llm._ctx.ctx, llm.model_path
        except AttributeError as e:
            raise ValueError(f"from_llama needs a llama_cpp.Llama instance, got {type(llm).__name__}") from e
        if model is None or ctx is None:
            raise ValueError("from_llama: this llama_cpp.Llama is closed (it has no model or context left)")
        model_ptr, ctx_ptr = int(model), int(ctx)
        n_gpu_layers = int(getattr(getattr(llm, "model_params", None), "n_gpu_layers", 0))
        loop = _loop_options(n_max, draft_q, device, n_gpu_layers, fallback, sampler)
        core = _open_with_vocab(
            draft_vocab,
            lambda ids: Speculator.adopt(
                model_ptr, ctx_ptr, path, draft, n_threads=int(llm.n_threads or 0), draft_vocab=ids or [], **loop
            ),
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

    def share_weights(
        self,
        *,
        n_max: int | str = "auto",
        draft_q: str | None = None,
        fallback: bool | None = None,
        sampler: str | None = None,
        draft_vocab: str | os.PathLike[str] | Sequence[int] | None = None,
    ) -> SpeculativeLlama:
        """Another SpeculativeLlama on this one's loaded target and drafter weights: a target context,
        draft cache and draft-length controller of its own, made with this one's n_ctx, n_batch, threads,
        devices and weight placement. The weights stay in memory once, until the last decoder sharing them
        closes, so several n_max values or samplers cost one model's memory (`dflash bench` runs its n_max
        configurations so). `draft_q`, `fallback`, `sampler` and `draft_vocab`: this one's unless given
        (`draft_vocab=[]`: the whole vocabulary; another subset costs only its rows of the head). Not for a
        target adopted by from_llama. Like any SpeculativeLlama, each is used by one thread at a time."""
        sampler = self.sampler if sampler is None else sampler
        cap, adaptive = _parse_n_max(n_max)
        core = _open_with_vocab(
            draft_vocab,  # None: this one's
            lambda ids: self._spec.share_weights(
                n_max=cap, adaptive=adaptive, draft_q=draft_q, fallback=fallback, sampler=sampler, draft_vocab=ids
            ),
        )
        obj = type(self)(
            self.model_path,
            self.draft_path,
            n_max=n_max,
            last_n_tokens_size=self.last_n_tokens_size,
            sampler=sampler,
            chat_template=self.chat_template,
            _core=core,
        )
        obj.n_batch = self.n_batch
        return obj

    def end_reasoning(self) -> bool:
        """From any thread, while a chat made with `reasoning_control=True` (or a reasoning budget) streams:
        its thinking ends at the next step, the end of thinking (the budget's message and closing tag) written
        for it, and the reply goes on to its answer (llama-server's `reasoning_end` control; a desktop app's
        "answer now"). False when no such generation is under way."""
        if not self._lock.locked() or not self._reasoning_armed:
            return False
        self._end_reasoning = True
        return True

    @property
    def lora_adapters(self) -> list[dict[str, Any]]:
        """The target's LoRA adapters as llama-server lists them (GET /lora-adapters): id, path, scale."""
        return [{"id": i, "path": path, "scale": scale} for i, (path, scale) in enumerate(self._spec.loras)]

    def set_lora_scales(self, scales: Sequence[float]) -> None:
        """The LoRA adapters' scales, one per adapter (0 leaves one out), for the generations from now on; a
        change empties the context (what it holds was computed with the old weights), so the next prompt
        is prefilled whole."""
        with self._idle():
            self._spec.set_lora_scales([float(s) for s in scales])

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

    def n_embd(self) -> int:
        return self._spec.n_embd

    def token_nl(self) -> int:
        return self._spec.token_nl

    def token_eos(self) -> int:
        return self._spec.token_eos

    def token_bos(self) -> int:
        return self._spec.token_bos

    @property
    def metadata(self) -> dict[str, str]:
        """The target GGUF's metadata as llama_cpp.Llama's `metadata` (general.name, the chat template, ...)."""
        if self._metadata is None:
            self._metadata = self._spec.target_metadata
        return self._metadata

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

    @property
    def draft_vocab_size(self) -> int:
        """Tokens a draft may propose: the drafting vocabulary's (draft_vocab=), else the whole vocabulary."""
        return int(self._spec.draft_vocab_size)

    @contextlib.contextmanager
    def _idle(self) -> Iterator[None]:
        if not self._lock.acquire(blocking=False):
            raise RuntimeError("this SpeculativeLlama is already generating (one generation at a time per object)")
        try:
            yield
        finally:
            self._lock.release()


__all__ = ["DFlashError", "GenerationStats", "SpeculativeLlama"]
