"""Coverage-guided fuzzing of tiercheck's read path with atheris (libFuzzer for Python).

Not collected by pytest (the name does not start with ``test_``); run it by hand::

    . .venv/bin/activate && pip install atheris
    python tests/helpers/fuzz_manifest_atheris.py -max_total_time=60 -timeout=10          # ~60 s, from
                                                                                   # seeds it makes
    python tests/helpers/fuzz_manifest_atheris.py -max_total_time=3600 -timeout=10 corpus/ # long run,
                                                                                   # corpus kept

Each input picks a target with its first byte:

0. `decode_manifest` on the raw bytes;
1. `decode_marker` on the raw bytes;
2. the raw bytes as step 2's COMMIT file, then ``tiercheck.load(root, step=2)``;
3. the raw bytes as step 2's manifest, the marker re-sealed over them (length and
   checksum match, so only validation can refuse them), then ``load``;
4. a valid manifest with a slice replaced by the input, re-sealed, then ``load``;
5. a valid marker with a slice replaced by the input, then ``load``.

Allowed outcomes: a value, `CheckpointCorruptedError` or `NoCheckpointError`. Anything else
(another exception type, a hang past ``-timeout``) is a crash: libFuzzer prints the
traceback and saves the input as ``crash-<sha1>`` (replay: ``python
tests/helpers/fuzz_manifest_atheris.py crash-<sha1>``). The address space is capped at its size at
start-up plus ``TIERCHECK_FUZZ_HEADROOM_MB`` (default 768), so a read that allocates far
more than its input fails loudly as MemoryError instead of passing unnoticed.
Only tiercheck's own modules are instrumented (torch and numpy are imported first).
Scratch files live in ``$TIERCHECK_FUZZ_WORKDIR`` (default ``/tmp/tiercheck-fuzz-<uid>``),
emptied at each start.
"""

from __future__ import annotations

import contextlib
import json
import os
import resource
import shutil
import sys
import tempfile
import warnings
from pathlib import Path

import atheris
import numpy as np
import torch

with atheris.instrument_imports(include=["tiercheck"]):
    import tiercheck
    from tiercheck.errors import CheckpointCorruptedError, NoCheckpointError
    from tiercheck.format import naming
    from tiercheck.format.checksum import checksum_function
    from tiercheck.format.manifest import decode_manifest, decode_marker

MANIFEST = naming.manifest_name(0, 1)
COMMIT = naming.COMMIT_NAME
SHARD = naming.shard_name(0, 1)


# libFuzzer ends the process without running atexit handlers, so the scratch directory is
# a fixed one, emptied at each start (one run at a time per directory).
WORK = Path(os.environ.get("TIERCHECK_FUZZ_WORKDIR") or Path(tempfile.gettempdir()) / f"tiercheck-fuzz-{os.getuid()}")
shutil.rmtree(WORK, ignore_errors=True)
WORK.mkdir(parents=True)


def _build() -> tuple[Path, bytes, bytes, bytes]:
    root = WORK / "ckpt"
    state = {
        "w": torch.arange(64, dtype=torch.float32).reshape(8, 8),
        "h": torch.ones(10, dtype=torch.bfloat16),
        "np": np.arange(5, dtype=np.uint32),
        "blob": b"xyz",
        "meta": {"step": 2, 0: (1.5, None, True), "big": 2**80, "nested": [[{"a": [1]}]]},
    }
    with tiercheck.Checkpointer(local=root, keep_local=None) as ckpt:
        ckpt.save(1, state).wait()
        ckpt.save(2, state).wait()
    d = root / naming.step_dir_name(2)
    return root, (d / MANIFEST).read_bytes(), (d / COMMIT).read_bytes(), (d / SHARD).read_bytes()


ROOT, VALID_MANIFEST, VALID_MARKER, VALID_SHARD = _build()
STEP_DIR = ROOT / naming.step_dir_name(2)
ALGO = json.loads(VALID_MARKER)["checksum_algorithm"]


def _reset() -> None:
    for name, data in ((MANIFEST, VALID_MANIFEST), (COMMIT, VALID_MARKER), (SHARD, VALID_SHARD)):
        (STEP_DIR / name).write_bytes(data)


def _seal(manifest: bytes) -> None:
    (STEP_DIR / MANIFEST).write_bytes(manifest)
    marker = json.loads(VALID_MARKER)
    marker["manifests"][0]["length"] = len(manifest)
    marker["manifests"][0]["checksum"] = checksum_function(ALGO)(manifest)
    (STEP_DIR / COMMIT).write_bytes(json.dumps(marker).encode())


def _splice(base: bytes, fdp: atheris.FuzzedDataProvider) -> bytes:
    start = fdp.ConsumeIntInRange(0, len(base))
    end = fdp.ConsumeIntInRange(start, len(base))
    return base[:start] + fdp.ConsumeBytes(fdp.remaining_bytes()) + base[end:]


def _load() -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with contextlib.suppress(CheckpointCorruptedError, NoCheckpointError):
            tiercheck.load(ROOT, step=2)


def test_one_input(data: bytes) -> None:
    if not data:
        return
    mode, rest = data[0] % 6, data[1:]
    if mode == 0:
        with contextlib.suppress(CheckpointCorruptedError):
            decode_manifest(rest, "fuzz")
        return
    if mode == 1:
        with contextlib.suppress(CheckpointCorruptedError):
            decode_marker(rest, "fuzz")
        return
    _reset()
    if mode == 2:
        (STEP_DIR / COMMIT).write_bytes(rest)
    elif mode == 3:
        _seal(rest)
    elif mode == 4:
        _seal(_splice(VALID_MANIFEST, atheris.FuzzedDataProvider(rest)))
    else:
        (STEP_DIR / COMMIT).write_bytes(_splice(VALID_MARKER, atheris.FuzzedDataProvider(rest)))
    _load()


def _cap_address_space() -> None:
    headroom = int(os.environ.get("TIERCHECK_FUZZ_HEADROOM_MB", "768")) << 20
    with open("/proc/self/status") as f:
        vm = next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmSize:"))
    resource.setrlimit(resource.RLIMIT_AS, (vm + headroom, resource.getrlimit(resource.RLIMIT_AS)[1]))


def _with_seed_corpus(argv: list[str]) -> list[str]:
    """Without a corpus directory, start from a fresh one seeded with the valid documents
    (one seed per mode), so the fuzzer begins past the JSON syntax."""
    args = list(argv)
    if not any(not a.startswith("-") for a in args[1:]):
        seeds = WORK / "seeds"
        seeds.mkdir()
        docs = [VALID_MANIFEST, VALID_MARKER, VALID_MARKER, VALID_MANIFEST, b"\x00" * 8, b"\x00" * 8]
        for mode, doc in enumerate(docs):
            (seeds / f"seed-{mode}").write_bytes(bytes([mode]) + doc)
        args.append(str(seeds))
    if not any(a.startswith("-max_len=") for a in args):
        args.append("-max_len=8192")
    return args


def main() -> None:
    _cap_address_space()
    atheris.Setup(_with_seed_corpus(sys.argv), test_one_input)
    atheris.Fuzz()


if __name__ == "__main__":
    main()
