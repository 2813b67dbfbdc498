"""One rank of a resharding test job: ``python tests/helpers/reshard_worker.py MODE RANK WORLD PORT DIR SPEC``.

SPEC is JSON: {"mesh": [2, 2], "placements": {"w": ["S0", "S1"], ...}, "extra": {...}}. MODE
"save" saves the tensors of `GLOBAL` as DTensors of that mesh and placements (plus a plain
`step` every rank holds alike, and with "seed" in SPEC a value that differs per rank);
"restore" restores them into zeroed DTensors of its own mesh and placements (a placement
list of [] means a plain tensor template) and reports whether every `full_tensor()` is
bit-identical to the saved one. Writes ``DIR/result-MODE-RANK.json``.
"""

from __future__ import annotations

import json
import os
import sys
import traceback
from typing import Any

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

import tiercheck  # noqa: E402


def global_tensors() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(7)
    return {
        "w": torch.randn(10, 12, generator=g),  # 10 rows: uneven over 3 or 4 ranks
        "v": torch.randn(7, 9, generator=g).to(torch.bfloat16),
        "b": torch.randn(5, generator=g).double(),
        "big": torch.randn(600, 1000, generator=g),  # 2.3 MiB: several checksum blocks
    }


def bits(t: torch.Tensor) -> torch.Tensor:
    """The bytes of `t`: equal only when every bit is (NaN, -0.0 included)."""
    return t.detach().contiguous().view(torch.uint8)


def placement(text: str) -> Any:
    from torch.distributed.tensor import Replicate, Shard

    return Replicate() if text == "R" else Shard(int(text[1:]))


def as_dtensor(t: torch.Tensor, mesh: Any, places: list[str]) -> torch.Tensor:
    from torch.distributed.tensor import distribute_tensor

    if not places:
        return t.clone()
    return distribute_tensor(t, mesh, [placement(p) for p in places])


def main() -> None:
    mode, rank, world, port, root, spec_text = sys.argv[1:7]
    rank_i, world_i = int(rank), int(world)
    spec = json.loads(spec_text)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank_i, world_size=world_i)
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", tuple(spec["mesh"]))
    full = global_tensors()
    node = spec.get("nodes", [0] * world_i)[rank_i]
    local = os.path.join(root, f"node{node}", "ckpt") if spec.get("node_local") else os.path.join(root, "ckpt")
    ck = tiercheck.Checkpointer(
        local=local, remote="file://" + os.path.join(root, "remote"), keep_local=None, run_log_interval=None,
        coordination_timeout=120,
    )
    out: dict[str, Any] = {}
    try:
        if mode == "save":
            state: dict[str, Any] = {
                "model": {k: as_dtensor(v, mesh, spec["placements"][k]) for k, v in full.items()},
                "step": 7,
            }
            if spec.get("seed"):
                state["seed"] = 1000 + rank_i
            ck.save(3, state).wait()
            ck.wait()
            out["ok"] = True
        else:
            tmpl: dict[str, Any] = {
                "model": {k: as_dtensor(torch.zeros_like(v), mesh, spec["placements"][k]) for k, v in full.items()},
                "step": -1,
            }
            if spec.get("seed"):
                tmpl["seed"] = -1
            step = ck.restore(tmpl, strict=not spec.get("lenient"))
            out["step"] = step
            out["plain_step"] = tmpl["step"]
            out["seed"] = tmpl.get("seed")
            exact = {}
            for k, v in tmpl["model"].items():
                got = v.full_tensor() if hasattr(v, "full_tensor") else v
                exact[k] = bool(torch.equal(bits(got), bits(full[k])))
            out["exact"] = exact
    except Exception as exc:  # reported to the test, which checks the type and message
        out["error"] = f"{type(exc).__name__}: {exc}"
        out["trace"] = traceback.format_exc()
    ck.close()
    with open(os.path.join(root, f"result-{mode}-{rank}.json"), "w") as f:
        json.dump(out, f)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
