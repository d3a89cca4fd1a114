"""`dflash info FILE [--json]`, run as a real subprocess of the installed console script."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from draft_gguf import write_draft_gguf

_BIN_DIR = Path(sys.executable).parent


def _dflash_exe() -> str:
    exe = _BIN_DIR / "dflash"
    if exe.exists():
        return str(exe)
    found = shutil.which("dflash")
    if not found:
        pytest.skip("the dflash console script is not installed")
    return found


def run_info(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [_dflash_exe(), "info", *args],
        capture_output=True,
        text=True,
        timeout=60,
        env={**os.environ, "PYTHONWARNINGS": "ignore"},
    )


def _by_type(tensors: dict[str, np.ndarray]) -> dict[str, int]:
    out: dict[str, int] = {}
    for arr in tensors.values():
        t = {np.dtype(np.float32): "f32", np.dtype(np.float16): "f16"}[arr.dtype]
        out[t] = out.get(t, 0) + 1
    return out


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    d = tmp_path_factory.mktemp("info")
    v2 = d / "v2-f16.gguf"
    t2 = write_draft_gguf(
        v2, version=2, dtype=np.float16, block_size=16, target_layers=(1, 3, 5), n_layer=3, mask_token_id=7, n_vocab=300
    )
    v1 = d / "v1.gguf"
    t1 = write_draft_gguf(v1, version=1, block_size=4, target_layers=(2, 5))
    return {"v2": (v2, t2), "v1": (v1, t1)}


def test_text_dflash2(files):
    path, tensors = files["v2"]
    r = run_info(str(path))
    assert r.returncode == 0, r.stderr
    out = r.stdout
    by_type = _by_type(tensors)
    lines = {ln.split("  ")[0].strip(): ln for ln in out.splitlines()}
    assert lines["DFlash version"].split()[-1] == "2"
    assert lines["block size"].split()[-1] == "16"
    assert "[1, 3, 5]" in lines["target layers"]
    assert lines["mask token"].split()[-1] == "7"
    assert "vocab 300" in lines["target hidden"]
    assert "kernel 2" in lines["conv"] and "group size 16" in lines["conv"]
    assert "rank 8" in lines["selector"] and "top-k 4" in lines["selector"]
    tl = lines["tensors"]
    assert tl.split()[1] == str(len(tensors)) == "51"
    # tensors by type: per layer 9 f16 matrices and 6 F32 norms / conv bases; fc + 3 selector
    # matrices in f16; the two global norms in F32
    assert by_type == {"f16": 3 * 9 + 4, "f32": 2 + 3 * 6}
    assert f"f16: {by_type['f16']} (" in tl and f"f32: {by_type['f32']} (" in tl
    assert str(path) in lines["file"]
    assert lines["draft cache"].endswith("0.38 KiB per context row (K and V in F16): 1.50 MiB for 4096 rows")
    assert r.stderr == ""


def test_cache_per_row_is_what_the_runtime_holds():
    """`dflash info`'s figure is the bytes per row of the drafter's cache that a saved context carries."""
    pytest.importorskip("llama_cpp", reason="llama-cpp-python is not installed")
    from tinycode import TARGET, drafter_gguf

    from dflash_gguf import SpeculativeLlama

    draft = drafter_gguf("q8_0")
    per_row = json.loads(run_info(str(draft), "--json").stdout)["cache_bytes_per_row"]
    llm = SpeculativeLlama(str(TARGET), str(draft), n_ctx=256, n_threads=1)
    llm.create_completion("def add(a, b):", max_tokens=8, temperature=0)
    state = llm.save_state()
    assert len(state.input_ids) > 0 and len(state.draft) == len(state.input_ids) * per_row
    llm.close()


def test_text_dflash1(files):
    path, tensors = files["v1"]
    r = run_info(str(path))
    assert r.returncode == 0, r.stderr
    assert "DFlash version  1" in r.stdout
    assert "block size      4" in r.stdout
    assert "target layers   [2, 5]" in r.stdout
    assert "conv " not in r.stdout and "selector" not in r.stdout
    assert f"tensors         {len(tensors)}  (f32: {len(tensors)} (" in r.stdout


def test_attention_variants_and_gelu(tmp_path):
    p = tmp_path / "swa.gguf"
    keys = {
        "dflash.attention.sliding_window": 512,
        "dflash.attention.sliding_window_pattern": [True, True, False],
        "dflash.hidden_activation": "gelu_pytorch_tanh",
        "dflash.attention.causal_layers": [True, True, False],
    }
    write_draft_gguf(p, n_layer=3, target_layers=(1, 3), key_overrides=keys)
    r = run_info(str(p))
    assert r.returncode == 0, r.stderr
    assert "sliding window  512 positions in layers [0, 1], the others attend to everything" in r.stdout
    assert "MLP activation  gelu_pytorch_tanh" in r.stdout
    assert "causal          layers [0, 1]: a block row attends to the rows before it, not after" in r.stdout
    s = json.loads(run_info(str(p), "--json").stdout)
    assert s["sliding_window"] == {"window": 512, "layers": [True, True, False]}
    # the sliding layers keep a ring of their last window + block + 256 positions (to 64 rows), the last
    # layer every row: K and V of 2 KV heads x 16 dimensions in F16 per row and layer
    rows = (512 + s["block_size"] + 256 + 63) // 64 * 64
    assert s["context_length"] > rows
    assert s["cache_bytes_per_row"] == 128 and s["cache_ring"] == {"rows": rows, "bytes": 2 * rows * 128}
    total = (128 * s["context_length"] + 2 * rows * 128) / 2**20
    assert (
        f"draft cache     0.12 KiB per context row (K and V in F16) + a ring of {rows} rows per sliding layer "
        f"(0.20 MiB): {total:.2f} MiB for {s['context_length']} rows\n"
        "                and up to 3 copies of the rings (0.20 MiB each) in host memory, of the last prompts' ends"
        in r.stdout
    )
    assert s["hidden_activation"] == "gelu_pytorch_tanh"
    assert s["causal_layers"] == [True, True, False]


@pytest.mark.parametrize("which", ["v1", "v2"])
def test_json_numbers_equal_what_was_written(files, which):
    path, tensors = files[which]
    r = run_info(str(path), "--json")
    assert r.returncode == 0, r.stderr
    s = json.loads(r.stdout)
    version = 2 if which == "v2" else 1
    expect = {
        "path": str(path),
        "dflash_version": version,
        "block_size": 16 if version == 2 else 4,
        "target_layers": [1, 3, 5] if version == 2 else [2, 5],
        "mask_token_id": 7 if version == 2 else 1,
        "n_layer": 3 if version == 2 else 2,
        "n_embd": 64,
        "n_head": 4,
        "n_head_kv": 2,
        "head_dim": 16,
        "n_ff": 128,
        "n_vocab": 300 if version == 2 else 256,
        "target_hidden": 64,
        "context_length": 4096,
        "embeds_target_head": False,
        "tensor_count": len(tensors),
        "tensors_by_type": _by_type(tensors),
        "tensor_bytes": sum(a.nbytes for a in tensors.values()),
        "file_size": path.stat().st_size,
        "cache_bytes_per_row": (3 if version == 2 else 2) * 2 * 2 * 16 * 2,  # layers x (K, V) x kv heads x dim x f16
    }
    assert {k: s[k] for k in expect} == expect
    assert s["rms_eps"] == pytest.approx(1e-6, rel=1e-6)
    assert s["rope_freq_base"] == pytest.approx(1e6)
    if version == 2:
        assert s["conv"] == {"kernel_size": 2, "group_size": 16}
        assert s["selector"] == {"rank": 8, "top_k": 4}
    else:
        assert "conv" not in s and "selector" not in s
    assert not {"sliding_window", "hidden_activation", "causal", "causal_layers"} & set(s)
    assert sum(s["bytes_by_type"].values()) == s["tensor_bytes"]


def _bad_files(d: Path) -> dict[str, tuple[Path, str]]:
    """name -> (file, a fragment the error line must contain)."""
    out: dict[str, tuple[Path, str]] = {}
    p = d / "random.gguf"
    p.write_bytes(np.random.default_rng(3).integers(0, 256, 1000, dtype=np.uint8).tobytes())
    out["random"] = (p, "not a GGUF file")
    p = d / "missing_key.gguf"
    write_draft_gguf(p, drop_keys=["dflash.block_size"])
    out["missing_key"] = (p, "key 'dflash.block_size' is missing")
    p = d / "bad_shape.gguf"
    write_draft_gguf(p, tensor_overrides={"blk.0.ffn_up.weight": np.zeros((64, 128), np.float32)})
    out["bad_shape"] = (p, "tensor 'blk.0.ffn_up.weight'")
    p = d / "truncated_data.gguf"
    full = d / "full.gguf"
    write_draft_gguf(full)
    p.write_bytes(full.read_bytes()[:-1])
    out["truncated_data"] = (p, "beyond the end of the file")
    out["nonexistent"] = (d / "nonexistent.gguf", "cannot open file")
    return out


@pytest.mark.parametrize("case", ["random", "missing_key", "bad_shape", "truncated_data", "nonexistent"])
def test_bad_file_exits_2_with_one_error_line(tmp_path, case):
    path, fragment = _bad_files(tmp_path)[case]
    for args in ((str(path),), (str(path), "--json")):
        r = run_info(*args)
        assert r.returncode == 2, (r.returncode, r.stdout, r.stderr)
        assert r.stdout == ""
        assert "Traceback" not in r.stderr
        lines = r.stderr.splitlines()
        assert lines == [lines[0]] and lines[0].startswith("dflash: error: "), r.stderr
        assert str(path) in lines[0] and fragment in lines[0], lines[0]


def test_header_truncated_file_prints_exactly_one_line(tmp_path):
    full = tmp_path / "full.gguf"
    write_draft_gguf(full)
    p = tmp_path / "truncated_header.gguf"
    p.write_bytes(full.read_bytes()[:5000])  # inside the tensor-info table
    r = run_info(str(p))
    assert r.returncode == 2
    assert "Traceback" not in r.stderr
    assert any(ln.startswith("dflash: error: ") and str(p) in ln for ln in r.stderr.splitlines()), r.stderr
    assert len(r.stderr.splitlines()) == 1, r.stderr
