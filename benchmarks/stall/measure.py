"""The stall benchmark's measurement: one save in a running training loop (clean steps for
the baseline, the save, the steps until durable and the tail), the methods interleaved in
rotated order, and what each save cost (`SaveRecord.metrics`)."""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import gc
import statistics
import sys
import threading
import traceback
from pathlib import Path
from typing import Any

import torch

from benchmarks.common import rotated
from benchmarks.stall.methods import (
    Ctx,
    Memcpy,
    Method,
    NoSave,
    ODirectWriter,
    Tiercheck,
    TiercheckMemory,
    TiercheckNormalPriority,
    TiercheckOverlap,
    Unavailable,
)
from benchmarks.stall.others import (
    DCPAsyncProcess,
    DCPAsyncThread,
    DCPAsyncThreadSync,
    DCPSave,
    TorchSave,
    TorchSnapshot,
)
from benchmarks.stall.workloads import StepRec, Trainer, build_workload, cpu_now, now

ALL_METHODS = (
    "none",
    "memcpy",
    "odirect_writer",
    "tiercheck",
    "tiercheck_overlap",
    "torch_save",
    "dcp_save",
    "dcp_async_thread",
    "dcp_async_thread_sync",
    "dcp_async_process",
    "torchsnapshot",
)
DCP_METHODS = ("dcp_save", "dcp_async_thread", "dcp_async_thread_sync", "dcp_async_process")
TIERCHECK_METHODS = ("tiercheck", "tiercheck_overlap", "tiercheck_memory")

METHOD_CLASSES: dict[str, type[Method]] = {
    c.name: c
    for c in (
        NoSave,
        Memcpy,
        ODirectWriter,
        Tiercheck,
        TiercheckOverlap,
        TiercheckNormalPriority,
        TiercheckMemory,
        TorchSave,
        DCPSave,
        DCPAsyncThread,
        DCPAsyncThreadSync,
        DCPAsyncProcess,
        TorchSnapshot,
    )
}


@dataclasses.dataclass
class SaveRecord:
    method: str
    repeat: int
    step: int
    t_call: float
    t_return: float
    t_durable: float | None
    baseline_step_s: float
    steps: list[StepRec]  # the window: steps after the call, through the tail steps
    pre_steps: list[StepRec]  # the clean steps the baseline came from
    extra: dict[str, Any]
    window_capped: bool = False
    c_call: float = 0.0  # process CPU seconds at the save call
    baseline_step_cpu_s: float = 0.0

    def metrics(self) -> dict[str, Any]:
        base = self.baseline_step_s
        call = self.t_return - self.t_call
        wait = sum(s.wait for s in self.steps)
        end = self.steps[-1].t1 if self.steps else self.t_return
        lost = (end - self.t_call) - len(self.steps) * base
        t_bg_end = self.t_durable if self.t_durable is not None else self.t_return
        bg = [s for s in self.steps if s.t0 < t_bg_end]
        bg_time = sum(s.dur for s in bg)
        rel = (len(bg) * base / bg_time) if bg and bg_time > 0 else None
        return {
            "call_s": call,
            "wait_s": wait,
            "stall_s": call + wait,
            "durable_s": None if self.t_durable is None else self.t_durable - self.t_call,
            "bg_s": None if self.t_durable is None else self.t_durable - self.t_return,
            "lost_s": lost,
            "cpu_s": (self.steps[-1].c1 if self.steps else self.c_call)
            - self.c_call
            - len(self.steps) * self.baseline_step_cpu_s,
            "slowdown_s": lost - call - wait,
            "window_steps": len(self.steps),
            "bg_steps": len(bg),
            "bg_rel_throughput": rel,
            "bg_steps_per_s": (len(bg) / bg_time) if bg and bg_time > 0 else None,
            "baseline_step_s": base,
            "baseline_steps_per_s": 1.0 / base if base > 0 else None,
            "baseline_step_cpu_s": self.baseline_step_cpu_s,
        }


class Bench:
    def __init__(self, args: argparse.Namespace, root: Path) -> None:
        self.args = args
        self.root = root
        dev = args.device
        if dev == "auto":
            dev = "cuda" if torch.cuda.is_available() else "cpu"
        self.device = torch.device(dev)
        print(
            f"# building {args.model} (~{args.size_gib:g} GiB of params + Adam) on {self.device} ...", file=sys.stderr
        )
        self.w = build_workload(args, self.device)
        self.trainer = Trainer(self.w, self.device)
        for _ in range(2):  # Adam state exists from the first step on
            self.trainer.step()
        self.ctx = Ctx(args, self.w, root, self.device)
        self.methods: list[Method] = []
        self.unavailable: dict[str, str] = {}
        self.failed: dict[str, str] = {}
        self.records: list[SaveRecord] = []
        self.step = 0
        self.t_start = now()

    def setup_methods(self) -> None:
        for name in self.args.methods:
            m = METHOD_CLASSES[name](self.ctx)
            try:
                m.setup()
            except Unavailable as e:
                self.unavailable[name] = str(e)
                print(f"# {name}: unavailable: {e}", file=sys.stderr)
                continue
            except Exception as e:
                self.unavailable[name] = f"setup failed: {type(e).__name__}: {e}"
                print(f"# {name}: setup failed:\n{traceback.format_exc()}", file=sys.stderr)
                continue
            self.methods.append(m)

    def clean_steps(self, n: int) -> list[StepRec]:
        out = []
        for _ in range(n):
            out.append(self.trainer.step())
            self.step += 1
        return out

    def one_save(self, m: Method, repeat: int, record: bool) -> None:
        a = self.args
        gc.collect()
        pre = self.clean_steps(max(a.pre_steps, a.every - self._last_window))
        base = statistics.median(s.dur for s in pre[-a.pre_steps :][1:] or pre)
        self.step += 1
        step = self.step
        base_cpu = statistics.median(s.cpu for s in pre[-a.pre_steps :][1:] or pre)
        c_call = cpu_now()
        t_call = now()
        pending = m.save(step)
        t_return = now()
        durable_at: list[float] = []
        err: list[BaseException] = []
        done = threading.Event()
        watcher = None
        if pending.wait_durable is None:
            durable_at.append(t_return)  # nothing runs in the background
            done.set()
        else:
            wait_durable = pending.wait_durable

            def watch() -> None:
                try:
                    wait_durable()
                except BaseException as e:
                    err.append(e)
                finally:
                    durable_at.append(now())
                    done.set()

            watcher = threading.Thread(target=watch, name="durable-watcher", daemon=True)
            watcher.start()
        window: list[StepRec] = []
        before = pending.before_step
        tail = a.noise_steps if isinstance(m, NoSave) else a.tail_steps
        after_durable = 0
        capped = False
        while True:
            rec = self.trainer.step(before)
            before = None  # only the first optimizer.step() after the save needs the wait
            self.step += 1
            window.append(rec)
            if done.is_set() and durable_at and durable_at[0] <= rec.t0:
                after_durable += 1
            if after_durable >= tail:
                break
            if rec.t1 - t_call > a.max_window_s:
                capped = True
                done.wait()
                break
        if watcher is not None:
            watcher.join()
        info = pending.info() if pending.info else {}
        if pending.cleanup:
            pending.cleanup()
        self._last_window = len(window)
        if err:
            raise err[0]
        if record:
            t_d = durable_at[0] if (durable_at and m.durable) else None
            self.records.append(
                SaveRecord(
                    m.name,
                    repeat,
                    step,
                    t_call,
                    t_return,
                    t_d,
                    base,
                    window,
                    pre[-a.pre_steps :],
                    info,
                    capped,
                    c_call,
                    base_cpu,
                )
            )
            r = self.records[-1].metrics()
            dur = "   -   " if r["durable_s"] is None else f"{r['durable_s']:7.3f}"
            print(
                f"  {m.name:24s} stall {r['stall_s']:7.3f}s  durable {dur}s  lost {r['lost_s']:7.3f}s  "
                f"(base step {base:.3f}s, window {len(window)} steps)",
                file=sys.stderr,
            )

    def run(self) -> None:
        a = self.args
        self._last_window = 0
        self.setup_methods()
        print(f"# warm-up: {a.warmup_steps} steps, then one unrecorded save per method", file=sys.stderr)
        self.clean_steps(a.warmup_steps)
        for m in list(self.methods):
            self._guarded(m, -1, record=False)
        for r in range(a.repeats):
            order = rotated(self.methods, r)
            print(f"# repeat {r + 1}/{a.repeats}: {[m.name for m in order]}", file=sys.stderr)
            for m in order:
                if m in self.methods:
                    self._guarded(m, r, record=True)

    def _guarded(self, m: Method, repeat: int, record: bool) -> None:
        try:
            self.one_save(m, repeat, record)
        except Exception as e:
            self.failed[m.name] = f"{type(e).__name__}: {e}"
            print(f"# {m.name} failed, dropped:\n{traceback.format_exc()}", file=sys.stderr)
            self.methods.remove(m)
            self.records = [rec for rec in self.records if rec.method != m.name]
            with contextlib.suppress(Exception):
                m.close()

    def close(self) -> None:
        for m in self.methods:
            with contextlib.suppress(Exception):
                m.close()
        self.ctx.close()
        end_child_processes()


def end_child_processes() -> None:
    """DCP's PROCESS executor keeps a spawned daemon process; end the ones we started."""
    import multiprocessing

    try:
        import torch.distributed.checkpoint._async_process_executor as ape

        proc = getattr(ape, "_CHECKPOINT_PROCESS", None)
        if proc is not None:
            with contextlib.suppress(Exception):
                proc.__del__()
            ape._CHECKPOINT_PROCESS = None
    except Exception:
        pass
    for child in multiprocessing.active_children():
        child.terminate()
        child.join(5)
