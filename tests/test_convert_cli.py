"""The dflash-convert command line: dry run, names, placeholders, optional metadata, --embed-target-head."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from factories import gguf_kv, gguf_tensors, make_checkpoint, make_target_gguf
from factories import run_convert_cli as run_cli


@pytest.fixture(scope="module")
def target(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("target") / "target.gguf"
    make_target_gguf(path)
    return path


def test_dry_run_prints_plan_and_writes_nothing(
    tmp_path: Path, target: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    d = tmp_path / "drafter"
    src = make_checkpoint(d, prefix="model.")
    before = sorted(p.name for p in tmp_path.rglob("*"))
    code, out, err = run_cli(
        [
            str(d),
            "--target",
            str(target),
            "--outtype",
            "q8_0",
            "--dry-run",
            "--outfile",
            str(tmp_path / "x-{ftype}.gguf"),
        ],
        capsys,
    )
    assert code == 0, err
    assert sorted(p.name for p in tmp_path.rglob("*")) == before
    assert "dry run: nothing written" in out
    # HF name -> GGUF name, shape, type, bytes
    assert any(
        line.split()[:6] == ["model.fc.weight", "->", "fc.weight", "64x128", "Q8_0", "8,704"]
        for line in out.splitlines()
    ), out
    assert any(
        line.split()[:5] == ["model.norm.weight", "->", "output_norm.weight", "64", "F32"] for line in out.splitlines()
    )
    assert any(
        line.split()[:5] == ["model.layers.1.attention_conv.base_kernel", "->", "blk.1.attn_conv_base", "2x2x64", "F32"]
        for line in out.splitlines()
    )
    # codebooks of rank 8: rows are not whole Q8_0 blocks -> F16
    assert any(
        line.split()[:5]
        == ["model.candidate_selector.predecessor_codebook", "->", "selector_predecessor.weight", "512x8", "F16"]
        for line in out.splitlines()
    )
    assert f"{len(src)} tensors" in out
    assert str(tmp_path / "x-q8_0.gguf") in out


def test_outtype_case_insensitive_and_ftype_placeholder(
    tmp_path: Path, target: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    d = tmp_path / "drafter"
    make_checkpoint(d)
    code, out, err = run_cli(
        [
            str(d),
            "--target",
            str(target),
            "--outtype",
            "Q5_0",
            "--outfile",
            str(tmp_path / "draft-{ftype}.gguf"),
            "--no-progress",
        ],
        capsys,
    )
    assert code == 0, err
    path = tmp_path / "draft-q5_0.gguf"
    assert path.is_file()
    assert gguf_tensors(path)["blk.0.ffn_up.weight"].type.name == "Q5_0"
    # the type chosen for each tensor is printed
    assert any(line.split() == ["blk.0.ffn_up.weight", "128x64", "Q5_0"] for line in out.splitlines()), out
    assert any(line.split() == ["blk.0.attn_norm.weight", "64", "F32"] for line in out.splitlines())
    assert gguf_kv(path)["general.file_type"][0] == 8  # MOSTLY_Q5_0
    assert oct(path.stat().st_mode & 0o777) != oct(0o600)


def test_default_outfile_in_cwd(
    tmp_path: Path, target: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    d = tmp_path / "my-drafter"
    make_checkpoint(d)
    work = tmp_path / "work"
    work.mkdir()
    monkeypatch.chdir(work)
    code, _, err = run_cli([str(d), "--target", str(target), "--no-progress"], capsys)
    assert code == 0, err
    assert (work / "my-drafter-f16.gguf").is_file()


def test_derived_target_layer_ids(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    target = tmp_path / "t8.gguf"
    make_target_gguf(target, n_layers=8)
    d = tmp_path / "drafter"
    make_checkpoint(d, n_target_layers=8, target_layer_ids=None)  # 2 draft layers: [1, round(1 + 4)] = [1, 5]
    out = tmp_path / "o.gguf"
    code, _, err = run_cli([str(d), "--target", str(target), "--outfile", str(out), "--no-progress"], capsys)
    assert code == 0, err
    assert gguf_kv(out)["dflash.target_layers"][0] == [2, 6]


def test_optional_metadata(tmp_path: Path, target: Path, capsys: pytest.CaptureFixture[str]) -> None:
    d = tmp_path / "drafter"
    make_checkpoint(
        d,
        dflash_overrides={
            "output_multiplier": 0.5,
            "final_logit_softcapping": 30.0,
            "input_embedding_scale": 2.0,
            "attention_value_scale": 0.25,
            "causal": True,
            "use_swa": True,
            "swa_window_size": 128,
        },
        config_overrides={
            "partial_rotary_factor": 0.5,
            "rope_scaling": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 1024},
        },
    )
    out = tmp_path / "o.gguf"
    code, _, err = run_cli([str(d), "--target", str(target), "--outfile", str(out), "--no-progress"], capsys)
    assert code == 0, err
    kv = gguf_kv(out)
    assert kv["dflash.logit_scale"] == (0.5, "FLOAT32", None)
    assert kv["dflash.final_logit_softcapping"] == (30.0, "FLOAT32", None)
    assert kv["dflash.embedding_scale"] == (2.0, "FLOAT32", None)
    assert kv["dflash.attention.value_scale"] == (0.25, "FLOAT32", None)
    assert kv["dflash.attention.causal"] == (True, "BOOL", None)
    assert kv["dflash.attention.sliding_window"] == (128, "UINT32", None)
    assert kv["dflash.attention.sliding_window_pattern"] == ([True, True], "ARRAY", "BOOL")
    assert kv["dflash.rope.dimension_count"] == (8, "UINT32", None)
    assert kv["dflash.rope.scaling.type"] == ("yarn", "STRING", None)
    assert kv["dflash.rope.scaling.factor"] == (4.0, "FLOAT32", None)
    assert kv["dflash.rope.scaling.original_context_length"] == (1024, "UINT32", None)


S, F = "sliding_attention", "full_attention"
# config.json -> (attention.causal, attention.causal_layers, attention.sliding_window, its pattern), None: absent.
# Causality follows z-lab's reference: config.is_causal if given, else sliding_attention layers are causal;
# the window follows transformers, which keeps sliding_window only with use_sliding_window.
ATTENTION_LAYOUTS = {
    # z-lab's Qwen3.6 drafters: slide and are causal in every layer but the last
    "qwen3.6": (
        {"use_sliding_window": True, "sliding_window": 64, "layer_types": [S, F]},
        (None, [True, False], 64, [True, False]),
    ),
    # the DFlash 2 release: every layer slides, is_causal false
    "dflash2_release": (
        {"use_sliding_window": True, "sliding_window": 64, "layer_types": [S, S], "is_causal": False},
        (False, None, 64, [True, True]),
    ),
    # every layer sliding_attention, no is_causal: all causal, which llama.cpp's key says too
    "all_sliding": (
        {"use_sliding_window": True, "sliding_window": 64, "layer_types": [S, S]},
        (True, None, 64, [True, True]),
    ),
    # layer types without use_sliding_window: transformers drops the window, the causal layers stay
    "types_only": ({"sliding_window": 64, "layer_types": [S, F]}, (None, [True, False], None, None)),
    "full_only": ({"layer_types": [F, F]}, (None, None, None, None)),
}


@pytest.mark.parametrize("layout", list(ATTENTION_LAYOUTS))
def test_attention_layout(tmp_path: Path, target: Path, capsys: pytest.CaptureFixture[str], layout: str) -> None:
    config, want = ATTENTION_LAYOUTS[layout]
    d = tmp_path / "drafter"
    make_checkpoint(d, config_overrides=config)
    out = tmp_path / "o.gguf"
    code, _, err = run_cli([str(d), "--target", str(target), "--outfile", str(out), "--no-progress"], capsys)
    assert code == 0, err
    kv = gguf_kv(out)
    keys = ("causal", "causal_layers", "sliding_window", "sliding_window_pattern")
    got = tuple(kv[f"dflash.attention.{k}"][0] if f"dflash.attention.{k}" in kv else None for k in keys)
    assert got == want


def test_muse_glimmer_assistant(tmp_path: Path, target: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Meta's Muse Glimmer assistant (its dflash settings at the top level, no vocab_size, bidirectional
    sliding layers without use_sliding_window, fc and hidden_norm named encoder.*) converts to the GGUF its
    DFlash-format twin does."""
    from safetensors.numpy import load_file, save_file

    twin = tmp_path / "drafter"
    sliding = {"use_sliding_window": True, "sliding_window": 64, "layer_types": [S, S], "is_causal": False}
    make_checkpoint(twin, version=1, dtype="f32", config_overrides=sliding)
    cfg = json.loads((twin / "config.json").read_text())
    dc = cfg.pop("dflash_config")
    for k in ("use_sliding_window", "is_causal", "vocab_size", "num_target_layers"):
        del cfg[k]
    cfg |= {k: dc[k] for k in ("block_size", "mask_token_id", "target_layer_ids")}
    cfg |= {"architectures": ["MuseGlimmerAssistantModel"], "model_type": "muse_glimmer_assistant"}
    assistant = tmp_path / "assistant"
    assistant.mkdir()
    (assistant / "config.json").write_text(json.dumps(cfg))
    renamed = {"fc.weight": "encoder.fc.weight", "hidden_norm.weight": "encoder.output_norm_enc.weight"}
    weights = load_file(twin / "model.safetensors")
    save_file({renamed.get(k, k): v for k, v in weights.items()}, assistant / "model.safetensors")

    files = {}
    for d in (twin, assistant):
        files[d] = tmp_path / f"{d.name}.gguf"
        args = [str(d), "--target", str(target), "--outfile", str(files[d]), "--no-progress"]
        code, _, err = run_cli(args, capsys)
        assert code == 0, err
    kv = {d: gguf_kv(f) for d, f in files.items()}
    assert kv[assistant].pop("general.name")[0] == "assistant"
    kv[twin].pop("general.name")
    assert kv[assistant] == kv[twin]
    assert kv[twin]["dflash.attention.sliding_window"][0] == 64 and kv[twin]["dflash.attention.causal"][0] is False
    t = {d: gguf_tensors(f) for d, f in files.items()}
    assert t[assistant].keys() == t[twin].keys()
    for name, a in t[assistant].items():
        assert a.type == t[twin][name].type and np.array_equal(a.raw, t[twin][name].raw), name


def test_embed_target_head(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    target = tmp_path / "t.gguf"
    tgt = make_target_gguf(target)
    d = tmp_path / "drafter"
    make_checkpoint(d)
    out = tmp_path / "o.gguf"
    code, _, err = run_cli(
        [
            str(d),
            "--target",
            str(target),
            "--outfile",
            str(out),
            "--outtype",
            "f32",
            "--embed-target-head",
            "--no-progress",
        ],
        capsys,
    )
    assert code == 0, err
    tensors = gguf_tensors(out)
    np.testing.assert_array_equal(tensors["token_embd.weight"].values, tgt["token_embd.weight"])
    np.testing.assert_array_equal(tensors["output.weight"].values, tgt["output.weight"])

    # a tied target has no output.weight: only the embedding is copied (upstream reuses it as the head)
    tied = tmp_path / "tied.gguf"
    tgt_tied = make_target_gguf(tied, tied_embeddings=True, seed=5)
    out2 = tmp_path / "o2.gguf"
    code, _, err = run_cli(
        [
            str(d),
            "--target",
            str(tied),
            "--outfile",
            str(out2),
            "--outtype",
            "q8_0",
            "--embed-target-head",
            "--no-progress",
        ],
        capsys,
    )
    assert code == 0, err
    tensors = gguf_tensors(out2)
    assert "output.weight" not in tensors
    assert tensors["token_embd.weight"].type.name == "Q8_0"
    err_rel = np.linalg.norm(tensors["token_embd.weight"].values - tgt_tied["token_embd.weight"]) / np.linalg.norm(
        tgt_tied["token_embd.weight"]
    )
    assert err_rel < 0.01


def test_embed_target_head_loads_in_libllama(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    llama_cpp = pytest.importorskip("llama_cpp")
    target = tmp_path / "t.gguf"
    make_target_gguf(target, dtype="f16")
    d = tmp_path / "drafter"
    make_checkpoint(d)
    out = tmp_path / "o.gguf"
    code, _, err = run_cli(
        [
            str(d),
            "--target",
            str(target),
            "--outfile",
            str(out),
            "--outtype",
            "f16",
            "--embed-target-head",
            "--no-progress",
        ],
        capsys,
    )
    assert code == 0, err
    llama_cpp.llama_backend_init()
    model = llama_cpp.llama_model_load_from_file(str(out).encode(), llama_cpp.llama_model_default_params())
    assert model
    llama_cpp.llama_model_free(model)


def test_console_script_process(tmp_path: Path, target: Path) -> None:
    """The real process: exit status 2 and one error line on bad input, 0 on success."""
    d = tmp_path / "drafter"
    make_checkpoint(d, mask_token_id=9999)
    env = dict(os.environ)
    root = Path(__file__).resolve().parent.parent
    env["PYTHONPATH"] = os.pathsep.join([str(root / "converter"), env.get("PYTHONPATH", "")])
    cmd = [
        sys.executable,
        "-m",
        "dflash_convert",
        str(d),
        "--target",
        str(target),
        "--outfile",
        str(tmp_path / "o.gguf"),
    ]
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=120)
    assert proc.returncode == 2
    assert proc.stderr.strip().startswith("dflash-convert: error: ")
    assert len(proc.stderr.strip().splitlines()) == 1
    assert not (tmp_path / "o.gguf").exists()

    make_checkpoint(d)
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert (tmp_path / "o.gguf").is_file()
