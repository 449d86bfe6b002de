#!/usr/bin/env bash
# A refactor changes no run: the default run (configs/default.yaml) for a few steps at each seed, on revision REV
# and on this checkout, every logged metric but the time/* ones compared record by record.
#
#   bash benchmarks/same_runs.sh REV                  # seeds 1 2 3, 30 steps (about 10 minutes on 2 cores)
#   bash benchmarks/same_runs.sh REV "1 2" 10
#
# Prints one line per seed: identical or DIFFERENT, the records compared and the held-out accuracies. Exit code 1
# if any seed differs.
set -eu
cd "$(dirname "$0")/.."
rev=${1:?usage: same_runs.sh REV [SEEDS] [STEPS]}
seeds=${2:-1 2 3}
steps=${3:-30}
py=${PYTHON:-python}
work=$(mktemp -d)
git worktree add -q --detach "$work/old" "$rev"
trap 'git worktree remove --force "$work/old"; rm -rf "$work"' EXIT
status=0
for seed in $seeds; do
    for side in old new; do
        tree=$PWD
        [ "$side" = old ] && tree=$work/old
        (cd "$tree" && OMP_NUM_THREADS=1 PYTHONPATH=$tree "$py" -m podsrl train seed="$seed" train.max_steps="$steps" \
            train.eval_every=$((steps / 2)) log.plot=false log.progress=false output_dir="$work/$side$seed" \
            >"$work/$side$seed.log" 2>&1)
    done
    "$py" - "$work/old$seed/metrics.jsonl" "$work/new$seed/metrics.jsonl" "$seed" <<'PY' || status=1
import json
import sys


def records(path):
    with open(path) as f:
        return [{k: v for k, v in json.loads(line).items() if not k.startswith("time/")} for line in f]


old, new, seed = records(sys.argv[1]), records(sys.argv[2]), sys.argv[3]
accuracy = [round(r["eval/accuracy"], 4) for r in new if "eval/accuracy" in r]
print(f"seed {seed}: {'identical' if old == new else 'DIFFERENT'}, {len(new)} records; held-out accuracy {accuracy}")
sys.exit(old != new)
PY
done
exit $status
