"""The `dflash` command line: info and generate."""

from __future__ import annotations

import json
import sys

import click

from . import DFlashError, inspect_draft
from .info import format_text, summarize


def _fail(e: Exception) -> None:
    click.echo(f"dflash: error: {e}", err=True)
    sys.exit(2)


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
        _fail(e)
    click.echo(json.dumps(s, indent=2) if as_json else format_text(s))


@main.command()
@click.option("--target", "-m", required=True, type=click.Path(dir_okay=False), help="Target model GGUF.")
@click.option("--draft", "-d", required=True, type=click.Path(dir_okay=False), help="DFlash drafter GGUF.")
@click.option("--prompt", "-p", required=True, help="Prompt text (raw, no chat template).")
@click.option("-n", "--n-predict", default=128, show_default=True, help="Tokens to generate.")
@click.option("--temp", default=0.0, show_default=True, help="Temperature (0 = greedy, lossless).")
@click.option("--top-k", default=0, show_default=True, help="Top-k (0 = off).")
@click.option("--top-p", default=1.0, show_default=True, help="Top-p (1 = off).")
@click.option("--min-p", default=0.0, show_default=True, help="Min-p (0 = off).")
@click.option("--seed", default=-1, show_default=True, help="RNG seed (-1 = random).")
@click.option("--n-max", default=0, show_default=True, help="Drafted tokens verified per step (0 = block size - 1).")
@click.option("--draft-q", type=click.Choice(["logits", "selector"]), default="logits", show_default=True,
              help="Which exact q the draft tokens are sampled from at temperature > 0.")
@click.option("--ctx-size", "-c", default=4096, show_default=True, help="Context size.")
@click.option("--n-gpu-layers", "-ngl", default=0, show_default=True, help="Target layers on the GPU.")
@click.option("--threads", "-t", default=0, show_default=True, help="CPU threads (0 = all cores).")
@click.option("--device", default="auto", show_default=True, help="ggml device for the drafter (auto, cpu, CUDA0, ...).")
@click.option("--no-stream", is_flag=True, help="Print the text at the end instead of streaming it.")
@click.option("--verbose", is_flag=True, help="Show libllama's log.")
def generate(target: str, draft: str, prompt: str, n_predict: int, temp: float, top_k: int, top_p: float,
             min_p: float, seed: int, n_max: int, draft_q: str, ctx_size: int, n_gpu_layers: int, threads: int,
             device: str, no_stream: bool, verbose: bool) -> None:
    """Generate text with speculative decoding, then print the statistics."""
    from .speculative import SpeculativeLlama

    try:
        llm = SpeculativeLlama(target, draft, n_ctx=ctx_size, n_gpu_layers=n_gpu_layers, n_threads=threads,
                               n_max=n_max, draft_q=draft_q, device=device, verbose=verbose)
        kw = dict(max_tokens=n_predict, temperature=temp, top_k=top_k, top_p=top_p, min_p=min_p,
                  seed=None if seed < 0 else seed)
        click.echo(prompt, nl=False)
        if no_stream:
            click.echo(llm.create_completion(prompt, **kw)["choices"][0]["text"])
        else:
            for chunk in llm.create_completion(prompt, stream=True, **kw):
                click.echo(chunk["choices"][0]["text"], nl=False)
            click.echo()
    except (ValueError, RuntimeError) as e:
        _fail(e)
    click.echo(f"[dflash] {llm.stats.line()}", err=True)


if __name__ == "__main__":
    main()
