"""Build examples/tinycode-hybrid: the tinycode pair's function on a Qwen3.5 (qwen35) hybrid target.

The target is a Qwen3_5ForCausalLM of 24 layers: tinycode's 6 attention layers at the positions Qwen3.5's
3:1 layout gives full attention (3, 7, ..., 23), each preceded by 3 Gated DeltaNet layers with random
weights whose output projection and MLP down projection are zero. Those add nothing to the residual
stream, so the model computes tinycode's function, while its cost and its recurrent state (what a
rejected draft must roll back) are a hybrid's. Tinycode's attention becomes Qwen3.5's: the gate half of
q_proj is zero (sigmoid 0.5, so o_proj is doubled), norms are stored as w - 1 (Qwen3.5 scales by 1 + w),
rotary over the whole head with M-RoPE sections [11, 11, 10] (all one position for text: plain RoPE).

The trained drafter reads tinycode layers 1 and 3, now hybrid layers 7 and 15 (target_layer_ids [7, 15]).

    .venv/bin/python scripts/make_hybrid_pair.py        (needs transformers, torch, and the llama.cpp
                                                        source that scripts/build_llama_server.sh unpacks)
"""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

import torch
import transformers

ROOT = Path(__file__).resolve().parent.parent
TINY = ROOT / "examples" / "tinycode"
OUT = ROOT / "examples" / "tinycode-hybrid"
PER_ATTENTION = 4  # 3 Gated DeltaNet layers, then the attention layer


def hybrid_model() -> transformers.PreTrainedModel:
    src = transformers.AutoModelForCausalLM.from_pretrained(TINY / "target", dtype=torch.float32).eval()
    c = src.config
    n = c.num_hidden_layers * PER_ATTENTION
    cfg = transformers.Qwen3_5TextConfig(
        vocab_size=c.vocab_size,
        hidden_size=c.hidden_size,
        intermediate_size=c.intermediate_size,
        num_hidden_layers=n,
        num_attention_heads=c.num_attention_heads,
        num_key_value_heads=c.num_key_value_heads,
        head_dim=c.head_dim,
        max_position_embeddings=c.max_position_embeddings,
        rms_norm_eps=c.rms_norm_eps,
        tie_word_embeddings=False,
        bos_token_id=0,
        eos_token_id=0,
        pad_token_id=0,
        layer_types=(["linear_attention"] * (PER_ATTENTION - 1) + ["full_attention"]) * c.num_hidden_layers,
        linear_num_key_heads=2,
        linear_num_value_heads=4,
        linear_key_head_dim=64,
        linear_value_head_dim=64,
        linear_conv_kernel_dim=4,
        rope_parameters={
            "rope_type": "default",
            "rope_theta": 10000.0,
            "partial_rotary_factor": 1.0,
            "mrope_section": [11, 11, 10],
            "mrope_interleaved": True,
        },
    )
    torch.manual_seed(0)
    dst = transformers.Qwen3_5ForCausalLM(cfg).to(torch.float32).eval()
    s, d = src.state_dict(), dst.state_dict()
    hd, heads = c.head_dim, c.num_attention_heads

    def put(name: str, value: torch.Tensor) -> None:
        assert d[name].shape == value.shape, (name, d[name].shape, value.shape)
        d[name] = value.clone()

    put("model.embed_tokens.weight", s["model.embed_tokens.weight"])
    put("lm_head.weight", s["lm_head.weight"])
    put("model.norm.weight", s["model.norm.weight"] - 1)
    for i in range(n):
        p = f"model.layers.{i}."
        if i % PER_ATTENTION != PER_ATTENTION - 1:  # a Gated DeltaNet layer that adds nothing
            d[p + "linear_attn.out_proj.weight"].zero_()
            d[p + "mlp.down_proj.weight"].zero_()
            continue
        q = f"model.layers.{i // PER_ATTENTION}."
        for norm in ("input_layernorm", "post_attention_layernorm", "self_attn.q_norm", "self_attn.k_norm"):
            put(p + norm + ".weight", s[q + norm + ".weight"] - 1)
        wq = s[q + "self_attn.q_proj.weight"].view(heads, hd, -1)
        put(p + "self_attn.q_proj.weight", torch.cat([wq, torch.zeros_like(wq)], 1).reshape(2 * heads * hd, -1))
        for proj in ("k_proj", "v_proj"):
            put(p + f"self_attn.{proj}.weight", s[q + f"self_attn.{proj}.weight"])
        put(p + "self_attn.o_proj.weight", 2 * s[q + "self_attn.o_proj.weight"])
        for proj in ("gate_proj", "up_proj", "down_proj"):
            put(p + f"mlp.{proj}.weight", s[q + f"mlp.{proj}.weight"])
    dst.load_state_dict(d)
    ids = torch.tensor([[int(t) for t in range(3, 200, 7)]])
    with torch.no_grad():
        diff = (dst(ids).logits - src(ids).logits).abs().max().item()
    print(f"hybrid vs tinycode logits, max |diff| {diff:.2e}")
    assert diff < 1e-3, diff
    return dst


def main() -> None:
    sys.path.insert(0, str(ROOT / "tests"))
    from arch_targets import save_with_tinycode_tokenizer, upstream_convert

    work = OUT / "hf-target.tmp"
    shutil.rmtree(work, ignore_errors=True)
    save_with_tinycode_tokenizer(hybrid_model(), work)
    OUT.mkdir(exist_ok=True)
    upstream_convert(work, OUT / "target-f16.gguf", "--no-mtp", outtype="f16")
    shutil.rmtree(work)

    draft = OUT / "drafter-dflash2"
    draft.mkdir(exist_ok=True)
    cfg = json.loads((TINY / "drafter-dflash2" / "config.json").read_text())
    cfg["num_target_layers"] = 24
    cfg["dflash_config"]["target_layer_ids"] = [7, 15]  # tinycode's [1, 3]
    (draft / "config.json").write_text(json.dumps(cfg, indent=2) + "\n")
    weights = draft / "model.safetensors"
    if not weights.is_symlink():
        weights.unlink(missing_ok=True)
        weights.symlink_to(Path("..") / ".." / "tinycode" / "drafter-dflash2" / "model.safetensors")


if __name__ == "__main__":
    main()
