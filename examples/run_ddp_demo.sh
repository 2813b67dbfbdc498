#!/usr/bin/env bash
# Kill-and-resume demo for a multi-rank (torchrun, DDP) job checkpointed with tiercheck.
#
# 1. Runs examples/ddp_train.py on 2 ranks uninterrupted (the reference).
# 2. Runs it again on a fresh checkpoint dir; rank KILL_RANK SIGKILLs itself right after
#    queueing the save of step KILL_AT (that save is cut off mid-write), and torchrun
#    takes the other rank down. Shows which steps were committed.
# 3. Restarts it on the same dir and checks that every rank resumed from the newest
#    committed step, and that every rank's loss lines after it are identical to the
#    reference run.
#
# Uses .venv/bin/python when there is one (bash scripts/setup.sh), else `python` on PATH.
# torchrun runs as `python -m torch.distributed.run --standalone`, which picks a free port,
# so two demos can run at once.
# Environment knobs: STEPS (40), EVERY (5), KILL_AT (25), KILL_RANK (1; -1: every rank),
# NPROC (2), REMOTE=1 to add a tier 2 (file://), PER_RANK=1 for one tier-1 directory per rank
# (as on separate nodes) instead of one shared node-local directory, KEEP_TMP=1 to keep the temp dir.
set -euo pipefail

HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
DEMO="$HERE/ddp_train.py"
STEPS="${STEPS:-40}"
EVERY="${EVERY:-5}"
KILL_AT="${KILL_AT:-25}"
KILL_RANK="${KILL_RANK:-1}"
NPROC="${NPROC:-2}"

PY="$(dirname "$HERE")/.venv/bin/python"
[[ -x "$PY" ]] || PY="$(command -v python || true)"
if [[ -z "$PY" ]]; then
    echo "run_ddp_demo.sh: no .venv (bash scripts/setup.sh) and no 'python' on PATH" >&2
    exit 2
fi
if ! "$PY" -c "import tiercheck, torch.distributed.run" > /dev/null; then
    echo "run_ddp_demo.sh: 'import tiercheck, torch.distributed.run' fails with $PY" >&2
    exit 2
fi
if (( KILL_AT >= STEPS )); then
    echo "run_ddp_demo.sh: KILL_AT ($KILL_AT) must be below STEPS ($STEPS)" >&2
    exit 2
fi

TMP="$(mktemp -d "${TMPDIR:-/tmp}/tiercheck-ddp-demo.XXXXXX")"
cleanup() {
    if [[ "${KEEP_TMP:-0}" == "1" ]]; then
        echo "(kept $TMP)"
    else
        rm -rf "$TMP"
    fi
}
trap cleanup EXIT

export OMP_NUM_THREADS=1 # torchrun would set it anyway, with a warning
torchrun() { "$PY" -m torch.distributed.run --standalone --nproc-per-node "$NPROC" "$@"; }
COMMON=(--steps "$STEPS" --every "$EVERY")
# Tier 2 (REMOTE=1) and one tier-1 directory per rank (PER_RANK=1) are optional.
remote() {
    if [[ "${REMOTE:-0}" == "1" ]]; then echo "--remote=file://$1/tier2"; fi
    if [[ "${PER_RANK:-0}" == "1" ]]; then echo "--per-rank-dirs"; fi
}
# "step N rank R loss X" lines, ordered by step, then rank (the ranks print concurrently).
loss_lines() { { grep -E '^step [0-9]+ rank [0-9]+ loss ' "$1" || true; } | sort -k2,2n -k4,4n; }
resumed_from() { sed -nE 's/^rank ([0-9]+): resumed from step ([0-9]+).*/\2/p' "$1" | sort -u; }

echo "== python: $PY"
echo "== 1/3 reference run: torchrun, $NPROC ranks, $STEPS steps, uninterrupted"
start_s=$SECONDS
torchrun "$DEMO" --ckpt "$TMP/ref" $(remote "$TMP/ref") "${COMMON[@]}" > "$TMP/ref.log" 2>&1 || {
    tail -n 30 "$TMP/ref.log" >&2
    echo "FAIL: the reference run failed" >&2
    exit 1
}
loss_lines "$TMP/ref.log" > "$TMP/ref.loss"
ref_n=$(wc -l < "$TMP/ref.loss")
if (( ref_n != STEPS * NPROC )); then
    echo "FAIL: reference run printed $ref_n loss lines, expected $((STEPS * NPROC))" >&2
    exit 1
fi
echo "   $ref_n loss lines ($((SECONDS - start_s)) s), final: $(tail -n "$NPROC" "$TMP/ref.loss" | paste -sd ';' -)"

CKPT="$TMP/ckpt"
who="rank $KILL_RANK"
(( KILL_RANK >= 0 )) || who="every rank"
echo "== 2/3 run on a fresh dir; $who SIGKILLs itself right after queueing the save of step $KILL_AT"
rc=0
torchrun "$DEMO" --ckpt "$CKPT" $(remote "$CKPT") "${COMMON[@]}" --kill-at "$KILL_AT" --kill-rank "$KILL_RANK" \
    > "$TMP/killed.log" 2>&1 || rc=$?
if (( rc == 0 )) || ! grep -q "SIGKILL at step $KILL_AT" "$TMP/killed.log"; then
    tail -n 30 "$TMP/killed.log" >&2
    echo "FAIL: the run was not killed at step $KILL_AT (torchrun exit status $rc)" >&2
    exit 1
fi
echo "   torchrun exit status $rc; last lines before the kill:"
{ grep -E '^(step|rank) ' "$TMP/killed.log" || true; } | tail -n 4 | sed 's/^/     | /'
# Every loss the killed run printed must already match the reference.
if comm -23 <(loss_lines "$TMP/killed.log" | sort) <(sort "$TMP/ref.loss") | grep -q .; then
    echo "FAIL: the killed run's losses already differ from the reference run:" >&2
    comm -23 <(loss_lines "$TMP/killed.log" | sort) <(sort "$TMP/ref.loss") | head -n 5 >&2
    exit 1
fi

echo "   files on disk after the crash, and the steps committed in each directory:"
"$PY" - "$CKPT" "$TMP/newest" <<'EOF'
import os
import sys

from tiercheck.tiers.local import LocalTier

root = sys.argv[1]
for dirpath, _dirs, files in sorted(os.walk(root)):
    for f in sorted(files):
        p = os.path.join(dirpath, f)
        print(f"     {os.path.relpath(p, root)}  ({os.path.getsize(p)} bytes)")
# Read-only listing (a Checkpointer would clean up the crash's leftovers on creation).
# Restorable: committed on tier 2, or in every rank's tier-1 directory.
tier1: set[int] | None = None
tier2: set[int] = set()
for d in sorted(d for d in os.listdir(root) if os.path.isdir(os.path.join(root, d))):
    found = LocalTier(os.path.join(root, d)).committed_steps()
    print(f"     committed in {d}/: {found}")
    if d == "tier2":
        tier2 = set(found)
    else:
        tier1 = set(found) if tier1 is None else tier1 & set(found)
with open(sys.argv[2], "w") as f:
    print(max(tier2 | (tier1 or set()), default=-1), file=f)
EOF
newest=$(cat "$TMP/newest")
if (( newest < 0 )); then
    echo "FAIL: no step was committed before the kill; raise KILL_AT" >&2
    exit 1
fi

echo "== 3/3 restart (same dir, no --kill-at)"
start_s=$SECONDS
torchrun "$DEMO" --ckpt "$CKPT" $(remote "$CKPT") "${COMMON[@]}" > "$TMP/resumed.log" 2>&1 || {
    tail -n 30 "$TMP/resumed.log" >&2
    echo "FAIL: the restarted run failed" >&2
    exit 1
}
grep -E '^rank [0-9]+: resumed' "$TMP/resumed.log" | sort | sed 's/^/   /'
from=$(resumed_from "$TMP/resumed.log")
nres=$(grep -cE '^rank [0-9]+: resumed' "$TMP/resumed.log" || true)
if [[ -z "$from" ]] || (( $(wc -l <<< "$from") != 1 || nres != NPROC )); then
    echo "FAIL: expected every rank to resume from the same step; got: $(echo $from) ($nres ranks)" >&2
    exit 1
fi
if (( from != newest )); then
    echo "FAIL: resumed from step $from, but the newest committed step was $newest" >&2
    exit 1
fi

loss_lines "$TMP/resumed.log" > "$TMP/resumed.loss"
awk -v s="$from" '$2 > s' "$TMP/ref.loss" > "$TMP/ref_tail.loss"
expected=$(((STEPS - from) * NPROC))
got=$(wc -l < "$TMP/resumed.loss")
if diff "$TMP/ref_tail.loss" "$TMP/resumed.loss" > /dev/null && (( got == expected )); then
    echo
    echo "PASS: killed at step $KILL_AT, all $NPROC ranks resumed from step $from (the newest committed)," \
        "$got subsequent loss lines ($((STEPS - from)) steps x $NPROC ranks) identical to the uninterrupted run"
    exit 0
fi
echo
echo "FAIL: resumed from step $from; resumed losses differ from the uninterrupted run" \
    "($got lines, expected $expected). First differences:"
paste -d '|' "$TMP/ref_tail.loss" "$TMP/resumed.loss" \
    | awk -F '|' '$1 != $2 { printf "   reference: %-40s resumed: %s\n", $1, $2; if (++n == 5) exit }'
exit 1
