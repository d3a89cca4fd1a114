"""The conversion: plan (read + validate everything), then write atomically and verify."""

from __future__ import annotations

import glob
import os
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import TextIO

from gguf import GGMLQuantizationType

from .config import DraftConfig, load_config
from .errors import ConversionError
from .mask_embedding import MASK_FILE, load_mask_embedding, with_mask_row
from .metadata import build_metadata
from .quantize import OutType, choose_type, llama_quantize, parse_outtype
from .source import TensorSource, open_source
from .target import KV, TargetInfo, load_target
from .tensor_map import OUTPUT, TOKEN_EMBD, Kind
from .validate import check_against_target, check_hidden, match_tensors
from .writer import PlannedTensor, verify_gguf, write_gguf

Q = GGMLQuantizationType


@dataclass
class Options:
    draft_dir: Path
    target: Path
    outfile: Path | None = None
    outtype: OutType | str = "f16"
    dry_run: bool = False
    force: bool = False
    embed_target_head: bool = False
    allow_extra: bool = False
    allow_pickle: bool = False
    progress: bool = True
    verify: bool = True


@dataclass
class Plan:
    cfg: DraftConfig
    target: TargetInfo
    source: TensorSource
    outtype: OutType
    outfile: Path
    kvs: list[KV]
    tensors: list[PlannedTensor]
    skipped: list[str] = field(default_factory=list)

    @property
    def total_bytes(self) -> int:
        return sum(t.nbytes for t in self.tensors)

    @property
    def input_files(self) -> list[Path]:
        return [self.cfg.path, self.target.path, *self.source.files]


@dataclass
class Result:
    outfile: Path
    types: dict[str, Q]
    bytes_written: int
    seconds: float


def resolve_outfile(outfile: Path | None, draft_dir: Path, outtype: OutType) -> Path:
    """``--outfile`` with its ``{ftype}`` placeholder; default ``./<draft dir name>-<ftype>.gguf``."""
    if outfile is None:
        name = draft_dir.resolve().name or "drafter"
        return Path.cwd() / f"{name}-{outtype.name}.gguf"
    text = str(outfile)
    if "{ftype}" in text:
        text = text.replace("{ftype}", outtype.name)
    return Path(text)


def build_plan(opts: Options) -> Plan:
    """Read and validate everything; no output is touched."""
    out = opts.outtype if isinstance(opts.outtype, OutType) else parse_outtype(opts.outtype)
    draft_dir = Path(opts.draft_dir)
    if draft_dir.is_file():
        if draft_dir.suffix in (".bin", ".pt", ".pth") and not opts.allow_pickle:
            raise ConversionError(
                f"{draft_dir}: refusing to unpickle a PyTorch checkpoint; pass the drafter directory "
                "(config.json + safetensors), or --allow-pickle"
            )
        raise ConversionError(f"{draft_dir}: expected the drafter directory (config.json + safetensors), not a file")
    cfg = load_config(draft_dir)
    mask_vec = load_mask_embedding(draft_dir, cfg)
    target = load_target(Path(opts.target), want_head=opts.embed_target_head or mask_vec is not None)
    if cfg.vocab_size is None:
        cfg = replace(cfg, vocab_size=target.vocab_size)
    check_against_target(cfg, target)
    source = open_source(draft_dir, allow_pickle=opts.allow_pickle)
    matched, skipped = match_tensors(cfg, target, source, allow_extra=opts.allow_extra)
    check_hidden(cfg, target)

    tensors: list[PlannedTensor] = []
    for m in matched:
        qtype, why = choose_type(out, m.spec.kind, m.spec.shape)
        tensors.append(PlannedTensor(m.source_key, m.spec.gguf, m.spec.shape, m.spec.kind, m.ref, qtype, why))

    head = dict(target.head_tensors)
    if mask_vec is not None:
        if TOKEN_EMBD in {t.gguf for t in tensors}:
            raise ConversionError(f"{draft_dir}: carries its own embed_tokens and a {MASK_FILE}; expected one of them")
        # the head stays the target's own: tied targets read it from the unpatched embedding
        head[OUTPUT] = head.get(OUTPUT, head[TOKEN_EMBD])
        head[TOKEN_EMBD] = with_mask_row(head[TOKEN_EMBD], cfg.mask_token_id, mask_vec)
    if opts.embed_target_head or mask_vec is not None:
        have = {t.gguf for t in tensors}
        for name in (TOKEN_EMBD, OUTPUT):
            if name in have or name not in head:
                continue
            ref = head[name]
            want = (cfg.vocab_size, cfg.hidden_size)
            if ref.shape != want:
                raise ConversionError(
                    f"{target.path}: target tensor '{name}' has shape {ref.shape}, the drafter (embedding it for "
                    f"{'--embed-target-head' if opts.embed_target_head else MASK_FILE}) expects {want}"
                )
            qtype, why = choose_type(out, Kind.EMBEDDING, ref.shape)
            tensors.append(PlannedTensor(f"target:{ref.key}", name, ref.shape, Kind.EMBEDDING, ref, qtype, why))

    outfile = resolve_outfile(opts.outfile, draft_dir, out)
    kvs = build_metadata(cfg, target, out, mask_embedding=mask_vec is not None)
    return Plan(cfg, target, source, out, outfile, kvs, tensors, skipped)


def check_outfile(plan: Plan, force: bool) -> None:
    out = plan.outfile
    out_abs = Path(os.path.abspath(out))
    for p in plan.input_files:
        same = os.path.abspath(p) == str(out_abs)
        if not same and out.exists():
            try:
                same = os.path.samefile(p, out)
            except OSError:
                same = False
        if same:
            raise ConversionError(f"{out}: the output file is an input file ({p}); choose another --outfile")
    if out.is_dir():
        raise ConversionError(f"{out}: is a directory; --outfile needs a file name")
    if out.exists() and not force:
        raise ConversionError(f"{out}: already exists; pass --force to overwrite it")
    parent = out_abs.parent
    if not parent.is_dir():
        raise ConversionError(f"{out}: the output folder {parent} does not exist")


def format_plan(plan: Plan) -> str:
    rows = [("HF tensor", "GGUF tensor", "shape", "type", "bytes")]
    for t in plan.tensors:
        qname = t.qtype.name
        if plan.outtype.kquant and t.qtype == Q.F32 and "libllama" in t.reason:
            qname = f"{plan.outtype.name.upper()}*"
        rows.append((t.source_name, t.gguf, "x".join(map(str, t.shape)), qname, f"{t.nbytes:,}"))
    widths = [max(len(r[i]) for r in rows) for i in range(5)]
    lines = []
    for i, r in enumerate(rows):
        lines.append(
            f"{r[0]:<{widths[0]}}  ->  {r[1]:<{widths[1]}}  {r[2]:>{widths[2]}}  {r[3]:<{widths[3]}}  {r[4]:>{widths[4]}}"
        )
        if i == 0:
            lines.append("-" * len(lines[0]))
    return "\n".join(lines)


def describe(plan: Plan) -> str:
    cfg = plan.cfg
    bits = [
        f"{cfg.architecture} (DFlash{cfg.version}): {cfg.num_layers} layers, hidden {cfg.hidden_size}, "
        f"block_size {cfg.block_size}, mask_token_id {cfg.mask_token_id}",
        f"target {plan.target.path.name}: {plan.target.arch}, {plan.target.n_layer} layers, hidden "
        f"{plan.target.hidden}, vocab {plan.target.vocab_size}; target_layer_ids {list(cfg.target_layer_ids)}"
        f"{' (derived)' if cfg.target_layer_ids_derived else ''} -> dflash.target_layers "
        f"{[i + 1 for i in cfg.target_layer_ids]}",
    ]
    if cfg.is_dflash2:
        bits.append(
            f"DFlash2: conv kernel {cfg.conv_kernel_size}, group {cfg.conv_group_size}, "
            f"selector rank {cfg.selector_rank}, top-k {cfg.selector_top_k}"
        )
    if plan.skipped:
        bits.append(f"skipped (--allow-extra): {', '.join(plan.skipped)}")
    return "\n".join(bits)


def _tmp_path(final: Path, tag: str) -> Path:
    # the owner's pid is in the name so that a later run can tell an orphan (SIGKILL) from a live one
    fd, name = tempfile.mkstemp(prefix=f".{final.name}.{os.getpid()}.", suffix=f".{tag}.tmp", dir=str(final.parent))
    os.close(fd)
    return Path(name)


def _sweep_orphan_temps(final: Path) -> None:
    """Removes temp files of earlier conversions to `final` whose process is gone (killed with SIGKILL)."""
    prefix = f".{final.name}."
    for p in final.parent.glob(f"{glob.escape(prefix)}*.tmp"):
        pid = p.name[len(prefix) :].split(".", 1)[0]
        if not pid.isdigit() or int(pid) == os.getpid():
            continue
        try:
            os.kill(int(pid), 0)
        except ProcessLookupError:
            p.unlink(missing_ok=True)
        except PermissionError:
            pass  # alive, someone else's


def execute(
    plan: Plan,
    *,
    force: bool = False,
    verify: bool = True,
    progress: bool = True,
    log: Callable[[str], None] | None = None,
    stream: TextIO | None = None,
) -> Result:
    """Write ``plan.outfile`` atomically: temp file in the same folder, verify, rename."""
    say = log or (lambda s: None)
    check_outfile(plan, force)
    final = plan.outfile
    t0 = time.perf_counter()
    _sweep_orphan_temps(final)
    tmp = _tmp_path(final, "gguf")
    tmp_f32: Path | None = None
    try:
        total = plan.total_bytes
        bar = _progress_bar(total, "write", progress, stream)
        try:
            if plan.outtype.kquant:
                tmp_f32 = _tmp_path(final, "f32")
                write_gguf(tmp_f32, plan.kvs, plan.tensors, on_progress=lambda t, n: bar(n, t.gguf))
            else:
                write_gguf(tmp, plan.kvs, plan.tensors, on_progress=lambda t, n: bar(n, t.gguf))
        finally:
            bar(None, None)
        if tmp_f32 is not None:
            say(f"quantizing with libllama's llama_model_quantize to {plan.outtype.name.upper()} ...")
            llama_quantize(tmp_f32, tmp, plan.outtype)
            tmp_f32.unlink(missing_ok=True)
            tmp_f32 = None
        types = {t.gguf: t.qtype for t in plan.tensors}
        if verify:
            vbar = _progress_bar(tmp.stat().st_size, "verify", progress, stream)
            try:
                types = verify_gguf(
                    tmp,
                    plan.kvs,
                    plan.tensors,
                    libllama_types=plan.outtype.kquant,
                    display_path=final,
                    on_progress=lambda t, n: vbar(n, t.gguf),
                )
            finally:
                vbar(None, None)
        size = tmp.stat().st_size
        _set_default_mode(tmp)
        os.replace(tmp, final)
        tmp = None  # type: ignore[assignment]
    finally:
        if tmp is not None:
            Path(tmp).unlink(missing_ok=True)
        if tmp_f32 is not None:
            tmp_f32.unlink(missing_ok=True)
    return Result(final, types, size, time.perf_counter() - t0)


def _set_default_mode(path: Path) -> None:
    """mkstemp makes 0600 files; give the output the mode a plain open() would (0666 & ~umask)."""
    umask = os.umask(0)
    os.umask(umask)
    os.chmod(path, 0o666 & ~umask)


def _progress_bar(
    total: int, desc: str, enabled: bool, stream: TextIO | None
) -> Callable[[int | None, str | None], None]:
    """A tqdm bar over bytes, labelled with the current tensor; call (None, None) to close."""
    if not enabled:
        return lambda n, name: None
    from tqdm import tqdm

    bar = tqdm(
        total=total,
        desc=desc,
        unit="B",
        unit_scale=True,
        unit_divisor=1024,
        file=stream or sys.stderr,
        leave=False,
        dynamic_ncols=True,
        disable=None,  # off when the stream is not a terminal
    )
    last: list[str | None] = [None]

    def update(n: int | None, name: str | None) -> None:
        if n is None:
            bar.close()
            return
        if name != last[0]:
            bar.set_postfix_str(name or "", refresh=False)
            last[0] = name
        bar.update(n)

    return update


def convert(opts: Options, *, log: Callable[[str], None] | None = None) -> Result | Plan:
    """Plan, then (unless dry-run) write. The library entry point behind the CLI."""
    plan = build_plan(opts)
    if opts.dry_run:
        return plan
    return execute(plan, force=opts.force, verify=opts.verify, progress=opts.progress, log=log)
