"""A server for a benchmark: started on a free port of 127.0.0.1, ready once /health answers, stopped.

Shared by the tools that time or soak a server in a process of its own (``soak.py``,
``serve_load.py``, ``vllm_bench.py``); not a tool itself. The scripts of ``benchmarks/`` find it
because Python puts a script's own folder first on its path.

    port = free_port()
    server, url = start([..., "--port", str(port)], port)
    try:
        ...  # requests to url
    finally:
        exit_code = stop(server)
"""

from __future__ import annotations

import signal
import socket
import subprocess
import tempfile
import time
from typing import IO

import httpx


def free_port() -> int:
    """A port of 127.0.0.1 that nothing listens on now."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def start(command: list[str], port: int, timeout: float = 600, log: IO[bytes] | None = None):
    """Run ``command``, a server that listens on 127.0.0.1:``port``; return (process, url) once its
    /health answers 200. Its output goes to ``log`` (a temporary file if None). A server that exits
    first, or does not answer within ``timeout`` seconds, raises RuntimeError with its output's tail."""
    log = log if log is not None else tempfile.TemporaryFile()  # noqa: SIM115  (the server writes it)
    server = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if server.poll() is not None:
            raise RuntimeError(f"the server exited with {server.returncode} before answering /health:\n{_tail(log)}")
        try:
            if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                return server, url
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    stop(server, timeout=10)
    raise RuntimeError(f"the server did not answer /health within {timeout:g} s:\n{_tail(log)}")


def stop(server: subprocess.Popen, timeout: float = 120) -> int | None:
    """SIGTERM, then wait up to ``timeout`` seconds; a server still running then is killed.
    Returns its exit status after SIGTERM, or None if it had to be killed."""
    server.send_signal(signal.SIGTERM)
    try:
        return server.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        server.kill()
        server.wait()
        return None


def _tail(log: IO[bytes], size: int = 5000) -> str:
    log.seek(0)
    return log.read().decode(errors="replace")[-size:]
