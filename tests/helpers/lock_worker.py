"""A writer process for `tests/tiers/test_writer_lock.py`: ``python tests/helpers/lock_worker.py MODE DIR``.

Modes (each prints its progress, one line at a time, flushed):

* ``slow-save``: commit step 1 (small), then save step 2 (12 MiB) at 4 MiB/s; prints
  ``committed 1``, then ``writing 2`` once step 2's temp directory exists, then
  ``committed 2`` or ``error <TYPE>: <message>``.
* ``hold``: become the writer of DIR (``prepare``), print ``holding``, sleep until killed.
* ``hold-fork``: as ``hold``, but once it holds the lock it forks a child that sleeps on
  (a data-loader worker outliving its trainer); prints ``child <PID>`` before ``holding``.
"""

from __future__ import annotations

import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

import torch

import tiercheck
from tiercheck.format import naming


def say(line: str) -> None:
    print(line, flush=True)


def slow_save(root: str) -> None:
    ckpt = tiercheck.Checkpointer(local=root, keep_local=None, local_write_rate=4 << 20, direct_io=False)
    ckpt.save(1, {"x": torch.full((1024,), 1.0)}).wait()
    say("committed 1")
    handle = ckpt.save(2, {"x": torch.full((3 << 20,), 2.0)})  # 12 MiB: about 3 s to write
    while not any(n.startswith(naming.TMP_PREFIX) for n in os.listdir(root)):
        time.sleep(0.005)
    say("writing 2")
    try:
        handle.wait()
        ckpt.close()
    except tiercheck.TiercheckError as exc:
        say(f"error {type(exc).__name__}: {exc}")
        return
    say("committed 2")


def hold(root: str, fork: bool) -> None:
    ckpt = tiercheck.Checkpointer(local=root)
    ckpt.prepare({"x": torch.zeros(16)})
    if fork:  # the child (say, a data-loader worker) outlives its parent, sleeping
        pid = os.fork()
        if pid == 0:
            time.sleep(600)
            os._exit(0)
        say(f"child {pid}")
    say("holding")
    time.sleep(600)


def main() -> None:
    mode, root = sys.argv[1], sys.argv[2]
    if mode == "slow-save":
        slow_save(root)
    elif mode in ("hold", "hold-fork"):
        hold(root, fork=mode == "hold-fork")
    else:
        raise SystemExit(f"unknown mode {mode!r}")


if __name__ == "__main__":
    main()
