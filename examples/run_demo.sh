#!/usr/bin/env bash
# The whole shape of tiercheck in one run: three tiers, two crashes, a lost node, two resumes.
#
# 1. Starts a real S3 server (SeaweedFS, `weed mini`) on 127.0.0.1 for this run
#    (examples/s3_server.py; the same binary the tests use).
# 2. Runs examples/train_demo.py uninterrupted: the reference losses.
# 3. "Node 1": the same run checkpointing to tier 0 (shared memory: a directory of the
#    demo's own under /dev/shm, a fixed job id), tier 1 (a local directory) and tier 2 (the
#    bucket). Per save it prints the stall, the time to durable on each tier, and the stall
#    torch.save of the same state would have cost. It is SIGKILLed mid-run (no cleanup,
#    background writes and uploads cut off wherever they are).
# 4. The process restarts on node 1 with the same job id: it restores from tier 0 (the
#    dead process's shared memory, every byte verified) and prints the restore time; its
#    losses must equal the reference run's. It is SIGKILLed again mid-run.
# 5. Node 1 is gone: its tier 1 and its memory are deleted. "Node 2" starts with an empty
#    tier 0 and tier 1, resumes from the bucket, and every loss after the resume point must
#    equal the reference run.
#
# Uses `python` from the current environment (tiercheck, torch and s3fs importable, and the
# `weed` binary next to it or on PATH: bash scripts/setup.sh installs all of it).
# Environment knobs: STEPS (100), EVERY (5), SLEEP (0.05 s per step), HIDDEN (1024: a
# ~12 MiB state), KILL_AFTER (1.0 s after the first save is durable on all tiers),
# SHM_DIR (/dev/shm: where tier 0's directory goes), KEEP_TMP=1 to keep the temp dirs.
set -euo pipefail

HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
DEMO="$HERE/train_demo.py"
STEPS="${STEPS:-100}"
EVERY="${EVERY:-5}"
SLEEP="${SLEEP:-0.05}"
HIDDEN="${HIDDEN:-1024}"
KILL_AFTER="${KILL_AFTER:-1.0}"
SHM_DIR="${SHM_DIR:-/dev/shm}"
JOB_ID="tiercheck-demo"

PY="$(command -v python || true)"
if [[ -z "$PY" ]]; then
    echo "run_demo.sh: no 'python' on PATH (activate the venv first, or run bash scripts/demo.sh)" >&2
    exit 2
fi
if ! python -c "import tiercheck, s3fs" > /dev/null; then
    echo "run_demo.sh: 'import tiercheck, s3fs' fails with $PY (run bash scripts/setup.sh)" >&2
    exit 2
fi
if [[ ! -d "$SHM_DIR" ]]; then
    echo "run_demo.sh: no shared-memory directory $SHM_DIR for tier 0 (set SHM_DIR)" >&2
    exit 2
fi

# Short path: SeaweedFS puts unix sockets in its work dir (108-byte limit).
TMP="$(mktemp -d /tmp/tiercheck-demo.XXXXXX)"
# Tier 0 of the demo's two "nodes": directories of its own in shared memory, removed at the end.
SHM="$(mktemp -d "$SHM_DIR/tiercheck-demo.XXXXXX")"
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
        echo "(kept $TMP and $SHM)"
    else
        rm -rf "$TMP" "$SHM"
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
# same_as_reference LOG FROM: LOG's loss lines must be the reference run's from step FROM+1
# on; prints how many there are.
same_as_reference() {
    local n
    loss_lines "$1" > "$1.loss"
    n=$(wc -l < "$1.loss")
    if ! diff <(tail -n +"$(($2 + 1))" "$TMP/ref.loss" | head -n "$n") "$1.loss" > "$1.diff"; then
        echo "FAIL: the losses in $(basename "$1") differ from the uninterrupted run's:" >&2
        head -n 20 "$1.diff" >&2
        exit 1
    fi
    echo "$n"
}
# run_and_kill LOG ARGS...: start the training, wait until a save is durable on tier 2
# (python, torch and the S3 client take a while to start), let it run KILL_AFTER seconds
# more, SIGKILL it (no cleanup; background writes and uploads cut off wherever they are).
run_and_kill() {
    local log="$1" rc
    shift
    python "$DEMO" "$@" --sleep "$SLEEP" > "$log" 2>&1 &
    CHILD=$!
    for _ in $(seq 1 1800); do
        grep -qE '^  save [0-9]+: .*tier 2' "$log" && break
        kill -0 "$CHILD" 2>/dev/null || break
        sleep 0.05
    done
    sleep "$KILL_AFTER"
    if ! kill -0 "$CHILD" 2>/dev/null; then
        rc=0
        wait "$CHILD" || rc=$?
        CHILD=""
        if [[ "$rc" -ne 0 ]]; then
            fail_with_log "the run died on its own (exit status $rc) before it was killed" "$log"
        fi
        fail_with_log "the run finished before it could be killed; lower KILL_AFTER or raise STEPS" "$log"
    fi
    kill -9 "$CHILD"
    wait "$CHILD" 2>/dev/null || true
    CHILD=""
}
# last_loss_step LOG: the last step whose loss LOG printed (0 if none)
last_loss_step() {
    local s
    s=$(loss_lines "$1" | tail -n 1 | awk '{print $2}')
    echo "${s:-0}"
}
# check_resume LOG TIER_TEXT KILLED_AT: the step LOG resumed from, checked; prints it
check_resume() {
    local from
    from=$(sed -nE 's/^resumed from step ([0-9]+)$/\1/p' "$1" | head -n 1)
    [[ -n "$from" ]] || fail_with_log "the run did not resume from a checkpoint" "$1"
    grep -q "restored from $2" "$1" || fail_with_log "the run did not restore from $2" "$1"
    if (( from > $3 )); then
        echo "FAIL: resumed from step $from, but the killed run only reached $3" >&2
        exit 1
    fi
    if (( from >= STEPS )); then
        echo "FAIL: resumed from the final step $from, so nothing was left to compare;" \
            "lower KILL_AFTER or raise STEPS" >&2
        exit 1
    fi
    if (( from % EVERY != 0 )); then
        echo "FAIL: resumed from step $from, which is not a checkpoint step" >&2
        exit 1
    fi
    echo "$from"
}
# committed: what node 1's tiers hold now. Tier 0 is listed by `tiercheck memory ls`, not by
# opening the job: a Checkpointer of the job that closes cleanly takes its memory back.
committed() {
    python - "$TMP/node1" "$REMOTE" "$ENDPOINT" <<'PYEOF'
import sys

import tiercheck

local, remote, endpoint = sys.argv[1:]
with tiercheck.Checkpointer(local=local, remote=remote, storage_options={"endpoint_url": endpoint}) as ck:
    print(f"   committed: tier 1 {ck.steps('local')}, tier 2 (bucket) {ck.steps('remote')}; tier 0:")
PYEOF
    python -m tiercheck memory ls "$SHM/node1" | sed 's/^/     /'
}

echo "== python: $PY"
echo "== 1/6 S3 server (SeaweedFS) on 127.0.0.1"
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

echo "== 2/6 reference run (uninterrupted, $STEPS steps, tier 1 only)"
python "$DEMO" --dir "$TMP/ref" --fresh "${COMMON[@]}" --sleep 0 --no-stats > "$TMP/ref.log"
loss_lines "$TMP/ref.log" > "$TMP/ref.loss"
ref_n=$(wc -l < "$TMP/ref.loss")
[[ "$ref_n" -eq "$STEPS" ]] || fail_with_log "reference run printed $ref_n loss lines, expected $STEPS" "$TMP/ref.log"
echo "   $ref_n loss lines, final: $(tail -n 1 "$TMP/ref.loss")"

mkdir -p "$SHM/node1" "$SHM/node2"
NODE1=(--dir "$TMP/node1" "${COMMON[@]}" "${TIERS[@]}" --memory-dir "$SHM/node1" --job-id "$JOB_ID")
echo "== 3/6 node 1: tier 0 $SHM/node1 (job $JOB_ID) + tier 1 $TMP/node1 + tier 2 (the bucket); SIGKILL mid-run"
run_and_kill "$TMP/killed1.log" --fresh "${NODE1[@]}"
killed1=$(last_loss_step "$TMP/killed1.log")
echo "   per save, once durable on every tier (stall = time save() blocked training):"
grep -E '^  save [0-9]+: ' "$TMP/killed1.log" | sed 's/^  /     /'
same_as_reference "$TMP/killed1.log" 0 > /dev/null
echo "   killed (SIGKILL) after step $killed1 was printed"
committed

echo "== 4/6 node 1: the process restarts (same job id) and resumes from tier 0; SIGKILL mid-run"
run_and_kill "$TMP/killed2.log" "${NODE1[@]}"
killed2=$(last_loss_step "$TMP/killed2.log")
resumed2=$(check_resume "$TMP/killed2.log" "tier 0 (memory" "$killed1")
grep -E '^resumed from step|restored from tier' "$TMP/killed2.log" | sed 's/^ */   /'
n2=$(same_as_reference "$TMP/killed2.log" "$resumed2")
(( n2 > 0 )) || fail_with_log "the restarted run printed no loss before it was killed" "$TMP/killed2.log"
echo "   $n2 losses after the resume, identical to the uninterrupted run; killed (SIGKILL) after step $killed2"
committed

rm -rf "$TMP/node1" "$SHM/node1"
echo "== 5/6 node 1 is gone: its tier 1 ($TMP/node1) and its memory ($SHM/node1) are deleted"

echo "== 6/6 node 2: empty tier 0 and tier 1, resume from the bucket"
python "$DEMO" --dir "$TMP/node2" "${COMMON[@]}" "${TIERS[@]}" --memory-dir "$SHM/node2" --job-id "$JOB_ID" \
    --sleep 0 --no-stats > "$TMP/resumed.log"
resumed_from=$(check_resume "$TMP/resumed.log" "tier 2" "$killed2")
grep -E '^resumed from step|restored from tier' "$TMP/resumed.log" | sed 's/^ */   /'
got=$(same_as_reference "$TMP/resumed.log" "$resumed_from")
expected=$((STEPS - resumed_from))
if [[ "$got" -ne "$expected" ]]; then
    fail_with_log "node 2 resumed from step $resumed_from and printed $got losses, expected $expected" \
        "$TMP/resumed.log"
fi
echo
echo "PASS: node 1's process was killed at step ~$killed1 and resumed from step $resumed2 in tier 0 (memory);"
echo "      killed again at step ~$killed2, node 1 lost (disk and memory); node 2 resumed from step $resumed_from"
echo "      in the bucket; every loss after each resume identical to the uninterrupted run"
