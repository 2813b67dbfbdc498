"""``tiercheck report DIR`` (where the run's time went) and ``tiercheck plan`` (how often to
save), over the run log (`runlog.py`) and the formulas in `goodput.py`. Both only read."""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import sys
import time
from collections.abc import Sequence
from typing import Any

from ..goodput import summary as goodput
from ..goodput.recovery import DLROVER_SHARE, Tier0Plan, tier0_plan
from ..goodput.runlog import RunLogFiles, no_log_message
from ..goodput.summary import CATEGORIES, Report, format_duration, parse_duration

__all__ = ["COMMANDS", "add_parsers", "main"]

COMMANDS = ("report", "plan")

COLORS = {
    "compute": "#2ca02c",
    "data wait": "#ff7f0e",
    "checkpoint": "#d62728",
    "restore": "#9467bd",
    "redo": "#7f7f7f",
    "gap": "#222222",
    "other": "#d9d9d9",
}


class UsageError(Exception):
    """Bad input on the command line: printed as one line, exit status 2."""


def add_parsers(sub: Any) -> None:
    """Add ``report`` and ``plan`` to the subparsers of ``tiercheck``'s parser."""
    report = sub.add_parser(
        "report",
        help="where the run's time went: compute, data wait, checkpoint, restore, redone work, gaps",
        description="Read the run log in a checkpoint directory (or URL) and report, per run (restart) "
        "and in total, wall time, compute, data wait, checkpoint stall, restore time, work redone after "
        "each failure and the gap before the next start.",
    )
    report.add_argument("location", help="the checkpoint directory (tier 1) or URL (tier 2 without tier 1)")
    report.add_argument("--rank", type=int, default=None, help="whose run log (default: the lowest rank)")
    report.add_argument("--json", action="store_true", help="print JSON instead of a table")
    report.add_argument("--plot", metavar="FILE.png", help="draw the timeline and the totals (needs matplotlib)")
    report.set_defaults(run=run_report)
    plan = sub.add_parser(
        "plan",
        help="the checkpoint interval that maximises goodput (Young, Daly) and the time it loses",
        description="Young's interval sqrt(2 C M), Daly's higher-order one and the expected fraction of "
        "time lost, for a save costing C (--cost, or measured from the run log in LOCATION) and a mean "
        "time between failures M. Durations: 250ms, 30s, 5m, 8h, 1.5d, 1h30m.",
    )
    plan.add_argument("location", nargs="?", help="take the cost per save (and restart time) from this run log")
    plan.add_argument("--mtbf", required=True, help="mean time between failures of the whole job, e.g. 8h")
    plan.add_argument("--cost", help="seconds of training one save costs (default: measured in LOCATION)")
    plan.add_argument("--restart", help="time from a failure until training runs again (default: measured, or 0)")
    plan.add_argument("--blocking-cost", help="a blocking save's cost, to compare (default: measured durable time)")
    plan.add_argument(
        "--memory-restart",
        metavar="DURATION",
        help="with tier 0: time from a failure until training runs again when the node's memory holds the "
        "step (relaunch + restore from memory; default: measured in LOCATION's restores from memory)",
    )
    plan.add_argument(
        "--memory-share",
        metavar="FRACTION",
        help="with tier 0: the fraction of failures that leave the node up and restart from its memory, "
        f"0.75 or 75%% (default {DLROVER_SHARE:g}: DLRover's share of faults recovered on the same node)",
    )
    plan.add_argument(
        "--durable-after",
        metavar="DURATION",
        help="with tier 0: time from save() until durable on tiers 1-2, how far behind their snapshot is "
        "(default: measured on tier 1 in LOCATION, or 0)",
    )
    plan.add_argument("--rank", type=int, default=None, help="whose run log (default: the lowest rank)")
    plan.add_argument("--json", action="store_true", help="print JSON instead of a table")
    plan.set_defaults(run=run_plan)


def main(argv: Sequence[str]) -> int:
    """``tiercheck report ...`` or ``tiercheck plan ...`` (`argv` starts with the command)."""
    ap = argparse.ArgumentParser(prog="tiercheck")
    add_parsers(ap.add_subparsers(dest="cmd", required=True))
    args = ap.parse_args(list(argv))
    try:
        return int(args.run(args))
    except UsageError as exc:
        print(f"tiercheck {args.cmd}: {exc}", file=sys.stderr)
        return 2


def _duration(name: str, text: str | None, positive: bool = True) -> float | None:
    if text is None:
        return None
    try:
        value = parse_duration(text)
    except ValueError as exc:
        raise UsageError(f"{name}: {exc}") from None
    if positive and value <= 0:
        raise UsageError(f"{name}: must be more than zero, got {text!r}")
    return value


def _load(location: str, rank: int | None) -> Report:
    """One rank's report (default: the lowest rank with a log), reading that rank's files
    only, a line at a time: the other ranks' logs are known by their names alone."""
    try:
        files = RunLogFiles(location)
    except FileNotFoundError as exc:
        raise UsageError(str(exc)) from None
    chosen = rank if rank is not None else (files.ranks[0] if files.ranks else None)
    if chosen is None or chosen not in files.ranks:
        raise UsageError(no_log_message(files, rank))
    report = goodput.summarise(files.records(chosen), chosen)
    skipped = tuple(files.skipped_files)
    if not report.runs:
        why = f"; skipped {'; '.join(skipped)}" if skipped else ""
        raise UsageError(f"no run of rank {chosen} in the run log of {location} (ranks there: {files.ranks}){why}")
    return dataclasses.replace(
        report,
        ranks=tuple(sorted(set(report.ranks) | set(files.ranks))),
        skipped_records=report.skipped_records + files.bad,
        skipped_files=skipped,
    )


# -- report ----------------------------------------------------------------------------


def run_report(args: argparse.Namespace) -> int:
    report = _load(args.location, args.rank)
    if args.plot:
        plot_report(report, args.plot)
    if args.json:
        print(json.dumps(report.to_dict(), indent=1, sort_keys=False))
    else:
        print(format_report(report, args.location))
        if args.plot:
            print(f"plot: {args.plot}")
    return 0


def _pct(part: float, whole: float) -> str:
    return f"{part / whole:.1%}" if whole > 0 else "-"


def format_report(report: Report, location: str) -> str:
    t = report.total
    ranks = f" of ranks {', '.join(map(str, report.ranks))}" if len(report.ranks) > 1 else ""
    lines = [
        f"tiercheck report {location} (rank {report.rank}{ranks}): {t.runs} run(s), {t.failures} failed, "
        f"{format_duration(t.wall_s)} of wall time"
    ]
    head = ["run", "started", "ended", "wall", "compute", "data wait", "checkpoint", "restore", "redo", "gap before"]
    rows = [head]
    for r in report.runs:
        redo = "-" if not r.redo_steps and not r.redo_s else f"{format_duration(r.redo_s)} ({r.redo_steps} steps)"
        rows.append(
            [
                str(r.run),
                time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(r.start_t)),
                r.ended,
                format_duration(r.wall_s),
                format_duration(r.compute_s),
                format_duration(r.data_wait_s),
                format_duration(r.checkpoint_s),
                _restore_cell(r),
                redo,
                format_duration(r.gap_before_s) + (" (after failure)" if r.after_failure else ""),
            ]
        )
    rows.append(
        [
            "total",
            "",
            "",
            format_duration(t.wall_s),
            format_duration(t.compute_s),
            format_duration(t.data_wait_s),
            format_duration(t.checkpoint_s),
            format_duration(t.restore_s),
            format_duration(t.redo_s),
            format_duration(t.gap_s),
        ]
    )
    widths = [max(len(row[i]) for row in rows) for i in range(len(head))]
    lines += ["  ".join(c.ljust(w) for c, w in zip(row, widths, strict=True)).rstrip() for row in rows]
    lost = ", ".join(f"{c} {_pct(t.bar[c], t.wall_s)}" for c in CATEGORIES if c != "compute")
    lines.append(
        f"goodput {t.goodput:.1%}: useful compute {format_duration(t.useful_compute_s)} of "
        f"{format_duration(t.wall_s)}; the rest: {lost}"
    )
    if t.saves:
        durable = ", ".join(f"{k} {format_duration(v)}" for k, v in t.durable_s.items()) or "-"
        lines.append(
            f"saves: {t.saves}, stall {format_duration(t.mean_stall_s)} each; lost per save "
            f"{format_duration(t.save_cost_s)} (stall + slowdown while writing); durable after: {durable}"
        )
    if t.restores:
        each = (
            f"{int(v['count'])} from {'an unnamed tier (a log older than tier 0)' if k == '?' else k} "
            f"{format_duration(v['mean_s'])}"
            for k, v in t.restores.items()
        )
        lines.append("restores, mean time each: " + "; ".join(each))
    errors = sum(r.errors for r in report.runs)
    if errors:
        lines.append(f"errors: {errors} failed step writes (see the `durable`/`error` records)")
    if report.skipped_records:
        lines.append(
            f"skipped {report.skipped_records} unreadable record(s) (a line torn by a crash, or not a record "
            "this library writes)"
        )
    lines += [f"skipped file {f}" for f in report.skipped_files]
    lines += [f"! {f}" for f in report.flags]
    return "\n".join(lines)


def _restore_cell(r: goodput.RunSummary) -> str:
    """``12.3 ms (memory)``: the restore's time and the tier it read (none named in a log
    older than tier 0, or when there was no step to restore)."""
    if not r.restore_s and r.restored_step is None:
        return "-"
    return format_duration(r.restore_s) + (f" ({r.restored_tier})" if r.restored_tier else "")


def plot_report(report: Report, path: str) -> None:
    """The timeline (like a GPU-utilisation chart, split by where the time went) above a
    stacked bar of the totals."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise UsageError("--plot needs matplotlib: pip install matplotlib (or the 'dev' extra)") from None
    edges, fractions = goodput.utilisation(report)
    span = edges[-1] if edges else 0.0
    unit, scale = ("h", 3600.0) if span > 3 * 3600 else ("min", 60.0) if span > 180 else ("s", 1.0)
    fig, (ax1, ax2) = plt.subplots(2, 1, figsize=(11, 6), gridspec_kw={"height_ratios": [3, 1]})
    if edges:
        x = [e / scale for e in edges]
        bottom = [0.0] * (len(edges) - 1)
        for c in CATEGORIES:
            top = [b + 100 * f for b, f in zip(bottom, fractions[c], strict=True)]
            ax1.fill_between(x, bottom + bottom[-1:], top + top[-1:], step="post", color=COLORS[c], label=c, lw=0)
            bottom = top
        for r in report.runs[1:]:
            ax1.axvline((r.start_t - report.runs[0].start_t) / scale, color="black", lw=0.6, ls=":")
        ax1.set_xlim(x[0], x[-1])
    ax1.set_ylim(0, 100)
    ax1.set_ylabel("% of time")
    ax1.set_xlabel(f"time since the first start ({unit}); dotted: a restart")
    ax1.set_title(f"Where the time went, rank {report.rank}: {len(report.runs)} run(s)")
    ax1.legend(loc="upper center", bbox_to_anchor=(0.5, -0.2), ncol=len(CATEGORIES), fontsize=8, frameon=False)
    t = report.total
    left = 0.0
    bar_scale = 3600.0 if t.wall_s > 3 * 3600 else 60.0 if t.wall_s > 180 else 1.0
    bar_unit = {3600.0: "h", 60.0: "min", 1.0: "s"}[bar_scale]
    for c in CATEGORIES:
        v = t.bar[c] / bar_scale
        ax2.barh([0], [v], left=left, color=COLORS[c])
        if t.wall_s > 0 and t.bar[c] / t.wall_s >= 0.06:
            ink = "white" if c == "gap" else "black"
            ax2.text(
                left + v / 2, 0, f"{c}\n{t.bar[c] / t.wall_s:.0%}", ha="center", va="center", fontsize=8, color=ink
            )
        left += v
    ax2.set_yticks([])
    ax2.set_xlabel(f"total ({bar_unit}); goodput {t.goodput:.1%}")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


# -- plan ------------------------------------------------------------------------------


@dataclasses.dataclass
class _PlanInputs:
    """`tiercheck plan`'s numbers: given as options, or measured from a run log."""

    mtbf: float
    cost: float | None
    restart: float | None
    blocking: float | None
    memory_restart: float | None
    durable_after: float | None
    share: float | None
    tier0: bool
    durable: dict[str, float] = dataclasses.field(default_factory=dict)
    source: str = "--cost"


def _plan_inputs(args: argparse.Namespace) -> _PlanInputs:
    mtbf = _duration("--mtbf", args.mtbf)
    assert mtbf is not None
    memory_restart = _duration("--memory-restart", args.memory_restart, positive=False)
    share = _share(args.memory_share)
    i = _PlanInputs(
        mtbf=mtbf,
        cost=_duration("--cost", args.cost),
        restart=_duration("--restart", args.restart, positive=False),
        blocking=_duration("--blocking-cost", args.blocking_cost),
        memory_restart=memory_restart,
        durable_after=_duration("--durable-after", args.durable_after, positive=False),
        share=share,
        tier0=share is not None or memory_restart is not None,
    )
    if args.location is not None:
        _measure_plan_inputs(i, args.location, args.rank)
    if i.cost is None:
        raise UsageError("give --cost (e.g. --cost 30s) or a checkpoint directory whose run log has saves")
    if i.tier0 and i.memory_restart is None:
        raise UsageError(
            "give --memory-restart (e.g. 30s: relaunch + restore from memory), or a checkpoint directory "
            "whose run log has a restore from tier 0"
        )
    return i


def _measure_plan_inputs(i: _PlanInputs, location: str, rank: int | None) -> None:
    """Fill what the options left open from the run log at `location`."""
    report = _load(location, rank)
    t = report.total
    i.durable = t.durable_s
    if i.cost is None:
        if not t.saves or t.save_cost_s is None:
            raise UsageError(f"no save in the run log of {location}: pass --cost")
        i.cost, i.source = max(t.save_cost_s, 1e-6), "run log"
    if i.blocking is None and t.blocking_cost_s is not None:
        i.blocking = t.blocking_cost_s
    after = [r for r in report.runs if r.after_failure]
    from_memory = [r for r in after if r.restored_tier == "memory"]
    if i.restart is None:
        # Restarts from tiers 1-2 when tier 0 is asked about and the log has both kinds.
        durable_runs = [r for r in after if r.restored_tier != "memory"] if i.tier0 else after
        i.restart = _mean_restart(durable_runs or after)
    if i.tier0 and i.memory_restart is None and from_memory:
        i.memory_restart = _mean_restart(from_memory)
    if i.durable_after is None and i.durable:
        i.durable_after = i.durable.get("local", next(iter(i.durable.values())))


def run_plan(args: argparse.Namespace) -> int:
    i = _plan_inputs(args)
    cost, mtbf, restart = i.cost, i.mtbf, i.restart or 0.0
    assert cost is not None
    try:
        mine = goodput.plan(cost, mtbf, restart)
        theirs = goodput.plan(i.blocking, mtbf, restart) if i.blocking is not None else None
        with_memory = (
            tier0_plan(
                cost,
                mtbf,
                restart,
                i.memory_restart or 0.0,
                DLROVER_SHARE if i.share is None else i.share,
                i.durable_after or 0.0,
            )
            if i.tier0
            else None
        )
    except ValueError as exc:
        raise UsageError(str(exc)) from None
    if args.json:
        print(json.dumps(_plan_json(i, restart, mine, theirs, with_memory), indent=1))
    else:
        _print_plan(i, restart, mine, theirs, with_memory)
    return 0


def _plan_json(
    i: _PlanInputs, restart: float, mine: Any, theirs: Any, with_memory: Any
) -> dict[str, Any]:
    out: dict[str, Any] = {
        "young_interval_s": mine.young_interval_s,
        "daly_interval_s": mine.daly_interval_s,
        "lost_fraction": mine.lost_fraction,
        "lost_fraction_young": mine.lost_fraction_young,
        "cost_s": i.cost,
        "cost_source": i.source,
        "mtbf_s": i.mtbf,
        "restart_s": restart,
    }
    if i.durable:
        out["durable_s"] = i.durable
    if theirs is not None:
        out["blocking"] = {
            "cost_s": theirs.cost_s,
            "young_interval_s": theirs.young_interval_s,
            "daly_interval_s": theirs.daly_interval_s,
            "lost_fraction": theirs.lost_fraction,
        }
    if with_memory is not None:
        out["tier0"] = dataclasses.asdict(with_memory)
    return out


def _print_plan(i: _PlanInputs, restart: float, mine: Any, theirs: Any, with_memory: Any) -> None:
    print(
        f"checkpoint interval (compute time between saves) for MTBF {format_duration(i.mtbf)}, restart "
        f"{format_duration(restart)}; cost per save from {i.source}"
    )
    rows = [["", "cost per save", "Young sqrt(2CM)", "Daly", "time lost at Daly's"]]
    named = [("tiercheck" if i.source == "run log" else "this save", mine)]
    if theirs is not None:
        named.append(("blocking save", theirs))
    for name, p in named:
        rows.append(
            [
                name,
                format_duration(p.cost_s),
                format_duration(p.young_interval_s),
                format_duration(p.daly_interval_s),
                f"{p.lost_fraction:.2%}",
            ]
        )
    widths = [max(len(r[c]) for r in rows) for c in range(len(rows[0]))]
    for r in rows:
        print("  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)).rstrip())
    if with_memory is not None:
        print(format_tier0(with_memory))
    # The host buffer is free again once tier 1 has the step: a save sooner than that waits.
    first = i.durable.get("local", next(iter(i.durable.values()), 0.0))
    if first > mine.daly_interval_s:
        print(
            f"note: a save takes {format_duration(first)} to become durable on tier 1, longer than the "
            f"interval: saves would queue behind each other; save at most every {format_duration(first)}"
        )


def _share(text: str | None) -> float | None:
    """``--memory-share``: a fraction in [0, 1], or a percentage (``75%``)."""
    if text is None:
        return None
    t = text.strip()
    try:
        value = float(t[:-1]) / 100.0 if t.endswith("%") else float(t)
    except ValueError:
        value = math.nan
    if not 0.0 <= value <= 1.0:  # NaN fails too
        raise UsageError(f"--memory-share: give a fraction from 0 to 1 or a percentage (0.75, 75%), got {text!r}")
    return value


def _mean_restart(runs: Sequence[goodput.RunSummary]) -> float:
    """The mean time from a run's failure until the next trains: the gap plus the restore."""
    return sum((r.gap_before_s or 0.0) + r.restore_s for r in runs) / len(runs) if runs else 0.0


def format_tier0(p: Tier0Plan) -> str:
    """The tier-0 comparison of ``tiercheck plan``: both rows at the same interval."""
    lines = [
        f"with tier 0: {p.memory_share:.0%} of failures restart from memory in {format_duration(p.memory_restart_s)} "
        f"(the newest save), the other {1 - p.memory_share:.0%} from tiers 1-2 in {format_duration(p.restart_s)} "
        f"(durable {format_duration(p.durable_after_s)} after a save)"
    ]
    rows = [
        ["", "interval", "restart (effective)", "time lost"],
        [
            "tiers 1-2 only",
            format_duration(p.interval_s),
            format_duration(p.durable_restart_effective_s),
            f"{p.durable_lost_fraction:.2%}",
        ],
        [
            "with tier 0",
            format_duration(p.interval_s),
            format_duration(p.restart_effective_s),
            f"{p.lost_fraction:.2%}",
        ],
    ]
    widths = [max(len(r[c]) for r in rows) for c in range(len(rows[0]))]
    lines += ["  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)).rstrip() for r in rows]
    saved = p.durable_lost_fraction - p.lost_fraction
    lines.append(f"tier 0 saves {saved:.2%} of the time: {format_duration(saved * 3600)} per GPU-hour")
    return "\n".join(lines)
