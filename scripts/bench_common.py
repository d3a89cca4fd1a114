"""What the bench scripts share: the repository's paths and a parser whose --target / --draft default
to the bundled pair (the q4_0 drafter that `make demo` converts)."""

from __future__ import annotations

import argparse
import subprocess
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
TINY = ROOT / "examples" / "tinycode"


def pair_parser(doc: str | None) -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--target", default=str(TINY / "target-f16.gguf"))
    ap.add_argument("--draft", default=str(ROOT / "out" / "tinycode-dflash2-q4_0.gguf"))
    return ap


def n_max_values(ap: argparse.ArgumentParser, text: str) -> list[int | str]:
    """`text` read as `dflash bench --n-max` reads it (ints, "auto"); its errors end the script via `ap`."""
    from dflash_gguf.bench.options import BenchError, parse_n_max

    try:
        return parse_n_max(text)
    except BenchError as e:
        ap.error(str(e))


def greedy_prompt_runs(llm: Any, prompts_path: str, limit: int | None, n_predict: int) -> tuple[list, list, dict]:
    """The bench's prompts (the first `limit`, None = all), their tokens, and greedy settings for
    `dflash_gguf.bench.three_way.run_ours`, as `dflash bench` decodes them."""
    from dflash_gguf.bench import load_prompts

    prompts = load_prompts(prompts_path, limit)
    token_lists = [llm.tokenize(p["text"].encode(), add_bos=False, special=False) for p in prompts]
    sampling = {"n_predict": n_predict, "temperature": 0.0, "top_k": 0, "top_p": 1.0, "min_p": 0.0, "seed": 0}
    return prompts, token_lists, sampling


def converted_drafter(draft_dir: Path, target: Path, out: Path, outtype: str = "q4_0") -> Path:
    """`out`, converted by dflash-convert from `draft_dir` against `target` when it is not there yet."""
    if not out.exists():
        out.parent.mkdir(parents=True, exist_ok=True)
        subprocess.run(
            [
                sys.executable,
                "-m",
                "dflash_convert",
                str(draft_dir),
                "--target",
                str(target),
                "--outfile",
                str(out),
                "--outtype",
                outtype,
                "--no-progress",
            ],
            check=True,
            capture_output=True,
        )
    return out
