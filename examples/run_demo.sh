#!/usr/bin/env bash
# Kill-and-resume demo for tiercheck.
#
# 1. Runs examples/train_demo.py uninterrupted (the reference).
# 2. Runs it again on a fresh checkpoint dir, SIGKILLs it mid-run (kill -9: no cleanup,
#    no flushing, background writes cut off wherever they are).
# 3. Shows which checkpoints were committed, restarts the demo, and checks that every
#    loss line after the resume point is identical to the reference run.
#
# Uses `python` from the current environment (tiercheck must be importable).
# Environment knobs: STEPS (60), EVERY (5), SLEEP (0.05), KILL_AFTER (1.5 seconds after
# the first training step is printed), KEEP_TMP=1 to keep the temp dir.
set -euo pipefail

HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
DEMO="$HERE/train_demo.py"
STEPS="${STEPS:-60}"
EVERY="${EVERY:-5}"
SLEEP="${SLEEP:-0.05}"
KILL_AFTER="${KILL_AFTER:-1.5}"

PY="$(command -v python || true)"
if [[ -z "$PY" ]]; then
    echo "run_demo.sh: no 'python' on PATH (activate the venv first)" >&2
    exit 2
fi
if ! python -c "import tiercheck" > /dev/null; then
    echo "run_demo.sh: 'import tiercheck' fails with $PY (install the package first)" >&2
    exit 2
fi

TMP="$(mktemp -d "${TMPDIR:-/tmp}/tiercheck-demo.XXXXXX")"
CHILD=""
cleanup() {
    if [[ -n "$CHILD" ]] && kill -0 "$CHILD" 2>/dev/null; then
        kill -9 "$CHILD" 2>/dev/null || true
    fi
    if [[ "${KEEP_TMP:-0}" == "1" ]]; then
        echo "(kept $TMP)"
    else
        rm -rf "$TMP"
    fi
}
trap cleanup EXIT

COMMON=(--steps "$STEPS" --every "$EVERY" --sleep "$SLEEP")
loss_lines() { grep -E '^step [0-9]+ loss ' "$1" || true; }

echo "== python: $PY"
echo "== 1/3 reference run (uninterrupted, $STEPS steps)"
python "$DEMO" --dir "$TMP/ref_ckpt" --fresh "${COMMON[@]}" --sleep 0 > "$TMP/ref.log"
loss_lines "$TMP/ref.log" > "$TMP/ref.loss"
ref_n=$(wc -l < "$TMP/ref.loss")
if [[ "$ref_n" -ne "$STEPS" ]]; then
    echo "FAIL: reference run printed $ref_n loss lines, expected $STEPS" >&2
    exit 1
fi
echo "   $ref_n loss lines, final: $(tail -n 1 "$TMP/ref.loss")"

echo "== 2/3 run on a fresh dir, SIGKILL ~${KILL_AFTER}s after training starts"
CKPT="$TMP/ckpt"
python "$DEMO" --dir "$CKPT" --fresh "${COMMON[@]}" > "$TMP/killed.log" 2>&1 &
CHILD=$!
# Wait for the first training step (python + torch startup time varies), then let it run.
for _ in $(seq 1 600); do
    grep -qE '^step [0-9]+ loss ' "$TMP/killed.log" && break
    kill -0 "$CHILD" 2>/dev/null || break
    sleep 0.05
done
sleep "$KILL_AFTER"
if ! kill -0 "$CHILD" 2>/dev/null; then
    rc=0
    wait "$CHILD" || rc=$?
    CHILD=""
    tail -n 20 "$TMP/killed.log" >&2
    if [[ "$rc" -ne 0 ]]; then
        echo "FAIL: the run died on its own (exit status $rc) before it was killed" >&2
    else
        echo "FAIL: the run finished before it could be killed; lower KILL_AFTER" >&2
    fi
    exit 1
fi
kill -9 "$CHILD"
wait "$CHILD" 2>/dev/null || true
CHILD=""
killed_at=$(loss_lines "$TMP/killed.log" | tail -n 1 | awk '{print $2}')
killed_at="${killed_at:-0}"
echo "   killed (SIGKILL) after step $killed_at was printed"
echo "   last lines before the kill:"
tail -n 4 "$TMP/killed.log" | sed 's/^/     | /'

# Every loss the killed run printed must already match the reference too.
if ! diff <(loss_lines "$TMP/killed.log") <(head -n "$killed_at" "$TMP/ref.loss") > "$TMP/killed.diff"; then
    echo "FAIL: the killed run's losses already differ from the reference run:" >&2
    head -n 20 "$TMP/killed.diff" >&2
    exit 1
fi

echo "   files on disk after the crash, and what tiercheck reports as committed:"
python - "$CKPT" <<'EOF'
import os
import sys

import tiercheck

d = sys.argv[1]
for root, _dirs, files in sorted(os.walk(d)):
    for f in sorted(files):
        p = os.path.join(root, f)
        print(f"     {os.path.relpath(p, d)}  ({os.path.getsize(p)} bytes)")
with tiercheck.Checkpointer(local=d, keep_local=3) as ck:
    print(f"     steps()={ck.steps()} latest_step()={ck.latest_step()}")
EOF

echo "== 3/3 restart (same dir, no --fresh)"
python "$DEMO" --dir "$CKPT" "${COMMON[@]}" --sleep 0 > "$TMP/resumed.log"
head -n 1 "$TMP/resumed.log" | sed 's/^/   /'
resumed_from=$(sed -nE 's/^resumed from step ([0-9]+)$/\1/p' "$TMP/resumed.log" | head -n 1)
if [[ -z "$resumed_from" ]]; then
    echo "FAIL: the restarted run did not resume from a checkpoint" >&2
    head -n 5 "$TMP/resumed.log" >&2
    exit 1
fi
if (( resumed_from > killed_at )); then
    echo "FAIL: resumed from step $resumed_from, but the killed run only reached $killed_at" >&2
    exit 1
fi
if (( resumed_from >= STEPS )); then
    echo "FAIL: resumed from the final step $resumed_from, so nothing was left to compare;" \
        "lower KILL_AFTER or raise STEPS" >&2
    exit 1
fi
if (( resumed_from % EVERY != 0 )); then
    echo "FAIL: resumed from step $resumed_from, which is not a checkpoint step" >&2
    exit 1
fi

loss_lines "$TMP/resumed.log" > "$TMP/resumed.loss"
tail -n +"$((resumed_from + 1))" "$TMP/ref.loss" > "$TMP/ref_tail.loss"
expected=$((STEPS - resumed_from))
got=$(wc -l < "$TMP/resumed.loss")
if diff "$TMP/ref_tail.loss" "$TMP/resumed.loss" > "$TMP/resumed.diff" && [[ "$got" -eq "$expected" ]]; then
    echo
    echo "PASS: killed at step ~$killed_at, resumed from step $resumed_from," \
        "$got subsequent losses identical to the uninterrupted run"
    exit 0
fi
echo
echo "FAIL: killed at step ~$killed_at, resumed from step $resumed_from; resumed losses differ" \
    "from the uninterrupted run ($got lines, expected $expected). First differences:"
paste -d '|' "$TMP/ref_tail.loss" "$TMP/resumed.loss" \
    | awk -F '|' '$1 != $2 { printf "   reference: %-32s resumed: %s\n", $1, $2; if (++n == 5) exit }'
exit 1
