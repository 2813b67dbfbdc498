"""Unfinished multipart uploads are aborted, not left billed in the bucket forever: by the
drain before SIGTERM goes on, and by the restarted writer of a rank killed mid-upload.
Against the real SeaweedFS server (which lists unfinished uploads: ListMultipartUploads)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import torch

import tiercheck
from tests.helpers.servers.seaweedfs import SeaweedFS
from tiercheck.format import naming
from tiercheck.tiers.remote import RemoteTier

MiB = 1 << 20


def unfinished(fs: Any, url: str) -> dict[str, str]:
    """upload id -> key of every unfinished multipart upload under `url`."""
    bucket, key, _ = fs.split_path(url)
    out = fs.call_s3("list_multipart_uploads", Bucket=bucket, Prefix=key.rstrip("/") + "/")
    return {u["UploadId"]: u["Key"] for u in out.get("Uploads", [])}


def begin(fs: Any, path: str) -> str:
    """An unfinished upload of `path` with one part sent, as a killed writer leaves it."""
    bucket, key, _ = fs.split_path(path)
    upload_id: str = fs.call_s3("create_multipart_upload", Bucket=bucket, Key=key)["UploadId"]
    fs.call_s3("upload_part", Bucket=bucket, Key=key, UploadId=upload_id, PartNumber=1, Body=b"x" * (5 * MiB))
    return upload_id


def wait_for(condition: Any, what: str, timeout: float = 120.0) -> Any:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if value := condition():
            return value
        time.sleep(0.05)
    raise AssertionError(f"timed out waiting for {what}")


CHILD = """
import sys, threading, torch, tiercheck
root, url, options, handler = sys.argv[1], sys.argv[2], eval(sys.argv[3]), sys.argv[4]
ckpt = tiercheck.Checkpointer(
    local=root, remote=url, storage_options=options, keep_local=None, remote_part_size=5 << 20,
    remote_concurrency=2, remote_write_rate=1 << 20, remote_timeout=30, remote_retry_budget=30,
)
if handler == "1":
    ckpt.install_sigterm_handler(grace_s=1)
g = torch.Generator().manual_seed(1)
ckpt.save(1, {"x": torch.randn(4 << 20, generator=g)})  # 16 MiB: 4 parts of 5 MiB at 1 MiB/s
print("saved", flush=True)
threading.Event().wait()
"""


def start_child(tmp_path: Path, url: str, server: SeaweedFS, handler: bool) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, "-c", CHILD, str(tmp_path / "l"), url, repr(server.storage_options), "1" if handler else "0"],
        stdout=subprocess.PIPE,
        text=True,
        cwd=Path(__file__).resolve().parents[2],
    )


def test_drain_out_of_grace_aborts_the_upload_before_sigterm(seaweedfs_healthy: SeaweedFS, tmp_path: Path) -> None:
    """SIGTERM under the draining handler (grace 1 s) while a 16 MiB shard is uploaded at
    1 MiB/s: the drain runs out of grace, the upload is aborted, then the process dies by
    SIGTERM, leaving no unfinished upload in the bucket."""
    fs = seaweedfs_healthy.filesystem()
    url = seaweedfs_healthy.unique_url("grace")
    proc = start_child(tmp_path, url, seaweedfs_healthy, handler=True)
    try:
        assert proc.stdout is not None and proc.stdout.readline().strip() == "saved"
        wait_for(lambda: unfinished(fs, url), "the shard's multipart upload to begin")
        os.kill(proc.pid, signal.SIGTERM)
        rc = proc.wait(timeout=120)
    finally:
        proc.kill()
    assert rc == -signal.SIGTERM
    assert unfinished(fs, url) == {}
    assert (tmp_path / "l" / naming.step_dir_name(1) / naming.COMMIT_NAME).is_file()  # tier 1 drained first


def test_restarted_writer_aborts_the_upload_a_killed_one_left(seaweedfs_healthy: SeaweedFS, tmp_path: Path) -> None:
    """SIGKILL mid-upload leaves the shard's upload unfinished; the restarted job aborts it
    before its first upload, and leaves alone an upload of a name it did not make. Its step
    2 is on tier 2, and step 1 on tier 1, restorable bit-exact."""
    fs = seaweedfs_healthy.filesystem()
    url = seaweedfs_healthy.unique_url("killed")
    proc = start_child(tmp_path, url, seaweedfs_healthy, handler=False)
    try:
        assert proc.stdout is not None and proc.stdout.readline().strip() == "saved"
        left = wait_for(lambda: unfinished(fs, url), "the shard's multipart upload to begin")
        os.kill(proc.pid, signal.SIGKILL)
        assert proc.wait(timeout=60) == -signal.SIGKILL
    finally:
        proc.kill()
    assert unfinished(fs, url).keys() >= left.keys()  # the killed upload stays: nobody aborted it
    foreign = begin(fs, f"{url}/notes/big-file.bin")  # the user's upload under the same prefix
    opts = seaweedfs_healthy.storage_options
    g = torch.Generator().manual_seed(1)
    expected = {"x": torch.randn(4 << 20, generator=g)}
    with tiercheck.Checkpointer(
        local=tmp_path / "l", remote=url, storage_options=opts, keep_local=None, remote_part_size=5 << 20
    ) as ckpt:
        ckpt.save(2, {"x": expected["x"] + 1}).wait()
        assert ckpt.steps("remote")[-1] == 2
    assert unfinished(fs, url) == {foreign: f"{fs.split_path(url)[1]}/notes/big-file.bin"}
    assert torch.equal(tiercheck.load(tmp_path / "l", 1)["x"], expected["x"])
    assert torch.equal(tiercheck.load(url, 2, storage_options=opts)["x"], expected["x"] + 1)


def test_sweep_aborts_only_the_uploads_no_live_rank_owns(seaweedfs_healthy: SeaweedFS) -> None:
    """Rank 1 of 2 aborts the unfinished uploads of rank 1's files (of any world size), and
    rank 0 those of rank 0 and of ranks the job no longer has; neither touches the other's
    (a live rank may be sending them), another name, or another prefix."""
    fs = seaweedfs_healthy.filesystem()
    url = seaweedfs_healthy.unique_url("ranks")
    step = naming.step_dir_name(7)
    ids = {
        name: begin(fs, f"{url}/{step}/{name}")
        for name in (
            naming.shard_name(0, 2),
            naming.shard_name(1, 2),
            naming.manifest_name(1, 4),
            naming.shard_name(3, 4),
        )
    }
    other = {
        "user": begin(fs, f"{url}/{step}/rank-00001-of-00002.shard.bak"),
        "sibling": begin(fs, f"{url}-other/{step}/{naming.shard_name(1, 2)}"),
    }
    tier = RemoteTier(url, seaweedfs_healthy.storage_options)
    tier.sweep_before_upload(1, 2)
    tier.open_step(8, 1).abort()
    left = set(unfinished(fs, url))
    assert left == {ids[naming.shard_name(0, 2)], ids[naming.shard_name(3, 4)], other["user"]}
    tier.open_step(9, 1).abort()  # once per writer: the same tier does not list again
    tier0 = RemoteTier(url, seaweedfs_healthy.storage_options)
    tier0.sweep_before_upload(0, 2)
    tier0.open_step(8, 0).abort()
    assert set(unfinished(fs, url)) == {other["user"]}
    assert set(unfinished(fs, f"{url}-other")) == {other["sibling"]}


def test_gcs_sweep_deletes_the_part_objects_a_killed_upload_left(gcs_server: Any) -> None:
    """GCS: a kill mid-composite-upload leaves part objects beside the file; the restarted
    writer of rank 0 deletes those of its files (a part and a composed group), not a part
    object of a name tiercheck did not make."""
    fs = gcs_server.filesystem()
    url = gcs_server.unique_url("parts")
    step = f"{url}/{naming.step_dir_name(7)}"
    mine = [
        f"{step}/{naming.shard_name(0, 1)}.tcpart-{'a' * 12}-00001-abcdef",
        f"{step}/{naming.shard_name(0, 1)}.tcpart-{'a' * 12}-c000",
    ]
    theirs = f"{step}/notes.bin.tcpart-{'b' * 12}-00001-abcdef"
    for path in [*mine, theirs]:
        fs.pipe_file(path, b"part")
    tier = RemoteTier(url, gcs_server.storage_options)
    tier.sweep_before_upload(0, 1)
    tier.open_step(8, 0).abort()
    fs.invalidate_cache()
    assert [p.rsplit("/", 1)[-1] for p in fs.find(url)] == [theirs.rsplit("/", 1)[-1]]
