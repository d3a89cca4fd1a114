"""Bad input: one test per validation rule, plus malformed safetensors and output-file safety.

Every failure must be one line ``dflash-convert: error: ...`` naming what and
where, exit status 2, no output file, and an existing output file untouched
(even with --force), with no temporary file left behind.
"""

from __future__ import annotations

import json
import struct
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from factories import make_checkpoint, make_target_gguf
from factories import run_convert_cli as run_cli

SENTINEL = b"an existing output file that must survive\n"


@pytest.fixture(scope="module")
def target(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("target") / "target.gguf"
    make_target_gguf(path)  # vocab 512, hidden 64, 4 layers
    return path


def expect_failure(
    capsys: pytest.CaptureFixture[str],
    draft: Path,
    target: Path,
    *fragments: str,
    extra_args: tuple[str, ...] = (),
    force: bool = True,
    outfile: Path | None = None,
) -> str:
    out = outfile or draft.parent / "out.gguf"
    if outfile is None:
        out.write_bytes(SENTINEL)
    args = [str(draft), "--target", str(target), "--outfile", str(out), "--no-progress", *extra_args]
    if force:
        args.append("--force")
    code, stdout, stderr = run_cli(args, capsys)
    assert code == 2, f"exit {code}\nstdout: {stdout}\nstderr: {stderr}"
    lines = [line for line in stderr.splitlines() if line.strip()]
    assert len(lines) == 1, stderr
    assert lines[0].startswith("dflash-convert: error: "), lines[0]
    for frag in fragments:
        assert frag in lines[0], f"{frag!r} not in {lines[0]!r}"
    if outfile is None:
        assert out.read_bytes() == SENTINEL
    leftovers = [p.name for p in out.parent.iterdir() if p.name.endswith(".tmp")]
    assert not leftovers, leftovers
    return lines[0]


def ckpt(tmp_path: Path, **kw: Any) -> Path:
    path = tmp_path / "drafter"
    make_checkpoint(path, **kw)
    return path


# ---------------------------------------------------------------- validation rules


def test_unknown_architecture(tmp_path: Path, target: Path, capsys: pytest.CaptureFixture[str]) -> None:
    d = ckpt(tmp_path, config_overrides={"architectures": ["Qwen3ForCausalLM"]})
    expect_failure(capsys, d, target, "config.json", "unknown architecture 'Qwen3ForCausalLM'")


def test_missing_tensor(tmp_path: Path, target: Path, capsys: pytest.CaptureFixture[str]) -> None:
    d = ckpt(tmp_path, extra={"layers.1.mlp.up_proj.weight": None})
    expect_failure(capsys, d, target, "missing tensor 'layers.1.mlp.up_proj.weight'", "(128, 64)")


def test_missing_dflash2_tensor(tmp_path: Path, target: Path, capsys: pytest.CaptureFixture[str]) -> None:
    d = ckpt(tmp_path, extra={"candidate_selector.successor_codebook": None})
    expect_failure(capsys, d, target, "missing tensor 'candidate_selector.successor_codebook'")


def test_wrong_shape(tmp_path: Path, target: Path, capsys: pytest.CaptureFixture[str]) -> None:
    d = ckpt(tmp_path, prefix="model.", extra={"layers.0.self_attn.q_proj.weight": np.zeros((48, 64), np.float32)})
    expect_failure(
        capsys,
        d,
        target,
        "model.safetensors",
        "'model.layers.0.self_attn.q_proj.weight'",
        "(48, 64)",
        "expected (64, 64)",
    )


def test_wrong_conv_base_shape(tmp_path: Path, target: Path, capsys: pytest.CaptureFixture[str]) -> None:
    d = ckpt(tmp_path, extra={"layers.1.mlp_conv.base_kernel": np.zeros((2, 3, 64), np.float32)})
    expect_failure(capsys, d, target, "'layers.1.mlp_conv.base_kernel'", "(2, 3, 64)", "expected (2, 2, 64)")


def test_unknown_tensor(tmp_path: Path, target: Path, capsys: pytest.CaptureFixture[str]) -> None:
    d = ckpt(tmp_path, extra={"mystery.weight": np.zeros((4, 4), np.float32)})
    expect_failure(capsys, d, target, "unknown tensor 'mystery.weight'", "--allow-extra")


def test_dflash2_tensor_in_dflash1(tmp_path: Path, target: Path, capsys: pytest.CaptureFixture[str]) -> None:
    d = ckpt(tmp_path, version=1, extra={"layers.0.mlp_conv.base_kernel": np.zeros((2, 2, 64), np.float32)})
    expect_failure(capsys, d, target, "unknown tensor 'layers.0.mlp_conv.base_kernel'", "DFlash2 tensor")


def test_allow_extra_skips_unknown(tmp_path: Path, target: Path, capsys: pytest.CaptureFixture[str]) -> None:
    d = ckpt(tmp_path, extra={"mystery.weight": np.zeros((4, 4), np.float32)})
    out = tmp_path / "out.gguf"
    code, stdout, stderr = run_cli(
        [str(d), "--target", str(target), "--outfile", str(out), "--allow-extra", "--no-progress"], capsys
    )
    assert code == 0, stderr
    assert "mystery.weight" in stdout  # reported as skipped
    from factories import gguf_tensors

    assert "mystery.weight" not in gguf_tensors(out)


def test_mask_token_outside_vocab(tmp_path: Path, target: Path, capsys: pytest.CaptureFixture[str]) -> None:
    d = ckpt(tmp_path, mask_token_id=512)
    expect_failure(capsys, d, target, "config.json", "mask_token_id' 512", "outside the vocabulary")


def test_target_layer_ids_outside_target(tmp_path: Path, target: Path, capsys: pytest.CaptureFixture[str]) -> None:
    # num_target_layers absent: only the target GGUF says how many layers there are (4)
    d = ckpt(tmp_path, target_layer_ids=(1, 4), config_overrides={"num_target_layers": None})
    expect_failure(capsys, d, target, "target_layer_ids [1, 4]", "ids [4]", "4 layers", "target.gguf")


def test_num_target_layers_disagrees_with_target(
    tmp_path: Path, target: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    d = ckpt(tmp_path, n_target_layers=6)
    expect_failure(capsys, d, target, "num_target_layers 6", "block_count 4")


def test_fc_input_width(tmp_path: Path, target: Path, capsys: pytest.CaptureFixture[str]) -> None:
    d = ckpt(tmp_path, target_hidden=48)  # fc is (64, 2 x 48) but the target's hidden is 64
    expect_failure(capsys, d, target, "'fc.weight'", "input width 96", "2 target layers", "target hidden 64", "128")


def test_vocab_differs_from_target(tmp_path: Path, target: Path, capsys: pytest.CaptureFixture[str]) -> None:
    d = ckpt(tmp_path, vocab=500)
    expect_failure(capsys, d, target, "vocab_size 500", "target vocabulary 512")


def test_hidden_differs_from_target(tmp_path: Path, target: Path, capsys: pytest.CaptureFixture[str]) -> None:
    d = ckpt(tmp_path, hidden=32, head_dim=8, target_hidden=64)
    expect_failure(capsys, d, target, "hidden_size 32", "embedding_length 64")


def test_dflash2_conv_group_must_divide_hidden(
    tmp_path: Path, target: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    d = ckpt(tmp_path, conv_group=24)
    expect_failure(capsys, d, target, "hidden_size % dflash_config.conv_group_size", "64", "24")


def test_dflash2_hidden_too_small_for_top_k(tmp_path: Path, target: Path, capsys: pytest.CaptureFixture[str]) -> None:
    d = ckpt(tmp_path, top_k=8)  # needs hidden >= 72
    expect_failure(capsys, d, target, "selector_top_k * (selector_top_k + 1) = 72", "hidden_size 64")


@pytest.mark.parametrize(
    "layer_types",
    [["sliding_attention"], ["sliding_attention", "linear_attention"], "sliding_attention"],
    ids=["too_few", "unknown_type", "not_a_list"],
)
def test_bad_layer_types(tmp_path: Path, target: Path, capsys: pytest.CaptureFixture[str], layer_types: Any) -> None:
    d = ckpt(tmp_path, config_overrides={"layer_types": layer_types})
    expect_failure(capsys, d, target, "config.json", "'layer_types' must list num_hidden_layers = 2 entries")


def test_sliding_window_without_layer_types(tmp_path: Path, target: Path, capsys: pytest.CaptureFixture[str]) -> None:
    d = ckpt(tmp_path, config_overrides={"use_sliding_window": True, "sliding_window": 64})
    expect_failure(capsys, d, target, "'sliding_window' is set but 'layer_types' (which layers slide) is missing")


def test_missing_dflash_config(tmp_path: Path, target: Path, capsys: pytest.CaptureFixture[str]) -> None:
    d = ckpt(tmp_path, config_overrides={"dflash_config": None})
    expect_failure(capsys, d, target, "config.json", "'dflash_config'")


def test_missing_dflash2_key(tmp_path: Path, target: Path, capsys: pytest.CaptureFixture[str]) -> None:
    d = ckpt(tmp_path, dflash_overrides={"selector_rank": None})
    expect_failure(capsys, d, target, "'dflash_config.selector_rank'")


def test_target_not_a_gguf(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    d = ckpt(tmp_path)
    bogus = tmp_path / "bogus.gguf"
    bogus.write_bytes(b"not a gguf at all")
    expect_failure(capsys, d, bogus, "bogus.gguf")


# ---------------------------------------------------------------- pickles


def test_pickle_refused(tmp_path: Path, target: Path, capsys: pytest.CaptureFixture[str]) -> None:
    import torch

    d = ckpt(tmp_path)
    state = {k: torch.zeros(1) for k in ("fc.weight",)}
    (d / "model.safetensors").unlink()
    torch.save(state, d / "pytorch_model.bin")
    expect_failure(capsys, d, target, "pytorch_model.bin", "refusing to unpickle", "--allow-pickle")


def test_allow_pickle_uses_weights_only(tmp_path: Path, target: Path, capsys: pytest.CaptureFixture[str]) -> None:
    import torch

    d = tmp_path / "drafter"
    src = make_checkpoint(d, dtype="f32")
    (d / "model.safetensors").unlink()
    torch.save({k: torch.from_numpy(v) for k, v in src.items()}, d / "pytorch_model.bin")
    out = tmp_path / "out.gguf"
    code, _, stderr = run_cli(
        [str(d), "--target", str(target), "--outfile", str(out), "--allow-pickle", "--outtype", "f32", "--no-progress"],
        capsys,
    )
    assert code == 0, stderr
    from factories import gguf_tensors

    np.testing.assert_array_equal(gguf_tensors(out)["fc.weight"].values, src["fc.weight"])

    # a pickle that is not plain tensors must be refused by weights_only=True
    class Evil:
        def __reduce__(self) -> tuple[Any, ...]:
            return (print, ("unpickled!",))

    torch.save({"fc.weight": Evil()}, d / "pytorch_model.bin")
    expect_failure(capsys, d, target, "pytorch_model.bin", "weights_only=True", extra_args=("--allow-pickle",))


# ---------------------------------------------------------------- malformed safetensors


def _read_st(path: Path) -> tuple[dict[str, Any], bytes]:
    raw = path.read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    return json.loads(raw[8 : 8 + n]), raw[8 + n :]


def _write_st(path: Path, header: dict[str, Any], data: bytes, *, length: int | None = None) -> None:
    blob = json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(blob) if length is None else length) + blob + data)


def _tensor_names(header: dict[str, Any]) -> list[str]:
    return sorted((k for k in header if k != "__metadata__"), key=lambda k: header[k]["data_offsets"][0])


def corrupt_header_too_long(path: Path) -> None:
    header, data = _read_st(path)
    _write_st(path, header, data, length=10**12)


def corrupt_header_past_eof(path: Path) -> None:
    header, data = _read_st(path)
    blob = json.dumps(header).encode()
    _write_st(path, header, data, length=len(blob) + len(data) + 1)


def corrupt_header_not_json(path: Path) -> None:
    _, data = _read_st(path)
    blob = b"{not json" + b" " * 10
    path.write_bytes(struct.pack("<Q", len(blob)) + blob + data)


def corrupt_overlap(path: Path) -> None:
    header, data = _read_st(path)
    a, b = _tensor_names(header)[:2]
    size_b = header[b]["data_offsets"][1] - header[b]["data_offsets"][0]
    start = header[a]["data_offsets"][0]
    header[b]["data_offsets"] = [start, start + size_b]
    header[b]["shape"] = [size_b // 2]
    _write_st(path, header, data)


def corrupt_out_of_range(path: Path) -> None:
    header, data = _read_st(path)
    last = _tensor_names(header)[-1]
    b, e = header[last]["data_offsets"]
    header[last]["data_offsets"] = [b + 64, e + 64]
    _write_st(path, header, data)


def corrupt_truncated(path: Path) -> None:
    raw = path.read_bytes()
    path.write_bytes(raw[:-100])


def corrupt_size_mismatch(path: Path) -> None:
    header, data = _read_st(path)
    name = _tensor_names(header)[0]
    header[name]["shape"] = [header[name]["shape"][0] * 2] + header[name]["shape"][1:]
    _write_st(path, header, data)


def corrupt_bad_dtype(path: Path) -> None:
    header, data = _read_st(path)
    name = _tensor_names(header)[0]
    header[name]["dtype"] = "I16"
    _write_st(path, header, data)


def corrupt_hole(path: Path) -> None:
    header, data = _read_st(path)
    names = _tensor_names(header)
    for name in names[1:]:
        b, e = header[name]["data_offsets"]
        header[name]["data_offsets"] = [b + 2, e + 2]
    _write_st(path, header, data + b"\0\0")


def corrupt_tiny_file(path: Path) -> None:
    path.write_bytes(b"\x01\x02")


CORRUPTIONS = {
    "header-length-huge": (corrupt_header_too_long, "header length"),
    "header-length-past-eof": (corrupt_header_past_eof, "runs past the end"),
    "header-not-json": (corrupt_header_not_json, "not valid UTF-8 JSON"),
    "overlapping-offsets": (corrupt_overlap, "overlap"),
    "out-of-range-offsets": (corrupt_out_of_range, "out of range"),
    "truncated-data": (corrupt_truncated, "out of range"),
    "size-mismatch": (corrupt_size_mismatch, "needs"),
    "bad-dtype": (corrupt_bad_dtype, "dtype I16"),
    "hole": (corrupt_hole, "hole"),
    "shorter-than-8-bytes": (corrupt_tiny_file, "shorter than the 8-byte header"),
}


@pytest.mark.parametrize("case", list(CORRUPTIONS))
@pytest.mark.parametrize("shards", [1, 2])
def test_malformed_safetensors(
    tmp_path: Path, target: Path, capsys: pytest.CaptureFixture[str], case: str, shards: int
) -> None:
    d = ckpt(tmp_path, shards=shards)
    victim = sorted(d.glob("*.safetensors"))[-1]
    corrupt, fragment = CORRUPTIONS[case]
    corrupt(victim)
    expect_failure(capsys, d, target, victim.name, fragment)


def test_index_names_missing_shard(tmp_path: Path, target: Path, capsys: pytest.CaptureFixture[str]) -> None:
    d = ckpt(tmp_path, shards=2)
    sorted(d.glob("*.safetensors"))[0].unlink()
    expect_failure(capsys, d, target, "model-00001-of-00002.safetensors", "does not exist")


def test_index_key_not_in_shard(tmp_path: Path, target: Path, capsys: pytest.CaptureFixture[str]) -> None:
    d = ckpt(tmp_path, shards=2)
    index = json.loads((d / "model.safetensors.index.json").read_text())
    index["weight_map"]["fc.weight"] = next(
        n for k, n in index["weight_map"].items() if n != index["weight_map"]["fc.weight"]
    )
    (d / "model.safetensors.index.json").write_text(json.dumps(index))
    expect_failure(capsys, d, target, "'fc.weight'", "not in this shard")


def test_no_weights(tmp_path: Path, target: Path, capsys: pytest.CaptureFixture[str]) -> None:
    d = ckpt(tmp_path)
    (d / "model.safetensors").unlink()
    expect_failure(capsys, d, target, "no weights found")


# ---------------------------------------------------------------- output safety


def test_refuses_to_overwrite_without_force(tmp_path: Path, target: Path, capsys: pytest.CaptureFixture[str]) -> None:
    d = ckpt(tmp_path)
    out = tmp_path / "exists.gguf"
    out.write_bytes(SENTINEL)
    expect_failure(capsys, d, target, "exists.gguf", "already exists", "--force", force=False, outfile=out)
    assert out.read_bytes() == SENTINEL


def test_force_overwrites(tmp_path: Path, target: Path, capsys: pytest.CaptureFixture[str]) -> None:
    d = ckpt(tmp_path)
    out = tmp_path / "exists.gguf"
    out.write_bytes(SENTINEL)
    code, _, stderr = run_cli(
        [str(d), "--target", str(target), "--outfile", str(out), "--force", "--no-progress"], capsys
    )
    assert code == 0, stderr
    assert out.read_bytes()[:4] == b"GGUF"


def test_refuses_output_equal_to_target(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    target = tmp_path / "target.gguf"
    make_target_gguf(target)
    before = target.read_bytes()
    d = ckpt(tmp_path)
    expect_failure(capsys, d, target, "is an input file", outfile=target)
    assert target.read_bytes() == before


def test_refuses_output_equal_to_checkpoint(tmp_path: Path, target: Path, capsys: pytest.CaptureFixture[str]) -> None:
    d = ckpt(tmp_path)
    st = d / "model.safetensors"
    before = st.read_bytes()
    expect_failure(capsys, d, target, "is an input file", outfile=st)
    assert st.read_bytes() == before


@pytest.mark.parametrize("dtype", ["f32", "bf16"])
def test_failure_while_writing_leaves_nothing(tmp_path: Path, capsys: pytest.CaptureFixture[str], dtype: str) -> None:
    """A value that does not fit F16 is found mid-write: the temp file goes, the old output stays."""
    target = tmp_path / "t.gguf"
    make_target_gguf(target)
    big = np.full((128, 64), 1.0e6, np.float32)
    d = ckpt(tmp_path, dtype=dtype, extra={"layers.1.mlp.up_proj.weight": big})
    expect_failure(
        capsys, d, target, "'layers.1.mlp.up_proj.weight'", "does not fit in F16", extra_args=("--outtype", "f16")
    )


@pytest.mark.parametrize(("outtype", "dtype"), [("q8_0", "f32"), ("f16", "f32"), ("bf16", "f32"), ("f16", "bf16")])
def test_failed_read_back_leaves_nothing(
    tmp_path: Path,
    target: Path,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
    outtype: str,
    dtype: str,
) -> None:
    """Corrupt one stored value on its way to disk: the read-back check must catch it."""
    from dflash_convert import writer

    calls = {"n": 0}

    def corrupting(real: Any) -> Any:
        def flip(*args: Any) -> np.ndarray:
            out = real(*args)
            calls["n"] += 1
            if calls["n"] == 1:  # the first chunk written: fc.weight
                out = out.copy()
                out.reshape(-1)[1] ^= 0x40 if out.dtype == np.uint8 else 0x4000
            return out

        return flip

    # the write path's converters (bf16 -> f16 works on bits; the rest through encode_rows)
    monkeypatch.setattr(writer, "encode_rows", corrupting(writer.encode_rows))
    monkeypatch.setattr(writer, "bf16_bits_to_f16_bits", corrupting(writer.bf16_bits_to_f16_bits))
    d = ckpt(tmp_path, dtype=dtype)  # f32 source: f16/bf16 are converted, not copied
    expect_failure(
        capsys, d, target, "out.gguf: read-back check failed", "'fc.weight'", extra_args=("--outtype", outtype)
    )


def test_unknown_outtype(tmp_path: Path, target: Path, capsys: pytest.CaptureFixture[str]) -> None:
    d = ckpt(tmp_path)
    expect_failure(capsys, d, target, "unknown type 'q3_k_xl'", "q4_k_m", extra_args=("--outtype", "q3_k_xl"))
