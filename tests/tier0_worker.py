"""One rank of a multi-rank tier-0 test job: ``python tests/tier0_worker.py SCENARIO RANK WORLD
PORT DIR NODES`` (NODES: each rank's node, e.g. ``0,0,1,1``). A node is a set of rank
processes with their own shared-memory directory and tier-1 directory (``DIR/node<n>/shm``,
``DIR/node<n>/ckpt``); tier 2 is ``DIR/remote``, shared by all. Writes what the rank saw to
``DIR/result-SCENARIO-RANK.json`` for `tests/test_tier0_multirank.py`.
"""

from __future__ import annotations

import json
import logging
import os
import sys
from typing import Any

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import tiercheck  # noqa: E402

STEPS = 4


def state_at(rank: int, step: int) -> dict[str, Any]:
    g = torch.Generator().manual_seed(1000 * rank + step)
    return {"w": torch.randn(300, 700, generator=g), "b": torch.randn(17, generator=g).double(), "step": step}


def template() -> dict[str, Any]:
    return {"w": torch.zeros(300, 700), "b": torch.zeros(17, dtype=torch.float64), "step": -1}


class _Events(logging.Handler):
    def __init__(self) -> None:
        super().__init__()
        self.events: list[dict[str, Any]] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.events.append(json.loads(record.getMessage()))


def main() -> None:
    scenario, rank, world, port, root, nodes = sys.argv[1:7]
    rank_i, world_i = int(rank), int(world)
    node = nodes.split(",")[rank_i]
    here = os.path.join(root, f"node{node}")
    os.makedirs(os.path.join(here, "shm"), exist_ok=True)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank_i, world_size=world_i)
    events = _Events()
    logging.getLogger("tiercheck.events").addHandler(events)
    logging.getLogger("tiercheck.events").setLevel(logging.INFO)
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
        coordination_timeout=120,
    )
    out: dict[str, Any] = {}
    if scenario == "save":
        for step in range(STEPS):
            ck.save(step, state_at(rank_i, step)).wait()
        ck.wait()
        dist.barrier()
        out["memory"] = ck.steps("memory")
        out["local"] = ck.steps("local")
        with open(os.path.join(root, f"result-{scenario}-{rank}.json"), "w") as f:
            json.dump(out, f)
        os._exit(0)  # the job dies: no close, its memory stays
    state = template()
    step = ck.restore(state)
    want = state_at(rank_i, STEPS - 1)
    out["step"] = step
    out["exact"] = bool(torch.equal(state["w"], want["w"]) and torch.equal(state["b"], want["b"]) and state["step"] == step)
    out["tier"] = [e["tier"] for e in events.events if e.get("event") == "restore"]
    with open(os.path.join(root, f"result-{scenario}-{rank}.json"), "w") as f:
        json.dump(out, f)
    dist.barrier()
    os._exit(0)


if __name__ == "__main__":
    main()
