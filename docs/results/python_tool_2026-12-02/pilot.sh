#!/usr/bin/env bash
# The pilot of the python-tool comparison: its warm-ups (trained once and cached; `podsrl warmup` prints each one's
# folder), then the comparison's own command with one seed and a 30 s budget. Copies the warm-ups' reports and the
# runs' report and metrics into pilot/ beside this file. From the repository root:
#     bash docs/results/python_tool_2026-12-02/pilot.sh
set -euo pipefail
here=docs/results/python_tool_2026-12-02
out=runs/python_tool_pilot
export OMP_NUM_THREADS=1
mkdir -p "$here/pilot"
for cfg in arithmetic_python_plain arithmetic_python; do  # the plain warm-up first: the episode one continues it
    warmup=$(nice podsrl warmup --config "configs/$cfg.yaml" | tail -1)
    cp "$warmup/warmup.json" "$here/pilot/warmup_$cfg.json"
done
start=$(date +%s)
nice podsrl compare configs/arithmetic_python_plain.yaml configs/arithmetic_python.yaml --seeds 1 \
    --budget-seconds 30 --out "$out" --no-progress
echo "comparison wall clock: $(($(date +%s) - start)) s" | tee "$here/pilot/wall_clock.txt"
cp "$out/results.md" "$here/pilot/results.md"
for run in "$out"/*/seed1; do
    cp "$run/metrics.jsonl" "$here/pilot/metrics_$(basename "$(dirname "$run")").jsonl"
done
