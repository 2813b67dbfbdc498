"""PNG timelines of the stall benchmark: training throughput around each save, per method,
and an overview (lost seconds per save, every timeline stacked). Needs matplotlib."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from benchmarks.common import GIB


def plot(rep: dict[str, Any], img_dir: Path, prefix: str) -> list[str]:
    """One PNG per method (throughput around each save) and an overview; [] without matplotlib."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        rep["notes"].append("matplotlib is not installed: no PNG timelines")
        return []
    img_dir.mkdir(parents=True, exist_ok=True)
    methods = {k: v for k, v in rep["methods"].items() if v.get("saves")}
    if not methods:
        return []
    xmax = 0.0
    for e in methods.values():
        for s in e["saves"]:
            xmax = max(xmax, s["steps"][-1][3] - s["t_call"])
    xmin = -2.5 * max(e["summary"]["baseline_step_s"]["median"] for e in methods.values())
    written = []

    def own_xmax(e: dict[str, Any]) -> float:
        return max(s["steps"][-1][3] - s["t_call"] for s in e["saves"])

    def draw(ax: Any, name: str, e: dict[str, Any], x_max: float) -> None:
        saves = e["saves"]
        lost = [s["lost_s"] for s in saves]
        med = sorted(range(len(saves)), key=lambda i: lost[i])[len(saves) // 2]
        for i, s in enumerate(saves):
            xs, ys = _throughput_curve(s)
            ax.plot(
                xs,
                ys,
                color="C0" if i == med else "0.6",
                lw=1.6 if i == med else 0.7,
                alpha=1.0 if i == med else 0.6,
                zorder=3 if i == med else 2,
            )
        s = saves[med]
        stall_end = s["t_return"] - s["t_call"]
        ax.axvspan(0, max(stall_end, 1e-3), color="C3", alpha=0.25, lw=0, label="save call (blocked)")
        if s["t_durable"] is not None and s["t_durable"] > s["t_return"]:
            ax.axvspan(
                stall_end,
                s["t_durable"] - s["t_call"],
                color="C2",
                alpha=0.15,
                lw=0,
                label="background work until durable",
            )
        ax.axvline(0, color="C3", lw=1)
        if s["t_durable"] is not None:
            ax.axvline(s["t_durable"] - s["t_call"], color="C2", lw=1, ls="--")
        sm = e["summary"]
        ax.set_title(
            f"{name}: lost {sm['lost_s']['median']:.2f} s/save, stall {sm['stall_s']['median']:.2f} s"
            + (f", durable {sm['durable_s']['median']:.2f} s" if sm["durable_s"] else ""),
            fontsize=9,
        )
        ax.set_ylim(-5, 130)
        ax.set_xlim(xmin, x_max)
        ax.set_ylabel("throughput, % of baseline", fontsize=8)
        ax.grid(alpha=0.3)

    cfg = rep["config"]
    sub = f"{cfg['workload']}; state {cfg['state_bytes'] / GIB:.2f} GiB; {cfg['device']}"
    for name, e in methods.items():
        fig, ax = plt.subplots(figsize=(8, 3))
        draw(ax, name, e, own_xmax(e))
        ax.set_xlabel("seconds since the save call (bold: median-lost repeat; grey: other repeats)", fontsize=8)
        ax.legend(fontsize=7, loc="lower right")
        fig.suptitle(sub, fontsize=7)
        fig.tight_layout()
        p = img_dir / f"{prefix}_{name}.png"
        fig.savefig(p, dpi=110)
        plt.close(fig)
        written.append(str(p))
    # overview: lost seconds per save (stall + slowdown), then every timeline stacked
    names = list(methods)
    fig = plt.figure(figsize=(9, 2.2 + 1.35 * len(names)))
    gs = fig.add_gridspec(len(names) + 1, 1, height_ratios=[2.2] + [1.0] * len(names))
    ax0 = fig.add_subplot(gs[0])
    stall = [methods[n]["summary"]["stall_s"]["median"] for n in names]
    slow = [methods[n]["summary"]["slowdown_s"]["median"] for n in names]
    lo = [methods[n]["summary"]["lost_s"]["min"] for n in names]
    hi = [methods[n]["summary"]["lost_s"]["max"] for n in names]
    med = [methods[n]["summary"]["lost_s"]["median"] for n in names]
    y = list(range(len(names)))
    ax0.barh(y, stall, color="C3", alpha=0.7, label="stall (median)")
    ax0.barh(y, [max(0.0, x) for x in slow], left=stall, color="C1", alpha=0.7, label="slowdown (median, if > 0)")
    cpu = [(methods[n]["summary"].get("cpu_s") or {}).get("median") for n in names]
    cy = [yy for yy, c in zip(y, cpu, strict=True) if c is not None]
    if cy:
        ax0.plot([c for c in cpu if c is not None], cy, "D", color="C4", ms=4, label="extra CPU s (all cores)")
    ax0.errorbar(
        med,
        y,
        xerr=[[m - a for m, a in zip(med, lo, strict=True)], [b - m for m, b in zip(med, hi, strict=True)]],
        fmt="k|",
        lw=0.8,
        capsize=2,
        label="lost: median [min-max]",
    )
    ax0.set_yticks(y, names, fontsize=7)
    ax0.invert_yaxis()
    ax0.set_xlabel("training seconds lost per save", fontsize=8)
    ax0.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0))
    ax0.grid(axis="x", alpha=0.3)
    ax0.set_title(sub, fontsize=8)
    for i, n in enumerate(names):
        ax = fig.add_subplot(gs[i + 1])
        draw(ax, n, methods[n], xmax)
        ax.set_ylabel("%", fontsize=7)
        ax.tick_params(labelsize=7)
        if i < len(names) - 1:
            ax.set_xticklabels([])
    ax.set_xlabel("seconds since the save call", fontsize=8)
    fig.tight_layout()
    p = img_dir / f"{prefix}_overview.png"
    fig.savefig(p, dpi=100)
    plt.close(fig)
    written.append(str(p))
    return written


def _throughput_curve(s: dict[str, Any]) -> tuple[list[float], list[float]]:
    """Throughput (% of baseline) as a step function of time since the save call: 0 while the
    loop is blocked (save call, waits), baseline/duration elsewhere within each step."""
    base = s["baseline_step_s"]
    tc = s["t_call"]
    xs: list[float] = []
    ys: list[float] = []

    def seg(a: float, b: float, v: float) -> None:
        if b <= a:
            return
        xs.extend([a - tc, b - tc])
        ys.extend([v, v])

    steps = s["steps"]
    npre = s["n_pre_steps"]
    for i, (t0, tw0, tw1, t1) in enumerate(steps):
        if i == npre:
            seg(steps[i - 1][3] if i else tc, t0, 0.0)  # the save call
        wait = tw1 - tw0
        if wait < 0.02 * base:  # a negligible wait: don't draw a spike for it
            v = 100.0 * base / (t1 - t0) if t1 > t0 else 0.0
            seg(t0, t1, v)
            continue
        v = 100.0 * base / (t1 - t0 - wait) if t1 - t0 > wait else 0.0
        seg(t0, tw0, v)
        seg(tw0, tw1, 0.0)
        seg(tw1, t1, v)
    return xs, ys
