"""The speculative loop with the drafter on a non-CPU ggml device (DFLASH_TEST_DEVICE, e.g. Vulkan0 from
scripts/vulkan_check.sh or CUDA0): it drafts what the CPU drafter drafts, so the same target outputs and
the same acceptance, at every draft length the loop runs (short blocks of 2, 3, 6 and 8 graph rows).
A graph that reads a wrong operand on the device (as ggml-vulkan did with block positions at a
misaligned offset: acceptance 2.36 against 3.32 at n_max 5) stays lossless, since the target verifies,
but accepts less. Skipped on the CPU: test_graph_parity covers the graph there."""

from __future__ import annotations

import os
import re

import pytest
from tinycode import N_CTX, TARGET, THREADS, GreedyReference, drafter_gguf, prompts

from dflash_gguf import SpeculativeLlama

DEVICE = os.environ.get("DFLASH_TEST_DEVICE", "cpu")
pytestmark = pytest.mark.skipif(
    DEVICE.lower() == "cpu",
    reason="set DFLASH_TEST_DEVICE to a non-CPU ggml device (scripts/vulkan_check.sh, scripts/gpu_check.sh)",
)

N_NEW = 40
N_PROMPTS = 3


@pytest.fixture(scope="module")
def ptoks() -> list[list[int]]:
    ref = GreedyReference(TARGET, n_ctx=N_CTX, n_threads=THREADS)
    return [ref.tokenize(p["text"]) for p in prompts()[:N_PROMPTS]]


def run(
    device: str, n_max: int, ptoks: list[list[int]], draft_vocab: list[int] | None = None
) -> tuple[list[list[int]], int, int]:
    spec = SpeculativeLlama(
        str(TARGET),
        str(drafter_gguf("f16")),
        n_ctx=N_CTX,
        n_threads=THREADS,
        n_max=n_max,
        device=device,
        draft_vocab=draft_vocab,
    )
    outs, accepted, drafted = [], 0, 0
    for p in ptoks:
        outs.append(list(spec.generate_tokens(p, max_tokens=N_NEW)))
        accepted += spec.stats.accepted
        drafted += spec.stats.drafted
    spec.close()
    return outs, accepted, drafted


@pytest.mark.parametrize("n_max", (1, 2, 5, 6))
def test_device_drafts_what_the_cpu_drafts(n_max: int, ptoks: list[list[int]]) -> None:
    cpu_out, cpu_acc, cpu_drafted = run("cpu", n_max, ptoks)
    dev_out, dev_acc, dev_drafted = run(DEVICE, n_max, ptoks)
    print(f"n_max {n_max}: accepted {dev_acc}/{dev_drafted} on {DEVICE}, {cpu_acc}/{cpu_drafted} on the CPU")
    assert cpu_acc > 0.3 * cpu_drafted  # the bundled drafter drafts well: a comparison with meaning
    # the device computes in its own precision (f16 activations, TF32): a near-tie may flip a draft
    assert dev_acc >= 0.95 * cpu_acc, f"the drafter on {DEVICE} accepted {dev_acc} tokens, on the CPU {cpu_acc}"
    assert dev_out == cpu_out


def test_a_moe_target_offloaded_with_its_experts_on_the_cpu(capfd: pytest.CaptureFixture[str]) -> None:
    """`-ngl 99 --cpu-moe`, the way a MoE too large for the GPU runs: the small Qwen3 MoE (the 4.5B-moe layout)
    on the device with every expert in CPU memory decodes what it decodes on the CPU (the device's precision
    may flip a near-tie, so most tokens), drafting as well, and libllama places exactly the experts on the CPU."""
    from tinycode import inflated_moe

    size, pair = inflated_moe()
    ref = GreedyReference(TARGET, n_ctx=N_CTX, n_threads=THREADS)
    prompt = ref.tokenize(prompts()[0]["text"])
    outs, accepted = {}, {}
    for where, kw in (("cpu", {}), (DEVICE, {"n_gpu_layers": 99, "cpu_moe": True, "verbose": True})):
        capfd.readouterr()
        spec = SpeculativeLlama(
            str(pair.targets["f16"]), str(pair.draft), n_ctx=N_CTX, n_threads=THREADS, n_max=3, device=where, **kw
        )
        log = capfd.readouterr().err  # libllama's, with verbose
        outs[where] = list(spec.generate_tokens(prompt, max_tokens=N_NEW))
        accepted[where] = spec.stats.accepted
        spec.close()
    # CPU memory: the CPU's buffer types, or the device's pinned host buffer (CUDA_Host, Vulkan_Host)
    placed = set(re.findall(r"tensor (\S+) \(.*buffer type overridden to (?:CPU|\S+_Host)", log))
    assert placed == {f"blk.{i}.ffn_{r}_exps.weight" for i in range(size.n_layers) for r in ("gate", "up", "down")}
    assert f"offloaded {size.n_layers + 1}/{size.n_layers + 1} layers to GPU" in log
    same = sum(a == b for a, b in zip(outs["cpu"], outs[DEVICE]))
    print(f"{same}/{N_NEW} tokens as on the CPU; accepted {accepted[DEVICE]} on {DEVICE}, {accepted['cpu']} on the CPU")
    assert same >= 0.9 * N_NEW and accepted[DEVICE] >= 0.9 * accepted["cpu"]


def test_decoders_sharing_weights_on_the_device_draft_alike(ptoks: list[list[int]]) -> None:
    """share_weights with the target offloaded and the drafter on the device: the shared decoder's drafter
    computes with the first one's device buffers through a backend of its own, and drafts what a separately
    loaded one drafts."""
    kw = dict(n_ctx=N_CTX, n_threads=THREADS, n_gpu_layers=99, device=DEVICE)
    first = SpeculativeLlama(str(TARGET), str(drafter_gguf("f16")), n_max=2, **kw)  # type: ignore[arg-type]
    shared = first.share_weights(n_max=5)
    fresh = SpeculativeLlama(str(TARGET), str(drafter_gguf("f16")), n_max=5, **kw)  # type: ignore[arg-type]
    assert shared._spec.draft_device == first._spec.draft_device != "CPU"
    results = []
    for spec in (shared, fresh):
        outs, accepted = [], 0
        for p in ptoks:
            outs.append(list(spec.generate_tokens(p, max_tokens=N_NEW)))
            accepted += spec.stats.accepted
        results.append((outs, accepted))
    first.close()  # the weights stay with the shared decoder
    assert list(shared.generate_tokens(ptoks[0], max_tokens=N_NEW)) == results[1][0][0]
    assert results[0] == results[1] and results[1][1] > 0
    shared.close()
    fresh.close()


def test_a_drafting_vocabulary_on_the_device_drafts_as_on_the_cpu(ptoks: list[list[int]]) -> None:
    """The head's and the codebooks' rows of a subset, uploaded to the device: drafts as the CPU's subset does
    (this subset, every third token dropped, costs acceptance, so a device ignoring it would differ)."""
    subset = [t for t in range(2048) if t % 3]
    cpu_out, cpu_acc, _ = run("cpu", 5, ptoks, subset)
    dev_out, dev_acc, dev_drafted = run(DEVICE, 5, ptoks, subset)
    full_acc = run("cpu", 5, ptoks)[1]
    print(f"subset: accepted {dev_acc}/{dev_drafted} on {DEVICE}, {cpu_acc} on the CPU; whole vocabulary {full_acc}")
    assert cpu_acc < 0.9 * full_acc
    assert dev_acc >= 0.95 * cpu_acc
    assert dev_out == cpu_out
