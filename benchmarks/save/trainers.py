#!/usr/bin/env python3
"""Stall per save: each trainer's own default checkpointing vs tiercheck, on the same model.

Three idioms, each measured both ways, interleaved in one process (the order of the two
methods alternates between rounds, so a noisy shared machine affects both alike):

  plain loop   ``torch.save(state_dicts, path)`` + fsync   vs  ``Checkpointer.save(step, state)``
  Lightning    ``ModelCheckpoint`` with Lightning's default ``TorchCheckpointIO``
                                                          vs  ``plugins=[TiercheckIO(...)]``
  Accelerate   ``accelerator.save_state(dir)``            vs  ``tiercheck.integrations.accelerate.save_state``

The *stall* of a save is the time the training loop is blocked by it: the call itself
(Lightning: the whole ``ModelCheckpoint._save_checkpoint``, i.e. building the checkpoint
dict, the plugin and the barrier), including any wait for an earlier save's host buffer.
Training steps run between saves, so tiercheck's background writes overlap them, as in a
real job. The first save of each run (tiercheck allocates its host buffer then) is
reported apart; "steady" is the median of the later ones. For tiercheck, "durable" is the
median time from a save's start until it is committed on tier 1.

Usage::

    python benchmarks/save/trainers.py --quick
    python benchmarks/save/trainers.py --params-mib 64 --saves 6 --rounds 3 --json out.json
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import shutil
import statistics
import sys
import tempfile
import time
import warnings
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the checkout: `benchmarks.*` when run as a script

import tiercheck
from benchmarks.common import fsync_path

MIB = 1 << 20
WIDTH = 1024


def make_model(params_mib: float) -> torch.nn.Module:
    """An MLP of WIDTH-wide layers holding about `params_mib` MiB of fp32 parameters."""
    per_layer = (WIDTH * WIDTH + WIDTH) * 4
    layers = max(1, round(params_mib * MIB / per_layer))
    mods: list[torch.nn.Module] = []
    for _ in range(layers):
        mods += [torch.nn.Linear(WIDTH, WIDTH), torch.nn.Tanh()]
    torch.manual_seed(0)
    return torch.nn.Sequential(*mods)


def train_steps(model: torch.nn.Module, opt: torch.optim.Optimizer, n: int) -> None:
    for _ in range(n):
        x = torch.randn(16, WIDTH)
        loss = model(x).square().mean()
        opt.zero_grad()
        loss.backward()
        opt.step()


# ----------------------------------------------------------------------------- plain loop


def plain(method: str, root: Path, args: argparse.Namespace) -> dict[str, Any]:
    model = make_model(args.params_mib)
    opt = torch.optim.Adam(model.parameters(), lr=1e-4)
    train_steps(model, opt, 1)
    stalls: list[float] = []
    durable: list[float] = []
    if method == "default":
        for i in range(args.saves):
            train_steps(model, opt, args.steps_between)
            path = root / f"step-{i}.pt"
            t0 = time.perf_counter()
            torch.save({"model": model.state_dict(), "optimizer": opt.state_dict(), "step": i}, path)
            fsync_path(str(path))
            stalls.append(time.perf_counter() - t0)
            if i >= 2:
                (root / f"step-{i - 2}.pt").unlink()
    else:
        state = {"model": model, "optimizer": opt, "step": 0}
        with tiercheck.Checkpointer(local=root, keep_local=2) as ckpt:
            for i in range(args.saves):
                train_steps(model, opt, args.steps_between)
                state["step"] = i
                t0 = time.perf_counter()
                handle = ckpt.save(i, state)
                stalls.append(time.perf_counter() - t0)
                handle.add_done_callback(_durable_recorder(durable, t0))
    return {"stalls": stalls, "durable": durable}


def _durable_recorder(out: list[float], t0: float) -> Any:
    def record(handle: Any, tier: str, error: Any) -> None:
        if error is None:
            out.append(time.perf_counter() - t0)

    return record


# ------------------------------------------------------------------------------ Lightning


def lightning(method: str, root: Path, args: argparse.Namespace) -> dict[str, Any]:
    import pytorch_lightning as pl
    from pytorch_lightning.callbacks import ModelCheckpoint

    from tiercheck.integrations.lightning import TiercheckIO

    stalls: list[float] = []

    class TimedCheckpoint(ModelCheckpoint):
        def _save_checkpoint(self, trainer: Any, filepath: str) -> None:
            t0 = time.perf_counter()
            super()._save_checkpoint(trainer, filepath)
            stalls.append(time.perf_counter() - t0)

    class Module(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.net = make_model(args.params_mib)

        def training_step(self, batch: Any, idx: int) -> torch.Tensor:
            return self.net(batch[0]).square().mean()

        def configure_optimizers(self) -> Any:
            return torch.optim.Adam(self.parameters(), lr=1e-4)

    n = args.steps_between
    data = torch.utils.data.DataLoader(
        torch.utils.data.TensorDataset(torch.randn(16 * n * (args.saves + 1), WIDTH)), batch_size=16
    )
    plugins = [TiercheckIO(local=root / "ckpt")] if method == "tiercheck" else []
    trainer = pl.Trainer(
        plugins=plugins,
        callbacks=[TimedCheckpoint(dirpath=str(root / "ckpt"), every_n_train_steps=n, save_top_k=1)],
        max_steps=n * args.saves,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        accelerator="cpu",
        devices=1,
    )
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer.fit(Module(), data)  # teardown drains tiercheck: outside the timed saves
    return {"stalls": stalls, "durable": []}


# ----------------------------------------------------------------------------- Accelerate


_ACCELERATOR: Any = None


def accelerate_(method: str, root: Path, args: argparse.Namespace) -> dict[str, Any]:
    global _ACCELERATOR
    from accelerate import Accelerator

    from tiercheck.integrations import accelerate as tc

    if _ACCELERATOR is None:
        _ACCELERATOR = Accelerator(cpu=True)
    acc = _ACCELERATOR
    model = make_model(args.params_mib)
    opt = torch.optim.Adam(model.parameters(), lr=1e-4)
    model, opt = acc.prepare(model, opt)
    stalls: list[float] = []
    durable: list[float] = []
    try:
        if method == "default":
            for i in range(args.saves):
                train_steps(model, opt, args.steps_between)
                t0 = time.perf_counter()
                acc.save_state(str(root / f"checkpoint_{i}"))
                stalls.append(time.perf_counter() - t0)
                if i >= 2:
                    shutil.rmtree(root / f"checkpoint_{i - 2}")
        else:
            with tc.checkpointer(acc, local=root / "ckpt", keep_local=2) as ckpt:
                for i in range(args.saves):
                    train_steps(model, opt, args.steps_between)
                    t0 = time.perf_counter()
                    handle = tc.save_state(acc, ckpt, i)
                    stalls.append(time.perf_counter() - t0)
                    handle.add_done_callback(_durable_recorder(durable, t0))
    finally:
        acc.free_memory()
    return {"stalls": stalls, "durable": durable}


IDIOMS = {"plain loop": plain, "Lightning": lightning, "Accelerate": accelerate_}


def available(name: str) -> bool:
    module = {"Lightning": "pytorch_lightning", "Accelerate": "accelerate"}.get(name)
    if module is None:
        return True
    try:
        __import__(module)
    except ImportError:
        return False
    return True


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--params-mib", type=float, default=64.0, help="model parameters, MiB of fp32 (Adam doubles it)")
    ap.add_argument("--saves", type=int, default=6, help="saves per run")
    ap.add_argument("--rounds", type=int, default=2, help="runs per idiom and method, order alternating")
    ap.add_argument("--steps-between", type=int, default=4, help="training steps between two saves")
    ap.add_argument("--dir", default=None, help="where to write (default: a temporary directory)")
    ap.add_argument("--json", default=None, help="write the results here")
    ap.add_argument("--quick", action="store_true", help="a small, fast configuration (smoke test)")
    args = ap.parse_args(argv)
    if args.quick:
        args.params_mib, args.saves, args.rounds, args.steps_between = 4.0, 3, 1, 2
    torch.set_num_threads(max(1, (os.cpu_count() or 2) // 2))
    base = Path(args.dir or tempfile.mkdtemp(prefix="tiercheck-trainers-"))
    results: dict[str, dict[str, list[dict[str, Any]]]] = {}
    for name, run in IDIOMS.items():
        if not available(name):
            print(f"{name}: not installed, skipped", file=sys.stderr)
            continue
        for r in range(args.rounds):
            order = ("default", "tiercheck") if r % 2 == 0 else ("tiercheck", "default")
            for method in order:
                root = base / f"{name.replace(' ', '_')}-{method}-{r}"
                root.mkdir(parents=True)
                try:
                    out = run(method, root, args)
                finally:
                    shutil.rmtree(root, ignore_errors=True)
                results.setdefault(name, {}).setdefault(method, []).append(out)
    with contextlib.suppress(OSError):
        if args.dir is None:
            shutil.rmtree(base)
    model = make_model(args.params_mib)
    nbytes = sum(p.numel() * 4 for p in model.parameters()) * 3  # weights + Adam's two moments
    summary = summarise(results)
    header = (
        f"model: {sum(p.numel() for p in model.parameters()) / 1e6:.1f} M fp32 parameters, checkpoint "
        f"~{nbytes / MIB:.0f} MiB with Adam; {args.saves} saves per run, {args.rounds} round(s), "
        f"{args.steps_between} training steps between saves; {platform.processor() or platform.machine()}, "
        f"{os.cpu_count()} CPUs, torch {torch.__version__}"
    )
    print(header)
    print(table(summary))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"config": vars(args), "header": header, "summary": summary, "raw": results}, f, indent=1)
    return 0


def summarise(results: dict[str, dict[str, list[dict[str, Any]]]]) -> dict[str, dict[str, dict[str, float]]]:
    out: dict[str, dict[str, dict[str, float]]] = {}
    for name, methods in results.items():
        for method, runs in methods.items():
            first = [r["stalls"][0] for r in runs if r["stalls"]]
            steady = [s for r in runs for s in r["stalls"][1:]]
            durable = [d for r in runs for d in r["durable"][1:]]
            out.setdefault(name, {})[method] = {
                "first_s": statistics.median(first) if first else float("nan"),
                "steady_s": statistics.median(steady) if steady else float("nan"),
                "steady_max_s": max(steady) if steady else float("nan"),
                "durable_s": statistics.median(durable) if durable else float("nan"),
            }
    return out


def table(summary: dict[str, dict[str, dict[str, float]]]) -> str:
    lines = [
        "| idiom | default: stall per save | tiercheck: stall per save | ratio | tiercheck: first save | "
        "tiercheck: durable on tier 1 |",
        "|---|---|---|---|---|---|",
    ]
    for name, m in summary.items():
        d, t = m.get("default"), m.get("tiercheck")
        if d is None or t is None:
            continue
        ratio = d["steady_s"] / t["steady_s"] if t["steady_s"] > 0 else float("inf")
        durable = "n/a" if t["durable_s"] != t["durable_s"] else f"{t['durable_s'] * 1e3:.0f} ms"
        lines.append(
            f"| {name} | {d['steady_s'] * 1e3:.0f} ms (max {d['steady_max_s'] * 1e3:.0f}) | "
            f"{t['steady_s'] * 1e3:.0f} ms (max {t['steady_max_s'] * 1e3:.0f}) | {ratio:.1f}x | "
            f"{t['first_s'] * 1e3:.0f} ms | {durable} |"
        )
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
