"""CUDA checks, prepared for a machine with a GPU (one short script, ~3 minutes on an H200).

    python benchmarks/cuda_check.py --size-gib 10 --out cuda_check.json

1. Correctness: a state of CUDA tensors (fp32, bf16, fp8, int64, 0-d, empty, a
   non-contiguous view, tied weights) saves and restores bit-exact, in place on the GPU;
   mutating the GPU tensors right after save() returns does not change the saved step;
   overlap=True with a real CUDA model + optimizer gives exactly the state at save().
2. Pinned device-to-host bandwidth: one large cudaMemcpy into pinned memory vs into
   pageable memory (the PCIe/NVLink-C2C practical peak), and tiercheck's stage throughput.
3. Stall on a state of at least `--size-gib` GB: save() blocking time after prepare(),
   vs torch.save of the same state (which copies to pageable memory and pickles), and
   time to durable on tier 1.
4. Tier 0 on CUDA (issue 26): with ``memory=True`` the host buffers are shared-memory files
   registered as pinned (cudaHostRegister): a CUDA state saved into them, mutated right
   after save() returns, restores bit-exact from tier 0 in a fresh Checkpointer (a process
   restart's view), and the save stall with tier 0 is reported beside the plain one.

Prints a summary and writes JSON. Exits non-zero if a correctness check fails.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from typing import Any

import torch

import tiercheck


def cuda_state(n_bytes: int, device: torch.device) -> dict[str, torch.Tensor]:
    per = 256 << 20
    out: dict[str, torch.Tensor] = {}
    i = 0
    while n_bytes > 0:
        n = min(per, n_bytes)
        out[f"w{i}"] = torch.randn(n // 4, device=device)
        n_bytes -= n
        i += 1
    return out


def check_correctness(root: str, device: torch.device) -> list[str]:
    failures: list[str] = []
    base = torch.randn(64, 32, device=device)
    state: dict[str, Any] = {
        "fp32": torch.randn(1000, device=device),
        "bf16": torch.randn(333, device=device).bfloat16(),
        "fp8": torch.randn(128, device=device).to(torch.float8_e4m3fn),
        "i64": torch.arange(77, device=device),
        "zero_d": torch.tensor(3.5, device=device),
        "empty": torch.empty(0, 5, device=device),
        "view": base.t(),
        "tied_a": base,
        "tied_b": base,
    }
    expected = {k: v.clone() for k, v in state.items()}
    with tiercheck.Checkpointer(local=os.path.join(root, "c")) as ckpt:
        h = ckpt.save(1, state)
        for v in state.values():  # mutate right after save() returns
            if v.numel() and v.dtype != torch.float8_e4m3fn:
                v.add_(1)
        h.wait()
        target = {k: torch.zeros_like(v) for k, v in expected.items()}
        target["tied_b"] = target["tied_a"]
        ckpt.restore(target)

    def raw(t: torch.Tensor) -> torch.Tensor:
        return t.detach().cpu().contiguous().reshape(-1).view(torch.uint8)

    for k, v in expected.items():
        got = target[k]
        if got.device != v.device or got.shape != v.shape or not torch.equal(raw(got), raw(v)):
            failures.append(f"round trip differs for {k}")
    # overlap with a real model on the GPU
    layers = [torch.nn.Linear(1024, 1024), torch.nn.LayerNorm(1024), torch.nn.Linear(1024, 1024)]
    model = torch.nn.Sequential(*layers).to(device)
    opt = torch.optim.Adam(model.parameters())
    x = torch.randn(256, 1024, device=device)

    def step() -> None:
        opt.zero_grad()
        model(x).square().mean().backward()
        opt.step()

    step()
    with tiercheck.Checkpointer(local=os.path.join(root, "o"), overlap=True) as ckpt:
        ref = {k: v.detach().clone() for k, v in model.state_dict().items()}
        h = ckpt.save(1, {"model": model, "opt": opt})
        step()
        step()
        h.wait()
    got_sd = tiercheck.load(os.path.join(root, "o"))["model"]
    for k, v in ref.items():
        if not torch.equal(got_sd[k], v.cpu()):
            failures.append(f"overlapped save differs for model.{k}")
    return failures


def bandwidth(device: torch.device, n: int = 4 << 30) -> dict[str, float]:
    src = torch.empty(n, dtype=torch.uint8, device=device)
    pinned = torch.empty(n, dtype=torch.uint8, pin_memory=True)
    pageable = torch.empty(n, dtype=torch.uint8)
    out: dict[str, float] = {}
    for name, dst in (("pinned", pinned), ("pageable", pageable)):
        dst.copy_(src[: 1 << 20])
        times = []
        for _ in range(3):
            torch.cuda.synchronize()
            t = time.perf_counter()
            dst.copy_(src, non_blocking=(name == "pinned"))
            torch.cuda.synchronize()
            times.append(time.perf_counter() - t)
        out[f"d2h_{name}_GBps"] = n / min(times) / 1e9
    return out


def check_tier0(root: str, device: torch.device) -> tuple[list[str], dict[str, float]]:
    """Tier 0's registered shared-memory buffers with a CUDA state: bit-exact from memory."""
    failures: list[str] = []
    shm = tempfile.mkdtemp(prefix="tiercheck-cuda-shm-", dir="/dev/shm" if os.path.isdir("/dev/shm") else None)
    timings: dict[str, float] = {}
    try:
        state = {"w": torch.randn(64 << 20, device=device), "b": torch.randn(1000, device=device).bfloat16()}
        expected = {k: v.clone() for k, v in state.items()}
        opts = {"local": os.path.join(root, "t0"), "memory": True, "memory_dir": shm, "job_id": "cuda-check"}
        with tiercheck.Checkpointer(**opts) as ck:
            ck.prepare(state)
            torch.cuda.synchronize()
            t = time.perf_counter()
            h = ck.save(1, state)
            timings["tier0_stall_s"] = time.perf_counter() - t
            for v in state.values():
                v.add_(1)  # right after save() returns: the step must not see it
            h.wait()
            if ck.steps("memory") != [1]:
                failures.append(f"tier 0 holds {ck.steps('memory')}, expected [1]")
            # a fresh Checkpointer reads tier 0 while this one still holds it (a restart's view)
            target = {k: torch.zeros_like(v) for k, v in expected.items()}
            with tiercheck.Checkpointer(**opts) as reader:
                t = time.perf_counter()
                reader.restore(target)
                timings["tier0_restore_s"] = time.perf_counter() - t
        for k, v in expected.items():
            got = target[k]
            if got.device != v.device or not torch.equal(got.view(torch.uint8), v.view(torch.uint8)):
                failures.append(f"tier-0 round trip differs for {k}")
    except Exception as exc:  # reported, not raised: the other checks still run
        failures.append(f"tier 0 on CUDA raised {type(exc).__name__}: {exc}")
    finally:
        shutil.rmtree(shm, ignore_errors=True)
    return failures, timings


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--size-gib", type=float, default=10.0)
    ap.add_argument("--dir", default=None, help="tier-1 directory (default: a temp dir)")
    ap.add_argument("--out", default="cuda_check.json")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        print("no CUDA device: nothing to check")
        sys.exit(2)
    device = torch.device("cuda")
    root = args.dir or tempfile.mkdtemp(prefix="tiercheck-cuda-")
    report: dict[str, Any] = {"device": torch.cuda.get_device_name(), "torch": torch.__version__}
    try:
        failures = check_correctness(root, device)
        tier0_failures, tier0_timings = check_tier0(root, device)
        failures += tier0_failures
        report.update(tier0_timings)
        report["correctness_failures"] = failures
        report.update(bandwidth(device))
        state = cuda_state(int(args.size_gib * (1 << 30)), device)
        nbytes = sum(t.numel() * t.element_size() for t in state.values())
        stalls, durables = [], []
        with tiercheck.Checkpointer(local=os.path.join(root, "big"), keep_local=1) as ckpt:
            t = time.perf_counter()
            ckpt.prepare(state)
            report["prepare_s"] = time.perf_counter() - t
            for i in range(3):
                torch.cuda.synchronize()
                t = time.perf_counter()
                h = ckpt.save(i, state)
                stalls.append(time.perf_counter() - t)
                h.wait()
                durables.append(time.perf_counter() - t)
        t = time.perf_counter()
        torch.save(state, os.path.join(root, "torch_save.pt"))
        report["torch_save_s"] = time.perf_counter() - t
        report["state_bytes"] = nbytes
        report["stall_s_median"] = statistics.median(stalls)
        report["stage_GBps"] = nbytes / statistics.median(stalls) / 1e9
        report["durable_s_median"] = statistics.median(durables)
        report["torch_save_over_stall"] = report["torch_save_s"] / report["stall_s_median"]
    finally:
        if args.dir is None:
            shutil.rmtree(root, ignore_errors=True)
    with open(args.out, "w") as f:
        json.dump(report, f, indent=2)
    for k, v in report.items():
        print(f"{k}: {v}")
    sys.exit(1 if report["correctness_failures"] else 0)


if __name__ == "__main__":
    main()
