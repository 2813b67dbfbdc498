"""Run a job of rank processes for a test: one ``python WORKER ARGS...`` per rank, each given
its rank, the world size and a free port on 127.0.0.1 for its gloo rendezvous, all waited
for (generously: 300 s) and killed if the test fails first."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from collections.abc import Callable, Sequence
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def run_ranks(
    worker: str | Path,
    world: int,
    args: Callable[[int, int], Sequence[str]],
    env: dict[str, str] | None = None,
    killed: frozenset[int] = frozenset(),
    timeout: float = 300,
) -> list[str]:
    """Start `world` processes of `worker` with ``args(rank, port)`` and wait for them; return
    each one's output. Every rank exits 0, except those in `killed`, which must die by SIGKILL."""
    port = free_port()
    procs = [
        subprocess.Popen(
            [sys.executable, str(worker), *args(r, port)],
            cwd=REPO,
            env={**os.environ, "PYTHONPATH": str(REPO), **(env or {})},
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for r in range(world)
    ]
    logs = []
    try:
        for p in procs:
            logs.append(p.communicate(timeout=timeout)[0])
    finally:
        for p in procs:
            p.kill()
    for r, p in enumerate(procs):
        want = -9 if r in killed else 0
        assert p.returncode == want, f"rank {r} exited {p.returncode}, expected {want}:\n{logs[r]}"
    return logs
