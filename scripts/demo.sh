#!/usr/bin/env bash
# Sets everything up and runs the demo: train, checkpoint, SIGKILL mid-run, resume.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
PATH="$PWD/.venv/bin:$PATH" bash examples/run_demo.sh
