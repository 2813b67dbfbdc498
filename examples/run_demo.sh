#!/usr/bin/env bash
# The whole shape of tiercheck in one run: two tiers, a crash, a lost node, a resume.
#
# 1. Starts a real S3 server (SeaweedFS, `weed mini`) on 127.0.0.1 for this run
#    (examples/s3_server.py; the same binary the tests use).
# 2. Runs examples/train_demo.py uninterrupted: the reference losses.
# 3. "Node 1": the same run checkpointing to tier 1 (a local directory) and tier 2 (the
#    bucket). Per save it prints the stall, the time to durable on each tier, and the stall
#    torch.save of the same state would have cost. It is SIGKILLed mid-run (no cleanup,
#    background writes and uploads cut off wherever they are).
# 4. Node 1 is gone: its tier 1 is deleted. "Node 2" starts with an empty tier 1, resumes
#    from the bucket, and every loss after the resume point must equal the reference run.
#
# Uses `python` from the current environment (tiercheck, torch and s3fs importable, and the
# `weed` binary next to it or on PATH: bash scripts/setup.sh installs all of it).
# Environment knobs: STEPS (80), EVERY (5), SLEEP (0.05 s per step), HIDDEN (1024: a
# ~12 MiB state), KILL_AFTER (1.0 s after the first save is durable on both tiers),
# KEEP_TMP=1 to keep the temp dir.
set -euo pipefail

HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
DEMO="$HERE/train_demo.py"
STEPS="${STEPS:-80}"
EVERY="${EVERY:-5}"
SLEEP="${SLEEP:-0.05}"
HIDDEN="${HIDDEN:-1024}"
KILL_AFTER="${KILL_AFTER:-1.0}"

PY="$(command -v python || true)"
if [[ -z "$PY" ]]; then
    echo "run_demo.sh: no 'python' on PATH (activate the venv first, or run bash scripts/demo.sh)" >&2
    exit 2
fi
if ! python -c "import tiercheck, s3fs" > /dev/null; then
    echo "run_demo.sh: 'import tiercheck, s3fs' fails with $PY (run bash scripts/setup.sh)" >&2
    exit 2
fi

# Short path: SeaweedFS puts unix sockets in its work dir (108-byte limit).
TMP="$(mktemp -d /tmp/tiercheck-demo.XXXXXX)"
CHILD=""
SERVER=""
cleanup() {
    if [[ -n "$CHILD" ]] && kill -0 "$CHILD" 2>/dev/null; then
        kill -9 "$CHILD" 2>/dev/null || true
    fi
    if [[ -n "$SERVER" ]] && kill -0 "$SERVER" 2>/dev/null; then
        kill -TERM "$SERVER" 2>/dev/null || true
        wait "$SERVER" 2>/dev/null || true
    fi
    if [[ "${KEEP_TMP:-0}" == "1" ]]; then
        echo "(kept $TMP)"
    else
        rm -rf "$TMP"
    fi
}
trap cleanup EXIT

COMMON=(--steps "$STEPS" --every "$EVERY" --hidden "$HIDDEN")
loss_lines() { grep -E '^step [0-9]+ loss ' "$1" || true; }
fail_with_log() {
    echo "FAIL: $1" >&2
    tail -n 20 "$2" | sed 's/^/     | /' >&2
    exit 1
}

echo "== python: $PY"
echo "== 1/4 S3 server (SeaweedFS) on 127.0.0.1"
python "$HERE/s3_server.py" "$TMP/s3" > "$TMP/s3.json" 2> "$TMP/s3.log" &
SERVER=$!
for _ in $(seq 1 1800); do
    [[ -s "$TMP/s3.json" ]] && break
    kill -0 "$SERVER" 2>/dev/null || fail_with_log "the S3 server did not start" "$TMP/s3.log"
    sleep 0.05
done
[[ -s "$TMP/s3.json" ]] || fail_with_log "the S3 server did not answer within 90 s" "$TMP/s3.log"
field() { python -c "import json, sys; print(json.load(open(sys.argv[1]))[sys.argv[2]])" "$TMP/s3.json" "$1"; }
ENDPOINT="$(field endpoint_url)"
REMOTE="$(field url)/run"
AWS_ACCESS_KEY_ID="$(field key)"
AWS_SECRET_ACCESS_KEY="$(field secret)"
export AWS_ACCESS_KEY_ID AWS_SECRET_ACCESS_KEY
TIERS=(--remote "$REMOTE" --endpoint-url "$ENDPOINT")
echo "   $ENDPOINT, tier 2 = $REMOTE"

echo "== 2/4 reference run (uninterrupted, $STEPS steps, tier 1 only)"
python "$DEMO" --dir "$TMP/ref" --fresh "${COMMON[@]}" --sleep 0 --no-stats > "$TMP/ref.log"
loss_lines "$TMP/ref.log" > "$TMP/ref.loss"
ref_n=$(wc -l < "$TMP/ref.loss")
[[ "$ref_n" -eq "$STEPS" ]] || fail_with_log "reference run printed $ref_n loss lines, expected $STEPS" "$TMP/ref.log"
echo "   $ref_n loss lines, final: $(tail -n 1 "$TMP/ref.loss")"

echo "== 3/4 node 1: tier 1 $TMP/node1 + tier 2 (the bucket); SIGKILL mid-run"
python "$DEMO" --dir "$TMP/node1" --fresh "${COMMON[@]}" "${TIERS[@]}" --sleep "$SLEEP" > "$TMP/killed.log" 2>&1 &
CHILD=$!
# Wait until a save is durable on both tiers (python, torch and the S3 client take a while
# to start), then let it run on and kill it.
for _ in $(seq 1 1800); do
    grep -qE '^  save [0-9]+: .*tier 2' "$TMP/killed.log" && break
    kill -0 "$CHILD" 2>/dev/null || break
    sleep 0.05
done
sleep "$KILL_AFTER"
if ! kill -0 "$CHILD" 2>/dev/null; then
    rc=0
    wait "$CHILD" || rc=$?
    CHILD=""
    if [[ "$rc" -ne 0 ]]; then
        fail_with_log "node 1's run died on its own (exit status $rc) before it was killed" "$TMP/killed.log"
    fi
    fail_with_log "node 1's run finished before it could be killed; lower KILL_AFTER or raise STEPS" "$TMP/killed.log"
fi
kill -9 "$CHILD"
wait "$CHILD" 2>/dev/null || true
CHILD=""
killed_at=$(loss_lines "$TMP/killed.log" | tail -n 1 | awk '{print $2}')
killed_at="${killed_at:-0}"
echo "   per save, once durable on both tiers (stall = time save() blocked training):"
grep -E '^  save [0-9]+: ' "$TMP/killed.log" | sed 's/^  /     /'
echo "   killed (SIGKILL) after step $killed_at was printed"
if ! diff <(loss_lines "$TMP/killed.log") <(head -n "$killed_at" "$TMP/ref.loss") > "$TMP/killed.diff"; then
    echo "FAIL: node 1's losses already differ from the reference run:" >&2
    head -n 20 "$TMP/killed.diff" >&2
    exit 1
fi
python - "$TMP/node1" "$REMOTE" "$ENDPOINT" <<'EOF'
import sys

import tiercheck

local, remote, endpoint = sys.argv[1:]
with tiercheck.Checkpointer(local=local, remote=remote, storage_options={"endpoint_url": endpoint}) as ck:
    print(f"   committed after the crash: tier 1 {ck.steps('local')}, tier 2 (bucket) {ck.steps('remote')}")
EOF
rm -rf "$TMP/node1"
echo "   node 1 is gone: its tier 1 ($TMP/node1) is deleted"

echo "== 4/4 node 2: empty tier 1, resume from the bucket"
python "$DEMO" --dir "$TMP/node2" "${COMMON[@]}" "${TIERS[@]}" --sleep 0 --no-stats > "$TMP/resumed.log"
grep -E '^resumed from step|restored from tier 2' "$TMP/resumed.log" | sed 's/^ */   /'
resumed_from=$(sed -nE 's/^resumed from step ([0-9]+)$/\1/p' "$TMP/resumed.log" | head -n 1)
if [[ -z "$resumed_from" ]]; then
    fail_with_log "node 2 did not resume from a checkpoint" "$TMP/resumed.log"
fi
if ! grep -q 'restored from tier 2' "$TMP/resumed.log"; then
    fail_with_log "node 2 did not restore from the bucket" "$TMP/resumed.log"
fi
if (( resumed_from > killed_at )); then
    echo "FAIL: resumed from step $resumed_from, but node 1 only reached $killed_at" >&2
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
    echo "PASS: node 1 killed at step ~$killed_at and its disk lost; node 2 resumed from step" \
        "$resumed_from in the bucket; $got subsequent losses identical to the uninterrupted run"
    exit 0
fi
echo
echo "FAIL: node 1 killed at step ~$killed_at, node 2 resumed from step $resumed_from; resumed losses" \
    "differ from the uninterrupted run ($got lines, expected $expected). First differences:"
paste -d '|' "$TMP/ref_tail.loss" "$TMP/resumed.loss" \
    | awk -F '|' '$1 != $2 { printf "   reference: %-32s resumed: %s\n", $1, $2; if (++n == 5) exit }'
exit 1
