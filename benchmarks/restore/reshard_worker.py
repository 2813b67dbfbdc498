"""One rank of a `restore/reshard.py` job (started by it, not by hand):

    python benchmarks/restore/reshard_worker.py MODE RANK WORLD PORT SPEC_JSON

SPEC holds ``checkout`` (the tiercheck checkout under test: put first on ``sys.path``, so
this file imports nothing else from the benchmarks; a base revision's checkout runs the same
worker), ``tensors`` ([name, rows, cols] fp32, the global state, deterministic from a
seed per tensor), ``mesh`` and ``placements`` (this job's layout, e.g. [2, 2] and
["S0", "S1"]), ``tc_dir`` (tier 1 of tiercheck), ``dcp_dir`` (a DCP directory or null),
``methods``, ``repeats`` and ``out`` (where this rank writes its JSON).

MODE ``save``: the ranks save the state as DTensors of the layout with tiercheck (step 1)
and, when ``dcp_dir`` is set, with ``torch.distributed.checkpoint.save`` (what a DCP user
has: one file per saving rank). MODE ``restore``: ``repeats`` times, each method of
``methods`` in an order rotated between repeats (``tiercheck``: a fresh Checkpointer's
``restore`` of zeroed DTensors of this job's layout; ``dcp``: ``dcp.load`` into the same
template), with every file of both directories dropped from the page cache first
(``os.sync`` and ``POSIX_FADV_DONTNEED`` by rank 0, then a barrier), or with ``cache``
``"warm"`` in SPEC read whole once by rank 0 instead (both methods then read from memory,
as a restart on the node that just wrote them would). Per call and rank: the
wall time of the call, the bytes tiercheck read from shard files (counted by wrapping
``ShardFiles.read_into``, the one shard reader every restore goes through), and the
``rchar`` / ``read_bytes`` deltas of ``/proc/self/io`` (everything the process read:
shards, manifests, markers, sockets; and what came from the disk). Every restored piece is
compared with the saved one (bit-exact) after its first timed call.
"""

from __future__ import annotations

import json
import os
import sys
import time
from typing import Any

MODE, RANK, WORLD, PORT, SPEC_TEXT = sys.argv[1:6]
SPEC: dict[str, Any] = json.loads(SPEC_TEXT)
sys.path.insert(0, SPEC["checkout"])

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

import tiercheck  # noqa: E402


def io_counters() -> dict[str, int]:
    out = {}
    with open("/proc/self/io") as f:
        for line in f:
            k, v = line.split(":")
            out[k] = int(v)
    return out


def files_of(*dirs: str | None) -> list[str]:
    """Every file under `dirs` (None: none)."""
    return [os.path.join(p, n) for d in dirs if d for p, _, names in os.walk(d) for n in names]


def warm_cache(*dirs: str | None) -> None:
    """Read every file of `dirs` once, so the calls after it find every page in memory."""
    for path in files_of(*dirs):
        with open(path, "rb", buffering=0) as f:
            while f.read(8 << 20):
                pass


def drop_cache(*dirs: str | None) -> None:
    os.sync()
    for path in files_of(*dirs):
        fd = os.open(path, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def global_tensor(i: int, rows: int, cols: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(1000 + i)
    return torch.rand(rows, cols, generator=g)


def placement(text: str) -> Any:
    from torch.distributed.tensor import Replicate, Shard

    return Replicate() if text == "R" else Shard(int(text[1:]))


def local_box(full_shape: tuple[int, ...], mesh: Any, places: list[Any]) -> tuple[tuple[int, ...], tuple[int, ...]]:
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    shape, offsets = compute_local_shape_and_global_offset(full_shape, mesh, places)
    return tuple(int(o) for o in offsets), tuple(int(s) for s in shape)


def piece_of(full: torch.Tensor, box: tuple[tuple[int, ...], tuple[int, ...]]) -> torch.Tensor:
    t = full
    for dim, (o, s) in enumerate(zip(*box, strict=True)):
        t = t.narrow(dim, o, s)
    return t.clone()  # its own storage, not a view of the whole tensor


def main() -> None:
    rank, world = int(RANK), int(WORLD)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{PORT}", rank=rank, world_size=world)
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor

    mesh = init_device_mesh("cpu", tuple(SPEC["mesh"]))
    places = [placement(p) for p in SPEC["placements"]]
    expected: dict[str, torch.Tensor] = {}
    state: dict[str, DTensor] = {}
    share = 0
    for i, (name, rows, cols) in enumerate(SPEC["tensors"]):
        full = global_tensor(i, rows, cols)
        box = local_box(tuple(full.shape), mesh, places)
        local = piece_of(full, box)
        share += local.numel() * local.element_size()
        if MODE == "restore":
            expected[name] = local
            local = torch.zeros_like(local)
        state[name] = DTensor.from_local(local, mesh, places, run_check=False, shape=full.shape, stride=full.stride())
        del full
    result: dict[str, Any] = {"rank": rank, "share_bytes": share, "calls": []}
    tc_kw = {"local": SPEC["tc_dir"], "keep_local": None, "run_log_interval": None, "coordination_timeout": 120}
    if MODE == "save":
        t0 = time.perf_counter()
        with tiercheck.Checkpointer(**tc_kw) as ck:
            ck.save(1, {"model": state, "step": 1}).wait()
            ck.wait()
        result["tiercheck_save_s"] = time.perf_counter() - t0
        if SPEC.get("dcp_dir"):
            from torch.distributed.checkpoint.state_dict_saver import save as dcp_save

            dist.barrier()
            t0 = time.perf_counter()
            dcp_save({"model": state}, checkpoint_id=SPEC["dcp_dir"])
            result["dcp_save_s"] = time.perf_counter() - t0
    else:
        counted = [0]
        try:
            from tiercheck.steps import catalog

            original = catalog.ShardFiles.read_into

            def counting(self: Any, name: str, offset: int, dest: memoryview) -> None:
                counted[0] += len(dest)
                original(self, name, offset, dest)

            catalog.ShardFiles.read_into = counting  # type: ignore[method-assign]
        except (ImportError, AttributeError):  # a revision without the one shard reader: rchar only
            counted[0] = -(1 << 62)
        methods = SPEC["methods"]
        checked: set[str] = set()
        for rep in range(SPEC["repeats"]):
            k = rep % len(methods)
            for method in methods[k:] + methods[:k]:
                for t in state.values():
                    t.to_local().zero_()
                ckpt: tiercheck.Checkpointer | None = None
                if method == "tiercheck":
                    ckpt = tiercheck.Checkpointer(**tc_kw)
                dist.barrier()
                if rank == 0:
                    prime = warm_cache if SPEC.get("cache") == "warm" else drop_cache
                    prime(SPEC["tc_dir"], SPEC.get("dcp_dir"))
                dist.barrier()
                io0, n0 = io_counters(), counted[0]
                t0 = time.perf_counter()
                if ckpt is not None:
                    tmpl: dict[str, Any] = {"model": state, "step": -1}
                    step = ckpt.restore(tmpl)
                    assert step == 1 and tmpl["step"] == 1, (step, tmpl["step"])
                else:
                    from torch.distributed.checkpoint.state_dict_loader import load as dcp_load

                    dcp_load({"model": state}, checkpoint_id=SPEC["dcp_dir"])
                elapsed = time.perf_counter() - t0
                io1, n1 = io_counters(), counted[0]
                if ckpt is not None:
                    ckpt.close()
                result["calls"].append(
                    {
                        "repeat": rep,
                        "method": method,
                        "s": elapsed,
                        "shard_bytes": n1 - n0,
                        "rchar": io1["rchar"] - io0["rchar"],
                        "read_bytes": io1["read_bytes"] - io0["read_bytes"],
                    }
                )
                if method not in checked:
                    checked.add(method)
                    bad = [n for n, t in state.items() if not torch.equal(t.to_local(), expected[n])]
                    if bad:
                        raise SystemExit(f"rank {rank}: {method} restored {bad} wrong")
                dist.barrier()
    with open(SPEC["out"], "w") as f:
        json.dump(result, f)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
