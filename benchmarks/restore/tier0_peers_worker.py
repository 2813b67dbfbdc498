"""One rank of a `restore/tier0_peers.py` job (started by it, not by hand):

    python benchmarks/restore/tier0_peers_worker.py MODE RANK WORLD PORT SPEC_JSON

A node is a set of rank processes with a shared-memory directory and a tier-1 directory of
its own (``SPEC.shm/node<n>``, ``SPEC.root/node<n>/...``), as in
``tests/helpers/tier0_worker.py``; ``SPEC.nodes`` gives each rank's node.

MODE ``save``: a Checkpointer with tier 0 and ``memory_peers=1`` saves step 0 (``SPEC.mib``
MiB of fp32 in ``SPEC.tensors`` tensors, deterministic per rank), waits until everything is
done (tier 0, tier 1 and the copy to the peer), writes its result and dies by SIGKILL: the
job is killed, its memory stays.

MODE ``restore``: the restarted job (same job id, ``memory_peer_rate=SPEC.rate``) restores
into a zeroed template and compares every byte. Timed per rank, by wrapping (no library
change): the whole ``restore()``, ``PeerCopies.fetch_replicas`` (the collective fetch:
holdings published through the store, transfers, the barrier, the marker), and the transfer
itself: ``PeerLink.receive_one`` on a receiving rank (with the time each chunk completed:
``PeerLink._wait`` is wrapped while it runs) and ``PeerLink.send_one`` on a holder (with
the rate limiter's budget when the send began: its 1-second bucket lets that much go
uncapped).

MODE ``cost``: three Checkpointers in one job, saved in turn (order rotated every repeat),
each save started together on every rank (a barrier) and waited for until the pipeline is
idle: ``tier1`` (no tier 0), ``tier0`` (``memory=True, memory_peers=0``), ``tier0+peers``
(``memory=True, memory_peers=1, memory_peer_rate=SPEC.save_rate``). Per save and rank: the
stall (``save()``), when tier 0 and tier 1 were written (``stats.tier_s``), when the step was
committed on tier 1 (``wait("local")``), when the pipeline was idle (``ckpt.wait()``: the copy
to the peer included), and the CPU seconds the process used from the call to idle.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import signal
import statistics
import sys
import threading
import time
from pathlib import Path
from typing import Any

MODE, RANK, WORLD, PORT, SPEC_TEXT = sys.argv[1:6]
SPEC: dict[str, Any] = json.loads(SPEC_TEXT)
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

import tiercheck  # noqa: E402
from tiercheck.engine import peers as engine_peers  # noqa: E402
from tiercheck.job import peers as job_peers  # noqa: E402

rank, world = int(RANK), int(WORLD)
node = SPEC["nodes"][rank]


def make_state(step: int) -> dict[str, torch.Tensor]:
    n = SPEC["mib"] * (1 << 20) // 4 // SPEC["tensors"]
    g = torch.Generator().manual_seed(1000 * rank + step)
    return {f"t{i:02d}": torch.randn(n, generator=g) for i in range(SPEC["tensors"])}


def template() -> dict[str, torch.Tensor]:
    n = SPEC["mib"] * (1 << 20) // 4 // SPEC["tensors"]
    return {f"t{i:02d}": torch.zeros(n) for i in range(SPEC["tensors"])}


def checkpointer(name: str, memory: bool, peers: int, rate: float | None) -> Any:
    here = os.path.join(SPEC["root"], f"node{node}")
    shm = os.path.join(SPEC["shm"], f"node{node}")
    os.makedirs(shm, exist_ok=True)
    return tiercheck.Checkpointer(
        local=os.path.join(here, f"ckpt-{name}"),
        keep_local=1,
        memory=memory,
        memory_dir=shm if memory else None,
        job_id=f"{SPEC['job_id']}-{name}" if memory else None,
        keep_memory=1,
        memory_peers=peers,
        memory_peer_rate=rate,
        run_log_interval=None,
        coordination_timeout=SPEC.get("coord", 120.0),
    )


def write_out(out: dict[str, Any]) -> None:
    tmp = SPEC["out"] + ".tmp"
    with open(tmp, "w") as f:
        json.dump(out, f)
    os.replace(tmp, SPEC["out"])


class _Events(logging.Handler):
    def __init__(self) -> None:
        super().__init__()
        self.events: list[dict[str, Any]] = []

    def emit(self, record: logging.LogRecord) -> None:
        with contextlib.suppress(ValueError):
            self.events.append(json.loads(record.getMessage()))


# --------------------------------------------------------------------------- save


def save() -> None:
    state = make_state(0)
    ck = checkpointer("peers", True, 1, SPEC.get("save_rate"))
    t0 = time.perf_counter()
    h = ck.save(0, state)
    stall = time.perf_counter() - t0
    h.wait()
    ck.wait()  # the copy to the peer included
    done = time.perf_counter() - t0
    dist.barrier()
    write_out({"rank": rank, "stall_s": stall, "idle_s": done, "memory": ck.steps("memory")})
    os.kill(os.getpid(), signal.SIGKILL)  # the job is killed: no close, tier 0 stays


# --------------------------------------------------------------------------- restore


def instrument(rec: dict[str, Any]) -> None:
    """Time the fetch and its transfers by wrapping library functions (their code unchanged)."""
    recv_tl = threading.local()
    orig_fetch = engine_peers.PeerCopies.fetch_replicas
    orig_accept_own = engine_peers.PeerCopies._accept_own
    orig_recv = job_peers.PeerLink.receive_one
    orig_send = job_peers.PeerLink.send_one
    orig_wait = job_peers.PeerLink._wait

    def fetch_replicas(self: Any) -> Any:
        rec["fetch_start"] = time.perf_counter()
        try:
            return orig_fetch(self)
        finally:
            rec["fetch_end"] = time.perf_counter()

    def accept_own(self: Any, source: int, nbytes: int, step: int) -> Any:
        rec["recv_bytes"] = nbytes
        rec["recv_from"] = source
        return orig_accept_own(self, source, nbytes, step)

    def receive_one(self: Any, src: int, step: int, accept: Any) -> Any:
        recv_tl.marks = []
        rec["recv_start"] = time.perf_counter()
        try:
            return orig_recv(self, src, step, accept)
        finally:
            rec["recv_end"] = time.perf_counter()
            rec["recv_marks"] = recv_tl.marks
            recv_tl.marks = None

    def send_one(self: Any, dst: int, outgoing: Any) -> Any:
        limiter = getattr(self._throttle, "__self__", None)
        now = time.perf_counter()
        if limiter is not None and limiter._rate is not None:
            bucket = min(limiter._rate, limiter._available + (time.monotonic() - limiter._last) * limiter._rate)
        else:
            bucket = None
        rec.setdefault("sends", []).append({"dst": dst, "bytes": outgoing.shard.numel(), "bucket": bucket})
        try:
            return orig_send(self, dst, outgoing)
        finally:
            rec["sends"][-1]["s"] = time.perf_counter() - now

    def wait(self: Any, work: list[Any]) -> None:
        marks = getattr(recv_tl, "marks", None)
        if marks is None:
            return orig_wait(self, work)
        batch = []
        for w in work:  # in posting order: header; then marker, manifest, chunk 0, 1, ...
            orig_wait(self, [w])
            batch.append(time.perf_counter())
        marks.append(batch)

    engine_peers.PeerCopies.fetch_replicas = fetch_replicas  # type: ignore[method-assign]
    engine_peers.PeerCopies._accept_own = accept_own  # type: ignore[method-assign]
    job_peers.PeerLink.receive_one = receive_one  # type: ignore[method-assign]
    job_peers.PeerLink.send_one = send_one  # type: ignore[method-assign]
    job_peers.PeerLink._wait = wait  # type: ignore[method-assign]


def restore() -> None:
    rec: dict[str, Any] = {"rank": rank, "node": node}
    instrument(rec)
    events = _Events()
    logging.getLogger("tiercheck.events").addHandler(events)
    logging.getLogger("tiercheck.events").setLevel(logging.INFO)
    state = template()
    t0 = time.perf_counter()
    ck = checkpointer("peers", True, 1, SPEC["rate"])
    rec["init_s"] = time.perf_counter() - t0
    dist.barrier()
    t1 = time.perf_counter()
    step = ck.restore(state)
    t2 = time.perf_counter()
    rec["restore_s"] = t2 - t1
    rec["step"] = step
    want = make_state(0)
    rec["exact"] = all(torch.equal(state[k], want[k]) for k in want)
    rec["tier"] = [e.get("tier") for e in events.events if e.get("event") == "restore"]
    for k in ("fetch_start", "fetch_end", "recv_start", "recv_end"):
        if k in rec:
            rec[k] -= t1  # seconds since restore() was called
    if "recv_marks" in rec:
        rec["recv_marks"] = [[x - t1 for x in batch] for batch in rec["recv_marks"]]
    rec["chunk"] = job_peers.CHUNK
    write_out(rec)
    dist.barrier()
    os._exit(0)  # the driver removes the directories


# --------------------------------------------------------------------------- cost


def cpu_s() -> float:
    t = os.times()
    return t.user + t.system


METHODS = ("tier1", "tier0", "tier0+peers")


def rotated(items: tuple[str, ...], k: int) -> list[str]:
    k %= len(items)
    return list(items[k:]) + list(items[:k])


def three_checkpointers(state: Any) -> dict[str, Any]:
    """The methods compared: tier 1 alone, tier 0 + tier 1, and tier 0 with a copy on the
    other node; every host buffer allocated first."""
    cks = {
        "tier1": checkpointer("t1", False, 0, None),
        "tier0": checkpointer("t0", True, 0, None),
        "tier0+peers": checkpointer("t0p", True, 1, SPEC.get("save_rate")),
    }
    for ck in cks.values():
        ck.prepare(state)
    return cks


def cost() -> None:
    state = make_state(0)
    cks = three_checkpointers(state)
    rows = []
    step = 0
    warm = SPEC.get("warmup", 2)
    for rep in range(-warm, SPEC["repeats"]):
        for name in rotated(METHODS, rep):
            step += 1
            ck = cks[name]
            for t in state.values():
                t.add_(1.0)  # the state changes between saves
            dist.barrier()
            c0 = cpu_s()
            t0 = time.perf_counter()
            h = ck.save(step, state)
            t1 = time.perf_counter()
            if name != "tier1":
                h.wait("memory")
            t2 = time.perf_counter()
            h.wait("local")
            t3 = time.perf_counter()
            ck.wait()
            t4 = time.perf_counter()
            c1 = cpu_s()
            st = h.stats.tier_s
            if rep >= 0:
                rows.append(
                    {
                        "repeat": rep,
                        "method": name,
                        "stall_s": t1 - t0,
                        "memory_wait_s": (t2 - t0) if name != "tier1" else None,
                        "memory_written_s": st.get("memory"),
                        "local_written_s": st.get("local"),
                        "durable_s": t3 - t0,
                        "idle_s": t4 - t0,
                        "cpu_s": c1 - c0,
                    }
                )
    dist.barrier()
    write_out({"rank": rank, "rows": rows})
    dist.barrier()
    os._exit(0)  # the driver removes the directories


# --------------------------------------------------------------------------- lost


def lost() -> None:
    """Lost training time per save: each rank trains an MLP + Adam on one thread; every save
    starts on every rank at the same step (a barrier and a fixed count of clean steps
    before it, so the collective saves and the copies pair up), and the training goes on
    until the Checkpointer is idle (copies to the peer included) plus `tail` steps. Lost =
    window time - window steps x the median clean step before the save; `none` (no save)
    is the noise floor. The state is `{"model": model, "optim": opt}`.

    With `SPEC["device_ms"]` > 0 the training models a GPU node instead of CPU training:
    each step is the host's share of a GPU step (a step of a small MLP, `host` below: the
    Python and launch work, about a millisecond) and then the host blocked for `device_ms`
    while the device computes (a sleep, as a blocking device synchronisation leaves the
    core and the GIL free). The saved state (the large model and its Adam moments) is the
    same; it is not updated by these steps, which changes nothing a save costs."""
    import torch.nn as nn

    torch.manual_seed(rank)
    width, depth = SPEC["width"], SPEC["depth"]
    model = nn.Sequential(*[nn.Linear(width, width) for _ in range(depth)])
    opt = torch.optim.Adam(model.parameters(), lr=1e-5, foreach=True)
    x = torch.randn(SPEC["batch"], width)
    device_s = SPEC.get("device_ms", 0) / 1e3
    host = nn.Sequential(*[nn.Linear(64, 64) for _ in range(4)])
    host_opt = torch.optim.Adam(host.parameters(), lr=1e-5, foreach=True)
    hx = torch.randn(8, 64)
    if device_s > 0:  # the large model's moments exist, as after a real step
        opt.zero_grad(set_to_none=True)
        model(x).square().mean().backward()
        opt.step()

    def train_step() -> tuple[float, float]:
        t0 = time.perf_counter()
        if device_s > 0:
            host_opt.zero_grad(set_to_none=True)
            host(hx).square().mean().backward()
            host_opt.step()
            time.sleep(device_s)
            return t0, time.perf_counter()
        opt.zero_grad(set_to_none=True)
        model(x).square().mean().backward()
        opt.step()
        return t0, time.perf_counter()

    for _ in range(3):
        train_step()
    state = {"model": model, "optim": opt}
    cks = three_checkpointers(state)
    methods = ("none", *cks)
    rows = []
    step = 0
    pre, tail = SPEC["pre_steps"], SPEC["tail_steps"]
    for rep in range(-SPEC.get("warmup", 1), SPEC["repeats"]):
        for name in rotated(methods, rep):
            step += 1
            dist.barrier()
            cc = cpu_s()
            clean = [train_step() for _ in range(pre)]
            c0 = cpu_s()
            base = statistics.median(b - a for a, b in clean[1:])
            base_cpu = (c0 - cc) / pre
            t_call = time.perf_counter()
            idle_at: list[float] = []
            done = threading.Event()
            if name == "none":
                t_ret = t_call
                idle_at.append(t_call)
                done.set()
            else:
                ck = cks[name]
                ck.save(step, state)
                t_ret = time.perf_counter()

                def watch(ck: Any = ck, idle_at: list[float] = idle_at, done: threading.Event = done) -> None:
                    try:
                        ck.wait()  # every tier and the copy to the peer
                    finally:
                        idle_at.append(time.perf_counter())
                        done.set()

                threading.Thread(target=watch, daemon=True).start()
            window: list[tuple[float, float]] = []
            after = 0
            while after < tail:
                window.append(train_step())
                if done.is_set() and idle_at[0] <= window[-1][0]:
                    after += 1
            end = window[-1][1]
            if rep >= 0:
                rows.append(
                    {
                        "repeat": rep,
                        "method": name,
                        "stall_s": t_ret - t_call,
                        "idle_s": idle_at[0] - t_call,
                        "lost_s": (end - t_call) - len(window) * base,
                        "window_steps": len(window),
                        "base_step_s": base,
                        "extra_cpu_s": cpu_s() - c0 - len(window) * base_cpu,
                        "device_ms": SPEC.get("device_ms", 0),
                    }
                )
    dist.barrier()
    write_out({"rank": rank, "rows": rows, "state_bytes": sum(t.numel() * 4 for t in model.parameters()) * 3})
    dist.barrier()
    os._exit(0)


def main() -> None:
    torch.set_num_threads(1)
    master = SPEC.get("master", "127.0.0.1")  # node 0's address when the nodes are network namespaces
    dist.init_process_group("gloo", init_method=f"tcp://{master}:{PORT}", rank=rank, world_size=world)
    {"save": save, "restore": restore, "cost": cost, "lost": lost}[MODE]()


if __name__ == "__main__":
    main()
