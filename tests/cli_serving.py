"""What the tests that start ``python -m tinyserve.serve`` as a process share."""

from __future__ import annotations

import socket
import subprocess
import time
from collections.abc import Callable

import httpx


def free_port() -> int:
    """A free loopback port (the server binds it a moment later)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_until_serving(proc: subprocess.Popen, port: int, output: Callable[[], str], timeout: float = 120) -> None:
    """Return once ``/health`` answers 200; fail with the process's ``output()`` if it exits first."""
    deadline = time.monotonic() + timeout
    while True:
        assert proc.poll() is None, output()
        assert time.monotonic() < deadline, "the server did not come up"
        try:
            if httpx.get(f"http://127.0.0.1:{port}/health", timeout=2).status_code == 200:
                return
        except httpx.TransportError:
            time.sleep(0.25)
