#!/usr/bin/env python3
"""The files the tinycode target was trained on (its training split of the Python standard library), one
path per line, for `dflash draft-vocab`'s corpus: the bench prompts come from held-out files.

    dflash draft-vocab -m TARGET.gguf --size 32768 -o vocab.json $(.venv/bin/python scripts/tinycode_corpus.py)

Paths are under this interpreter's standard library (the target was trained on Python 3.11's)."""

from __future__ import annotations

import json
import sys
import sysconfig
from pathlib import Path

SPLIT = Path(__file__).resolve().parent.parent / "examples" / "tinycode" / "results" / "split.json"


def main() -> None:
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    files = [stdlib / f for f in json.loads(SPLIT.read_text())["train"]]
    present = [f for f in files if f.is_file()]
    if len(present) < len(files):
        print(f"{len(files) - len(present)} of the {len(files)} training files are not under {stdlib}", file=sys.stderr)
    print("\n".join(map(str, present)))


if __name__ == "__main__":
    main()
