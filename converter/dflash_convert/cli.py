"""``dflash-convert``: a DFlash / DFlash2 checkpoint to a GGUF drafter for llama.cpp."""

from __future__ import annotations

import signal
import sys
from pathlib import Path
from typing import NoReturn

import click

from . import __version__
from .convert import Options, build_plan, describe, execute, format_plan
from .errors import ConversionError
from .memory import keep_freed_chunks
from .quantize import OUT_TYPES, parse_outtype

EXIT_ERROR = 2


def _raise_interrupt(signum: int, frame: object) -> None:
    raise KeyboardInterrupt


def _fail(message: str) -> NoReturn:
    click.echo(f"dflash-convert: error: {message}", err=True)
    sys.exit(EXIT_ERROR)


@click.command(
    context_settings={"help_option_names": ["-h", "--help"]},
    help=(
        "Convert a DFlash (DFlashDraftModel) or DFlash2 (DFlash2DraftModel) drafter checkpoint "
        "DRAFT_DIR (config.json + safetensors) into a GGUF drafter for llama.cpp "
        "(arch 'dflash'), carrying the tokenizer of the target GGUF."
    ),
)
@click.argument("draft_dir", type=click.Path(path_type=Path))
@click.option(
    "--target",
    "target",
    required=True,
    type=click.Path(path_type=Path),
    help="The target model's GGUF (its tokenizer, vocabulary and sizes are used).",
)
@click.option(
    "--outfile",
    type=click.Path(path_type=Path),
    default=None,
    help="Output GGUF; '{ftype}' is replaced by the output type. Default: ./<DRAFT_DIR name>-<type>.gguf",
)
@click.option(
    "--outtype",
    default="f16",
    show_default=True,
    metavar="TYPE",
    help=f"One of {', '.join(OUT_TYPES)} (case-insensitive).",
)
@click.option(
    "--dry-run",
    is_flag=True,
    help="Validate and print the plan (HF name -> GGUF name, shape, type, bytes); write nothing.",
)
@click.option("--force", is_flag=True, help="Overwrite an existing output file.")
@click.option(
    "--embed-target-head",
    is_flag=True,
    help="Copy the target's token embedding and LM head into the drafter, so it runs without the target's tensors.",
)
@click.option(
    "--allow-extra", is_flag=True, help="Skip checkpoint tensors the mapping table does not know instead of failing."
)
@click.option(
    "--allow-pickle",
    is_flag=True,
    help="Accept .bin/.pt/.pth checkpoints (loaded with torch.load(weights_only=True) only).",
)
@click.option("--no-verify", is_flag=True, hidden=True, help="Skip the read-back check (debugging only).")
@click.option("--no-progress", is_flag=True, help="Do not show a progress bar.")
@click.version_option(__version__, prog_name="dflash-convert")
def main(
    draft_dir: Path,
    target: Path,
    outfile: Path | None,
    outtype: str,
    dry_run: bool,
    force: bool,
    embed_target_head: bool,
    allow_extra: bool,
    allow_pickle: bool,
    no_verify: bool,
    no_progress: bool,
) -> None:
    keep_freed_chunks()
    # a polite kill (SIGTERM) cleans up like Ctrl-C: the temp files go, the destination stays as it was
    signal.signal(signal.SIGTERM, _raise_interrupt)
    try:
        out = parse_outtype(outtype)
        opts = Options(
            draft_dir=draft_dir,
            target=target,
            outfile=outfile,
            outtype=out,
            dry_run=dry_run,
            force=force,
            embed_target_head=embed_target_head,
            allow_extra=allow_extra,
            allow_pickle=allow_pickle,
            progress=not no_progress,
            verify=not no_verify,
        )
        plan = build_plan(opts)
        click.echo(describe(plan))
        if dry_run:
            click.echo(format_plan(plan))
            total = plan.total_bytes
            click.echo(f"{len(plan.tensors)} tensors, {total:,} bytes of tensor data -> {plan.outfile}")
            if out.kquant:
                click.echo(
                    f"* {out.name.upper()}: the final type of these tensors is chosen by libllama's quantizer "
                    "(bytes shown are the F32 intermediate)"
                )
            click.echo("dry run: nothing written")
            return
        result = execute(
            plan, force=force, verify=not no_verify, progress=not no_progress, log=lambda s: click.echo(s, err=True)
        )
    except ConversionError as exc:
        _fail(exc.message)
    except KeyboardInterrupt:
        _fail("interrupted; no output written")
    except OSError as exc:  # disk full, permission denied, I/O error: one line, no traceback
        where = f" ({exc.filename})" if exc.filename else ""
        _fail(f"{exc.strerror or exc}{where}; no output written (an existing output file is left as it was)")

    # the type chosen for each tensor
    width = max(len(t.gguf) for t in plan.tensors)
    for t in plan.tensors:
        qtype = result.types[t.gguf]
        shape = "x".join(map(str, t.shape))
        click.echo(f"  {t.gguf:<{width}}  {shape:>12}  {qtype.name}")
    mb = result.bytes_written / 1e6
    verified = "" if no_verify else ", read back and verified"
    click.echo(
        f"wrote {result.outfile} ({mb:.1f} MB, {len(plan.tensors)} tensors, {out.name}) "
        f"in {result.seconds:.2f} s{verified}"
    )


if __name__ == "__main__":  # pragma: no cover
    main()
