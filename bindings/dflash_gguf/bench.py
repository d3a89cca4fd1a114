"""`dflash bench`: plain decoding vs our speculative loop vs upstream llama-server, one run.

Three systems decode the same prompts with the same GGUF files:

- ``ar``: plain C++ decoding of the target (``SpeculativeLlama.generate_tokens(..., plain=True)``:
  one ``llama_decode`` per token, same process and target context as ``ours``);
- ``ours``: our speculative loop (target in libllama, drafter in our ggml graph);
- ``upstream``: ``llama-server --spec-type draft-dflash`` started by the bench on loopback;
- ``upstream-ar`` (optional): the same server without the drafter.

Runs are interleaved prompt by prompt (ar, ours, upstream, ar, ...) so that machine drift
hits all systems alike; each system gets one warm-up request that is not counted. Speedups
are ratios to the ``ar`` run of the same prompt and round of the same configuration.
Every configuration (one per ``--n-max`` value) runs its own ``ar`` baseline.
"""

from __future__ import annotations

import gc
import json
import os
import platform
import re
import shutil
import socket
import statistics
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from ._core import default_cpu_threads

LLAMA_SERVER_VERSION = "0.3.36"
SYSTEMS = ("ar", "ours", "upstream", "upstream-ar")
DEFAULT_SYSTEMS = ("ar", "ours", "upstream")
STARTUP_TIMEOUT_S = 300.0
REQUEST_TIMEOUT_S = 600.0

NMax = int | str  # an int >= 0 (0 = block_size - 1) or "auto"


class BenchError(RuntimeError):
    """A problem the user can fix (missing binary, bad option); printed without a traceback."""


# --- options -------------------------------------------------------------


def parse_n_max(value: str | int | Sequence[Any]) -> list[NMax]:
    """'7' -> [7]; '3,7,15' -> [3, 7, 15]; 'auto' -> ['auto']; '0' = block_size - 1."""
    if isinstance(value, int):
        items: list[Any] = [value]
    elif isinstance(value, str):
        items = [v.strip() for v in value.split(",") if v.strip()]
    else:
        items = list(value)
    out: list[NMax] = []
    for v in items:
        if isinstance(v, str) and v.lower() == "auto":
            out.append("auto")
            continue
        try:
            k = int(v)
        except (TypeError, ValueError):
            raise BenchError(f"--n-max: {v!r} is neither an int nor 'auto'") from None
        if k < 0:
            raise BenchError(f"--n-max: {k} < 0 (0 = block_size - 1)")
        out.append(k)
    if not out:
        raise BenchError("--n-max: no value given")
    return out


def parse_systems(value: str | Sequence[str]) -> list[str]:
    items = [v.strip() for v in value.split(",")] if isinstance(value, str) else list(value)
    items = [v for v in items if v]
    bad = [v for v in items if v not in SYSTEMS]
    if bad:
        raise BenchError(f"--systems: unknown {', '.join(bad)} (choose from {', '.join(SYSTEMS)})")
    if not items:
        raise BenchError("--systems: none given")
    # the ar baseline always runs: speedups are ratios to it
    ordered = ["ar"] + [s for s in SYSTEMS if s in items and s != "ar"]
    return ordered


def load_prompts(path: str | Path, limit: int | None = None) -> list[dict[str, str]]:
    """JSONL with a "text" (or "prompt") field per line; "id" optional."""
    prompts = []
    with open(path, encoding="utf-8") as f:
        for i, line in enumerate(f):
            line = line.strip()
            if not line:
                continue
            try:
                obj = json.loads(line)
            except json.JSONDecodeError as e:
                raise BenchError(f"{path}:{i + 1}: not JSON ({e})") from None
            if isinstance(obj, str):
                obj = {"text": obj}
            text = obj.get("text", obj.get("prompt")) if isinstance(obj, dict) else None
            if not isinstance(text, str) or not text:
                raise BenchError(f'{path}:{i + 1}: no "text" field')
            prompts.append({"id": str(obj.get("id", f"prompt-{len(prompts)}")), "text": text})
    if limit is not None and limit > 0:
        prompts = prompts[:limit]
    if not prompts:
        raise BenchError(f"{path}: no prompts")
    return prompts


# --- upstream llama-server -----------------------------------------------


def find_server_binary(explicit: str | None = None) -> Path | None:
    """$DFLASH_LLAMA_SERVER, else the build script's cache, else llama-server on PATH."""
    if explicit:
        return Path(explicit)
    env = os.environ.get("DFLASH_LLAMA_SERVER")
    if env:
        return Path(env)
    cache = Path(os.environ.get("DFLASH_CACHE", Path.home() / ".cache" / "dflash-gguf"))
    path = cache / f"llama-server-{LLAMA_SERVER_VERSION}" / "bin" / "llama-server"
    if path.is_file():
        return path
    found = shutil.which("llama-server")
    return Path(found) if found else None


def missing_server_message() -> str:
    return (
        f"upstream llama-server {LLAMA_SERVER_VERSION} not found. Build it once (about 10 minutes on 2 cores, "
        "cached in ~/.cache/dflash-gguf/) with `scripts/build_llama_server.sh` or `make llama-server` in a "
        "dflash-gguf checkout, or point --server-binary / $DFLASH_LLAMA_SERVER at one; or leave `upstream` out "
        "of --systems."
    )


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _http(url: str, payload: dict[str, Any] | None = None, timeout: float = REQUEST_TIMEOUT_S) -> tuple[int, bytes]:
    data = json.dumps(payload).encode() if payload is not None else None
    req = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            return resp.status, resp.read()
    except urllib.error.HTTPError as e:
        return e.code, e.read()


def _gguf_is_quantized(path: str) -> bool:
    """True when any weight tensor is neither F32, F16 nor BF16 (best effort)."""
    try:
        from gguf import GGMLQuantizationType, GGUFReader

        plain = {GGMLQuantizationType.F32, GGMLQuantizationType.F16, GGMLQuantizationType.BF16}
        return any(t.tensor_type not in plain for t in GGUFReader(path).tensors)
    except Exception:  # noqa: BLE001 - a guess only decides whether to add --no-repack
        return False


def _cpu_has_amx() -> bool:
    try:
        return " amx_" in Path("/proc/cpuinfo").read_text()
    except OSError:
        return False


_PROM_RE = re.compile(r'^llamacpp:(\w+)(?:\{position="(\d+)"\})?\s+(\S+)$')


def parse_prometheus(text: str) -> dict[str, Any]:
    """The llamacpp:* counters of /metrics; per-position acceptance as a list."""
    out: dict[str, Any] = {"accepted_per_pos": []}
    per_pos: dict[int, float] = {}
    for line in text.splitlines():
        m = _PROM_RE.match(line.strip())
        if not m:
            continue
        name, pos, val = m.group(1), m.group(2), float(m.group(3))
        if pos is not None:
            per_pos[int(pos)] = val
        else:
            out[name] = val
    if per_pos:
        out["accepted_per_pos"] = [per_pos.get(i, 0.0) for i in range(max(per_pos) + 1)]
    return out


class UpstreamServer:
    """llama-server on 127.0.0.1 with a free port; started, waited for /health, stopped always."""

    def __init__(
        self,
        binary: Path,
        target: str,
        draft: str | None,
        *,
        n_max: int,
        threads: int,
        n_ctx: int,
        n_gpu_layers: int,
        seed: int,
        extra_args: Sequence[str] = (),
        log_path: Path | None = None,
    ) -> None:
        self.binary = binary
        self.port = _free_port()
        self.base = f"http://127.0.0.1:{self.port}"
        cmd = [
            str(binary),
            "-m",
            target,
            "--host",
            "127.0.0.1",
            "--port",
            str(self.port),
            "-c",
            str(n_ctx),
            "-np",
            "1",
            "-t",
            str(threads),
            "--seed",
            str(seed),
            "--metrics",
            "-ngl",
            str(n_gpu_layers),
        ]
        if draft is not None:
            cmd += [
                "-md",
                draft,
                "--spec-type",
                "draft-dflash",
                "--spec-draft-n-max",
                str(n_max),
                "--spec-draft-n-min",
                "0",
                "-td",
                str(threads),
                "-ngld",
                str(99 if n_gpu_layers > 0 else 0),
            ]
        cmd += list(extra_args)
        self.cmd = cmd
        self.log_path = log_path
        self.proc: subprocess.Popen[bytes] | None = None
        self._logf: Any = None

    def log_tail(self, n: int = 30) -> str:
        if self.log_path is None:
            return "(no log)"
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-n:])
        except OSError:
            return "(no log)"

    def __enter__(self) -> UpstreamServer:
        if self.log_path is None:
            import tempfile

            fd, name = tempfile.mkstemp(prefix="dflash-bench-server-", suffix=".log")
            os.close(fd)
            self.log_path = Path(name)
        self._logf = open(self.log_path, "wb")
        self.proc = subprocess.Popen(self.cmd, stdout=self._logf, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
        try:
            deadline = time.monotonic() + STARTUP_TIMEOUT_S
            while True:
                if self.proc.poll() is not None:
                    raise BenchError(
                        f"llama-server exited with {self.proc.returncode} during startup "
                        f"({' '.join(self.cmd)}):\n{self.log_tail()}"
                    )
                try:
                    status, _ = _http(self.base + "/health", timeout=5)
                    if status == 200:
                        break
                except (urllib.error.URLError, ConnectionError, TimeoutError, OSError):
                    pass
                if time.monotonic() > deadline:
                    raise BenchError(f"llama-server not healthy after {STARTUP_TIMEOUT_S:.0f} s:\n{self.log_tail()}")
                time.sleep(0.1)
        except BaseException:
            self.__exit__(None, None, None)
            raise
        return self

    def __exit__(self, *exc: Any) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=15)
        if self._logf is not None:
            self._logf.close()
            self._logf = None

    def metrics(self) -> dict[str, Any]:
        status, body = _http(self.base + "/metrics", timeout=30)
        if status != 200:
            return {"accepted_per_pos": []}
        return parse_prometheus(body.decode(errors="replace"))

    def complete(
        self,
        tokens: list[int],
        *,
        n_predict: int,
        temperature: float,
        top_k: int,
        top_p: float,
        min_p: float,
        seed: int,
    ) -> dict[str, Any]:
        before = self.metrics()
        payload = {
            "prompt": tokens,
            "n_predict": n_predict,
            "temperature": temperature,
            "top_k": top_k,
            "top_p": top_p,
            "min_p": min_p,
            "seed": seed,
            "typical_p": 1.0,
            "repeat_penalty": 1.0,
            "presence_penalty": 0.0,
            "frequency_penalty": 0.0,
            "dry_multiplier": 0.0,
            "xtc_probability": 0.0,
            "mirostat": 0,
            "cache_prompt": False,
            "return_tokens": True,
            "stream": False,
        }
        status, body = _http(self.base + "/completion", payload)
        if status != 200:
            raise BenchError(f"llama-server /completion answered {status}: {body[:500]!r}\n{self.log_tail()}")
        resp = json.loads(body)
        after = self.metrics()
        t = resp.get("timings", {})
        n = int(t.get("predicted_n", resp.get("tokens_predicted", 0)))
        predicted_ms = float(t.get("predicted_ms", 0.0))
        rec: dict[str, Any] = {
            "tokens": n,
            "decode_ms": predicted_ms,
            "tok_s": n / predicted_ms * 1e3 if predicted_ms > 0 else 0.0,
            "prefill_ms": float(t.get("prompt_ms", 0.0)),
            "prompt_tokens": int(t.get("prompt_n", len(tokens))),
            "drafted": int(t.get("draft_n", 0)),
            "accepted": int(t.get("draft_n_accepted", 0)),
            "output": [int(x) for x in resp.get("tokens", [])],
        }
        steps_key = "spec_decode_num_drafts_total"
        if steps_key in after and steps_key in before:
            steps = int(round(after[steps_key] - before[steps_key]))
            pos_a, pos_b = after["accepted_per_pos"], before["accepted_per_pos"]
            pos_b = pos_b + [0.0] * (len(pos_a) - len(pos_b))
            rec["steps"] = steps
            rec["pos_accepted"] = [int(round(a - b)) for a, b in zip(pos_a, pos_b)]
            rec["steps_source"] = "metrics"
        else:
            rec["steps"] = None
            rec["steps_source"] = "none"
        if rec["steps"]:
            rec["mean_accepted_length"] = (rec["accepted"] + rec["steps"]) / rec["steps"]
        elif rec["drafted"]:
            # no step count: every accepted draft token saved one target pass
            rec["mean_accepted_length"] = n / max(n - rec["accepted"], 1)
            rec["steps_source"] = "estimate predicted_n / (predicted_n - draft_n_accepted)"
        else:
            rec["mean_accepted_length"] = 1.0
        if rec.get("pos_accepted") and rec["steps"]:
            rec["pos_reached"] = [rec["steps"]] + rec["pos_accepted"][:-1]
            rec["per_position_acceptance"] = [
                a / r if r else 0.0 for a, r in zip(rec["pos_accepted"], rec["pos_reached"])
            ]
        return rec


# --- our systems ---------------------------------------------------------


def _fresh_prefill(llm: Any, prompt: list[int]) -> None:
    """Make the next generation prefill the whole prompt (the loop reuses a common prefix
    of the last prompt): one 1-token generation on a token that differs from prompt[0]."""
    tok = (prompt[0] + 1) % max(llm._spec.n_vocab, 2) if prompt else 0
    for _ in llm.generate_tokens([tok], max_tokens=1, temperature=0.0, plain=True):
        pass


def _run_ours(
    llm: Any,
    prompt: list[int],
    *,
    plain: bool,
    n_predict: int,
    temperature: float,
    top_k: int,
    top_p: float,
    min_p: float,
    seed: int,
) -> dict[str, Any]:
    _fresh_prefill(llm, prompt)
    out = list(
        llm.generate_tokens(
            prompt,
            max_tokens=n_predict,
            temperature=temperature,
            top_k=top_k,
            top_p=top_p,
            min_p=min_p,
            seed=seed,
            plain=plain,
        )
    )
    s = llm.stats
    rec: dict[str, Any] = {
        "tokens": len(out),
        "decode_ms": s.decode_ms,
        "tok_s": s.tokens_per_second,
        "prefill_ms": s.prefill_ms,
        "prompt_tokens": s.prompt_tokens,
        "reused_prompt_tokens": s.reused_prompt_tokens,
        "output": [int(t) for t in out],
    }
    if not plain:
        drafted_steps = s.steps - s.plain_steps
        rec.update(
            steps=s.steps,
            plain_steps=s.plain_steps,
            drafted=s.drafted,
            accepted=s.accepted,
            mean_accepted_length=s.mean_accepted_length,
            per_position_acceptance=list(s.per_position_acceptance),
            draft_ms=s.draft_ms,
            verify_ms=s.verify_ms,
            inject_ms=s.inject_ms,
            draft_ms_per_step=s.draft_ms / drafted_steps if drafted_steps else 0.0,
            verify_ms_per_step=s.verify_ms / s.steps if s.steps else 0.0,
        )
        raw = getattr(llm._spec, "stats", None)  # counts, to pool acceptance over prompts
        if isinstance(raw, dict) and "pos_reached" in raw:
            rec["pos_reached"] = [int(x) for x in raw["pos_reached"]]
            rec["pos_accepted"] = [int(x) for x in raw["pos_accepted"]]
    return rec


# --- the run -------------------------------------------------------------


@dataclass
class BenchOptions:
    target: str
    draft: str
    prompts: str
    n_predict: int = 128
    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    min_p: float = 0.0
    n_max: list[NMax] = field(default_factory=lambda: [0])
    repeat: int = 1
    systems: list[str] = field(default_factory=lambda: list(DEFAULT_SYSTEMS))
    threads: int = 0
    seed: int = 0
    n_ctx: int = 2048
    n_gpu_layers: int = 0
    device: str = "auto"
    draft_q: str = "logits"
    limit: int | None = None
    server_binary: str | None = None
    server_args: list[str] = field(default_factory=list)
    progress: bool = True


def _make_llm(o: BenchOptions, n_max: NMax, threads: int) -> Any:
    from .speculative import SpeculativeLlama

    try:
        return SpeculativeLlama(
            o.target,
            o.draft,
            n_ctx=o.n_ctx,
            n_gpu_layers=o.n_gpu_layers,
            n_threads=threads,
            n_max=n_max,
            draft_q=o.draft_q,
            device=o.device,
        )  # type: ignore[arg-type]
    except (TypeError, ValueError) as e:
        if n_max == "auto":
            raise BenchError(
                "--n-max auto: this build of dflash_gguf has no adaptive n_max controller yet "
                f"(SpeculativeLlama(n_max='auto') failed: {e}); pass an int or a comma list"
            ) from None
        raise


def _upstream_n_max(llm: Any, n_max: NMax) -> int:
    block = int(llm._spec.draft_hparams["block_size"])
    if isinstance(n_max, int) and n_max > 0:
        return min(n_max, block - 1)
    return block - 1  # 0 = block_size - 1; "auto": upstream has no controller, it drafts the full block


def _seed_for(base: int, prompt_index: int, rnd: int) -> int:
    return base + 1000 * rnd + prompt_index


def run_bench(o: BenchOptions, log: Callable[[str], None] = lambda s: print(s, file=sys.stderr)) -> dict[str, Any]:
    """Run every configuration; the result is what --json writes (summaries included)."""
    systems = parse_systems(o.systems)
    n_maxes = parse_n_max(o.n_max)
    if o.repeat < 1:
        raise BenchError("--repeat must be >= 1")
    if o.n_predict < 1:
        raise BenchError("-n must be >= 1")
    for what, path in (("--target", o.target), ("--draft", o.draft), ("--prompts", o.prompts)):
        if not Path(path).is_file():
            raise BenchError(f"{what}: {path} is not a file")
    threads = o.threads if o.threads > 0 else default_cpu_threads()  # what n_threads = 0 means to us
    prompts = load_prompts(o.prompts, o.limit)

    server_bin: Path | None = None
    server_extra = list(o.server_args)
    notes: list[str] = []
    if any(s.startswith("upstream") for s in systems):
        server_bin = find_server_binary(o.server_binary)
        if server_bin is None or not server_bin.is_file() or not os.access(server_bin, os.X_OK):
            raise BenchError(missing_server_message() + (f" (looked at {server_bin})" if server_bin else ""))
        if (
            "--no-repack" not in server_extra
            and "-nr" not in server_extra
            and _cpu_has_amx()
            and (_gguf_is_quantized(o.target) or _gguf_is_quantized(o.draft))
        ):
            server_extra.append("--no-repack")
            notes.append(
                "llama-server got --no-repack: llama.cpp 0.3.36's AMX repack crashes on quantized "
                "weights on this CPU (docs/converting.md)"
            )

    result: dict[str, Any] = {
        "meta": {
            "target": o.target,
            "draft": o.draft,
            "prompts": o.prompts,
            "n_prompts": len(prompts),
            "n_predict": o.n_predict,
            "temperature": o.temperature,
            "top_k": o.top_k,
            "top_p": o.top_p,
            "min_p": o.min_p,
            "seed": o.seed,
            "repeat": o.repeat,
            "systems": systems,
            "threads": threads,
            "n_ctx": o.n_ctx,
            "n_gpu_layers": o.n_gpu_layers,
            "device": o.device,
            "draft_q": o.draft_q,
            "n_max": n_maxes,
            "server_binary": str(server_bin) if server_bin else None,
            "server_args": server_extra,
            "host": platform.node(),
            "machine": platform.machine(),
            "cpu_count": os.cpu_count(),
            "python": platform.python_version(),
            "started": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        },
        "notes": notes,
        "configs": [],
    }

    n_runs = len(n_maxes) * (o.repeat * len(prompts) + 1) * len(systems)
    bar = _progress(n_runs, o.progress)
    try:
        for n_max in n_maxes:
            result["configs"].append(_run_config(o, n_max, systems, prompts, threads, server_bin, server_extra, bar))
            gc.collect()
    finally:
        bar.close()
    for cfg in result["configs"]:
        cfg["summary"] = summarize_config(cfg)
    return result


class _NoBar:
    def update(self, n: int = 1) -> None: ...
    def set_description(self, s: str) -> None: ...
    def close(self) -> None: ...


class _LineProgress:
    """Outside a terminal (CI, a log file): a line when a configuration starts, and one at the end, instead of
    a bar whose every redraw would land in the log."""

    def __init__(self, total: int) -> None:
        self.total, self.done, self.config = total, 0, ""

    def update(self, n: int = 1) -> None:
        self.done += n

    def set_description(self, s: str) -> None:
        config = s.split(" ")[0]
        if config != self.config:
            self.config = config
            print(f"[bench] {config}: {self.done}/{self.total} runs done", file=sys.stderr, flush=True)

    def close(self) -> None:
        print(f"[bench] {self.done}/{self.total} runs done", file=sys.stderr, flush=True)


def _progress(total: int, enabled: bool) -> Any:
    if not enabled:
        return _NoBar()
    if not sys.stderr.isatty():
        return _LineProgress(total)
    try:
        from tqdm import tqdm
    except ImportError:
        return _NoBar()
    return tqdm(total=total, unit="run", file=sys.stderr, dynamic_ncols=True, leave=False)


def _run_config(
    o: BenchOptions,
    n_max: NMax,
    systems: list[str],
    prompts: list[dict[str, str]],
    threads: int,
    server_bin: Path | None,
    server_extra: list[str],
    bar: Any,
) -> dict[str, Any]:
    llm = _make_llm(o, n_max, threads)
    cfg: dict[str, Any] = {
        "n_max": n_max,
        "n_max_ours": llm.n_max,
        "block_size": int(llm._spec.draft_hparams["block_size"]),
        "draft_device": getattr(llm._spec, "draft_device", None),
        "runs": [],
        "notes": [],
    }
    up_k = _upstream_n_max(llm, n_max)
    if any(s.startswith("upstream") for s in systems):
        cfg["n_max_upstream"] = up_k
        if n_max == "auto":
            cfg["notes"].append(f"upstream has no adaptive n_max: it drafts {up_k} tokens (block_size - 1)")
    token_lists = [llm.tokenize(p["text"], add_special=False, parse_special=False) for p in prompts]
    kw = dict(n_predict=o.n_predict, temperature=o.temperature, top_k=o.top_k, top_p=o.top_p, min_p=o.min_p)

    with _servers(o, systems, server_bin, server_extra, up_k, threads) as servers:

        def one(system: str, toks: list[int], seed: int) -> dict[str, Any]:
            if system in ("ar", "ours"):
                return _run_ours(llm, toks, plain=system == "ar", seed=seed, **kw)  # type: ignore[arg-type]
            return servers[system].complete(toks, seed=seed, **kw)  # type: ignore[arg-type]

        bar.set_description(f"n_max={n_max} warm-up")
        for system in systems:  # warm-up, not counted
            one(system, token_lists[0], _seed_for(o.seed, 0, -1))
            bar.update(1)
        for rnd in range(o.repeat):
            for i, (p, toks) in enumerate(zip(prompts, token_lists)):
                bar.set_description(f"n_max={n_max} round {rnd + 1}/{o.repeat} {p['id']}")
                seed = _seed_for(o.seed, i, rnd)
                ar_rec: dict[str, Any] | None = None
                for system in systems:
                    rec = one(system, toks, seed)
                    rec.update(system=system, prompt_id=p["id"], prompt_index=i, round=rnd, seed=seed)
                    if system == "ar":
                        ar_rec = rec
                    assert ar_rec is not None
                    rec["ar_tok_s"] = ar_rec["tok_s"]
                    rec["speedup_vs_ar"] = rec["tok_s"] / ar_rec["tok_s"] if ar_rec["tok_s"] > 0 else 0.0
                    if system == "ours" and ar_rec["tok_s"] > 0:
                        # what the same steps would give with no loop overhead: only the model work counted
                        work_ms = rec["draft_ms"] + rec["verify_ms"] + rec["inject_ms"]
                        rec["limit_vs_ar"] = rec["tokens"] / work_ms * 1e3 / ar_rec["tok_s"] if work_ms > 0 else 0.0
                    if o.temperature == 0.0:
                        n = min(len(rec["output"]), len(ar_rec["output"]))
                        rec["same_as_ar"] = rec["output"][:n] == ar_rec["output"][:n]
                    cfg["runs"].append(rec)
                    bar.update(1)
    llm.close()  # the model goes before the next configuration loads its own
    return cfg


@contextmanager
def _servers(
    o: BenchOptions, systems: list[str], server_bin: Path | None, extra: list[str], n_max: int, threads: int
) -> Iterator[dict[str, UpstreamServer]]:
    servers: dict[str, UpstreamServer] = {}
    try:
        for system in systems:
            if system.startswith("upstream"):
                assert server_bin is not None
                srv = UpstreamServer(
                    server_bin,
                    o.target,
                    o.draft if system == "upstream" else None,
                    n_max=n_max,
                    threads=threads,
                    n_ctx=o.n_ctx,
                    n_gpu_layers=o.n_gpu_layers,
                    seed=o.seed,
                    extra_args=extra,
                )
                srv.__enter__()
                servers[system] = srv
        yield servers
    finally:
        for srv in servers.values():
            srv.__exit__(None, None, None)
            if srv.log_path is not None:
                try:
                    srv.log_path.unlink()
                except OSError:
                    pass


# --- summaries -----------------------------------------------------------


def _quantile(xs: Sequence[float], q: float) -> float:
    s = sorted(xs)
    if not s:
        return float("nan")
    pos = q * (len(s) - 1)
    lo = int(pos)
    hi = min(lo + 1, len(s) - 1)
    return s[lo] + (s[hi] - s[lo]) * (pos - lo)


def spread(xs: Sequence[float]) -> dict[str, float]:
    return {
        "median": statistics.median(xs),
        "p10": _quantile(xs, 0.1),
        "p90": _quantile(xs, 0.9),
        "min": min(xs),
        "max": max(xs),
        "mean": statistics.fmean(xs),
    }


def pooled_acceptance(runs: Sequence[dict[str, Any]]) -> list[float] | None:
    """Conditional acceptance per draft position pooled over runs: accepted[i] / reached[i]."""
    return _pooled(runs)[0]


def pooled_reached(runs: Sequence[dict[str, Any]]) -> list[int] | None:
    """How many verify steps reached each draft position (all earlier drafts accepted), pooled."""
    return _pooled(runs)[1]


def _pooled(runs: Sequence[dict[str, Any]]) -> tuple[list[float] | None, list[int] | None]:
    reached: list[int] = []
    accepted: list[int] = []
    have = False
    for r in runs:
        if "pos_reached" in r and "pos_accepted" in r:
            have = True
            for i, (re_, ac) in enumerate(zip(r["pos_reached"], r["pos_accepted"])):
                if i >= len(reached):
                    reached.append(0)
                    accepted.append(0)
                reached[i] += re_
                accepted[i] += ac
    if have:
        # trailing positions nobody reached say nothing
        while reached and reached[-1] == 0:
            reached.pop()
            accepted.pop()
        return [a / r if r else 0.0 for a, r in zip(accepted, reached)], reached
    lists = [r["per_position_acceptance"] for r in runs if r.get("per_position_acceptance")]
    if not lists:
        return None, None
    n = max(len(x) for x in lists)
    return [statistics.fmean([x[i] for x in lists if i < len(x)]) for i in range(n)], None


def summarize_config(cfg: dict[str, Any]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    systems = list(dict.fromkeys(r["system"] for r in cfg["runs"]))
    for system in systems:
        runs = [r for r in cfg["runs"] if r["system"] == system]
        s: dict[str, Any] = {
            "runs": len(runs),
            "tokens": sum(r["tokens"] for r in runs),
            "tok_s": spread([r["tok_s"] for r in runs]),
            "speedup_vs_ar": spread([r["speedup_vs_ar"] for r in runs]),
            "prefill_ms": spread([r["prefill_ms"] for r in runs]),
        }
        if "same_as_ar" in runs[0]:
            s["same_as_ar"] = sum(bool(r["same_as_ar"]) for r in runs)
        if system in ("ours", "upstream"):
            drafted = sum(r.get("drafted", 0) for r in runs)
            accepted = sum(r.get("accepted", 0) for r in runs)
            s["drafted"], s["accepted"] = drafted, accepted
            if all(r.get("steps") is not None for r in runs):
                if system == "ours":
                    steps = sum(r["steps"] - r["plain_steps"] for r in runs)
                else:
                    steps = sum(r["steps"] for r in runs)
                s["steps"] = steps
                s["mean_accepted_length"] = (accepted + steps) / steps if steps else 1.0
                s["mean_accepted_length_source"] = "(accepted + steps) / steps"
            else:
                n = s["tokens"]
                s["mean_accepted_length"] = n / max(n - accepted, 1)
                s["mean_accepted_length_source"] = "estimate: tokens / (tokens - accepted)"
            s["per_position_acceptance"], s["per_position_reached"] = _pooled(runs)
        if system == "ours":
            s["draft_ms_per_step"] = spread([r["draft_ms_per_step"] for r in runs])
            s["verify_ms_per_step"] = spread([r["verify_ms_per_step"] for r in runs])
            s["plain_steps"] = sum(r["plain_steps"] for r in runs)
            if all("limit_vs_ar" in r for r in runs):
                s["limit_vs_ar"] = spread([r["limit_vs_ar"] for r in runs])
                s["share_of_limit"] = spread(
                    [r["speedup_vs_ar"] / r["limit_vs_ar"] for r in runs if r["limit_vs_ar"] > 0]
                )
        if system == "ar":
            s["ms_per_token"] = 1e3 / s["tok_s"]["median"] if s["tok_s"]["median"] > 0 else float("nan")
        out[system] = s
    return out


# --- the table -----------------------------------------------------------


def format_table(result: dict[str, Any]) -> str:
    m = result["meta"]
    lines = [
        f"target {m['target']}  draft {m['draft']}",
        f"{m['n_prompts']} prompts x {m['repeat']} round(s), {m['n_predict']} tokens, temperature {m['temperature']}, "
        f"threads {m['threads']}, n_gpu_layers {m['n_gpu_layers']}, seed {m['seed']}",
    ]
    for note in result.get("notes", []):
        lines.append(f"note: {note}")
    for cfg in result["configs"]:
        up = f", upstream --spec-draft-n-max {cfg['n_max_upstream']}" if "n_max_upstream" in cfg else ""
        lines.append("")
        lines.append(
            f"n_max {cfg['n_max']} (ours: {cfg['n_max_ours']}{up}; block size {cfg['block_size']}, "
            f"draft device {cfg.get('draft_device')})"
        )
        for note in cfg.get("notes", []):
            lines.append(f"note: {note}")
        hdr = (
            f"{'system':<12}{'decode tok/s':>13}{'p10-p90':>17}{'speedup':>9}{'p10-p90':>13}"
            f"{'acc.len':>9}{'draft ms':>10}{'verify ms':>11}{'prefill ms':>12}"
        )
        lines.append(hdr)
        lines.append("-" * len(hdr))
        for system, s in cfg["summary"].items():
            t, sp, pf = s["tok_s"], s["speedup_vs_ar"], s["prefill_ms"]
            acc = f"{s['mean_accepted_length']:.2f}" if "mean_accepted_length" in s else "1"
            if s.get("mean_accepted_length_source", "").startswith("estimate"):
                acc += "~"
            dms = f"{s['draft_ms_per_step']['median']:.3f}" if "draft_ms_per_step" in s else "-"
            vms = f"{s['verify_ms_per_step']['median']:.3f}" if "verify_ms_per_step" in s else "-"
            speed = "1 (base)" if system == "ar" else f"{sp['median']:.2f}x"
            sspread = "" if system == "ar" else f"{sp['p10']:.2f}-{sp['p90']:.2f}"
            lines.append(
                f"{system:<12}{t['median']:>13.1f}{t['p10']:>8.1f}-{t['p90']:<8.1f}{speed:>9}"
                f"{sspread:>13}{acc:>9}{dms:>10}{vms:>11}{pf['median']:>12.2f}"
            )
        for system in ("ours", "upstream"):
            s = cfg["summary"].get(system)
            if not s:
                continue
            ppa = s.get("per_position_acceptance")
            if ppa:
                txt = " ".join(f"{x:.2f}" for x in ppa)
            elif system == "upstream":
                txt = "not exposed by the server"
            else:
                txt = "none (no drafted step)"
            extra = ""
            if system == "ours" and s.get("plain_steps"):
                extra = f"; {s['plain_steps']} fallback plain steps"
            lines.append(
                f"{system} per-position conditional acceptance: {txt}  "
                f"({s['accepted']}/{s['drafted']} drafts accepted{extra})"
            )
            if system == "ours" and "limit_vs_ar" in s:
                lines.append(
                    f"ours vs the limit of its own measured costs (draft + verify + inject, no loop "
                    f"overhead): limit {s['limit_vs_ar']['median']:.2f}x, measured "
                    f"{s['speedup_vs_ar']['median']:.2f}x = {s['share_of_limit']['median']:.0%} of it"
                )
        same = {k: v for k, v in cfg["summary"].items() if "same_as_ar" in v and k != "ar"}
        if same:
            lines.append(
                "greedy output identical to ar: "
                + ", ".join(f"{k} {v['same_as_ar']}/{v['runs']}" for k, v in same.items())
            )
    lines.append("")
    lines.append(
        "decode tok/s excludes prefill; speedup = median over prompts of (tok/s / ar tok/s on the same "
        "prompt and round); acc.len = tokens per target verify pass, bonus token included "
        "(~ = estimated); draft/verify ms = per step, medians over prompts"
    )
    return "\n".join(lines)


def write_json(result: dict[str, Any], path: str | Path) -> None:
    Path(path).write_text(json.dumps(result, indent=1, default=_json_default))


def _json_default(x: Any) -> Any:
    if hasattr(x, "__dataclass_fields__"):
        return asdict(x)
    return str(x)


__all__ = [
    "BenchError",
    "BenchOptions",
    "SYSTEMS",
    "UpstreamServer",
    "find_server_binary",
    "format_table",
    "load_prompts",
    "parse_n_max",
    "parse_prometheus",
    "parse_systems",
    "run_bench",
    "summarize_config",
    "write_json",
]
