"""A llama-server that `dflash bench` starts dies with the bench, even when the bench is killed (out of
memory at a large --scale size): otherwise it would go on holding its model's memory."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytestmark = pytest.mark.skipif(sys.platform != "linux", reason="PR_SET_PDEATHSIG is Linux's")


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # a killed child not yet reaped by its new parent is a zombie: dead for this purpose
    stat = Path(f"/proc/{pid}/stat").read_text()
    return stat.rsplit(")", 1)[1].split()[0] != "Z"


def test_a_server_dies_when_the_bench_is_killed(tmp_path: Path) -> None:
    pid_file = tmp_path / "server.pid"
    server = tmp_path / "llama-server"  # never healthy: the bench waits for it until killed
    server.write_text(f"#!/bin/sh\necho $$ > {pid_file}\nexec sleep 600\n")
    server.chmod(0o755)
    bench = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "from pathlib import Path\n"
            "from dflash_gguf.bench.upstream import UpstreamServer\n"
            f"UpstreamServer(Path({str(server)!r}), 'target.gguf', None, n_max=3, threads=1, n_ctx=512,"
            f" n_gpu_layers=0, seed=0, log_path=Path({str(tmp_path / 'server.log')!r})).__enter__()\n",
        ]
    )
    try:
        deadline = time.monotonic() + 60
        while not (pid_file.is_file() and pid_file.read_text().strip()):
            assert bench.poll() is None and time.monotonic() < deadline, "the fake server never started"
            time.sleep(0.05)
        pid = int(pid_file.read_text())
        assert _alive(pid)
        bench.send_signal(signal.SIGKILL)
        bench.wait()
        deadline = time.monotonic() + 10
        while _alive(pid) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not _alive(pid), "the server outlived the killed bench"
    finally:
        bench.kill()
        if pid_file.is_file() and pid_file.read_text().strip() and _alive(int(pid_file.read_text())):
            os.kill(int(pid_file.read_text()), signal.SIGKILL)


def test_a_server_that_fails_to_start_reports_its_log_and_leaves_no_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import tempfile

    from dflash_gguf.bench.upstream import BenchError, UpstreamServer

    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))  # where the server's own log goes
    server = tmp_path / "llama-server"
    server.write_text("#!/bin/sh\necho 'error: unknown model architecture' >&2\nexit 3\n")
    server.chmod(0o755)
    srv = UpstreamServer(server, "target.gguf", None, n_max=3, threads=1, n_ctx=512, n_gpu_layers=0, seed=0)
    with pytest.raises(BenchError, match="exited with 3 during startup(.|\n)*unknown model architecture"):
        srv.__enter__()
    assert not list(tmp_path.glob("dflash-bench-server-*")), "the temporary log outlived the server"
