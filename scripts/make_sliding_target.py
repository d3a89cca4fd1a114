#!/usr/bin/env python3
"""A target with gpt-oss-20b's layers, for timing its sliding-window attention against context length.

    .venv/bin/python scripts/make_sliding_target.py OUT.gguf [--layers 4] [--outtype f16]
    .venv/bin/python scripts/bench_verify.py OUT.gguf --context 16384 --blocks 1,4 --swa-full both

Random weights, built by transformers from a config and converted by upstream's convert_hf_to_gguf.py
(as tests/arch_targets.py builds its tiny targets; needs the test install and the llama.cpp source that
scripts/build_llama_server.sh unpacks). Each layer has gpt-oss-20b's shape: hidden 2880, 64 query heads
and 8 KV heads of 64, attention sinks, a 128-position sliding window in every other layer. Its MoE has 4
experts of 2880 and routes every token to all 4, which reads per token what gpt-oss-20b's 4 of 32 read;
the vocabulary is the tinycode one (2,048 tokens: gpt-oss' 201,088-token head would be a fixed cost beside
the layers, whose share of a step this target keeps). A file that exists is not overwritten.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("out", type=Path)
    ap.add_argument("--layers", type=int, default=4, help="an even number: sliding and full attention alternate")
    ap.add_argument("--outtype", default="f16", help="upstream converter's --outtype")
    args = ap.parse_args()
    if args.out.exists():
        sys.exit(f"{args.out}: exists (not overwritten)")
    if args.layers < 2 or args.layers % 2:
        sys.exit(f"--layers must be an even number >= 2, got {args.layers}")

    import torch
    import transformers

    sys.path.insert(0, str(ROOT / "tests"))
    from arch_targets import save_with_tinycode_tokenizer, upstream_convert

    config = transformers.GptOssConfig(
        vocab_size=2048,
        hidden_size=2880,
        intermediate_size=2880,
        num_hidden_layers=args.layers,
        num_attention_heads=64,
        num_key_value_heads=8,
        head_dim=64,
        num_local_experts=4,
        num_experts_per_tok=4,
        sliding_window=128,
        layer_types=["sliding_attention", "full_attention"] * (args.layers // 2),
        rope_parameters={"rope_type": "default", "rope_theta": 150000.0},
        max_position_embeddings=131072,
        tie_word_embeddings=False,
        bos_token_id=0,
        eos_token_id=0,
        pad_token_id=0,
    )
    torch.manual_seed(0)
    model = transformers.GptOssForCausalLM(config).to(torch.bfloat16).eval()
    with tempfile.TemporaryDirectory(prefix="dflash-sliding-target-") as tmp:
        hf = Path(tmp) / "hf"
        save_with_tinycode_tokenizer(model, hf)
        del model
        part = args.out.with_name(args.out.name + ".part")
        upstream_convert(hf, part, outtype=args.outtype)
        part.replace(args.out)
    print(f"wrote {args.out} ({args.out.stat().st_size / 2**30:.2f} GiB, {args.layers} layers)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
