"""Crash-test worker: saves a deterministic state, step after step, until it is killed.

The state saved as step N is a pure function of N (`make_state`), so whoever inspects
the directory afterwards knows the exact bytes every committed step must hold.

Modes::

    python crash_worker.py run DIR [MAX_STEPS]
        Open a Checkpointer on DIR (keep_local=3), restore the newest step if any (and
        check it bit-exact against `make_state`), then save latest+1, latest+2, ...,
        printing ``committed N`` after each ``handle.wait()`` returns.

    python crash_worker.py zygote
        Import torch and tiercheck once, then serve requests read from stdin, one a line,
        so that a crash campaign does not pay the interpreter start-up per kill:
          ``run DIR OUTFILE MAX_STEPS`` fork a child running ``run`` with its stdout and
            stderr sent to OUTFILE; answer ``pid PID``.
          ``reap PID`` wait for that child to end; answer ``reaped PID STATUS``.
        The zygote never runs a torch operation before forking, so no OpenMP or
        intra-op thread pool exists that a forked child could inherit in a bad state.

Lines the ``run`` mode prints: ``ready`` (imports done, before the Checkpointer
starts), ``resumed N`` (restored step N and it matched), ``torn N <why>`` (restored
step N did not match: exit status 3), ``committed N``, ``done``.
"""

from __future__ import annotations

import math
import os
import struct
import sys
from typing import Any

import numpy as np
import torch

import tiercheck

KEEP_LOCAL = 3


def make_state(step: int) -> dict[Any, Any]:
    """The state saved as `step`: about 3.5 MB, every value a pure function of `step`."""
    g = torch.Generator().manual_seed(1_000_003 * step + 17)
    w = torch.randn(512, 512, generator=g)
    rng = np.random.default_rng(step)
    return {
        "model": {
            "w": w,
            "tied": w,  # shares storage with "w": written once, restored into both
            "b": torch.randn(512, generator=g).to(torch.bfloat16),
            "emb": torch.randn(256, 1024, generator=g).to(torch.bfloat16),
            "mask": torch.rand(1000, generator=g) > 0.5,
            "empty": torch.empty(0, 3),
        },
        "optimizer": {
            "state": {
                0: {
                    "exp_avg": torch.randn(512, 512, generator=g),
                    "step": torch.tensor(float(step)),
                },
                "0": "a str key beside the int key 0",
            },
            "param_groups": [{"lr": 1e-3 * (step + 1), "betas": (0.9, 0.999), "params": [0]}],
        },
        "counts": torch.randint(-(2**62), 2**62, (64, 64), generator=g, dtype=torch.int64),
        "np_f8": rng.standard_normal((256, 256)),
        "np_u4": rng.integers(0, 2**32, size=624, dtype=np.uint32),
        "np_scalar": np.int16(step % 30000),
        "step": step,
        "epoch": step // 10,
        "loss": 1.0 / (step + 1),
        "neg_zero": -0.0,
        "nan": math.nan,
        "big": 2**100 + step,
        "name": f"step {step}",
        "even": step % 2 == 0,
        "none": None,
        "blob": bytes((step + i) % 256 for i in range(37)),
        "rng_state": (3, tuple(range(step % 7, step % 7 + 5)), None),
    }


def mismatch(actual: object, expected: object, path: str = "state") -> str | None:
    """Where `actual` differs from `expected` bit for bit (types included), or None."""
    if type(actual) is not type(expected):
        return f"{path}: type {type(actual).__name__} != {type(expected).__name__}"
    if isinstance(expected, torch.Tensor):
        assert isinstance(actual, torch.Tensor)
        if actual.dtype != expected.dtype or actual.shape != expected.shape:
            return f"{path}: {actual.dtype}{tuple(actual.shape)} != {expected.dtype}{tuple(expected.shape)}"
        a = actual.detach().contiguous().reshape(-1).view(torch.uint8)
        e = expected.detach().contiguous().reshape(-1).view(torch.uint8)
        return None if torch.equal(a, e) else f"{path}: tensor bytes differ"
    if isinstance(expected, (np.ndarray, np.generic)):
        a_np, e_np = np.asarray(actual), np.asarray(expected)
        if a_np.dtype.str != e_np.dtype.str or a_np.shape != e_np.shape:
            return f"{path}: {a_np.dtype.str}{a_np.shape} != {e_np.dtype.str}{e_np.shape}"
        return None if a_np.tobytes() == e_np.tobytes() else f"{path}: array bytes differ"
    if isinstance(expected, dict):
        assert isinstance(actual, dict)
        if list(actual) != list(expected):
            return f"{path}: keys {list(actual)!r} != {list(expected)!r}"
        for k in expected:
            found = mismatch(actual[k], expected[k], f"{path}[{k!r}]")
            if found:
                return found
        return None
    if isinstance(expected, (list, tuple)):
        assert isinstance(actual, (list, tuple))
        if len(actual) != len(expected):
            return f"{path}: length {len(actual)} != {len(expected)}"
        for i, (a_item, e_item) in enumerate(zip(actual, expected, strict=True)):
            found = mismatch(a_item, e_item, f"{path}[{i}]")
            if found:
                return found
        return None
    if isinstance(expected, float):
        assert isinstance(actual, float)
        same = struct.pack("<d", actual) == struct.pack("<d", expected)
        return None if same else f"{path}: {actual!r} != {expected!r}"
    return None if actual == expected else f"{path}: {actual!r} != {expected!r}"


def say(line: str) -> None:
    # One write(2) per line, unbuffered: a kill can never leave half a line.
    os.write(1, (line + "\n").encode())


def run(directory: str, max_steps: int) -> int:
    say("ready")
    ckpt = tiercheck.Checkpointer(local=directory, keep_local=KEEP_LOCAL)
    template = make_state(0)
    restored = ckpt.restore(template)
    if restored is not None:
        why = mismatch(template, make_state(restored))
        if why is not None:
            say(f"torn {restored} {why}")
            return 3
        say(f"resumed {restored}")
    step = 0 if restored is None else restored + 1
    while step < max_steps:
        handle = ckpt.save(step, make_state(step))
        handle.wait()
        say(f"committed {step}")
        step += 1
    ckpt.close()
    say("done")
    return 0


def zygote() -> int:
    children: set[int] = set()
    while True:
        line = sys.stdin.readline()
        if not line:
            break
        words = line.split()
        if not words:
            continue
        if words[0] == "run":
            directory, out_path, max_steps = words[1], words[2], int(words[3])
            sys.stdout.flush()
            pid = os.fork()
            if pid == 0:
                status = 1
                try:
                    fd = os.open(out_path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
                    os.dup2(fd, 1)
                    os.dup2(fd, 2)
                    os.close(fd)
                    null = os.open(os.devnull, os.O_RDONLY)
                    os.dup2(null, 0)
                    os.close(null)
                    status = run(directory, max_steps)
                finally:
                    os._exit(status)
            children.add(pid)
            print(f"pid {pid}", flush=True)
        elif words[0] == "reap":
            pid = int(words[1])
            _, status = os.waitpid(pid, 0)
            children.discard(pid)
            print(f"reaped {pid} {status}", flush=True)
        else:
            print(f"error unknown request {line.strip()!r}", flush=True)
    for pid in children:
        os.waitpid(pid, 0)
    return 0


def main(argv: list[str]) -> int:
    if len(argv) >= 2 and argv[1] == "zygote":
        return zygote()
    if len(argv) >= 3 and argv[1] == "run":
        return run(argv[2], int(argv[3]) if len(argv) > 3 else 10**9)
    print(__doc__, file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main(sys.argv))
