#!/usr/bin/env bash
# Two commits' benchmarks side by side, arms alternating: for each of ROUNDS rounds, each commit in turn runs the
# step-vs-TRL benchmark (TRL's defaults, then without its gradient checkpointing) and the decode benchmark; then each
# runs the update benchmark once. The older commit is checked out in a temporary worktree; both use this Python.
#
#   bash benchmarks/compare_commits.sh BEFORE [AFTER=HEAD] [ROUNDS=3] > ab.log
set -euo pipefail
before=$1 after=${2:-HEAD} rounds=${3:-3}
root=$(git rev-parse --show-toplevel)
py=${PYTHON:-python3}
work=$(mktemp -d)
trap 'git -C "$root" worktree remove --force "$work/before" >/dev/null 2>&1 || true; git -C "$root" worktree remove --force "$work/after" >/dev/null 2>&1 || true; rm -rf "$work"' EXIT
git -C "$root" worktree add -q --detach "$work/before" "$before"
git -C "$root" worktree add -q --detach "$work/after" "$after"
export OMP_NUM_THREADS=1
run() {  # ARM TITLE COMMAND...: one benchmark in that commit's tree, its summary lines
    local arm=$1 title=$2
    shift 2
    echo "##### $arm ($(git -C "$work/$arm" rev-parse --short HEAD)) $title"
    (cd "$work/$arm" && PYTHONPATH="$work/$arm" "$py" "$@" 2>&1 |
        grep -E "^machine|rollouts/step|podsrl step|TRL    step|TRL/podsrl|matmul work|eager:|fit:|shared-prompt update:|plain update:|speed-up|^== ")
}
for round in $(seq "$rounds"); do
    for arm in before after; do
        echo "##### round $round"
        run $arm "step vs TRL (TRL's defaults)" benchmarks/step_throughput.py --skip-task --repeats 5
        run $arm "step vs TRL (TRL without gradient checkpointing)" benchmarks/step_throughput.py --skip-task \
            --repeats 5 --trl-no-checkpointing
        run $arm "decode" benchmarks/decode_overhead.py --repeats 5
    done
done
for arm in before after; do
    run $arm "update" benchmarks/update_speed.py --repeats 5 --skip-memory
done
