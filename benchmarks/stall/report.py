"""The stall benchmark's report: per-method summaries, the targets as ratios (of medians and
paired per repeat), the markdown table, and the table of ratios to the naive O_DIRECT
writer across state sizes."""

from __future__ import annotations

import math
import os
import statistics
from collections.abc import Sequence
from typing import Any

from benchmarks.common import GIB, fs_text, summary
from benchmarks.stall.measure import DCP_METHODS, METHOD_CLASSES, TIERCHECK_METHODS, Bench

TARGETS = (
    # name, numerator (method, metric), denominator (method or "dcp_best", metric), op, value
    ("lost / torch.save stall", "lost_s", "torch_save", "stall_s", "<=", 0.1),
    ("lost / best DCP mode's lost", "lost_s", "dcp_best", "lost_s", "<=", 0.1),
    ("stall / memcpy stall", "stall_s", "memcpy", "stall_s", "<=", 1.2),
    # the naive writer (issue 18): copy into a pre-faulted buffer, O_DIRECT + fsync from one
    # thread; no checksum, no manifest, no retention (tiercheck runs with keep_local=1)
    ("lost / naive O_DIRECT writer lost", "lost_s", "odirect_writer", "lost_s", "<=", 1.1),
    ("background / naive writer background", "bg_s", "odirect_writer", "bg_s", "<=", None),
    ("durable / naive O_DIRECT writer durable", "durable_s", "odirect_writer", "durable_s", "<=", 1.05),
    # CPU seconds the save adds to the process: on a loop that keeps every core busy, the
    # lost time follows it, and it barely moves with other jobs' load on a shared machine
    ("extra CPU / naive writer extra CPU", "cpu_s", "odirect_writer", "cpu_s", "<=", None),
)

# tier 0 (issue 26): what memory=True adds to a save, against the same save without it
MEMORY_TARGETS = (
    ("stall / tiercheck stall (no tier 0)", "stall_s", "tiercheck", "stall_s", "<=", 1.05),
    ("lost / tiercheck lost (no tier 0)", "lost_s", "tiercheck", "lost_s", "<=", 1.05),
    ("durable / tiercheck durable (no tier 0)", "durable_s", "tiercheck", "durable_s", "<=", None),
    ("extra CPU / tiercheck extra CPU (no tier 0)", "cpu_s", "tiercheck", "cpu_s", "<=", None),
)


METRIC_NAMES = (  # summarised per method
    "stall_s",
    "call_s",
    "wait_s",
    "durable_s",
    "bg_s",
    "lost_s",
    "slowdown_s",
    "cpu_s",
    "bg_rel_throughput",
    "bg_steps_per_s",
    "baseline_steps_per_s",
    "baseline_step_s",
    "window_steps",
)


def build_report(b: Bench, info: dict[str, Any], wall_s: float) -> dict[str, Any]:
    a = b.args
    per_method: dict[str, Any] = {}
    t0 = b.t_start
    for name in a.methods:
        recs = [r for r in b.records if r.method == name]
        entry: dict[str, Any] = {
            "description": METHOD_CLASSES[name].description,
            "available": name not in b.unavailable and name not in b.failed,
            "reason": b.unavailable.get(name) or b.failed.get(name),
        }
        if recs:
            ms = [r.metrics() for r in recs]
            entry["summary"] = {k: summary([m[k] for m in ms]) for k in METRIC_NAMES}
            entry["saves"] = [
                {
                    "repeat": r.repeat,
                    "step": r.step,
                    **m,
                    **r.extra,
                    "window_capped": r.window_capped,
                    # timestamps relative to the start of the run, for the timelines
                    "t_call": r.t_call - t0,
                    "t_return": r.t_return - t0,
                    "t_durable": None if r.t_durable is None else r.t_durable - t0,
                    "steps": [
                        [round(s.t0 - t0, 5), round(s.tw0 - t0, 5), round(s.tw1 - t0, 5), round(s.t1 - t0, 5)]
                        for s in r.pre_steps + r.steps
                    ],
                    "n_pre_steps": len(r.pre_steps),
                }
                for r, m in zip(recs, ms, strict=True)
            ]
        per_method[name] = entry
    if "odirect_writer" in per_method:
        m = METHOD_CLASSES["odirect_writer"]
        odw = next((x for x in b.methods if isinstance(x, m)), None)
        if odw is not None and getattr(odw, "fell_back", False):
            b.ctx.notes.append("odirect_writer: the filesystem refused O_DIRECT; it wrote buffered + fsync")
    dcp_best = best_dcp_method(per_method)
    rows = [(r.method, r.repeat, r.metrics()) for r in b.records]
    targets = compute_targets(per_method, rows, dcp_best)
    return {
        "benchmark": "stall",
        "machine": info,
        "config": {
            "model": a.model,
            "workload": b.w.description,
            "device": str(b.device),
            "params": b.w.params,
            "state_bytes": b.ctx.nbytes,
            "state_tensors": len(b.ctx.tensors),
            "repeats": a.repeats,
            "every": a.every,
            "pre_steps": a.pre_steps,
            "tail_steps": a.tail_steps,
            "noise_steps": a.noise_steps,
            "odirect_block": a.odirect_block,
            "quick": a.quick,
            "methods": list(a.methods),
            "loadavg_end": os.getloadavg(),
            "wall_s": wall_s,
            "process": os.getpid(),
        },
        "definitions": {
            "stall_s": "time in the save call + waits the method adds before the next optimizer.step()",
            "durable_s": "save call to durable on disk (fsynced); None for methods that make no checkpoint",
            "bg_s": "the background part: from the save call's return to durable",
            "lost_s": "wall time from the save call to the end of the tail steps after durable, minus "
            "(steps in that window x baseline step time)",
            "slowdown_s": "lost_s - stall_s: the integrated slowdown of the steps overlapping the background work",
            "bg_rel_throughput": "steps/s of the steps that started before durable, over baseline steps/s",
            "baseline_step_s": "median duration of the clean steps just before the save (first one excluded)",
            "cpu_s": "CPU seconds (this process + child processes) used in the window, minus steps x the baseline "
            "step's CPU seconds: what the save cost in CPU; less sensitive to other load on the machine than "
            "lost_s, and on a CPU-bound loop that fills every core, lost_s is about cpu_s / cores",
        },
        "dcp_best": dcp_best,
        "methods": per_method,
        "targets": targets,
        "notes": b.ctx.notes,
    }


def best_dcp_method(per_method: dict[str, Any]) -> str | None:
    best, best_v = None, math.inf
    for name in DCP_METHODS:
        s = per_method.get(name, {}).get("summary", {}).get("lost_s")
        if s and s["median"] < best_v:
            best, best_v = name, s["median"]
    return best


Row = tuple[str, int, dict[str, Any]]  # method, repeat, that save's metrics


def compute_targets(per_method: dict[str, Any], rows: Sequence[Row], dcp_best: str | None) -> list[dict[str, Any]]:
    """Every target of `TARGETS` for each tiercheck method measured: ratio of medians, and
    the median of the ratios paired per repeat."""
    targets: list[dict[str, Any]] = []
    for subject in TIERCHECK_METHODS:
        if "summary" not in per_method.get(subject, {}):
            continue
        for label, num_metric, den_method, den_metric, op, val in TARGETS + (
            MEMORY_TARGETS if subject == "tiercheck_memory" else ()
        ):
            den_name = dcp_best if den_method == "dcp_best" else den_method
            limit = "-" if val is None else f"{op} {val}"
            t = _ratio(rows, per_method, subject, num_metric, den_name, den_metric)
            if t is None:
                note = f"no {den_method} measurement"
                targets.append({"subject": subject, "target": label, "limit": limit, "met": None, "note": note})
                continue
            t.update({"subject": subject, "target": label, "limit": limit, "denominator": den_name})
            t["met"] = None if val is None else t["of_medians"] <= val
            t["met_paired"] = None if val is None else t["paired_median"] is not None and t["paired_median"] <= val
            targets.append(t)
    return targets


def _ratio(
    rows: Sequence[Row], per_method: dict[str, Any], num: str, num_metric: str, den: str | None, den_metric: str
) -> dict[str, Any] | None:
    if den is None:
        return None
    sn = per_method.get(num, {}).get("summary", {}).get(num_metric)
    sd = per_method.get(den, {}).get("summary", {}).get(den_metric)
    if not sn or not sd or sd["median"] <= 0:
        return None
    by_rep: dict[int, dict[str, float]] = {}
    for method, repeat, metrics in rows:
        if method in (num, den):
            v = metrics[num_metric if method == num else den_metric]
            if v is not None:
                by_rep.setdefault(repeat, {})[method] = v
    paired = [d[num] / d[den] for d in by_rep.values() if num in d and den in d and d[den] > 0]
    return {
        "numerator": f"{num}.{num_metric}",
        "denominator_metric": f"{den}.{den_metric}",
        "num_median": sn["median"],
        "den_median": sd["median"],
        "of_medians": sn["median"] / sd["median"],
        "paired_median": statistics.median(paired) if paired else None,
    }


def _fmt(s: dict[str, float] | None, digits: int = 3, pct: bool = False) -> str:
    if not s:
        return "-"
    if pct:
        return f"{100 * s['median']:.0f}% [{100 * s['min']:.0f}-{100 * s['max']:.0f}]"
    return f"{s['median']:.{digits}f} [{s['min']:.{digits}f}-{s['max']:.{digits}f}]"


def to_markdown(rep: dict[str, Any]) -> str:
    c, mi = rep["config"], rep["machine"]
    lines = [
        f"**stall** — {c['workload']} on {c['device']}; state {c['state_bytes'] / GIB:.3f} GiB "
        f"({c['params'] / 1e6:.1f} M params + Adam, {c['state_tensors']} tensors); "
        f"a save every >= {c['every']} steps, methods interleaved, {c['repeats']} repeats; "
        "median [min-max] in seconds",
        "",
        f"machine: {mi['cpu_count']} CPUs ({mi['cpu_model']}), {mi['mem_total_gib']} GiB RAM"
        + (f", GPU {mi['gpu']}" if mi.get("gpu") else "")
        + f", torch {mi['torch']} ({mi['torch_num_threads']} threads), python {mi['python']}, repo {mi['git_rev']}; "
        f"target {fs_text(mi['target_fs'])}; load avg at start {tuple(round(x, 1) for x in mi['loadavg_start'])}, "
        f"at end {tuple(round(x, 1) for x in c['loadavg_end'])}; run took {c['wall_s']:.0f} s",
        "",
        "| method | lost s/save | stall s | background s | durable s | slowdown s |"
        " steps/s during bg write (vs baseline) | extra CPU s | baseline step s |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for name, e in rep["methods"].items():
        s = e.get("summary")
        if not s:
            lines.append(f"| {name} | n/a: {e.get('reason') or 'no samples'} | | | | | | | |")
            continue
        lines.append(
            f"| {name} | **{_fmt(s['lost_s'])}** | {_fmt(s['stall_s'])} | {_fmt(s.get('bg_s'))} | "
            f"{_fmt(s['durable_s'])} | "
            f"{_fmt(s['slowdown_s'])} | {_fmt(s['bg_rel_throughput'], pct=True)} | {_fmt(s['cpu_s'], 2)} | "
            f"{_fmt(s['baseline_step_s'])} |"
        )
    lines += ["", "Methods:", ""]
    for name, e in rep["methods"].items():
        lines.append(f"- `{name}`: {e['description']}")
    if rep["targets"]:
        lines += [
            "",
            f"Targets (best DCP mode by median lost seconds: `{rep['dcp_best']}`):",
            "",
            "| subject | target | numerator | denominator | ratio of medians | paired median | limit | met |",
            "|---|---|---:|---:|---:|---:|---|---|",
        ]
        for t in rep["targets"]:
            if t.get("of_medians") is None:
                lines.append(f"| {t['subject']} | {t['target']} | | | | | {t['limit']} | n/a ({t.get('note')}) |")
                continue
            pm = "-" if t["paired_median"] is None else f"{t['paired_median']:.3f}"
            lines.append(
                f"| {t['subject']} | {t['target']} | {t['num_median']:.3f} | {t['den_median']:.3f} "
                f"({t['denominator']}) | {t['of_medians']:.3f} | {pm} | {t['limit']} | "
                f"{'-' if t['met'] is None else 'yes' if t['met'] else 'no'} |"
            )
    if rep["notes"]:
        lines += ["", "Notes: " + " ".join(rep["notes"])]
    return "\n".join(lines) + "\n"


def naive_writer_table(reps: Sequence[dict[str, Any]]) -> str:
    """Per size: tiercheck's lost time, background part and time to durable (retention
    included) as ratios of medians to the naive O_DIRECT writer's (paired median in brackets)."""
    lines = [
        "| state GiB | subject | lost s (naive) | lost ratio | background s (naive) | background ratio |"
        " durable s (naive) | durable ratio | extra CPU s (naive) | extra CPU ratio | load avg start / end |",
        "|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---|",
    ]
    for rep in reps:
        gib = rep["config"]["state_bytes"] / GIB
        load = f"{rep['machine']['loadavg_start'][0]:.1f} / {rep['config']['loadavg_end'][0]:.1f}"
        by: dict[str, dict[str, Any]] = {}
        for t in rep["targets"]:
            if t.get("denominator") == "odirect_writer":
                by.setdefault(t["subject"], {})[t["numerator"].split(".", 1)[1]] = t
        for subject, ts in by.items():
            cells = []
            for metric in ("lost_s", "bg_s", "durable_s", "cpu_s"):
                t = ts.get(metric)
                if t is None:
                    cells += ["-", "-"]
                    continue
                pm = "-" if t["paired_median"] is None else f"{t['paired_median']:.2f}"
                cells += [f"{t['num_median']:.3f} ({t['den_median']:.3f})", f"**{t['of_medians']:.2f}** ({pm})"]
            lines.append(f"| {gib:.2f} | {subject} | " + " | ".join(cells) + f" | {load} |")
    return "\n".join(lines) + "\n"
