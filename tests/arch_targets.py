"""Tiny random-weight targets of the architectures the published drafters serve, made for the tests.

    from arch_targets import ARCHS, target_gguf, drafter_for, hf_dir

* ``hf_dir(arch)``: a Hugging Face directory built by ``transformers`` from a config alone (no download):
  random weights, the bundled tinycode tokenizer (vocabulary 2048).
* ``target_gguf(arch)``: that directory converted by upstream's own ``convert_hf_to_gguf.py`` (from the
  llama-cpp-python 0.3.36 source that ``scripts/build_llama_server.sh`` unpacks), F32.
* ``drafter_for(arch)``: a random DFlash2 checkpoint of the target's width converted by ``dflash-convert``
  against that GGUF; its drafts are mostly rejected, which is what exercises the rollback.

The LM head is drawn with a larger scale than transformers' default init so that the target's top-2
logits are far apart (random 0.02-scale weights give near-uniform logits, where batched and one-token
decoding may legitimately pick different tokens).

Upstream's converter recognises a BPE pre-tokenizer only by the hash of a published tokenizer's output;
the tinycode vocabulary is GPT-2's regex (tokenizer.ggml.pre "gpt-2"), so the conversion runs with that
answer patched in (and Gemma 4's converter, which reads only SentencePiece-style vocabularies, with the
GPT-2 one).
"""

from __future__ import annotations

import functools
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

from tinycode import TINY, _workdir, convert

HIDDEN, HEADS, KV_HEADS, HEAD_DIM, N_LAYERS, VOCAB = 64, 4, 2, 16, 4, 2048
LLAMA_CPP = (
    Path(os.environ.get("DFLASH_CACHE", Path.home() / ".cache" / "dflash-gguf"))
    / "llama-server-0.3.36"
    / "src"
    / "llama_cpp_python-0.3.36"
    / "vendor"
    / "llama.cpp"
)

_COMMON: dict[str, Any] = dict(
    vocab_size=VOCAB,
    hidden_size=HIDDEN,
    num_hidden_layers=N_LAYERS,
    num_attention_heads=HEADS,
    num_key_value_heads=KV_HEADS,
    head_dim=HEAD_DIM,
    max_position_embeddings=4096,
    tie_word_embeddings=False,
    bos_token_id=0,
    eos_token_id=0,
    pad_token_id=0,
)
# Qwen3.5's layout at a small size: 3 Gated DeltaNet layers to 1 attention layer, partial rotary M-RoPE whose
# sections cover the rotated half-dimensions (Qwen3.5-9B: head_dim 256 x 0.25, sections [11, 11, 10])
_LINEAR = dict(
    linear_num_key_heads=2,
    linear_num_value_heads=4,
    linear_key_head_dim=16,
    linear_value_head_dim=16,
    linear_conv_kernel_dim=4,
    layer_types=["linear_attention"] * 3 + ["full_attention"],
    rope_parameters={
        "rope_type": "default",
        "rope_theta": 10000.0,
        "partial_rotary_factor": 0.5,
        "mrope_section": [2, 1, 1],
        "mrope_interleaved": True,
    },
)
_MOE = dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32)

# gguf arch -> (transformers config class, model class, config kwargs)
ARCHS: dict[str, tuple[str, str, dict[str, Any]]] = {
    "llama": ("LlamaConfig", "LlamaForCausalLM", dict(intermediate_size=128)),
    "qwen3moe": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM", dict(intermediate_size=128, **_MOE)),
    # Gated DeltaNet 3:1 with attention, M-RoPE (the converter writes Qwen3.5's default sections)
    "qwen35": ("Qwen3_5TextConfig", "Qwen3_5ForCausalLM", dict(intermediate_size=128, **_LINEAR)),
    "qwen35moe": (
        "Qwen3_5MoeTextConfig",
        "Qwen3_5MoeForCausalLM",
        dict(shared_expert_intermediate_size=32, **_MOE, **_LINEAR),
    ),
    "qwen3next": (
        "Qwen3NextConfig",
        "Qwen3NextForCausalLM",
        dict(intermediate_size=128, shared_expert_intermediate_size=32, **_MOE, **_LINEAR),
    ),
    # alternating sliding-window (8 positions: shorter than the prompts) and full attention, MoE, sinks
    "gpt-oss": (
        "GptOssConfig",
        "GptOssForCausalLM",
        dict(
            intermediate_size=32,
            num_local_experts=4,
            num_experts_per_tok=2,
            sliding_window=8,
            layer_types=["sliding_attention", "full_attention"] * (N_LAYERS // 2),
            rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
        ),
    ),
    # Mamba-2 + attention + MoE blocks, one kind per layer (libllama's snapshot rollback covers it)
    "nemotron_h_moe": (
        "NemotronHConfig",
        "NemotronHForCausalLM",
        dict(
            intermediate_size=128,
            layers_block_type=["mamba", "moe", "attention", "moe"],
            mamba_num_heads=4,
            mamba_head_dim=16,
            ssm_state_size=16,
            n_groups=1,
            expand=1,
            chunk_size=16,
            use_mamba_kernels=False,
            n_routed_experts=4,
            num_experts_per_tok=2,
            moe_intermediate_size=32,
            moe_shared_expert_intermediate_size=32,
        ),
    ),
    # alternating sliding-window and full attention, per-layer input embeddings
    "gemma4": (
        "Gemma4TextConfig",
        "Gemma4ForCausalLM",
        dict(
            intermediate_size=128,
            sliding_window=8,
            hidden_size_per_layer_input=16,
            vocab_size_per_layer_input=VOCAB,
            layer_types=["sliding_attention", "full_attention"] * (N_LAYERS // 2),
        ),
    ),
    # archs libllama cannot feed a drafter (no layer inputs in their graphs)
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", dict(intermediate_size=128)),
}
UNSUPPORTED = ("qwen2",)
RECURRENT = ("qwen35", "qwen35moe", "qwen3next", "nemotron_h_moe")


@functools.cache
def hf_dir(arch: str, seed: int = 0) -> Path:
    import torch
    import transformers

    config_cls, model_cls, kwargs = ARCHS[arch]
    out = _workdir() / f"hf-{arch}"
    if (out / "config.json").exists():
        return out
    torch.manual_seed(seed)
    config = getattr(transformers, config_cls)(**{**_COMMON, **kwargs})
    model = getattr(transformers, model_cls)(config).to(torch.float32).eval()
    with torch.no_grad():
        model.lm_head.weight.normal_(0.0, 1.0)
    tmp = out.with_name(out.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    save_with_tinycode_tokenizer(model, tmp)
    tmp.replace(out)
    return out


def save_with_tinycode_tokenizer(model: Any, out: Path) -> None:
    """A transformers model saved to the directory out (safetensors) with the bundled tinycode tokenizer,
    as upstream's converter reads it."""
    model.save_pretrained(out, safe_serialization=True)
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        shutil.copy(TINY / "target" / name, out / name)


_UPSTREAM_CONVERT = """
import runpy, sys
llama_cpp, args = sys.argv[1], sys.argv[2:]
sys.path[:0] = [llama_cpp, llama_cpp + "/gguf-py"]
import conversion.base
conversion.base.TextModel.get_vocab_base_pre = lambda self, tokenizer: "gpt-2"
import conversion.gemma  # its converter reads only SentencePiece-style vocabularies
conversion.gemma.Gemma4Model.set_vocab = lambda self: self._set_vocab_gpt2()
sys.argv = ["convert_hf_to_gguf.py", *args]
runpy.run_path(llama_cpp + "/convert_hf_to_gguf.py", run_name="__main__")
"""


def upstream_convert(src: Path, outfile: Path, *extra: str, outtype: str = "f32") -> Path:
    """Run upstream's convert_hf_to_gguf.py; raise with its output on failure."""
    if not (LLAMA_CPP / "convert_hf_to_gguf.py").is_file():
        raise FileNotFoundError(f"{LLAMA_CPP}/convert_hf_to_gguf.py (unpacked by scripts/build_llama_server.sh)")
    cmd = [
        sys.executable,
        "-c",
        _UPSTREAM_CONVERT,
        str(LLAMA_CPP),
        str(src),
        "--outfile",
        str(outfile),
        "--outtype",
        outtype,
        *extra,
    ]
    res = subprocess.run(cmd, capture_output=True, text=True, env={**os.environ, "NO_LOCAL_GGUF": "1"})
    if res.returncode != 0 or not outfile.exists():
        raise RuntimeError(
            f"upstream conversion of {src} failed ({res.returncode}):\n{res.stdout[-3000:]}\n{res.stderr[-3000:]}"
        )
    return outfile


@functools.cache
def target_gguf(arch: str) -> Path:
    out = _workdir() / f"target-{arch}.gguf"
    if not out.exists():
        extra = ("--no-mtp",) if arch in RECURRENT else ()
        upstream_convert(hf_dir(arch), out, *extra)
    return out


@functools.cache
def drafter_for(arch: str, seed: int = 7) -> Path:
    """A random DFlash2 drafter (1 layer, block 8) reading target layers 1 and 2 of `arch`'s target.

    Its final norm is scaled down to near zero, so its logits are nearly flat: at a high temperature a
    draft token is then accepted with probability about sum_t min(p(t), 1/vocab), and sampled runs see
    partial acceptances (rollbacks of every length), which greedy runs with a random drafter do not."""
    import numpy as np
    from factories import make_checkpoint

    src = _workdir() / f"drafter-{arch}"
    make_checkpoint(
        src,
        version=2,
        hidden=HIDDEN,
        n_layers=1,
        heads=HEADS,
        kv_heads=KV_HEADS,
        head_dim=HEAD_DIM,
        ff=128,
        vocab=VOCAB,
        n_target_layers=N_LAYERS,
        target_layer_ids=(1, 2),
        top_k=4,
        rank=8,
        conv_kernel=2,
        conv_group=16,
        seed=seed,
        extra={"norm.weight": np.full(HIDDEN, 1e-3, np.float32)},
    )
    return convert(src, target_gguf(arch), _workdir() / f"drafter-{arch}.gguf", "f32")


def target_config(arch: str) -> dict[str, Any]:
    return json.loads((hf_dir(arch) / "config.json").read_text())
