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
from tiercheck.testing import Faults, FaultyTier
from tiercheck.tiers import open_tier

# tests.helpers.markers derives the procs, servers and root markers from what each test does
pytest_plugins = ["tests.helpers.servers.plugin", "tests.helpers.markers"]


@pytest.fixture
def ckpt_dir(tmp_path: Path) -> Path:
    return tmp_path / "ckpt"


@pytest.fixture
def tier_faults() -> Faults:
    """Faults injected into tier 1: `make_ckpt` wraps its local tier in a `FaultyTier` with
    these rules when a test asks for this fixture (directly, or through `write_gate` or
    `fail_step`); a test that builds its own Checkpointer passes ``faulty_local(path, tier_faults)``."""
    return Faults()


def faulty_local(path: str | os.PathLike[str], faults: Faults, **options: Any) -> FaultyTier:
    """A local tier at `path` (with LocalTier `options`) whose operations obey `faults`."""
    return FaultyTier(open_tier(path, role="local", **options), faults)


_LOCAL_OPTIONS = {"direct_io": "direct_io", "fsync": "fsync", "local_write_rate": "write_rate"}


@pytest.fixture
def make_ckpt(ckpt_dir: Path, request: pytest.FixtureRequest) -> Iterator[Callable[..., tiercheck.Checkpointer]]:
    """`make_ckpt(**kwargs)`: a Checkpointer on `ckpt_dir` (keep_local=None unless given)."""
    made: list[tiercheck.Checkpointer] = []
    faults = request.getfixturevalue("tier_faults") if "tier_faults" in request.fixturenames else None

    def make(**kwargs: Any) -> tiercheck.Checkpointer:
        kwargs.setdefault("local", ckpt_dir)
        kwargs.setdefault("keep_local", None)
        if faults is not None and kwargs["local"] is not None:
            options = {v: kwargs.pop(k) for k, v in _LOCAL_OPTIONS.items() if k in kwargs}
            kwargs["local"] = faulty_local(kwargs["local"], faults, **options)
        c = tiercheck.Checkpointer(**kwargs)
        made.append(c)
        return c

    yield make
    for c in made:
        # a test that provoked a background error may leave it unraised
        with contextlib.suppress(tiercheck.TiercheckError):
            c.close()


@pytest.fixture
def write_gate(tier_faults: Faults) -> Iterator[threading.Event]:
    """Tier-1 file writes block until the returned event is set (keeps a step in flight)."""
    gate = threading.Event()
    tier_faults.block("write_file", gate, timeout=20)
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
