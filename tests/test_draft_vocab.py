"""Drafting vocabularies: drafts limited to the target's most frequent tokens (FR-Spec), the LM head and the
selector's codebooks cut to those rows. The output stays plain decoding's; acceptance drops by what the
subset misses."""

from __future__ import annotations

import json
import re
import subprocess
import sys
import sysconfig
from collections import Counter
from pathlib import Path

import numpy as np
import pytest

llama_cpp = pytest.importorskip("llama_cpp", reason="llama-cpp-python is not installed")

from tinycode import (  # noqa: E402
    DRAFTER_DIR,
    N_CTX,
    TARGET,
    THREADS,
    TINY,
    _workdir,
    drafter_gguf,
    prompts,
)

import dflash_gguf  # noqa: E402
from dflash_gguf import DFlashError, SpeculativeLlama  # noqa: E402
from dflash_gguf.draft_vocab import corpus_texts, make_draft_vocab, rank_tokens, save_draft_vocab  # noqa: E402

N_VOCAB = 2048
DFLASH = [sys.executable, "-m", "dflash_gguf.cli"]


def _train_files(n: int) -> list[str]:
    """The first n files of the split the tinycode target was trained on (the bench prompts are held out)."""
    split = json.loads((TINY / "results" / "split.json").read_text())
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    files = [str(stdlib / f) for f in split["train"] if (stdlib / f).is_file()]
    assert len(files) >= n, f"only {len(files)} of the training split's files under {stdlib}"
    return files[:n]


@pytest.fixture(scope="module")
def vocab_files(tmp_path_factory: pytest.TempPathFactory) -> dict[int, Path]:
    folder = tmp_path_factory.mktemp("draft-vocab")
    out = {}
    for size in (1024, 256):
        out[size] = folder / f"v{size}.json"
        save_draft_vocab(make_draft_vocab(str(TARGET), _train_files(150), size), str(out[size]))
    return out


def _draft(draft: str, vocab: list[int], anchor: int = 5, target: str = str(TARGET)) -> dict:
    d = dflash_gguf.Drafter(draft, target, device="cpu", n_threads=1, n_ctx=256, draft_vocab=vocab)
    width = len(d.hparams["target_layers"]) * d.hparams["target_hidden"]
    feats = np.random.default_rng(1).standard_normal((40, width)).astype(np.float32)
    d.inject(feats, np.arange(40, dtype=np.int32))
    out = d.draft(anchor, 40, 7, details=True)
    out["vocab_size"] = d.draft_vocab_size
    return out


@pytest.fixture(scope="module")
def embedded_q4_drafter() -> Path:
    """The bundled drafter with the target's head embedded at q4_0: on the CPU the head then sits in ggml's
    repacked layout, which cannot be read back, so the subset's rows come from the file."""
    out = _workdir() / "tinycode-drafter-q4_0-head.gguf"
    if not out.exists():
        exe = Path(sys.executable).with_name("dflash-convert")
        subprocess.run(
            [str(exe), str(DRAFTER_DIR), "--target", str(TARGET), "--outfile", str(out), "--outtype", "q4_0"]
            + ["--embed-target-head", "--no-progress"],
            check=True,
            capture_output=True,
        )
    return out


@pytest.mark.parametrize("kind", ["target head f32", "embedded q4_0 head"])
def test_the_whole_vocabulary_in_any_order_drafts_exactly_as_none(kind: str, embedded_q4_drafter: Path) -> None:
    draft, target = (
        (str(drafter_gguf("f32")), str(TARGET)) if kind.startswith("target") else (str(embedded_q4_drafter), "")
    )
    full = _draft(draft, [], target=target)
    shuffled = [int(t) for t in np.random.default_rng(3).permutation(N_VOCAB)]
    got = _draft(draft, shuffled, target=target)
    assert (full["vocab_size"], got["vocab_size"]) == (N_VOCAB, N_VOCAB)
    assert got["tokens"] == full["tokens"]
    np.testing.assert_array_equal(got["candidates"], full["candidates"])
    np.testing.assert_array_equal(got["argmax"], full["argmax"])
    np.testing.assert_allclose(got["scores"], full["scores"], rtol=0, atol=1e-5)
    np.testing.assert_allclose(got["logits"], full["logits"], rtol=0, atol=1e-5)


def test_a_subset_drafts_only_its_tokens() -> None:
    draft = str(drafter_gguf("f32"))
    full = _draft(draft, [])
    best = set(np.asarray(full["candidates"])[:, 0].tolist())  # each row's most likely token
    keep = [t for t in range(N_VOCAB) if t not in best]
    got = _draft(draft, keep)
    cands = set(np.asarray(got["candidates"]).ravel().tolist()) | set(got["tokens"]) | set(got["argmax"].tolist())
    assert cands <= set(keep) and not cands & best
    logits = np.asarray(got["logits"])
    assert np.isneginf(logits[:, sorted(best)]).all()
    np.testing.assert_allclose(logits[:, keep], np.asarray(full["logits"])[:, keep], rtol=0, atol=1e-5)


@pytest.mark.parametrize(
    ("vocab", "message"),
    [
        ([3, 3] + list(range(10, 20)), "token id 3 is listed twice"),
        ([N_VOCAB] + list(range(10)), f"token id {N_VOCAB} is outside the vocabulary"),
        ([-1] + list(range(10)), "token id -1 is outside the vocabulary"),
        ([1, 2, 3], "has 3 tokens; expected 8 (the selector's top k)"),
    ],
)
def test_bad_ids_are_refused(vocab: list[int], message: str) -> None:
    with pytest.raises(DFlashError, match=message.replace("(", r"\(").replace(")", r"\)")):
        SpeculativeLlama(str(TARGET), str(drafter_gguf("f32")), n_ctx=N_CTX, n_threads=THREADS, draft_vocab=vocab)


def test_bad_files_are_refused(tmp_path: Path, vocab_files: dict[int, Path]) -> None:
    draft = str(drafter_gguf("f32"))
    other = tmp_path / "other.json"
    other.write_text(json.dumps(json.loads(vocab_files[256].read_text()) | {"n_vocab": 151936}))
    cases = {
        tmp_path / "missing.json": "cannot read a drafting vocabulary",
        tmp_path / "notjson.json": "cannot read a drafting vocabulary",
        tmp_path / "list.json": "not a drafting vocabulary",
        other: "made for a vocabulary of 151936 tokens, but the target has 2048",
    }
    (tmp_path / "notjson.json").write_text("{")
    (tmp_path / "list.json").write_text("[1, 2, 3]")
    for path, message in cases.items():
        with pytest.raises(ValueError) as e:
            SpeculativeLlama(str(TARGET), draft, n_ctx=N_CTX, n_threads=THREADS, draft_vocab=str(path))
        assert str(e.value).startswith(f"{path}: ") and message in str(e.value)
    # another target's file is refused from the target's header, before anything loads (a missing drafter
    # would otherwise be the error) ...
    wrong_target = f"^{re.escape(str(other))}: made for a vocabulary of 151936"
    with pytest.raises(ValueError, match=wrong_target):
        SpeculativeLlama(str(TARGET), str(tmp_path / "absent.gguf"), n_ctx=N_CTX, draft_vocab=str(other))
    # ... and by the loaded target where there is no file to read first
    spec = SpeculativeLlama(str(TARGET), draft, n_ctx=N_CTX, n_threads=THREADS)
    with pytest.raises(ValueError, match=wrong_target):
        spec.share_weights(draft_vocab=str(other))


def test_ranking() -> None:
    counts = Counter({7: 5, 3: 5, 9: 9, 2: 1, 50: 4})
    assert rank_tokens(counts, 60, 6, always=[0]) == [0, 9, 3, 7, 50, 2]
    assert rank_tokens(counts, 60, 8, always=[0]) == [0, 9, 3, 7, 50, 2, 1, 4]  # then by id
    assert rank_tokens(counts, 10, 3, always=[]) == [9, 3, 7]  # 50 lies outside a vocabulary of 10
    with pytest.raises(ValueError, match="size must be 1..10"):
        rank_tokens(counts, 10, 11)


def test_corpus_files_and_directories(tmp_path: Path) -> None:
    (tmp_path / "sub").mkdir()
    (tmp_path / "a.txt").write_text("alpha")
    (tmp_path / "sub" / "c.py").write_text("gamma")
    (tmp_path / "b.bin").write_bytes(b"\xff\xfe\x00binary")
    assert list(corpus_texts([str(tmp_path)])) == ["alpha", "gamma"]  # the binary file among them skipped
    with pytest.raises(ValueError, match=f"{tmp_path / 'b.bin'}: not a UTF-8 text file"):
        list(corpus_texts([str(tmp_path / "b.bin")]))  # but not when named
    with pytest.raises(FileNotFoundError, match="nope: no such file"):
        list(corpus_texts([str(tmp_path / "nope")]))


def _acceptance(spec: SpeculativeLlama, toks: list[list[int]], plain: list[list[int]]) -> float:
    accepted = steps = 0
    for prompt, want in zip(toks, plain):
        assert list(spec.generate_tokens(prompt, max_tokens=96, temperature=0.0)) == want
        accepted += spec.stats.accepted
        steps += spec.stats.steps
    return (accepted + steps) / steps


def test_acceptance_drops_by_what_the_subset_misses(vocab_files: dict[int, Path]) -> None:
    """Counted on the training split, half the vocabulary covers ~90% of its tokens and drafts within 2% of
    the whole vocabulary's acceptance; an eighth drafts measurably worse. The output is plain decoding's."""
    draft = str(drafter_gguf("q8_0"))
    kw = dict(n_ctx=N_CTX, n_threads=THREADS, n_max=7)
    full = SpeculativeLlama(str(TARGET), draft, **kw)  # type: ignore[arg-type]
    toks = [full.tokenize(p["text"], add_special=False) for p in prompts()[:10]]
    plain = [list(full.generate_tokens(t, max_tokens=96, temperature=0.0, plain=True)) for t in toks]
    got = {"full": _acceptance(full, toks, plain)}
    for size, path in vocab_files.items():
        spec = full.share_weights(n_max=7, draft_vocab=str(path))
        assert spec.draft_vocab_size == size
        got[size] = _acceptance(spec, toks, plain)
    print(f"mean accepted length: {got}")
    assert got[1024] >= 0.98 * got["full"]
    assert got[256] < 0.95 * got["full"]


def test_shared_decoders_keep_or_change_the_subset(tmp_path: Path, vocab_files: dict[int, Path]) -> None:
    """share_weights keeps the drafting vocabulary unless given one ([]: the whole vocabulary); a share with
    a subset drafts and accepts as a fresh load with it."""
    draft = str(drafter_gguf("q8_0"))
    kw = dict(n_ctx=N_CTX, n_threads=THREADS, n_max=5)
    fresh_sub = SpeculativeLlama(str(TARGET), draft, draft_vocab=str(vocab_files[256]), **kw)  # type: ignore[arg-type]
    fresh_full = SpeculativeLlama(str(TARGET), draft, **kw)  # type: ignore[arg-type]
    toks = [fresh_full.tokenize(p["text"], add_special=False) for p in prompts()[:4]]

    def drafts(spec: SpeculativeLlama) -> list[tuple[list[int], int, int]]:
        out = []
        for t in toks:
            out.append(
                (list(spec.generate_tokens(t, max_tokens=40, temperature=0.0)), spec.stats.drafted, spec.stats.accepted)
            )
        return out

    from_full = fresh_full.share_weights(n_max=5, draft_vocab=str(vocab_files[256]))
    from_sub = fresh_sub.share_weights(n_max=5, draft_vocab=[])
    kept = fresh_sub.share_weights(n_max=5)
    assert (from_full.draft_vocab_size, from_sub.draft_vocab_size, kept.draft_vocab_size) == (256, N_VOCAB, 256)
    assert drafts(from_full) == drafts(fresh_sub) == drafts(kept)
    assert drafts(from_sub) == drafts(fresh_full)
    assert drafts(fresh_sub) != drafts(fresh_full)  # the comparison can tell the two apart

    other = tmp_path / "other.json"
    other.write_text(json.dumps(json.loads(vocab_files[256].read_text()) | {"n_vocab": 151936}))
    with pytest.raises(ValueError, match="made for a vocabulary of 151936 tokens"):
        fresh_full.share_weights(draft_vocab=str(other))


def test_draft_vocab_cli(tmp_path: Path, vocab_files: dict[int, Path]) -> None:
    out = tmp_path / "v.json"
    files = _train_files(20)
    res = subprocess.run(
        [*DFLASH, "draft-vocab", "-m", str(TARGET), "--size", "300", "-o", str(out), *files],
        capture_output=True,
        text=True,
    )
    assert res.returncode == 0, res.stderr
    assert res.stderr == ""  # libllama's log stays quiet
    data = json.loads(out.read_text())
    assert len(data["tokens"]) == 300 and data["n_vocab"] == N_VOCAB and data["corpus_files"] == 20
    assert data["tokens"][0] == 0  # <|endoftext|>, the end-of-generation token, always kept
    assert f"wrote {out}: 300 of {N_VOCAB} tokens" in res.stdout
    # an existing file is never overwritten
    again = subprocess.run(
        [*DFLASH, "draft-vocab", "-m", str(TARGET), "-o", str(out), *files], capture_output=True, text=True
    )
    assert again.returncode == 2 and "exists" in again.stderr
    assert json.loads(out.read_text()) == data

    gen = subprocess.run(
        [*DFLASH, "generate", "-m", str(TARGET), "-d", str(drafter_gguf("q8_0")), "-t", str(THREADS)]
        + ["-p", prompts()[0]["text"], "-n", "24", "--draft-vocab", str(vocab_files[1024]), "--no-stream"],
        capture_output=True,
        text=True,
    )
    plain = subprocess.run(
        [*DFLASH, "generate", "-m", str(TARGET), "-d", str(drafter_gguf("q8_0")), "-t", str(THREADS)]
        + ["-p", prompts()[0]["text"], "-n", "24", "--no-stream"],
        capture_output=True,
        text=True,
    )
    assert gen.returncode == 0 and plain.returncode == 0, gen.stderr + plain.stderr
    assert gen.stdout == plain.stdout


def test_bench_runs_each_vocabulary_side_by_side(tmp_path: Path, vocab_files: dict[int, Path]) -> None:
    out = tmp_path / "bench.json"
    res = subprocess.run(
        [*DFLASH, "bench", "--target", str(TARGET), "--draft", str(drafter_gguf("q8_0")), "--prompts"]
        + [str(TINY / "prompts.jsonl"), "--threads", str(THREADS), "--no-progress", "--limit", "2", "-n", "16"]
        + ["--n-max", "3,auto", "--systems", "ar,ours", "--draft-vocab", f"none,{vocab_files[256]}"]
        + ["--json", str(out)],
        capture_output=True,
        text=True,
        timeout=180,
    )
    assert res.returncode == 0, res.stderr
    configs = json.loads(out.read_text())["configs"]
    assert [(c["n_max"], c["draft_vocab_size"]) for c in configs] == [
        (3, 2048),
        ("auto", 2048),
        (3, 256),
        ("auto", 256),
    ]
    for c in configs:
        assert c["summary"]["ours"]["same_as_ar"] == 2
        assert ("vs_full_vocab" in c["summary"]["ours"]) == (c["draft_vocab"] is not None)
        # auto is compared with the fixed length of its own vocabulary
        assert ("vs_n_max" in c["summary"]["ours"]) == (c["n_max"] == "auto")
    assert res.stdout.count("ours / ours with the whole vocabulary") == 2
    assert "drafting vocabulary v256.json, 256 tokens" in res.stdout

    scale = subprocess.run(
        [*DFLASH, "bench", "--scale", "--draft-vocab", str(vocab_files[256])], capture_output=True, text=True
    )
    assert scale.returncode == 2 and "drop --draft-vocab" in scale.stderr
    missing = subprocess.run(
        [*DFLASH, "bench", "--target", str(TARGET), "--draft", str(drafter_gguf("q8_0")), "--prompts"]
        + [str(TINY / "prompts.jsonl"), "--draft-vocab", str(tmp_path / "nope.json")],
        capture_output=True,
        text=True,
    )
    assert missing.returncode == 2 and f"--draft-vocab: {tmp_path / 'nope.json'} is not a file" in missing.stderr


@pytest.mark.parametrize("draft_q", ["logits", "selector"])
def test_sampled_drafts_see_the_whole_vocabulary_in_any_order_as_none(draft_q: str) -> None:
    """At temperature > 0 a draft is sampled from q (the draft logits mapped back to token ids, or the
    selector's walk) and kept by p/q: with every token in a shuffled order, rejection sampling drafts,
    accepts and emits exactly what it does without a drafting vocabulary (a q left in the subset's order
    would draft other tokens)."""
    hot = {"temperature": 0.8, "top_k": 40, "top_p": 0.95, "min_p": 0.05}
    kw = dict(n_ctx=N_CTX, n_threads=THREADS, n_max=3, sampler="rejection", draft_q=draft_q)
    draft = str(drafter_gguf("q8_0"))
    shuffled = [int(t) for t in np.random.default_rng(5).permutation(N_VOCAB)]
    runs = []
    for vocab in (None, shuffled):
        spec = SpeculativeLlama(str(TARGET), draft, draft_vocab=vocab, **kw)  # type: ignore[arg-type]
        out = []
        for p in prompts()[:4]:
            prompt = spec.tokenize(p["text"], add_special=False)
            out.append((list(spec.generate_tokens(prompt, max_tokens=40, seed=3, **hot)), spec.stats.accepted))
        runs.append(out)
    assert runs[0] == runs[1]
    assert sum(acc for _, acc in runs[0]) > 0


def test_sampling_with_a_subset_stays_exact(vocab_files: dict[int, Path]) -> None:
    """At temperature > 0 the draft's q is zero outside the subset: seeded Gumbel sampling still gives
    plain sampling's text (a draft token outside the subset, or q not renormalised on it, would not)."""
    hot = {"temperature": 0.8, "top_k": 40, "top_p": 0.95, "min_p": 0.05}
    kw = dict(n_ctx=N_CTX, n_threads=THREADS, n_max=3, sampler="gumbel")
    spec = SpeculativeLlama(str(TARGET), str(drafter_gguf("q8_0")), draft_vocab=str(vocab_files[256]), **kw)
    accepted = 0
    for p in prompts()[:4]:
        prompt = spec.tokenize(p["text"], add_special=False)
        for seed in (0, 7):
            plain = list(spec.generate_tokens(prompt, max_tokens=40, seed=seed, plain=True, **hot))
            assert list(spec.generate_tokens(prompt, max_tokens=40, seed=seed, **hot)) == plain
            accepted += spec.stats.accepted
    assert accepted > 0
