#!/usr/bin/env bash
# The inner loop: every test that starts no process, needs no object-store server and is not
# marked slow (markers: tests/helpers/markers.py, tests/README.md). Under 2 minutes on a quiet 2-core
# machine; `bash scripts/test.sh` (CI) still runs everything. Extra arguments go to pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
exec .venv/bin/python -m pytest -q -m "not slow and not procs and not servers" "$@"
