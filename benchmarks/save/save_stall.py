#!/usr/bin/env python3
"""Save-stall benchmark: how long does a checkpoint block the training loop?

Compares, side by side in one process (methods interleaved within every repeat,
with the order rotated between repeats, so that a noisy shared machine affects
all methods alike):

  a. ``torch.save``          -- ``torch.save(state, f)`` + ``f.flush()`` + ``os.fsync``
                                (the whole thing blocks the caller).
  b. ``plain copy``          -- copy every tensor into one preallocated, pre-faulted
                                uint8 host buffer (``dst_view.copy_(src)`` per tensor):
                                the physical lower bound for a blocking host snapshot.
  c. ``tiercheck``           -- ``Checkpointer.save()`` blocking time (steady state, i.e.
                                saves after the first), time-to-durable (``save()`` start
                                to ``h.wait()`` return), and the first save's stall on a
                                fresh Checkpointer, with and without ``prepare()``.
  d. ``plain os.write+fsync``-- the same number of bytes written from an already-filled
                                host buffer with ``os.write`` in 1 MiB blocks to a new
                                file, then ``os.fsync`` (the physical lower bound for
                                "durable on the local tier").

Results are reported as absolute times (median/min/max) and as ratios.  The page
cache cannot be dropped reliably without root, so it is not; files are fsynced
and deleted between runs.

Usage::

    python benchmarks/save/save_stall.py --quick
    python benchmarks/save/save_stall.py --size-gib 1.0 --repeats 5 --json out.json
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import math
import os
import random
import shutil
import statistics
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the checkout: `benchmarks.*` when run as a script

import torch

from benchmarks.common import GIB, KIB, MIB, O_DIRECT, PlainBuffer, machine_info, rotated, summary, write_file

WRITE_BLOCK = 1 * MIB

TARGETS = {
    "torch_save_over_tiercheck_stall": (">=", 8.0),
    "tiercheck_stall_over_plain_copy": ("<=", 1.2),
    "tiercheck_durable_over_plain_write": ("<=", 1.1),
}


# --------------------------------------------------------------------------- state


def make_state(total_bytes: int, seed: int = 0) -> dict[str, torch.Tensor]:
    """A flat dict of fp32 tensors shaped like an MLP + Adam state.

    Parameter sizes are drawn log-uniformly between 4 KiB and min(64 MiB, total/16);
    every weight has a small bias; every parameter has ``exp_avg`` and
    ``exp_avg_sq`` of the same shape.  Contents are random normal (incompressible).
    """
    rng = random.Random(seed)
    gen = torch.Generator().manual_seed(seed)
    row = 1024  # floats per row -> 4 KiB granularity
    gran = row * 4
    param_budget = max(total_bytes // 3 // gran, 2) * gran
    cap = max(min(64 * MIB, total_bytes // 16), gran)
    sizes: list[tuple[str, int]] = []
    remaining = param_budget
    layer = 0
    while remaining > 0:
        b_bytes = gran * rng.choice((1, 2, 4))
        w_bytes = math.exp(rng.uniform(math.log(gran), math.log(cap)))
        w_bytes = max(gran, int(w_bytes) // gran * gran)
        if w_bytes + b_bytes >= remaining:
            # last layer: take what is left
            if remaining <= b_bytes:
                sizes.append((f"layers.{layer}.weight", remaining))
                remaining = 0
                break
            w_bytes = remaining - b_bytes
        sizes.append((f"layers.{layer}.weight", w_bytes))
        sizes.append((f"layers.{layer}.bias", b_bytes))
        remaining -= w_bytes + b_bytes
        layer += 1

    state: dict[str, torch.Tensor] = {}
    for prefix in ("model.", "optim.exp_avg.", "optim.exp_avg_sq."):
        for name, nbytes in sizes:
            n = nbytes // 4
            shape = (n,) if name.endswith("bias") else (n // row, row)
            t = torch.empty(shape, dtype=torch.float32)
            t.normal_(generator=gen)
            state[prefix + name] = t
    return state


def state_nbytes(state: dict[str, torch.Tensor]) -> int:
    return sum(t.numel() * t.element_size() for t in state.values())


# --------------------------------------------------------------------------- helpers


def timed(fn: Callable[[], Any]) -> tuple[float, Any]:
    gc.collect()
    t0 = time.perf_counter()
    r = fn()
    return time.perf_counter() - t0, r


def torch_save_fsync(state: dict[str, torch.Tensor], path: Path) -> dict[str, float]:
    t0 = time.perf_counter()
    with open(path, "wb") as f:
        torch.save(state, f)
        f.flush()
        t1 = time.perf_counter()
        os.fsync(f.fileno())
    t2 = time.perf_counter()
    return {"serialize": t1 - t0, "fsync": t2 - t1}


# --------------------------------------------------------------------------- benchmark


class Bench:
    def __init__(self, args: argparse.Namespace, root: Path):
        self.args = args
        self.root = root
        self.samples: dict[str, list[float]] = {}
        self.extra: dict[str, list[float]] = {}
        self.notes: list[str] = []
        self.tc_error: str | None = None
        self.tc: Any = None
        self.verify: dict[str, Any] = {}

        nbytes = int(args.size_gib * GIB)
        print(f"# building state (~{nbytes / GIB:.3f} GiB fp32) ...", file=sys.stderr)
        self.state = make_state(nbytes, seed=args.seed)
        self.nbytes = state_nbytes(self.state)
        self.plain = PlainBuffer(self.state.values())
        self.plain.copy()  # buffer now holds real data for the writer baseline

        if not args.no_tiercheck:
            try:
                import tiercheck

                tiercheck.Checkpointer  # noqa: B018
                self.tc = tiercheck
            except Exception as e:  # library may not exist yet
                self.tc_error = f"import failed: {type(e).__name__}: {e}"
                print(f"# tiercheck unavailable ({self.tc_error}); no part c", file=sys.stderr)
        self.tc_steady: Any = None
        self.step = 0
        self.last_step: int | None = None
        self.counter = 0
        self.no_direct: str | None = None if O_DIRECT else "os.O_DIRECT not available"

    # -- recording
    def add(self, key: str, value: float) -> None:
        self.samples.setdefault(key, []).append(value)

    def add_extra(self, key: str, value: float) -> None:
        self.extra.setdefault(key, []).append(value)

    def fresh_path(self, stem: str) -> Path:
        self.counter += 1
        return self.root / f"{stem}-{self.counter}"

    # -- methods (each returns nothing, records into self.samples if `record`)
    def m_torch_save(self, record: bool) -> None:
        path = self.fresh_path("torch_save.pt")
        dt, parts = timed(lambda: torch_save_fsync(self.state, path))
        if record:
            self.add("torch_save", dt)
            self.add_extra("torch_save.serialize", parts["serialize"])
            self.add_extra("torch_save.fsync", parts["fsync"])
        path.unlink()

    def m_plain_copy(self, record: bool) -> None:
        dt, _ = timed(self.plain.copy)
        if record:
            self.add("plain_copy", dt)

    def m_plain_write(self, record: bool) -> None:
        path = self.fresh_path("plain_write.bin")
        dt, _ = timed(lambda: write_file(self.plain.buf, path, WRITE_BLOCK, direct=False, sync_dir=False))
        if record:
            self.add("plain_write", dt)
        path.unlink()

    def m_plain_write_direct(self, record: bool) -> None:
        path = self.fresh_path("plain_write_direct.bin")
        dt, direct = timed(lambda: write_file(self.plain.buf, path, WRITE_BLOCK, direct=True, sync_dir=False))
        if not direct:  # EINVAL: a filesystem without O_DIRECT (written buffered instead)
            self.no_direct = "the filesystem refused O_DIRECT (EINVAL)"
            path.unlink(missing_ok=True)
            return
        if record:
            self.add("plain_write_direct", dt)
        path.unlink()

    def _mark(self, value: float) -> None:
        for t in self.state.values():
            t.view(-1)[0] = value

    def m_tc_steady(self, record: bool) -> None:
        if self.tc_steady is None:
            d = self.root / "tc_steady"
            self.tc_steady = self.tc.Checkpointer(local=str(d), keep_local=2)
            # first save on this long-lived checkpointer: warm-up, reported as extra
            self.step += 1
            self._mark(float(self.step))
            dt, h = timed(lambda: self.tc_steady.save(self.step, self.state))
            h.wait()
            self.add_extra("tiercheck_steady_first_save_stall", dt)
            self.last_step = self.step
        self.step += 1
        step = self.step
        self._mark(float(step))
        gc.collect()
        t0 = time.perf_counter()
        h = self.tc_steady.save(step, self.state)
        t1 = time.perf_counter()
        # save() returned: the caller may now mutate the state. Do so (cheaply) to check
        # that the snapshot was really taken before save() returned.
        self._mark(-1.0)
        h.wait()
        t2 = time.perf_counter()
        self.last_step = step
        if record:
            self.add("tiercheck_stall", t1 - t0)
            self.add("tiercheck_durable", t2 - t0)
            self.record_handle_stats("tiercheck_steady", h)
        self._checkpointer_wait(self.tc_steady)

    def record_handle_stats(self, prefix: str, h: Any) -> None:
        """Keep tiercheck's own SaveStats (if the handle has them) for diagnosis."""
        st = getattr(h, "stats", None)
        if st is None:
            return
        for f in ("stall_s", "buffer_wait_s", "stage_s"):
            v = getattr(st, f, None)
            if isinstance(v, (int, float)):
                self.add_extra(f"{prefix}.{f}", float(v))
        if isinstance(getattr(st, "allocated", None), bool):
            self.add_extra(f"{prefix}.allocated", float(st.allocated))

    def _checkpointer_wait(self, ckpt: Any) -> None:
        w = getattr(ckpt, "wait", None)
        if callable(w):
            w()

    def _first_save(self, prepared: bool, record: bool) -> None:
        d = self.fresh_path("tc_first_prepared" if prepared else "tc_first_cold")
        ckpt = self.tc.Checkpointer(local=str(d), keep_local=2)
        try:
            if prepared:
                dtp, _ = timed(lambda: ckpt.prepare(self.state))
                if record:
                    self.add_extra("tiercheck_prepare", dtp)
            gc.collect()
            t0 = time.perf_counter()
            h = ckpt.save(1, self.state)
            t1 = time.perf_counter()
            h.wait()
            t2 = time.perf_counter()
            self._checkpointer_wait(ckpt)
            key = "tiercheck_first_stall_prepared" if prepared else "tiercheck_first_stall_cold"
            if record:
                self.add(key, t1 - t0)
                self.add_extra(key.replace("stall", "durable"), t2 - t0)
                self.record_handle_stats("tiercheck_first_" + key.rsplit("_", 1)[1], h)
        finally:
            ckpt.close()
            shutil.rmtree(d, ignore_errors=True)

    def m_tc_first_cold(self, record: bool) -> None:
        self._first_save(prepared=False, record=record)

    def m_tc_first_prepared(self, record: bool) -> None:
        self._first_save(prepared=True, record=record)

    # -- driver
    def methods(self) -> list[tuple[str, Callable[[bool], None]]]:
        ms: list[tuple[str, Callable[[bool], None]]] = [
            ("torch_save", self.m_torch_save),
            ("plain_copy", self.m_plain_copy),
            ("plain_write", self.m_plain_write),
        ]
        if self.no_direct is None:
            ms.append(("plain_write_direct", self.m_plain_write_direct))
        if self.tc is not None and self.tc_error is None:
            ms += [
                ("tiercheck_steady", self.m_tc_steady),
                ("tiercheck_first_cold", self.m_tc_first_cold),
                ("tiercheck_first_prepared", self.m_tc_first_prepared),
            ]
        return ms

    def run_one(self, name: str, fn: Callable[[bool], None], record: bool) -> None:
        if name.startswith("tiercheck") and self.tc_error is not None:
            return
        if name == "plain_write_direct" and self.no_direct is not None:
            return
        try:
            fn(record)
        except Exception as e:
            if not name.startswith("tiercheck"):
                raise
            tb = traceback.format_exc()
            self.tc_error = f"{name}: {type(e).__name__}: {e}"
            print(f"# tiercheck error in {name}:\n{tb}", file=sys.stderr)
            self.notes.append(f"tiercheck raised in {name}: {type(e).__name__}: {e}")

    def run(self) -> None:
        ms = self.methods()
        if not self.args.no_warmup:
            print("# warm-up round (not recorded)", file=sys.stderr)
            for name, fn in ms:
                self.run_one(name, fn, record=False)
        for r in range(self.args.repeats):
            order = rotated(ms, r)  # no method always first or last
            print(f"# repeat {r + 1}/{self.args.repeats}: {[n for n, _ in order]}", file=sys.stderr)
            for name, fn in order:
                self.run_one(name, fn, record=True)
        self.verify_restore()
        if self.tc_steady is not None:
            with contextlib.suppress(Exception):
                self.tc_steady.close()

    def verify_restore(self) -> None:
        if self.tc_steady is None or self.last_step is None or self.args.no_verify:
            return
        try:
            target = {k: torch.zeros_like(v) for k, v in self.state.items()}
            ret = self.tc_steady.restore(target)
            bad = []
            for k, v in self.state.items():
                got = target[k].view(-1)
                exp = v.view(-1)
                if float(got[0]) != float(self.last_step) or not torch.equal(got[1:], exp[1:]):
                    bad.append(k)
            self.verify = {
                "restored_ok": not bad,
                "mismatched_tensors": len(bad),
                "first_mismatch": bad[0] if bad else None,
                "expected_step": self.last_step,
                "restore_returned": repr(ret)[:200],
            }
            if bad:
                self.notes.append(
                    f"restore() mismatch in {len(bad)}/{len(self.state)} tensors "
                    f"(e.g. {bad[0]}); expected values as of step {self.last_step}, with "
                    "element [0] == step (state was mutated right after save() returned)"
                )
            del target
        except Exception as e:
            self.verify = {"restored_ok": False, "error": f"{type(e).__name__}: {e}"}
            self.notes.append(f"restore() raised {type(e).__name__}: {e}")
            traceback.print_exc()


# --------------------------------------------------------------------------- report


def ratio(a: dict[str, float] | None, b: dict[str, float] | None) -> float | None:
    if not a or not b or b["median"] <= 0:
        return None
    return a["median"] / b["median"]


def paired_ratio(xs: list[float] | None, ys: list[float] | None) -> float | None:
    if not xs or not ys:
        return None
    n = min(len(xs), len(ys))
    rs = [x / y for x, y in zip(xs[:n], ys[:n], strict=True) if y > 0]
    return statistics.median(rs) if rs else None


def build_report(b: Bench, info: dict[str, Any]) -> dict[str, Any]:
    st = {k: summary(v) for k, v in b.samples.items()}
    ex = {k: summary(v) for k, v in b.extra.items()}
    s = b.samples
    ratios: dict[str, dict[str, Any]] = {}
    defs = {
        "torch_save_over_tiercheck_stall": ("torch_save", "tiercheck_stall"),
        "tiercheck_stall_over_plain_copy": ("tiercheck_stall", "plain_copy"),
        "tiercheck_durable_over_plain_write": ("tiercheck_durable", "plain_write"),
        "tiercheck_durable_over_plain_write_direct": ("tiercheck_durable", "plain_write_direct"),
        "first_stall_cold_over_steady": ("tiercheck_first_stall_cold", "tiercheck_stall"),
        "first_stall_prepared_over_steady": ("tiercheck_first_stall_prepared", "tiercheck_stall"),
        "first_stall_cold_over_prepared": (
            "tiercheck_first_stall_cold",
            "tiercheck_first_stall_prepared",
        ),
    }
    for name, (num, den) in defs.items():
        r = ratio(st.get(num), st.get(den))
        entry: dict[str, Any] = {
            "value": r,
            "of_mins": (
                st[num]["min"] / st[den]["min"] if st.get(num) and st.get(den) and st[den]["min"] > 0 else None
            ),
            "paired_median": paired_ratio(s.get(num), s.get(den)),
            "num": num,
            "den": den,
        }
        if name in TARGETS:
            op, tgt = TARGETS[name]
            entry["target"] = f"{op} {tgt}"
            entry["met"] = None if r is None else (r >= tgt if op == ">=" else r <= tgt)
        ratios[name] = entry
    return {
        "machine": info,
        "config": {
            "size_gib_requested": b.args.size_gib,
            "state_bytes": b.nbytes,
            "num_tensors": len(b.state),
            "min_tensor_bytes": min(t.numel() * 4 for t in b.state.values()),
            "max_tensor_bytes": max(t.numel() * 4 for t in b.state.values()),
            "repeats": b.args.repeats,
            "warmup": not b.args.no_warmup,
            "write_block_bytes": WRITE_BLOCK,
            "o_direct_baseline": b.no_direct or "ok",
            "seed": b.args.seed,
        },
        "timings_s": st,
        "extra_timings_s": ex,
        "samples_s": b.samples,
        "extra_samples_s": b.extra,
        "ratios": ratios,
        "tiercheck": {
            "available": b.tc is not None,
            "version": getattr(b.tc, "__version__", None) if b.tc is not None else None,
            "error": b.tc_error,
            "verify": b.verify,
        },
        "notes": [
            *b.notes,
            "torch.save time includes f.flush() + os.fsync() of the file (no directory fsync).",
            "plain os.write+fsync: os.write in 1 MiB blocks from an already-filled host buffer "
            "to a new file, then os.fsync of the file (no directory fsync). d2 is the same "
            "with O_DIRECT from the page-aligned buffer (bypasses the page cache; tiercheck's "
            "local tier uses O_DIRECT where the filesystem allows it).",
            "plain copy: per-tensor dst_view.copy_(src) into one preallocated, pre-faulted "
            "uint8 buffer (lower bound for a blocking host snapshot).",
            "tiercheck durable = save() start to h.wait() return (local tier fsynced+committed).",
            "tiercheck steady = a long-lived Checkpointer whose first save is excluded; "
            "first-save stalls use a fresh Checkpointer per repeat (with/without prepare()).",
            "page cache was NOT dropped (not reliably possible here); files are fsynced and "
            "deleted after each run; data is random fp32 (incompressible).",
            "methods are interleaved within each repeat, order rotated between repeats.",
            "'of mins' ratios: on a shared machine noise only adds time, so mins are the "
            "least-contended estimate; 'paired median' = median of per-repeat ratios.",
        ],
    }


def fmt_ms(x: float | None) -> str:
    return "n/a" if x is None else f"{x * 1e3:,.1f}"


def fmt_r(x: float | None) -> str:
    return "n/a" if x is None else f"{x:.2f}"


def markdown(rep: dict[str, Any]) -> str:
    m = rep["machine"]
    c = rep["config"]
    fs = m["target_fs"]
    nb = c["state_bytes"]
    lines = []
    lines.append(
        f"**save_stall** — state {nb / GIB:.3f} GiB in {c['num_tensors']} fp32 tensors "
        f"({c['min_tensor_bytes'] // KIB} KiB - {c['max_tensor_bytes'] / MIB:.1f} MiB), "
        f"{c['repeats']} repeats"
    )
    lines.append(
        f"machine: {m['cpu_count']} CPUs ({m['cpu_model']}), {m['mem_total_gib']} GiB RAM, "
        f"torch {m['torch']} ({m['torch_num_threads']} threads), python {m['python']}, "
        f"repo {m['git_rev']}; "
        f"target dir `{m['target_dir']}` on **{fs['fstype']}** ({fs['source']} at "
        f"{fs['mountpoint']}); load avg (1/5/15 min) start "
        f"{'/'.join(f'{x:.1f}' for x in m['loadavg_start'])}, end "
        f"{'/'.join(f'{x:.1f}' for x in m.get('loadavg_end', (0, 0, 0)))}"
    )
    if fs["fstype"] in ("tmpfs", "ramfs"):
        lines.append("**WARNING: target is a RAM filesystem; fsync numbers are meaningless.**")
    lines.append("")
    lines.append("| method | median ms | min ms | max ms | GiB/s @median |")
    lines.append("|---|---:|---:|---:|---:|")
    rows = [
        ("a. torch.save + fsync (blocking)", "torch_save"),
        ("b. plain copy into prealloc buffer", "plain_copy"),
        ("c. tiercheck save() stall (steady)", "tiercheck_stall"),
        ("c. tiercheck save() → durable", "tiercheck_durable"),
        ("c. tiercheck 1st save stall, cold", "tiercheck_first_stall_cold"),
        ("c. tiercheck 1st save stall, after prepare()", "tiercheck_first_stall_prepared"),
        ("d. plain os.write 1MiB + fsync", "plain_write"),
        ("d2. same with O_DIRECT (extra)", "plain_write_direct"),
    ]
    for label, key in rows:
        s = rep["timings_s"].get(key)
        if s is None:
            lines.append(f"| {label} | n/a | n/a | n/a | n/a |")
            continue
        gbs = nb / GIB / s["median"] if s["median"] > 0 else float("inf")
        lines.append(f"| {label} | {fmt_ms(s['median'])} | {fmt_ms(s['min'])} | {fmt_ms(s['max'])} | {gbs:.2f} |")
    ex = rep["extra_timings_s"]
    extra_rows = [
        ("  torch.save serialize part", "torch_save.serialize"),
        ("  torch.save fsync part", "torch_save.fsync"),
        ("  tiercheck prepare() itself", "tiercheck_prepare"),
        ("  tiercheck 1st save → durable, cold", "tiercheck_first_durable_cold"),
        ("  tiercheck 1st save → durable, prepared", "tiercheck_first_durable_prepared"),
        ("  tiercheck SaveStats steady: stage_s", "tiercheck_steady.stage_s"),
        ("  tiercheck SaveStats steady: buffer_wait_s", "tiercheck_steady.buffer_wait_s"),
        ("  tiercheck SaveStats 1st cold: stage_s", "tiercheck_first_cold.stage_s"),
        ("  tiercheck SaveStats 1st prepared: stage_s", "tiercheck_first_prepared.stage_s"),
    ]
    for label, key in extra_rows:
        s = ex.get(key)
        if s is not None:
            lines.append(f"| {label} | {fmt_ms(s['median'])} | {fmt_ms(s['min'])} | {fmt_ms(s['max'])} | |")
    lines.append("")
    lines.append("| ratio | of medians | paired median | of mins | target | met (medians) |")
    lines.append("|---|---:|---:|---:|---|---|")
    labels = {
        "torch_save_over_tiercheck_stall": "torch.save stall / tiercheck stall",
        "tiercheck_stall_over_plain_copy": "tiercheck stall / plain copy",
        "tiercheck_durable_over_plain_write": "tiercheck durable / plain os.write+fsync",
        "tiercheck_durable_over_plain_write_direct": "tiercheck durable / plain O_DIRECT write",
        "first_stall_cold_over_steady": "1st-save stall (cold) / steady stall",
        "first_stall_prepared_over_steady": "1st-save stall (prepare()) / steady stall",
        "first_stall_cold_over_prepared": "1st-save stall cold / with prepare()",
    }
    for key, label in labels.items():
        r = rep["ratios"][key]
        met = r.get("met")
        met_s = "" if "target" not in r else ("n/a" if met is None else ("yes" if met else "NO"))
        lines.append(
            f"| {label} | {fmt_r(r['value'])} | {fmt_r(r['paired_median'])} "
            f"| {fmt_r(r['of_mins'])} | {r.get('target', '')} | {met_s} |"
        )
    tc = rep["tiercheck"]
    lines.append("")
    allocs = {
        k.split(".")[0]: f"{int(sum(v))}/{len(v)}"
        for k, v in rep["extra_samples_s"].items()
        if k.endswith(".allocated")
    }
    if allocs:
        lines.append(
            "tiercheck SaveStats.allocated (saves that allocated a buffer): "
            + ", ".join(f"{k} {v}" for k, v in allocs.items())
        )
    if tc["error"]:
        lines.append(f"tiercheck: **{tc['error']}**")
    if tc["verify"]:
        v = tc["verify"]
        lines.append(
            "restore check (state mutated right after save() returned): "
            + ("OK" if v.get("restored_ok") else f"**FAILED** {v}")
        )
    lines.append("")
    lines.append("Notes: " + " ".join(f"({i + 1}) {n}" for i, n in enumerate(rep["notes"])))
    return "\n".join(lines)


# --------------------------------------------------------------------------- main


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--size-gib", type=float, default=None, help="total state size (default 1.0)")
    p.add_argument("--repeats", type=int, default=None, help="recorded repeats (default 5)")
    p.add_argument(
        "--dir",
        type=Path,
        default=None,
        help="target dir (default: fresh temp dir under ./bench_out/; avoid tmpfs)",
    )
    p.add_argument("--json", type=Path, default=None, metavar="OUT", help="write JSON here")
    p.add_argument("--quick", action="store_true", help="0.1 GiB, 2 repeats (explicit flags still win)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--no-warmup", action="store_true", help="skip the unrecorded warm-up round")
    p.add_argument("--no-tiercheck", action="store_true", help="baselines only (a, b, d)")
    p.add_argument("--no-verify", action="store_true", help="skip the restore() check")
    p.add_argument("--keep", action="store_true", help="keep the target dir afterwards")
    a = p.parse_args(argv)
    if a.size_gib is None:
        a.size_gib = 0.1 if a.quick else 1.0
    if a.repeats is None:
        a.repeats = 2 if a.quick else 5
    if a.repeats < 1 or a.size_gib <= 0:
        p.error("--repeats must be >= 1 and --size-gib > 0")
    return a


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    created = False
    if args.dir is None:
        base = Path.cwd() / "bench_out"
        base.mkdir(parents=True, exist_ok=True)
        root = Path(tempfile.mkdtemp(prefix="save_stall-", dir=base))
        created = True
    else:
        root = args.dir.resolve()
        root.mkdir(parents=True, exist_ok=True)
    info = machine_info(root)
    if info["target_fs"]["fstype"] in ("tmpfs", "ramfs"):
        print(f"# WARNING: {root} is on {info['target_fs']['fstype']}", file=sys.stderr)
    try:
        bench = Bench(args, root)
        bench.run()
        info["loadavg_end"] = os.getloadavg()
        rep = build_report(bench, info)
    finally:
        if created and not args.keep:
            shutil.rmtree(root, ignore_errors=True)
    print(markdown(rep))
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(rep, indent=2, default=str))
        print(f"\n(JSON written to {args.json})")
    # non-zero only if tiercheck was importable but failed at run time
    return 1 if rep["tiercheck"]["available"] and rep["tiercheck"]["error"] else 0


if __name__ == "__main__":
    sys.exit(main())
