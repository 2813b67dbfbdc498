"""Disk full and read-only tier 1 on real, small filesystems made by the test.

Each test mounts its own tmpfs or loop-mounted ext4 image (we run as root; without
CAP_SYS_ADMIN they skip, saying why) and unmounts it in a `finally`, even on failure.
The faults are real kernel errors, not injected ones:

* the state is larger than the free space: the free-space check (statvfs) refuses it
  before anything is written, naming the shortfall;
* the check passes, then the disk fills while the step is written (another file takes
  the space between the check and the write; or the ext4 image runs out of inodes,
  which statvfs's byte count does not show): ENOSPC in the middle of the step;
* the filesystem is remounted read-only: EROFS, before or in the middle of a step.

Every case checks the same guarantees: the error reaches the caller once, as a
`TierError` naming tier "local", the step and a path under the tier; `save()` keeps
working; earlier committed steps stay listed and restore bit-exact; nothing
half-written is ever listed, and no temp directory is left (where the filesystem still
allows deleting it); and with a remote tier configured, the failed step still reaches
tier 2 from host memory and restores from there.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import os
import re
import shutil
import subprocess
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import fsspec
import pytest
import torch

import tiercheck
from tiercheck.format import naming
from tiercheck.tiers.local import LocalTier

MiB = 1 << 20


# ------------------------------------------------------------------ filesystems


def _sh(*cmd: str) -> subprocess.CompletedProcess[bytes]:
    return subprocess.run(cmd, check=True, capture_output=True, timeout=30)


def _why(exc: BaseException) -> str:
    if isinstance(exc, subprocess.CalledProcessError):
        return (exc.stderr or b"").decode(errors="replace").strip() or str(exc)
    return str(exc)


def _umount(mnt: Path) -> None:
    if subprocess.run(["umount", str(mnt)], capture_output=True, timeout=30).returncode != 0:
        # Busy (a failed test left a file open): detach now, the kernel frees it later.
        subprocess.run(["umount", "-l", str(mnt)], capture_output=True, timeout=30)


@contextlib.contextmanager
def _mounted(mnt: Path, *mount_args: str) -> Iterator[Path]:
    mnt.mkdir()
    try:
        _sh("mount", *mount_args, str(mnt))
    except (OSError, subprocess.SubprocessError) as exc:
        pytest.skip(f"mounting refused here (needs root or CAP_SYS_ADMIN): {_why(exc)}")
    try:
        yield mnt
    finally:
        _umount(mnt)


@contextlib.contextmanager
def tmpfs(tmp_path: Path, size: str = "8m") -> Iterator[Path]:
    with _mounted(tmp_path / "tmpfs", "-t", "tmpfs", "-o", f"size={size}", "tiercheck-test") as mnt:
        yield mnt


@contextlib.contextmanager
def ext4(tmp_path: Path, size: int = 16 * MiB, inodes: int | None = None) -> Iterator[Path]:
    if shutil.which("mkfs.ext4") is None:
        pytest.skip("mkfs.ext4 is not installed")
    img = tmp_path / "ext4.img"
    with open(img, "wb") as f:
        f.truncate(size)
    _sh("mkfs.ext4", "-q", "-F", "-m", "0", *(["-N", str(inodes)] if inodes else []), str(img))
    with _mounted(tmp_path / "ext4", "-o", "loop", str(img)) as mnt:
        yield mnt


def remount(mnt: Path, mode: str) -> None:
    _sh("mount", "-o", f"remount,{mode}", str(mnt))


def free_bytes(path: Path) -> int:
    st = os.statvfs(path)
    return st.f_bavail * st.f_frsize


def fill(path: Path, leave: int) -> None:
    """Write `path` until at most `leave` bytes stay free (the ENOSPC at the end is expected)."""
    chunk = b"\xa5" * MiB
    with open(path, "wb") as f:
        while (room := free_bytes(path.parent) - leave) > 0:
            try:
                f.write(chunk[: min(len(chunk), room)])
                f.flush()
            except OSError as exc:
                if exc.errno != errno.ENOSPC:
                    raise
                break
        os.fsync(f.fileno())


# ------------------------------------------------------------------------ states


def state(step: int, nbytes: int) -> dict[str, Any]:
    g = torch.Generator().manual_seed(step)
    return {
        "w": torch.randint(0, 256, (nbytes,), dtype=torch.uint8, generator=g),
        "f": torch.randn(257, generator=g),
        "step": step,
    }


def assert_same(got: dict[str, Any], step: int, nbytes: int) -> None:
    want = state(step, nbytes)
    assert got["step"] == step
    for k in ("w", "f"):
        assert got[k].dtype == want[k].dtype and got[k].shape == want[k].shape
        assert torch.equal(got[k].view(torch.uint8), want[k].view(torch.uint8)), k


def assert_restores(ckpt: tiercheck.Checkpointer, step: int, nbytes: int) -> None:
    template = {"w": torch.zeros(nbytes, dtype=torch.uint8), "f": torch.zeros(257), "step": -1}
    assert ckpt.restore(template, step=step) == step
    assert_same(template, step, nbytes)


def visible_entries(root: Path) -> list[str]:
    """What a lister sees at the tier root, filesystem bookkeeping, the writer lock and the run log aside."""
    return sorted(
        n
        for n in os.listdir(root)
        if n not in ("lost+found", naming.RUNLOG_DIR) and not n.startswith(naming.LOCK_PREFIX)
    )


def assert_nothing_half_written(root: Path, committed: list[int]) -> None:
    assert visible_entries(root) == [naming.step_dir_name(s) for s in committed]
    for s in committed:
        assert sorted(os.listdir(root / naming.step_dir_name(s))) == sorted(
            [naming.shard_name(0, 1), naming.manifest_name(0, 1), naming.COMMIT_NAME]
        )


def assert_local_error(err: BaseException, step: int, root: Path, code: int) -> tiercheck.TierError:
    assert isinstance(err, tiercheck.TierError) and isinstance(err, OSError)
    assert (err.tier, err.step) == ("local", step)
    assert os.path.commonpath([err.path, str(root)]) == str(root), err.path
    assert f"step {step}" in str(err) and "'local'" in str(err)
    cause = err.__cause__
    assert isinstance(cause, OSError) and cause.errno == code, repr(cause)
    return err


def wait_finished(handle: tiercheck.SaveHandle) -> None:
    """Wait until the step is done or failed everywhere, without consuming its error
    (`handle.wait` would raise it, and then it is not raised again)."""
    deadline = time.monotonic() + 30
    while not handle.done():
        assert time.monotonic() < deadline, handle
        time.sleep(0.005)


@pytest.fixture
def remote_url(tmp_path: Path, request: pytest.FixtureRequest) -> Iterator[str]:
    if request.param == "memory":
        url = f"memory://diskfull-{uuid.uuid4().hex}"
        yield url
        with contextlib.suppress(FileNotFoundError):
            fsspec.filesystem("memory").rm(url, recursive=True)
    else:
        yield (tmp_path / "remote").as_uri()


# ---------------------------------------------------- free-space check (statvfs)


def test_state_larger_than_free_space_fails_once_naming_the_shortfall(tmp_path: Path) -> None:
    with tmpfs(tmp_path, "8m") as mnt:
        root = mnt / "ckpt"
        with tiercheck.Checkpointer(local=root, keep_local=2) as ckpt:
            ckpt.save(1, state(1, 2 * MiB)).wait()
            before = free_bytes(mnt)
            handle = ckpt.save(2, state(2, 12 * MiB))  # returns at once: training goes on
            with pytest.raises(tiercheck.TierError) as info:
                handle.wait()
            err = assert_local_error(info.value, 2, root, errno.ENOSPC)
            assert err.path == str(root)
            m = re.search(r"needs (\d+) bytes, (\d+) are free \(short by (\d+)\)", str(err))
            assert m is not None, str(err)
            need, free, short = map(int, m.groups())
            assert need >= 12 * MiB and short == need - free
            assert abs(free - before) <= MiB
            assert free_bytes(mnt) == before  # refused before a byte was written
            ckpt.wait()  # raised once: not again
            assert ckpt.steps() == [1]
            assert_nothing_half_written(root, [1])
            ckpt.save(3, state(3, 1 * MiB)).wait()  # a step that fits still commits
            assert ckpt.steps() == [1, 3]
            assert_restores(ckpt, 1, 2 * MiB)
            assert_restores(ckpt, 3, 1 * MiB)
        assert_nothing_half_written(root, [1, 3])
        assert_same(tiercheck.load(root, step=1), 1, 2 * MiB)


def test_a_full_disk_counts_the_spare_shard_the_next_step_overwrites(tmp_path: Path) -> None:
    # Room for two steps, not three: with keep_local=1 the deleted step's shard, held to be
    # recycled, is what the next step is written over, so the free-space check counts it as
    # free. A descriptor held on that shard keeps its blocks whatever tiercheck does: the save
    # succeeds only if the shard is overwritten in place, not freed and allocated again. (Not
    # a hard link: tiercheck never overwrites a file that has one, tests/tiers/test_links.py.)
    class SmallShards(LocalTier):
        RECYCLE_MIN = MiB

    with ext4(tmp_path, 24 * MiB) as mnt:
        root = mnt / "ckpt"
        nbytes = (free_bytes(mnt) * 2 // 5) // MiB * MiB
        tier = SmallShards(root)
        with tiercheck.Checkpointer(local=tier, keep_local=1) as ckpt:
            ckpt.save(0, state(0, nbytes)).wait()
            shard0 = root / naming.step_dir_name(0) / naming.shard_name(0, 1)
            held = os.open(shard0, os.O_RDONLY)
            try:
                ckpt.save(1, state(1, nbytes)).wait()
                ckpt.wait()
                deadline = time.monotonic() + 20
                while tier.spare_bytes == 0:
                    assert time.monotonic() < deadline, "step 0's shard was not kept"
                    time.sleep(0.01)
                assert free_bytes(mnt) < nbytes  # step 2 fits only over the spare
                ckpt.save(2, state(2, nbytes)).wait()
                a, b = os.fstat(held), os.stat(root / naming.step_dir_name(2) / naming.shard_name(0, 1))
                assert (a.st_dev, a.st_ino) == (b.st_dev, b.st_ino)
            finally:
                os.close(held)
            ckpt.wait()
            assert ckpt.steps() == [2]
            assert_restores(ckpt, 2, nbytes)


def test_the_error_is_raised_once_at_the_next_save_and_training_goes_on(tmp_path: Path) -> None:
    with tmpfs(tmp_path, "8m") as mnt:
        root = mnt / "ckpt"
        with tiercheck.Checkpointer(local=root, keep_local=2) as ckpt:
            ckpt.save(1, state(1, 1 * MiB)).wait()
            wait_finished(ckpt.save(2, state(2, 16 * MiB)))
            raised = []
            for step in (3, 4, 5):
                try:
                    ckpt.save(step, state(step, 1 * MiB)).wait()
                except tiercheck.TierError as exc:
                    raised.append((step, exc))
            assert len(raised) == 1
            assert raised[0][0] == 3  # at the first sync point after the failure
            assert_local_error(raised[0][1], 2, root, errno.ENOSPC)
            ckpt.wait()  # retention ran
            assert ckpt.steps() == [4, 5]  # the save that raised was not taken; keep_local=2
        assert_nothing_half_written(root, [4, 5])


@pytest.mark.parametrize("remote_url", ["memory", "file"], indirect=True)
def test_a_step_too_large_for_tier1_still_reaches_tier2(tmp_path: Path, remote_url: str) -> None:
    with tmpfs(tmp_path, "8m") as mnt:
        root = mnt / "ckpt"
        with tiercheck.Checkpointer(local=root, remote=remote_url, keep_local=2) as ckpt:
            ckpt.save(1, state(1, 2 * MiB)).wait()
            handle = ckpt.save(2, state(2, 12 * MiB))
            with pytest.raises(tiercheck.TierError) as info:
                handle.wait("local")
            assert_local_error(info.value, 2, root, errno.ENOSPC)
            handle.wait("remote")  # from host memory
            ckpt.wait()  # raised once already
            assert ckpt.steps("local") == [1]
            assert ckpt.steps("remote") == [1, 2]
            assert_nothing_half_written(root, [1])
            template = {"w": torch.zeros(12 * MiB, dtype=torch.uint8), "f": torch.zeros(257), "step": -1}
            assert ckpt.restore(template) == 2  # the newest step, from tier 2
            assert_same(template, 2, 12 * MiB)
            ckpt.save(3, state(3, 1 * MiB)).wait()
            assert ckpt.steps("local") == [1, 3]
            assert ckpt.steps("remote") == [1, 2, 3]
        assert_same(tiercheck.load(remote_url, step=2), 2, 12 * MiB)
        assert_same(tiercheck.load(root, step=1), 1, 2 * MiB)


# ------------------------------------------------- ENOSPC in the middle of a step


def fill_after_check(monkeypatch: pytest.MonkeyPatch, ballast: Path, step: int, leave: int) -> list[int]:
    """After the free-space check for `step` passes, another file takes the space (the
    race between the check and the write, made deterministic). Returns the free bytes
    the check saw."""
    seen: list[int] = []
    original = LocalTier.check_space

    def check_then_fill(self: LocalTier, s: int, nbytes: int, *args: Any) -> None:
        original(self, s, nbytes, *args)
        if s == step:
            seen.append(free_bytes(Path(self.root)))
            fill(ballast, leave)

    monkeypatch.setattr(LocalTier, "check_space", check_then_fill)
    return seen


@pytest.mark.parametrize("fs", ["tmpfs", "ext4"])
def test_disk_fills_during_the_write(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, fs: str) -> None:
    mount: Callable[[Path], contextlib.AbstractContextManager[Path]] = tmpfs if fs == "tmpfs" else ext4
    with mount(tmp_path) as mnt:
        root = mnt / "ckpt"
        ballast = mnt / "other-job.bin"
        seen = fill_after_check(monkeypatch, ballast, step=2, leave=MiB)
        with tiercheck.Checkpointer(local=root, keep_local=2) as ckpt:
            ckpt.save(1, state(1, 1 * MiB)).wait()
            handle = ckpt.save(2, state(2, 3 * MiB))
            with pytest.raises(tiercheck.TierError) as info:
                handle.wait()
            assert seen and seen[0] > 3 * MiB  # the check passed: this ENOSPC came mid-write
            err = assert_local_error(info.value, 2, root, errno.ENOSPC)
            assert "No space left" in str(err)
            ckpt.wait()
            assert ckpt.steps() == [1]
            assert_nothing_half_written(root, [1])  # the partial step was removed
            assert_restores(ckpt, 1, 1 * MiB)
            ballast.unlink()  # the other job is gone: saving works again
            ckpt.save(3, state(3, 3 * MiB)).wait()
            assert ckpt.steps() == [1, 3]
            assert_restores(ckpt, 3, 3 * MiB)
        assert_nothing_half_written(root, [1, 3])


@pytest.mark.parametrize("remote_url", ["memory"], indirect=True)
def test_disk_fills_during_the_write_with_a_remote_tier(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, remote_url: str
) -> None:
    with ext4(tmp_path) as mnt:
        root = mnt / "ckpt"
        fill_after_check(monkeypatch, mnt / "other-job.bin", step=2, leave=MiB)
        with tiercheck.Checkpointer(local=root, remote=remote_url, keep_local=2) as ckpt:
            ckpt.save(1, state(1, 1 * MiB)).wait()
            handle = ckpt.save(2, state(2, 3 * MiB))
            with pytest.raises(tiercheck.TierError) as info:
                handle.wait("local")
            assert_local_error(info.value, 2, root, errno.ENOSPC)
            handle.wait("remote")
            ckpt.wait()
            assert ckpt.steps("local") == [1] and ckpt.steps("remote") == [1, 2]
            assert_nothing_half_written(root, [1])
        assert_same(tiercheck.load(remote_url, step=2), 2, 3 * MiB)
        assert_same(tiercheck.load(root, step=1), 1, 1 * MiB)


def test_inode_exhaustion_mid_step(tmp_path: Path) -> None:
    """statvfs reports megabytes free, but the ext4 image has no inode left for the files of
    the step: ENOSPC after the step's temp directory was created."""
    with ext4(tmp_path, inodes=32) as mnt:
        root = mnt  # the tier root is the mount: every inode is the step's
        ballast_dir = mnt / "ballast"
        ballast_dir.mkdir()
        spare = os.statvfs(mnt).f_favail - 6  # leave 6: the writer lock, one step (4 inodes), then 1
        for i in range(spare):
            (ballast_dir / str(i)).touch()
        # No run log: its directory and file would take two of the inodes counted here.
        with tiercheck.Checkpointer(local=root, keep_local=2, run_log_interval=None) as ckpt:
            ckpt.save(1, state(1, 64 << 10)).wait()
            assert os.statvfs(mnt).f_favail == 1
            assert free_bytes(mnt) > 8 * MiB
            handle = ckpt.save(2, state(2, 64 << 10))
            with pytest.raises(tiercheck.TierError) as info:
                handle.wait()
            assert_local_error(info.value, 2, root, errno.ENOSPC)
            ckpt.wait()
            assert ckpt.steps() == [1]
            assert sorted(n for n in visible_entries(root) if n != "ballast") == [naming.step_dir_name(1)]
            assert os.statvfs(mnt).f_favail == 1  # the temp directory's inode was given back
            assert_restores(ckpt, 1, 64 << 10)
            shutil.rmtree(ballast_dir)
            ckpt.save(3, state(3, 64 << 10)).wait()
            assert ckpt.steps() == [1, 3]
        assert_nothing_half_written(root, [1, 3])
        assert_same(tiercheck.load(root, step=3), 3, 64 << 10)


def test_another_process_churning_the_free_space(tmp_path: Path) -> None:
    """A real race: another writer fills the disk and frees it again, over and over, while
    steps are saved. Whatever each step meets, it either commits or fails once with ENOSPC;
    every listed step restores bit-exact and nothing partial is left."""
    with tmpfs(tmp_path, "8m") as mnt:
        root = mnt / "ckpt"
        stop = threading.Event()
        churned = [0]

        def churn() -> None:
            while not stop.is_set():
                with contextlib.suppress(OSError):
                    fill(mnt / "other-job.bin", leave=0)
                churned[0] += 1
                time.sleep(0.002)
                with contextlib.suppress(FileNotFoundError):
                    (mnt / "other-job.bin").unlink()
                time.sleep(0.002)

        filler = threading.Thread(target=churn, daemon=True)
        outcomes: dict[int, str] = {}
        with tiercheck.Checkpointer(local=root, keep_local=3) as ckpt:
            filler.start()
            try:
                for step in range(1, 41):
                    try:
                        ckpt.save(step, state(step, 1 * MiB)).wait()
                        outcomes[step] = "committed"
                    except tiercheck.TierError as exc:
                        assert_local_error(exc, step, root, errno.ENOSPC)
                        outcomes[step] = "failed"
            finally:
                stop.set()
                filler.join(10)
            ckpt.wait()  # every error was raised by its handle already
            committed = [s for s, o in outcomes.items() if o == "committed"]
            assert ckpt.steps() == committed[-3:]
            for s in ckpt.steps():
                assert_restores(ckpt, s, 1 * MiB)
        assert churned[0] > 0
        with contextlib.suppress(FileNotFoundError):
            (mnt / "other-job.bin").unlink()
        assert_nothing_half_written(root, committed[-3:])
        print(f"churn: {len(committed)} committed, {len(outcomes) - len(committed)} failed with ENOSPC")


# ------------------------------------------------------------------------ EROFS


@pytest.mark.parametrize("remote_url", ["memory"], indirect=True)
@pytest.mark.parametrize("with_remote", [False, True], ids=["local-only", "with-remote"])
def test_read_only_filesystem(tmp_path: Path, remote_url: str, with_remote: bool) -> None:
    with ext4(tmp_path) as mnt:
        root = mnt / "ckpt"
        remote = remote_url if with_remote else None
        with tiercheck.Checkpointer(local=root, remote=remote, keep_local=2) as ckpt:
            ckpt.save(1, state(1, 1 * MiB)).wait()
            remount(mnt, "ro")
            try:
                handle = ckpt.save(2, state(2, 1 * MiB))
                with pytest.raises(tiercheck.TierError) as info:
                    handle.wait("local")
                assert_local_error(info.value, 2, root, errno.EROFS)
                if with_remote:
                    handle.wait("remote")
                    assert ckpt.steps("remote") == [1, 2]
                ckpt.wait()
                assert ckpt.steps("local") == [1]
                assert_nothing_half_written(root, [1])
                assert_restores(ckpt, 1, 1 * MiB)  # reading a read-only tier works
            finally:
                remount(mnt, "rw")
            ckpt.save(3, state(3, 1 * MiB)).wait()
            assert ckpt.steps("local") == [1, 3]
        assert_nothing_half_written(root, [1, 3])
        if with_remote:
            assert_same(tiercheck.load(remote_url, step=2), 2, 1 * MiB)


@pytest.mark.parametrize("remote_url", ["memory"], indirect=True)
def test_a_first_save_where_the_writer_lock_cannot_be_created_still_goes_on(tmp_path: Path, remote_url: str) -> None:
    """Read-only before this Checkpointer ever wrote: the lock file cannot be created. The
    save is not refused for that (the directory is written unlocked, with a warning); tier 1
    fails as any write would, once, and tier 2 still gets the step."""
    with ext4(tmp_path) as mnt:
        root = mnt / "ckpt"
        root.mkdir()
        remount(mnt, "ro")
        warned: list[str] = []
        handler = logging.Handler()
        handler.emit = lambda record: warned.append(record.getMessage())  # type: ignore[method-assign]
        logging.getLogger("tiercheck").addHandler(handler)
        try:
            with tiercheck.Checkpointer(local=root, remote=remote_url, keep_local=2) as ckpt:
                handle = ckpt.save(1, state(1, 1 * MiB))
                with pytest.raises(tiercheck.TierError) as info:
                    handle.wait("local")
                assert_local_error(info.value, 1, root, errno.EROFS)
                handle.wait("remote")
                ckpt.wait()
                assert ckpt.steps("remote") == [1]
            assert any("cannot lock" in m for m in warned), warned
            assert os.listdir(root) == []
        finally:
            logging.getLogger("tiercheck").removeHandler(handler)
            remount(mnt, "rw")
        assert_same(tiercheck.load(remote_url, step=1), 1, 1 * MiB)


def test_read_only_in_the_middle_of_a_step(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Remounted read-only after the shard is written: the manifest fails with EROFS, and the
    partial step cannot even be deleted. It stays invisible (no marker: never listed, never
    restored), and the next Checkpointer that writes to the directory removes it."""
    with ext4(tmp_path) as mnt:
        root = mnt / "ckpt"
        original = LocalTier.write_file
        shard_of_step_2 = naming.step_dir_name(2) + "-"

        def write_then_remount(self: LocalTier, path: str, data: memoryview, aligned: bool, *args: Any) -> None:
            original(self, path, data, aligned, *args)
            if shard_of_step_2 in path and path.endswith(".shard"):
                remount(mnt, "ro")

        monkeypatch.setattr(LocalTier, "write_file", write_then_remount)
        with tiercheck.Checkpointer(local=root, keep_local=2) as ckpt:
            ckpt.save(1, state(1, 1 * MiB)).wait()
            try:
                handle = ckpt.save(2, state(2, 1 * MiB))
                with pytest.raises(tiercheck.TierError) as info:
                    handle.wait()
                assert_local_error(info.value, 2, root, errno.EROFS)
                assert ckpt.steps() == [1]
                leftovers = [n for n in visible_entries(root) if naming.is_leftover(n)]
                assert len(leftovers) <= 1
                assert visible_entries(root) == sorted([naming.step_dir_name(1), *leftovers])
                assert_restores(ckpt, 1, 1 * MiB)
            finally:
                remount(mnt, "rw")
            ckpt.save(3, state(3, 1 * MiB)).wait()
            assert ckpt.steps() == [1, 3]
        with tiercheck.Checkpointer(local=root, keep_local=2) as fresh:
            assert fresh.steps() == [1, 3]
            fresh.prepare(state(4, 1 * MiB))  # the writer sweeps
        assert_nothing_half_written(root, [1, 3])
