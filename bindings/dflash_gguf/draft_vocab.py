"""Drafting vocabularies: the target's most frequent tokens, counted on a corpus, to which drafts are limited.

At a real vocabulary (Qwen3's 151,936 tokens) the drafter's LM head is about half of a CPU draft step.
With a drafting vocabulary the drafter computes the head and the selector's codebooks for those rows only
(FR-Spec's frequency-ranked drafting); the target still verifies over its whole vocabulary, so the output
is unchanged and a token outside the subset is only never drafted. `dflash draft-vocab` writes the file,
`SpeculativeLlama(draft_vocab=...)` and `--draft-vocab` read it.
"""

from __future__ import annotations

import json
import os
from collections import Counter
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import Any

FORMAT = "dflash-draft-vocab"


def rank_tokens(counts: Counter[int], n_vocab: int, size: int, always: Sequence[int] = ()) -> list[int]:
    """The `size` tokens a draft may propose: `always` first (the end-of-generation tokens), then by count
    (most frequent first), then tokens never counted by id (a BPE vocabulary's ids follow its merges,
    the more frequent pieces first)."""
    if not 1 <= size <= n_vocab:
        raise ValueError(f"size must be 1..{n_vocab} (the vocabulary), got {size}")
    picked = list(dict.fromkeys(t for t in always if 0 <= t < n_vocab))
    taken = set(picked)
    for t, _ in sorted(counts.items(), key=lambda kv: (-kv[1], kv[0])):
        if len(picked) >= size:
            break
        if t not in taken and 0 <= t < n_vocab:
            picked.append(t)
            taken.add(t)
    t = 0
    while len(picked) < size:
        if t not in taken:
            picked.append(t)
        t += 1
    return picked[:size]


def corpus_texts(paths: Iterable[str]) -> Iterable[str]:
    """The text of every file given and of every UTF-8 file under the directories given (in name order)."""
    for p in paths:
        root = Path(p)
        if not root.exists():
            raise FileNotFoundError(f"{p}: no such file or directory")
        if root.is_file():
            try:
                yield root.read_text(encoding="utf-8")
            except UnicodeDecodeError:
                raise ValueError(f"{root}: not a UTF-8 text file") from None
            continue
        for f in sorted(f for f in root.rglob("*") if f.is_file()):
            try:
                yield f.read_text(encoding="utf-8")
            except (UnicodeDecodeError, OSError):
                pass  # a binary or unreadable file among the texts


def count_tokens(tokenize: Callable[[str], list[int]], texts: Iterable[str]) -> tuple[Counter[int], int]:
    """Token counts over the texts, and how many were read."""
    counts: Counter[int] = Counter()
    files = 0
    for text in texts:
        counts.update(tokenize(text))
        files += 1
    return counts, files


def make_draft_vocab(target: str, corpus: Sequence[str], size: int) -> dict[str, Any]:
    """Count the target's tokens over the corpus files / directories and pick the `size` most frequent
    (plus the end-of-generation tokens). Loads only the target's vocabulary."""
    import llama_cpp as lc
    from llama_cpp import _logger

    if not corpus:
        raise ValueError("no corpus given: pass text files or directories to count tokens on")
    _logger.set_verbose(False)
    params = lc.llama_model_default_params()
    params.vocab_only = True
    model = lc.llama_model_load_from_file(target.encode(), params)
    if not model:
        raise ValueError(f"{target}: cannot load the target's vocabulary (not a llama.cpp GGUF model?)")
    try:
        vocab = lc.llama_model_get_vocab(model)
        n_vocab = lc.llama_vocab_n_tokens(vocab)
        size = min(size, n_vocab)
        always = sorted({t for t in (lc.llama_vocab_eos(vocab), lc.llama_vocab_eot(vocab)) if t >= 0})

        def tokenize(text: str) -> list[int]:
            data = text.encode()
            buf = (lc.llama_token * (len(data) + 1))()
            n = lc.llama_tokenize(vocab, data, len(data), buf, len(buf), False, False)
            if n < 0:  # more tokens than bytes: cannot happen with a byte-level vocabulary
                raise ValueError(f"{target}: tokenizing a corpus text failed ({n})")
            return list(buf[:n])

        counts, files = count_tokens(tokenize, corpus_texts(corpus))
    finally:
        lc.llama_model_free(model)
    if not counts:
        raise ValueError(f"the corpus ({', '.join(corpus)}) holds no UTF-8 text")
    tokens = rank_tokens(counts, n_vocab, size, always)
    total = sum(counts.values())
    covered = sum(counts[t] for t in tokens)
    return {
        "format": FORMAT,
        "target": os.path.basename(target),
        "n_vocab": n_vocab,
        "corpus_files": files,
        "corpus_tokens": total,
        "coverage": covered / total,  # share of the corpus's tokens a draft could propose
        "tokens": tokens,
    }


def refuse_existing(path: str) -> None:
    if os.path.exists(path):
        raise FileExistsError(f"{path} exists; remove it or choose another output path")


def save_draft_vocab(vocab: dict[str, Any], path: str) -> None:
    """Write without ever leaving a half-written file, and never over an existing one."""
    refuse_existing(path)
    tmp = f"{path}.tmp{os.getpid()}"
    with open(tmp, "w") as f:
        json.dump(vocab, f)
    os.replace(tmp, path)


def load_draft_vocab(path: str) -> tuple[list[int], int]:
    """The token ids of a `dflash draft-vocab` file, and the vocabulary size of the target it was made for."""
    try:
        data = json.loads(Path(path).read_text())
    except (OSError, ValueError) as e:
        raise ValueError(f"{path}: cannot read a drafting vocabulary ({e})") from e
    if not isinstance(data, dict) or data.get("format") != FORMAT:
        raise ValueError(f"{path}: not a drafting vocabulary (expected a JSON object with format {FORMAT!r})")
    tokens, n_vocab = data.get("tokens"), data.get("n_vocab")
    if not isinstance(tokens, list) or not all(isinstance(t, int) and not isinstance(t, bool) for t in tokens):
        raise ValueError(f"{path}: 'tokens' must be a list of token ids")
    if not isinstance(n_vocab, int):
        raise ValueError(f"{path}: 'n_vocab' (the target's vocabulary size) must be an int")
    return tokens, n_vocab


def target_vocab_size(target: str) -> int | None:
    """The vocabulary size a target GGUF's header records (the length of its token list), read without
    loading the model; None where the header does not say (libllama then reports a bad file itself)."""
    from dflash_convert.errors import ConversionError
    from dflash_convert.gguf_file import read_header

    try:
        tokens = read_header(Path(target)).fields.get("tokenizer.ggml.tokens")
    except ConversionError:
        return None
    return None if tokens is None else len(tokens.value)


def check_made_for(path: str, made_for: int, n_vocab: int) -> None:
    """A file counted with another tokenizer would pass the id checks and draft nonsense."""
    if made_for != n_vocab:
        raise ValueError(f"{path}: made for a vocabulary of {made_for} tokens, but the target has {n_vocab}")


def draft_vocab_ids(draft_vocab: str | os.PathLike[str] | Sequence[int] | None) -> tuple[list[int], str | None, int]:
    """SpeculativeLlama's draft_vocab as token ids ([]: the whole vocabulary), with the file they came from
    and the vocabulary size it was made for (None, 0 for a list of ids)."""
    if draft_vocab is None:
        return [], None, 0
    if isinstance(draft_vocab, (str, os.PathLike)):
        path = os.fspath(draft_vocab)
        tokens, made_for = load_draft_vocab(path)
        return tokens, path, made_for
    if isinstance(draft_vocab, (bytes, int)):
        raise TypeError(f"draft_vocab must be a file path or a sequence of token ids, got {draft_vocab!r}")
    return [int(t) for t in draft_vocab], None, 0
