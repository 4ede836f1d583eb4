"""Child processes for the benchmarks and tests that start servers on 127.0.0.1 (``kvagent serve``,
llama-cpp-python's server, ``llama-server``): a free port, a start that waits until the server answers, a stop.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path


def free_port() -> int:
    """A TCP port free on 127.0.0.1 now."""
    import socket

    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


# run a child so that it is stopped when this process dies (Linux: PR_SET_PDEATHSIG, kept across exec)
_DIE_WITH_PARENT = ("import ctypes, os, signal, sys; ctypes.CDLL(None).prctl(1, signal.SIGTERM); "
                    "os.execv(sys.argv[1], sys.argv[1:])")


def child_args(args: list[str]) -> list[str]:
    """``args`` run so that the child stops when its parent dies (no orphan servers after a crash)."""
    return [sys.executable, "-c", _DIE_WITH_PARENT, *args] if sys.platform.startswith("linux") else args


def start_process(args: list[str], url: str, log: Path, ready_s: float = 180.0,
                  env: dict[str, str] | None = None) -> subprocess.Popen[bytes]:
    """Start a server (``child_args``, output to ``log``, ``env`` added to this environment) and wait until
    ``url`` answers below 500; a child that exits or stays silent for ``ready_s`` raises with its log's tail."""
    import httpx

    out = open(log, "wb")  # noqa: SIM115 - the process writes to it until it stops
    proc = subprocess.Popen(child_args(args), stdout=out, stderr=subprocess.STDOUT, env={**os.environ, **(env or {})})
    deadline = time.monotonic() + ready_s
    while True:
        if proc.poll() is not None:
            raise RuntimeError(f"{' '.join(args[:5])} exited with {proc.returncode}; {log}:\n{log.read_text()[-3000:]}")
        try:
            if httpx.get(url, timeout=2, trust_env=False).status_code < 500:
                return proc
        except httpx.HTTPError:
            pass
        if time.monotonic() > deadline:
            stop_process(proc)
            raise RuntimeError(f"{' '.join(args[:5])} did not answer {url} within {ready_s} s; {log}:\n"
                               f"{log.read_text()[-3000:]}")
        time.sleep(0.3)


def stop_process(proc: subprocess.Popen[bytes]) -> None:
    """Terminate ``proc`` and wait; kill it when it does not stop within 30 s."""
    proc.terminate()
    try:
        proc.wait(timeout=30)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(timeout=10)


__all__ = ["child_args", "free_port", "start_process", "stop_process"]
