"""Restore after a process kill on the same node: tier 0 (shared memory) vs tier 1 with a cold
page cache vs a plain memcpy of the same bytes, side by side in one run, interleaved.

    python benchmarks/restore/tier0_restart.py --sizes 1,3 --repeats 3
    python benchmarks/restore/tier0_restart.py --sizes 0.25 --repeats 2     # a quick look

Per size and repeat, a child process builds a state of ``--tensors`` fp32 tensors (a bit
pattern that differs per tensor, element and repeat), saves it with
``Checkpointer(local=..., memory=True, memory_dir=<a dir of the run's own under /dev/shm>,
job_id=...)``, waits until the step is committed on tier 0 and durable on tier 1, reports
its peak RSS and is SIGKILLed. Then this process (which never saved: a fresh process for
the restore) times, in rotated order:

(a) ``tier0``: ``Checkpointer(memory=True, same job_id).restore(template)``: the step comes
    from the dead process's shared memory, every byte checked against its CRC-32C;
(b) ``tier1_cold``: ``Checkpointer(local=..., memory=False).restore(template)`` after the
    page cache of the tier-1 files was emptied (fsync + POSIX_FADV_DONTNEED, as in
    benchmarks/compare_revisions.py; ``--drop-caches`` empties the whole cache, root only);
(c) ``memcpy``: torch ``copy_`` from a preallocated, pre-faulted host buffer holding the
    same bytes into the template (no checks): the physical limit of a restore from memory.

The template (``--tensors`` fp32 tensors, pre-faulted) is zeroed before every timed read
and compared with the expected bits after it (off the clock). Each Checkpointer is built
and closed around its restore; the time reported is ``restore()`` alone (the constructor's
time is recorded as ``open_s``). Which tier a restore used comes from its ``restore``
event on the ``tiercheck.events`` logger and is checked.

Memory: the child holds its state plus its shared-memory host buffer; this process holds
the template, and the memcpy source only while (c) runs (allocated and freed around it).
The report gives the child's peak RSS (VmHWM, shared memory it maps included), the bytes
in the tier-0 directory, this process's peak RSS, and the machine's lowest MemAvailable.

Everything the run makes (the tier-1 directory under ``--dir``, the tier-0 directory under
``--memory-dir``) is removed at the end, also on an error or SIGTERM.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import os
import select
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the checkout: `benchmarks.*` when run as a script

import torch

from benchmarks.common import GIB, drop_tree_cache, machine_info, rotated

METHODS = ("tier0", "tier1_cold", "memcpy")
EXPECTED_TIER = {"tier0": "memory", "tier1_cold": "local"}
GOLDEN = -1640531535  # 0x9E3779B1 as an int32: neighbouring elements get unrelated bits


# --------------------------------------------------------------------------- the state


def numels(size_gib: float, n: int) -> list[int]:
    total = int(size_gib * GIB) // 4
    each = total // n
    return [each] * (n - 1) + [total - each * (n - 1)]


def fill_expected(t: torch.Tensor, index: int, salt: int) -> torch.Tensor:
    """Writes tensor `index`'s bits for repeat `salt` into `t` (fp32, viewed as int32): cheap
    to make again, different in every element, tensor and repeat."""
    v = t.view(torch.int32)
    torch.arange(v.numel(), dtype=torch.int32, out=v)
    v.mul_(GOLDEN).add_(index * 7919 + salt * 104729 + 1)
    return t


def check(template: list[torch.Tensor], salt: int, what: str) -> None:
    """Every element of every tensor, compared bit for bit (int32 views: NaN patterns count)."""
    scratch = torch.empty(max(t.numel() for t in template), dtype=torch.float32)
    for i, t in enumerate(template):
        want = fill_expected(scratch[: t.numel()], i, salt)
        if not torch.equal(t.view(torch.int32), want.view(torch.int32)):
            raise AssertionError(f"{what}: tensor {i} differs from the saved state")


def as_state(tensors: list[torch.Tensor]) -> dict[str, torch.Tensor]:
    return {f"t{i:03d}": t for i, t in enumerate(tensors)}


# --------------------------------------------------------------------------- memory figures


def proc_status(pid: int | str = "self") -> dict[str, int]:
    """VmRSS, VmHWM, RssAnon, RssFile, RssShmem of a process, in bytes."""
    out: dict[str, int] = {}
    with contextlib.suppress(OSError), open(f"/proc/{pid}/status") as f:
        for line in f:
            key, _, rest = line.partition(":")
            if key in ("VmRSS", "VmHWM", "RssAnon", "RssFile", "RssShmem"):
                out[key] = int(rest.split()[0]) * 1024
    return out


def mem_available() -> int:
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    return 0


def tree_bytes(root: str) -> int:
    """Bytes allocated to the files under `root` (tmpfs: the shared memory they hold)."""
    n = 0
    for dirpath, _, files in os.walk(root):
        for name in files:
            with contextlib.suppress(OSError):
                n += os.lstat(os.path.join(dirpath, name)).st_blocks * 512
    return n


# --------------------------------------------------------------------------- the child that saves and dies


def child_main(args: argparse.Namespace) -> int:
    """Build the state, save it on tier 0 + tier 1, say "ready" with its memory figures, wait
    for the SIGKILL."""
    import tiercheck

    torch.set_num_threads(max(1, os.cpu_count() or 1))
    tensors = [fill_expected(torch.empty(n, dtype=torch.float32), i, args.salt) for i, n in enumerate(args.numels)]
    ckpt = tiercheck.Checkpointer(
        local=args.local, memory=True, memory_dir=args.memory_dir, job_id=args.job_id, keep_memory=1
    )
    t0 = time.perf_counter()
    handle = ckpt.save(args.step, as_state(tensors))
    stall = time.perf_counter() - t0
    handle.wait("memory")
    t_mem = time.perf_counter() - t0
    handle.wait()
    t_all = time.perf_counter() - t0
    info = {
        "tiers": list(handle.tiers),
        "stall_s": stall,
        "memory_s": t_mem,
        "durable_s": t_all,
        "status": proc_status(),
        "memory_steps": ckpt.steps("memory"),
    }
    print("ready " + json.dumps(info), flush=True)
    while True:  # killed here, Checkpointer open, tier 0 held: a crash, not a finished job
        time.sleep(60)


def spawn_and_kill(
    args: argparse.Namespace, local: str, mem_dir: str, job_id: str, step: int, salt: int, sizes: list[int]
) -> dict[str, Any]:
    cmd = [
        sys.executable, str(Path(__file__).resolve()), "--child",
        "--local", local, "--memory-dir", mem_dir, "--job-id", job_id,
        "--step", str(step), "--salt", str(salt), "--numels", ",".join(map(str, sizes)),
    ]  # fmt: skip
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout is not None
        deadline = time.monotonic() + args.child_timeout
        line = ""
        while time.monotonic() < deadline:
            ready, _, _ = select.select([proc.stdout], [], [], 1.0)
            if ready:
                line = proc.stdout.readline()
                if line.startswith("ready ") or not line:
                    break
            if proc.poll() is not None:
                break
        if not line.startswith("ready "):
            raise RuntimeError(f"the saving child did not get ready (exit status {proc.poll()})")
        info: dict[str, Any] = json.loads(line[len("ready ") :])
        info["shm_bytes"] = tree_bytes(mem_dir)
        info["mem_available_child_alive"] = mem_available()
        info["status_at_kill"] = proc_status(proc.pid)
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait()
        info["exit"] = proc.returncode
        return info
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


# --------------------------------------------------------------------------- the timed restores


class RestoreEvents(logging.Handler):
    """Collects the `restore` events (which tier, how long) the library logs."""

    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.events: list[dict[str, Any]] = []

    def emit(self, record: logging.LogRecord) -> None:
        with contextlib.suppress(Exception):
            ev = json.loads(record.getMessage())
            if ev.get("event") == "restore":
                self.events.append(ev)


@contextlib.contextmanager
def restore_events() -> Iterator[RestoreEvents]:
    logger = logging.getLogger("tiercheck.events")
    h = RestoreEvents()
    old = logger.level
    logger.addHandler(h)
    logger.setLevel(logging.INFO)
    try:
        yield h
    finally:
        logger.removeHandler(h)
        logger.setLevel(old)


def timed_tiercheck(template: list[torch.Tensor], step: int, **options: Any) -> dict[str, Any]:
    import tiercheck

    state = as_state(template)
    with restore_events() as ev:
        t0 = time.perf_counter()
        ckpt = tiercheck.Checkpointer(**options)
        t1 = time.perf_counter()
        try:
            got = ckpt.restore(state)
            t2 = time.perf_counter()
        finally:
            ckpt.close()
    if got != step:
        raise AssertionError(f"restore returned {got}, expected step {step}")
    tier = ev.events[-1]["tier"] if ev.events else None
    return {"s": t2 - t1, "open_s": t1 - t0, "tier": tier, "event_s": ev.events[-1]["seconds"] if ev.events else None}


def timed_memcpy(template: list[torch.Tensor], salt: int) -> dict[str, Any]:
    total = sum(t.numel() for t in template)
    src = torch.empty(total, dtype=torch.float32)
    views, off = [], 0
    for i, t in enumerate(template):
        views.append(fill_expected(src[off : off + t.numel()], i, salt))  # also faults every page in
        off += t.numel()
    t0 = time.perf_counter()
    for dst, s in zip(template, views, strict=True):
        dst.copy_(s)
    t1 = time.perf_counter()
    del views, src
    return {"s": t1 - t0, "tier": None}


def measure(size_gib: float, args: argparse.Namespace, work: str, shm: str) -> dict[str, Any]:
    sizes = numels(size_gib, args.tensors)
    nbytes = 4 * sum(sizes)
    template = [torch.empty(n, dtype=torch.float32) for n in sizes]
    for t in template:
        t.zero_()  # fault the template in: a real restart's model and optimizer exist before restore()
    times: dict[str, list[float]] = {m: [] for m in METHODS}
    details: list[dict[str, Any]] = []
    children: list[dict[str, Any]] = []
    how: set[str] = set()
    low_avail = mem_available()
    load0 = os.getloadavg()
    tag = f"{size_gib:g}g"
    for rep in range(-1 if args.warmup else 0, args.repeats):  # repeat -1: unrecorded warm-up
        salt = (rep + 2) * 1000 + int(size_gib * 100)
        step = rep + 2
        local = os.path.join(work, f"tier1-{tag}-{rep + 1}")
        mem_dir = os.path.join(shm, f"{tag}-{rep + 1}")
        job_id = f"bench-{tag}-{rep + 1}"
        os.makedirs(mem_dir)
        try:
            child = spawn_and_kill(args, local, mem_dir, job_id, step, salt, sizes)
            low_avail = min(low_avail, child["mem_available_child_alive"])
            if rep >= 0:
                children.append(child)
            order = rotated(METHODS, max(rep, 0))
            label = "warm-up (unrecorded)" if rep < 0 else f"repeat {rep + 1}/{args.repeats}"
            print(f"# {tag} {label}: child saved (stall {child['stall_s']:.2f} s, "
                  f"tier 0 {child['memory_s']:.2f} s, durable {child['durable_s']:.2f} s), killed; {order}",
                  file=sys.stderr)  # fmt: skip
            for name in order:
                for t in template:
                    t.zero_()
                r: dict[str, Any]
                if name == "tier0":
                    r = timed_tiercheck(
                        template, step, local=local, memory=True, memory_dir=mem_dir, job_id=job_id, keep_memory=1
                    )
                elif name == "tier1_cold":
                    how.add(drop_tree_cache(local, args.drop_caches))
                    r = timed_tiercheck(template, step, local=local, memory=False)
                else:
                    r = timed_memcpy(template, salt)
                low_avail = min(low_avail, mem_available())
                want = EXPECTED_TIER.get(name)
                if want is not None and r["tier"] != want:
                    raise AssertionError(f"{name}: restored from tier {r['tier']!r}, expected {want!r}")
                check(template, salt, name)
                print(f"  {name:10s} {r['s']:7.3f} s  ({nbytes / GIB / r['s']:.2f} GiB/s)"
                      + (f"  open {r['open_s']:.3f} s, tier {r['tier']}" if "open_s" in r else ""),
                      file=sys.stderr)  # fmt: skip
                if rep >= 0:
                    times[name].append(r["s"])
                    details.append({"repeat": rep, "method": name, **r})
        finally:
            shutil.rmtree(local, ignore_errors=True)
            shutil.rmtree(mem_dir, ignore_errors=True)
    med = {m: statistics.median(v) for m, v in times.items()}
    t0, t1, mc = times["tier0"], times["tier1_cold"], times["memcpy"]
    out: dict[str, Any] = {
        "size_gib": size_gib,
        "bytes": nbytes,
        "tensors": len(sizes),
        "repeats": args.repeats,
        "cache": f"cold ({', '.join(sorted(how))})" if "" not in how else "WARM (the page cache could not be emptied)",
        "loadavg_start": load0,
        "loadavg_end": os.getloadavg(),
        "times": times,
        "median": med,
        "details": details,
        "children": children,
        # tier-1 cold time / tier-0 time: how much faster the restart is from memory
        "t1_over_t0": med["tier1_cold"] / med["tier0"],
        "t1_over_t0_paired": statistics.median(a / b for a, b in zip(t1, t0, strict=True)),
        # tier-0 speed / memcpy speed = memcpy time / tier-0 time
        "t0_vs_memcpy": med["memcpy"] / med["tier0"],
        "t0_vs_memcpy_paired": statistics.median(a / b for a, b in zip(mc, t0, strict=True)),
        "memory": {
            "child_peak_rss": max(c["status_at_kill"].get("VmHWM", 0) for c in children),
            "child_peak_rss_shmem": max(c["status_at_kill"].get("RssShmem", 0) for c in children),
            "shm_bytes": max(c["shm_bytes"] for c in children),
            "parent_peak_rss": proc_status().get("VmHWM", 0),
            "lowest_mem_available": low_avail,
        },
    }
    del template
    return out


# --------------------------------------------------------------------------- report


def report(r: dict[str, Any]) -> str:
    gib = r["bytes"] / GIB
    m = r["memory"]
    lines = [
        f"state {gib:.2f} GiB ({r['tensors']} fp32 tensors), {r['repeats']} repeats, tier-1 cache {r['cache']}, "
        f"load avg {r['loadavg_start'][0]:.1f} -> {r['loadavg_end'][0]:.1f}",
        "| method | median s | min s | max s | GiB/s |",
        "|---|---:|---:|---:|---:|",
    ]
    for name, v in r["times"].items():
        med = r["median"][name]
        lines.append(f"| {name} | {med:.3f} | {min(v):.3f} | {max(v):.3f} | {gib / med:.2f} |")
    lines += [
        "",
        f"tier-1 cold / tier 0: {r['t1_over_t0']:.2f}x of medians, {r['t1_over_t0_paired']:.2f}x paired (target >= 3)",
        f"tier-0 speed / memcpy speed: {r['t0_vs_memcpy']:.2f}x of medians, {r['t0_vs_memcpy_paired']:.2f}x paired "
        "(target >= 0.5)",
        f"memory: saving child peak RSS {m['child_peak_rss'] / GIB:.2f} GiB (of it shared memory "
        f"{m['child_peak_rss_shmem'] / GIB:.2f} GiB), tier 0 on /dev/shm {m['shm_bytes'] / GIB:.2f} GiB, "
        f"restoring process peak RSS {m['parent_peak_rss'] / GIB:.2f} GiB (template + memcpy source), "
        f"lowest MemAvailable {m['lowest_mem_available'] / GIB:.1f} GiB",
    ]
    return "\n".join(lines) + "\n"


def sizes_table(results: list[dict[str, Any]]) -> str:
    lines = [
        "| state GiB | tier 0 s | tier 1 cold s | memcpy s | tier-1 cold / tier 0 (paired) | tier-0 / memcpy speed "
        "(paired) | child peak RSS GiB | /dev/shm GiB | restorer peak RSS GiB | load avg |",
        "|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|",
    ]
    for r in results:
        md, m = r["median"], r["memory"]
        lines.append(
            f"| {r['bytes'] / GIB:.2f} | {md['tier0']:.3f} | {md['tier1_cold']:.3f} | {md['memcpy']:.3f} | "
            f"**{r['t1_over_t0']:.2f}x** ({r['t1_over_t0_paired']:.2f}x) | **{r['t0_vs_memcpy']:.2f}x** "
            f"({r['t0_vs_memcpy_paired']:.2f}x) | {m['child_peak_rss'] / GIB:.2f} | {m['shm_bytes'] / GIB:.2f} | "
            f"{m['parent_peak_rss'] / GIB:.2f} | {r['loadavg_start'][0]:.1f} -> {r['loadavg_end'][0]:.1f} |"
        )
    return "\n".join(lines) + "\n"


# --------------------------------------------------------------------------- command line


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    ap.add_argument("--sizes", default="1,3", help="comma-separated GiB (default 1,3)")
    ap.add_argument("--tensors", type=int, default=48, help="fp32 tensors in the state (default 48)")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--no-warmup", dest="warmup", action="store_false", help="no unrecorded first repeat")
    ap.add_argument("--dir", default="bench_out", help="where tier 1 goes (a temp dir under it)")
    ap.add_argument("--memory-dir", default="/dev/shm", help="where tier 0 goes (a temp dir under it)")
    ap.add_argument("--json", default=None)
    ap.add_argument("--child-timeout", type=float, default=180.0, help="seconds the saving child may take")
    ap.add_argument("--drop-caches", action="store_true", help="empty the whole page cache (root) instead")
    # the saving child's arguments
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--local", help=argparse.SUPPRESS)
    ap.add_argument("--job-id", help=argparse.SUPPRESS)
    ap.add_argument("--step", type=int, help=argparse.SUPPRESS)
    ap.add_argument("--salt", type=int, help=argparse.SUPPRESS)
    ap.add_argument("--numels", help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    if a.numels:
        a.numels = [int(x) for x in a.numels.split(",")]
    return a


def _on_term(signum: int, frame: Any) -> None:
    raise SystemExit(128 + signum)  # unwind: the finally blocks remove the run's files


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.child:
        return child_main(args)
    signal.signal(signal.SIGTERM, _on_term)
    os.makedirs(args.dir, exist_ok=True)
    work = tempfile.mkdtemp(prefix="tier0-restart-", dir=args.dir)
    shm = tempfile.mkdtemp(prefix="tier0-restart-", dir=args.memory_dir)
    info = machine_info(Path(work))
    info["memory_dir_fs"] = machine_info(Path(shm))["target_fs"]
    print(f"# revision {info['git_rev']}, load avg {info['loadavg_start']}, tier 1 {work}, tier 0 {shm}",
          file=sys.stderr)  # fmt: skip
    results = []
    t_start = time.perf_counter()
    try:
        for size in [float(x) for x in args.sizes.split(",") if x.strip()]:
            r = measure(size, args, work, shm)
            print(report(r), flush=True)
            results.append(r)
    finally:
        shutil.rmtree(work, ignore_errors=True)
        shutil.rmtree(shm, ignore_errors=True)
    table = sizes_table(results)
    print(f"revision {info['git_rev']}; {info['cpu_count']} CPUs, {info['mem_total_gib']} GiB RAM; tier 1 on "
          f"{info['target_fs']['fstype']}, tier 0 on {info['memory_dir_fs']['fstype']}; run took "
          f"{time.perf_counter() - t_start:.0f} s\n")  # fmt: skip
    print(table)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"machine": info, "results": results, "table": table}, f, indent=1, default=str)
    return 0


if __name__ == "__main__":
    sys.exit(main())
