"""Unit checks of converter pieces: the GGUF header reader, exact conversions, the type policy."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from factories import gguf_tensors, make_checkpoint, make_target_gguf
from gguf import GGMLQuantizationType as Q
from gguf import GGUFReader

from dflash_convert import Options, convert
from dflash_convert.config import default_target_layer_ids
from dflash_convert.gguf_file import read_header
from dflash_convert.quantize import choose_type, encode_rows, exact_mismatch, parse_outtype
from dflash_convert.source import bf16_to_f32
from dflash_convert.tensor_map import Kind


def test_header_reader_matches_gguf_reader(tinycode: Path) -> None:
    path = tinycode / "target-f16.gguf"
    ours = read_header(path)
    ref = GGUFReader(path, "r")
    assert set(ours.fields) == {k for k in ref.fields if not k.startswith("GGUF.")}
    tokens = ref.fields["tokenizer.ggml.tokens"]
    assert [b.decode() for b in ours.fields["tokenizer.ggml.tokens"].value] == tokens.contents()
    assert ours.fields["tokenizer.ggml.token_type"].value == ref.fields["tokenizer.ggml.token_type"].contents()
    for t in ref.tensors:
        mine = ours.tensors[t.name]
        assert mine.qtype == Q(t.tensor_type)
        assert mine.ne == tuple(int(x) for x in t.shape.tolist())
        assert mine.offset == t.data_offset
        assert mine.nbytes == t.n_bytes


def test_header_reader_rejects_garbage(tmp_path: Path) -> None:
    from dflash_convert import ConversionError

    p = tmp_path / "x.gguf"
    p.write_bytes(b"GGUF" + b"\x03\x00\x00\x00" + b"\xff" * 16)
    with pytest.raises(ConversionError, match="x.gguf"):
        read_header(p)


def test_bf16_widening_is_exact() -> None:
    bits = np.arange(0, 1 << 16, dtype=np.uint16)
    f = bf16_to_f32(bits)
    assert np.array_equal(f.view(np.uint32) >> 16, bits.astype(np.uint32))


@pytest.mark.parametrize("qtype", [Q.F16, Q.BF16])
def test_exact_check_handles_special_values(qtype: Q) -> None:
    src = np.array(
        [[0.0, -0.0, 1e-7, -3e-6, 6e-8, 1e-30, 65504.0, 1.0 / 3.0, np.inf, -np.inf, 2.5e-5, 7.0]], np.float32
    )
    with np.errstate(over="ignore"):
        raw = encode_rows(src, qtype)
    assert exact_mismatch(raw, src, qtype) is None
    bad = raw.copy()
    bad[0, 4] ^= 1  # one bit of the subnormal 1e-7's encoding
    assert exact_mismatch(bad, src, qtype) is not None


def test_special_values_round_trip(tmp_path: Path) -> None:
    target = tmp_path / "t.gguf"
    make_target_gguf(target)
    special = np.zeros((64, 64), np.float32)
    special[0, :8] = [1e-7, -3e-6, 6e-8, 1e-30, 65504.0, -0.0, 2.5e-5, 1.0 / 3.0]
    src = make_checkpoint(tmp_path / "d", dtype="f32", extra={"layers.0.self_attn.q_proj.weight": special})
    for outtype, cast in (
        ("f16", lambda a: a.astype(np.float16).astype(np.float32)),
        ("bf16", None),
        ("f32", lambda a: a),
    ):
        out = tmp_path / f"o-{outtype}.gguf"
        convert(Options(draft_dir=tmp_path / "d", target=target, outfile=out, outtype=outtype, progress=False))
        got = gguf_tensors(out)["blk.0.attn_q.weight"].values
        want = src["layers.0.self_attn.q_proj.weight"]
        if cast is not None:
            np.testing.assert_array_equal(got, cast(want))
        else:
            from factories import round_to_bf16

            np.testing.assert_array_equal(got, round_to_bf16(want))


def test_default_target_layer_ids() -> None:
    assert default_target_layer_ids(36, 1) == [18]
    assert default_target_layer_ids(36, 5) == [1, 9, 17, 25, 33]
    assert default_target_layer_ids(8, 2) == [1, 5]


def test_type_policy() -> None:
    q4 = parse_outtype("Q4_0")
    assert choose_type(q4, Kind.NORM, (64,))[0] == Q.F32
    assert choose_type(q4, Kind.CONV_BASE, (2, 2, 64))[0] == Q.F32
    assert choose_type(q4, Kind.MATRIX, (64, 64))[0] == Q.Q4_0
    assert choose_type(q4, Kind.CODEBOOK, (512, 8))[0] == Q.F16  # 8 is not a multiple of 32
    km = parse_outtype("q4_K_M")
    assert km.kquant and choose_type(km, Kind.MATRIX, (256, 256))[0] == Q.F32  # libllama decides
    assert parse_outtype("Q4_K").name == "q4_k_m"


def test_bf16_to_f16_bits_equals_numpy_on_every_pattern() -> None:
    from dflash_convert.quantize import RangeError, bf16_bits_to_f16_bits

    bits = np.arange(0, 1 << 16, dtype=np.uint16)
    widened = bf16_to_f32(bits)
    mag = bits & 0x7FFF
    finite_overflow = (mag >= 0x4780) & (mag < 0x7F80)
    ok = bits[~finite_overflow]
    with np.errstate(over="ignore", invalid="ignore"):
        want = bf16_to_f32(ok).astype(np.float16).view(np.uint16)
    assert np.array_equal(bf16_bits_to_f16_bits(ok), want)
    assert np.isfinite(widened[finite_overflow]).all()
    with pytest.raises(RangeError, match="does not fit in F16"):
        bf16_bits_to_f16_bits(bits[finite_overflow][:3])
