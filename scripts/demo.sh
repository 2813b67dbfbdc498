#!/usr/bin/env bash
# Sets everything up and runs the demo: an S3 server on 127.0.0.1, training with both tiers,
# SIGKILL mid-run, the node's tier 1 wiped, resume on a new node from the bucket.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
PATH="$PWD/.venv/bin:$PATH" bash examples/run_demo.sh
