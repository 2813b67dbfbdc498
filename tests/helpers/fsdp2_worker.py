"""One rank of the FSDP2 + Adam resharding test: ``python tests/helpers/fsdp2_worker.py MODE RANK WORLD PORT DIR``.

MODE "save": a small model (Linear 10->13, ReLU, Linear 13->6: 13 and 6 rows are uneven over
4 ranks, one rank holding no row of the last layer) wrapped with `fully_shard` on a CPU mesh,
trained 3 steps with Adam (data differs per rank), saved with tiercheck at step 3 as
{"model": model, "optim": optimizer, "step": 3}; rank 0 writes the whole parameters and
optimizer states to ``DIR/saved.pt``.

MODE "restore" (another world size): (a) a fresh FSDP2 model + Adam (the optimizer state made
by one step with zero gradients, which changes no parameter) restored with tiercheck; (b)
another fresh one loaded with `dcp.load` from the DCP export of the same step
(``DIR/export.dcp``, written by the test), through `get_state_dict`/`set_state_dict`; rank 0
writes both as whole tensors to ``DIR/restored.pt`` and ``DIR/dcp.pt``; then (a) runs one
more optimizer step and rank 0 writes its parameters to ``DIR/trained.pt``. Writes
``DIR/result-MODE-RANK.json``.
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

import tiercheck

STEP = 3


def build(mesh: Any, seed: int) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(10, 13), torch.nn.ReLU(), torch.nn.Linear(13, 6))
    for layer in (model[0], model[2]):
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model, torch.optim.Adam(model.parameters(), lr=1e-2)


def train_step(model: torch.nn.Module, optim: torch.optim.Optimizer, rank: int, i: int) -> None:
    g = torch.Generator().manual_seed(100 * i + rank)
    x, y = torch.randn(8, 10, generator=g), torch.randn(8, 6, generator=g)
    optim.zero_grad()
    torch.nn.functional.mse_loss(model(x), y).backward()
    optim.step()


def init_state(model: torch.nn.Module, optim: torch.optim.Optimizer) -> None:
    """Adam's state (step, exp_avg, exp_avg_sq as DTensors like the parameters), made by one
    step with zero gradients: the update is lr * 0 / (0 + eps), so no parameter changes."""
    for p in model.parameters():
        p.grad = torch.zeros_like(p)
    optim.step()
    optim.zero_grad(set_to_none=True)


def whole(model: torch.nn.Module, optim: torch.optim.Optimizer) -> dict[str, torch.Tensor]:
    """Every parameter and optimizer state as a whole tensor, by parameter name (collective)."""
    out: dict[str, torch.Tensor] = {}
    for name, p in model.named_parameters():
        out[f"param.{name}"] = p.full_tensor().detach().clone()
        for k, v in sorted(optim.state[p].items()):
            t = v.full_tensor() if hasattr(v, "full_tensor") else v
            out[f"state.{name}.{k}"] = t.detach().clone()
    return out


def dcp_load(model: torch.nn.Module, optim: torch.optim.Optimizer, path: str) -> None:
    """Load the export as a DCP user would: sharded templates from `get_state_dict`, the
    optimizer state (saved by `optimizer.state_dict()`, keyed by parameter index) mapped to
    the parameter names `get_state_dict` uses, then `set_state_dict`."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    model_sd, optim_sd = get_state_dict(model, optim)
    names = [n for group in optim_sd["param_groups"] for n in group["params"]]
    by_index = {i: optim_sd["state"][n] for i, n in enumerate(names)}
    state: dict[str, Any] = {"model": model_sd, "optim": {"state": by_index}, "step": 0}
    dcp.load(state, checkpoint_id=path, planner=dcp.DefaultLoadPlanner(allow_partial_load=True))
    optim_sd["state"] = {n: by_index[i] for i, n in enumerate(names)}
    set_state_dict(model, optim, model_state_dict=model_sd, optim_state_dict=optim_sd)


def main() -> None:
    mode, rank, world, port, root = sys.argv[1:6]
    rank_i, world_i = int(rank), int(world)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank_i, world_size=world_i)
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (world_i,))
    ck = tiercheck.Checkpointer(
        local=os.path.join(root, "ckpt"),
        remote="file://" + os.path.join(root, "remote"),
        keep_local=None,
        run_log_interval=None,
        coordination_timeout=120,
    )
    out: dict[str, Any] = {}
    try:
        if mode == "save":
            model, optim = build(mesh, seed=0)
            for i in range(STEP):
                train_step(model, optim, rank_i, i)
            ck.save(STEP, {"model": model, "optim": optim, "step": STEP}).wait()
            ck.wait()
            saved = whole(model, optim)
            if rank_i == 0:
                torch.save(saved, os.path.join(root, "saved.pt"))
            out["ok"] = True
        else:
            model, optim = build(mesh, seed=1)
            init_state(model, optim)
            state: dict[str, Any] = {"model": model, "optim": optim, "step": 0}
            out["restored_step"] = ck.restore(state)
            out["plain_step"] = state["step"]
            restored = whole(model, optim)
            from torch.distributed.tensor import DTensor

            out["sharded"] = all(
                isinstance(v, DTensor)
                for p in model.parameters()
                for v in (p, optim.state[p]["exp_avg"], optim.state[p]["exp_avg_sq"])
            )
            other, other_optim = build(mesh, seed=2)
            dcp_load(other, other_optim, os.path.join(root, "export.dcp"))
            loaded = whole(other, other_optim)
            train_step(model, optim, rank_i, STEP)
            trained = whole(model, optim)
            if rank_i == 0:
                torch.save(restored, os.path.join(root, "restored.pt"))
                torch.save(loaded, os.path.join(root, "dcp.pt"))
                torch.save(trained, os.path.join(root, "trained.pt"))
            out["ok"] = True
    except Exception as exc:  # reported to the test, which shows it
        out["error"] = f"{type(exc).__name__}: {exc}"
        out["trace"] = traceback.format_exc()
    ck.close()
    with open(os.path.join(root, f"result-{mode}-{rank}.json"), "w") as f:
        json.dump(out, f)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
