"""The seeds' checkpoint scenarios, worked through: GPU-hours lost per month to checkpoint
stalls and redone work, for a blocking save at the storage's speed and for tiercheck.

    .venv/bin/python benchmarks/goodput/goodput_scenarios.py                 # print the table
    .venv/bin/python benchmarks/goodput/goodput_scenarios.py --write-docs    # also update docs/goodput.md
                                                                     # and docs/img/goodput_scenarios.png
    .venv/bin/python benchmarks/goodput/goodput_scenarios.py --overhead      # measure ckpt.timed()'s cost per item

A model, not a measurement: every input is a figure from the seeds or an assumption listed
in `ASSUMPTIONS` (docs/goodput.md prints them next to the results). The model:

* a save costs the training C seconds (blocking: the whole write, S / write bandwidth;
  tiercheck: the copy of each GPU's share into pinned host memory, S / N / D2H bandwidth,
  while the write to storage, W = S / write bandwidth, runs in the background);
* failures arrive at random (exponential), F per month, MTBF M = month / F;
* the interval T (compute time between saves) is each method's own optimum: Daly's
  higher-order interval for its cost C (`tiercheck.goodput.summary.daly_interval`), and for
  tiercheck at least W, since a save cannot start before the previous one is durable
  without queueing behind it;
* per month: stall = saves x C, with saves = month / (T + C); redo = F x the expected work
  lost per failure: (T + C) / 2 for a blocking save, (T + C) / 2 + W for tiercheck (the
  newest snapshot is only restorable once durable, W after it was taken);
* GPU-hours = seconds x N / 3600. The restart itself (relaunch, reading the checkpoint
  back) costs the same for both methods and is left out of both.
"""

from __future__ import annotations

import argparse
import json
import math
import re
import sys
from dataclasses import asdict, dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from tiercheck.goodput.summary import daly_interval, format_duration  # noqa: E402

HOUR = 3600.0
MONTH = 730.0 * HOUR  # 365 * 24 / 12

# Figures from the seeds (the DDN talk, /work/shared/seeds/001_*.txt; the Adobe talk as
# reported by Backblaze, 000_*.txt).
CHECKPOINT_BYTES = 2e12  # "2TB程度のWrite" per checkpoint (992-GPU GPT-3 175B run; and the ABCI job's ~2 TB)
FAST_WRITE = 70e9  # the ABCI job's average write speed, 70 GB/s: "30秒ほどで終了"
SLOW_WRITE = 7e9  # "仮にストレージの性能が10分の1なら ... 5分"
PRACTICED_INTERVAL = 2 * HOUR  # the ABCI user checkpoints every 2 hours
GPUS = 992  # NVIDIA A100-80GB x 992 (Meta's OPT-175B run, cited in the DDN talk)
RESTARTS = 35 + 70  # 35 manual + "70回以上" automatic restarts ...
RESTART_PERIOD = 2 * 730.0 * HOUR  # ... in 2 months
ADOBE_DATA_WAIT = 2 / 3  # "roughly two-thirds of GPU time was spent simply waiting for data"

# Assumptions (not in the seeds).
D2H_PER_GPU = 12.5e9  # see ASSUMPTIONS
D2H_RANGE = (6.25e9, 25e9, 50e9)

ASSUMPTIONS = [
    "The checkpoint (2 TB) is spread evenly over the 992 GPUs (sharded model and optimizer state, "
    "as FSDP/ZeRO-style training spreads it), and every GPU saves its own share: 2.02 GB per GPU.",
    "Device-to-host bandwidth: 12.5 GB/s per GPU while every GPU of a node copies at once. The A100 "
    "datasheet gives PCIe Gen4 at 64 GB/s both ways together (32 GB/s each way); pinned copies reach "
    "about 25 GB/s of that in practice, and we halve it as if two GPUs shared each link to the host. "
    "Not measured here (no GPU was lent to this task: `benchmarks/cuda_check.py` measures it). "
    "The sensitivity row uses 6.25, 25 and 50 GB/s (50: PCIe Gen5, H100-class).",
    "The 992-GPU run writes its 2 TB at the ABCI job's 70 GB/s, or at a tenth of it (7 GB/s), the DDN "
    "talk's two cases; the seeds give no write speed for that run itself.",
    "Failures: 105 restarts (35 manual + 70 automatic; the seed says 70 or more) in 2 months of 730 h, "
    "at random times: MTBF 13.9 h, 52.5 failures a month. Every restart redoes the work since the "
    "newest durable checkpoint.",
    "tiercheck's save never waits for the previous one (its interval is at least the write time W), "
    "its background write does not slow the GPUs (it uses host CPU, PCIe and the storage network), and "
    "the storage sustains one checkpoint per interval.",
    "Restart time (relaunch, reading 2 TB back) is the same for both methods and left out; so is the data loader.",
]


@dataclass(frozen=True, slots=True)
class Scenario:
    name: str
    method: str  # "blocking" or "tiercheck"
    write_gbps: float
    cost_s: float  # C: seconds of training each save takes
    durable_s: float  # W: seconds until the save is durable on storage
    interval_s: float  # T: compute between saves
    saves_per_month: float
    stall_gpu_h: float
    redo_gpu_h: float
    lost_gpu_h: float
    lost_fraction: float  # of the month's GPU-hours
    storage_busy: float  # share of the time the storage spends writing checkpoints, W / (T + C)


def mtbf() -> float:
    return RESTART_PERIOD / RESTARTS


def scenario(name: str, method: str, write: float, interval: float | None = None, d2h: float = D2H_PER_GPU) -> Scenario:
    m = mtbf()
    failures = MONTH / m
    w = CHECKPOINT_BYTES / write
    c = w if method == "blocking" else CHECKPOINT_BYTES / GPUS / d2h
    t = interval if interval is not None else daly_interval(c, m)
    if method == "tiercheck":
        t = max(t, w)
    saves = MONTH / (t + c)
    redo_per_failure = (t + c) / 2 + (w if method == "tiercheck" else 0.0)
    stall = GPUS * saves * c / HOUR
    redo = GPUS * failures * redo_per_failure / HOUR
    return Scenario(
        name=name,
        method=method,
        write_gbps=write / 1e9,
        cost_s=c,
        durable_s=w,
        interval_s=t,
        saves_per_month=saves,
        stall_gpu_h=stall,
        redo_gpu_h=redo,
        lost_gpu_h=stall + redo,
        lost_fraction=(stall + redo) / (GPUS * MONTH / HOUR),
        storage_busy=min(1.0, w / (t + c)),
    )


def scenarios() -> list[Scenario]:
    out = []
    for write, label in ((FAST_WRITE, "70 GB/s"), (SLOW_WRITE, "7 GB/s")):
        out.append(scenario(f"blocking, {label}, every 2 h (as practised)", "blocking", write, PRACTICED_INTERVAL))
        out.append(scenario(f"tiercheck, {label}, every 2 h (as practised)", "tiercheck", write, PRACTICED_INTERVAL))
        out.append(scenario(f"blocking, {label}, optimal interval", "blocking", write))
        out.append(scenario(f"tiercheck, {label}, optimal interval", "tiercheck", write))
    return out


def sensitivity() -> list[Scenario]:
    return [scenario(f"tiercheck, 7 GB/s, D2H {d / 1e9:g} GB/s", "tiercheck", SLOW_WRITE, d2h=d) for d in D2H_RANGE]


def table(rows: list[Scenario]) -> str:
    head = (
        "| scenario | cost per save C | durable after W | interval T | saves/month | stall GPU-h/month "
        "| redo GPU-h/month | lost GPU-h/month | share of GPU time | storage busy writing |"
    )
    lines = [head, "|" + "---|" * 10]
    for s in rows:
        lines.append(
            f"| {s.name} | {format_duration(s.cost_s)} | {format_duration(s.durable_s)} | "
            f"{format_duration(s.interval_s)} | {s.saves_per_month:,.0f} | {s.stall_gpu_h:,.0f} | "
            f"{s.redo_gpu_h:,.0f} | **{s.lost_gpu_h:,.0f}** | {s.lost_fraction:.2%} | {s.storage_busy:.1%} |"
        )
    return "\n".join(lines)


def inputs_table() -> str:
    m = mtbf()
    rows = [
        ("checkpoint size", "2 TB", "seed 001 (DDN): ~2 TB per checkpoint, 992-GPU GPT-3 175B run; ABCI job ~2 TB"),
        ("write bandwidth", "70 GB/s and 7 GB/s", "seed 001: ABCI job, 70 GB/s average (~30 s); '1/10 -> 5 min'"),
        ("GPUs", f"{GPUS}", "seed 001: NVIDIA A100-80GB x 992 (Meta, GPT-3 175B)"),
        ("failures", f"{RESTARTS} in 2 months", "seed 001: 35 manual + 70 or more automatic restarts"),
        ("MTBF (derived)", format_duration(m), "2 x 730 h / 105"),
        ("practised interval", "2 h", "seed 001: the ABCI user checkpoints every 2 hours"),
        ("D2H bandwidth", "12.5 GB/s per GPU", "assumption (see below)"),
        ("share per GPU (derived)", f"{CHECKPOINT_BYTES / GPUS / 1e9:.2f} GB", "2 TB / 992"),
    ]
    out = ["| input | value | source |", "|---|---|---|"]
    out += [f"| {a} | {b} | {c} |" for a, b, c in rows]
    return "\n".join(out)


def plot(rows: list[Scenario], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(13, 4.8), gridspec_kw={"width_ratios": [1.25, 1]})
    names = [s.name.replace(", optimal interval", ",\noptimal T").replace(", every 2 h (as practised)", ",\nevery 2 h")
             for s in rows]  # fmt: skip
    y = list(range(len(rows)))[::-1]
    ax1.barh(y, [s.stall_gpu_h for s in rows], color="#d62728", label="checkpoint stall")
    ax1.barh(y, [s.redo_gpu_h for s in rows], left=[s.stall_gpu_h for s in rows], color="#7f7f7f", label="redone work")
    for yi, s in zip(y, rows, strict=True):
        ax1.text(s.lost_gpu_h, yi, f" {s.lost_gpu_h:,.0f} ({s.lost_fraction:.1%})", va="center", fontsize=8)
    ax1.set_yticks(y)
    ax1.set_yticklabels(names, fontsize=8)
    ax1.set_xlabel("GPU-hours lost per month (992 GPUs, 52.5 failures a month)")
    ax1.set_xlim(0, max(s.lost_gpu_h for s in rows) * 1.3)
    ax1.legend(fontsize=8, loc="lower right")
    ax1.set_title("2 TB checkpoint, per month", fontsize=10)
    m = mtbf()
    ts = [60 * 1.08**k for k in range(80)]
    for write, style in ((FAST_WRITE, "-"), (SLOW_WRITE, "--")):
        w = CHECKPOINT_BYTES / write
        c_tc = CHECKPOINT_BYTES / GPUS / D2H_PER_GPU
        gbps = f"{write / 1e9:g} GB/s"
        blocking = [GPUS * (MONTH / (t + w) * w + MONTH / m * (t + w) / 2) / HOUR for t in ts]
        tc = [
            GPUS * (MONTH / (t + c_tc) * c_tc + MONTH / m * ((t + c_tc) / 2 + w)) / HOUR if t >= w else math.nan
            for t in ts
        ]
        ax2.plot([t / 60 for t in ts], blocking, style, color="#d62728", label=f"blocking, {gbps}")
        ax2.plot([t / 60 for t in ts], tc, style, color="#2ca02c", label=f"tiercheck, {gbps}")
    ax2.axvline(120, color="black", lw=0.6, ls=":")
    ax2.text(120, ax2.get_ylim()[1] * 0.9, " 2 h", fontsize=8)
    ax2.set_xscale("log")
    ax2.set_yscale("log")
    ax2.set_xlabel("interval between saves (min)")
    ax2.set_ylabel("GPU-hours lost per month")
    ax2.set_title("lost GPU-hours against the interval", fontsize=10)
    ax2.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def docs_block(rows: list[Scenario], sens: list[Scenario]) -> str:
    adobe = GPUS * MONTH / HOUR * ADOBE_DATA_WAIT
    lines = [
        "<!-- scenarios:begin (generated by benchmarks/goodput/goodput_scenarios.py --write-docs; do not edit) -->",
        "Inputs:",
        "",
        inputs_table(),
        "",
        "Assumptions:",
        "",
        *[f"{i}. {a}" for i, a in enumerate(ASSUMPTIONS, 1)],
        "",
        "Results (each method at its own optimal interval, and the blocking save at the practised 2 h):",
        "",
        table(rows),
        "",
        "Sensitivity to the device-to-host bandwidth (7 GB/s storage, where it matters most):",
        "",
        table(sens),
        "",
        f"For scale: were two thirds of these GPUs' time spent waiting for data, as in Adobe's early runs "
        f"(seed 000), that would be {adobe:,.0f} GPU-hours a month, "
        f"{adobe / rows[2].lost_gpu_h:.0f}x what the blocking save at 70 GB/s loses at its optimal interval.",
        "",
        "![GPU-hours lost per month, and against the interval](img/goodput_scenarios.png)",
        "<!-- scenarios:end -->",
    ]
    return "\n".join(lines)


def timed_overhead(items: int = 100_000, repeats: int = 5) -> tuple[float, float]:
    """Seconds `Checkpointer.timed` adds per item of an empty loop: (best, median) of `repeats`."""
    import tempfile
    import time

    import torch

    import tiercheck

    per_item = []
    with tempfile.TemporaryDirectory() as d, tiercheck.Checkpointer(local=d) as ckpt:
        ckpt.save(0, {"w": torch.zeros(10)})  # the run log is active, as in training
        for _ in range(repeats):
            t0 = time.perf_counter()
            for _ in range(items):
                pass
            plain = time.perf_counter() - t0
            t0 = time.perf_counter()
            for _ in ckpt.timed(range(items)):
                pass
            per_item.append((time.perf_counter() - t0 - plain) / items)
    per_item.sort()
    return per_item[0], per_item[len(per_item) // 2]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument(
        "--write-docs", action="store_true", help="update docs/goodput.md and docs/img/goodput_scenarios.png"
    )
    ap.add_argument("--json", metavar="FILE", help="also write the results as JSON")
    ap.add_argument("--overhead", action="store_true", help="measure what ckpt.timed() costs per item, and stop")
    args = ap.parse_args(argv)
    if args.overhead:
        best, median = timed_overhead()
        print(
            f"ckpt.timed(): {best * 1e6:.2f} us per item (best of 5), median {median * 1e6:.2f} us: "
            f"{best / 0.010:.3%} of a 10 ms step"
        )
        return 0
    rows, sens = scenarios(), sensitivity()
    print(f"MTBF {format_duration(mtbf())}, {MONTH / mtbf():.1f} failures a month, {GPUS} GPUs")
    print(table(rows))
    print()
    print(table(sens))
    if args.json:
        Path(args.json).write_text(json.dumps([asdict(s) for s in rows + sens], indent=1, default=str))
    if args.write_docs:
        doc = ROOT / "docs" / "goodput.md"
        text = doc.read_text()
        block = docs_block(rows, sens)
        new, n = re.subn(r"<!-- scenarios:begin.*?<!-- scenarios:end -->", lambda _: block, text, flags=re.S)
        if n != 1:
            print("docs/goodput.md has no scenarios block to replace", file=sys.stderr)
            return 1
        doc.write_text(new)
        plot(rows, ROOT / "docs" / "img" / "goodput_scenarios.png")
        print("updated docs/goodput.md and docs/img/goodput_scenarios.png")
    return 0


if __name__ == "__main__":
    sys.exit(main())
