"""Where a run's GPU time went, and how often to checkpoint. Pure: records in, values out.

`summarise` turns the run log's records (`runlog.py` writes them; the schema is in
`docs/goodput.md`) into one `RunSummary` per run (one `Checkpointer` session: a process
start, or a restart) and a `Totals`:

* wall time: from the session's start to its `close` record, or, for a run that failed
  (no `close`), to its newest record or heartbeat (about a second early on tier 1);
* compute: time inside the loop body of ``ckpt.timed(loader)``, less the time spent in
  `save`/`restore`/`wait`/`drain` calls made there;
* data wait: time spent in the loader's ``next()``;
* checkpoint: the stall of every `save()` plus the time blocked in `wait`/`drain`/`close`;
* restore: the time `restore()` took, and the tier it read (``memory``, ``local``,
  ``remote``; None in logs older than tier 0);
* redo: work the run repeated because the run before it got further than the restored
  step: (furthest step reached - restored step) x that run's step time (compute plus data
  wait per step). Steps are counted from the loop's iterations, anchored to the steps of
  the saves and the restore;
* gap: from the end of a failed run to the start of the next one (restart, scheduling,
  imports and model building until the `Checkpointer` exists);
* other: the rest of the wall time (set-up before the loop, evaluation outside it, ...).

The interval formulas: Young (1974), T = sqrt(2 C M); Daly (2006, "A higher order estimate
of the optimum checkpoint interval for restart dumps"),
T = sqrt(2 C M) [1 + (1/3) sqrt(C / 2M) + (1/9) (C / 2M)] - C for C < 2M, else M; the
expected fraction of time lost is Daly's exponential-failure model,
1 - T / (M e^(R/M) (e^((T+C)/M) - 1)), with T the compute time between saves, C the time a
save costs, R the restart time and M the mean time between failures.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any, TypeVar

__all__ = [
    "SCHEMA_VERSION",
    "Plan",
    "Report",
    "RunSummary",
    "Totals",
    "daly_interval",
    "format_duration",
    "lost_fraction",
    "parse_duration",
    "plan",
    "summarise",
    "utilisation",
    "young_interval",
]

SCHEMA_VERSION = 1

# The categories of the timeline and of the stacked totals, in drawing order.
CATEGORIES = ("compute", "data wait", "checkpoint", "restore", "redo", "gap", "other")


# -- checkpoint interval ---------------------------------------------------------------


def young_interval(cost: float, mtbf: float) -> float:
    """Young's optimum compute time between checkpoints, sqrt(2 C M), in seconds."""
    _check_positive(cost=cost, mtbf=mtbf)
    return math.sqrt(2.0 * cost * mtbf)


def daly_interval(cost: float, mtbf: float) -> float:
    """Daly's higher-order optimum: sqrt(2CM)(1 + sqrt(C/2M)/3 + (C/2M)/9) - C for C < 2M, else M."""
    _check_positive(cost=cost, mtbf=mtbf)
    if cost >= 2.0 * mtbf:
        return mtbf
    x = cost / (2.0 * mtbf)
    return math.sqrt(2.0 * cost * mtbf) * (1.0 + math.sqrt(x) / 3.0 + x / 9.0) - cost


def lost_fraction(interval: float, cost: float, mtbf: float, restart: float = 0.0) -> float:
    """Expected fraction of wall time that does no useful work: Daly's model for exponential
    failures, 1 - T / (M e^(R/M) (e^((T+C)/M) - 1)); it counts saves, redone work and restarts.

    Args:
        interval: compute time between two saves (T), seconds.
        cost: seconds each save takes from training (C).
        mtbf: mean time between failures of the whole job (M).
        restart: seconds from a failure until training runs again, restore included (R).
    """
    _check_positive(interval=interval, mtbf=mtbf)
    if cost < 0 or restart < 0:
        raise ValueError(f"cost and restart must be >= 0, got cost={cost!r} restart={restart!r}")
    exponent = (interval + cost) / mtbf + restart / mtbf
    if exponent > 700:  # e^700 overflows a float: nothing useful gets done at all
        return 1.0
    wall = mtbf * math.exp(restart / mtbf) * math.expm1((interval + cost) / mtbf)
    return max(0.0, min(1.0, 1.0 - interval / wall))


@dataclass(frozen=True, slots=True)
class Plan:
    """How often to save for one cost per save.

    Attributes:
        cost_s: seconds of training each save costs.
        mtbf_s: mean time between failures.
        restart_s: seconds from a failure until training resumes.
        young_interval_s: Young's interval, sqrt(2 C M).
        daly_interval_s: Daly's higher-order interval (the one to use).
        lost_fraction: expected fraction of time lost at Daly's interval (saves, redone
            work and restarts).
        lost_fraction_young: the same at Young's interval.
    """

    cost_s: float
    mtbf_s: float
    restart_s: float
    young_interval_s: float
    daly_interval_s: float
    lost_fraction: float
    lost_fraction_young: float


def plan(cost: float, mtbf: float, restart: float = 0.0) -> Plan:
    """The checkpoint interval that maximises goodput for a save costing `cost` seconds.

    Example:
        >>> p = plan(30.0, 8 * 3600.0)
        >>> round(p.young_interval_s)
        1315
    """
    young = young_interval(cost, mtbf)
    daly = daly_interval(cost, mtbf)
    return Plan(
        cost_s=cost,
        mtbf_s=mtbf,
        restart_s=restart,
        young_interval_s=young,
        daly_interval_s=daly,
        lost_fraction=lost_fraction(daly, cost, mtbf, restart),
        lost_fraction_young=lost_fraction(young, cost, mtbf, restart),
    )


def _check_positive(**values: float) -> None:
    for name, v in values.items():
        if not (isinstance(v, (int, float)) and math.isfinite(v) and v > 0):
            raise ValueError(f"{name} must be a positive number of seconds, got {v!r}")


# -- durations -------------------------------------------------------------------------

_UNITS = {
    "": 1.0,
    "ms": 1e-3,
    "s": 1.0,
    "sec": 1.0,
    "m": 60.0,
    "min": 60.0,
    "h": 3600.0,
    "hr": 3600.0,
    "d": 86400.0,
    "w": 7 * 86400.0,
}
_PART_RE = re.compile(r"([0-9]+(?:\.[0-9]*)?|\.[0-9]+)\s*([a-z]*)", re.ASCII)


def parse_duration(text: str) -> float:
    """Seconds in a duration such as ``30s``, ``5m``, ``8h``, ``1.5d``, ``1h30m``, ``250ms``
    or a bare number of seconds.

    Raises:
        ValueError: the text is not such a duration (the message says what is accepted).
    """
    s = text.strip().lower()
    pos, total = 0, 0.0
    while pos < len(s):
        m = _PART_RE.match(s, pos)
        if m is None or m.group(2) not in _UNITS or (m.group(2) == "" and (pos > 0 or m.end() != len(s))):
            break
        total += float(m.group(1)) * _UNITS[m.group(2)]
        pos = m.end()
        while pos < len(s) and s[pos] == " ":
            pos += 1
    else:
        if s:
            return total
    raise ValueError(f"cannot read {text!r} as a duration: use a number with a unit, e.g. 250ms, 30s, 5m, 8h, 1.5d")


def format_duration(seconds: float | None) -> str:
    """``850 us``, ``12.3 ms``, ``4.56 s``, ``12.5 min``, ``3.20 h``, ``2.1 d``; ``-`` for None."""
    if seconds is None:
        return "-"
    s = abs(seconds)
    sign = "-" if seconds < 0 else ""
    if s == 0:
        return "0 s"
    if s < 1e-3:
        return f"{sign}{s * 1e6:.0f} us"
    if s < 1:
        return f"{sign}{s * 1e3:.1f} ms"
    if s < 60:
        return f"{sign}{s:.2f} s"
    if s < 3600:
        return f"{sign}{s / 60:.1f} min"
    if s < 86400:
        return f"{sign}{s / 3600:.2f} h"
    return f"{sign}{s / 86400:.1f} d"


# -- the report ------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class RunSummary:
    """One run: a `Checkpointer` session, from its start to its close or its last record.

    Times are seconds. `compute_s` includes the redone work (`redo_s` says how much of it
    was repeated); `other_s` is wall time in none of the measured categories.
    """

    run: int
    session: str
    rank: int
    start_t: float
    end_t: float
    ended: str  # "closed", or "failed": no close record (killed, crashed, preempted)
    wall_s: float
    compute_s: float
    data_wait_s: float
    checkpoint_s: float
    restore_s: float
    redo_s: float | None
    redo_steps: int
    other_s: float
    gap_before_s: float | None  # since the previous run ended (None for the first run)
    after_failure: bool  # the previous run failed
    iterations: int
    saves: int
    stall_s: float  # summed save() stalls (part of checkpoint_s)
    mean_stall_s: float | None
    save_cost_s: float | None  # lost per save: stall + the loop's slowdown while it was written
    durable_s: dict[str, float]  # per tier, mean seconds from save() to durable there
    restored_step: int | None
    restored_tier: str | None  # the tier the restore read; None: no step, or a log older than tier 0
    furthest_step: int | None
    step_time_s: float | None
    errors: int
    data_wait_exceeds_checkpoint: bool

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass(frozen=True, slots=True)
class Totals:
    """Every run together; `wall_s` adds the gaps after failures to the runs' wall times.

    `bar` splits `wall_s` into `CATEGORIES` (the stacked bar): "compute" is useful compute
    (the redone part moved to "redo"), "data wait" likewise without the redone steps' waits.
    """

    runs: int
    failures: int
    wall_s: float
    compute_s: float
    useful_compute_s: float
    data_wait_s: float
    checkpoint_s: float
    restore_s: float
    redo_s: float
    gap_s: float
    other_s: float
    goodput: float  # useful compute / wall time
    saves: int
    mean_stall_s: float | None
    save_cost_s: float | None
    blocking_cost_s: float | None  # what a save would have stalled had it blocked until durable
    durable_s: dict[str, float]
    restores: dict[str, dict[str, float]]  # per tier read ("?": a log older than tier 0): count, mean_s
    data_wait_exceeds_checkpoint: bool
    bar: dict[str, float]

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass(frozen=True, slots=True)
class Report:
    """`tiercheck report`: per run and in total, plus one-line findings (`flags`)."""

    rank: int | None
    runs: tuple[RunSummary, ...]
    total: Totals
    flags: tuple[str, ...]
    ranks: tuple[int, ...] = ()
    skipped_records: int = 0
    skipped_files: tuple[str, ...] = ()  # "path: reason": files named like a log but not read
    _timeline: tuple[_Session, ...] = field(default=(), repr=False, compare=False)

    def to_dict(self) -> dict[str, Any]:
        return {
            "schema": SCHEMA_VERSION,
            "rank": self.rank,
            "ranks": list(self.ranks),
            "runs": [r.to_dict() for r in self.runs],
            "total": self.total.to_dict(),
            "flags": list(self.flags),
            "skipped_records": self.skipped_records,
            "skipped_files": list(self.skipped_files),
        }


@dataclass(slots=True)
class _Session:
    """Accumulates one session's records (internal)."""

    session: str
    rank: int
    start_t: float
    end_t: float
    clean: bool = False
    iterations: int = 0
    reached: int = 0  # iterations done as the newest heartbeat saw them (a run killed between flushes)
    beat: Mapping[str, Any] | None = None  # the newest heartbeat: its window, if no loop record covers it
    loop_end: float = -math.inf  # end of the newest loop window
    compute_s: float = 0.0
    data_wait_s: float = 0.0
    busy_iterations: int = 0
    busy_compute_s: float = 0.0
    busy_wait_s: float = 0.0
    stall_s: float = 0.0
    blocked_s: float = 0.0
    restore_s: float = 0.0
    restored: bool = False
    restored_step: int | None = None
    restored_tier: str | None = None
    # What the records say, kept in memory that does not grow with the log: only the
    # extremes of the anchors and save times are ever used, sums for the durable times, and
    # the timeline's windows and intervals are merged pairwise past `MAX_SPANS`.
    failed: set[tuple[object, object]] = field(default_factory=set)  # (step, tier) that failed
    failed_more: int = 0  # failures beyond `MAX_FAILED` distinct ones
    anchor_lo: tuple[int, int] | None = None  # (iterations done, step), least and greatest
    anchor_hi: tuple[int, int] | None = None
    save_count: int = 0
    save_lo: tuple[float, int] | None = None  # (t, step), earliest and latest
    save_hi: tuple[float, int] | None = None
    durable: dict[str, tuple[float, int]] = field(default_factory=dict)  # tier: (sum, count)
    windows: list[tuple[float, float, float, float]] = field(default_factory=list)  # t0, t1, compute, wait
    intervals: dict[str, list[tuple[float, float, float]]] = field(default_factory=dict)  # cat: t0, t1, seconds

    def saves(self) -> int:
        return self.save_count

    def anchor(self, step: int, it: int) -> None:
        a = (it, step)
        self.anchor_lo = a if self.anchor_lo is None else min(self.anchor_lo, a)
        self.anchor_hi = a if self.anchor_hi is None else max(self.anchor_hi, a)

    def saved(self, t: float, step: int) -> None:
        self.save_count += 1
        p = (t, step)
        self.save_lo = p if self.save_lo is None else min(self.save_lo, p)
        self.save_hi = p if self.save_hi is None else max(self.save_hi, p)

    def add_failed(self, key: tuple[object, object]) -> None:
        if len(self.failed) < MAX_FAILED or key in self.failed:
            self.failed.add(key)
        else:
            self.failed_more += 1

    def errors(self) -> int:
        return len(self.failed) + self.failed_more

    def add_window(self, w: tuple[float, float, float, float]) -> None:
        self.windows.append(w)
        if len(self.windows) > MAX_SPANS:
            self.halve()

    def add_interval(self, t0: float, t1: float, cat: str) -> None:
        spans = self.intervals.setdefault(cat, [])
        spans.append((t0, t1, t1 - t0))
        if len(spans) > MAX_SPANS:
            self.halve()

    def spans(self) -> int:
        return len(self.windows) + sum(len(v) for v in self.intervals.values())

    def halve(self) -> None:
        """The timeline at half the resolution: neighbouring spans merged, totals kept."""
        self.windows = _halve(sorted(self.windows), lambda a, b: (a[0], b[1], a[2] + b[2], a[3] + b[3]))
        for cat, spans in self.intervals.items():
            self.intervals[cat] = _halve(sorted(spans), lambda a, b: (a[0], max(a[1], b[1]), a[2] + b[2]))

    def ratio(self) -> float:
        """Steps per loop iteration, from the anchors (1 when they cannot tell)."""
        lo, hi = self.anchor_lo, self.anchor_hi
        if lo is not None and hi is not None and hi[0] > lo[0]:
            r = (hi[1] - lo[1]) / (hi[0] - lo[0])
            if r > 0:
                return r
        return 1.0

    def furthest_step(self) -> int | None:
        # A save made in the body of iteration i is anchored at i, even if the run died
        # before that iteration finished and was counted.
        hi = self.anchor_hi
        done = max(self.iterations, self.reached, hi[0] if hi is not None else 0)
        if done == 0:
            return None if hi is None else hi[1]
        it, step = hi if hi is not None else (0, -1)  # a fresh start: the first iteration makes step 0
        return step + round((done - it) * self.ratio())

    def step_time(self) -> float | None:
        if self.iterations > 0:
            return (self.compute_s + self.data_wait_s) / (self.iterations * self.ratio())
        lo, hi = self.save_lo, self.save_hi
        if self.save_count >= 2 and lo is not None and hi is not None and hi[1] > lo[1]:
            return (hi[0] - lo[0]) / (hi[1] - lo[1])
        return None

    def per_step(self) -> tuple[float, float]:
        """(compute, data wait) per step."""
        if self.iterations == 0:
            return (self.step_time() or 0.0, 0.0)
        n = self.iterations * self.ratio()
        return self.compute_s / n, self.data_wait_s / n

    def save_cost(self) -> float | None:
        """Stall per save plus the loop's slowdown while saves were in flight, per save."""
        n = self.saves()
        if n == 0:
            return None
        idle = self.iterations - self.busy_iterations
        excess = 0.0
        if idle > 0 and self.busy_iterations > 0:
            base = (self.compute_s - self.busy_compute_s + self.data_wait_s - self.busy_wait_s) / idle
            excess = max(0.0, self.busy_compute_s + self.busy_wait_s - self.busy_iterations * base)
        return (self.stall_s + excess) / n


MAX_SECONDS = 1e11  # a time (since the epoch, about year 5100) or a duration beyond this is no record's
MAX_INT = 2**63 - 1  # nor a step, count or rank beyond this
MAX_SPANS = 8192  # timeline spans (loop windows, stalls) kept in all runs together before merging pairs
MAX_FAILED = 65536  # distinct (step, tier) failures kept per run; more are only counted
MAX_UNPLACED = 4096  # records held until their session's start arrives (a list in any order)

_T = TypeVar("_T")


def _halve(spans: list[_T], merge: Callable[[_T, _T], _T]) -> list[_T]:
    """Neighbours merged pairwise: half as many spans, the same totals."""
    out = [merge(spans[i], spans[i + 1]) for i in range(0, len(spans) - 1, 2)]
    if len(spans) % 2:
        out.append(spans[-1])
    return out


def _num(v: object) -> float | None:
    """A time or duration in seconds: a finite, non-negative number below `MAX_SECONDS`."""
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        return None
    if isinstance(v, int) and not 0 <= v <= MAX_SECONDS:  # before float(): a huge int overflows it
        return None
    x = float(v)
    return x if 0.0 <= x <= MAX_SECONDS else None  # NaN fails both


def _int(v: object) -> int | None:
    """A step, count or rank: an int (not a bool) in [0, 2**63)."""
    return v if type(v) is int and 0 <= v <= MAX_INT else None


def _tier_name(v: object) -> bool:
    """Whether `v` is a tier's name as a record holds it: a short plain word."""
    return isinstance(v, str) and _TIER_RE.fullmatch(v) is not None


_TIER_RE = re.compile(r"[a-z][a-z0-9_-]{0,31}", re.ASCII)


def _opt_step(v: object) -> tuple[bool, int | None]:
    """(valid, step) for a field that holds a step or None."""
    return (True, None) if v is None else (_int(v) is not None, _int(v))


def _apply(s: _Session, r: Mapping[str, Any]) -> bool:
    """Fold one record into its session; False if the record is malformed."""
    kind = r.get("kind")
    t = _num(r.get("t"))
    if t is None:
        return False
    s.end_t = max(s.end_t, t)
    if kind == "loop" or kind == "beat-window":
        return _apply_window(s, r, t)
    elif kind == "save":
        step, it, stall = _int(r.get("step")), _int(r.get("iter")), _num(r.get("stall_s"))
        if step is None or it is None or stall is None:
            return False
        s.stall_s += stall
        s.anchor(step, it)
        s.saved(t, step)
        s.add_interval(t, t + stall, "checkpoint")
    elif kind == "durable":
        tiers, errors = r.get("tier_s"), r.get("errors")
        ok, step = _opt_step(r.get("step"))
        if not isinstance(tiers, Mapping) or not ok or not (errors is None or isinstance(errors, Mapping)):
            return False
        for name, v in tiers.items():
            if (x := _num(v)) is not None:
                total, n = s.durable.get(str(name), (0.0, 0))
                s.durable[str(name)] = (total + x, n + 1)
        for k in errors or ():
            s.add_failed((step, str(k)))
    elif kind == "restore":
        dur, it = _num(r.get("dur_s")), _int(r.get("iter"))
        ok, step = _opt_step(r.get("step"))
        tier = r.get("tier")
        if dur is None or it is None or not ok or not (tier is None or _tier_name(tier)):
            return False
        s.restore_s += dur
        s.restored = True
        s.restored_step = step
        s.restored_tier = tier if step is not None else None
        if step is not None:
            s.anchor(step, it)
        s.add_interval(t, t + dur, "restore")
    elif kind in ("wait", "drain"):
        dur = _num(r.get("dur_s"))
        if dur is None:
            return False
        s.blocked_s += dur
        s.add_interval(t, t + dur, "checkpoint")
    elif kind == "error":
        ok, step = _opt_step(r.get("step"))
        tier = r.get("tier")
        if not ok or not (tier is None or isinstance(tier, str)):
            return False
        s.add_failed((step, tier))
    elif kind == "heartbeat":
        it = _int(r.get("iter"))
        if it is None:
            return False
        s.reached = max(s.reached, it)
        if s.beat is None or t >= (_num(s.beat.get("t")) or 0.0):
            s.beat = r
    elif kind == "close":
        s.clean = True
        dur = _num(r.get("dur_s"))
        if dur is not None:
            s.blocked_s += dur
            s.add_interval(t, t + dur, "checkpoint")
            s.end_t = max(s.end_t, t + dur)
    elif kind != "start":
        return True  # a kind from a newer version: ignored, not malformed
    return True


def _apply_window(s: _Session, r: Mapping[str, Any], t: float) -> bool:
    """Fold a window of the training loop's timings ending at `t` (a ``loop`` record, or the
    ``beat-window`` a heartbeat carries); False if it is malformed."""
    t0 = _num(r.get("t0"))
    vals = [_num(r.get(k)) for k in ("wait_s", "compute_s", "busy_wait_s", "busy_compute_s")]
    iters, busy, it = _int(r.get("iters")), _int(r.get("busy_iters")), _int(r.get("iter"))
    if t0 is None or None in vals or iters is None or busy is None or it is None:
        return False
    wait, comp, bwait, bcomp = (v or 0.0 for v in vals)
    s.iterations = max(s.iterations, it)
    s.data_wait_s += wait
    s.compute_s += comp
    s.busy_iterations += busy
    s.busy_wait_s += bwait
    s.busy_compute_s += bcomp
    s.add_window((t0, t, comp, wait))
    s.loop_end = max(s.loop_end, t)
    return True


def _coarsen(sessions: Iterable[_Session]) -> None:
    """Keep the timeline within `MAX_SPANS` spans in all (memory that does not grow with the
    log): the runs with the most spans are drawn at half the resolution."""
    runs = list(sessions)
    total = sum(s.spans() for s in runs)
    while total > MAX_SPANS:
        s = max(runs, key=_Session.spans)
        before = s.spans()
        s.halve()
        if s.spans() == before:
            return
        total -= before - s.spans()


def _rank_of(r: object) -> int | None:
    """The rank of a record of this schema, None for one that is not."""
    if not isinstance(r, Mapping) or r.get("v") != SCHEMA_VERSION or not isinstance(r.get("session"), str):
        return None
    return _int(r.get("rank"))


def _sessions(records: Iterable[Mapping[str, Any]], rank: int | None) -> tuple[list[_Session], list[int], int]:
    """Group one rank's records by session, folded as they stream by (they are not kept),
    sessions in start order; also every rank seen and how many records were skipped as
    malformed. `rank` None: the lowest rank present, which takes the records in memory."""
    if rank is None:
        records = list(records)
        present = [rk for r in records if (rk := _rank_of(r)) is not None]
        rank = min(present) if present else None
    by_id: dict[str, _Session] = {}
    unplaced: dict[str, list[Mapping[str, Any]]] = {}  # records that came before their session's start
    held = 0
    ranks: set[int] = set()
    skipped = applied = 0
    for r in records:
        rk = _rank_of(r)
        if rk is None:
            skipped += 1
            continue
        ranks.add(rk)
        if rk != rank:
            continue
        sid = r["session"]
        s = by_id.get(sid)
        if s is not None:
            skipped += not _apply(s, r)
            applied += 1
            if applied % 4096 == 0:
                _coarsen(by_id.values())
            continue
        t = _num(r.get("t"))
        if r.get("kind") != "start" or t is None:
            if held < MAX_UNPLACED:  # its start may come later (a list in any order)
                unplaced.setdefault(sid, []).append(r)
                held += 1
            else:
                skipped += 1
            continue
        s = by_id[sid] = _Session(session=sid, rank=rk, start_t=t, end_t=t)
        early = unplaced.pop(sid, [])
        held -= len(early)
        skipped += sum(not _apply(s, e) for e in early)
    # Those whose start record is lost (a torn line) cannot be placed.
    skipped += held
    for s in by_id.values():
        # A heartbeat whose window began after the newest loop window ended holds the loop
        # timing a crash kept from being flushed.
        beat = s.beat
        if beat is not None and "iters" in beat and (_num(beat.get("t0")) or -math.inf) >= s.loop_end - 1e-6:
            _apply(s, {**beat, "kind": "beat-window"})
    return sorted(by_id.values(), key=lambda s: s.start_t), sorted(ranks), skipped


def summarise(records: Iterable[Mapping[str, Any]], rank: int | None = None) -> Report:
    """The report for one rank's records (default: the lowest rank present).

    Args:
        records: run-log records in any order (`runlog.read_records`); malformed ones
            (a line torn by a crash) are skipped and counted.
        rank: whose records to summarise.
    """
    sessions, ranks, skipped = _sessions(records, rank)
    runs: list[RunSummary] = []
    redo_parts: list[tuple[float, float]] = []  # per run: redone (compute, data wait)
    for i, s in enumerate(sessions):
        prev = sessions[i - 1] if i > 0 else None
        redo_steps, redo_s, gap = 0, None, None
        rc = rw = 0.0
        if prev is not None:
            gap = max(0.0, s.start_t - prev.end_t)
            furthest = prev.furthest_step()
            if s.restored and furthest is not None:
                base = -1 if s.restored_step is None else s.restored_step
                redo_steps = max(0, furthest - base)
                step_time = prev.step_time()
                if step_time is not None:
                    redo_s = redo_steps * step_time
                    pc, pw = prev.per_step()
                    if pc + pw > 0:
                        rc, rw = redo_s * pc / (pc + pw), redo_s * pw / (pc + pw)
            elif not s.restored:
                redo_s = 0.0
        redo_parts.append((rc, rw))
        wall = max(0.0, s.end_t - s.start_t)
        checkpoint = s.stall_s + s.blocked_s
        measured = s.compute_s + s.data_wait_s + checkpoint + s.restore_s
        ckpt_cost = checkpoint + s.restore_s + (redo_s or 0.0)
        runs.append(
            RunSummary(
                run=i + 1,
                session=s.session,
                rank=s.rank,
                start_t=s.start_t,
                end_t=s.end_t,
                ended="closed" if s.clean else "failed",
                wall_s=wall,
                compute_s=s.compute_s,
                data_wait_s=s.data_wait_s,
                checkpoint_s=checkpoint,
                restore_s=s.restore_s,
                redo_s=redo_s,
                redo_steps=redo_steps,
                other_s=max(0.0, wall - measured),
                gap_before_s=gap,
                after_failure=prev is not None and not prev.clean,
                iterations=s.iterations,
                saves=s.saves(),
                stall_s=s.stall_s,
                mean_stall_s=s.stall_s / s.saves() if s.saves() else None,
                save_cost_s=s.save_cost(),
                durable_s={k: total / n for k, (total, n) in sorted(s.durable.items())},
                restored_step=s.restored_step,
                restored_tier=s.restored_tier,
                furthest_step=s.furthest_step(),
                step_time_s=s.step_time(),
                errors=s.errors(),
                data_wait_exceeds_checkpoint=s.data_wait_s > ckpt_cost and s.data_wait_s > 0,
            )
        )
    total = _totals(runs, sessions, redo_parts)
    return Report(
        rank=sessions[0].rank if sessions else rank,
        runs=tuple(runs),
        total=total,
        flags=tuple(_flags(runs, total)),
        ranks=tuple(ranks),
        skipped_records=skipped,
        _timeline=tuple(sessions),
    )


def _mean(values: Sequence[float]) -> float | None:
    return sum(values) / len(values) if values else None


def _totals(runs: list[RunSummary], sessions: list[_Session], redo_parts: list[tuple[float, float]]) -> Totals:
    gap = sum(r.gap_before_s or 0.0 for r in runs if r.after_failure)
    wall = sum(r.wall_s for r in runs) + gap
    compute = sum(r.compute_s for r in runs)
    wait = sum(r.data_wait_s for r in runs)
    checkpoint = sum(r.checkpoint_s for r in runs)
    restore = sum(r.restore_s for r in runs)
    redo = sum(r.redo_s or 0.0 for r in runs)
    redo_compute = sum(c for c, _ in redo_parts)
    redo_wait = sum(w for _, w in redo_parts)
    useful = max(0.0, compute - redo_compute)
    saves = sum(r.saves for r in runs)
    durable: dict[str, tuple[float, int]] = {}
    for s in sessions:
        for k, (x, n) in s.durable.items():
            total, count = durable.get(k, (0.0, 0))
            durable[k] = (total + x, count + n)
    durable_mean = {k: total / n for k, (total, n) in sorted(durable.items())}
    restores: dict[str, dict[str, float]] = {}
    for r in runs:
        if r.restored_step is not None:
            t = restores.setdefault(r.restored_tier or "?", {"count": 0, "mean_s": 0.0})
            t["mean_s"] = (t["mean_s"] * t["count"] + r.restore_s) / (t["count"] + 1)
            t["count"] += 1
    first_tier = "local" if "local" in durable_mean else next(iter(durable_mean), None)
    costs = [(r.save_cost_s or 0.0) * r.saves for r in runs if r.saves]
    bar = {
        "compute": useful,
        "data wait": max(0.0, wait - redo_wait),
        "checkpoint": checkpoint,
        "restore": restore,
        "redo": redo,
        "gap": gap,
    }
    bar["other"] = max(0.0, wall - sum(bar.values()))
    ckpt_cost = checkpoint + restore + redo
    return Totals(
        runs=len(runs),
        failures=sum(1 for r in runs if r.ended == "failed"),
        wall_s=wall,
        compute_s=compute,
        useful_compute_s=useful,
        data_wait_s=wait,
        checkpoint_s=checkpoint,
        restore_s=restore,
        redo_s=redo,
        gap_s=gap,
        other_s=bar["other"],
        goodput=useful / wall if wall > 0 else 0.0,
        saves=saves,
        mean_stall_s=sum(r.stall_s for r in runs) / saves if saves else None,
        save_cost_s=sum(costs) / saves if saves else None,
        blocking_cost_s=durable_mean.get(first_tier) if first_tier is not None else None,
        durable_s=durable_mean,
        restores=dict(sorted(restores.items())),
        data_wait_exceeds_checkpoint=wait > ckpt_cost and wait > 0,
        bar=bar,
    )


def _flags(runs: list[RunSummary], total: Totals) -> list[str]:
    flags: list[str] = []
    slow = [r.run for r in runs if r.data_wait_exceeds_checkpoint]
    if total.data_wait_exceeds_checkpoint or slow:
        where = f"runs {', '.join(map(str, slow))}" if len(slow) > 1 else f"run {slow[0]}" if slow else "in total"
        share = total.data_wait_s / total.wall_s if total.wall_s > 0 else 0.0
        flags.append(
            f"data wait ({format_duration(total.data_wait_s)}, {share:.0%} of wall time) exceeds the checkpoint "
            f"cost ({format_duration(total.checkpoint_s + total.restore_s + total.redo_s)}: stall + restore + "
            f"redo) in {where}: the input pipeline, not checkpointing, is the larger loss"
        )
    no_loop = [r.run for r in runs if r.iterations == 0 and r.saves > 0]
    if no_loop:
        flags.append(
            "no loop timing in run(s) " + ", ".join(map(str, no_loop)) + ": wrap the data source "
            "(`for batch in ckpt.timed(loader)`) to measure compute, data wait and redone work"
        )
    return flags


# -- the timeline ----------------------------------------------------------------------


def utilisation(report: Report, bins: int = 400) -> tuple[list[float], dict[str, list[float]]]:
    """The timeline as fractions of each time bin per category (the vendor's GPU-utilisation
    chart, split by what the time went to instead): (bin edges in seconds since the first
    run started, {category: fraction per bin}). Fractions of a bin sum to 1."""
    sessions = list(report._timeline)
    if not sessions or bins < 1:
        return [], {c: [] for c in CATEGORIES}
    origin = sessions[0].start_t
    end = max(s.end_t for s in sessions)
    span = max(end - origin, 1e-9)
    width = span / bins
    edges = [i * width for i in range(bins + 1)]
    acc = {c: [0.0] * bins for c in CATEGORIES}

    def spread(t0: float, t1: float, seconds: float, cat: str) -> None:
        """Add `seconds` of `cat`, spread evenly over [t0, t1] (seconds since origin)."""
        if seconds <= 0:
            return
        if t1 <= t0:
            t1 = t0 + seconds
        density = seconds / (t1 - t0)
        first = max(0, min(bins - 1, int(t0 / width)))
        last = max(0, min(bins - 1, int(t1 / width)))
        for b in range(first, last + 1):
            lo, hi = max(t0, b * width), min(t1, (b + 1) * width)
            if hi > lo:
                acc[cat][b] += density * (hi - lo)

    runs = {r.session: r for r in report.runs}
    for i, s in enumerate(sessions):
        run = runs[s.session]
        redo_left = run.redo_s or 0.0
        for t0, t1, comp, wait in sorted(s.windows):
            a, b = t0 - origin, t1 - origin
            work = comp + wait
            if work <= 0:
                continue
            # The run's first steps are the redone ones: they take the front of the window.
            moved = min(redo_left, work)
            redo_left -= moved
            split = a + (b - a) * moved / work
            spread(a, split, moved, "redo")
            spread(split, b, wait * (1 - moved / work), "data wait")
            spread(split, b, comp * (1 - moved / work), "compute")
        for cat, spans in s.intervals.items():
            for t0, t1, seconds in spans:
                spread(t0 - origin, t1 - origin, seconds, cat)
        if i > 0 and run.after_failure:
            prev = sessions[i - 1]
            spread(prev.end_t - origin, s.start_t - origin, max(0.0, s.start_t - prev.end_t), "gap")
    # Time in a run (or a gap) that no category claims is "other"; between a clean close and
    # the next start nothing is drawn. A bin whose categories overfill it is scaled down.
    for b in range(bins):
        lo, hi = b * width, (b + 1) * width
        live = sum(max(0.0, min(hi, s.end_t - origin) - max(lo, s.start_t - origin)) for s in sessions)
        known = sum(acc[c][b] for c in CATEGORIES if c != "other")
        acc["other"][b] = max(0.0, min(width, live + acc["gap"][b]) - known)
        scale = 1.0 / max(width, known + acc["other"][b])
        for c in CATEGORIES:
            acc[c][b] *= scale
    return edges, acc
