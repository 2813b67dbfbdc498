#!/usr/bin/env bash
# Sets everything up from a fresh machine and runs the test suite, lint and types.
set -euo pipefail
cd "$(dirname "$0")/.."
# Keep compiled modules (git ignores __pycache__/): with PYTHONDONTWRITEBYTECODE set, as some
# machines set it, pytest rewrites every test module's asserts again at each run (~4 s of the
# inner loop) and every worker process compiles tiercheck from source.
unset PYTHONDONTWRITEBYTECODE
bash scripts/setup.sh
.venv/bin/python -m ruff check tiercheck
.venv/bin/python -m mypy tiercheck
.venv/bin/python -m pytest -q "$@"
