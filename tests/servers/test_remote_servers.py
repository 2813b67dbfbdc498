"""The remote tier against real object-store servers (tests/helpers/servers): SeaweedFS (S3),
Azurite (Azure Blob) and the GCS emulator, plus outages made with the TCP fault proxy
and with signals to the SeaweedFS process.

Every test builds a `Checkpointer` the way a user would (URL + ``storage_options``) and
checks what a second, independent fsspec client sees in the bucket. Timeouts and retry
budgets are short so the whole module runs in about two minutes; the bounds in the
asserts are generous because the machine is small and shared.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

import tiercheck
from tests.helpers.servers import ObjectStoreServer, ProxiedServer, SeaweedFS
from tiercheck.errors import UploadSkippedError
from tiercheck.format import naming

MiB = 1 << 20
SERVERS = ["seaweedfs", "azurite", "gcs_server"]
SHARD = naming.shard_name(0, 1)
MANIFEST = naming.manifest_name(0, 1)
COMMIT = naming.COMMIT_NAME

# Generous upper bounds (seconds) for a 2-core machine that other jobs share.
FAST_SAVE_S = 5.0  # one save() of a few MiB, whatever the remote tier is doing
LOCAL_DURABLE_S = 20.0


# ------------------------------------------------------------------------------ helpers


def make_state(seed: int, mib: float = 1.0) -> dict[str, Any]:
    """A training-like state of about `mib` MiB whose every value depends on `seed`."""
    g = torch.Generator().manual_seed(seed)
    n = max(1, int(mib * MiB) // 4)
    return {
        "model": {
            "w": torch.randn(n, generator=g),
            "b": torch.randn(33, generator=g).to(torch.bfloat16),
            "idx": torch.randint(0, 1 << 40, (17,), generator=g, dtype=torch.int64),
        },
        "opt": {0: {"m": torch.randn(5, 7, generator=g)}, "0": [1, 2.5, None]},
        "rng": np.random.default_rng(seed).integers(0, 255, size=99, dtype=np.uint8),
        "step": seed,
        "meta": {"name": f"run-{seed}", "lr": 0.1 * seed, "tup": (seed, "x")},
    }


def template_like(state: Any) -> Any:
    """The same structure with every value different (restore must overwrite them all)."""
    if isinstance(state, torch.Tensor):
        t = torch.empty_like(state)
        if t.numel():
            t.view(torch.uint8).fill_(0x5A)
        return t
    if isinstance(state, np.ndarray):
        return np.full_like(state, 7)
    if isinstance(state, dict):
        return {k: template_like(v) for k, v in state.items()}
    if isinstance(state, (list, tuple)):
        return type(state)(template_like(v) for v in state)
    if isinstance(state, bool) or state is None:
        return state
    if isinstance(state, (int, float)):
        return type(state)(-1)
    if isinstance(state, str):
        return "?"
    raise TypeError(type(state))


def assert_same(a: Any, b: Any, path: str = "state") -> None:
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor), path
        assert a.dtype == b.dtype and a.shape == b.shape, path
        assert torch.equal(a.view(torch.uint8) if a.numel() else a, b.view(torch.uint8) if b.numel() else b), path
    elif isinstance(a, np.ndarray):
        assert isinstance(b, np.ndarray) and a.dtype == b.dtype, path
        assert np.array_equal(a, b), path
    elif isinstance(a, dict):
        assert isinstance(b, dict), path
        assert list(a.keys()) == list(b.keys()), path
        for k in a:
            assert_same(a[k], b[k], f"{path}[{k!r}]")
    elif isinstance(a, (list, tuple)):
        assert type(a) is type(b) and len(a) == len(b), path
        for i, (x, y) in enumerate(zip(a, b, strict=True)):
            assert_same(x, y, f"{path}[{i}]")
    else:
        assert type(a) is type(b) and a == b, path


def restore_fresh(tmp_path: Path, url: str, opts: dict[str, Any], expected: dict[str, Any], **kw: Any) -> int | None:
    """A new node: empty local dir, same bucket. Restores into a template and compares."""
    fresh = tmp_path / f"fresh-{time.monotonic_ns()}"
    with tiercheck.Checkpointer(local=fresh, remote=url, storage_options=opts, **kw) as c:
        tmpl = template_like(expected)
        step = c.restore(tmpl)
        assert_same(expected, tmpl)
    return step


def listing(fs: Any, url: str) -> dict[str, dict[str, int]]:
    """step dir name -> {file name: size}, as an independent client sees the bucket."""
    root = fs._strip_protocol(url).rstrip("/")
    fs.invalidate_cache()
    try:
        found = fs.find(root, detail=True)
    except FileNotFoundError:
        return {}
    out: dict[str, dict[str, int]] = {}
    for path, info in found.items():
        if info.get("type") != "file":
            continue
        rel = path.lstrip("/")[len(root.lstrip("/")) + 1 :].split("/")
        if len(rel) == 2:
            out.setdefault(rel[0], {})[rel[1]] = int(info["size"])
    return out


def committed(fs: Any, url: str) -> list[int]:
    steps = []
    for d, files in listing(fs, url).items():
        s = naming.parse_step_dir(d)
        if s is not None and COMMIT in files:
            steps.append(s)
    return sorted(steps)


class Watcher:
    """Polls the bucket with its own client while uploads run; records any step whose commit
    marker is visible before its shard (of the expected size) and manifest are."""

    def __init__(self, fs: Any, url: str, shard_sizes: Callable[[int], int | None], interval: float = 0.05) -> None:
        self.fs, self.url, self.shard_sizes = fs, url, shard_sizes
        self.interval = interval
        self.violations: list[str] = []
        self.polls = 0
        self.seen_partial: set[int] = set()  # steps seen with data but without a marker
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self) -> Watcher:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(30)

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                seen = listing(self.fs, self.url)
            except Exception:  # the server may be down right now
                seen = None
            if seen is not None:
                self.polls += 1
                for d, files in seen.items():
                    step = naming.parse_step_dir(d)
                    if step is None:
                        continue
                    if COMMIT not in files:
                        self.seen_partial.add(step)
                        continue
                    want = self.shard_sizes(step)
                    if MANIFEST not in files or SHARD not in files or (want is not None and files[SHARD] != want):
                        self.violations.append(f"step {step} marked committed with files {files}")
            self._stop.wait(self.interval)


def local_shard_size(local: Path) -> Callable[[int], int | None]:
    def size(step: int) -> int | None:
        p = local / naming.step_dir_name(step) / SHARD
        return p.stat().st_size if p.exists() else None

    return size


def without_client_timeouts(opts: dict[str, Any]) -> dict[str, Any]:
    """The fixture's storage_options minus its S3 client timeouts, so `remote_timeout` applies."""
    opts = dict(opts)
    opts.pop("config_kwargs", None)
    return opts


def run_bounded(fn: Callable[[], Any], bound_s: float, what: str) -> Any:
    """Run `fn` on a thread; fail (instead of hanging the suite) if it takes longer than `bound_s`."""
    result: list[Any] = []
    error: list[BaseException] = []

    def target() -> None:
        try:
            result.append(fn())
        except BaseException as e:
            error.append(e)

    t = threading.Thread(target=target, daemon=True)
    t0 = time.monotonic()
    t.start()
    t.join(bound_s)
    assert not t.is_alive(), f"{what} still blocked after {bound_s:.0f} s"
    if error:
        raise error[0]
    return result[0] if result else None, time.monotonic() - t0


@pytest.fixture
def server(request: pytest.FixtureRequest) -> ObjectStoreServer:
    s: ObjectStoreServer = request.getfixturevalue(request.param)
    if isinstance(s, SeaweedFS):
        request.getfixturevalue("seaweedfs_healthy")
    return s


@pytest.fixture
def closing() -> Iterator[Callable[[tiercheck.Checkpointer], tiercheck.Checkpointer]]:
    """Register a checkpointer to be closed after the test (errors it still holds are dropped)."""
    made: list[tiercheck.Checkpointer] = []

    def add(c: tiercheck.Checkpointer) -> tiercheck.Checkpointer:
        made.append(c)
        return c

    yield add
    for c in made:
        with contextlib.suppress(tiercheck.TiercheckError):
            c.close()


def quick(server: ObjectStoreServer | ProxiedServer, **kw: Any) -> dict[str, Any]:
    """Checkpointer kwargs for tests: short budgets so a failure shows in seconds."""
    kw.setdefault("remote_retry_budget", 20.0)
    kw.setdefault("remote_timeout", 5.0)
    kw.setdefault("storage_options", server.storage_options)
    return kw


# ------------------------------------------------------------------ round trips per server


@pytest.mark.parametrize("server", SERVERS, indirect=True)
def test_round_trip_retention_fresh_node_and_load(server: ObjectStoreServer, tmp_path: Path) -> None:
    url = server.unique_url("rt")
    opts = server.storage_options
    states = {s: make_state(s, mib=1.5) for s in (1, 2, 3, 4)}
    with tiercheck.Checkpointer(
        local=tmp_path / "node1", remote=url, keep_local=2, keep_remote=2, upload_backlog="all", **quick(server)
    ) as ckpt:
        handles = [ckpt.save(s, st) for s, st in states.items()]
        handles[-1].wait("remote", timeout=60)
        ckpt.wait(timeout=60)
        assert ckpt.steps("remote") == [3, 4]
        assert ckpt.latest_step("remote") == 4
        assert ckpt.steps("local") == [3, 4]
        for h in handles[2:]:
            assert h.done("remote") and h.done("local")
            assert h.stats.tier_s["remote"] >= h.stats.tier_s["local"] > 0
    # An independent client sees exactly the retained steps, each complete.
    fs = server.filesystem()
    seen = listing(fs, url)
    assert committed(fs, url) == [3, 4]
    for s in (3, 4):
        files = seen[naming.step_dir_name(s)]
        assert set(files) == {SHARD, MANIFEST, COMMIT}
        assert files[SHARD] == (tmp_path / "node1" / naming.step_dir_name(s) / SHARD).stat().st_size
    # A fresh node with an empty local directory restores the newest step from the bucket.
    assert restore_fresh(tmp_path, url, opts, states[4]) == 4
    # ...and an older one by number.
    with tiercheck.Checkpointer(local=tmp_path / "node3", remote=url, storage_options=opts) as c:
        tmpl = template_like(states[3])
        assert c.restore(tmpl, step=3) == 3
        assert_same(states[3], tmpl)
        with pytest.raises(tiercheck.NoCheckpointError):
            c.restore(template_like(states[1]), step=1)
    # tiercheck.load straight from the URL, without a template.
    got = tiercheck.load(url, storage_options=opts)
    assert_same(states[4]["model"], got["model"])
    assert got["step"] == 4 and got["meta"] == states[4]["meta"]
    assert_same(states[3]["opt"], tiercheck.load(url, step=3, storage_options=opts)["opt"])


@pytest.mark.parametrize("server", SERVERS, indirect=True)
def test_zstd_round_trip(server: ObjectStoreServer, tmp_path: Path) -> None:
    url = server.unique_url("zstd")
    opts = server.storage_options
    state = make_state(7, mib=2)
    state["model"]["zeros"] = torch.zeros(1 << 20, dtype=torch.bfloat16)  # 2 MiB, compresses well
    with tiercheck.Checkpointer(local=tmp_path / "l", remote=url, remote_compression="zstd", **quick(server)) as c:
        c.save(7, state).wait(timeout=60)
        c.wait(timeout=60)
    raw = (tmp_path / "l" / naming.step_dir_name(7) / SHARD).stat().st_size
    stored = listing(server.filesystem(), url)[naming.step_dir_name(7)][SHARD]
    assert stored < raw * 0.8, (stored, raw)
    # the bucket copy is readable on its own (fresh node, and load without a template)
    assert restore_fresh(tmp_path, url, opts, state) == 7
    got = tiercheck.load(url, storage_options=opts)
    assert_same(state["model"], got["model"])


@pytest.mark.parametrize("server", SERVERS, indirect=True)
def test_remote_only_round_trip(server: ObjectStoreServer, tmp_path: Path) -> None:
    url = server.unique_url("only")
    opts = server.storage_options
    states = {s: make_state(s) for s in (10, 20, 30)}
    with tiercheck.Checkpointer(remote=url, keep_remote=2, **quick(server)) as c:
        for s, st in states.items():
            h = c.save(s, st)
            assert h.tiers == ("remote",)
        c.wait(timeout=60)
        assert c.steps() == c.steps("remote") == [20, 30]
        tmpl = template_like(states[30])
        assert c.restore(tmpl) == 30
        assert_same(states[30], tmpl)
    assert committed(server.filesystem(), url) == [20, 30]
    with tiercheck.Checkpointer(remote=url, storage_options=opts) as c:
        tmpl = template_like(states[20])
        assert c.restore(tmpl, step=20) == 20
        assert_same(states[20], tmpl)
    assert_same(states[30]["model"], tiercheck.load(url, storage_options=opts)["model"])


# ------------------------------------------------------------ outages through the fault proxy


def test_refused_outage_is_ridden_out(seaweedfs_proxy: ProxiedServer, tmp_path: Path, closing: Any) -> None:
    """~3 s of refused connections while training keeps saving: save() stays fast, tier 1
    keeps committing, and the uploads finish after recovery with no error raised."""
    url = seaweedfs_proxy.unique_url("refuse")
    proxy = seaweedfs_proxy.proxy
    local = tmp_path / "l"
    ckpt = closing(
        tiercheck.Checkpointer(
            local=local, remote=url, keep_local=2, **quick(seaweedfs_proxy, remote_retry_budget=30, remote_timeout=2)
        )
    )
    ckpt.save(1, make_state(1)).wait(timeout=60)
    ckpt.wait(timeout=60)  # retention after step 1 done too: the outage hits step 2 only
    proxy.refuse = True
    proxy.reset_all()  # pooled keep-alive connections too
    handles = {}
    stalls = []
    outage_start = time.monotonic()
    for s in (2, 3, 4):
        st = make_state(s)
        t0 = time.monotonic()
        handles[s] = ckpt.save(s, st)
        stalls.append(time.monotonic() - t0)
        handles[s].wait("local", timeout=LOCAL_DURABLE_S)
        time.sleep(0.8)
    assert max(stalls) < FAST_SAVE_S, stalls
    assert ckpt.steps("local")[-1] == 4
    assert not handles[4].done("remote")  # nothing got through the outage
    time.sleep(max(0.0, 3.0 - (time.monotonic() - outage_start)))
    assert proxy.stats()["refused"] >= 1
    proxy.refuse = False
    handles[4].wait("remote", timeout=60)  # within the 30 s budget; raises if it failed
    ckpt.wait(timeout=60)  # no error surfaced
    remote = ckpt.steps("remote")
    assert remote[0] == 1 and remote[-1] == 4
    for s in (2, 3):  # skipped by the 'newest' backlog policy, or uploaded: never an error
        with contextlib.suppress(UploadSkippedError):
            handles[s].wait("remote", timeout=1)
    ckpt.close()
    assert restore_fresh(tmp_path, url, seaweedfs_proxy.server.storage_options, make_state(4)) == 4


def test_outage_longer_than_budget_raises_once(seaweedfs_proxy: ProxiedServer, tmp_path: Path, closing: Any) -> None:
    url = seaweedfs_proxy.unique_url("long")
    proxy = seaweedfs_proxy.proxy
    ckpt = closing(
        tiercheck.Checkpointer(
            local=tmp_path / "l", remote=url, **quick(seaweedfs_proxy, remote_retry_budget=3, remote_timeout=2)
        )
    )
    ckpt.save(1, make_state(1)).wait(timeout=60)
    ckpt.wait(timeout=60)  # retention after step 1 done too: the outage hits step 2 only
    proxy.refuse = True
    proxy.reset_all()
    t0 = time.monotonic()
    h = ckpt.save(2, make_state(2))
    assert time.monotonic() - t0 < FAST_SAVE_S
    h.wait("local", timeout=LOCAL_DURABLE_S)
    with pytest.raises(tiercheck.TierError) as ei:
        ckpt.wait(timeout=60)
    elapsed = time.monotonic() - t0
    err = ei.value
    assert err.tier == "remote" and err.step == 2
    assert naming.step_dir_name(2) in err.path and err.path.startswith(url)
    assert elapsed < 45, f"a 3 s budget took {elapsed:.1f} s to give up"
    assert isinstance(err, OSError) and isinstance(err, tiercheck.TiercheckError)
    ckpt.wait(timeout=10)  # raised exactly once
    with pytest.raises(tiercheck.TierError):  # still visible on the step's own handle
        h.wait("remote", timeout=1)
    assert 2 in ckpt.steps("local")
    proxy.refuse = False
    ckpt.save(3, make_state(3)).wait(timeout=60)
    ckpt.close()  # no stale error left behind
    assert committed(seaweedfs_proxy.server.filesystem(), url) == [1, 3]


def test_blackhole_save_stays_fast_and_upload_recovers(
    seaweedfs_proxy: ProxiedServer, tmp_path: Path, closing: Any
) -> None:
    """A server that accepts connections and never answers: save() stays fast, tier 1 keeps
    committing, and once the server answers again the upload completes without an error."""
    url = seaweedfs_proxy.unique_url("bh")
    proxy = seaweedfs_proxy.proxy
    opts = without_client_timeouts(seaweedfs_proxy.storage_options)
    ckpt = closing(
        tiercheck.Checkpointer(
            local=tmp_path / "l", remote=url, storage_options=opts, remote_retry_budget=30, remote_timeout=2
        )
    )
    ckpt.save(1, make_state(1)).wait(timeout=60)
    ckpt.wait(timeout=60)
    proxy.blackhole = True
    proxy.reset_all()
    state = make_state(2, mib=4)
    stalls = []
    for s, st in ((2, state), (3, make_state(3))):
        t0 = time.monotonic()
        h = ckpt.save(s, st)
        stalls.append(time.monotonic() - t0)
        h.wait("local", timeout=LOCAL_DURABLE_S)
    assert max(stalls) < FAST_SAVE_S, stalls
    time.sleep(2)
    assert not h.done("remote")
    assert proxy.stats()["blackholed"] + proxy.stats()["bytes_up"] > 0
    proxy.blackhole = False
    proxy.reset_all()  # the swallowed requests' connections are unusable
    run_bounded(lambda: h.wait("remote"), 90, "the upload after the server answers again")
    run_bounded(ckpt.close, 60, "close() after the blackhole")
    assert committed(seaweedfs_proxy.server.filesystem(), url)[-1] == 3
    assert restore_fresh(tmp_path, url, seaweedfs_proxy.server.storage_options, make_state(3)) == 3


def test_blackhole_failure_bounded_by_timeout_and_budget(
    seaweedfs_proxy: ProxiedServer, tmp_path: Path, closing: Any
) -> None:
    url = seaweedfs_proxy.unique_url("bhb")
    proxy = seaweedfs_proxy.proxy
    opts = without_client_timeouts(seaweedfs_proxy.storage_options)
    ckpt = closing(
        tiercheck.Checkpointer(
            local=tmp_path / "l", remote=url, storage_options=opts, remote_retry_budget=1, remote_timeout=1
        )
    )
    ckpt.save(1, make_state(1)).wait(timeout=60)
    ckpt.wait(timeout=60)
    proxy.blackhole = True
    proxy.reset_all()
    try:
        h = ckpt.save(2, make_state(2, mib=2))
        h.wait("local", timeout=LOCAL_DURABLE_S)
        # budget 1 s + a few 1 s request timeouts (+ a bounded cleanup): 15 s is generous
        with pytest.raises(tiercheck.TierError) as ei:
            run_bounded(lambda: h.wait("remote"), 15, "a step uploading into a blackhole")
        assert ei.value.tier == "remote" and ei.value.step == 2
    finally:
        proxy.clear()
        proxy.reset_all()


def test_reset_mid_upload_never_looks_complete(seaweedfs_proxy: ProxiedServer, tmp_path: Path, closing: Any) -> None:
    """Connections reset after N bytes: every upload attempt dies midway. No step is listed
    (by tiercheck or by a separate client) before it is complete; it completes on recovery."""
    url = seaweedfs_proxy.unique_url("rst")
    proxy = seaweedfs_proxy.proxy
    local = tmp_path / "l"
    state = make_state(5, mib=6)
    ckpt = closing(
        tiercheck.Checkpointer(
            local=local, remote=url, **quick(seaweedfs_proxy, remote_retry_budget=40, remote_timeout=2)
        )
    )
    ckpt.save(1, make_state(1)).wait(timeout=60)
    ckpt.wait(timeout=60)  # retention after step 1 done too: the outage hits step 2 only
    proxy.reset_after_bytes = 2 * MiB
    proxy.reset_all()
    fs = seaweedfs_proxy.server.filesystem()
    with Watcher(fs, url, local_shard_size(local)) as watch:
        h = ckpt.save(5, state)
        h.wait("local", timeout=LOCAL_DURABLE_S)
        deadline = time.monotonic() + 30
        while proxy.stats()["reset"] < 3 and time.monotonic() < deadline:
            time.sleep(0.1)
        assert proxy.stats()["reset"] >= 3, proxy.stats()
        assert not h.done("remote")
        assert 5 not in ckpt.steps("remote")
        assert 5 not in committed(fs, url)
        proxy.reset_after_bytes = None
        h.wait("remote", timeout=60)
        ckpt.wait(timeout=60)
    assert watch.polls >= 2 and watch.violations == []
    assert committed(fs, url) == [1, 5]
    ckpt.close()
    assert restore_fresh(tmp_path, url, seaweedfs_proxy.server.storage_options, state) == 5


def test_outage_right_after_commit_with_keep_all(
    seaweedfs_proxy: ProxiedServer, tmp_path: Path, closing: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    from tiercheck.tiers.remote import RemoteTier

    url = seaweedfs_proxy.unique_url("keepall")
    proxy = seaweedfs_proxy.proxy
    original = RemoteTier.committed_steps

    def outage_starts_now(self: RemoteTier) -> list[int]:
        if threading.current_thread().name.startswith("tiercheck-uploader"):
            proxy.refuse = True  # the bucket goes away right after the marker was written
            proxy.reset_all()
        return original(self)

    ckpt = closing(
        tiercheck.Checkpointer(
            local=tmp_path / "l", remote=url, keep_remote=None, **quick(seaweedfs_proxy, remote_retry_budget=2)
        )
    )
    monkeypatch.setattr(RemoteTier, "committed_steps", outage_starts_now)
    try:
        h = ckpt.save(1, make_state(1))
        h.wait("remote", timeout=60)  # committed on the bucket
        ckpt.wait(timeout=60)  # nothing failed that the user must act on
    finally:
        monkeypatch.undo()
        proxy.clear()
    assert committed(seaweedfs_proxy.server.filesystem(), url) == [1]


# ---------------------------------------------------------- the S3 server process itself


def test_sigkill_mid_upload_then_restart(seaweedfs_proxy: ProxiedServer, tmp_path: Path, closing: Any) -> None:
    """SeaweedFS is SIGKILLed while a multi-MiB step is being uploaded, then restarted on
    the same data dir. Before the client may reach it again, the bucket holds no marker for
    the step; once it may, the upload completes within the budget and restores bit-exact."""
    server = seaweedfs_proxy.server
    assert isinstance(server, SeaweedFS)
    url = seaweedfs_proxy.unique_url("kill")
    proxy = seaweedfs_proxy.proxy
    local = tmp_path / "l"
    state = make_state(9, mib=24)
    ckpt = closing(
        tiercheck.Checkpointer(
            local=local, remote=url, **quick(seaweedfs_proxy, remote_retry_budget=60, remote_timeout=3)
        )
    )
    ckpt.save(1, make_state(1)).wait(timeout=60)
    ckpt.wait(timeout=60)  # retention after step 1 done too: the outage hits step 2 only
    proxy.bandwidth_bps = 8 * MiB  # ~3 s for the step: time to kill it midway
    h = ckpt.save(9, state)
    h.wait("local", timeout=LOCAL_DURABLE_S)
    base = proxy.stats()["bytes_up"]
    deadline = time.monotonic() + 30
    while proxy.stats()["bytes_up"] - base < 6 * MiB and time.monotonic() < deadline:
        time.sleep(0.02)
    assert not h.done("remote")
    proxy.refuse = True  # the client sees a dead server until we have looked at the bucket
    server.kill()
    proxy.reset_all()
    assert not server.alive()
    try:
        server.restart()
        fs = server.filesystem()  # direct, not through the proxy
        assert committed(fs, url) == [1]
        assert not h.done("remote")
    finally:
        proxy.clear()
    with Watcher(fs, url, local_shard_size(local)) as watch:
        h.wait("remote", timeout=90)
        ckpt.wait(timeout=60)
    assert watch.violations == []
    assert committed(fs, url) == [1, 9]
    ckpt.close()
    assert restore_fresh(tmp_path, url, server.storage_options, state) == 9


def test_sigstop_short_hang_is_ridden_out(seaweedfs_healthy: SeaweedFS, tmp_path: Path, closing: Any) -> None:
    """SIGSTOP (a hung server) for ~3 s with short timeouts: save() stays fast, tier 1 keeps
    committing; after SIGCONT the upload completes with no error."""
    server = seaweedfs_healthy
    url = server.unique_url("stop")
    opts = without_client_timeouts(server.storage_options)
    ckpt = closing(
        tiercheck.Checkpointer(
            local=tmp_path / "l", remote=url, storage_options=opts, remote_retry_budget=25, remote_timeout=2
        )
    )
    ckpt.save(1, make_state(1)).wait(timeout=60)
    ckpt.wait(timeout=60)
    state = make_state(2, mib=4)
    server.stop_process()
    try:
        t0 = time.monotonic()
        h2 = ckpt.save(2, state)
        assert time.monotonic() - t0 < FAST_SAVE_S
        h2.wait("local", timeout=LOCAL_DURABLE_S)
        t0 = time.monotonic()
        ckpt.save(3, make_state(3)).wait("local", timeout=LOCAL_DURABLE_S)
        assert time.monotonic() - t0 < LOCAL_DURABLE_S
        time.sleep(max(0.0, 3 - (time.monotonic() - t0)))
        assert not h2.done("remote")
    finally:
        server.cont_process()
    run_bounded(lambda: ckpt.wait(), 90, "uploads after SIGCONT")
    assert ckpt.steps("remote")[-1] == 3
    run_bounded(ckpt.close, 30, "close()")
    assert restore_fresh(tmp_path, url, server.storage_options, make_state(3)) == 3


def test_sigstop_hang_longer_than_budget_is_bounded(seaweedfs_healthy: SeaweedFS, closing: Any) -> None:
    server = seaweedfs_healthy
    url = server.unique_url("stopb")
    opts = without_client_timeouts(server.storage_options)
    ckpt = closing(tiercheck.Checkpointer(remote=url, storage_options=opts, remote_retry_budget=2, remote_timeout=1))
    ckpt.save(1, make_state(1, mib=4)).wait(timeout=60)
    ckpt.wait(timeout=60)
    server.stop_process()
    try:
        t0 = time.monotonic()
        h2 = ckpt.save(2, make_state(2, mib=4))
        assert time.monotonic() - t0 < FAST_SAVE_S
        # budget 2 s + a few 1 s request timeouts: the step must have failed by 15 s, and
        # the next save() (which needs the host buffer back) must not block longer than that.
        with pytest.raises(tiercheck.TierError) as ei:
            run_bounded(lambda: h2.wait("remote"), 15, "a step uploading to a SIGSTOPped server")
        assert ei.value.tier == "remote" and ei.value.step == 2
        run_bounded(lambda: ckpt.save(3, make_state(3, mib=4)), 15, "save() while the server is hung")
    finally:
        server.cont_process()


# ------------------------------------------------------------------ permanent errors


def _assert_fails_once_quickly(ckpt: tiercheck.Checkpointer, url: str) -> None:
    t0 = time.monotonic()
    h = ckpt.save(1, make_state(1))
    assert time.monotonic() - t0 < FAST_SAVE_S
    h.wait("local", timeout=LOCAL_DURABLE_S)
    with pytest.raises(tiercheck.TierError) as ei:
        ckpt.wait(timeout=60)
    assert time.monotonic() - t0 < 20, "a permanent error was retried"
    err = ei.value
    assert err.tier == "remote" and err.step == 1 and err.path.startswith(url)
    ckpt.wait(timeout=10)  # once
    ckpt.close()


def test_s3_bad_credentials_fail_once_fast(seaweedfs_healthy: SeaweedFS, tmp_path: Path) -> None:
    url = seaweedfs_healthy.unique_url("creds")
    opts = dict(seaweedfs_healthy.storage_options, secret="not-the-secret")
    ckpt = tiercheck.Checkpointer(local=tmp_path / "l", remote=url, storage_options=opts, remote_retry_budget=120)
    _assert_fails_once_quickly(ckpt, url)
    assert committed(seaweedfs_healthy.filesystem(), url) == []


def test_azure_bad_credentials_fail_once_fast(azurite: Any, tmp_path: Path) -> None:
    from tests.helpers.servers.azurite import ACCOUNT

    url = azurite.unique_url("creds")
    bad_key = "A" * 86 + "=="
    conn = (
        f"DefaultEndpointsProtocol=http;AccountName={ACCOUNT};AccountKey={bad_key};"
        f"BlobEndpoint=http://127.0.0.1:{azurite.port}/{ACCOUNT};"
    )
    opts = dict(azurite.storage_options, connection_string=conn)
    ckpt = tiercheck.Checkpointer(local=tmp_path / "l", remote=url, storage_options=opts, remote_retry_budget=120)
    _assert_fails_once_quickly(ckpt, url)


# Not SeaweedFS: it creates a missing bucket on the first PutObject.
@pytest.mark.parametrize("server", ["azurite", "gcs_server"], indirect=True)
def test_missing_bucket_fails_once_fast(server: ObjectStoreServer, tmp_path: Path) -> None:
    url = f"{server.protocol}://tiercheck-no-such-bucket/run"
    ckpt = tiercheck.Checkpointer(
        local=tmp_path / "l", remote=url, storage_options=server.storage_options, remote_retry_budget=120
    )
    _assert_fails_once_quickly(ckpt, url)


def test_remote_only_bad_credentials_fail_fast(seaweedfs_healthy: SeaweedFS) -> None:
    """Without a local tier the bucket is the only tier: the error reaches the caller quickly
    as a TierError (at save() or the next wait()), never as a 120 s retry."""
    url = seaweedfs_healthy.unique_url("creds-only")
    opts = dict(seaweedfs_healthy.storage_options, secret="not-the-secret")
    ckpt = tiercheck.Checkpointer(remote=url, storage_options=opts, remote_retry_budget=120)
    t0 = time.monotonic()
    with pytest.raises(tiercheck.TierError) as ei:
        ckpt.save(1, make_state(1))
        ckpt.wait(timeout=60)
    assert time.monotonic() - t0 < 20
    assert ei.value.tier == "remote" and ei.value.path.startswith(url)
    ckpt.close()
