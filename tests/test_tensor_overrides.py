"""Target weights placed by name, as llama-server's --override-tensor / --cpu-moe / --n-cpu-moe: the way a MoE
target (Qwen3-Coder-30B-A3B, Qwen3.5-35B-A3B, gpt-oss) runs on a GPU too small for its experts. libllama logs
every weight it places by an override ("... buffer type overridden to CPU"), which these tests count."""

from __future__ import annotations

import json
import re
import subprocess
import sys

import pytest

pytest.importorskip("llama_cpp", reason="llama-cpp-python is not installed")
from tinycode import PROMPTS, THREADS, inflated_moe  # noqa: E402

from dflash_gguf import DFlashError, SpeculativeLlama  # noqa: E402
from dflash_gguf.speculative import tensor_overrides  # noqa: E402

EXPERT_NAMES = ("blk.{}.ffn_up_exps.weight", "blk.{}.ffn_gate_exps.weight", "blk.{}.ffn_down_exps.weight")
# what else libllama names a routed expert (some archs fuse gate and up, some keep experts in chunks)
OTHER_EXPERT_NAMES = ("blk.{}.ffn_gate_up_exps.weight", "blk.{}.ffn_down_chexps.weight", "blk.{}.ffn_down_exps.bias")


def _placed(overrides: list[tuple[str, str]], name: str) -> str | None:
    """Where the first matching override puts the tensor `name` (libllama searches each regex in order)."""
    return next((buft for pattern, buft in overrides if re.search(pattern, name)), None)


def test_overrides_parse_as_llama_servers() -> None:
    assert tensor_overrides("exps=CPU,attn_q=CUDA0") == [("exps", "CPU"), ("attn_q", "CUDA0")]
    assert tensor_overrides(["a=CPU", " b=Vulkan0 ", ""]) == [("a", "CPU"), ("b", "Vulkan0")]
    assert tensor_overrides(None) == []
    every = tensor_overrides(None, cpu_moe=True)
    first_two = tensor_overrides(None, n_cpu_moe=2)
    for layer in (0, 1, 2, 10, 11):
        for name in EXPERT_NAMES + OTHER_EXPERT_NAMES:
            assert _placed(every, name.format(layer)) == "CPU"
            assert _placed(first_two, name.format(layer)) == ("CPU" if layer < 2 else None)
    for name in ("blk.0.ffn_up_shexp.weight", "blk.0.ffn_gate_inp.weight", "blk.0.attn_q.weight", "output.weight"):
        assert _placed(every, name) is None, name  # shared experts, routers and the rest stay with their layer
    for bad in ("expsCPU", "=CPU", "exps="):
        with pytest.raises(ValueError, match=re.escape(f"override_tensor: {bad!r}: expected PATTERN=BUFFER_TYPE")):
            tensor_overrides(bad)
    with pytest.raises(ValueError, match="n_cpu_moe must be an int >= 0, got -1"):
        tensor_overrides(None, n_cpu_moe=-1)


def _generate(target: str, draft: str, *args: str) -> subprocess.CompletedProcess[str]:
    cmd = [sys.executable, "-m", "dflash_gguf.cli", "generate", "-m", target, "-d", draft, "-t", str(THREADS)]
    cmd += ["-p", "def main(", "-n", "16", "--n-max", "3", "--no-stream", "--verbose", *args]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=120)


def _placed_by_override(log: str) -> dict[str, str]:
    """Weight name -> the CPU buffer type an override placed it in, as libllama logs it: "CPU", or one of the
    CPU's repacked buffers where that takes the weight (an override to the CPU considers them: a Q4_K
    weight goes to CPU_REPACK on an AVX2 CPU). On a CPU with AMX our runtime also places a quantized
    target's weights in ggml's repacked layout by overrides of its own, with no flag given."""
    return dict(re.findall(r"tensor (\S+) \(.*buffer type overridden to (CPU\S*)$", log, re.M))


def _overridden(log: str, without_flags: str) -> set[str]:
    """The weights the flags placed: those placed by an override other than as without them."""
    before = _placed_by_override(without_flags)
    return {name for name, buft in _placed_by_override(log).items() if before.get(name) != buft}


def test_experts_are_placed_where_the_flags_say() -> None:
    """On the small Qwen3 MoE (the 4.5B-moe layout): --cpu-moe places every layer's experts, --n-cpu-moe 2
    those of layers 0 and 1, -ot what its regex matches, and nothing else; the text is the same."""
    size, pair = inflated_moe()
    target, draft = str(pair.targets["q4_k_m"]), str(pair.draft)
    runs = {
        "none": _generate(target, draft),
        "cpu-moe": _generate(target, draft, "--cpu-moe"),
        "n-cpu-moe": _generate(target, draft, "--n-cpu-moe", "2"),
        "ot": _generate(target, draft, "-ot", r"blk\.3\.ffn_down=CPU"),
    }
    for what, r in runs.items():
        assert r.returncode == 0, (what, r.stderr[-2000:])
        assert r.stdout == runs["none"].stdout, what
    experts = {name.format(i) for i in range(size.n_layers) for name in EXPERT_NAMES}
    none = runs["none"].stderr
    assert set(_placed_by_override(none).values()) <= {"CPU_REPACK"}  # at most our runtime's own, on AMX
    assert _overridden(runs["cpu-moe"].stderr, none) == experts
    assert _overridden(runs["n-cpu-moe"].stderr, none) == {name.format(i) for i in (0, 1) for name in EXPERT_NAMES}
    assert _overridden(runs["ot"].stderr, none) == {"blk.3.ffn_down_exps.weight"}


def test_a_bad_override_names_the_file_and_the_override() -> None:
    """Refused before libllama loads anything (libllama itself would only log a bad regex and fail the
    load), with the buffer types this build has; the Python process goes on."""
    _, pair = inflated_moe()
    target, draft = str(pair.targets["f16"]), str(pair.draft)
    unknown = re.escape(f"{target}: tensor override 'exps=GPU9': unknown buffer type 'GPU9' (this build has: ")
    with pytest.raises(DFlashError, match=unknown + ".*CPU"):
        SpeculativeLlama(target, draft, n_threads=THREADS, override_tensor="exps=GPU9")
    with pytest.raises(DFlashError, match=re.escape(f"{target}: tensor override 'ex(ps': not a regular expression")):
        SpeculativeLlama(target, draft, n_threads=THREADS, override_tensor="ex(ps=CPU")
    r = _generate(target, draft, "-ot", "exps=GPU9")
    assert r.returncode != 0 and "unknown buffer type 'GPU9'" in r.stderr and "Traceback" not in r.stderr, r.stderr


def test_the_bench_places_the_weights_alike_for_ours_and_llama_server(tmp_path) -> None:  # type: ignore[no-untyped-def]
    """`dflash bench --cpu-moe -ot ...`: our models get the overrides and llama-server the same flags (it
    starts with them and decodes the same text)."""
    from test_bench import server_available

    _, pair = inflated_moe()
    systems = "ar,ours,upstream" if server_available() else "ar,ours"
    cmd = [sys.executable, "-m", "dflash_gguf.cli", "bench", "--target", str(pair.targets["f16"]), "--draft"]
    cmd += [str(pair.draft), "--prompts", str(PROMPTS), "--threads", str(THREADS), "--no-progress", "--limit", "1"]
    cmd += ["-n", "8", "--n-max", "3", "--systems", systems, "--json", str(tmp_path / "r.json")]
    cmd += ["--cpu-moe", "-ot", r"blk\.0\.attn_q=CPU"]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    meta = json.loads((tmp_path / "r.json").read_text())["meta"]
    assert (meta["cpu_moe"], meta["override_tensor"]) == (True, [r"blk\.0\.attn_q=CPU"])
    assert meta["server_args"][:3] == ["-ot", r"blk\.0\.attn_q=CPU", "--cpu-moe"]
    same = re.search(r"greedy output identical to ar: (.*)", r.stdout)
    assert same and "ours 1/1" in same[1] and ("upstream 1/1" in same[1] or "upstream" not in systems), r.stdout
    bad = subprocess.run([*cmd[:-3], "-ot", "x=GPU9"], capture_output=True, text=True, timeout=120)
    assert bad.returncode != 0 and "unknown buffer type 'GPU9'" in bad.stderr, bad.stderr[-2000:]
