"""What the bench scripts share: the repository's paths and a parser whose --target / --draft default
to the bundled pair (the q4_0 drafter that `make demo` converts)."""

from __future__ import annotations

import argparse
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
TINY = ROOT / "examples" / "tinycode"


def pair_parser(doc: str | None) -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--target", default=str(TINY / "target-f16.gguf"))
    ap.add_argument("--draft", default=str(ROOT / "out" / "tinycode-dflash2-q4_0.gguf"))
    return ap


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
