#!/usr/bin/env python3
"""Many small tensors: does a save's stall (and a restore) follow the bytes, not the leaf count?

For each leaf count (``--counts``), two states of fp32 tensors: the bytes held constant
(``--constant-mib`` in all) and the bytes growing (``--leaf-kib`` per leaf). Measured side by
side in one process, methods interleaved within every repeat with the order rotated, median
of ``--repeats``:

save stall (the caller blocked):
  floor       -- ``dst.copy_(src)`` per tensor into one preallocated, pre-faulted buffer,
                 the views made beforehand (`common.PlainBuffer`): a plain Python loop
  tiercheck   -- ``Checkpointer.save()`` after ``prepare()`` and one warm-up save,
                 ``keep_local=1``; the write is waited for outside the timed region
  torch.save  -- ``torch.save(state, f)`` + flush + fsync (all of it blocks)
  dcp         -- ``dcp.async_save`` (THREAD executor, a reused DefaultStager, staging before
                 it returns: the best CPU option of torch 2.13; pinned memory and non-blocking
                 copies need CUDA), the time until it returns; counts up to ``--dcp-max``

restore (page cache dropped for the files read, where the kernel lets us):
  plain       -- ``readinto`` of a file of the same bytes into a preallocated buffer, then
                 ``copy_`` of every view into the target tensors
  tiercheck   -- ``Checkpointer.restore(target, step)`` (reads, verifies checksums, copies)
  torch.load  -- ``torch.load(f, weights_only=True)`` of the torch.save file (no copy into a target)

manifest: the size of tiercheck's manifest, and the time ``decode_manifest`` takes to parse and
validate its bytes (already in memory), median of ``--repeats``.

The machine is shared: numbers are noisy; the ratios, taken within one repeat, are the
point. Usage::

    python benchmarks/save/many_tensors.py --counts 100,1000,5000 --repeats 3
    python benchmarks/save/many_tensors.py --json out.json --md out.md
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the checkout: `benchmarks.*` when run as a script
from benchmarks.common import KIB, MIB, PlainBuffer, drop_tree_cache, machine_info, rotated, summary

SAVE_METHODS = ("floor", "tiercheck", "torch_save", "dcp")
RESTORE_METHODS = ("plain", "tiercheck", "torch_load")


def make_state(count: int, leaf_bytes: int) -> dict[str, torch.Tensor]:
    numel = max(1, leaf_bytes // 4)
    gen = torch.Generator().manual_seed(count)
    return {f"layers.{i}.w": torch.randn(numel, generator=gen) for i in range(count)}


def timed(fn: Callable[[], object]) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


class Saves:
    """The save-side methods for one state, each set up once (buffers, Checkpointer, stager)."""

    def __init__(self, state: dict[str, torch.Tensor], root: Path, dcp_max: int) -> None:
        import tiercheck

        self.state, self.root = state, root
        self.plain = PlainBuffer(state.values())
        self.ckpt = tiercheck.Checkpointer(local=root / "tc", keep_local=1, run_log_interval=None)
        self.ckpt.prepare(state)
        self.step = 0
        self.ckpt.save(self.step, state).wait()  # warm-up: the structure is now known
        self.dcp: Any = None
        if len(state) <= dcp_max:
            with contextlib.suppress(ImportError):
                import torch.distributed.checkpoint as dcp
                from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions
                from torch.distributed.checkpoint.state_dict_saver import AsyncCheckpointerType

                self.dcp = dcp
                self.kind = AsyncCheckpointerType.THREAD
                self.stager = DefaultStager(StagingOptions(False, False, False, False))

    def run(self, method: str) -> float | None:
        if method == "floor":
            return timed(self.plain.copy)
        if method == "tiercheck":
            self.step += 1
            t0 = time.perf_counter()
            handle = self.ckpt.save(self.step, self.state)
            stall = time.perf_counter() - t0
            handle.wait()
            return stall
        if method == "torch_save":
            path = self.root / "torch.pt"

            def save() -> None:
                with open(path, "wb") as f:
                    torch.save(self.state, f)
                    f.flush()
                    os.fsync(f.fileno())

            return timed(save)
        if method == "dcp":
            if self.dcp is None:
                return None
            path = self.root / f"dcp{self.step}"
            t0 = time.perf_counter()
            r = self.dcp.async_save(
                self.state, checkpoint_id=str(path), async_checkpointer_type=self.kind, async_stager=self.stager
            )
            stall = time.perf_counter() - t0
            getattr(r, "upload_completion", r).result()
            shutil.rmtree(path, ignore_errors=True)
            return stall
        raise ValueError(method)

    def close(self) -> None:
        self.ckpt.close()
        if self.dcp is not None:
            with contextlib.suppress(Exception):
                self.stager.close()


class Restores:
    """The restore-side methods: a plain file of the same bytes, the tiercheck step, torch.save's file."""

    def __init__(self, saves: Saves) -> None:
        self.saves = saves
        self.target = {k: torch.empty_like(v) for k, v in saves.state.items()}
        self.plain = PlainBuffer(self.target.values())
        self.plain.copy()  # any bytes: only the read and the copy are timed
        self.path = saves.root / "plain.bin"
        with open(self.path, "wb") as f:
            f.write(self.plain.buf.numpy().tobytes())
            os.fsync(f.fileno())
        self.torch_path = saves.root / "torch.pt"
        if not self.torch_path.exists():
            saves.run("torch_save")

    def run(self, method: str) -> float:
        root = self.saves.root
        drop_tree_cache(root)
        if method == "plain":

            def read() -> None:
                with open(self.path, "rb", buffering=0) as f:
                    f.readinto(memoryview(self.plain.buf.numpy()))  # type: ignore[attr-defined]
                for dst, tgt in self.plain.pairs:
                    tgt.copy_(dst)

            return timed(read)
        if method == "tiercheck":
            return timed(lambda: self.saves.ckpt.restore(self.target, step=self.saves.step))
        if method == "torch_load":
            return timed(lambda: torch.load(self.torch_path, weights_only=True))
        raise ValueError(method)


def measure(count: int, leaf_bytes: int, repeats: int, dcp_max: int, work: Path) -> dict[str, Any]:
    state = make_state(count, leaf_bytes)
    root = Path(tempfile.mkdtemp(prefix=f"many{count}_", dir=work))
    saves = Saves(state, root, dcp_max)
    stall: dict[str, list[float | None]] = {m: [] for m in SAVE_METHODS}
    ratio_floor: list[float] = []
    ratio_torch: list[float] = []
    try:
        for r in range(repeats):
            got: dict[str, float | None] = {}
            for m in rotated(SAVE_METHODS, r):
                gc.collect()
                got[m] = saves.run(m)
                stall[m].append(got[m])
            tc, fl, ts = got["tiercheck"], got["floor"], got["torch_save"]
            assert tc is not None and fl is not None and ts is not None
            ratio_floor.append(tc / fl)
            ratio_torch.append(tc / ts)
        restores = Restores(saves)
        rest: dict[str, list[float | None]] = {m: [] for m in RESTORE_METHODS}
        ratio_plain: list[float] = []
        for r in range(repeats):
            one = {m: restores.run(m) for m in rotated(RESTORE_METHODS, r)}
            for m, v in one.items():
                rest[m].append(v)
            ratio_plain.append(one["tiercheck"] / one["plain"])
        manifest, parse = manifest_size_and_parse(root / "tc", repeats)
    finally:
        saves.close()
        shutil.rmtree(root, ignore_errors=True)
    return {
        "leaves": count,
        "leaf_bytes": max(1, leaf_bytes // 4) * 4,
        "state_bytes": sum(t.numel() * 4 for t in state.values()),
        "stall_s": {m: summary(v) for m, v in stall.items()},
        "restore_s": {m: summary(v) for m, v in rest.items()},
        "stall_over_floor": statistics.median(ratio_floor),
        "stall_over_torch_save": statistics.median(ratio_torch),
        "restore_over_plain": statistics.median(ratio_plain),
        "manifest_bytes": manifest,
        "manifest_parse_s": parse,
    }


def manifest_size_and_parse(tc_root: Path, repeats: int) -> tuple[int, dict[str, float] | None]:
    """The largest manifest's bytes under `tc_root`, and the time `decode_manifest` takes to
    parse and validate them (from memory: no I/O), over `repeats`."""
    from tiercheck.format.manifest import decode_manifest

    paths = sorted((p for p in tc_root.rglob("*.manifest.json")), key=lambda p: p.stat().st_size)
    if not paths:
        return 0, None
    data = paths[-1].read_bytes()
    times = []
    for _ in range(max(1, repeats)):
        gc.collect()
        times.append(timed(lambda: decode_manifest(data, str(paths[-1]))))
    return len(data), summary(times)


def stall_over_floor(count: int, leaf_bytes: int, repeats: int, work: Path) -> float:
    """Median over `repeats` of save() stall / the plain copy floor, the two interleaved:
    the smoke benchmark's check that the per-leaf cost did not regress."""
    root = Path(tempfile.mkdtemp(prefix=f"smoke{count}_", dir=work))
    saves = Saves(make_state(count, leaf_bytes), root, dcp_max=0)
    ratios = []
    try:
        for r in range(repeats):
            got = {m: saves.run(m) for m in rotated(("floor", "tiercheck"), r)}
            tc, fl = got["tiercheck"], got["floor"]
            assert tc is not None and fl is not None
            ratios.append(tc / fl)
    finally:
        saves.close()
        shutil.rmtree(root, ignore_errors=True)
    return statistics.median(ratios)


def restore_over_plain(count: int, leaf_bytes: int, repeats: int, work: Path) -> float:
    """Median over `repeats` of restore() into a template of the same structure / a plain
    read and `copy_` of the same bytes, the two interleaved: the smoke benchmark's check that
    restore's per-leaf cost did not regress."""
    root = Path(tempfile.mkdtemp(prefix=f"smoke_restore{count}_", dir=work))
    saves = Saves(make_state(count, leaf_bytes), root, dcp_max=0)
    ratios = []
    try:
        restores = Restores(saves)
        for r in range(repeats):
            got = {m: restores.run(m) for m in rotated(("plain", "tiercheck"), r)}
            ratios.append(got["tiercheck"] / got["plain"])
    finally:
        saves.close()
        shutil.rmtree(root, ignore_errors=True)
    return statistics.median(ratios)


def ms(s: dict[str, float] | None) -> str:
    return "n/a" if s is None else f"{s['median'] * 1e3:,.1f}"


def markdown(rows: list[dict[str, Any]]) -> str:
    out = [
        "| state | floor | tiercheck save() | torch.save | DCP async_save | stall / floor | stall / torch.save |"
        " plain read+copy_ | tiercheck restore | torch.load | restore / plain | manifest | manifest parse |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        st, rs = r["stall_s"], r["restore_s"]
        out.append(
            f"| {r['leaves']:,} x {r['leaf_bytes'] / KIB:g} KiB ({r['state_bytes'] / MIB:,.1f} MiB) "
            f"| {ms(st['floor'])} | {ms(st['tiercheck'])} | {ms(st['torch_save'])} | {ms(st['dcp'])} "
            f"| {r['stall_over_floor']:.2f}x | {r['stall_over_torch_save']:.2f}x "
            f"| {ms(rs['plain'])} | {ms(rs['tiercheck'])} | {ms(rs['torch_load'])} "
            f"| {r['restore_over_plain']:.2f}x | {r['manifest_bytes'] / MIB:.2f} MiB "
            f"| {ms(r.get('manifest_parse_s'))} |"
        )
    return "\n".join(out) + "\n\n(times in ms, median; ratios are medians of per-repeat ratios)\n"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--counts", default="100,1000,5000,20000,140000")
    ap.add_argument("--constant-mib", type=float, default=16.0, help="bytes in all, for the constant series")
    ap.add_argument("--leaf-kib", type=float, default=4.0, help="bytes per leaf, for the growing series")
    ap.add_argument("--series", default="constant,growing")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--dcp-max", type=int, default=20000, help="leaf counts above this skip DCP (minutes per save)")
    ap.add_argument("--dir", default=None, help="where files are written (default: a temp dir)")
    ap.add_argument("--json", default=None)
    ap.add_argument("--md", default=None)
    a = ap.parse_args()
    work = Path(a.dir or tempfile.mkdtemp(prefix="many_tensors_"))
    work.mkdir(parents=True, exist_ok=True)
    report: dict[str, Any] = {"benchmark": "many_tensors", "machine": machine_info(work), "series": {}}
    text = ""
    for series in a.series.split(","):
        rows = []
        for count in (int(c) for c in a.counts.split(",")):
            leaf = int(a.constant_mib * MIB / count) if series == "constant" else int(a.leaf_kib * KIB)
            rows.append(measure(count, leaf, a.repeats, a.dcp_max, work))
            keys = ("leaves", "stall_over_floor", "stall_over_torch_save", "restore_over_plain", "manifest_bytes")
            print(json.dumps({k: rows[-1][k] for k in keys}), flush=True)
        report["series"][series] = rows
        text += f"\n### {series} bytes\n\n" + markdown(rows)
    print(text)
    if a.json:
        Path(a.json).write_text(json.dumps(report, indent=1))
    if a.md:
        Path(a.md).write_text(text)


if __name__ == "__main__":
    main()
