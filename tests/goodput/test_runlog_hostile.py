"""The run log against hostile input (issue 23, items 11-13): hostile lines, files that are
not regular files, other ranks' logs, and, on the writer side, links and FIFOs named like
its files (invariant 8).

The CLI runs in a subprocess wherever the defect was a hang (a FIFO) or a measured bound
(peak RSS, bytes read): a hang then fails the test at its timeout instead of stopping it.
"""

from __future__ import annotations

import contextlib
import io
import json
import logging
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

import tiercheck
from tiercheck.__main__ import main as tiercheck_main
from tiercheck.format import naming
from tiercheck.goodput.runlog import read_records
from tiercheck.goodput.summary import summarise

ROOT = Path(__file__).resolve().parents[2]
WORKER = Path(__file__).resolve().parents[1] / "helpers" / "goodput_worker.py"
ENV = {**os.environ, "PYTHONPATH": str(ROOT)}
HANG_TIMEOUT = 180  # seconds: far beyond a report or a short run on a busy machine; only a hang reaches it

A, B = "a" * 16, "b" * 16


def run_cli(*args: str) -> subprocess.CompletedProcess[str]:
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = tiercheck_main(list(args))
    return subprocess.CompletedProcess(["tiercheck", *args], code, out.getvalue(), err.getvalue())


def run_cli_subprocess(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "tiercheck", *args], env=ENV, capture_output=True, text=True, timeout=HANG_TIMEOUT
    )


def rec(kind: str, session: str, t: float, seq: int = 0, rank: int = 0, **fields: Any) -> dict[str, Any]:
    return {"v": 1, "kind": kind, "session": session, "rank": rank, "seq": seq, "t": t, **fields}


def loop(
    session: str, t0: float, t: float, it: int, iters: int, wait: float, comp: float, rank: int = 0
) -> dict[str, Any]:
    return rec("loop", session, t, rank=rank, t0=t0, iter=it, iters=iters, wait_s=wait, compute_s=comp,
               busy_iters=0, busy_wait_s=0.0, busy_compute_s=0.0)  # fmt: skip


def clean_records() -> list[dict[str, Any]]:
    """Run A: 100 steps of 1 s from t=1e9, killed; run B restores step 50 and closes."""
    t = 1.0e9
    return [
        rec("start", A, t + 10, 1),
        rec("save", A, t + 11, 2, step=0, iter=1, stall_s=1.0, bytes=10),
        rec("durable", A, t + 14, 3, step=0, tier_s={"local": 3.0}),
        loop(A, t + 10, t + 61, 50, 50, 15.0, 35.0),
        rec("save", A, t + 61, 4, step=50, iter=51, stall_s=1.0, bytes=10),
        loop(A, t + 61, t + 112, 100, 50, 15.0, 35.0),
        rec("start", B, t + 142, 1),
        rec("restore", B, t + 142, 2, dur_s=4.0, step=50, iter=0),
        loop(B, t + 146, t + 206, 60, 60, 18.0, 42.0),
        rec("close", B, t + 206, 3, dur_s=2.0),
    ]


def line(r: dict[str, Any]) -> bytes:
    return json.dumps(r, separators=(",", ":")).encode() + b"\n"


def write_log(root: Path, lines: list[bytes], name: str = naming.runlog_file_name(0)) -> Path:
    d = root / naming.RUNLOG_DIR
    d.mkdir(parents=True, exist_ok=True)
    (d / name).write_bytes(b"".join(lines))
    return d / name


def raw(session: str, kind: str, **fields: str) -> bytes:
    """A line with values written as given (JSON text no `json.dumps` of a float makes)."""
    head = f'{{"v":1,"kind":"{kind}","session":"{session}","seq":9'
    return (head + "".join(f',"{k}":{v}' for k, v in fields.items()) + "}\n").encode()


def hostile_lines() -> list[bytes]:
    """Lines no writer makes, each one record (or not even that) that must be skipped."""
    big = "9" * 400
    nested = "[" * 200_000 + "]" * 200_000
    save = {"rank": "0", "t": "1000000020.0", "step": "1", "iter": "2", "stall_s": "1.0", "bytes": "1"}
    window = {"rank": "0", "t": "1000000030.0", "t0": "1000000029.0", "iter": "40", "iters": "1", "wait_s": "0.0",
              "compute_s": "0.0", "busy_iters": "0", "busy_wait_s": "0.0", "busy_compute_s": "0.0"}  # fmt: skip
    return [
        raw(A, "save", **{**save, "t": big}),  # a 400-digit int: float() of it overflows
        raw(A, "save", **{**save, "step": big}),
        raw(A, "loop", **{**window, "iter": big}),
        raw(A, "save", **{**save, "rank": big}),
        raw(A, "loop", **{**window, "x": nested}),  # json recurses 200,000 deep
        nested.encode() + b"\n",
        line(rec("start", "c" * 16, 1e300, 1)),  # a start no clock gives: time.localtime() overflows
        line(loop(A, 1e9 + 20, 1e9 + 21, 30, 1, 0.0, 1e308)),  # two of these sum to inf
        line(loop(A, 1e9 + 21, 1e9 + 22, 31, 1, 0.0, 1e308)),
        raw(A, "loop", **{**window, "compute_s": "NaN"}),
        line(rec("save", A, 1e9 + 23, 9, step=7, iter=8, stall_s=-5.0, bytes=1)),  # a negative duration
        line(rec("error", A, 1e9 + 24, 9, step=[1, 2], tier={"x": 1}, message="m")),  # unhashable step and tier
        line(rec("durable", A, 1e9 + 25, 9, step=[3], tier_s={"local": 1.0}, errors={"remote": "x"})),
        line(rec("save", A, 1e9 + 26, 9, step=True, iter=8, stall_s=1.0, bytes=1)),  # a bool is no step
        b'{"v":1,"kind":"save","session":"' + b"\xff\xfe" * 8 + b'","rank":0}\n',  # not UTF-8
        b"[1, 2, 3]\n",
        b'"just a string"\n',
        b'{"v":1,"kind":"loop","message":"' + b"x" * (3 << 20) + b'"}\n',  # 3 MiB: longer than any record
    ]


def test_hostile_lines_are_skipped_and_counted(tmp_path: Path) -> None:
    clean, hostile = tmp_path / "clean", tmp_path / "hostile"
    good = [line(r) for r in clean_records()]
    write_log(clean, good)
    bad = hostile_lines()
    mixed = good[:4] + bad[:8] + good[4:7] + bad[8:] + good[7:]
    write_log(hostile, mixed)
    want = run_cli("report", str(clean), "--json")
    assert want.returncode == 0, want.stderr
    got = run_cli("report", str(hostile), "--json")
    assert got.returncode == 0, got.stderr
    w, g = json.loads(want.stdout), json.loads(got.stdout)
    assert (w["skipped_records"], g["skipped_records"]) == (0, len(bad))
    g["skipped_records"] = 0
    assert g == w  # every value exactly as without the hostile lines
    text = run_cli("report", str(hostile))
    assert text.returncode == 0, text.stderr
    assert f"skipped {len(bad)} unreadable record(s)" in text.stdout
    plan_want = run_cli("plan", str(clean), "--mtbf", "8h", "--json")
    plan_got = run_cli("plan", str(hostile), "--mtbf", "8h", "--json")
    assert plan_want.returncode == plan_got.returncode == 0, plan_got.stderr
    assert json.loads(plan_got.stdout) == json.loads(plan_want.stdout)
    records, unreadable = read_records(str(hostile))
    r = summarise(records)
    assert unreadable + r.skipped_records == len(bad) and len(r.runs) == 2


def test_summarise_rejects_values_out_of_range() -> None:
    """The pure API is handed records by other code too: the same bounds apply there."""
    records = [
        *clean_records(),
        rec("save", A, 1e9 + 20, 9, step=2**63, iter=2, stall_s=1.0, bytes=1),
        rec("save", A, 1e9 + 20, 9, step=1, iter=-1, stall_s=1.0, bytes=1),
        rec("save", A, 1e9 + 20, 9, step=1, iter=2, stall_s=float("inf"), bytes=1),
        rec("restore", B, 1e9 + 150, 9, dur_s=1e200, step=None, iter=0),
    ]
    r = summarise(records)
    assert r.skipped_records == 4
    assert r.to_dict()["runs"] == summarise(clean_records()).to_dict()["runs"]


# -- files that are not regular files -------------------------------------------------------


def test_fifo_and_links_named_like_logs_are_skipped_not_followed(tmp_path: Path) -> None:
    run = tmp_path / "run"
    write_log(run, [line(r) for r in clean_records()])
    d = run / naming.RUNLOG_DIR
    os.mkfifo(d / naming.runlog_part_name(0, "f" * 16, 0))  # a second rank-0 file: a FIFO
    os.mkfifo(d / naming.runlog_heartbeat_name(0))
    outside = tmp_path / "elsewhere.jsonl"  # a session that is not this run's
    outside.write_bytes(line(rec("start", "e" * 16, 1e9 + 500, 1)) + line(rec("close", "e" * 16, 1e9 + 600, 2)))
    os.symlink(outside, d / "rank-000000.jsonl")
    p = run_cli_subprocess("report", str(run), "--json")
    assert p.returncode == 0, p.stderr
    out = json.loads(p.stdout)
    assert [r["session"] for r in out["runs"]] == [A, B]
    assert out["skipped_records"] == 0
    skipped = out["skipped_files"]
    assert len(skipped) == 3
    assert sum("not a regular file" in s for s in skipped) == 2 and sum("symbolic link" in s for s in skipped) == 1
    text = run_cli_subprocess("plan", str(run), "--mtbf", "8h")
    assert text.returncode == 0, text.stderr
    # A rank whose only log is a FIFO: one line, exit 2, saying why.
    os.mkfifo(d / naming.runlog_file_name(1))
    one = run_cli_subprocess("report", str(run), "--rank", "1")
    assert one.returncode == 2 and len(one.stderr.splitlines()) == 1, one.stderr
    assert "rank 1" in one.stderr and "not a regular file" in one.stderr


def test_symlinked_runlog_directory_is_not_followed(tmp_path: Path) -> None:
    other = tmp_path / "other"
    write_log(other, [line(r) for r in clean_records()])
    run = tmp_path / "run"
    run.mkdir()
    os.symlink(other / naming.RUNLOG_DIR, run / naming.RUNLOG_DIR)
    p = run_cli("report", str(run))
    assert p.returncode == 2 and len(p.stderr.splitlines()) == 1
    assert "symbolic link" in p.stderr
    with pytest.raises(FileNotFoundError, match="symbolic link"):
        read_records(str(run))


# -- one rank's log, in bounded memory ----------------------------------------------------------

# Peak RSS of the command alone: the high-water mark (VmHWM) is reset once everything is
# imported (Linux: /proc/self/clear_refs), so the imports' own peak does not hide it.
PROBE = """
import gc, json, re, sys
from tiercheck.__main__ import main
def status():
    with open("/proc/self/status") as f:
        return {k: int(v) for k, v in re.findall(r"(Vm\\w+):\\s+(\\d+)", f.read())}
def rchar():
    with open("/proc/self/io") as f:
        return int(dict(ln.split(": ") for ln in f.read().splitlines())["rchar"])
gc.collect()
with open("/proc/self/clear_refs", "w") as f:
    f.write("5")
rss0, read0 = status()["VmRSS"], rchar()
code = main(sys.argv[1:])
print(json.dumps({"code": code, "growth_kib": status()["VmHWM"] - rss0, "read": rchar() - read0}), file=sys.stderr)
"""


def probe(*args: str) -> tuple[dict[str, Any], dict[str, Any]]:
    """`tiercheck ARGS --json` in a fresh interpreter: (its output, how much its peak RSS grew
    over the imported interpreter's, the bytes it read)."""
    p = subprocess.run(
        [sys.executable, "-c", PROBE, *args, "--json"], env=ENV, capture_output=True, text=True, timeout=HANG_TIMEOUT
    )
    assert p.returncode == 0, p.stderr
    stats = json.loads(p.stderr.strip().splitlines()[-1])
    assert stats["code"] == 0
    return json.loads(p.stdout), stats


def synthetic_log(mib: int, rank: int) -> bytes:
    """A rank's log as the writer writes it: sessions of loop records with a save every 10."""
    out: list[bytes] = []
    size, t, n = 0, 1.0e9, 0
    while size < mib << 20:
        sid = f"{n:016x}"
        recs = [rec("start", sid, t, 1, rank=rank, world_size=8, tiers=["local"], pid=1, host="h")]
        for i in range(2000):
            recs.append(loop(sid, t, t + 10, 10 * (i + 1), 10, 2.5, 7.5, rank=rank))
            if i % 10 == 0:
                recs.append(rec("save", sid, t + 10, i + 2, rank=rank, step=10 * i, iter=10 * i, stall_s=0.01,
                                bytes=1 << 30))  # fmt: skip
                recs.append(rec("durable", sid, t + 10, i + 3, rank=rank, step=10 * i, tier_s={"local": 2.0}))
            t += 10
        recs.append(rec("close", sid, t, 9999, rank=rank, dur_s=0.5))
        chunk = b"".join(line(r) for r in recs)
        out.append(chunk)
        size += len(chunk)
        t += 60
        n += 1
    return b"".join(out)


def test_report_one_rank_reads_only_its_log_in_bounded_memory(tmp_path: Path) -> None:
    """8 ranks x 16 MiB: `report --rank 0` reads rank 0's log only, line by line: its peak RSS
    does not grow with the other ranks' logs, nor with rank 0's (a 16 MiB one-line garbage
    record included), and the other ranks' files are not even looked at (one is a FIFO)."""
    mib = 16
    log0 = synthetic_log(mib, 0) + b"x" * (mib << 20) + b"\n"  # and one line as long as the log
    alone, crowd = tmp_path / "alone", tmp_path / "crowd"
    write_log(alone, [log0])
    write_log(crowd, [log0])
    for r in range(1, 8):
        if r == 5:
            os.mkfifo(crowd / naming.RUNLOG_DIR / naming.runlog_file_name(r))
        else:
            write_log(crowd, [synthetic_log(mib, r)], naming.runlog_file_name(r))
    out_alone, one = probe("report", str(alone), "--rank", "0")
    out_crowd, many = probe("report", str(crowd), "--rank", "0")
    assert out_crowd["runs"] == out_alone["runs"] and out_crowd["skipped_records"] == 1
    assert out_crowd["skipped_files"] == [] and out_crowd["ranks"] == list(range(8))
    log_kib = len(log0) >> 10
    # Bytes read: rank 0's log, once; the other ranks' 7 x 16 MiB not at all.
    assert len(log0) <= one["read"] < len(log0) + (1 << 20), one
    assert many["read"] - one["read"] < 1 << 20, (one, many)
    # Peak RSS: rank 0's 32 MiB log costs a fraction of it that does not grow with it (the read
    # buffer and the timeline's spans: about 4 MiB; 200 MiB before, all of it as records), the
    # other ranks nothing more (1.2 GiB before).
    assert one["growth_kib"] < log_kib // 4, (one, log_kib)
    assert many["growth_kib"] - one["growth_kib"] < log_kib // 16, (one, many)
    # The default rank reads rank 0 as well, and the JSON lists every rank's name.
    out_default, _ = probe("report", str(crowd))
    assert out_default["runs"] == out_alone["runs"]


# -- the writer: links, FIFOs and hard links named like its files (invariant 8) -------------------


def sleepy(n: int, wait: float) -> Iterator[int]:
    for i in range(n):
        time.sleep(wait)
        yield i


def train(root: Path, steps: int, every: int, interval: float = 0.0) -> None:
    state = {"w": torch.zeros(10)}
    with tiercheck.Checkpointer(local=root, keep_local=None, run_log_interval=interval) as ckpt:
        start = ckpt.restore(state)
        first = 0 if start is None else start + 1
        for i in ckpt.timed(sleepy(steps, 0.01)):
            step = first + i
            state["w"].fill_(step)
            if step % every == 0:
                ckpt.save(step, state)


def test_writer_never_writes_through_a_symlinked_runlog_directory(tmp_path: Path, caplog: Any) -> None:
    target = tmp_path / "users-own-dir"
    target.mkdir()
    (target / "notes.txt").write_bytes(b"mine")
    run = tmp_path / "run"
    run.mkdir()
    os.symlink(target, run / naming.RUNLOG_DIR)
    with caplog.at_level(logging.WARNING, logger="tiercheck"):
        train(run, 30, 10)
    assert sorted(os.listdir(target)) == ["notes.txt"] and (target / "notes.txt").read_bytes() == b"mine"
    warned = [r for r in caplog.records if "run log" in r.getMessage()]
    assert len(warned) == 1 and "symbolic link" in warned[0].getMessage()
    with tiercheck.Checkpointer(local=run, run_log_interval=None) as ckpt:
        assert ckpt.steps() == [0, 10, 20]


@pytest.mark.parametrize("which", ["log", "heartbeat"])
def test_writer_does_not_hang_on_a_fifo_named_like_its_file(tmp_path: Path, which: str) -> None:
    run = tmp_path / "run"
    d = run / naming.RUNLOG_DIR
    d.mkdir(parents=True)
    name = naming.runlog_file_name(0) if which == "log" else naming.runlog_heartbeat_name(0)
    os.mkfifo(d / name)
    out = tmp_path / "truth.json"
    # For the heartbeat: one save and no flush for 600 s, so that it is written once a second.
    every, interval, last = ("50", "0.2", 250.0) if which == "log" else ("1000", "600", 0.0)
    p = subprocess.run(
        [sys.executable, str(WORKER), str(run), str(out), "--steps", "300", "--wait", "0.005", "--compute", "0.005",
         "--every", every, "--interval", interval],
        env=ENV, capture_output=True, text=True, timeout=HANG_TIMEOUT,
    )  # fmt: skip
    assert p.returncode == 0, p.stderr
    assert "run log" in p.stderr and "not a regular file" in p.stderr  # warned once, training went on
    assert p.stderr.count("cannot write the run log") == 1
    assert (d / name).is_fifo()  # left as it was
    assert tiercheck.load(str(run))["w"][0].item() == last


def test_writer_breaks_hard_links_instead_of_writing_into_them(tmp_path: Path) -> None:
    """A run forked with hard links (`cp -al`, or `ln` of its log into keep/): the next
    session of one copy leaves the other copy's log and heartbeat as they were."""
    run = tmp_path / "run"
    train(run, 200, 1000, interval=600.0)  # one save, a long interval: the heartbeat is written once a second
    d = run / naming.RUNLOG_DIR
    keep = tmp_path / "keep"
    keep.mkdir()
    names = [naming.runlog_file_name(0), naming.runlog_heartbeat_name(0)]
    for n in names:
        assert (d / n).is_file()
        os.link(d / n, keep / n)
    before = {n: (keep / n).read_bytes() for n in names}
    train(run, 200, 1000, interval=600.0)
    assert {n: (keep / n).read_bytes() for n in names} == before
    assert all(os.stat(d / n).st_nlink == 1 and os.stat(keep / n).st_nlink == 1 for n in names)
    # The run keeps its history: the first session's records, then the second's.
    log = (d / names[0]).read_bytes()
    assert log.startswith(before[names[0]]) and len(log) > len(before[names[0]])
    r = summarise(read_records(str(run))[0])
    assert len(r.runs) == 2 and r.runs[1].restored_step == 0
    assert [n for n in os.listdir(d) if n.endswith(".tmp")] == []
