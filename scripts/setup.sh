#!/usr/bin/env bash
# Creates .venv (if missing) and installs tiercheck with its dev/test dependencies.
# torch is pinned here (not in the library's dependencies, which take a range) to the
# CPU build that this machine kind keeps on disk; a looser spec downloads a CUDA build.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  "$PY" -m venv .venv
fi
.venv/bin/python -m pip install -q --disable-pip-version-check -r requirements-dev.txt 2>&1 \
  | { grep -v -E "^WARNING: Location .* is ignored" || true; }
# Object-store clients and the real test servers (SeaweedFS, Azurite, a GCS emulator).
bash scripts/setup-servers.sh
