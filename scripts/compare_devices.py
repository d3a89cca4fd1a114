"""Where a device's draft graph departs from the CPU's: the same drafter, features and block run on the
CPU (the portable graph, DFLASH_PORTABLE_GRAPH=1: the ops every backend runs) and on DEVICE, every
computed f32 node saved (DFLASH_DUMP_NODES, cpp/src/node_dump.h) and compared by name, in the CPU's order.
A node far worse than those before it is where to look; but from ggml_top_k on, the selector's nodes
follow the candidates' order, which ggml leaves to each backend (the drafter sorts them on the host),
so there a large NMSE may be a permutation.

    python scripts/compare_devices.py out/tinycode-dflash2-f32.gguf examples/tinycode/target-f16.gguf \
        --device Vulkan0 --context 37 --n 2
"""

from __future__ import annotations

import argparse
import os
import struct
import tempfile
from collections import defaultdict
from pathlib import Path

import numpy as np

import dflash_gguf


def load_dump(path: Path) -> list[tuple[str, tuple[int, ...], np.ndarray]]:
    data, out, i = path.read_bytes(), [], 0
    while i < len(data):
        (n,) = struct.unpack_from("<I", data, i)
        name = data[i + 4 : i + 4 + n].decode()
        ne = struct.unpack_from("<4q", data, i + 4 + n)
        i += 4 + n + 32
        count = int(np.prod(ne))
        out.append((name, ne, np.frombuffer(data, np.float32, count, i)))
        i += 4 * count
    return out


def run(device: str, dump: Path, args: argparse.Namespace, feats: np.ndarray) -> np.ndarray:
    os.environ["DFLASH_DUMP_NODES"] = str(dump)
    os.environ["DFLASH_PORTABLE_GRAPH"] = "1"
    try:
        d = dflash_gguf.Drafter(args.draft, args.target, device=device, n_threads=1, n_ctx=512)
    finally:
        del os.environ["DFLASH_DUMP_NODES"], os.environ["DFLASH_PORTABLE_GRAPH"]
    if len(feats):
        d.inject(feats, np.arange(len(feats), dtype=np.int32))
    if args.n:
        out = d.draft(args.anchor, len(feats), args.n, details=True, all_rows=False, short_block=True)
    else:
        out = d.draft(args.anchor, len(feats), details=True)
    logits = np.asarray(out["logits"], np.float64)
    del d  # closes the dump
    return logits


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("draft")
    ap.add_argument("target")
    ap.add_argument("--device", required=True, help="ggml device name, e.g. CUDA0, Vulkan0, Metal")
    ap.add_argument("--context", type=int, default=37, help="random context rows injected first")
    ap.add_argument("--n", type=int, default=0, help="a short block of n drafted tokens (0: the whole block)")
    ap.add_argument("--anchor", type=int, default=7)
    ap.add_argument("--all", action="store_true", help="every node, not only those worse than all before")
    args = ap.parse_args()

    hp = dflash_gguf.inspect_draft(args.draft)["hparams"]
    width = hp["target_hidden"] * len(hp["target_layers"])
    feats = np.random.default_rng(0).standard_normal((args.context, width)).astype(np.float32)
    with tempfile.TemporaryDirectory() as tmp:
        a_logits = run("cpu", Path(tmp) / "cpu.bin", args, feats)
        b_logits = run(args.device, Path(tmp) / "dev.bin", args, feats)
        a, b = load_dump(Path(tmp) / "cpu.bin"), load_dump(Path(tmp) / "dev.bin")
    nmse = ((a_logits - b_logits) ** 2).sum(1) / (a_logits**2).sum(1)
    print(f"logits NMSE per row, {args.device} against the CPU: " + " ".join(f"{e:.2e}" for e in nmse))
    # the k-th node of a name on one side is the k-th of that name on the other (a backend may reorder)
    theirs: dict[str, list[tuple[tuple[int, ...], np.ndarray]]] = defaultdict(list)
    for name, ne, v in b:
        theirs[name].append((ne, v))
    seen: dict[str, int] = defaultdict(int)
    worst = 0.0
    print(f"{'node|op':44s} {'shape':22s} NMSE")
    for name, ne, v in a:
        k = seen[name]
        seen[name] += 1
        if k >= len(theirs[name]) or theirs[name][k][0] != ne:
            continue  # shaped by the device (e.g. its attention window): not comparable
        w = theirs[name][k][1].astype(np.float64)
        e = float(((v - w) ** 2).sum() / max(float((v.astype(np.float64) ** 2).sum()), 1e-30))
        if args.all or e > 10 * worst:
            print(f"{name:44s} {str(ne[:3]):22s} {e:.2e}")
        worst = max(worst, e)


if __name__ == "__main__":
    main()
