"""What the bench scripts share: the repository's paths and a parser whose --target / --draft default
to the bundled pair (the q4_0 drafter that `make demo` converts)."""

from __future__ import annotations

import argparse
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
TINY = ROOT / "examples" / "tinycode"


def pair_parser(doc: str | None) -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--target", default=str(TINY / "target-f16.gguf"))
    ap.add_argument("--draft", default=str(ROOT / "out" / "tinycode-dflash2-q4_0.gguf"))
    return ap
