"""`dflash bench --scale` machinery, end to end on a tiny size (the CLI's 0.5B / 2B take minutes).

Generates a tiny random Qwen3 target and its DFlash2 drafter, loads them in libllama and our
Drafter, measures, and checks the JSON: every figure present, positive and finite, and every
implied speedup recomputed from the measured medians with S = min(tau, k+1) * plain / (draft + verify).
"""

from __future__ import annotations

import json
import math
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
from click.testing import CliRunner

from dflash_gguf.bench_scale import TAUS, format_table, run_scale, write_json
from dflash_gguf.scale_models import SIZES, ScaleSize, ensure_models, synthetic_vocab
from dflash_gguf.cli import main as cli_main

TINY = ScaleSize("tiny", hidden=64, n_layers=4, n_heads=4, n_kv_heads=2, head_dim=16, ff=128, vocab=300,
                 rope_theta=1e4, draft_layers=2, block_size=8, selector_rank=8, selector_top_k=4,
                 target_layer_ids=(1, 2))
REPEAT = 3


@pytest.fixture(scope="module")
def scale_json(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    folder = tmp_path_factory.mktemp("scale")
    result = run_scale([TINY], folder=folder, context=40, repeat=REPEAT, threads=1, log=lambda m: None)
    write_json(result, folder / "scale.json")
    return json.loads((folder / "scale.json").read_text())


def _positive(x: Any) -> bool:
    return isinstance(x, (int, float)) and math.isfinite(x) and x > 0


def _check_spread(d: dict[str, float]) -> None:
    for key in ("median", "p10", "p90", "min", "max", "mean"):
        assert _positive(d[key]), (key, d)
    assert d["min"] <= d["p10"] <= d["median"] <= d["p90"] <= d["max"]


def test_json_has_every_figure(scale_json: dict[str, Any]) -> None:
    assert scale_json["meta"]["repeat"] == REPEAT and scale_json["meta"]["context"] == 40
    assert [t["value"] for t in scale_json["taus"]] == [t.value for t in TAUS]
    (r,) = scale_json["sizes"]
    assert r["size"]["name"] == "tiny" and r["target_layer_ids"] == [1, 2]
    assert _positive(r["target_params"]) and _positive(r["draft_params"])
    assert Path(r["target"]).is_file() and Path(r["draft"]).is_file()
    assert r["features_extracted"] is True
    _check_spread(r["plain_ms"])
    assert [row["k"] for row in r["per_k"]] == list(range(1, TINY.block_size))
    for row in r["per_k"]:
        _check_spread(row["draft_ms"])
        _check_spread(row["verify_ms"])
        assert _positive(row["c"])
        assert set(row["speedup"]) == {str(t.value) for t in TAUS}
        assert all(_positive(v) for v in row["speedup"].values())
    for name, samples in r["samples_ms"].items():
        assert len(samples) == REPEAT and all(_positive(x) for x in samples), name


def test_speedups_follow_the_formula(scale_json: dict[str, Any]) -> None:
    (r,) = scale_json["sizes"]
    plain = r["plain_ms"]["median"]
    by_k = {row["k"]: row for row in r["per_k"]}
    for k, row in by_k.items():
        draft, verify = row["draft_ms"]["median"], row["verify_ms"]["median"]
        assert row["c"] == pytest.approx(draft / verify)
        for tau in TAUS:
            assert row["speedup"][str(tau.value)] == pytest.approx(min(tau.value, k + 1) * plain / (draft + verify))
    for imp, tau in zip(r["implied"], TAUS):
        k = min(tau.k, TINY.block_size - 1)
        assert imp["tau"] == tau.value and imp["k"] == k
        assert imp["speedup"] == pytest.approx(by_k[k]["speedup"][str(tau.value)])
        best = max(by_k.values(), key=lambda row: row["speedup"][str(tau.value)])
        assert imp["best_k"] == best["k"] and imp["best_speedup"] == pytest.approx(best["speedup"][str(tau.value)])
    text = format_table(scale_json)
    assert "not measured end to end" in text and "tiny:" in text


def test_models_are_reused_and_keyed_by_config(scale_json: dict[str, Any]) -> None:
    (r,) = scale_json["sizes"]
    target, draft = Path(r["target"]), Path(r["draft"])
    before = (target.stat().st_mtime_ns, draft.stat().st_mtime_ns)
    assert ensure_models(TINY, target.parent, log=lambda m: None) == (target, draft)
    assert (target.stat().st_mtime_ns, draft.stat().st_mtime_ns) == before
    assert replace(TINY, selector_top_k=3).key() != TINY.key()
    assert replace(TINY, name="renamed").key() == TINY.key()  # the name is not part of the config
    assert not list(target.parent.glob(".*.tmp")), "no temp files left behind"


def test_named_sizes_and_vocabulary() -> None:
    assert SIZES["0.5B"].layer_ids() == [1, 7, 13, 19, 25] == SIZES["2B"].layer_ids()
    tokens, types, merges = synthetic_vocab(151936)
    assert len(tokens) == len(types) == 151936 and len(set(tokens)) == len(tokens)
    assert tokens[1] == "<|mask|>" and all(m.replace(" ", "") in tokens for m in merges)


def test_cli_options_without_scale_still_required() -> None:
    runner = CliRunner()
    res = runner.invoke(cli_main, ["bench", "--target", "t.gguf"])
    assert res.exit_code == 2 and "missing --draft, --prompts (required unless --scale)" in res.output
    res = runner.invoke(cli_main, ["bench", "--scale", "--draft", "d.gguf"])
    assert res.exit_code == 2 and "drop --draft" in res.output
    res = runner.invoke(cli_main, ["bench", "--scale", "--scale-sizes", "7B"])
    assert res.exit_code == 2 and "unknown size 7B" in res.output
