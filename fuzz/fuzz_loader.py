#!/usr/bin/env python
"""Fuzz the C++ drafter GGUF loader (dflash_gguf.inspect_draft / load_draft).

    python fuzz/fuzz_loader.py --seeds DIR [--time 120] [--crashes DIR] [--jobs 1]
    python fuzz/fuzz_loader.py --replay FILE...          # run inputs once, in this process

A structure-aware mutation fuzzer. Our extension is built with gcc and not
instrumented for coverage, so coverage-guided fuzzers (atheris/libFuzzer)
would mutate blind here; instead every mutation knows the GGUF layout of the
seed it starts from (header counts, string lengths, value types, array counts,
integer values, tensor n_dims / ne / type / offset) and targets those fields
with boundary values, plus bit flips, byte insert/delete, truncation and
splicing of two seeds. The distinct error messages (digits blanked) act as the
feedback: an input whose message is new joins the corpus.

Process model: a worker child runs the inputs in a loop; before each one it
writes the input to WORK/current.gguf, so when the child dies (signal, abort,
sanitizer report, exit code) or stops making progress for --hang-s seconds
(hang), the parent saves exactly that input to --crashes and starts a new
worker. A Python exception other than DFlashError, or inspect_draft and
load_draft disagreeing about a file, is a finding too. The last phase
replays a fixed set of inputs many times and checks that malloc'd bytes
(mallinfo2), open descriptors and mappings do not grow (leaks; skipped under
AddressSanitizer, whose allocator mallinfo does not see).

Exit status: 0 when nothing was found, 1 otherwise. Prints executions, exec/s.
"""

from __future__ import annotations

import argparse
import ctypes
import hashlib
import json
import os
import random
import re
import shutil
import signal
import struct
import subprocess
import sys
import tempfile
import time
from pathlib import Path

# --------------------------------------------------------------------------- #
# GGUF layout of a seed: the fields worth mutating
# --------------------------------------------------------------------------- #

# GGUF value types: size of a scalar, or None for string (8) / array (9)
_SCALAR = {0: 1, 1: 1, 2: 2, 3: 2, 4: 4, 5: 4, 6: 4, 7: 1, 10: 8, 11: 8, 12: 8}


class Field:
    __slots__ = ("off", "size", "kind")

    def __init__(self, off: int, size: int, kind: str) -> None:
        self.off, self.size, self.kind = off, size, kind


def parse_fields(b: bytes) -> tuple[list[Field], int]:
    """(fields, end of header) of a valid GGUF; on a parse problem, what was found so far."""
    fields: list[Field] = []
    pos = 0

    def u32() -> int:
        nonlocal pos
        v = struct.unpack_from("<I", b, pos)[0]
        pos += 4
        return v

    def u64() -> int:
        nonlocal pos
        v = struct.unpack_from("<Q", b, pos)[0]
        pos += 8
        return v

    def string(kind: str) -> None:
        nonlocal pos
        fields.append(Field(pos, 8, kind))
        n = u64()
        pos += n
        if pos > len(b):
            raise ValueError(n)

    def value(t: int, kind: str) -> None:
        nonlocal pos
        if t in _SCALAR:
            fields.append(Field(pos, _SCALAR[t], kind))
            pos += _SCALAR[t]
        elif t == 8:
            string(kind + ".strlen")
        elif t == 9:
            fields.append(Field(pos, 4, "array.type"))
            at = u32()
            fields.append(Field(pos, 8, "array.count"))
            n = u64()
            if pos + n > len(b):
                raise ValueError(n)
            for i in range(n):
                # many elements: only the first few become fields
                if i < 4 or at not in _SCALAR:
                    value(at, "array.elem")
                else:
                    pos += _SCALAR[at] * (n - i)
                    break
        else:
            raise ValueError(t)

    try:
        pos = 4
        fields.append(Field(pos, 4, "version"))
        u32()
        fields.append(Field(pos, 8, "n_tensors"))
        n_t = u64()
        fields.append(Field(pos, 8, "n_kv"))
        n_kv = u64()
        if n_t > len(b) or n_kv > len(b):
            raise ValueError(n_kv)
        for _ in range(n_kv):
            string("key.len")
            fields.append(Field(pos, 4, "kv.type"))
            t = u32()
            value(t, "kv.value")
        for _ in range(n_t):
            string("tensor.name_len")
            fields.append(Field(pos, 4, "tensor.n_dims"))
            nd = u32()
            if nd > 8:
                raise ValueError(nd)
            for _ in range(nd):
                fields.append(Field(pos, 8, "tensor.ne"))
                pos += 8
            fields.append(Field(pos, 4, "tensor.type"))
            pos += 4
            fields.append(Field(pos, 8, "tensor.offset"))
            pos += 8
    except (struct.error, ValueError, OverflowError):
        pass
    return fields, min(pos, len(b))


class Seed:
    def __init__(self, name: str, data: bytes) -> None:
        self.name, self.data = name, data
        self.fields, self.header_end = parse_fields(data)


# --------------------------------------------------------------------------- #
# mutations
# --------------------------------------------------------------------------- #


def _interesting(rng: random.Random, old: int, size: int) -> int:
    bits = size * 8
    top = (1 << bits) - 1
    choices = [
        0,
        1,
        2,
        3,
        4,
        7,
        8,
        16,
        31,
        32,
        63,
        64,
        255,
        256,
        1023,
        1024,
        4096,
        65535,
        65536,
        top,
        top - 1,
        1 << (bits - 1),
        (1 << (bits - 1)) - 1,
        old + 1,
        old - 1,
        old * 2,
        old // 2,
        old + rng.randint(-64, 64),
        rng.getrandbits(bits),
        1 << rng.randrange(bits),
    ]
    if bits >= 32:
        choices += [0x7FFFFFFF, 0x80000000, 0xFFFFFFFF, 0x100000000, 0x100000001]
    return rng.choice(choices) & top


def mutate(rng: random.Random, seed: Seed, seeds: list[Seed]) -> tuple[bytes, str]:
    """One stacked mutation of ``seed``; returns (bytes, description)."""
    b = bytearray(seed.data)
    hdr = max(seed.header_end, 24)
    what: list[str] = []
    for _ in range(rng.choice((1, 1, 1, 2, 2, 3, 4))):
        op = rng.random()
        n = len(b)
        if n == 0:
            break
        if op < 0.40 and seed.fields:
            f = rng.choice(seed.fields)
            if f.off + f.size > n:
                continue
            old = int.from_bytes(b[f.off : f.off + f.size], "little")
            new = _interesting(rng, old, f.size)
            b[f.off : f.off + f.size] = new.to_bytes(f.size, "little")
            what.append(f"{f.kind}@{f.off}:{old}->{new}")
        elif op < 0.55:
            # copy one field's bytes over another field of the same size
            same = [f for f in seed.fields if f.off + f.size <= n]
            if len(same) < 2:
                continue
            a, c = rng.sample(same, 2)
            sz = min(a.size, c.size)
            b[c.off : c.off + sz] = b[a.off : a.off + sz]
            what.append(f"copy {a.kind}@{a.off}->{c.kind}@{c.off}")
        elif op < 0.70:
            k = rng.choice((1, 1, 2, 4, 8))
            for _ in range(k):
                i = rng.randrange(min(hdr, n)) if rng.random() < 0.9 else rng.randrange(n)
                b[i] ^= 1 << rng.randrange(8)
            what.append(f"flip x{k}")
        elif op < 0.78:
            i = rng.randrange(min(hdr, n))
            k = rng.choice((1, 2, 4, 8, 16, 64))
            if rng.random() < 0.5:
                del b[i : i + k]
                what.append(f"del {k}@{i}")
            else:
                b[i:i] = bytes(rng.getrandbits(8) for _ in range(k))
                what.append(f"ins {k}@{i}")
        elif op < 0.88:
            # truncate: in the header, at a field boundary, or in the data
            r = rng.random()
            if r < 0.4 and seed.fields:
                f = rng.choice(seed.fields)
                cut = f.off + rng.randrange(f.size + 1)
            elif r < 0.7:
                cut = rng.randrange(min(hdr, n))
            else:
                cut = rng.randrange(n)
            del b[cut:]
            what.append(f"truncate@{cut}")
        elif op < 0.94:
            # splice: this header with another seed's tail (or the reverse)
            other = rng.choice(seeds)
            cut = rng.randrange(min(hdr, n))
            cut2 = min(cut, len(other.data))
            if rng.random() < 0.5:
                b = bytearray(bytes(b[:cut]) + other.data[cut2:])
            else:
                b = bytearray(other.data[:cut2] + bytes(b[cut:]))
            what.append(f"splice {other.name}@{cut}")
        else:
            # append junk / grow the file (offsets past the end become reachable)
            k = rng.choice((1, 31, 32, 4096))
            b += bytes(k)
            what.append(f"append {k}")
    return bytes(b), "; ".join(what) or "none"


# --------------------------------------------------------------------------- #
# the worker (child process)
# --------------------------------------------------------------------------- #

_DIGITS = re.compile(rb"[0-9]+|0x[0-9a-f]+")


def _signature(msg: str) -> str:
    # drop the path and the numbers: the shape of the message is the "coverage"
    msg = msg.split(": ", 1)[-1] if msg.startswith("/") else msg
    return re.sub(r"[0-9]+", "#", msg)[:160]


def _in_use_bytes() -> int:
    libc = ctypes.CDLL(None)

    class MallInfo2(ctypes.Structure):
        _fields_ = [
            (n, ctypes.c_size_t)
            for n in (
                "arena",
                "ordblks",
                "smblks",
                "hblks",
                "hblkhd",
                "usmblks",
                "fsmblks",
                "uordblks",
                "fordblks",
                "keepcost",
            )
        ]

    libc.mallinfo2.restype = MallInfo2
    mi = libc.mallinfo2()
    return int(mi.uordblks + mi.hblkhd)


def _counts() -> tuple[int, int]:
    return len(os.listdir("/proc/self/fd")), sum(1 for _ in open("/proc/self/maps"))


def run_one(dg, path: str, findings: list[dict], desc: str = "") -> str:
    """inspect_draft then load_draft; returns the error signature ("ok" when valid)."""
    try:
        dg.inspect_draft(path)
        ok_inspect, sig = True, "ok"
    except dg.DFlashError as e:
        ok_inspect, sig = False, _signature(str(e))
    except Exception as e:  # noqa: BLE001 - any other exception class is a finding
        findings.append(
            {"kind": "exception", "where": "inspect_draft", "error": f"{type(e).__name__}: {e}"[:500], "mutation": desc}
        )
        return "exc:" + type(e).__name__
    if ok_inspect:
        try:
            dg.load_draft(path)
        except dg.DFlashError as e:
            # legitimate only for damage inspect cannot see without reading data (none today)
            findings.append(
                {"kind": "disagree", "error": f"inspect_draft accepted, load_draft: {e}"[:500], "mutation": desc}
            )
        except Exception as e:  # noqa: BLE001
            findings.append(
                {
                    "kind": "exception",
                    "where": "load_draft",
                    "error": f"{type(e).__name__}: {e}"[:500],
                    "mutation": desc,
                }
            )
    return sig


def worker(args: argparse.Namespace) -> None:
    import resource

    if not os.environ.get("LD_PRELOAD", "").count("asan"):
        # a corrupt size must be refused, not allocated: cap the address space at 8 GiB
        resource.setrlimit(resource.RLIMIT_AS, (8 << 30, 8 << 30))
    import dflash_gguf as dg

    work = Path(args.work)
    cur = work / "current.gguf"
    seeds = [Seed(p.name, p.read_bytes()) for p in sorted(Path(args.seeds).glob("*.gguf"))]
    # small seeds are cheaper: weight them up
    weights = [1.0 / max(1, len(s.data) >> 18) for s in seeds]
    corpus: list[Seed] = []
    corpus_bytes = 0
    seen: set[str] = set()
    rng = random.Random(args.rng_seed)
    findings: list[dict] = []
    deadline = time.monotonic() + args.time
    selftest, _, at = os.environ.get("DFLASH_FUZZ_SELFTEST", "").partition(":")
    selftest_at = int(at) if selftest and args.rng_seed == int(os.environ.get("DFLASH_FUZZ_SEED", "1")) else -1
    n = 0
    progress = work / "progress"
    last_report = 0.0
    while time.monotonic() < deadline:
        if corpus and rng.random() < 0.3:
            base = rng.choice(corpus)
        else:
            base = rng.choices(seeds, weights)[0]
        data, desc = mutate(rng, base, seeds)
        desc = f"{base.name}: {desc}"
        with open(cur, "wb") as f:
            f.write(data)
        (work / "current.txt").write_text(desc)
        k0 = len(findings)
        if n == selftest_at:  # proves the parent catches a dying / hanging worker (tests/test_hardening.py)
            os.abort() if selftest == "abort" else time.sleep(1e6)
        sig = run_one(dg, str(cur), findings, desc)
        if len(findings) > k0:
            h = hashlib.sha1(data).hexdigest()[:12]
            (work / f"finding-{h}.gguf").write_bytes(data)
            findings[-1]["file"] = f"finding-{h}.gguf"
        if sig not in seen:
            seen.add(sig)
            if len(corpus) < 400 and corpus_bytes + len(data) < (256 << 20):
                corpus.append(Seed(f"{base.name}+", data))
                corpus_bytes += len(data)
        n += 1
        now = time.monotonic()
        if now - last_report > 0.5:
            progress.write_text(f"{n} {len(seen)}")
            last_report = now
    progress.write_text(f"{n} {len(seen)}")
    (work / "signatures.json").write_text(json.dumps(sorted(seen), indent=1))
    (work / "findings.json").write_text(json.dumps(findings, indent=1))

    # leak phase: a fixed set of inputs (every seed, and error-path inputs), replayed
    leak: dict = {"skipped": None}
    if os.environ.get("LD_PRELOAD", "").count("asan"):
        leak["skipped"] = "AddressSanitizer allocator (mallinfo2 does not see it)"
    elif args.leak_rounds > 0:
        lrng = random.Random(12345)
        fixed = [s.data for s in seeds] + [mutate(lrng, lrng.choice(seeds), seeds)[0] for _ in range(60)]
        paths = []
        for i, d in enumerate(fixed):
            p = work / f"leak-{i}.gguf"
            p.write_bytes(d)
            paths.append(str(p))
        import gc

        sink: list[dict] = []
        samples = []
        for r in range(args.leak_rounds):
            for p in paths:
                run_one(dg, p, sink)
            sink.clear()
            gc.collect()
            samples.append((_in_use_bytes(), *_counts()))
        warm = samples[1] if len(samples) > 1 else samples[0]
        end = samples[-1]
        calls = len(paths) * (len(samples) - 2) if len(samples) > 2 else 0
        leak.update(
            {
                "inputs": len(paths),
                "rounds": args.leak_rounds,
                "calls_after_warmup": calls,
                "malloc_in_use_warm": warm[0],
                "malloc_in_use_end": end[0],
                "malloc_growth": end[0] - warm[0],
                "fds_warm": warm[1],
                "fds_end": end[1],
                "maps_warm": warm[2],
                "maps_end": end[2],
            }
        )
    (work / "leak.json").write_text(json.dumps(leak, indent=1))


# --------------------------------------------------------------------------- #
# the parent: start workers, watch them, save what kills them
# --------------------------------------------------------------------------- #


def _read_progress(work: Path) -> tuple[int, int]:
    try:
        a, b = (work / "progress").read_text().split()
        return int(a), int(b)
    except (OSError, ValueError):
        return 0, 0


def fuzz(args: argparse.Namespace) -> int:
    crashes = Path(args.crashes)
    crashes.mkdir(parents=True, exist_ok=True)
    base = Path(tempfile.mkdtemp(prefix="dflash-fuzz-", dir="/dev/shm" if os.path.isdir("/dev/shm") else None))
    t_start = time.monotonic()
    deadline = t_start + args.time
    total = 0
    sigs: set[str] = set()
    found: list[dict] = []
    leak_reports: list[dict] = []
    rng_seed = args.rng_seed
    restarts = 0
    try:
        while True:
            left = deadline - time.monotonic()
            if left < 1:
                break
            work = base / f"w{restarts}"
            work.mkdir()
            cmd = [
                sys.executable,
                os.path.abspath(__file__),
                "--worker",
                "--seeds",
                args.seeds,
                "--work",
                str(work),
                "--time",
                f"{left:.1f}",
                "--rng-seed",
                str(rng_seed),
                "--leak-rounds",
                str(args.leak_rounds),
            ]
            log = open(work / "stderr.log", "wb")
            proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
            last_n, last_t = -1, time.monotonic()
            hung = False
            limit = left + 60 + args.leak_rounds * 10  # the leak phase comes after the time budget
            while proc.poll() is None:
                time.sleep(0.25)
                n, _ = _read_progress(work)
                now = time.monotonic()
                if n != last_n:
                    last_n, last_t = n, now
                elif now - last_t > args.hang_s and now < deadline:
                    hung = True
                elif now - t_start > args.time + limit:
                    hung = True
                if hung:
                    os.killpg(proc.pid, signal.SIGKILL)
                    proc.wait()
                    break
            log.close()
            n, _ = _read_progress(work)
            total += n
            if (work / "signatures.json").exists():
                sigs.update(json.loads((work / "signatures.json").read_text()))
            if (work / "findings.json").exists():
                for f in json.loads((work / "findings.json").read_text()):
                    if "file" in f:
                        dst = crashes / f"{f['kind']}-{f['file'].split('-', 1)[1]}"
                        shutil.copy(work / f["file"], dst)
                        f["saved"] = str(dst)
                    found.append(f)
            if (work / "leak.json").exists():
                leak_reports.append(json.loads((work / "leak.json").read_text()))
            rc = proc.returncode
            if hung or rc != 0:
                data = (work / "current.gguf").read_bytes() if (work / "current.gguf").exists() else b""
                h = hashlib.sha1(data).hexdigest()[:12]
                kind = "hang" if hung else ("crash" if rc < 0 else "exit")
                dst = crashes / f"{kind}-{h}.gguf"
                dst.write_bytes(data)
                desc = (work / "current.txt").read_text() if (work / "current.txt").exists() else ""
                tail = (work / "stderr.log").read_bytes()[-3000:].decode("utf-8", "replace")
                found.append({"kind": kind, "returncode": rc, "saved": str(dst), "mutation": desc, "log_tail": tail})
                print(f"[fuzz] {kind} (rc {rc}) -> {dst}\n{tail}", file=sys.stderr)
                rng_seed += 1000003
                restarts += 1
                continue
            break
    finally:
        shutil.rmtree(base, ignore_errors=True)
    elapsed = time.monotonic() - t_start
    leak_bad = []
    for lr in leak_reports:
        if lr.get("skipped") or "malloc_growth" not in lr:
            continue
        if lr["malloc_growth"] > args.leak_bytes or lr["fds_end"] != lr["fds_warm"] or lr["maps_end"] > lr["maps_warm"]:
            leak_bad.append(lr)
    summary = {
        "seconds": round(elapsed, 1),
        "executions": total,
        "exec_per_s": round(total / max(elapsed, 1e-9), 1),
        "distinct_errors": len(sigs),
        "worker_restarts": restarts,
        "findings": found,
        "leak": leak_reports,
        "leak_failures": leak_bad,
    }
    (crashes / "summary.json").write_text(json.dumps(summary, indent=1))
    print(
        f"[fuzz] {total} executions in {elapsed:.0f} s ({summary['exec_per_s']} exec/s), "
        f"{len(sigs)} distinct error messages, {len(found)} findings, leak check: "
        + (
            "; ".join(
                f"{lr.get('skipped')}"
                if lr.get("skipped")
                else f"{lr['calls_after_warmup']} calls, malloc'd bytes {lr['malloc_growth']:+d}, "
                f"fds {lr['fds_warm']}->{lr['fds_end']}, maps {lr['maps_warm']}->{lr['maps_end']}"
                for lr in leak_reports
            )
            or "not run"
        )
    )
    for f in found:
        print(f"[fuzz] FINDING {f['kind']}: {f.get('error', '')} {f.get('saved', '')} ({f.get('mutation', '')})")
    if leak_bad:
        print(f"[fuzz] LEAK: {leak_bad}")
    return 1 if (found or leak_bad) else 0


def replay(paths: list[str]) -> int:
    import dflash_gguf as dg

    bad = 0
    for p in paths:
        findings: list[dict] = []
        sig = run_one(dg, p, findings)
        print(f"{p}: {sig}")
        for f in findings:
            print(f"  FINDING {f}")
            bad += 1
    return 1 if bad else 0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seeds", help="folder of seed .gguf files (fuzz/make_seeds.py)")
    ap.add_argument("--time", type=float, default=120.0, help="seconds of fuzzing (default 120)")
    ap.add_argument("--crashes", default="fuzz/crashes", help="where findings and summary.json go")
    ap.add_argument("--rng-seed", type=int, default=int(os.environ.get("DFLASH_FUZZ_SEED", "1")))
    ap.add_argument("--hang-s", type=float, default=30.0, help="no progress for this long is a hang")
    ap.add_argument("--leak-rounds", type=int, default=8, help="replay rounds of the leak check (0: none)")
    ap.add_argument("--leak-bytes", type=int, default=256 << 10, help="allowed malloc growth after warm-up")
    ap.add_argument("--replay", nargs="+", help="run these files once in this process and report")
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--work", help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.replay:
        sys.exit(replay(a.replay))
    if a.worker:
        worker(a)
        return
    if not a.seeds:
        ap.error("--seeds is required")
    sys.exit(fuzz(a))


if __name__ == "__main__":
    main()
