"""The C++ drafter GGUF loader (cpp/src/draft_model.cpp, cpp/src/gguf_keys.cpp), through Python.

Every accepted file must report exactly what was written; every broken file
must raise DFlashError (a ValueError) naming the file and the offending key or
tensor, from both `inspect_draft` (no data) and `load_draft` (weights loaded),
and leave the process alive. Truncated files also run in a child process, so
an abort inside ggml shows up as a failed test instead of killing pytest.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from draft_gguf import GGUFValueType as T
from draft_gguf import typed, write_draft_gguf
from gguf import GGUFReader

import dflash_gguf
from dflash_gguf import DFlashError

TARGET = Path(__file__).resolve().parent.parent / "examples" / "tinycode" / "target-f16.gguf"
TESTS_DIR = Path(__file__).resolve().parent

# defaults of write_draft_gguf, repeated so a builder change cannot silently change the tests
E, N_LAYER, N_HEAD, N_HEAD_KV, HEAD_DIM, N_FF, N_VOCAB = 64, 2, 4, 2, 16, 128, 256
N_TENSORS = {1: 3 + 11 * N_LAYER, 2: 3 + 15 * N_LAYER + 3}


def ne(shape: tuple[int, ...]) -> str:
    """numpy shape -> the loader's "{ne0, ne1, ...}" text (reversed order)."""
    return "{" + ", ".join(str(d) for d in reversed(shape)) + "}"


def expect_error(path: Path | str, *fragments: str, loaders: tuple = ("inspect", "load")) -> str:
    """Both loaders raise DFlashError naming `path` and every fragment; returns the message."""
    fns = {"inspect": dflash_gguf.inspect_draft, "load": dflash_gguf.load_draft}
    msgs = []
    for which in loaders:
        with pytest.raises(DFlashError) as ei:
            fns[which](str(path))
        msg = str(ei.value)
        assert isinstance(ei.value, ValueError)
        assert str(path) in msg, f"{which}: message does not name the file: {msg!r}"
        for f in fragments:
            assert f in msg, f"{which}: {f!r} not in {msg!r}"
        msgs.append(msg)
    assert len(set(msgs)) == 1, f"inspect and load disagree: {msgs}"
    return msgs[0]


@pytest.fixture
def draft(tmp_path):
    """write_draft_gguf into a fresh file; returns the path."""
    counter = iter(range(1000))

    def make(**kw: Any) -> Path:
        p = tmp_path / f"draft{next(counter)}.gguf"
        write_draft_gguf(p, **kw)
        return p

    return make


# ----------------------------------------------------------------------------
# valid files
# ----------------------------------------------------------------------------


@pytest.mark.parametrize("version", [1, 2])
@pytest.mark.parametrize("fn", ["inspect_draft", "load_draft"])
def test_valid_draft_reports_what_was_written(tmp_path, version, fn):
    p = tmp_path / f"v{version}.gguf"
    written = write_draft_gguf(p, version=version)
    info = getattr(dflash_gguf, fn)(str(p))

    assert info["path"] == str(p)
    assert info["file_size"] == p.stat().st_size
    assert info["gguf_version"] == 3
    hp = info["hparams"]
    assert hp["version"] == version
    expect = {
        "context_length": 4096,
        "n_embd": E,
        "n_layer": N_LAYER,
        "n_ff": N_FF,
        "n_head": N_HEAD,
        "n_head_kv": N_HEAD_KV,
        "head_dim": HEAD_DIM,
        "n_rot": HEAD_DIM,
        "block_size": 8,
        "target_layers": [2, 4],
        "mask_token_id": 1,
        "n_vocab": N_VOCAB,
        "target_hidden": 64,
        "causal": False,
        "logit_scale": 0.0,
        "embedding_scale": 0.0,
    }
    if version == 2:
        expect |= {"conv_kernel_size": 2, "conv_group_size": 16, "selector_rank": 8, "selector_top_k": 4}
    else:
        expect |= {"conv_kernel_size": 0, "conv_group_size": 0, "selector_rank": 0, "selector_top_k": 0}
    assert {k: hp[k] for k in expect} == expect
    assert hp["rms_eps"] == pytest.approx(1e-6, rel=1e-6)
    assert hp["rope_freq_base"] == pytest.approx(1e6)

    assert len(info["tensors"]) == N_TENSORS[version] == len(written)
    assert [t["name"] for t in info["tensors"]] == list(written)
    for t in info["tensors"]:
        arr = written[t["name"]]
        assert t["ne"] == list(reversed(arr.shape)), t["name"]
        assert t["type"] == "f32", t["name"]
        assert t["nbytes"] == arr.nbytes, t["name"]
    names = {t["name"] for t in info["tensors"]}
    assert ("selector_hidden.weight" in names) == (version == 2)
    assert ("blk.1.ffn_conv_base" in names) == (version == 2)
    assert not info["has_token_embd"] and not info["has_output"]
    assert info["meta"]["general.architecture"] == "dflash"


def test_valid_f16_matrices_and_other_hparams(draft):
    """F16 matrices, 3 target layers, block 16, 3 draft layers, top_k at its limit (72 = 8*9)."""
    p = draft(
        version=2,
        dtype=np.float16,
        n_embd=72,
        n_head=6,
        n_head_kv=3,
        head_dim=12,
        n_ff=96,
        n_layer=3,
        target_layers=(1, 3, 5),
        target_hidden=40,
        block_size=16,
        top_k=8,
        rank=4,
        conv_kernel=3,
        conv_group=8,
        mask_token_id=N_VOCAB - 1,
    )
    info = dflash_gguf.load_draft(str(p))
    hp = info["hparams"]
    assert (hp["n_embd"], hp["n_layer"], hp["n_head"], hp["n_head_kv"], hp["head_dim"]) == (72, 3, 6, 3, 12)
    assert hp["target_layers"] == [1, 3, 5] and hp["target_hidden"] == 40
    assert (hp["block_size"], hp["selector_top_k"], hp["selector_rank"]) == (16, 8, 4)
    assert (hp["conv_kernel_size"], hp["conv_group_size"]) == (3, 8)
    assert hp["mask_token_id"] == N_VOCAB - 1
    types = {t["name"]: t["type"] for t in info["tensors"]}
    assert len(types) == 3 + 15 * 3 + 3
    assert types["fc.weight"] == "f16" and types["blk.2.attn_conv_proj.weight"] == "f16"
    assert types["blk.2.attn_norm.weight"] == "f32" and types["blk.0.ffn_conv_base"] == "f32"
    conv = {t["name"]: t["ne"] for t in info["tensors"]}
    assert conv["blk.1.attn_conv_base"] == [72, 3, 2]
    assert conv["blk.1.attn_conv_proj.weight"] == [72, 2 * 3 * (72 // 8)]
    assert conv["fc.weight"] == [3 * 40, 72]


@pytest.mark.parametrize("block_size", [2, 32])
def test_block_size_limits_accepted(draft, block_size):
    p = draft(version=1, block_size=block_size)
    assert dflash_gguf.inspect_draft(str(p))["hparams"]["block_size"] == block_size


def test_vocab_unknown_is_accepted_and_reported_as_zero(draft):
    """Without tokenizer tokens or vocab-sized tensors the vocabulary comes from the target later."""
    p = draft(version=1, drop_keys=["tokenizer.ggml.tokens"], mask_token_id=5000)
    hp = dflash_gguf.inspect_draft(str(p))["hparams"]
    assert hp["n_vocab"] == 0 and hp["mask_token_id"] == 5000


def test_vocab_from_selector_codebooks_when_no_tokens(draft):
    p = draft(version=2, drop_keys=["tokenizer.ggml.tokens"], n_vocab=300)
    assert dflash_gguf.inspect_draft(str(p))["hparams"]["n_vocab"] == 300


def test_embedded_target_head_is_reported(draft):
    p = draft(
        version=1,
        extra_tensors={
            "token_embd.weight": np.zeros((N_VOCAB, E), np.float16),
            "output.weight": np.zeros((N_VOCAB, E), np.float16),
        },
    )
    info = dflash_gguf.load_draft(str(p))
    assert info["has_token_embd"] and info["has_output"]
    assert len(info["tensors"]) == N_TENSORS[1] + 2


# ----------------------------------------------------------------------------
# not a GGUF at all
# ----------------------------------------------------------------------------


def test_random_bytes(tmp_path):
    p = tmp_path / "random.gguf"
    data = np.random.default_rng(1).integers(0, 256, 4096, dtype=np.uint8).tobytes()
    assert data[:4] != b"GGUF"
    p.write_bytes(data)
    expect_error(p, "not a GGUF file", "magic", "4096 bytes")


def test_empty_file(tmp_path):
    p = tmp_path / "empty.gguf"
    p.write_bytes(b"")
    expect_error(p, "not a GGUF file", "0 bytes")


def test_text_file(tmp_path):
    p = tmp_path / "notes.gguf"
    p.write_text("general.architecture = dflash\nthis is a text file, not a GGUF\n")
    expect_error(p, "not a GGUF file")


def test_magic_then_garbage(tmp_path):
    p = tmp_path / "garbage.gguf"
    p.write_bytes(b"GGUF" + np.random.default_rng(2).integers(0, 256, 100, dtype=np.uint8).tobytes())
    expect_error(p, "malformed or truncated")


def test_missing_file(tmp_path):
    expect_error(tmp_path / "nope.gguf", "cannot open file", "No such file")


# ----------------------------------------------------------------------------
# truncated files (in a child process first: an abort must not take pytest down)
# ----------------------------------------------------------------------------

_CHILD = r"""
import json, sys
import dflash_gguf
out = {}
for fn in ("inspect_draft", "load_draft"):
    try:
        getattr(dflash_gguf, fn)(sys.argv[1])
    except dflash_gguf.DFlashError as e:
        out[fn] = str(e)
    else:
        print("NO ERROR from " + fn)
        sys.exit(3)
print("RESULT " + json.dumps(out))
"""


@pytest.fixture(scope="module")
def full_v2(tmp_path_factory):
    """A valid DFlash2 file and its layout (where metadata, tensor infos and data start)."""
    p = tmp_path_factory.mktemp("full") / "full.gguf"
    write_draft_gguf(p, version=2)
    r = GGUFReader(str(p))
    kv_offsets = sorted(f.offset for name, f in r.fields.items() if not name.startswith("GGUF."))
    tok = r.fields["tokenizer.ggml.tokens"]
    layout = {
        "size": p.stat().st_size,
        "kv_start": kv_offsets[0],
        "tokens_mid": tok.offset + 200,  # inside the 256-string token array
        "ti_start": min(t.field.offset for t in r.tensors),
        "data_start": r.data_offset,
        "tensors": [(t.name, int(t.data_offset), int(t.n_bytes)) for t in r.tensors],
    }
    last = layout["tensors"][-1]
    assert last[1] + last[2] == layout["size"], "builder must end the file at the last tensor's data"
    assert layout["kv_start"] == 24 < layout["tokens_mid"] < layout["ti_start"] < layout["data_start"]
    return p, layout


def _truncation_cases(layout: dict) -> dict[str, tuple[int, tuple[str, ...]]]:
    tensors = layout["tensors"]
    name3, off3, nb3 = tensors[3]
    mid3 = off3 + nb3 // 2
    last_name = tensors[-1][0]
    return {
        "3_bytes": (3, ("not a GGUF file", "3 bytes")),
        "10_bytes": (10, ("malformed or truncated", "10 bytes")),
        "end_of_header": (24, ("malformed or truncated",)),
        "mid_metadata": (layout["tokens_mid"], ("malformed or truncated",)),
        "mid_tensor_info": ((layout["ti_start"] + layout["data_start"]) // 2, ("malformed or truncated",)),
        "before_data": (layout["data_start"], ("'fc.weight'", "beyond the end of the file")),
        "mid_tensor_data": (mid3, (f"'{name3}'", "beyond the end of the file", f"({mid3} bytes)")),
        "one_byte_short": (layout["size"] - 1, (f"'{last_name}'", "beyond the end of the file")),
    }


TRUNCATIONS = [
    "3_bytes",
    "10_bytes",
    "end_of_header",
    "mid_metadata",
    "mid_tensor_info",
    "before_data",
    "mid_tensor_data",
    "one_byte_short",
]


@pytest.mark.parametrize("case", TRUNCATIONS)
def test_truncated(tmp_path, full_v2, case):
    src, layout = full_v2
    n, fragments = _truncation_cases(layout)[case]
    p = tmp_path / f"trunc_{case}.gguf"
    p.write_bytes(src.read_bytes()[:n])
    assert p.stat().st_size == n

    child = subprocess.run(
        [sys.executable, "-c", _CHILD, str(p)],
        capture_output=True,
        text=True,
        timeout=60,
        env={**os.environ, "PYTHONPATH": str(TESTS_DIR)},
    )
    assert child.returncode == 0, (
        f"child died or did not raise (rc {child.returncode}):\n{child.stdout}\n{child.stderr}"
    )
    line = [ln for ln in child.stdout.splitlines() if ln.startswith("RESULT ")]
    assert len(line) == 1, child.stdout
    msgs = json.loads(line[0][len("RESULT ") :])
    for fn in ("inspect_draft", "load_draft"):
        assert str(p) in msgs[fn]
        for f in fragments:
            assert f in msgs[fn], (fn, f, msgs[fn])
    assert "Traceback" not in child.stderr

    # and in this process too (the child proved it does not abort)
    expect_error(p, *fragments)


# ----------------------------------------------------------------------------
# keys
# ----------------------------------------------------------------------------

REQUIRED_KEYS = [
    (2, "general.architecture"),
    (1, "dflash.context_length"),
    (2, "dflash.embedding_length"),
    (1, "dflash.block_count"),
    (2, "dflash.feed_forward_length"),
    (1, "dflash.attention.head_count"),
    (2, "dflash.attention.head_count_kv"),
    (1, "dflash.attention.layer_norm_rms_epsilon"),
    (1, "dflash.block_size"),
    (2, "dflash.block_size"),
    (1, "dflash.target_layers"),
    (2, "dflash.target_layers"),
    (1, "tokenizer.ggml.mask_token_id"),
    (2, "tokenizer.ggml.mask_token_id"),
    (2, "dflash.selector_top_k"),
    (2, "dflash.selector_rank"),
    (2, "dflash.conv_kernel_size"),
    (2, "dflash.conv_group_size"),
]


@pytest.mark.parametrize("version,key", REQUIRED_KEYS, ids=[f"v{v}-{k}" for v, k in REQUIRED_KEYS])
def test_missing_required_key(draft, version, key):
    p = draft(version=version, drop_keys=[key])
    expect_error(p, f"key '{key}'", "missing")


def test_dflash2_marked_only_by_its_tensors_still_needs_its_keys(draft):
    """No conv/selector keys at all, but the selector tensors are there: DFlash2, keys missing."""
    p = draft(version=2, drop_keys=["dflash.conv_kernel_size", "dflash.selector_top_k"])
    expect_error(p, "key 'dflash.conv_kernel_size'", "missing")


WRONG_TYPES = {
    "block_size_string": ("dflash.block_size", typed(T.STRING, "8"), "expected an integer, found string"),
    "embedding_length_float": ("dflash.embedding_length", typed(T.FLOAT32, 64.0), "expected an integer, found f32"),
    "block_count_bool": ("dflash.block_count", typed(T.BOOL, True), "expected an integer, found bool"),
    "mask_token_string": ("tokenizer.ggml.mask_token_id", typed(T.STRING, "1"), "expected an integer, found string"),
    "top_k_array": ("dflash.selector_top_k", typed(T.ARRAY, [4], T.UINT32), "expected an integer, found array"),
    "target_layers_float": ("dflash.target_layers", typed(T.FLOAT32, 2.0), "expected an array of integers, found f32"),
    "target_layers_int": ("dflash.target_layers", typed(T.UINT32, 2), "expected an array of integers, found u32"),
    "target_layers_float_array": (
        "dflash.target_layers",
        typed(T.ARRAY, [2.0, 4.0], T.FLOAT32),
        "found an array of f32",
    ),
    "target_layers_string_array": (
        "dflash.target_layers",
        typed(T.ARRAY, ["2", "4"], T.STRING),
        "found an array of string",
    ),
    "rms_eps_int": ("dflash.attention.layer_norm_rms_epsilon", typed(T.UINT32, 1), "expected a float (f32), found u32"),
    "rope_base_string": ("dflash.rope.freq_base", typed(T.STRING, "1e6"), "expected a float (f32), found string"),
    "architecture_int": ("general.architecture", typed(T.UINT32, 7), "expected a string, found u32"),
    "architecture_array": (
        "general.architecture",
        typed(T.ARRAY, ["dflash"], T.STRING),
        "expected a string, found array",
    ),
    "causal_int": ("dflash.attention.causal", typed(T.INT32, 1), "expected a bool, found i32"),
    "tokens_string": ("tokenizer.ggml.tokens", typed(T.STRING, "abc"), "expected an array, found string"),
}


@pytest.mark.parametrize("case", list(WRONG_TYPES))
def test_key_of_wrong_type(draft, case):
    key, value, fragment = WRONG_TYPES[case]
    p = draft(version=2, key_overrides={key: value})
    expect_error(p, f"key '{key}'", fragment)


BAD_VALUES = {
    "target_layers_decreasing": ("dflash.target_layers", [4, 2], "strictly increasing"),
    "target_layers_zero": ("dflash.target_layers", [0, 4], "element 0 = 0 is out of range"),
    "target_layers_u64_huge": ("dflash.target_layers", typed(T.ARRAY, [2**63 + 5], T.UINT64), "out of range"),
    "block_size_u64_huge": ("dflash.block_size", typed(T.UINT64, 2**64 - 1), "> 2^63 is out of range"),
    "block_size_negative": ("dflash.block_size", typed(T.INT8, -3), "value -3 is out of range"),
    "rms_eps_nan": ("dflash.attention.layer_norm_rms_epsilon", float("nan"), "not finite"),
    "rms_eps_zero": ("dflash.attention.layer_norm_rms_epsilon", 0.0, "expected a value in (0, 1)"),
    "value_length_differs": ("dflash.attention.value_length", 32, "expected 16 (= key_length), found 32"),
    "mask_token_negative": ("tokenizer.ggml.mask_token_id", typed(T.INT32, -1), "value -1 is out of range"),
    "rope_scaling_yarn": ("dflash.rope.scaling.type", "yarn", 'only "linear" and "none"'),
}


@pytest.mark.parametrize("case", list(BAD_VALUES))
def test_key_with_bad_value(draft, case):
    key, value, fragment = BAD_VALUES[case]
    p = draft(version=2, key_overrides={key: value})
    expect_error(p, f"key '{key}'", fragment)


@pytest.mark.parametrize("act", ["silu", "gelu", "gelu_pytorch_tanh"])
def test_hidden_activation_read(draft, act):
    p = draft(version=2, key_overrides={"dflash.hidden_activation": act})
    assert dflash_gguf.inspect_draft(str(p))["hparams"]["hidden_activation"] == act
    assert dflash_gguf.inspect_draft(str(draft(version=2)))["hparams"]["hidden_activation"] == "silu"


def test_hidden_activation_unknown(draft):
    p = draft(version=2, key_overrides={"dflash.hidden_activation": "relu"})
    expect_error(p, "key 'dflash.hidden_activation'", 'expected "silu", "gelu" or "gelu_pytorch_tanh", found "relu"')


SWA = "dflash.attention.sliding_window"
SWA_PATTERN = "dflash.attention.sliding_window_pattern"


@pytest.mark.parametrize(
    "pattern",
    [[True, False], typed(T.ARRAY, [1, 0], T.INT32), typed(T.ARRAY, [1, 0], T.UINT8)],
    ids=["bool", "i32", "u8"],
)
def test_sliding_window_read(draft, pattern):
    # llama.cpp's writers store the pattern as bools or as integers; both read as flags
    p = draft(version=2, key_overrides={SWA: 512, SWA_PATTERN: pattern})
    hp = dflash_gguf.inspect_draft(str(p))["hparams"]
    assert (hp["sliding_window"], hp["sliding_window_layers"]) == (512, [True, False])
    hp = dflash_gguf.inspect_draft(str(draft(version=2)))["hparams"]
    assert (hp["sliding_window"], hp["sliding_window_layers"]) == (0, [])


def test_sliding_window_without_pattern(draft):
    p = draft(version=2, key_overrides={SWA: 512})
    expect_error(p, f"key '{SWA_PATTERN}'", "missing", "sliding_window = 512")


def test_causal_layers(draft):
    p = draft(version=2, key_overrides={"dflash.attention.causal_layers": [True, False]})
    assert dflash_gguf.inspect_draft(str(p))["hparams"]["causal_layers"] == [True, False]
    p = draft(version=2, key_overrides={"dflash.attention.causal_layers": [True]})
    expect_error(p, "key 'dflash.attention.causal_layers'", f"expected {N_LAYER} flags (block_count), found 1")


@pytest.mark.parametrize(
    ("pattern", "fragment"),
    [
        ([True], f"expected {N_LAYER} flags (block_count), found 1"),
        ([True, False, True], f"expected {N_LAYER} flags (block_count), found 3"),
        (typed(T.ARRAY, [1, 2], T.INT32), "element 1 = 2 is out of range"),
        (
            typed(T.ARRAY, [0.5, 1.0], T.FLOAT32),
            "expected an array of bools (or of integers 0 / 1), found an array of f32",
        ),
        (typed(T.UINT32, 1), "expected an array of bools (or of integers 0 / 1), found u32"),
    ],
)
def test_sliding_window_pattern_bad(draft, pattern, fragment):
    p = draft(version=2, key_overrides={SWA: 512, SWA_PATTERN: pattern})
    expect_error(p, f"key '{SWA_PATTERN}'", fragment)


def test_odd_head_dim(draft):
    p = draft(version=1, key_overrides={"dflash.attention.key_length": 15, "dflash.attention.value_length": 15})
    expect_error(p, "key 'dflash.attention.key_length'", "must be even for RoPE, found 15")


@pytest.mark.parametrize("arch", ["llama", "DFlash", "dflash2", ""])
def test_wrong_architecture(draft, arch):
    p = draft(key_overrides={"general.architecture": typed(T.STRING, arch)})
    expect_error(p, "key 'general.architecture'", 'expected "dflash"', f'found "{arch}"')


@pytest.mark.parametrize("value", [0, 100000, 2**31])
def test_absurd_layer_count(draft, value):
    p = draft(key_overrides={"dflash.block_count": value})
    expect_error(p, "key 'dflash.block_count'", f"value {value} is out of range", "1..256")


@pytest.mark.parametrize("value", [0, 1, 33, 2**31])
def test_bad_block_size(draft, value):
    p = draft(version=1, key_overrides={"dflash.block_size": value})
    expect_error(p, "key 'dflash.block_size'", f"value {value} is out of range", "2..32")


@pytest.mark.parametrize(
    "key",
    ["dflash.embedding_length", "dflash.feed_forward_length", "dflash.attention.head_count", "dflash.context_length"],
)
def test_absurd_size(draft, key):
    p = draft(version=1, key_overrides={key: 2**32 - 1})
    expect_error(p, f"key '{key}'", f"value {2**32 - 1} is out of range")


@pytest.mark.parametrize("top_k", [8, 100])
def test_dflash2_embd_smaller_than_top_k_lattice(draft, top_k):
    p = draft(version=2, key_overrides={"dflash.selector_top_k": top_k})
    need = top_k * (top_k + 1)
    expect_error(p, "key 'dflash.selector_top_k'", f"top_k*(top_k+1) = {need}", f"embedding_length {E}")


@pytest.mark.parametrize("group", [24, 48, 7])
def test_conv_group_not_dividing_embd(draft, group):
    p = draft(version=2, key_overrides={"dflash.conv_group_size": group})
    expect_error(p, "key 'dflash.conv_group_size'", f"{group} must divide embedding_length = {E}")


def test_conv_group_larger_than_embd(draft):
    p = draft(version=2, key_overrides={"dflash.conv_group_size": 128})
    expect_error(p, "key 'dflash.conv_group_size'", "value 128 is out of range", f"1..{E}")


@pytest.mark.parametrize("version", [1, 2])
@pytest.mark.parametrize("mask", [N_VOCAB, N_VOCAB + 1000])
def test_mask_token_outside_vocab(draft, version, mask):
    p = draft(version=version, mask_token_id=mask)
    expect_error(p, "key 'tokenizer.ggml.mask_token_id'", f"{mask} is outside the vocabulary ({N_VOCAB} tokens)")


@pytest.mark.parametrize("n_head_kv", [3, 8])
def test_head_count_not_divisible_by_kv_heads(draft, n_head_kv):
    p = draft(version=1, key_overrides={"dflash.attention.head_count_kv": n_head_kv})
    expect_error(p, "key 'dflash.attention.head_count_kv'", f"{n_head_kv} must divide attention.head_count = 4")


# ----------------------------------------------------------------------------
# tensors
# ----------------------------------------------------------------------------

MISSING_TENSORS = [
    (1, "blk.1.attn_q.weight", (N_HEAD * HEAD_DIM, E)),
    (2, "blk.0.attn_k_norm.weight", (HEAD_DIM,)),
    (1, "blk.0.ffn_down.weight", (E, N_FF)),
    (2, "enc.output_norm.weight", (E,)),
    (1, "output_norm.weight", (E,)),
    (2, "selector_predecessor.weight", (N_VOCAB, 8)),
    (2, "selector_successor.weight", (N_VOCAB, 8)),
    (2, "selector_hidden.weight", (8, E)),
    (2, "blk.1.attn_conv_base", (2, 2, E)),
    (2, "blk.0.ffn_conv_proj.weight", (2 * 2 * (E // 16), E)),
]


@pytest.mark.parametrize("version,name,shape", MISSING_TENSORS, ids=[f"v{v}-{n}" for v, n, _ in MISSING_TENSORS])
def test_missing_tensor(draft, version, name, shape):
    p = draft(version=version, drop_tensors=[name])
    expect_error(p, f"tensor '{name}' is missing", f"expected shape (ggml ne) {ne(shape)}")


@pytest.mark.parametrize("version", [1, 2])
def test_missing_fc(draft, version):
    p = draft(version=version, drop_tensors=["fc.weight"])
    expect_error(p, "tensor 'fc.weight' is missing")


WRONG_SHAPES = {
    "ffn_gate_transposed": ("blk.0.ffn_gate.weight", (E, N_FF), (N_FF, E)),
    "attn_k_as_q": ("blk.1.attn_k.weight", (N_HEAD * HEAD_DIM, E), (N_HEAD_KV * HEAD_DIM, E)),
    "norm_too_long": ("blk.1.ffn_norm.weight", (E + 1,), (E,)),
    "q_norm_too_long": ("blk.0.attn_q_norm.weight", (2 * HEAD_DIM,), (HEAD_DIM,)),
    "norm_3d": ("output_norm.weight", (2, 1, E), (E,)),
    "conv_base_kernel_3": ("blk.0.attn_conv_base", (2, 3, E), (2, 2, E)),
    "conv_proj_rows": ("blk.1.ffn_conv_proj.weight", (2 * 2 * 8, E), (2 * 2 * 4, E)),
    "codebook_short_vocab": ("selector_successor.weight", (N_VOCAB - 1, 8), (N_VOCAB, 8)),
    "codebook_rank": ("selector_predecessor.weight", (N_VOCAB, 4), (N_VOCAB, 8)),
    "fc_1d": ("fc.weight", (128,), (E, 128)),
    "fc_rows": ("fc.weight", (E + 8, 128), (E, 128)),
}


@pytest.mark.parametrize("case", list(WRONG_SHAPES))
def test_tensor_of_wrong_shape(draft, case):
    name, bad, good = WRONG_SHAPES[case]
    p = draft(version=2, tensor_overrides={name: np.zeros(bad, np.float32)})
    expect_error(p, f"tensor '{name}'", f"expected shape (ggml ne) {ne(good)}", f"found {ne(bad)}")


def test_fc_width_not_multiple_of_target_layers(draft):
    p = draft(version=2, tensor_overrides={"fc.weight": np.zeros((E, 127), np.float32)})
    expect_error(p, "tensor 'fc.weight'", "input width 127", "number of target layers (2)")


WRONG_TYPES_T = {
    "f16_norm": ("output_norm.weight", (E,), np.float16, "type f16 is not allowed", "must be F32"),
    "f16_q_norm": ("blk.1.attn_q_norm.weight", (HEAD_DIM,), np.float16, "type f16 is not allowed", "must be F32"),
    "f16_conv_base": ("blk.0.ffn_conv_base", (2, 2, E), np.float16, "type f16 is not allowed", "must be F32"),
    "i32_matrix": (
        "blk.0.attn_v.weight",
        (N_HEAD_KV * HEAD_DIM, E),
        np.int32,
        "type i32 is not allowed",
        "expected F32/F16/BF16",
    ),
    "f64_fc": ("fc.weight", (E, 128), np.float64, "type f64 is not allowed", "expected F32/F16/BF16"),
}


@pytest.mark.parametrize("case", list(WRONG_TYPES_T))
def test_tensor_of_wrong_type(draft, case):
    name, shape, dtype, *fragments = WRONG_TYPES_T[case]
    p = draft(version=2, tensor_overrides={name: np.zeros(shape, dtype)})
    expect_error(p, f"tensor '{name}'", *fragments)


UNEXPECTED = {
    "layer_beyond_count": (2, "blk.2.attn_q.weight", (N_HEAD * HEAD_DIM, E), "DFlash2 drafter with 2 layers"),
    "rope_freqs": (2, "rope_freqs.weight", (HEAD_DIM // 2,), "DFlash2 drafter"),
    "conv_in_dflash1": (1, "blk.0.attn_conv_base", (2, 2, E), "DFlash drafter with 2 layers"),
    "typo": (1, "blk.0.attn_qq.weight", (N_HEAD * HEAD_DIM, E), "not part of a DFlash drafter"),
}


@pytest.mark.parametrize("case", list(UNEXPECTED))
def test_unexpected_extra_tensor(draft, case):
    version, name, shape, fragment = UNEXPECTED[case]
    p = draft(version=version, extra_tensors={name: np.zeros(shape, np.float32)})
    expect_error(p, f"unexpected tensor '{name}'", fragment)


def test_layer_count_larger_than_tensors(draft):
    p = draft(version=1, key_overrides={"dflash.block_count": 3})
    expect_error(p, "tensor 'blk.2.", "is missing")


def test_embedded_head_with_wrong_vocab(draft):
    p = draft(
        version=1,
        extra_tensors={
            "token_embd.weight": np.zeros((N_VOCAB, E), np.float32),
            "output.weight": np.zeros((N_VOCAB + 1, E), np.float32),
        },
    )
    expect_error(
        p, "tensor 'output.weight'", f"expected shape (ggml ne) {{{E}, {N_VOCAB}}}", f"found {{{E}, {N_VOCAB + 1}}}"
    )


# ----------------------------------------------------------------------------
# pairing with the bundled target (vocab 2048, hidden 256, 6 layers)
# ----------------------------------------------------------------------------


@pytest.fixture(scope="module")
def tiny_target() -> str:
    if not TARGET.exists():
        pytest.skip(f"{TARGET} not present")
    return str(TARGET)


def test_drafter_fc_width_mismatch_names_both_files(draft, tiny_target):
    p = draft(version=2, n_embd=256, target_hidden=64, n_vocab=2048)
    with pytest.raises(DFlashError) as ei:
        dflash_gguf.Drafter(str(p), tiny_target, n_threads=2)
    msg = str(ei.value)
    assert str(p) in msg and tiny_target in msg, msg
    assert "256" in msg and "width 64" in msg, msg


def test_drafter_vocab_mismatch_names_both_files(draft, tiny_target):
    p = draft(version=1, n_embd=256, target_hidden=256, n_vocab=1000)
    with pytest.raises(DFlashError) as ei:
        dflash_gguf.Drafter(str(p), tiny_target, n_threads=2)
    msg = str(ei.value)
    assert str(p) in msg and tiny_target in msg and "1000" in msg and "2048" in msg, msg


def test_drafter_target_layer_beyond_target(draft, tiny_target):
    p = draft(version=1, n_embd=256, target_hidden=256, n_vocab=2048, target_layers=(2, 7))
    with pytest.raises(DFlashError) as ei:
        dflash_gguf.Drafter(str(p), tiny_target, n_threads=2)
    msg = str(ei.value)
    assert str(p) in msg and tiny_target in msg and "layer 7" in msg and "6 layers" in msg, msg


@pytest.mark.parametrize("version", [1, 2])
def test_drafter_opens_and_drafts_without_context(draft, tiny_target, version):
    p = draft(version=version, n_embd=256, target_hidden=256, n_vocab=2048)
    d = dflash_gguf.Drafter(str(p), tiny_target, n_threads=2)
    assert d.n_vocab == 2048
    assert d.hparams["version"] == version
    assert d.n_cached == 0
    out = d.draft(anchor=5, position=0, n=3)
    assert isinstance(out, list) and len(out) == 3
    assert all(isinstance(t, int) and 0 <= t < 2048 for t in out), out
    # deterministic: the same block again gives the same tokens
    assert d.draft(anchor=5, position=0, n=3) == out


# ----------------------------------------------------------------------------
# edge cases of the loader's checks: files it must accept, and inputs it must reject with a clear error
# ----------------------------------------------------------------------------


@pytest.mark.parametrize("kw", [{"rank": 1}, {"n_ff": 1}], ids=["selector_rank_1", "n_ff_1"])
def test_valid_tensor_with_trailing_unit_dim_is_accepted(draft, kw):
    p = draft(version=2, **kw)
    dflash_gguf.inspect_draft(str(p))


def test_head_dim_zero_is_rejected(draft):
    p = draft(
        version=1,
        n_embd=E,
        n_head=128,
        n_head_kv=128,
        head_dim=1,
        drop_keys=["dflash.attention.key_length", "dflash.attention.value_length", "tokenizer.ggml.tokens"],
    )
    expect_error(p, "key_length")


def test_folder_given_as_draft_is_reported_clearly(tmp_path):
    d = tmp_path / "weights.gguf"
    d.mkdir()
    msg = expect_error(d)
    assert "9223372036854775807" not in msg
    assert "directory" in msg.replace(str(d), "").lower(), msg
