"""dflash-convert for the published drafters' targets: M-RoPE rope sections and mask_embedding.pt."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers", reason="transformers builds the tiny targets")

import gguf  # noqa: E402
from arch_targets import HIDDEN, VOCAB, drafter_for, target_gguf  # noqa: E402
from factories import make_checkpoint  # noqa: E402
from tinycode import GreedyReference, compare_greedy  # noqa: E402

from dflash_convert import ConversionError, Options, convert  # noqa: E402
from dflash_gguf import SpeculativeLlama, inspect_draft  # noqa: E402
from dflash_gguf.info import format_text, summarize  # noqa: E402

MASK_ID = 1


def _field(path: Path, key: str) -> list[int] | None:
    f = gguf.GGUFReader(path).get_field(key)
    return None if f is None else [int(f.parts[i][0]) for i in f.data]


def _tensor(path: Path, name: str) -> np.ndarray:
    t = next(t for t in gguf.GGUFReader(path).tensors if t.name == name)
    return np.asarray(t.data, dtype=np.float32).reshape(tuple(int(n) for n in reversed(t.shape)))


def test_an_m_rope_target_gives_the_drafter_upstreams_sections() -> None:
    assert _field(target_gguf("qwen35"), "qwen35.rope.dimension_sections") == [2, 1, 1, 0]
    draft = drafter_for("qwen35")
    assert _field(draft, "dflash.rope.dimension_sections") == [8, 0, 0, 0]  # head_dim / 2, temporal only
    info = summarize(inspect_draft(str(draft)))
    assert info["rope_sections"] == [8, 0, 0, 0]
    assert "M-RoPE sections [8, 0, 0, 0]" in format_text(info)
    plain = drafter_for("llama")
    assert _field(plain, "dflash.rope.dimension_sections") is None
    assert summarize(inspect_draft(str(plain)))["rope_sections"] == []


def _mask_drafter(tmp: Path, vec: np.ndarray | None = None, **mask: object) -> Path:
    src = tmp / "drafter"
    make_checkpoint(
        src,
        version=2,
        hidden=HIDDEN,
        n_layers=1,
        heads=4,
        kv_heads=2,
        head_dim=16,
        ff=128,
        vocab=VOCAB,
        n_target_layers=4,
        target_layer_ids=(1, 2),
        top_k=4,
        rank=8,
        mask_token_id=MASK_ID,
        seed=3,
    )
    data = {
        "mask_token_id": MASK_ID,
        "embedding": torch.from_numpy(vec if vec is not None else np.linspace(-1, 1, HIDDEN, dtype=np.float32)),
    }
    data.update(mask)
    torch.save(data, src / "mask_embedding.pt")
    return src


def test_mask_embedding_patches_the_targets_embedding_and_keeps_its_head(tmp_path: Path) -> None:
    vec = np.linspace(-2.0, 2.0, HIDDEN, dtype=np.float32)
    target = target_gguf("qwen35")
    out = tmp_path / "draft.gguf"
    convert(Options(draft_dir=_mask_drafter(tmp_path, vec), target=target, outfile=out, outtype="f32", progress=False))
    emb, head = _tensor(out, "token_embd.weight"), _tensor(out, "output.weight")
    t_emb, t_head = _tensor(target, "token_embd.weight"), _tensor(target, "output.weight")
    np.testing.assert_array_equal(emb[MASK_ID], vec)
    np.testing.assert_array_equal(np.delete(emb, MASK_ID, 0), np.delete(t_emb, MASK_ID, 0))
    np.testing.assert_array_equal(head, t_head)
    info = summarize(inspect_draft(str(out)))
    assert info["mask_embedding"] and info["embeds_target_head"]
    assert "its own mask row" in format_text(info)
    # the drafter drafts from its own table and the target's head, and the output stays the target's
    spec = SpeculativeLlama(str(target), str(out), n_ctx=256, n_threads=1, n_max=3, fallback=False)
    ref = GreedyReference(target, n_ctx=256, n_threads=1)
    prompt = ref.tokenize("def f(a, b):\n")
    problems, _ = compare_greedy(ref, prompt, list(spec.generate_tokens(prompt, max_tokens=16)), 16, 1e-3, "mask")
    assert not problems, problems
    assert spec.stats.drafted > 0


@pytest.mark.parametrize(
    ("mask", "message"),
    [
        ({"mask_token_id": 5}, "mask_token_id 5 does not match dflash_config.mask_token_id 1"),
        ({"embedding": torch.zeros(HIDDEN + 1)}, rf"'embedding' has shape \({HIDDEN + 1},\), expected \({HIDDEN},\)"),
        ({"embedding": torch.full((HIDDEN,), float("nan"))}, "non-finite"),
        ({"vector": 1}, None),
    ],
)
def test_a_bad_mask_embedding_is_refused_naming_the_file(tmp_path: Path, mask: dict, message: str | None) -> None:
    src = _mask_drafter(tmp_path, **mask)
    if message is None:  # wrong keys: rewrite without the embedding
        torch.save({"mask_token_id": MASK_ID}, src / "mask_embedding.pt")
        message = "expected a dict with 'mask_token_id' and 'embedding'"
    out = tmp_path / "draft.gguf"
    with pytest.raises(ConversionError, match=message) as e:
        convert(Options(draft_dir=src, target=target_gguf("llama"), outfile=out, outtype="f32", progress=False))
    assert "mask_embedding.pt" in str(e.value)
    assert not out.exists()
