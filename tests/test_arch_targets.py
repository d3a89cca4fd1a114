"""The loop on the target architectures the published drafters serve, each by its memory kind.

Tiny random-weight targets built by transformers from configs and converted by upstream's
convert_hf_to_gguf.py (tests/arch_targets.py), each with a random DFlash2 drafter from dflash-convert:

* llama, qwen3moe, gpt-oss (sliding window + MoE + sinks), gemma4: attention K/V, rolled back with seq_rm;
* qwen35, qwen35moe (Gated DeltaNet + attention, M-RoPE), nemotron_h_moe (Mamba-2 + attention + MoE):
  libllama's recurrent-state snapshots;
* qwen3next: no snapshots in libllama, so a checkpoint before each verify, restored on a rejection with
  the kept tokens re-decoded;
* qwen2: libllama exposes no layer inputs for it: refused when the object is built.

Greedy output must be the target's own (plain one-token-at-a-time libllama through llama_cpp.Llama, near-
ties of its top-2 logits tolerated and reported); sampled output's logprobs must be what a fresh decode
of the same tokens gives (a rollback that left a wrong recurrent state would change them).
"""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("transformers", reason="transformers builds the tiny targets")

from arch_targets import ARCHS, RECURRENT, UNSUPPORTED, drafter_for, target_gguf  # noqa: E402
from test_llama_server import llama_server  # noqa: E402, F401 (the fixture: skipped without it, failed in CI)
from tinycode import GreedyReference, compare_greedy, record  # noqa: E402

from dflash_gguf import DFlashError, SpeculativeLlama  # noqa: E402

SUPPORTED = [a for a in ARCHS if a not in UNSUPPORTED]
MEMORY = {
    "qwen35": "recurrent-snapshots",
    "qwen35moe": "recurrent-snapshots",
    "nemotron_h_moe": "recurrent-snapshots",
    "qwen3next": "recurrent-checkpoint",
    "gpt-oss": "sliding-window",
    "gemma4": "sliding-window",
}
SLIDING = [a for a in SUPPORTED if MEMORY.get(a) == "sliding-window"]
# libllama's log line per KV cache (a sliding-window target has two: full attention, then sliding)
KV_CELLS = re.compile(r"llama_kv_cache: size = .*?\( *(\d+) cells")
PROMPTS = ["def foo(x):\n    return", "import os\nimport sys\n\nclass A:", "for i in range(10):\n    print(i)\n"]
N_NEW = 24
EPS = 1e-3  # F32 targets: batched and one-token decoding agree far closer than this
N_CTX = 512


@pytest.fixture(scope="module", params=SUPPORTED)
def arch(request: pytest.FixtureRequest) -> str:
    return request.param


@pytest.fixture(scope="module")
def ref(arch: str) -> GreedyReference:
    return GreedyReference(target_gguf(arch), n_ctx=N_CTX, n_threads=1)


def _spec(arch: str, n_max: int | str = 3) -> SpeculativeLlama:
    # fallback off: a random drafter's drafts are all rejected, and every step should still draft
    return SpeculativeLlama(
        str(target_gguf(arch)), str(drafter_for(arch)), n_ctx=N_CTX, n_threads=1, n_max=n_max, fallback=False
    )


@pytest.mark.parametrize("n_max", [1, 3, 7, "auto"])
def test_greedy_is_the_targets_own_with_each_prompt_twice(arch: str, ref: GreedyReference, n_max: int | str) -> None:
    spec = _spec(arch, n_max)
    assert spec._spec.target_memory == MEMORY.get(arch, "attention")
    problems, ties = [], []
    for text in PROMPTS:
        prompt = ref.tokenize(text)
        for rep in range(2):  # the second time reuses the cached prompt but its last token
            ours = list(spec.generate_tokens(prompt, max_tokens=N_NEW))
            p, t = compare_greedy(ref, prompt, ours, N_NEW, EPS, f"{arch} n_max={n_max} {text[:12]!r} #{rep}")
            problems += p
            ties += t
        assert spec.stats.reused_prompt_tokens == len(prompt) - 1
    record(f"arch_{arch}_{n_max}", {"near_ties": [vars(t) for t in ties], "rollback": spec._spec.rollback_counters})
    assert not problems, problems
    if n_max != "auto":
        # no fallback to plain decoding; a step with one token left to generate is a plain one
        assert spec.stats.steps > 0 and spec.stats.plain_steps <= 1
    counters = spec._spec.rollback_counters
    if arch in RECURRENT:
        assert counters["seq_rm"] == 0
        # snapshot rollbacks where libllama has them, else a restored checkpoint per rejected verify
        assert counters["snapshot" if MEMORY[arch] == "recurrent-snapshots" else "restored"] > 0
    else:
        # a sliding-window cache of a window and a batch (512) holds all of this context: seq_rm alone
        assert counters["snapshot"] == counters["restored"] == counters["checkpoints"] == 0


def test_sampled_logprobs_are_a_fresh_decodes(arch: str, ref: GreedyReference) -> None:
    """At T = 4 with a near-flat drafter some drafts are accepted and some rejected at every position: each
    emitted token's logprob must be the target's after exactly the tokens before it."""
    spec = _spec(arch, 3)
    kw = dict(max_tokens=40, temperature=4.0, top_k=0, top_p=1.0, min_p=0.0, seed=11, logprobs=1)
    prompt = ref.tokenize(PROMPTS[0])
    out = spec.create_completion(prompt, **kw)
    again = spec.create_completion(prompt, **kw)
    assert again["choices"][0]["text"] == out["choices"][0]["text"]  # a fixed n_max repeats its draws
    s = spec.stats
    assert 0 < s.accepted < s.drafted, vars(s)
    tokens = spec.tokenize(out["choices"][0]["text"].encode(), add_bos=False)
    lp = out["choices"][0]["logprobs"]["token_logprobs"]
    # the text may tokenize differently from the emitted ids: compare over the emitted ids themselves
    ids = list(spec._completion_tokens)
    assert len(ids) == len(lp) > 0, (len(ids), len(lp), len(tokens))
    llm = ref.llm
    llm.reset()
    llm.eval(prompt + ids)
    rows = np.asarray(llm.scores[len(prompt) - 1 : len(prompt) - 1 + len(ids)], dtype=np.float64)
    want = rows[np.arange(len(ids)), ids] - np.log(np.exp(rows - rows.max(1, keepdims=True)).sum(1)) - rows.max(1)
    np.testing.assert_allclose(lp, want, atol=2e-3)


def test_state_save_and_load(arch: str, ref: GreedyReference) -> None:
    spec = _spec(arch, 3)
    a, b = (ref.tokenize(t) for t in PROMPTS[:2])
    out_a = list(spec.generate_tokens(a, max_tokens=8))
    state = spec.save_state()
    list(spec.generate_tokens(b, max_tokens=8))
    spec.load_state(state)
    assert spec._spec.cached_tokens == list(state.input_ids)
    follow = a + out_a + ref.tokenize("\n")
    ours = list(spec.generate_tokens(follow, max_tokens=N_NEW))
    assert spec.stats.reused_prompt_tokens == len(state.input_ids)
    problems, _ = compare_greedy(ref, follow, ours, N_NEW, EPS, f"{arch} after load_state")
    assert not problems, problems


@pytest.mark.parametrize("arch_", [a for a in SUPPORTED if a in RECURRENT])
def test_an_adopted_llama_without_snapshots_takes_the_checkpoint_path(arch_: str) -> None:
    import llama_cpp

    llm = llama_cpp.Llama(str(target_gguf(arch_)), n_ctx=N_CTX, n_threads=1, verbose=False)
    spec = SpeculativeLlama.from_llama(llm, str(drafter_for(arch_)), n_max=3, fallback=False)
    assert spec._spec.target_memory == "recurrent-checkpoint"
    ref = GreedyReference(target_gguf(arch_), n_ctx=N_CTX, n_threads=1)
    prompt = ref.tokenize(PROMPTS[1])
    for rep in range(2):
        ours = list(spec.generate_tokens(prompt, max_tokens=N_NEW))
        problems, _ = compare_greedy(ref, prompt, ours, N_NEW, EPS, f"{arch_} adopted #{rep}")
        assert not problems, problems
    assert spec._spec.rollback_counters["restored"] > 0


def _sliding_requests(
    arch_: str, ref: GreedyReference, swa_full: bool, capfd: pytest.CaptureFixture[str]
) -> tuple[list[str], list[dict[str, int]]]:
    """The requests of the test below on a new object: the cells of the full-attention and the sliding-window
    cache (libllama's log) and the rollback counters after each request."""
    short, other = ref.tokenize(PROMPTS[1]), ref.tokenize(PROMPTS[0])
    long = ref.tokenize("\n".join([PROMPTS[2], PROMPTS[0]] * 24))
    assert long[: len(short)] != short and len(long) > 300
    capfd.readouterr()
    spec = SpeculativeLlama(
        str(target_gguf(arch_)), str(drafter_for(arch_)), n_ctx=1024, n_batch=64, n_threads=1, n_max=3,
        fallback=False, swa_full=swa_full, verbose=True,
    )  # fmt: skip
    cells = KV_CELLS.findall(capfd.readouterr().err)
    assert spec._spec.target_memory == "sliding-window"
    counts: list[dict[str, int]] = []

    def run(prompt: list[int], n: int) -> list[int]:
        ours = list(spec.generate_tokens(prompt, max_tokens=n))
        assert len(ours) == n  # no end-of-generation token before
        problems, _ = compare_greedy(ref, prompt, ours, n, EPS, f"{arch_} swa_full={swa_full} #{len(counts)}")
        assert not problems, problems
        counts.append(dict(spec._spec.rollback_counters))
        return ours

    # replies longer than the window's 248 spare positions
    first = run(short, 300)
    again = short + first[:20] + other  # leaves the first reply after 20 of its tokens
    run(again, 300)
    # the tokens after the first prompt's checkpoint are decoded again: not counted as reused
    assert spec.stats.reused_prompt_tokens == len(short) + (20 if swa_full else 0)
    run(again, N_NEW)  # the reply regenerated
    assert spec.stats.reused_prompt_tokens == len(again) - 1
    run(long, N_NEW)  # shares no prefix: the context cleared
    run(long[:50] + short, N_NEW)
    assert spec.stats.reused_prompt_tokens == (50 if swa_full else 0)  # without, decoded again from the start
    return cells, counts


@pytest.mark.parametrize("arch_", SLIDING)
def test_sliding_layers_hold_a_window_and_roll_back_past_it(arch_: str, capfd: pytest.CaptureFixture[str]) -> None:
    """Without swa_full the target's sliding-window layers (window 8) hold 256 positions (libllama pads the
    window and a 64-token batch) of a 1024-token context: a verify's rollback is always within them; a
    deeper one restores the checkpoint of a prompt's end, before the new end (its tokens after it re-decoded)
    or after it (a regenerated reply), or without one re-decodes from the start. Greedy output stays the
    target's own (a plain seq_rm there decodes other tokens). swa_full keeps all 1024 and rolls back by
    seq_rm alone."""
    ref = GreedyReference(target_gguf(arch_), n_ctx=1024, n_threads=1)
    cells, counts = _sliding_requests(arch_, ref, False, capfd)
    assert cells == ["1024", "256"], cells
    got = [(c["restored"], c["replayed_tokens"]) for c in counts]
    # the first prompt's end, 20 tokens before the new end; the second's, after it; none left for position 50
    assert got == [(0, 0), (1, 20), (2, 20), (2, 20), (2, 70)], got
    cells, counts = _sliding_requests(arch_, ref, True, capfd)
    assert cells == ["1024", "1024"], cells
    assert all(c["restored"] == c["replayed_tokens"] == c["checkpoints"] == 0 for c in counts), counts


def test_generate_passes_swa_full_to_the_target() -> None:
    """`dflash generate --swa-full` (serve opens its model the same way) gives the target's sliding layers
    every position, without it a window's worth; the text is the same."""
    arch_ = SLIDING[0]

    def generate(*extra: str) -> tuple[list[str], str]:
        cmd = [
            sys.executable, "-m", "dflash_gguf.cli", "generate", "-m", str(target_gguf(arch_)),
            "-d", str(drafter_for(arch_)), "-c", "1024", "-b", "64", "-t", "1", "-n", "8", "-p", PROMPTS[0],
            "--no-stream", "--verbose", *extra,
        ]  # fmt: skip
        r = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
        assert r.returncode == 0, r.stderr
        return KV_CELLS.findall(r.stderr), r.stdout

    cells, text = generate()
    cells_full, text_full = generate("--swa-full")
    assert (cells, cells_full) == (["1024", "256"], ["1024", "1024"])
    assert text == text_full and text.startswith(PROMPTS[0])


def test_bench_passes_swa_full_to_both_systems(tmp_path: Path) -> None:
    """`dflash bench --swa-full` hands llama-server its --swa-full and ours' target keeps every position in
    its sliding layers (so it keeps no prompt checkpoints); without it ours keeps a window and checkpoints."""
    import json

    from dflash_gguf.bench import BenchOptions
    from dflash_gguf.bench.three_way import _make_llm

    arch_ = SLIDING[0]
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text(json.dumps({"text": PROMPTS[0]}) + "\n")
    out = tmp_path / "bench.json"
    cmd = [
        sys.executable, "-m", "dflash_gguf.cli", "bench", "--target", str(target_gguf(arch_)),
        "--draft", str(drafter_for(arch_)), "--prompts", str(prompts), "--systems", "ar,ours", "-n", "4",
        "-t", "1", "-c", "1024", "--n-max", "3", "--no-progress", "--swa-full", "--json", str(out),
    ]  # fmt: skip
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    meta = json.loads(out.read_text())["meta"]
    assert meta["swa_full"] is True and "--swa-full" in meta["server_args"], meta

    checkpoints = []
    for swa_full in (False, True):
        opts = BenchOptions(
            str(target_gguf(arch_)), str(drafter_for(arch_)), str(prompts), n_ctx=1024, swa_full=swa_full
        )
        llm = _make_llm(opts, 3, None, 1)
        list(llm.generate_tokens(llm.tokenize(PROMPTS[0].encode(), add_bos=False), max_tokens=4))
        checkpoints.append(llm._spec.rollback_counters["checkpoints"])
    assert checkpoints == [1, 0], checkpoints


@pytest.mark.parametrize("arch_", [a for a in SUPPORTED if "moe" in a or a == "gpt-oss"])
def test_quantized_experts_go_to_the_repacked_layout(arch_: str, tmp_path: Path) -> None:
    """repack="no-amx" (the default for a quantized target on a CPU with AMX) on a MoE at Q4_0: the routed
    experts' stacks go to ggml's repacked layout too (as mul_mat_id weights), and the loop decodes the
    quantized target's own greedy output (lossless against its plain decoding in the same load)."""
    import gguf

    from dflash_convert.quantize import llama_quantize, parse_outtype
    from dflash_gguf import _core

    if not any("avx2" in line.split() for line in Path("/proc/cpuinfo").read_text(errors="replace").splitlines()):
        pytest.skip("asserts ggml's x86 Q4_0 repack, which needs AVX2 (read from Linux's /proc/cpuinfo)")
    q4 = tmp_path / "target-q4_0.gguf"
    llama_quantize(target_gguf(arch_), q4, parse_outtype("q4_0"))
    _, placed = _core.target_weight_placement(str(q4), repack="no-amx")
    experts = [
        t.name
        for t in gguf.GGUFReader(q4).tensors
        if "_exps." in t.name and t.tensor_type == gguf.GGMLQuantizationType.Q4_0 and t.shape[1] % 8 == 0
    ]
    assert experts
    assert all(any(re.search(p, name) for p, _, _ in placed) for name in experts), placed
    assert not any(re.search(p, "token_embd.weight") for p, _, _ in placed)
    spec = SpeculativeLlama(str(q4), str(drafter_for(arch_)), n_ctx=N_CTX, n_threads=1, n_max=3, repack="no-amx")
    for text in PROMPTS:
        prompt = spec.tokenize(text.encode())
        ours = list(spec.generate_tokens(prompt, max_tokens=N_NEW))
        plain = list(spec.generate_tokens(prompt, max_tokens=N_NEW, plain=True))
        assert ours == plain, text


@pytest.mark.parametrize("arch_", UNSUPPORTED)
def test_an_arch_without_layer_inputs_is_refused_in_process(arch_: str) -> None:
    import llama_cpp

    target = target_gguf(arch_)
    draft = drafter_for("llama")  # any valid drafter: the target is refused first
    with pytest.raises(DFlashError, match=rf"'{arch_}'.*does not expose its layer inputs"):
        SpeculativeLlama(str(target), str(draft), n_ctx=N_CTX, n_threads=1)
    llm = llama_cpp.Llama(str(target), n_ctx=N_CTX, n_threads=1, verbose=False)
    with pytest.raises(DFlashError, match=rf"'{arch_}'"):
        SpeculativeLlama.from_llama(llm, str(draft))
    assert llm.create_completion("x", max_tokens=2)["choices"]  # the Llama is untouched and still works


def test_llama_server_drafts_with_the_same_files(arch: str, llama_server: Path, tmp_path: Path) -> None:
    """Upstream llama-server --spec-type draft-dflash with this target and drafter: its output is its plain
    output, and ours (greedy) is a prefix of it (ours stops at an end-of-generation token; it ignores EOS)."""
    from test_llama_server import http_json, running_server

    binary = llama_server
    target, draft = target_gguf(arch), drafter_for(arch)

    def complete(base: str, text: str) -> str:
        status, body = http_json(
            base + "/completion",
            {
                "prompt": text,
                "n_predict": N_NEW,
                "temperature": 0.0,
                "top_k": 1,
                "cache_prompt": False,
                "ignore_eos": True,
            },
        )
        assert status == 200, body
        return body["content"]

    with running_server(binary, target, tmp_path / "plain.log") as base:
        plain = [complete(base, t) for t in PROMPTS[:2]]
    with running_server(binary, target, tmp_path / "draft.log", draft=draft) as base:
        drafted = [complete(base, t) for t in PROMPTS[:2]]
    assert "draft-dflash" in (tmp_path / "draft.log").read_text(errors="replace")
    assert drafted == plain
    spec = _spec(arch, 7)
    for text, theirs in zip(PROMPTS[:2], plain):
        ours = spec.create_completion(text, max_tokens=N_NEW, temperature=0.0)["choices"][0]["text"]
        assert theirs.startswith(ours) and ours, (ours, theirs)


def test_dflash_serve_answers_as_the_python_api(arch: str) -> None:
    """The server over each kind of target: the same completion twice (the second from the cached prompt)
    and a streamed one, each what the Python API gives for the same request."""
    from test_server import events, request

    from dflash_gguf.server import serving

    body = {"prompt": PROMPTS[1], "max_tokens": N_NEW, "temperature": 0.0}
    want = _spec(arch, 3).create_completion(PROMPTS[1], max_tokens=N_NEW, temperature=0.0)["choices"][0]["text"]
    with _spec(arch, "auto") as llm, serving(llm, arch) as port:
        for _ in range(2):
            status, out = request(port, "POST", "/v1/completions", body)
            assert status == 200 and out["choices"][0]["text"] == want, out
        status, payload = request(port, "POST", "/v1/completions", {**body, "stream": True})
        assert status == 200
        assert "".join(e["choices"][0]["text"] for e in events(payload)) == want
