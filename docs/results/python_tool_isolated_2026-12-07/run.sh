#!/usr/bin/env bash
# The python-tool comparison's seed 1 again, with each call of the `python` tool isolated in its own namespaces
# (podsrl/sandbox/): the warm-ups (trained once and cached), then docs/results/python_tool_2026-12-02's command with
# --seeds 1 and its 90 s budget. Copies the warm-ups' reports, the report, each run's metrics and the start-up line
# naming the isolation beside this file. From the repository root:
#     bash docs/results/python_tool_isolated_2026-12-07/run.sh
set -euo pipefail
here=docs/results/python_tool_isolated_2026-12-07
out=runs/python_tool_isolated
export OMP_NUM_THREADS=1
for cfg in arithmetic_python_plain arithmetic_python; do  # the plain warm-up first: the episode one continues it
    warmup=$(nice podsrl warmup --config "configs/$cfg.yaml" | tail -1)
    cp "$warmup/warmup.json" "$here/warmup_$cfg.json"
done
start=$(date +%s)
nice podsrl compare configs/arithmetic_python_plain.yaml configs/arithmetic_python.yaml --seeds 1 \
    --budget-seconds 90 --out "$out" --no-progress
echo "comparison wall clock: $(($(date +%s) - start)) s" | tee "$here/wall_clock.txt"
cp "$out/results.md" "$here/results.md"
for run in "$out"/*/seed1; do
    label=$(basename "$(dirname "$run")")
    cp "$run/metrics.jsonl" "$here/metrics_$label.jsonl"
    grep -i "sandbox\|isolat" "$run/run.log" > "$here/sandbox_lines_$label.txt" || true
done
