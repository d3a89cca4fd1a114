"""The `dflash` command line: info (and, as they land, generate and bench)."""

from __future__ import annotations

import json
import sys

import click

from . import DFlashError, inspect_draft
from .info import format_text, summarize


@click.group()
@click.version_option(package_name="dflash-gguf")
def main() -> None:
    """DFlash / DFlash2 speculative decoding for llama.cpp models."""


@main.command()
@click.argument("path", type=click.Path(dir_okay=False))
@click.option("--json", "as_json", is_flag=True, help="Print machine-readable JSON.")
def info(path: str, as_json: bool) -> None:
    """Validate a drafter GGUF with the C++ loader and describe it."""
    try:
        s = summarize(inspect_draft(path))
    except DFlashError as e:
        click.echo(f"dflash: error: {e}", err=True)
        sys.exit(2)
    click.echo(json.dumps(s, indent=2) if as_json else format_text(s))


if __name__ == "__main__":
    main()
