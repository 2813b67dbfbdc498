#!/usr/bin/env bash
# The inner loop: every test that starts no process, needs no object-store server and is not
# marked slow (markers: tests/helpers/markers.py, tests/README.md), on one pytest-xdist worker
# a CPU up to 4 (TIERCHECK_TEST_WORKERS overrides; 0 runs in this process). Under 2 minutes on a
# quiet 2-core machine; `bash scripts/test.sh` (CI) still runs everything, in one process.
# Extra arguments go to pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
# Keep compiled modules (git ignores __pycache__/): with PYTHONDONTWRITEBYTECODE set, as some
# machines set it, pytest rewrites every test module's asserts again at each run (~4 s of the
# inner loop) and every worker process compiles tiercheck from source.
unset PYTHONDONTWRITEBYTECODE
cpus=$(nproc 2>/dev/null || echo 1)
workers=${TIERCHECK_TEST_WORKERS:-$(( cpus < 4 ? cpus : 4 ))}
exec .venv/bin/python -m pytest -q -n "$workers" -m "not slow and not procs and not servers" "$@"
