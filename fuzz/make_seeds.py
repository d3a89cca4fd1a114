#!/usr/bin/env python
"""Build the seed corpus of the drafter-loader fuzzer.

    python fuzz/make_seeds.py OUT_DIR [--quick]

Seeds (all valid drafters; every one must load):
* the bundled trained DFlash2 drafter (examples/tinycode/drafter-dflash2)
  converted with dflash-convert against the bundled target to every outtype:
  f32, f16, bf16, q8_0, q4_0, q5_0, q4_k_m, q5_k_m, q6_k (--quick: f16, q8_0, q4_k_m);
  f16 also with --embed-target-head (token_embd/output inside the drafter);
* small write_draft_gguf files (tests/draft_gguf.py, independent of the
  converter): DFlash1 and DFlash2, f32 and f16 matrices.
Existing seeds are kept (the conversion is skipped when the file exists).
"""

from __future__ import annotations

import argparse
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
TINY = ROOT / "examples" / "tinycode"
ALL_TYPES = ("f32", "f16", "bf16", "q8_0", "q4_0", "q5_0", "q4_k_m", "q5_k_m", "q6_k")
QUICK_TYPES = ("f16", "q8_0", "q4_k_m")


def _convert_cmd() -> list[str]:
    exe = Path(sys.executable).with_name("dflash-convert")
    return [str(exe)] if exe.exists() else [sys.executable, "-m", "dflash_convert"]


def make_seeds(out: Path, types: tuple[str, ...] = ALL_TYPES) -> list[Path]:
    out.mkdir(parents=True, exist_ok=True)
    made: list[Path] = []
    jobs = [(t, False) for t in types] + [("f16", True)]
    for outtype, embed in jobs:
        dst = out / f"tinycode-dflash2-{outtype}{'-embed' if embed else ''}.gguf"
        if not dst.exists():
            cmd = _convert_cmd() + [
                str(TINY / "drafter-dflash2"),
                "--target",
                str(TINY / "target-f16.gguf"),
                "--outfile",
                str(dst),
                "--outtype",
                outtype,
                "--no-progress",
                "--force",
            ]
            if embed:
                cmd.append("--embed-target-head")
            res = subprocess.run(
                cmd, capture_output=True, text=True, env={**__import__("os").environ, "DFLASH_CONVERT_THREADS": "1"}
            )
            if res.returncode != 0:
                raise SystemExit(f"{' '.join(cmd)} failed:\n{res.stdout}\n{res.stderr}")
        made.append(dst)

    sys.path.insert(0, str(ROOT / "tests"))
    import numpy as np
    from draft_gguf import write_draft_gguf

    small = {
        "small-dflash2-f32.gguf": dict(version=2),
        "small-dflash2-f16.gguf": dict(version=2, dtype=np.float16),
        "small-dflash1-f32.gguf": dict(version=1),
        "small-dflash1-f16-1layer.gguf": dict(version=1, n_layer=1, dtype=np.float16),
        "small-dflash2-mha-block4.gguf": dict(version=2, n_head_kv=4, block_size=4, n_layer=1),
    }
    for name, kw in small.items():
        dst = out / name
        if not dst.exists():
            write_draft_gguf(dst, **kw)
        made.append(dst)
    return made


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("out", type=Path)
    ap.add_argument("--quick", action="store_true", help=f"only {', '.join(QUICK_TYPES)} of the bundled drafter")
    a = ap.parse_args()
    made = make_seeds(a.out, QUICK_TYPES if a.quick else ALL_TYPES)

    import dflash_gguf

    for p in made:  # every seed must be a valid drafter
        dflash_gguf.load_draft(str(p))
        print(f"{p.name}\t{p.stat().st_size} bytes")


if __name__ == "__main__":
    main()
