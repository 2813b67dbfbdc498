"""One rank of a multi-rank tier-0 test job: ``python tests/helpers/tier0_worker.py SCENARIO RANK WORLD
PORT DIR NODES`` (NODES: each rank's node, e.g. ``0,0,1,1``). A node is a set of rank
processes with their own shared-memory directory and tier-1 directory (``DIR/node<n>/shm``,
``DIR/node<n>/ckpt``); tier 2 is ``DIR/remote``, shared by all. Writes what the rank saw to
``DIR/result-SCENARIO-RANK.json`` for `tests/procs/test_tier0_multirank.py`.

Scenarios: ``save`` (steps 0..STEPS-1, then the job dies: no close), ``restore`` (restore the
newest step, compare it bit for bit), and ``fault``: steps 0..STEPS-1 while rank VICTIM dies
by SIGKILL at step KILL_STEP (environment), where FAULT says when:

* ``send``: mid-send of its tier-0 copy to its peer (the shard cut into small chunks, the
  kill after a few of them went out; its tier 0 and tier 1 hold the step already);
* ``lost``: in its tier-1 write of the step (after its tier-0 commit, before any copy): the
  peer the others send to and receive from is gone while they save.

The other ranks record, for each step, how long save() took and what waiting for tier 0
and tier 1 gave (within the coordination timeout, COORD seconds), and the warnings the peer
copies printed, then die too (as a launcher would end them): no close.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import sys
import threading
import time
from typing import Any

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

import tiercheck

STEPS = 4


def state_at(rank: int, step: int) -> dict[str, Any]:
    g = torch.Generator().manual_seed(1000 * rank + step)
    return {"w": torch.randn(300, 700, generator=g), "b": torch.randn(17, generator=g).double(), "step": step}


def template() -> dict[str, Any]:
    return {"w": torch.zeros(300, 700), "b": torch.zeros(17, dtype=torch.float64), "step": -1}


def arm_fault(rank: int) -> None:
    """On rank VICTIM, SIGKILL this process at step KILL_STEP where FAULT says."""
    from tiercheck.engine import pipeline as pipeline_mod
    from tiercheck.job import peers as peers_mod

    if os.environ.get("FAULT") == "send":  # every rank: sender and receiver cut a shard alike
        peers_mod.CHUNK = 64 << 10  # the shard goes out in ~13 messages: the kill falls among them
    if os.environ.get("VICTIM") is None or int(os.environ["VICTIM"]) != rank:
        return
    kill_step, fault = int(os.environ["KILL_STEP"]), os.environ["FAULT"]

    def die(why: str) -> None:
        print(f"rank {rank}: SIGKILL {why} at step {kill_step}", flush=True)
        os.kill(os.getpid(), signal.SIGKILL)

    if fault == "send":
        exchanging = threading.local()
        orig_exchange = peers_mod.PeerLink.exchange
        orig_init = peers_mod.PeerLink.__init__

        def exchange(self: Any, outgoing: Any, step: int, *a: Any, **k: Any) -> Any:
            exchanging.step = step
            try:
                return orig_exchange(self, outgoing, step, *a, **k)
            finally:
                exchanging.step = None

        def init(self: Any, *a: Any, **k: Any) -> None:
            orig_init(self, *a, **k)
            throttle, sent = self._throttle, [0]

            def counted(nbytes: int) -> None:  # called before each chunk of a shard is sent
                if getattr(exchanging, "step", None) == kill_step:
                    sent[0] += 1
                    if sent[0] == 5:
                        time.sleep(0.2)  # the 4 chunks posted are on their way
                        die("mid-send of its tier-0 copy")
                if throttle is not None:
                    throttle(nbytes)

            self._throttle = counted

        peers_mod.PeerLink.exchange = exchange  # type: ignore[method-assign]
        peers_mod.PeerLink.__init__ = init  # type: ignore[method-assign]
    elif fault == "lost":
        orig_write = pipeline_mod.write_staged

        def write_staged(tier: Any, job: Any, **k: Any) -> Any:
            if tier.name == "local" and job.step == kill_step:
                die("in its tier-1 write")
            return orig_write(tier, job, **k)

        pipeline_mod.write_staged = write_staged  # type: ignore[assignment]
    elif fault == "recv":
        from tiercheck.engine import peers as engine_peers

        orig_accept = engine_peers.PeerCopies._accept

        def accept(self: Any, source: int, nbytes: int, step: int) -> Any:
            if step == kill_step:
                die("mid-receive of a peer's tier-0 copy")
            return orig_accept(self, source, nbytes, step)

        engine_peers.PeerCopies._accept = accept  # type: ignore[method-assign]
    elif fault == "mismatch":  # the victim cuts shards unlike the others: gloo aborts it mid-exchange
        peers_mod.CHUNK = 32 << 10
    else:
        raise SystemExit(f"unknown FAULT {fault!r}")


class _Warnings(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())


class _Events(logging.Handler):
    def __init__(self) -> None:
        super().__init__()
        self.events: list[dict[str, Any]] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.events.append(json.loads(record.getMessage()))


def count_replica_buffers() -> list[int]:
    """How many shared-memory files this process allocates for the copies it holds of other
    ranks (counted by wrapping `SharedMemoryTier.new_buffer`; its code unchanged)."""
    from tiercheck.tiers import memory

    count = [0]
    real = memory.SharedMemoryTier.new_buffer

    def counted(self: Any, rank: int, nbytes: int) -> Any:
        if memory.REPLICAS_DIR in self.root.split(os.sep):
            count[0] += 1
        return real(self, rank, nbytes)

    memory.SharedMemoryTier.new_buffer = counted  # type: ignore[method-assign]
    return count


def main() -> None:
    scenario, rank, world, port, root, nodes = sys.argv[1:7]
    if os.environ.get("DUMP_STACKS_AFTER"):  # a hang shows where every thread waits
        import faulthandler

        faulthandler.dump_traceback_later(float(os.environ["DUMP_STACKS_AFTER"]), repeat=True)
    rank_i, world_i = int(rank), int(world)
    node = nodes.split(",")[rank_i]
    here = os.path.join(root, f"node{node}")
    os.makedirs(os.path.join(here, "shm"), exist_ok=True)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank_i, world_size=world_i)
    events = _Events()
    logging.getLogger("tiercheck.events").addHandler(events)
    logging.getLogger("tiercheck.events").setLevel(logging.INFO)
    warned = _Warnings()
    logging.getLogger("tiercheck").addHandler(warned)
    arm_fault(rank_i)
    replica_buffers = count_replica_buffers()
    ck = tiercheck.Checkpointer(
        local=os.path.join(here, "ckpt"),
        remote="file://" + os.path.join(root, "remote"),
        memory=True,
        memory_dir=os.path.join(here, "shm"),
        job_id="mr",
        memory_peers=int(os.environ.get("PEERS", "1")),
        keep_memory=1,
        keep_local=None,
        run_log_interval=None,
        coordination_timeout=float(os.environ.get("COORD", "120")),
    )
    out: dict[str, Any] = {}
    if scenario == "save":
        for step in range(STEPS):
            ck.save(step, state_at(rank_i, step)).wait()
        ck.wait()
        dist.barrier()
        out["memory"] = ck.steps("memory")
        out["local"] = ck.steps("local")
        out["replica_buffers"] = replica_buffers[0]
        with open(os.path.join(root, f"result-{scenario}-{rank}.json"), "w") as f:
            json.dump(out, f)
        os._exit(0)  # the job dies: no close, its memory stays
    if scenario == "fault":
        out["steps"] = {}
        for step in range(STEPS):
            t0 = time.monotonic()
            got: dict[str, Any] = {}
            try:
                h = ck.save(step, state_at(rank_i, step))
            except tiercheck.TierError as exc:  # an earlier step's background failure, raised once
                # Not retried: a retried step reports its part twice to rank 0's vote, which
                # then may wait for a dead rank's part past the timeout (a known bug).
                got["raised"] = f"{type(exc).__name__}: {exc}"[:300]
                got["save_s"] = round(time.monotonic() - t0, 3)
                out["steps"][str(step)] = got
                continue
            got["save_s"] = round(time.monotonic() - t0, 3)
            kill_step = int(os.environ.get("KILL_STEP", STEPS))
            for tier in ("memory", "local") + (("remote",) if step < kill_step else ()):
                try:
                    h.wait(tier)  # the steps before the fault: durable everywhere, tier 2 too
                    got[tier] = "ok"
                except Exception as exc:  # a rank died: this step cannot commit
                    got[tier] = f"{type(exc).__name__}: {exc}"[:300]
            got["done_s"] = round(time.monotonic() - t0, 3)
            out["steps"][str(step)] = got
        out["memory"] = ck.steps("memory")
        out["local"] = ck.steps("local")
        out["peer_warnings"] = [w for w in warned.lines if "tier-0 copies to other nodes stopped" in w]
        with open(os.path.join(root, f"result-{scenario}-{rank}.json"), "w") as f:
            json.dump(out, f)
        os._exit(0)  # the launcher ends the job: no close, its memory stays
    state = template()
    step = ck.restore(state)
    want = state_at(rank_i, STEPS - 1 if step is None else step)
    out["step"] = step
    out["exact"] = bool(
        torch.equal(state["w"], want["w"]) and torch.equal(state["b"], want["b"]) and state["step"] == step
    )
    out["tier"] = [e["tier"] for e in events.events if e.get("event") == "restore"]
    if os.environ.get("SAVE_AFTER"):  # the restored job goes on: one more step, copies included
        ck.save(STEPS, state_at(rank_i, STEPS)).wait()
        ck.wait()
        out["memory"] = ck.steps("memory")
    with open(os.path.join(root, f"result-{scenario}-{rank}.json"), "w") as f:
        json.dump(out, f)
    dist.barrier()
    os._exit(0)


if __name__ == "__main__":
    main()
