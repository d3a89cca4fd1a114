"""`dflash bench`: plain decoding vs our speculative loop vs upstream llama-server, one run.

Three systems decode the same prompts with the same GGUF files:

- ``ar``: plain C++ decoding of the target (``SpeculativeLlama.generate_tokens(..., plain=True)``:
  one ``llama_decode`` per token, same process and target context as ``ours``);
- ``ours``: our speculative loop (target in libllama, drafter in our ggml graph);
- ``upstream``: ``llama-server --spec-type draft-dflash`` started by the bench on loopback;
- ``upstream-ar`` (optional): the same server without the drafter.

Runs are interleaved prompt by prompt so that machine drift hits all systems alike: every
configuration (one per ``--n-max`` value, each with its own server and its own target context and
drafter on the weights all of ours share, all loaded at once) decodes each prompt run right after the
others, in an order rotated from run to run, and ``ar`` decodes it once as the baseline of them all.
Speedups are ratios to that ``ar`` run, so two n_max values compare on the same prompt runs minutes
apart at most. Each configuration and server gets one warm-up request that is not counted.
"""

from __future__ import annotations

import os
import platform
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .._core import default_cpu_threads
from .options import BenchError, BenchOptions, NMax, load_prompts, parse_n_max, parse_systems, placement_flags
from .progress import progress_bar
from .summary import compare_auto_with_fixed, compare_with_full_vocab, summarize_config
from .upstream import UpstreamServer, cpu_has_amx, find_server_binary, gguf_is_quantized, missing_server_message
from .verify_timing import FLASH_ATTN_OFF, runtime_flash_attn


def fresh_prefill(llm: Any, prompt: list[int]) -> None:
    """Make the next generation prefill the whole prompt (the loop reuses a common prefix
    of the last prompt): one 1-token generation on a token that differs from prompt[0]."""
    tok = (prompt[0] + 1) % max(llm._spec.n_vocab, 2) if prompt else 0
    for _ in llm.generate_tokens([tok], max_tokens=1, temperature=0.0, plain=True):
        pass


def run_ours(
    llm: Any,
    prompt: list[int],
    *,
    plain: bool,
    n_predict: int,
    temperature: float,
    top_k: int,
    top_p: float,
    min_p: float,
    seed: int,
) -> dict[str, Any]:
    fresh_prefill(llm, prompt)
    out = list(
        llm.generate_tokens(
            prompt,
            max_tokens=n_predict,
            temperature=temperature,
            top_k=top_k,
            top_p=top_p,
            min_p=min_p,
            seed=seed,
            plain=plain,
        )
    )
    s = llm.stats
    rec: dict[str, Any] = {
        "tokens": len(out),
        "decode_ms": s.decode_ms,
        "tok_s": s.tokens_per_second,
        "prefill_ms": s.prefill_ms,
        "prompt_tokens": s.prompt_tokens,
        "reused_prompt_tokens": s.reused_prompt_tokens,
        "output": [int(t) for t in out],
    }
    if not plain:
        drafted_steps = s.steps - s.plain_steps
        rec.update(
            steps=s.steps,
            plain_steps=s.plain_steps,
            drafted=s.drafted,
            accepted=s.accepted,
            mean_accepted_length=s.mean_accepted_length,
            per_position_acceptance=list(s.per_position_acceptance),
            steps_by_length=list(s.steps_by_length),
            draft_ms=s.draft_ms,
            verify_ms=s.verify_ms,
            inject_ms=s.inject_ms,
            draft_ms_per_step=s.draft_ms / drafted_steps if drafted_steps else 0.0,
            verify_ms_per_step=s.verify_ms / s.steps if s.steps else 0.0,
        )
        raw = getattr(llm._spec, "stats", None)  # counts, to pool acceptance over prompts
        if isinstance(raw, dict) and "pos_reached" in raw:
            rec["pos_reached"] = [int(x) for x in raw["pos_reached"]]
            rec["pos_accepted"] = [int(x) for x in raw["pos_accepted"]]
        if isinstance(raw, dict) and "sample_ms" in raw and s.steps:
            # where a step's time goes besides the model work: picking the target's tokens from its logits,
            # and the rest (rollback, bookkeeping, this Python loop), which the implied speedup leaves out
            timed = s.draft_ms + s.verify_ms + s.inject_ms + raw["sample_ms"]
            rec["sample_ms_per_step"] = raw["sample_ms"] / s.steps
            rec["rest_ms_per_step"] = (s.decode_ms - timed) / s.steps
    return rec


def _make_llm(o: BenchOptions, n_max: NMax, draft_vocab: str | None, threads: int) -> Any:
    from ..speculative import SpeculativeLlama

    return SpeculativeLlama(
        o.target,
        o.draft,
        n_ctx=o.n_ctx,
        n_gpu_layers=o.n_gpu_layers,
        n_threads=threads,
        n_max=n_max,
        draft_q=o.draft_q,
        device=o.device,
        override_tensor=o.override_tensor,
        cpu_moe=o.cpu_moe,
        n_cpu_moe=o.n_cpu_moe,
        swa_full=o.swa_full,
        draft_vocab=draft_vocab,
    )  # type: ignore[arg-type]


def _upstream_n_max(llm: Any, n_max: NMax) -> int:
    block = int(llm._spec.draft_hparams["block_size"])
    if isinstance(n_max, int) and n_max > 0:
        return min(n_max, block - 1)
    return block - 1  # 0 = block_size - 1; "auto": upstream has no controller, it drafts the full block


def _seed_for(base: int, prompt_index: int, rnd: int) -> int:
    return base + 1000 * rnd + prompt_index


def run_bench(o: BenchOptions, log: Callable[[str], None] = lambda s: print(s, file=sys.stderr)) -> dict[str, Any]:
    """Run every configuration; the result is what --json writes (summaries included)."""
    systems = parse_systems(o.systems)
    n_maxes = parse_n_max(o.n_max)
    if o.repeat < 1:
        raise BenchError("--repeat must be >= 1")
    if o.n_predict < 1:
        raise BenchError("-n must be >= 1")
    for what, path in (("--target", o.target), ("--draft", o.draft), ("--prompts", o.prompts)):
        if not Path(path).is_file():
            raise BenchError(f"{what}: {path} is not a file")
    threads = o.threads if o.threads > 0 else default_cpu_threads()  # what n_threads = 0 means to us
    prompts = load_prompts(o.prompts, o.limit)

    server_bin: Path | None = None
    server_extra = placement_flags(o.override_tensor, o.cpu_moe, o.n_cpu_moe) + ["--swa-full"] * o.swa_full
    server_extra += o.server_args
    notes: list[str] = []
    if any(s.startswith("upstream") for s in systems):
        server_bin = find_server_binary(o.server_binary)
        if server_bin is None or not server_bin.is_file() or not os.access(server_bin, os.X_OK):
            raise BenchError(missing_server_message() + (f" (looked at {server_bin})" if server_bin else ""))
        if (
            "--no-repack" not in server_extra
            and "-nr" not in server_extra
            and cpu_has_amx()
            and (gguf_is_quantized(o.target) or gguf_is_quantized(o.draft))
        ):
            server_extra.append("--no-repack")
            notes.append(
                "llama-server got --no-repack: llama.cpp 0.3.36's AMX repack crashes on quantized "
                "weights on this CPU (docs/converting.md); ar and ours keep ggml's repacked layouts, "
                "placed by name without AMX, which llama-server cannot"
            )
        if runtime_flash_attn(o.n_gpu_layers) == FLASH_ATTN_OFF and not {"-fa", "--flash-attn"} & set(server_extra):
            # the same attention kernels as ours, where our runtime turns flash attention off and llama-server's
            # default (auto) would turn it on
            server_extra += ["-fa", "off"]
            notes.append("llama-server got -fa off: the target runs on the CPU without flash attention, as ours")

    result: dict[str, Any] = {
        "meta": {
            "target": o.target,
            "draft": o.draft,
            "prompts": o.prompts,
            "n_prompts": len(prompts),
            "n_predict": o.n_predict,
            "temperature": o.temperature,
            "top_k": o.top_k,
            "top_p": o.top_p,
            "min_p": o.min_p,
            "seed": o.seed,
            "repeat": o.repeat,
            "systems": systems,
            "threads": threads,
            "n_ctx": o.n_ctx,
            "n_gpu_layers": o.n_gpu_layers,
            "device": o.device,
            "draft_q": o.draft_q,
            "n_max": n_maxes,
            "server_binary": str(server_bin) if server_bin else None,
            "server_args": server_extra,
            "override_tensor": o.override_tensor,
            "cpu_moe": o.cpu_moe,
            "n_cpu_moe": o.n_cpu_moe,
            "swa_full": o.swa_full,
            "draft_vocab": [str(v) if v else None for v in o.draft_vocab],
            "host": platform.node(),
            "machine": platform.machine(),
            "cpu_count": os.cpu_count(),
            "python": platform.python_version(),
            "started": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        },
        "notes": notes,
        "configs": [],
    }

    with ExitStack() as stack:
        configs: list[_Config] = []
        for v, vocab in enumerate(o.draft_vocab):
            # upstream has no drafting vocabulary: its servers run in the first vocabulary's configurations only
            mine = [s for s in systems if s != "upstream" or v == 0]
            for n_max in n_maxes:
                base = configs[0].llm if configs else None
                configs.append(_open_config(o, n_max, vocab, mine, server_bin, server_extra, threads, stack, base))
        result["configs"] = [c.record for c in configs]
        if len(configs) > 1:
            notes.append(
                "configurations (n_max, drafting vocabulary) run side by side: each prompt run is decoded by ar "
                "once and by every configuration's systems, in an order rotated from run to run; ar's runs are "
                "every configuration's baseline"
            )
        _run_interleaved(o, configs, systems, prompts, threads, server_bin, server_extra, stack)
    for cfg in result["configs"]:
        cfg["summary"] = summarize_config(cfg)
    compare_auto_with_fixed(result["configs"])
    compare_with_full_vocab(result["configs"])
    return result


# decoded once per prompt run, the same for every configuration (the drafter's length plays no part)
_SHARED_SYSTEMS = ("ar", "upstream-ar")


@dataclass
class _Config:
    """One --n-max value with one drafting vocabulary: its own target context, drafter (auto's controller
    learns only from its own steps) and servers."""

    n_max: NMax
    llm: Any
    servers: dict[str, UpstreamServer]
    record: dict[str, Any]
    systems: list[str]


def _open_config(
    o: BenchOptions,
    n_max: NMax,
    draft_vocab: str | None,
    systems: list[str],
    server_bin: Path | None,
    server_extra: list[str],
    threads: int,
    stack: ExitStack,
    base: Any,
) -> _Config:
    # the weights are loaded once (by `base`, the first configuration): a Q4_K_M target repacks into memory of
    # its own per load; a drafting vocabulary adds only its rows of the head
    llm = (
        base.share_weights(n_max=n_max, draft_vocab=draft_vocab or [])
        if base
        else _make_llm(o, n_max, draft_vocab, threads)
    )
    stack.callback(llm.close)
    record: dict[str, Any] = {
        "n_max": n_max,
        "draft_vocab": draft_vocab,
        "draft_vocab_size": llm.draft_vocab_size,
        "n_max_ours": llm.n_max,
        "block_size": int(llm._spec.draft_hparams["block_size"]),
        "draft_device": getattr(llm._spec, "draft_device", None),
        "runs": [],
        "notes": [],
    }
    up_k = _upstream_n_max(llm, n_max)
    if "upstream" in systems:
        record["n_max_upstream"] = up_k
        if n_max == "auto":
            record["notes"].append(f"upstream has no adaptive n_max: it drafts {up_k} tokens (block_size - 1)")
    servers = stack.enter_context(
        _servers(o, ["upstream"] if "upstream" in systems else [], server_bin, server_extra, up_k, threads)
    )
    return _Config(n_max, llm, servers, record, systems)


def _run_interleaved(
    o: BenchOptions,
    configs: list[_Config],
    systems: list[str],
    prompts: list[dict[str, str]],
    threads: int,
    server_bin: Path | None,
    server_extra: list[str],
    stack: ExitStack,
) -> None:
    # ar decodes on a fixed length's model, where no step timing decides a length; with auto alone, on its own
    fixed = [c.llm for c in configs if c.n_max != "auto"]
    ar_llm = fixed[0] if fixed else configs[0].llm.share_weights(n_max=0)
    if not fixed:
        stack.callback(ar_llm.close)
    shared = stack.enter_context(
        _servers(o, ["upstream-ar"] if "upstream-ar" in systems else [], server_bin, server_extra, 0, threads)
    )
    token_lists = [ar_llm.tokenize(p["text"], add_special=False, parse_special=False) for p in prompts]
    kw = dict(n_predict=o.n_predict, temperature=o.temperature, top_k=o.top_k, top_p=o.top_p, min_p=o.min_p)

    # a unit is a system and the index of its configuration; ar and upstream-ar are no configuration's (None)
    Unit = tuple[str, int | None]
    units: list[Unit] = [(s, None) for s in systems if s in _SHARED_SYSTEMS]
    units += [(s, k) for k, c in enumerate(configs) for s in c.systems if s not in _SHARED_SYSTEMS]

    def one(unit: Unit, toks: list[int], seed: int) -> dict[str, Any]:
        system, k = unit
        if system in ("ar", "ours"):
            llm = ar_llm if k is None else configs[k].llm
            return run_ours(llm, toks, plain=system == "ar", seed=seed, **kw)  # type: ignore[arg-type]
        return (shared if k is None else configs[k].servers)[system].complete(toks, seed=seed, **kw)  # type: ignore[arg-type]

    bar = progress_bar(len(units) * (o.repeat * len(prompts) + 1), o.progress)
    try:
        bar.set_description("warm-up")
        for unit in units:  # one request per configuration and server, not counted
            one(unit, token_lists[0], _seed_for(o.seed, 0, -1))
            bar.update(1)
        for rnd in range(o.repeat):
            for i, (p, toks) in enumerate(zip(prompts, token_lists)):
                bar.set_description(f"round {rnd + 1}/{o.repeat} {p['id']}")
                seed = _seed_for(o.seed, i, rnd)
                turn = rnd * len(prompts) + i
                recs: dict[Unit, dict[str, Any]] = {}
                for position, unit in enumerate(units[turn % len(units) :] + units[: turn % len(units)]):
                    rec = one(unit, toks, seed)
                    rec.update(
                        system=unit[0],
                        prompt_id=p["id"],
                        prompt_index=i,
                        round=rnd,
                        seed=seed,
                        position_in_run=position,
                    )
                    recs[unit] = rec
                    bar.update(1)
                for rec in recs.values():
                    _relate_to_ar(rec, recs[("ar", None)], o.temperature)
                for k, c in enumerate(configs):  # the shared runs go into every configuration, as copies
                    c.record["runs"] += [dict(recs[(s, None if s in _SHARED_SYSTEMS else k)]) for s in c.systems]
    finally:
        bar.close()


def _relate_to_ar(rec: dict[str, Any], ar_rec: dict[str, Any], temperature: float) -> None:
    rec["ar_tok_s"] = ar_rec["tok_s"]
    rec["speedup_vs_ar"] = rec["tok_s"] / ar_rec["tok_s"] if ar_rec["tok_s"] > 0 else 0.0
    if rec["system"] == "ours" and ar_rec["tok_s"] > 0:
        # what the same steps would give with no loop overhead: only the model work counted
        work_ms = rec["draft_ms"] + rec["verify_ms"] + rec["inject_ms"]
        rec["limit_vs_ar"] = rec["tokens"] / work_ms * 1e3 / ar_rec["tok_s"] if work_ms > 0 else 0.0
    if temperature == 0.0:
        n = min(len(rec["output"]), len(ar_rec["output"]))
        rec["same_as_ar"] = rec["output"][:n] == ar_rec["output"][:n]


@contextmanager
def _servers(
    o: BenchOptions, systems: list[str], server_bin: Path | None, extra: list[str], n_max: int, threads: int
) -> Iterator[dict[str, UpstreamServer]]:
    servers: dict[str, UpstreamServer] = {}
    try:
        for system in systems:
            if system.startswith("upstream"):
                assert server_bin is not None
                srv = UpstreamServer(
                    server_bin,
                    o.target,
                    o.draft if system == "upstream" else None,
                    n_max=n_max,
                    threads=threads,
                    n_ctx=o.n_ctx,
                    n_gpu_layers=o.n_gpu_layers,
                    seed=o.seed,
                    extra_args=extra,
                )
                srv.__enter__()
                servers[system] = srv
        yield servers
    finally:
        for srv in servers.values():
            srv.__exit__(None, None, None)
