"""Hardening: nothing a user feeds us may crash the process, corrupt a file or leak.

* fuzz regressions: every input the loader fuzzer (fuzz/fuzz_loader.py) ever
  found is replayed from fuzz/regressions/ (a clean DFlashError, in a child
  process so an abort fails the test instead of killing pytest);
* non-UTF-8 bytes in names and metadata give DFlashError / a decoded string,
  never UnicodeDecodeError;
* converter crash safety: dflash-convert killed (SIGKILL) at several points of
  a conversion (before writing, while writing the F32 intermediate, while
  quantizing, while verifying) leaves no file at the destination and an
  existing destination byte-identical; Ctrl-C (SIGINT) also removes its
  temporary files; a full disk (a 1 MiB tmpfs, root only) is a clean error;
* long runs: 1,000 short generations in one process with bounded RSS;
* concurrency: three SpeculativeLlama objects (three drafter types) in three
  threads give exactly their sequential outputs.

Generation to the end of the context (finish reason "length") and an over-long
prompt (ValueError naming n_ctx) are covered in test_lossless.py
(test_generation_to_a_full_context) and test_api.py (test_bad_prompts); one
object used by two threads at once raising RuntimeError in test_api.py
(test_one_object_two_threads).
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import signal
import subprocess
import sys
import textwrap
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from tinycode import DRAFTER_DIR, TARGET, THREADS, drafter_gguf, prompts, record

ROOT = Path(__file__).resolve().parent.parent
FUZZ = ROOT / "fuzz"
REGRESSIONS = sorted((FUZZ / "regressions").glob("*.gguf"))


def _convert_cmd() -> list[str]:
    exe = Path(sys.executable).with_name("dflash-convert")
    return [str(exe)] if exe.exists() else [sys.executable, "-m", "dflash_convert"]


def _sha(p: Path) -> str:
    return hashlib.sha256(p.read_bytes()).hexdigest()


def _temps(folder: Path, final_name: str) -> list[str]:
    """The converter's temporary files for ``final_name`` (convert._tmp_path: .NAME.*.{gguf,f32}.tmp)."""
    return sorted(p.name for p in folder.glob(f".{final_name}.*.tmp"))


# --------------------------------------------------------------------------- #
# the loader: fuzz regressions and non-UTF-8 bytes
# --------------------------------------------------------------------------- #


def test_fuzz_regressions_replay_cleanly() -> None:
    """Every saved fuzzer finding: a DFlashError in a child process (no crash, no other exception)."""
    assert REGRESSIONS, "fuzz/regressions/ is empty"
    res = subprocess.run(
        [sys.executable, str(FUZZ / "fuzz_loader.py"), "--replay", *map(str, REGRESSIONS)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert res.returncode == 0, f"rc {res.returncode}\n{res.stdout[-4000:]}\n{res.stderr[-4000:]}"
    assert "FINDING" not in res.stdout
    assert res.stdout.count(": ") >= len(REGRESSIONS)


@pytest.mark.parametrize("path", REGRESSIONS, ids=[p.stem for p in REGRESSIONS])
def test_fuzz_regression_in_process(path: Path) -> None:
    import dflash_gguf as dg

    for fn in (dg.inspect_draft, dg.load_draft):
        with pytest.raises(dg.DFlashError) as e:
            fn(str(path))
        assert isinstance(e.value, ValueError) and str(e.value)


def test_non_utf8_metadata_and_names(tmp_path: Path) -> None:
    """A valid drafter whose general.name is not UTF-8 loads (the bytes shown escaped); a non-UTF-8
    tensor name is a DFlashError quoting it escaped."""
    import numpy as np
    from draft_gguf import GGUFValueType, typed, write_draft_gguf

    import dflash_gguf as dg

    p = tmp_path / "name.gguf"
    write_draft_gguf(p, key_overrides={"general.name": typed(GGUFValueType.STRING, b"tiny\xff\xfedrafter")})
    info = dg.inspect_draft(str(p))
    assert info["meta"].get("general.name", "tiny\\xff\\xfedrafter") == "tiny\\xff\\xfedrafter", info["meta"]
    dg.load_draft(str(p))

    q = tmp_path / "tensor.gguf"
    write_draft_gguf(q, extra_tensors={"blk.0.\xff_bogus.weight": np.zeros(4, np.float32)})
    data = q.read_bytes().replace("blk.0.\xff_bogus".encode(), b"blk.0.\xff\xfe_bogus")
    q.write_bytes(data)
    with pytest.raises(dg.DFlashError, match=r"\\xff"):
        dg.inspect_draft(str(q))


# --------------------------------------------------------------------------- #
# converter crash safety
# --------------------------------------------------------------------------- #


@pytest.fixture(scope="module")
def big_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A random DFlash2 checkpoint that fits the tinycode target, large enough (~27 MB bf16, 56 MB as F32)
    that a conversion takes long enough to be interrupted at chosen points."""
    from factories import make_checkpoint

    d = tmp_path_factory.mktemp("big") / "ckpt"
    make_checkpoint(
        d,
        version=2,
        hidden=256,
        n_layers=4,
        heads=4,
        kv_heads=2,
        head_dim=64,
        ff=4096,
        vocab=2048,
        n_target_layers=6,
        target_layer_ids=(1, 3),
        top_k=8,
        rank=64,
        conv_kernel=2,
        conv_group=16,
        seed=7,
    )
    return d


def _start_convert(ckpt: Path, out: Path, outtype: str) -> subprocess.Popen:
    cmd = _convert_cmd() + [
        str(ckpt),
        "--target",
        str(TARGET),
        "--outfile",
        str(out),
        "--outtype",
        outtype,
        "--force",
        "--no-progress",
    ]
    # SIGINT at its default, as in a terminal: a test run started in the background (`cmd &`) inherits
    # SIGINT ignored, and Python then installs no Ctrl-C handler at all
    return subprocess.Popen(
        cmd,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ, "DFLASH_CONVERT_THREADS": "1"},
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
    )


def _tmp_sizes(folder: Path, name: str) -> dict[str, int]:
    out = {}
    for t in _temps(folder, name):
        try:
            out[t] = (folder / t).stat().st_size
        except FileNotFoundError:
            pass
    return out


# kill point -> (outtype, predicate over {temp name: size} and seconds since start)
KillPoint = Callable[[dict[str, int], float], bool]
KILL_POINTS: dict[str, tuple[str, KillPoint]] = {
    # still reading the checkpoint / planning: no temp file yet
    "startup": ("f32", lambda tmps, t: t > 0.15),
    # the output temp exists and is being written
    "writing": ("f32", lambda tmps, t: any(k.endswith(".gguf.tmp") and v > 1 << 20 for k, v in tmps.items())),
    # k-quant: the F32 intermediate is being written
    "writing-f32": ("q4_k_m", lambda tmps, t: any(k.endswith(".f32.tmp") and v > 1 << 20 for k, v in tmps.items())),
    # k-quant: libllama is quantizing into the output temp
    "quantizing": ("q4_k_m", lambda tmps, t: any(k.endswith(".gguf.tmp") and v > 0 for k, v in tmps.items())),
    # k-quant: the F32 intermediate is gone (quantized), the result is being verified
    "verifying": (
        "q4_k_m",
        lambda tmps, t: len(tmps) == 1
        and next(iter(tmps)).endswith(".gguf.tmp")
        and next(iter(tmps.values())) > 4 << 20,
    ),
}


def _kill_at(
    ckpt: Path, out: Path, outtype: str, when: KillPoint, sig: int = signal.SIGKILL
) -> tuple[bool, dict[str, int], subprocess.Popen]:
    """Run a conversion and send ``sig`` once ``when`` holds; (hit before the end?, temps at kill, proc)."""
    proc = _start_convert(ckpt, out, outtype)
    t0 = time.monotonic()
    seen: dict[str, int] = {}
    try:
        while proc.poll() is None and time.monotonic() - t0 < 120:
            seen = _tmp_sizes(out.parent, out.name)
            if when(seen, time.monotonic() - t0):
                proc.send_signal(sig)
                # SIGTERM/SIGINT reach Python's handler only after the tensor being quantized (numpy, in
                # C): under the AddressSanitizer run on a busy 2-core machine that took over 60 s once
                proc.communicate(timeout=240)
                return True, seen, proc
            time.sleep(0.001)
        proc.communicate(timeout=60)
        return False, seen, proc
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


@pytest.mark.parametrize("point", list(KILL_POINTS))
@pytest.mark.parametrize("existing", [False, True], ids=["new", "existing"])
def test_sigkill_midway_leaves_destination_untouched(
    point: str, existing: bool, big_checkpoint: Path, tmp_path: Path
) -> None:
    outtype, when = KILL_POINTS[point]
    out = tmp_path / "drafter.gguf"
    if existing:
        out.write_bytes(b"GGUF" + os.urandom(4096))
        before = _sha(out)
    hit = False
    for _ in range(3):  # the machine is shared: a slow start can let the conversion win the race
        hit, seen, proc = _kill_at(big_checkpoint, out, outtype, when)
        if hit:
            break
        if not existing:
            out.unlink(missing_ok=True)
    assert hit, f"conversion finished before kill point {point!r}"
    assert proc.returncode == -signal.SIGKILL
    if existing:
        assert _sha(out) == before, "an existing destination was modified by a killed conversion"
    else:
        assert not out.exists(), "a killed conversion left a file at the destination"
    left = _temps(tmp_path, out.name)
    record(
        f"hardening-sigkill-{point}-{'existing' if existing else 'new'}", {"temps_at_kill": seen, "temps_left": left}
    )
    # what SIGKILL leaves: at most the hidden temp files of that one run (nothing can clean up after SIGKILL)
    assert all(t.startswith(f".{out.name}.") and t.endswith(".tmp") for t in left)
    assert len(left) <= 2


def test_sigkill_leaves_no_temp_files(big_checkpoint: Path, tmp_path: Path) -> None:
    out = tmp_path / "drafter.gguf"
    hit, _, _ = _kill_at(big_checkpoint, out, *KILL_POINTS["writing"])
    assert hit
    # the next conversion to the same destination
    proc = _start_convert(big_checkpoint, out, "f32")
    proc.communicate(timeout=300)
    assert proc.returncode == 0 and out.exists()
    assert _temps(tmp_path, out.name) == []


@pytest.mark.parametrize(
    "sig,point",
    [(signal.SIGINT, "writing-f32"), (signal.SIGTERM, "writing-f32"), (signal.SIGINT, "quantizing")],
    ids=["SIGINT-writing", "SIGTERM-writing", "SIGINT-quantizing"],
)
def test_interrupt_cleans_up(sig: int, point: str, big_checkpoint: Path, tmp_path: Path) -> None:
    """Ctrl-C / a polite kill while writing, or while libllama quantizes (where its log callback must not
    swallow the interrupt and let the conversion finish): no destination, no temp files."""
    out = tmp_path / "drafter.gguf"
    hit = False
    for _ in range(3):
        hit, _, proc = _kill_at(big_checkpoint, out, *KILL_POINTS[point], sig=sig)
        if hit:
            break
        out.unlink(missing_ok=True)
    assert hit
    assert proc.returncode != 0
    assert not out.exists()
    assert _temps(tmp_path, out.name) == []


@pytest.fixture
def tiny_tmpfs(tmp_path: Path) -> Any:
    """A 1 MiB tmpfs (needs root and a kernel that lets us mount)."""
    mnt = tmp_path / "tmpfs"
    mnt.mkdir()
    if os.geteuid() != 0 or shutil.which("mount") is None:
        pytest.skip("mounting a tmpfs needs root (disk-full test)")
    res = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(mnt)], capture_output=True, text=True)
    if res.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {res.stderr.strip()}")
    try:
        yield mnt
    finally:
        subprocess.run(["umount", "-l", str(mnt)], capture_output=True)


@pytest.mark.parametrize("outtype", ["f32", "q4_k_m"])
def test_disk_full_is_a_clean_error(outtype: str, tiny_tmpfs: Path) -> None:
    """The bundled drafter (8 MB as F32) into a 1 MiB filesystem: exit 1, a one-line error naming the
    problem, no traceback, the filesystem left as it was (an existing destination untouched)."""
    out = tiny_tmpfs / "drafter.gguf"
    out.write_bytes(b"GGUF" + bytes(100_000))
    before = _sha(out)
    cmd = _convert_cmd() + [
        str(DRAFTER_DIR),
        "--target",
        str(TARGET),
        "--outfile",
        str(out),
        "--outtype",
        outtype,
        "--force",
        "--no-progress",
    ]
    res = subprocess.run(
        cmd, capture_output=True, text=True, timeout=300, env={**os.environ, "DFLASH_CONVERT_THREADS": "1"}
    )
    record(f"hardening-disk-full-{outtype}", {"rc": res.returncode, "stderr": res.stderr[-3000:]})
    assert res.returncode != 0
    assert _sha(out) == before
    assert sorted(p.name for p in tiny_tmpfs.iterdir()) == ["drafter.gguf"], list(tiny_tmpfs.iterdir())
    assert "Traceback" not in res.stderr, res.stderr[-3000:]
    assert "space" in res.stderr.lower(), res.stderr[-3000:]


# --------------------------------------------------------------------------- #
# long runs
# --------------------------------------------------------------------------- #

LONG_RUN = textwrap.dedent("""
    import json, os, sys, time
    sys.path.insert(0, {tests!r})
    from dflash_gguf import SpeculativeLlama
    from tinycode import prompts

    page = os.sysconf("SC_PAGE_SIZE")
    def rss():
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * page

    spec = SpeculativeLlama({target!r}, {draft!r}, n_ctx=256, n_threads={threads})
    texts = [p["text"][:400] for p in prompts()]
    n, warm = {n}, {warm}
    samples, finish = [], {{}}
    t0 = time.perf_counter()
    for i in range(n):
        kw = dict(temperature=0.0) if i % 2 == 0 else dict(temperature=0.8, seed=i)
        if i % 3 == 0:
            chunks = list(spec.create_completion(texts[i % len(texts)], max_tokens=4, stream=True, **kw))
            reason = chunks[-1]["choices"][0]["finish_reason"]
        else:
            reason = spec.create_completion(texts[i % len(texts)], max_tokens=4, **kw)["choices"][0]["finish_reason"]
        finish[reason] = finish.get(reason, 0) + 1
        if i + 1 == warm or (i + 1) % 100 == 0:
            samples.append((i + 1, rss()))
    print(json.dumps({{"samples": samples, "finish": finish, "seconds": time.perf_counter() - t0}}))
""")

RSS_GROWTH_BOUND = 8 << 20  # bytes of RSS growth allowed from generation 200 to 1,000


def test_long_run_rss_is_bounded(tmp_path: Path) -> None:
    """1,000 completions of 4 tokens (greedy and sampled, streamed and not, 20 prompts) in one process:
    RSS after warm-up (200 completions) and at the end differ by less than 8 MiB (a leak of 10 KB per
    completion would show as 8 MB)."""
    script = tmp_path / "long_run.py"
    script.write_text(
        LONG_RUN.format(
            tests=str(ROOT / "tests"),
            target=str(TARGET),
            draft=str(drafter_gguf("f16")),
            threads=THREADS,
            n=1000,
            warm=200,
        )
    )
    res = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=900)
    assert res.returncode == 0, res.stderr[-4000:]
    out = json.loads(res.stdout.strip().splitlines()[-1])
    record("hardening-long-run", out)
    samples = dict(out["samples"])
    growth = samples[1000] - samples[200]
    print(
        f"long run: {out['seconds']:.1f} s, RSS {samples[200] / 2**20:.1f} MiB after 200 -> "
        f"{samples[1000] / 2**20:.1f} MiB after 1000 ({growth / 2**10:+.0f} KiB), finish {out['finish']}"
    )
    assert sum(out["finish"].values()) == 1000
    assert growth < RSS_GROWTH_BOUND, out["samples"]


# --------------------------------------------------------------------------- #
# concurrency
# --------------------------------------------------------------------------- #


def test_three_objects_three_threads() -> None:
    """Three SpeculativeLlama objects on three drafter types (F16, Q8_0, Q4_K_M), each in its own thread,
    several generations each at once: every output equals that object's own sequential output."""
    from dflash_gguf import SpeculativeLlama

    kinds = ("f16", "q8_0", "q4_k_m")
    objs = [SpeculativeLlama(str(TARGET), str(drafter_gguf(k)), n_ctx=512, n_threads=THREADS, n_max=7) for k in kinds]
    texts = [p["text"] for p in prompts()]
    jobs = {
        k: [
            (i, dict(temperature=0.0) if i % 2 else dict(temperature=1.0, top_k=0, top_p=1.0, min_p=0.0, seed=100 + i))
            for i in range(3 * k, 3 * k + 3)
        ]
        for k in range(3)
    }
    want = {
        k: [
            list(objs[k].generate_tokens(objs[k].tokenize(texts[i], False, False), max_tokens=40, **kw))
            for i, kw in jobs[k]
        ]
        for k in range(3)
    }
    results: dict[int, Any] = {}
    barrier = threading.Barrier(3)

    def work(k: int) -> None:
        try:
            barrier.wait(30)
            s = objs[k]
            results[k] = [
                [list(s.generate_tokens(s.tokenize(texts[i], False, False), max_tokens=40, **kw)) for i, kw in jobs[k]]
                for _ in range(2)
            ]
        except BaseException as e:  # pragma: no cover - reported below
            results[k] = e

    threads = [threading.Thread(target=work, args=(k,)) for k in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(300)
    assert not any(t.is_alive() for t in threads)
    for k in range(3):
        assert not isinstance(results[k], BaseException), results[k]
        for rep in results[k]:
            assert rep == want[k], (kinds[k], rep, want[k])


@pytest.mark.parametrize("kind", ["abort", "hang"])
def test_fuzzer_catches_a_dying_worker(kind: str, tmp_path: Path) -> None:
    """The fuzzer's own machinery: a worker that aborts (or stops making progress) at execution 50 is
    reported, its input saved, the run continues with a new worker, and the exit status is 1."""
    seeds = tmp_path / "seeds"
    seeds.mkdir()
    from draft_gguf import write_draft_gguf

    write_draft_gguf(seeds / "small.gguf", n_layer=1)
    env = {**os.environ, "DFLASH_FUZZ_SELFTEST": f"{kind}:50", "DFLASH_FUZZ_SEED": "1"}
    res = subprocess.run(
        [
            sys.executable,
            str(FUZZ / "fuzz_loader.py"),
            "--seeds",
            str(seeds),
            "--time",
            "6",
            "--hang-s",
            "2",
            "--leak-rounds",
            "0",
            "--crashes",
            str(tmp_path / "out"),
        ],
        capture_output=True,
        text=True,
        timeout=120,
        env=env,
    )
    assert res.returncode == 1, res.stdout + res.stderr
    summary = json.loads((tmp_path / "out" / "summary.json").read_text())
    kinds = [f["kind"] for f in summary["findings"]]
    assert kinds == ["crash" if kind == "abort" else "hang"], summary["findings"]
    assert summary["worker_restarts"] == 1 and summary["executions"] > 50
    assert Path(summary["findings"][0]["saved"]).stat().st_size > 0
