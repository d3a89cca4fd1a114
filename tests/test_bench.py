"""`dflash bench`: a short real run (2 prompts, 16 tokens) through the CLI.

Checks the JSON's structure, that every speedup is the ratio to the ar run of the same
prompt and round of the same run, that the summaries are computed from those runs, and
that --plot writes a valid PNG. ``upstream`` joins when llama-server is built
(``scripts/build_llama_server.sh``); without it that part is skipped, except under CI.
"""

from __future__ import annotations

import json
import math
import os
import statistics
import struct
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from tinycode import PROMPTS, TARGET, THREADS, drafter_gguf

from dflash_gguf.bench import (
    BenchError,
    find_server_binary,
    parse_n_max,
    parse_prometheus,
    parse_systems,
)
from dflash_gguf.bench.summary import paired_ratio

N_PREDICT = 16
N_PROMPTS = 2


def in_ci() -> bool:
    return os.environ.get("CI", "").strip().lower() not in ("", "0", "false", "no")


def server_available() -> bool:
    b = find_server_binary()
    return b is not None and b.is_file() and os.access(b, os.X_OK)


def run_cli(*args: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    cmd = [
        sys.executable,
        "-m",
        "dflash_gguf.cli",
        "bench",
        "--target",
        str(TARGET),
        "--draft",
        str(drafter_gguf("f16")),
        "--prompts",
        str(PROMPTS),
        "--threads",
        str(THREADS),
        "--no-progress",
        *args,
    ]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)


@pytest.fixture(scope="module")
def bench_run(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    out = tmp_path_factory.mktemp("bench")
    systems = "ar,ours,upstream" if server_available() else "ar,ours"
    res = run_cli(
        "--limit",
        str(N_PROMPTS),
        "-n",
        str(N_PREDICT),
        "--n-max",
        "7",
        "--systems",
        systems,
        "--json",
        str(out / "r.json"),
        "--plot",
        str(out / "r.png"),
    )
    assert res.returncode == 0, f"stdout:\n{res.stdout}\nstderr:\n{res.stderr}"
    return {
        "json": json.loads((out / "r.json").read_text()),
        "png": out / "r.png",
        "stdout": res.stdout,
        "systems": systems.split(","),
    }


def test_table_printed(bench_run: dict[str, Any]) -> None:
    text = bench_run["stdout"]
    for system in bench_run["systems"]:
        assert f"\n{system} " in text, text
    assert "decode tok/s" in text and "speedup" in text and "prefill ms" in text
    assert "ours per-position conditional acceptance" in text


def test_json_structure(bench_run: dict[str, Any]) -> None:
    r = bench_run["json"]
    meta = r["meta"]
    assert meta["n_predict"] == N_PREDICT and meta["n_prompts"] == N_PROMPTS and meta["repeat"] == 1
    assert meta["systems"] == bench_run["systems"]
    if "upstream" in meta["systems"]:
        # the same attention kernels as ours, whose CPU target runs without flash attention
        args = meta["server_args"]
        assert args[args.index("-fa") + 1] == "off", args
    assert len(r["configs"]) == 1
    cfg = r["configs"][0]
    assert cfg["n_max"] == 7 and cfg["n_max_ours"] == 7
    runs = cfg["runs"]
    assert len(runs) == N_PROMPTS * len(bench_run["systems"])  # warm-ups are not recorded
    for rec in runs:
        for key in (
            "system",
            "prompt_id",
            "round",
            "seed",
            "tokens",
            "decode_ms",
            "tok_s",
            "prefill_ms",
            "speedup_vs_ar",
            "ar_tok_s",
            "output",
        ):
            assert key in rec, (key, rec)
        assert 0 < rec["tokens"] <= N_PREDICT
        assert rec["decode_ms"] > 0 and rec["tok_s"] > 0
        assert rec["tok_s"] == pytest.approx(rec["tokens"] / rec["decode_ms"] * 1e3, rel=1e-6)
        assert rec["same_as_ar"] is True, rec  # greedy: every system emits the target's tokens
    ours = [x for x in runs if x["system"] == "ours"]
    for rec in ours:
        for key in (
            "steps",
            "drafted",
            "accepted",
            "mean_accepted_length",
            "per_position_acceptance",
            "draft_ms_per_step",
            "verify_ms_per_step",
        ):
            assert key in rec, key
        assert len(rec["per_position_acceptance"]) == 7
        by_length = rec["steps_by_length"]  # [k]: steps that drafted k tokens, [0] the plain ones
        assert len(by_length) == 8 and sum(by_length) == rec["steps"] and by_length[0] == rec["plain_steps"]
        assert sum(k * n for k, n in enumerate(by_length)) == rec["drafted"], rec
        # a step's time split: model work, picking the target's tokens, the rest; the timed parts sit
        # inside the decode time (a part counted twice, or one timed outside the decode, breaks this)
        assert rec["sample_ms_per_step"] > 0, rec
        work = rec["draft_ms"] + rec["verify_ms"] + rec["inject_ms"] + rec["sample_ms_per_step"] * rec["steps"]
        assert work <= rec["decode_ms"], rec
        assert rec["rest_ms_per_step"] == pytest.approx((rec["decode_ms"] - work) / rec["steps"])
        assert rec["reused_prompt_tokens"] == 0  # the bench defeats prefix reuse: prefill is the whole prompt
    s = cfg["summary"]
    assert set(s) == set(bench_run["systems"])
    assert s["ours"]["mean_accepted_length"] >= 1.0
    ppa = s["ours"]["per_position_acceptance"]
    assert ppa is None or all(0.0 <= x <= 1.0 for x in ppa)


def test_speedups_from_same_run(bench_run: dict[str, Any]) -> None:
    cfg = bench_run["json"]["configs"][0]
    runs = cfg["runs"]
    ar = {(x["prompt_id"], x["round"]): x for x in runs if x["system"] == "ar"}
    assert len(ar) == N_PROMPTS
    for system in bench_run["systems"]:
        mine = [x for x in runs if x["system"] == system]
        ratios = []
        for rec in mine:
            base = ar[(rec["prompt_id"], rec["round"])]
            assert rec["seed"] == base["seed"]
            assert rec["ar_tok_s"] == base["tok_s"]
            assert rec["speedup_vs_ar"] == pytest.approx(rec["tok_s"] / base["tok_s"], rel=1e-9)
            ratios.append(rec["tok_s"] / base["tok_s"])
        summ = cfg["summary"][system]
        assert summ["speedup_vs_ar"]["median"] == pytest.approx(statistics.median(ratios), rel=1e-9)
        assert summ["tok_s"]["median"] == pytest.approx(statistics.median(x["tok_s"] for x in mine), rel=1e-9)
        if system == "ar":
            assert summ["speedup_vs_ar"]["median"] == 1.0


def test_plot_is_png(bench_run: dict[str, Any]) -> None:
    data = bench_run["png"].read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    assert data[12:16] == b"IHDR"
    width, height = struct.unpack(">II", data[16:24])
    assert width > 800 and height > 300
    import matplotlib.image

    img = matplotlib.image.imread(bench_run["png"])
    assert img.shape[0] == height and img.shape[1] == width


def test_upstream_figures(bench_run: dict[str, Any]) -> None:
    if "upstream" not in bench_run["systems"]:
        reason = "llama-server not built (scripts/build_llama_server.sh or make llama-server)"
        if in_ci():
            pytest.fail(f"{reason}; CI is set, so this is an error")
        pytest.skip(reason)
    cfg = bench_run["json"]["configs"][0]
    assert cfg["n_max_upstream"] == 7
    ups = [x for x in cfg["runs"] if x["system"] == "upstream"]
    for rec in ups:
        assert rec["steps_source"] == "metrics", rec
        assert rec["steps"] > 0 and rec["drafted"] > 0
        assert rec["mean_accepted_length"] == pytest.approx((rec["accepted"] + rec["steps"]) / rec["steps"])
        assert rec["pos_accepted"][0] <= rec["steps"]
        assert sum(rec["pos_accepted"]) == rec["accepted"]
        # drafting time from the server's log: this request's calls (one per verify step), not the totals
        assert rec["draft_steps"] == rec["steps"], rec
        assert 0 < rec["draft_ms"] < rec["decode_ms"]
    s = cfg["summary"]["upstream"]
    steps = sum(x["steps"] for x in ups)
    acc = sum(x["accepted"] for x in ups)
    assert s["mean_accepted_length"] == pytest.approx((acc + steps) / steps)
    assert s["per_position_acceptance"] is not None
    assert s["draft_ms_per_step"]["median"] == pytest.approx(statistics.median(x["draft_ms_per_step"] for x in ups))
    ours = {(x["prompt_index"], x["round"]): x["tok_s"] for x in cfg["runs"] if x["system"] == "ours"}
    ratios = [ours[(x["prompt_index"], x["round"])] / x["tok_s"] for x in ups]
    paired = cfg["summary"]["ours"]["vs_upstream"]
    assert paired["pairs"] == len(ups) and paired["faster"] == sum(r > 1 for r in ratios)
    assert paired["median"] == pytest.approx(statistics.median(ratios))
    assert "ours / upstream decode tok/s, paired by prompt run" in bench_run["stdout"]


def test_n_max_values_run_side_by_side(tmp_path: Path) -> None:
    """Two n_max values: one ar run per prompt run is both configurations' baseline, each configuration
    decodes with its own length, the order rotates from prompt run to prompt run, and outside a terminal
    the progress is a line per prompt run."""
    cmd = [
        sys.executable,
        "-m",
        "dflash_gguf.cli",
        "bench",
        "--target",
        str(TARGET),
        "--draft",
        str(drafter_gguf("f16")),
        "--prompts",
        str(PROMPTS),
        "--threads",
        str(THREADS),
        "--limit",
        "2",
        "-n",
        "8",
        "--n-max",
        "1,2",
        "--systems",
        "ar,ours",
        "--json",
        str(tmp_path / "r.json"),
    ]
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=120)  # stderr is a pipe, not a terminal
    assert res.returncode == 0, res.stderr
    lines = [line for line in res.stderr.splitlines() if line.startswith("[bench]")]
    assert "\r" not in res.stderr
    assert [line.split(":")[0] for line in lines[:3]] == [
        "[bench] warm-up",
        "[bench] round 1/1 bench-00",
        "[bench] round 1/1 bench-01",
    ]
    done, total = lines[-1].removeprefix("[bench] ").removesuffix(" runs done").split("/")
    assert len(lines) == 4 and done == total == str(3 * 3)

    one, two = json.loads((tmp_path / "r.json").read_text())["configs"]
    assert (one["n_max_ours"], two["n_max_ours"]) == (1, 2)
    for i in range(2):
        ar1, ours1 = (
            next(r for r in one["runs"] if r["system"] == s and r["prompt_index"] == i) for s in ("ar", "ours")
        )
        ar2, ours2 = (
            next(r for r in two["runs"] if r["system"] == s and r["prompt_index"] == i) for s in ("ar", "ours")
        )
        assert ar1 == ar2  # the same run
        assert ours1["decode_ms"] != ours2["decode_ms"]
        assert max(ours1["pos_reached"][1:], default=0) == 0 < ours1["pos_reached"][0]  # n_max 1 drafts one token
        assert ours2["pos_reached"][1] > 0
        assert sorted(r["position_in_run"] for r in (ar1, ours1, ours2)) == [0, 1, 2]
    first_ar = [r["position_in_run"] for r in one["runs"] if r["system"] == "ar"]
    assert first_ar == [0, 2]  # units ar, ours@1, ours@2 rotated by one per prompt run


def test_n_max_auto_runs() -> None:
    res = run_cli("--limit", "1", "-n", "4", "--n-max", "auto", "--systems", "ar,ours", timeout=60)
    assert res.returncode == 0, res.stderr
    assert "n_max auto" in res.stdout


def test_missing_server_says_how_to_build(tmp_path: Path) -> None:
    res = run_cli(
        "--limit",
        "1",
        "-n",
        "4",
        "--systems",
        "ar,upstream",
        "--server-binary",
        str(tmp_path / "no-such-llama-server"),
        timeout=60,
    )
    assert res.returncode != 0
    assert "scripts/build_llama_server.sh" in res.stderr and "make llama-server" in res.stderr


def test_option_parsing() -> None:
    assert parse_n_max("7") == [7]
    assert parse_n_max("3, 7,15") == [3, 7, 15]
    assert parse_n_max("auto") == ["auto"]
    assert parse_n_max("0,auto") == [0, "auto"]
    for bad in ("x", "-1", ""):
        with pytest.raises(BenchError):
            parse_n_max(bad)
    assert parse_systems("ours,upstream") == ["ar", "ours", "upstream"]  # the baseline always runs
    assert parse_systems("upstream,ar,ours") == ["ar", "ours", "upstream"]
    with pytest.raises(BenchError):
        parse_systems("ar,vllm")


def test_prometheus_parsing() -> None:
    text = "\n".join(
        [
            "# HELP llamacpp:spec_decode_num_drafts_total Speculative: Total speculative decoding verification steps",
            "# TYPE llamacpp:spec_decode_num_drafts_total counter",
            "llamacpp:spec_decode_num_drafts_total 12",
            "llamacpp:spec_decode_num_accepted_tokens_total 20",
            'llamacpp:spec_decode_num_accepted_tokens_per_pos_total{position="0"} 10',
            'llamacpp:spec_decode_num_accepted_tokens_per_pos_total{position="1"} 7',
            'llamacpp:spec_decode_num_accepted_tokens_per_pos_total{position="2"} 3',
            "llamacpp:predicted_tokens_seconds 1.5e+03",
        ]
    )
    m = parse_prometheus(text)
    assert m["spec_decode_num_drafts_total"] == 12
    assert m["accepted_per_pos"] == [10, 7, 3]
    assert math.isclose(m["predicted_tokens_seconds"], 1500)


def test_paired_ratio_pairs_runs_of_the_same_prompt_and_round() -> None:
    def run(system: str, i: int, rnd: int, tok_s: float) -> dict[str, Any]:
        return {"system": system, "prompt_index": i, "round": rnd, "tok_s": tok_s}

    runs = [
        run("ours", 0, 0, 30.0),
        run("upstream", 0, 0, 20.0),
        run("ours", 1, 0, 10.0),
        run("upstream", 1, 0, 20.0),
        run("ours", 0, 1, 44.0),
        run("upstream", 0, 1, 40.0),
        run("ours", 1, 1, 99.0),  # no upstream run of prompt 1 in round 1: no pair
    ]
    p = paired_ratio(runs, "ours", "upstream")
    assert p is not None
    assert (p["pairs"], p["faster"]) == (3, 2)
    assert p["median"] == pytest.approx(1.1) and p["min"] == pytest.approx(0.5) and p["max"] == pytest.approx(1.5)
    assert paired_ratio([r for r in runs if r["system"] == "ours"], "ours", "upstream") is None
