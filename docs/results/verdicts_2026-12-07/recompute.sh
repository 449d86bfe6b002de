#!/usr/bin/env bash
# Recompute the verdicts of every saved comparison report with the current statistics code (two-sided exact
# sign-flip test, Holm across the report's metrics); from the repository root:
#     bash docs/results/verdicts_2026-12-07/recompute.sh > docs/results/verdicts_2026-12-07/recomputed.txt
set -euo pipefail
for table in \
    docs/results/gpu_pods_study_2026-11-27/runs.csv \
    docs/results/arithmetic_tool.md \
    docs/results/arithmetic_tool_300.md \
    docs/results/episode_stop.md \
    docs/results/knapsack.md \
    docs/results/reinforce_ada.md \
    docs/results/pods.md \
    docs/results/pods_rules.md \
    docs/results/aero.md \
    docs/results/dynamo.md \
    docs/results/async_equal_steps.md \
    docs/results/async_equal_time.md \
    docs/results/turn_credit_2026-12-01/runs.csv \
    docs/results/python_tool_2026-12-02/comparison/runs.csv \
    docs/results/python_tool_2026-12-02/pilot/results.md; do
    echo "    python benchmarks/paired_from_table.py $table"
    echo
    python benchmarks/paired_from_table.py "$table"
    echo
done
