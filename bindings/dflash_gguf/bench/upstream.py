"""Upstream llama-server (draft-dflash) as a bench system: found, started on loopback, asked, stopped."""

from __future__ import annotations

import json
import os
import re
import shutil
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from .options import BenchError


def _die_with_parent() -> None:
    """In the child before exec: SIGKILL when the bench dies, even killed (out of memory), so that no server
    is left holding a model's memory (prctl PR_SET_PDEATHSIG)."""
    import ctypes
    import signal

    pr_set_pdeathsig = 1  # <linux/prctl.h>
    ctypes.CDLL(None, use_errno=True).prctl(pr_set_pdeathsig, signal.SIGKILL, 0, 0, 0)


LLAMA_SERVER_VERSION = "0.3.36"
STARTUP_TIMEOUT_S = 300.0
REQUEST_TIMEOUT_S = 600.0
LOG_FLUSH_TIMEOUT_S = 5.0

# The speculative decoder's running totals, which llama-server logs at trace verbosity (-lv 4) after every
# request: "statistics draft-dflash: #calls(b,g,a) = 1 16 16, ... dur(b,g,a) = 0.004, 1032.543, 0.009 ms"
# (g = drafting: the calls and the milliseconds spent in them, the drafter's forward and its sampling).
# Not in any of them: process(), the drafter decode after each verify that writes the verified rows'
# features into the drafter's cache; ours does that inside its draft graph, so ours' draft ms includes it.
# A line still being written does not match: the pattern ends after the drafting milliseconds' comma.
_DRAFT_STATS = re.compile(rb"statistics\s+\S+: #calls\(b,g,a\) =\s*\d+\s+(\d+)\s.*dur\(b,g,a\) = [\d.]+, ([\d.]+), ")


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


def gguf_is_quantized(path: str) -> bool:
    """True when any weight tensor is neither F32, F16 nor BF16 (best effort)."""
    try:
        from gguf import GGMLQuantizationType, GGUFReader

        plain = {GGMLQuantizationType.F32, GGMLQuantizationType.F16, GGMLQuantizationType.BF16}
        return any(t.tensor_type not in plain for t in GGUFReader(path).tensors)
    except Exception:  # noqa: BLE001 - a guess only decides whether to add --no-repack
        return False


def cpu_has_amx() -> bool:
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
                "-lv",
                "4",  # the drafting statistics line (_DRAFT_STATS)
            ]
        cmd += list(extra_args)
        self.cmd = cmd
        self.log_path = log_path
        self._own_log = log_path is None  # a temporary log of its own, removed when the server stops
        self.proc: subprocess.Popen[bytes] | None = None
        self._logf: Any = None
        # (log bytes read, drafting calls, drafting ms) so far; None: no drafting totals to read
        self._draft_totals: tuple[int, int, float] | None = (0, 0, 0.0) if draft is not None else None

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
        self.proc = subprocess.Popen(
            self.cmd,
            stdout=self._logf,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            preexec_fn=_die_with_parent if sys.platform == "linux" else None,
        )
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
        if self._own_log and self.log_path is not None:
            self.log_path.unlink(missing_ok=True)
            self.log_path = None

    def _drafting_since_last(self) -> tuple[int, float] | None:
        """(drafting calls, ms) since the previous request, from the log's running totals; None if this
        server logs none (no drafter, or a build without the line). The log is written by a thread of
        its own, so the line of the request just answered may lag the answer a little."""
        if self._draft_totals is None or self.log_path is None:
            return None
        read_to, calls0, ms0 = self._draft_totals
        deadline = time.monotonic() + LOG_FLUSH_TIMEOUT_S
        while True:
            with open(self.log_path, "rb") as f:
                f.seek(read_to)
                found = list(_DRAFT_STATS.finditer(f.read()))
            if found or time.monotonic() > deadline:
                break
            time.sleep(0.02)
        if not found:
            self._draft_totals = None  # not logged by this build: no more waiting for it
            return None
        last = found[-1]
        calls, ms = int(last[1]), float(last[2])
        self._draft_totals = (read_to + last.end(), calls, ms)
        return calls - calls0, ms - ms0

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
        drafting = self._drafting_since_last()
        if drafting is not None and drafting[0] > 0:
            rec["draft_steps"], rec["draft_ms"] = drafting
            rec["draft_ms_per_step"] = drafting[1] / drafting[0]
        if rec.get("pos_accepted") and rec["steps"]:
            rec["pos_reached"] = [rec["steps"]] + rec["pos_accepted"][:-1]
            rec["per_position_acceptance"] = [
                a / r if r else 0.0 for a, r in zip(rec["pos_accepted"], rec["pos_reached"])
            ]
        return rec
