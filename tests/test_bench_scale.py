"""`dflash bench --scale` end to end on a small inflated size (the CLI's 0.6B / 1.7B take minutes).

Inflates the bundled pair to a small shape, runs the interleaved three-way bench on two target types
through the real libllama, our loop and upstream llama-server, and checks the JSON's `end_to_end` rows
against the raw per-prompt figures they summarise, the goals against the rows, and the cache.
"""

from __future__ import annotations

import json
import statistics
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
from click.testing import CliRunner
from test_llama_server import llama_server  # noqa: F401 - the fixture (skips, or fails in CI, without the build)

from dflash_gguf.bench import scale as bench_scale
from dflash_gguf.bench.inflate import SIZES, ScaleSize, ensure_pair
from dflash_gguf.bench.scale import format_table, goals, run_scale, write_json
from dflash_gguf.cli import main as cli_main

SMALL = ScaleSize("small", hidden=512, n_layers=8, n_heads=8, n_kv_heads=4, head_dim=128, ff=1024, vocab=4096)
TYPES = ("f16", "q8_0")


@pytest.fixture(scope="module")
def scale_json(
    tmp_path_factory: pytest.TempPathFactory,
    llama_server: Path,  # noqa: F811
    monkeypatch_module: pytest.MonkeyPatch,
) -> dict[str, Any]:
    monkeypatch_module.setenv("DFLASH_LLAMA_SERVER", str(llama_server))
    folder = tmp_path_factory.mktemp("scale")
    captured: list[dict[str, Any]] = []
    real_run_bench = bench_scale.run_bench

    def run_bench(o, log):  # type: ignore[no-untyped-def]
        res = real_run_bench(o, log)
        captured.append(res)
        return res

    monkeypatch_module.setattr(bench_scale, "run_bench", run_bench)
    partial: list[dict[str, Any]] = []
    result = run_scale(
        [SMALL],
        folder=folder,
        target_types=TYPES,
        n_max="2,auto",
        n_predict=12,
        limit=2,
        threads=1,
        repeat=2,
        placement={"cpu_moe": True},  # no experts here: what is checked is that every system gets it
        server={"server_args": ["--no-warmup"]},
        progress=False,
        log=lambda m: None,
        on_progress=lambda r: partial.append(json.loads(json.dumps(r))),
    )
    write_json(result, folder / "scale.json")
    out = json.loads((folder / "scale.json").read_text())
    out["_raw"], out["_partial"] = captured, partial
    return out


def test_each_target_types_rows_are_handed_on_when_measured(scale_json: dict[str, Any]) -> None:
    """--json is rewritten after each target type: a later type that fails (or a process killed for memory)
    loses nothing measured before it."""
    seen = [[(r["target_type"], r["n_max"]) for r in p["end_to_end"]] for p in scale_json["_partial"]]
    assert seen == [[("f16", 2), ("f16", "auto")], [("f16", 2), ("f16", "auto"), ("q8_0", 2), ("q8_0", "auto")]]
    assert scale_json["_partial"][0]["goals"] and scale_json["_partial"][-1]["end_to_end"] == scale_json["end_to_end"]


@pytest.fixture(scope="module")
def monkeypatch_module() -> Any:
    mp = pytest.MonkeyPatch()
    yield mp
    mp.undo()


def test_the_placement_reaches_every_bench(scale_json: dict[str, Any]) -> None:
    """--scale's --cpu-moe / --n-cpu-moe / -ot go to ours and llama-server in every target type's bench, as
    do --repeat and --server-arg."""
    assert scale_json["meta"]["placement"] == {"cpu_moe": True} and scale_json["meta"]["repeat"] == 2
    assert len(scale_json["_raw"]) == len(TYPES)
    for raw in scale_json["_raw"]:
        assert raw["meta"]["cpu_moe"] is True and "--cpu-moe" in raw["meta"]["server_args"]
        assert "--no-warmup" in raw["meta"]["server_args"] and raw["meta"]["repeat"] == 2
    assert "target on CPU --cpu-moe" in format_table(scale_json)
    assert "2 prompts x 12 tokens x 2 rounds" in format_table(scale_json)


def test_rows_summarise_the_runs(scale_json: dict[str, Any]) -> None:
    rows = scale_json["end_to_end"]
    assert [(r["target_type"], r["n_max"]) for r in rows] == [(t, n) for t in TYPES for n in (2, "auto")]
    for t in TYPES:  # the n_max values ran side by side: one ar run per prompt run is every row's baseline
        assert len({r["ar_tok_s"] for r in rows if r["target_type"] == t}) == 1
    for row, cfg in zip(rows, [cfg for res in scale_json["_raw"] for cfg in res["configs"]]):
        assert row["size"] == "small" and row["draft_type"] == "q4_0"
        assert set(row) == {"size", "target_type", "draft_type", "n_max", "ar_tok_s", "implied_speedup", "systems"}
        ar = [r for r in cfg["runs"] if r["system"] == "ar"]
        assert row["ar_tok_s"] == pytest.approx(statistics.median(r["tok_s"] for r in ar))
        for system in ("ours", "upstream"):
            runs = [r for r in cfg["runs"] if r["system"] == system]
            s = row["systems"][system]
            assert {"speedup", "acc_len", "identical", "runs"} <= set(s)
            assert s["runs"] == len(runs) == 4  # 2 prompts x 2 rounds
            assert s["speedup"] == pytest.approx(statistics.median(r["tok_s"] / a["tok_s"] for r, a in zip(runs, ar)))
            assert s["identical"] == sum(r["output"] == a["output"] for r, a in zip(runs, ar)) == 4, (
                "greedy is lossless"
            )
            assert s["acc_len"] >= 1
            assert s["draft_ms"] == pytest.approx(statistics.median(r["draft_ms_per_step"] for r in runs))
        up = {(r["prompt_index"], r["round"]): r["tok_s"] for r in cfg["runs"] if r["system"] == "upstream"}
        paired = [r["tok_s"] / up[(r["prompt_index"], r["round"])] for r in cfg["runs"] if r["system"] == "ours"]
        assert row["systems"]["ours"]["vs_upstream"] == pytest.approx(statistics.median(paired))
        ours = [r for r in cfg["runs"] if r["system"] == "ours"]
        assert row["implied_speedup"] == pytest.approx(statistics.median(r["limit_vs_ar"] for r in ours))
        for key in ("sample_ms", "rest_ms"):
            assert row["systems"]["ours"][key] == pytest.approx(statistics.median(r[f"{key}_per_step"] for r in ours))
        by_length = row["systems"]["ours"]["steps_by_length"]  # over the row's runs: [k] steps that drafted k
        assert by_length == [sum(col) for col in zip(*(r["steps_by_length"] for r in ours))]
        assert sum(by_length) == sum(r["steps"] for r in ours) and by_length[0] == sum(r["plain_steps"] for r in ours)
        assert row["n_max"] == "auto" or sum(by_length[3:]) == 0, by_length  # a fixed 2 never drafts more
    for res in scale_json["_raw"]:  # auto over the fixed length, paired by prompt run
        fixed, auto = (
            {(r["prompt_index"], r["round"]): r["tok_s"] for r in c["runs"] if r["system"] == "ours"}
            for c in res["configs"]
        )
        row = next(
            r
            for r in rows
            if r["n_max"] == "auto" and res["meta"]["target"].endswith(f"-target-{r['target_type']}.gguf")
        )
        expected = statistics.median(auto[key] / fixed[key] for key in auto)
        assert row["systems"]["ours"]["vs_n_max"] == {"2": pytest.approx(expected)}
        assert "vs_n_max" not in next(r for r in rows if r["n_max"] == 2)["systems"]["ours"]
    assert scale_json["meta"]["threads"] == 1


def test_goals_follow_the_rows(scale_json: dict[str, Any]) -> None:
    rows = scale_json["end_to_end"]
    assert scale_json["goals"] == goals(rows)
    ahead = next(g for g in scale_json["goals"] if g["goal"].startswith("ours ahead of upstream"))
    assert ahead["met"] == all(r["systems"]["ours"]["vs_upstream"] >= 1.0 for r in rows)
    faked = [dict(r, systems=dict(r["systems"], ours=dict(r["systems"]["ours"], vs_upstream=0.99))) for r in rows]
    assert next(g for g in goals(faked) if g["goal"].startswith("ours ahead"))["met"] is False
    unpaired = [
        {**r, "systems": {k: {x: y for x, y in v.items() if x != "vs_upstream"} for k, v in r["systems"].items()}}
        for r in faked
    ]
    unpaired[0]["systems"]["upstream"]["speedup"] = 99.0  # without the pairs, the medians decide
    assert next(g for g in goals(unpaired) if g["goal"].startswith("ours ahead"))["met"] is False
    for g in scale_json["goals"]:
        if g["goal"].startswith("auto within 3%"):
            row = next(
                r
                for r in rows
                if r["n_max"] == "auto" and g["goal"].endswith(f"({r['size']} {r['target_type'].upper()})")
            )
            assert g["met"] == (row["systems"]["ours"]["vs_n_max"]["2"] >= 0.97)
    text = format_table(scale_json)
    assert "small" in text and "goals:" in text and text.count("\nsmall ") == len(rows)


def test_pairs_are_cached_by_config(scale_json: dict[str, Any]) -> None:
    (size,) = scale_json["sizes"]
    files = [Path(p) for p in size["targets"].values()] + [Path(size["draft"])]
    before = [p.stat().st_mtime_ns for p in files]
    pair = ensure_pair(SMALL, files[0].parent, target_types=TYPES)
    assert [*pair.targets.values(), pair.draft] == files
    assert [p.stat().st_mtime_ns for p in files] == before
    assert replace(SMALL, ff=2048).key() != SMALL.key()
    assert replace(SMALL, name="renamed").key() == SMALL.key()  # the name is not part of the config
    assert not list(files[0].parent.glob(".*.tmp")), "no temp files left behind"


def test_named_sizes() -> None:
    assert SIZES["0.6B"].layer_ids() == [1, 7, 13, 19, 25] == SIZES["1.7B"].layer_ids()
    assert SIZES["4B"].layer_ids() == [1, 9, 17, 25, 33]
    assert 0.7e9 < SIZES["0.6B"].target_params() < 0.8e9 and 3.9e9 < SIZES["4B"].target_params() < 4.5e9


def test_cli_options() -> None:
    runner = CliRunner()
    res = runner.invoke(cli_main, ["bench", "--target", "t.gguf"])
    assert res.exit_code == 2 and "missing --draft, --prompts (required unless --scale)" in res.output
    res = runner.invoke(cli_main, ["bench", "--scale", "--draft", "d.gguf"])
    assert res.exit_code == 2 and "drop --draft" in res.output
    res = runner.invoke(cli_main, ["bench", "--scale", "--temp", "0.7", "--seed", "3"])
    assert res.exit_code == 2 and "decodes greedily; drop --temp, --seed" in res.output
    res = runner.invoke(cli_main, ["bench", "--scale", "--scale-sizes", "7B"])
    assert res.exit_code == 2 and "unknown size 7B" in res.output
    res = runner.invoke(cli_main, ["bench", "--scale", "--scale-types", "q3_x"])
    assert res.exit_code == 2 and "--scale-types" in res.output and "q3_x" in res.output


def test_a_missing_tinycode_pair_is_named(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """An installed wheel ships no examples/: --scale says where it looked before writing anything."""
    monkeypatch.setenv("DFLASH_TINYCODE", str(tmp_path / "nowhere"))
    res = CliRunner().invoke(cli_main, ["bench", "--scale", "--scale-dir", str(tmp_path / "scale")])
    assert res.exit_code == 2, res.output
    assert "tinycode pair" in res.output and str(tmp_path / "nowhere") in res.output and "DFLASH_TINYCODE" in res.output
    assert not (tmp_path / "scale").exists()
