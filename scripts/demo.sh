#!/usr/bin/env bash
# Sets everything up and runs the demo: an S3 server on 127.0.0.1, training with tiers 0, 1
# and 2, SIGKILL mid-run and resume from shared memory (tier 0), SIGKILL again, the node's
# tier 1 and memory wiped, resume on a new node from the bucket.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
PATH="$PWD/.venv/bin:$PATH" bash examples/run_demo.sh
