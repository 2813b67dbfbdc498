"""Shared fixtures: a checkpointer factory that always closes, a write gate, a dir snapshot."""

from __future__ import annotations

import contextlib
import os
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

import tiercheck
from tiercheck.tiers.local import LocalTier

pytest_plugins = ["tests.servers.plugin"]


@pytest.fixture
def ckpt_dir(tmp_path: Path) -> Path:
    return tmp_path / "ckpt"


@pytest.fixture
def make_ckpt(ckpt_dir: Path) -> Iterator[Callable[..., tiercheck.Checkpointer]]:
    """`make_ckpt(**kwargs)`: a Checkpointer on `ckpt_dir` (keep_local=None unless given)."""
    made: list[tiercheck.Checkpointer] = []

    def make(**kwargs: Any) -> tiercheck.Checkpointer:
        kwargs.setdefault("local", ckpt_dir)
        kwargs.setdefault("keep_local", None)
        c = tiercheck.Checkpointer(**kwargs)
        made.append(c)
        return c

    yield make
    for c in made:
        # a test that provoked a background error may leave it unraised
        with contextlib.suppress(tiercheck.TiercheckError):
            c.close()


@pytest.fixture
def write_gate(monkeypatch: pytest.MonkeyPatch) -> Iterator[threading.Event]:
    """Background writes block until the returned event is set (keeps a step in flight)."""
    gate = threading.Event()
    original = LocalTier.write_file

    def gated(self: LocalTier, path: str, data: memoryview, aligned: bool, *args: Any) -> None:
        if not gate.wait(timeout=20):
            raise TimeoutError("test write gate was never opened")
        original(self, path, data, aligned, *args)

    monkeypatch.setattr(LocalTier, "write_file", gated)
    yield gate
    gate.set()


def snapshot_dir(root: Path) -> dict[str, bytes | None]:
    """Every path under `root` mapped to its bytes (None for directories)."""
    snap: dict[str, bytes | None] = {}
    for dirpath, dirnames, filenames in os.walk(root):
        for d in dirnames:
            snap[os.path.relpath(os.path.join(dirpath, d), root)] = None
        for f in filenames:
            p = os.path.join(dirpath, f)
            snap[os.path.relpath(p, root)] = Path(p).read_bytes()
    return snap


@pytest.fixture
def dir_snapshot() -> Callable[[Path], dict[str, bytes | None]]:
    return snapshot_dir
