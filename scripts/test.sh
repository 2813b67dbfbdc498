#!/usr/bin/env bash
# Sets everything up from a fresh machine and runs the test suite, lint and types.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
.venv/bin/python -m ruff check tiercheck
.venv/bin/python -m mypy tiercheck
.venv/bin/python -m pytest -q "$@"
