"""A synthetic GPT-2 byte-level vocabulary and the qwen3 GGUF header keys, for targets written
straight as GGUFs by the tests and benches (token ids matter there, not text)."""

from __future__ import annotations

from typing import Any


def synthetic_vocab(n_vocab: int) -> tuple[list[str], list[int], list[str]]:
    """(tokens, types, merges) of a GPT-2 byte-level BPE libllama accepts: <|endoftext|> and <|mask|>
    (CONTROL), the 256 byte tokens, two-letter merges, then UNUSED filler up to n_vocab.
    The bench feeds token ids, so the text side only has to load."""
    control, normal, unused = 3, 1, 5  # llama_token_type
    if n_vocab < 258:
        raise ValueError(f"vocab {n_vocab}: needs >= 258 tokens (2 control + 256 bytes)")
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    shifted = iter(range(256, 512))  # GPT-2 maps the other bytes above U+00FF
    byte_chars = [chr(b) if b in printable else chr(next(shifted)) for b in range(256)]
    tokens, types = ["<|endoftext|>", "<|mask|>", *byte_chars], [control, control] + [normal] * 256
    letters = "etaoinshrdlcumwfgypbvkjxqz"
    merges = [f"{a} {b}" for a in letters for b in letters][: n_vocab - len(tokens)]
    tokens += [m.replace(" ", "") for m in merges]
    types += [normal] * len(merges)
    types += [unused] * (n_vocab - len(tokens))
    tokens += [f"<|unused{i}|>" for i in range(len(tokens), n_vocab)]
    return tokens, types, merges


def add_tokenizer(w: Any, n_vocab: int) -> None:
    """The synthetic GPT-2 vocabulary's keys (bos = eos = pad = <|endoftext|>, no BOS added)."""
    tokens, types, merges = synthetic_vocab(n_vocab)
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("gpt-2")  # libllama 0.3.36 rejects "gpt2" here
    w.add_token_list(tokens)
    w.add_token_types(types)
    w.add_token_merges(merges)
    w.add_bos_token_id(0)
    w.add_eos_token_id(0)
    w.add_pad_token_id(0)
    w.add_add_bos_token(False)


def add_qwen3_header(
    w: Any,
    *,
    name: str,
    hidden: int,
    n_layers: int,
    ff: int,
    heads: int,
    kv_heads: int,
    head_dim: int,
    rope_theta: float,
    vocab: int,
    context_length: int,
    file_type: int,
) -> None:
    """Every key but the tensors that libllama needs to load a qwen3 target (a gguf.GGUFWriter)."""
    w.add_type("model")
    w.add_name(name)
    w.add_file_type(file_type)
    w.add_context_length(context_length)
    w.add_embedding_length(hidden)
    w.add_block_count(n_layers)
    w.add_feed_forward_length(ff)
    w.add_head_count(heads)
    w.add_head_count_kv(kv_heads)
    w.add_key_length(head_dim)
    w.add_value_length(head_dim)
    w.add_layer_norm_rms_eps(1e-6)
    w.add_rope_freq_base(rope_theta)
    add_tokenizer(w, vocab)


__all__ = ["add_qwen3_header", "add_tokenizer", "synthetic_vocab"]
