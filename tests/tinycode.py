"""Shared helpers for the tests that run the bundled tinycode pair end to end.

    from tinycode import TARGET, THREADS, drafter_gguf, prompts, GreedyReference

* ``drafter_gguf("f32")``: the bundled DFlash2 drafter converted with
  ``dflash-convert`` (f32 / f16 / q8_0), once per test process.
* ``sliding_drafter_gguf()``: the bundled drafter's weights with a causal
  sliding window in every layer but the last (as z-lab's Qwen3.6 drafters).
* ``random_drafter_gguf()``: a random DFlash2 checkpoint of the tinycode
  shape (``factories.make_checkpoint``) converted against the tinycode target;
  its drafts are useless, so acceptance is ~0 and the fallback kicks in.
* ``mismatched_drafter_gguf(kind)``: drafters converted against a *different*
  tiny target, unusable with the tinycode target ("vocab", "hidden", "layers").
* ``prompts()``: the 20 benchmark prompts; tokenise ``text`` with
  ``add_special=False, parse_special=False``.
* ``GreedyReference``: plain libllama greedy decoding through
  ``llama_cpp.Llama`` (one token per decode, logits read from ``llm.scores``),
  with the top-2 logit margin of every step, memoised by prefix.

Threads: ``DFLASH_TEST_THREADS`` (default 1). On the 2-core test box with
other jobs running, 2 threads per ggml threadpool made libllama decoding up to
~40x slower (spinning workers competing for the cores); 1 thread is the robust
default. Set ``DFLASH_TEST_THREADS=2`` on an idle machine.
"""

from __future__ import annotations

import atexit
import functools
import json
import os
import shutil
import subprocess
import sys
import tempfile
import zlib
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
TESTS = ROOT / "tests"
TINY = ROOT / "examples" / "tinycode"
TARGET = TINY / "target-f16.gguf"
DRAFTER_DIR = TINY / "drafter-dflash2"
PROMPTS = TINY / "prompts.jsonl"

THREADS = int(os.environ.get("DFLASH_TEST_THREADS", "1"))
N_CTX = 512
EOS = 0  # <|endoftext|>: bos = eos = pad (examples/tinycode/README.md)

if str(TESTS) not in sys.path:
    sys.path.insert(0, str(TESTS))

# where the figures the tests measure are written (near-ties, acceptance, chi-square values)
REPORT_DIR = Path(tempfile.gettempdir()) / "dflash-gguf-tests"


def record(name: str, data: Any) -> Path:
    """Write a JSON report under REPORT_DIR (and return its path)."""
    REPORT_DIR.mkdir(parents=True, exist_ok=True)
    path = REPORT_DIR / f"{name}.json"
    path.write_text(json.dumps(data, indent=2, default=float))
    return path


# --------------------------------------------------------------------------- #
# files built once per process
# --------------------------------------------------------------------------- #


@functools.cache
def _workdir() -> Path:
    d = Path(tempfile.mkdtemp(prefix="dflash-gguf-tinycode-"))
    atexit.register(shutil.rmtree, d, True)
    return d


def convert(draft_dir: Path, target: Path, outfile: Path, outtype: str = "f32") -> Path:
    """Run the dflash-convert CLI; raise with its output on failure."""
    exe = Path(sys.executable).with_name("dflash-convert")
    cmd = [str(exe)] if exe.exists() else [sys.executable, "-m", "dflash_convert"]
    cmd += [
        str(draft_dir),
        "--target",
        str(target),
        "--outfile",
        str(outfile),
        "--outtype",
        outtype,
        "--no-progress",
        "--force",
    ]
    res = subprocess.run(cmd, capture_output=True, text=True)
    if res.returncode != 0 or not outfile.exists():
        raise RuntimeError(f"{' '.join(cmd)} failed ({res.returncode}):\n{res.stdout}\n{res.stderr}")
    return outfile


# fill-in-the-middle token ids given to ordinary tokens of the tinycode vocabulary (it has none of its own)
FIM_IDS = {"pre": 2043, "suf": 2044, "mid": 2045, "rep": 2046, "sep": 2047}


@functools.cache
def fim_target_gguf() -> Path:
    """The tinycode target with FIM_IDS as its fill-in-the-middle tokens (tokenizer.ggml.fim_*_token_id).
    The model was not trained for FIM: its middles are no good, but prompt layouts and losslessness do not
    need them to be."""
    import gguf

    return _target_copy(
        "fim", {f"tokenizer.ggml.fim_{k}_token_id": (gguf.GGUFValueType.UINT32, v) for k, v in FIM_IDS.items()}
    )


def chat_target_gguf(template: str) -> Path:
    """The tinycode target with one of llama.cpp's model chat templates (models/templates/<template>.jinja
    of the llama-server source the build script unpacked) as its tokenizer.chat_template. The model was
    not trained to chat: its replies are code, but prompt layouts and reply parsing do not need better."""
    import gguf

    return _target_copy(template, {"tokenizer.chat_template": (gguf.GGUFValueType.STRING, _template_text(template))})


def _template_text(template: str) -> str:
    """llama.cpp's models/templates/<template>.jinja, from the llama-server source the build script unpacked."""
    cache = Path(os.environ.get("DFLASH_CACHE", Path.home() / ".cache" / "dflash-gguf"))
    path = (
        cache
        / "llama-server-0.3.36"
        / "src"
        / "llama_cpp_python-0.3.36"
        / "vendor"
        / "llama.cpp"
        / "models"
        / "templates"
        / f"{template}.jinja"
    )
    if not path.is_file():
        raise FileNotFoundError(f"{path} (unpacked by scripts/build_llama_server.sh)")
    return path.read_text()


def special_tokens_target(template: str, tokens: tuple[str, ...], kind: str = "CONTROL") -> Path:
    """The tinycode target under one of llama.cpp's templates (chat_target_gguf), with `tokens` as tokens of
    its vocabulary in the places of <|mask|> and its last tokens, of the gguf.TokenType `kind`: as the
    markers of gpt-oss's or Muse Glimmer's replies (CONTROL) or Qwen's <tool_call> (USER_DEFINED) are in
    their own vocabularies."""
    import gguf

    fields = gguf.GGUFReader(TARGET, "r").fields
    vocab, types = fields["tokenizer.ggml.tokens"].contents(), fields["tokenizer.ggml.token_type"].contents()
    for i, token in zip((1, *range(len(vocab) - len(tokens) + 1, len(vocab))), tokens):
        vocab[i], types[i] = token, gguf.TokenType[kind]
    array = gguf.GGUFValueType.ARRAY
    return _target_copy(
        f"{template}-{kind.lower()}-{zlib.crc32(repr(tokens).encode()):08x}",
        {
            "tokenizer.chat_template": (gguf.GGUFValueType.STRING, _template_text(template)),
            "tokenizer.ggml.tokens": (array, vocab),
            "tokenizer.ggml.token_type": (array, types),
        },
    )


@functools.cache
def lora_gguf(seed: int = 0, rank: int = 8, std: float = 0.1, arch: str = "qwen3") -> Path:
    """A LoRA adapter of the tinycode target in llama.cpp's GGUF layout (general.type "adapter"): random A
    and B of `rank` on every layer's attn_q, attn_v and ffn_up, alpha = rank (so a scale is the update's
    factor). `arch` other than the target's makes one libllama refuses."""
    import gguf

    rng = np.random.default_rng(seed)
    out = _workdir() / f"lora-{arch}-{seed}-{rank}.gguf"
    w = gguf.GGUFWriter(str(out), arch)
    w.add_string("general.type", "adapter")
    w.add_string("adapter.type", "lora")
    w.add_float32("adapter.lora.alpha", float(rank))
    reader = gguf.GGUFReader(TARGET, "r")
    for t in reader.tensors:
        if t.name.split(".")[-2] in ("attn_q", "attn_v", "ffn_up"):
            n_in, n_out = (int(d) for d in t.shape)  # ggml order: ne0 = the input's width
            w.add_tensor(t.name + ".lora_a", (rng.standard_normal((rank, n_in)) * std).astype(np.float32))
            w.add_tensor(t.name + ".lora_b", (rng.standard_normal((n_out, rank)) * std).astype(np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return out


def _target_copy(tag: str, new: dict[str, tuple[Any, Any]]) -> Path:
    """The tinycode target with metadata keys added or replaced, written once per test process."""
    import gguf
    from gguf.scripts.gguf_new_metadata import MetadataDetails, copy_with_new_metadata

    out = _workdir() / f"target-f16-{tag}.gguf"
    if not out.exists():
        reader = gguf.GGUFReader(TARGET, "r")
        tmp = out.with_suffix(".tmp")
        writer = gguf.GGUFWriter(tmp, "qwen3", endianess=reader.endianess)
        copy_with_new_metadata(reader, writer, {k: MetadataDetails(t, v) for k, (t, v) in new.items()}, [])
        tmp.replace(out)
    return out


# the widths that build an inflated layout in seconds (272: a multiple of 16 above tinycode's 256)
_SMALL = dict(hidden=272, n_heads=4, n_kv_heads=2, ff=768, vocab=4096)
_SMALL_HYBRID = _SMALL | dict(ssm_k_heads=2, ssm_v_heads=4, ssm_head_dim=64, draft_heads=(8, 4, 128))


def _small_pair(size_name: str, name: str, **shape: Any) -> tuple[Any, Any]:
    """(ScaleSize, Pair): `dflash bench --scale`'s layout `size_name` at the given widths, inflated from the
    bundled pair, with F16 and Q4_K_M targets."""
    import dataclasses

    from dflash_gguf.bench.inflate import SIZES, ensure_pair

    size = dataclasses.replace(SIZES[size_name], name=name, **shape)
    return size, ensure_pair(size, _workdir() / "inflated", target_types=("f16", "q4_k_m"))


@functools.cache
def inflated_hybrid() -> tuple[Any, Any]:
    """The 2.8B-hybrid layout (Qwen3.5: Gated DeltaNet layers, gated attention over a partly rotated wide
    head), small (_small_pair)."""
    return _small_pair("2.8B-hybrid", "hybrid-test", **_SMALL_HYBRID)


@functools.cache
def inflated_hybrid_moe() -> tuple[Any, Any]:
    """The 7B-hybrid-moe layout (Qwen3.5 MoE: the hybrid's layers with a FFN split between a shared expert,
    its first 256 units, and routed experts, the other 512), small (_small_pair)."""
    return _small_pair(
        "7B-hybrid-moe", "hybrid-moe-test", **_SMALL_HYBRID, n_experts=8, n_experts_used=2, shared_ff=256
    )


@functools.cache
def inflated_moe() -> tuple[Any, Any]:
    """The 4.5B-moe layout (Qwen3 MoE: every expert the layer's FFN, a random router), small (_small_pair)."""
    return _small_pair("4.5B-moe", "moe-test", **_SMALL, n_experts=8)


@functools.cache
def drafter_gguf(outtype: str = "f32") -> Path:
    """The bundled trained drafter as a GGUF of the given type."""
    return convert(DRAFTER_DIR, TARGET, _workdir() / f"tinycode-drafter-{outtype}.gguf", outtype)


@functools.cache
def sliding_drafter_gguf(
    window: int = 16, outtype: str = "f32", drafter_dir: Path = DRAFTER_DIR, target: Path = TARGET
) -> Path:
    """The trained drafter's weights (the bundled pair's, or drafter_dir's for `target`) configured as z-lab's
    Qwen3.6 drafters are: every layer but the last slides over `window` positions and is causal. Trained
    without either, it drafts worse, not uselessly."""
    name = f"sliding-{drafter_dir.parent.name}-{window}"
    return convert(_sliding_drafter_dir(window, drafter_dir), target, _workdir() / f"{name}-{outtype}.gguf", outtype)


@functools.cache
def _sliding_drafter_dir(window: int, drafter_dir: Path) -> Path:
    src = _workdir() / f"sliding-{drafter_dir.parent.name}-{window}"
    src.mkdir()
    cfg = json.loads((drafter_dir / "config.json").read_text())
    n = cfg["num_hidden_layers"]
    cfg |= {
        "use_sliding_window": True,
        "sliding_window": window,
        "layer_types": ["sliding_attention"] * (n - 1) + ["full_attention"],
    }
    (src / "config.json").write_text(json.dumps(cfg))
    (src / "model.safetensors").symlink_to(drafter_dir / "model.safetensors")
    return src


@functools.cache
def random_drafter_gguf(seed: int = 1234) -> Path:
    """A random (untrained) DFlash2 drafter that fits the tinycode target."""
    from factories import make_checkpoint

    src = _workdir() / f"random-drafter-{seed}"
    make_checkpoint(
        src,
        version=2,
        hidden=256,
        n_layers=2,
        heads=4,
        kv_heads=2,
        head_dim=64,
        ff=768,
        vocab=2048,
        n_target_layers=6,
        target_layer_ids=(1, 3),
        top_k=8,
        rank=64,
        conv_kernel=2,
        conv_group=16,
        seed=seed,
    )
    return convert(src, TARGET, _workdir() / f"random-drafter-{seed}.gguf", "f32")


# kind -> (tiny target kwargs, checkpoint kwargs)
_MISMATCH = {
    # vocabulary 512 instead of 2048 (hidden 256 as the tinycode target)
    "vocab": (
        dict(vocab=512, hidden=256, n_layers=6, heads=4, kv_heads=2, head_dim=64, ff=128),
        dict(vocab=512, hidden=256, n_target_layers=6, target_layer_ids=(1, 3)),
    ),
    # hidden 128 instead of 256 (vocabulary 2048 as the tinycode target)
    "hidden": (
        dict(vocab=2048, hidden=128, n_layers=6, heads=4, kv_heads=2, head_dim=32, ff=128),
        dict(vocab=2048, hidden=128, n_target_layers=6, target_layer_ids=(1, 3)),
    ),
    # taps target layer 7 (dflash.target_layers [2, 8]); the tinycode target has 6 layers
    "layers": (
        dict(vocab=2048, hidden=256, n_layers=8, heads=4, kv_heads=2, head_dim=64, ff=128),
        dict(vocab=2048, hidden=256, n_target_layers=8, target_layer_ids=(1, 7)),
    ),
}


@functools.cache
def mismatched_drafter_gguf(kind: str) -> Path:
    """A valid drafter GGUF, converted against another tiny target, that does not fit the tinycode target."""
    from factories import make_checkpoint, make_target_gguf

    tkw, ckw = _MISMATCH[kind]
    d = _workdir() / f"mismatch-{kind}"
    d.mkdir(parents=True, exist_ok=True)
    target = d / "target.gguf"
    make_target_gguf(target, **tkw)
    make_checkpoint(d / "ckpt", version=2, n_layers=1, heads=4, kv_heads=2, head_dim=32, ff=128, top_k=4, rank=8, **ckw)
    return convert(d / "ckpt", target, d / "drafter.gguf", "f32")


# --------------------------------------------------------------------------- #
# prompts
# --------------------------------------------------------------------------- #


@functools.cache
def prompts() -> tuple[dict[str, Any], ...]:
    return tuple(json.loads(line) for line in PROMPTS.read_text().splitlines() if line.strip())


def prompt_tokens(tokenize: Any) -> list[list[int]]:
    """The 20 prompts as token ids; ``tokenize(bytes_or_str, add_special, parse_special)``."""
    return [list(tokenize(p["text"].encode("utf-8"), False, False)) for p in prompts()]


# --------------------------------------------------------------------------- #
# the greedy reference
# --------------------------------------------------------------------------- #


@dataclass
class RefRun:
    tokens: list[int]  # greedy continuation (stops after EOS, which is included)
    top2: list[tuple[int, int]]  # the two best token ids at each step
    margins: list[float]  # top-1 minus top-2 logit at each step


class GreedyReference:
    """Plain greedy decoding of the target with llama_cpp.Llama, one token per decode."""

    def __init__(self, target: Path | str = TARGET, n_ctx: int = N_CTX, n_threads: int = THREADS) -> None:
        import llama_cpp

        self.llm = llama_cpp.Llama(
            str(target), n_ctx=n_ctx, n_threads=n_threads, n_threads_batch=n_threads, logits_all=True, verbose=False
        )
        self._memo: dict[tuple[int, ...], RefRun] = {}

    def tokenize(self, text: bytes | str, add_special: bool = False, parse_special: bool = False) -> list[int]:
        if isinstance(text, str):
            text = text.encode("utf-8")
        return self.llm.tokenize(text, add_bos=add_special, special=parse_special)

    def logits_after(self, prefix: Sequence[int]) -> np.ndarray:
        """The target's next-token logits after ``prefix`` (one batched prefill)."""
        llm = self.llm
        llm.reset()
        llm.eval(list(prefix))
        return np.array(llm.scores[llm.n_tokens - 1], dtype=np.float32)

    def next_logits(self, prefix: Sequence[int], candidates: Sequence[int]) -> np.ndarray:
        """Logits after prefix + [c] for each candidate c (prefix decoded once, then one token each)."""
        llm = self.llm
        llm.reset()
        llm.eval(list(prefix))
        n = llm.n_tokens
        out = np.empty((len(candidates), llm.n_vocab()), np.float32)
        for i, c in enumerate(candidates):
            llm.n_tokens = n  # eval() drops the KV cache from n_tokens on
            llm.eval([int(c)])
            out[i] = llm.scores[n]
        return out

    def greedy(self, prefix: Sequence[int], n: int) -> RefRun:
        key = tuple(prefix)
        hit = self._memo.get(key)
        if hit is not None and (len(hit.tokens) >= n or (hit.tokens and hit.tokens[-1] == EOS)):
            return RefRun(hit.tokens[:n], hit.top2[:n], hit.margins[:n])
        llm = self.llm
        llm.reset()
        llm.eval(list(prefix))
        run = RefRun([], [], [])
        for _ in range(n):
            logits = llm.scores[llm.n_tokens - 1]
            a, b = (int(t) for t in np.argsort(-logits, kind="stable")[:2])
            run.tokens.append(a)  # argmax (the first of equal maxima)
            run.top2.append((a, b))
            run.margins.append(float(logits[a] - logits[b]))
            if a == EOS or len(prefix) + len(run.tokens) >= llm.n_ctx():
                break
            llm.eval([a])
        self._memo[key] = run
        return run


@dataclass
class NearTie:
    prompt: str
    index: int  # position in the continuation
    ours: int
    reference: int
    margin: float


def compare_greedy(
    ref: GreedyReference, prompt: Sequence[int], ours: Sequence[int], n: int, eps: float, name: str = ""
) -> tuple[list[str], list[NearTie]]:
    """Compare a greedy continuation with the reference, tolerating only near-ties.

    Where ours differs from the reference, the reference's top-2 logit margin at
    that prefix must be below ``eps`` and our token must be one of those two;
    the reference is then re-run greedily from prompt + ours[:i + 1] and the
    comparison continues. Returns (problems, near-ties).
    """
    problems: list[str] = []
    ties: list[NearTie] = []
    ours = list(ours)
    start = 0
    run = ref.greedy(list(prompt), n)
    i = 0
    while i < n:
        k = i - start
        if k >= len(run.tokens):  # the reference stopped (EOS) before this point
            problems.append(f"{name}: ours continues past the reference's end of generation at {i}")
            break
        r = run.tokens[k]
        if i >= len(ours):  # ours ended with an end-of-generation token (not yielded)
            if r != EOS:
                if EOS in run.top2[k] and run.margins[k] < eps:
                    ties.append(NearTie(name, i, EOS, r, run.margins[k]))
                else:
                    problems.append(
                        f"{name}: ours stopped after {len(ours)} tokens, the reference continues "
                        f"with {r} (top-2 {run.top2[k]}, margin {run.margins[k]:.5f})"
                    )
            break
        if ours[i] != r:
            margin = run.margins[k]
            if margin >= eps or ours[i] not in run.top2[k]:
                problems.append(
                    f"{name}: token {i}: ours {ours[i]} != reference {r} (reference top-2 {run.top2[k]}, "
                    f"margin {margin:.5f} >= eps {eps} or ours not among them)"
                )
                break
            ties.append(NearTie(name, i, ours[i], r, margin))
            if ours[i] == EOS:
                break
            start = i + 1
            run = ref.greedy(list(prompt) + ours[: i + 1], n - i - 1)
        elif r == EOS:
            break
        i += 1
    return problems, ties


def sse_events(url: str, payload: dict[str, Any], timeout: float = 180) -> list[tuple[str, Any]]:
    """POST `payload` to a streaming route: each server-sent event's name ("" where unnamed) and data, a
    closing [DONE] left out."""
    import urllib.request

    req = urllib.request.Request(url, json.dumps(payload).encode(), {"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=timeout) as resp:
        blocks = resp.read().decode().split("\n\n")
    events = []
    for block in blocks:
        fields = dict(line.split(": ", 1) for line in block.splitlines() if ": " in line)
        if "data" in fields and fields["data"] != "[DONE]":
            events.append((fields.get("event", ""), json.loads(fields["data"])))
    return events


def scrape_metrics(base: str) -> tuple[dict[str, float], dict[str, str], dict[str, str]]:
    """GET base/metrics in Prometheus' text format: each sample's value by its name with labels, each
    metric's type (# TYPE lines) by its name, and the response's headers."""
    import urllib.request

    with urllib.request.urlopen(base + "/metrics", timeout=60) as resp:
        text, headers = resp.read().decode(), dict(resp.headers)
    values: dict[str, float] = {}
    types: dict[str, str] = {}
    for line in text.splitlines():
        if line.startswith("# TYPE "):
            _, _, name, kind = line.split(" ")
            types[name] = kind
        elif line and not line.startswith("#"):
            sample, value = line.rsplit(" ", 1)
            values[sample] = float(value)
    return values, types, headers
