#!/usr/bin/env bash
# The GPU PODS vs GRPO study (docs/gpu.md) in one device call of at most 9 minutes: the 25M-parameter built-in model on
# the worked-solution arithmetic task (configs/gpu_pods_study.yaml) is warmed up once on the GPU, then
# `podsrl compare` trains GRPO 16-16 and PODS 64->16 for 3 seeds at equal wall-clock (--budget seconds of
# training each) and writes its paired statistics. Each part has a time limit; a part that fails or runs out of
# time is recorded and the rest still runs, and the whole script stops before --deadline seconds (what the device
# call allows, minus room to write the files). Writes 7 files to --out (default: $OUT, else /tmp/gpu_pods_study):
# summary.txt (each part ok / failed / timed out, the warm-up's outcome), log.txt (warm-up and compare output, then
# each run's log), results.md / results.csv / runs.csv / accuracy.png (`podsrl compare`'s report) and steps.md
# (per run: step time and the share of it spent generating).
#
#   bash benchmarks/gpu_pods_study.sh                          # on the GPU machine
#
# How the 9 minutes divide (from the 3-seed H200 study of 2026-11-27 in docs/results.md): the warm-up ~40 s (on the
# GPU: its cache, 100 MB of float32 weights, is over what a device call carries); a 2-step priming run of the GRPO
# arm, ~35 s, that pays the machine's first-run costs outside the comparison (without it the first run, GRPO seed 1,
# spent ~10-15 s of its budget on them); then 6 runs (2 arms x 3 seeds) of 45 s of training + ~26 s of start-up,
# evals and saving = ~430 s; ~505 s in all. --deadline 530 stops the compare before the call's end, keeping whole
# pairs of seeds.
#   bash benchmarks/gpu_pods_study.sh --seeds "4 5" --budget 55   # two more seeds of the 2026-11-27 study (~400 s)
#   bash benchmarks/gpu_pods_study.sh --smoke --out /tmp/ps    # on a CPU: the plumbing, tiny sizes, ~1 minute
#
# Wheels carried to the machine (benchmarks/gpu_wheels.sh) are installed first when .whl/ exists; the study needs
# none.
set -u
cd "$(dirname "$0")/.."

out=${OUT:-/tmp/gpu_pods_study}
runs=/tmp/gpu_pods_study_runs  # outside --out: the run dirs hold checkpoints, too big to bring back
smoke=0
seeds="1 2 3"
budget=""
prime=1
deadline=530  # 9 minutes less time to write the report and the step table
while [ $# -gt 0 ]; do
    case $1 in
        --out) out=$2; shift 2 ;;
        --runs) runs=$2; shift 2 ;;
        --smoke) smoke=1; shift ;;
        --seeds) seeds=$2; shift 2 ;;
        --budget) budget=$2; shift 2 ;;
        --deadline) deadline=$2; shift 2 ;;
        --no-prime) prime=0; shift ;;
        *) echo "gpu_pods_study.sh: unknown argument $1 (see the header)" >&2; exit 2 ;;
    esac
done

preset=configs/gpu_pods_study.yaml
# The overrides of every command (warm-up and runs alike, so the runs find the warm-up under its cache key).
study=(warmup.cache_dir="$runs/warmup" log.progress=true log.plot=false)
pods_n=64 pods_m=16 grpo_n=16
if [ "$smoke" = 1 ]; then
    study+=(model.device=cpu model.tiny.num_layers=1 model.tiny.hidden_size=32 model.tiny.intermediate_size=64
            warmup.steps=4 warmup.batch_size=8 warmup.validation_size=8 task.eval_size=8 eval.samples=0
            rollout.prompts_per_step=2 rollout.max_new_tokens=12 train.eval_every=2)
    pods_n=4 pods_m=2 grpo_n=2 budget=${budget:-2}
fi
# Training seconds per run: 6 runs of ~71 s with start-up and evals, after the warm-up and the priming run (the header).
budget=${budget:-45}

mkdir -p "$out"
summary=$out/summary.txt log=$out/log.txt
echo "gpu_pods_study: seeds '$seeds', budget ${budget}s a run, deadline ${deadline}s, smoke $smoke, out $out" \
    | tee "$summary"
: >"$log"
# shellcheck source=benchmarks/gpu_common.sh
. benchmarks/gpu_common.sh
gpu_environment "$log" "$summary"

# part NAME LIMIT_S CMD...: CMD's output appended to log.txt, killed after LIMIT_S; a status line to summary.txt
part() {
    local name=$1 limit=$2 start=$SECONDS rc
    shift 2
    echo "== $name (limit ${limit}s): $*" >>"$log"
    timeout -k 10 "$limit" "$@" >>"$log" 2>&1
    rc=$?
    echo "$name: $(outcome $rc "$limit"), $((SECONDS - start)) s" | tee -a "$summary"
    return $rc
}

# The two arms as config files (`podsrl compare` names runs after them): the preset is PODS n->m; GRPO is the
# same file with method grpo and n rollouts, all trained. Nothing else differs.
write_arms() {
    "$py" - "$preset" "$runs/arms" "$pods_n" "$pods_m" "$grpo_n" <<'EOF'
import sys
from pathlib import Path

import yaml

preset, arms, pods_n, pods_m, grpo_n = sys.argv[1], Path(sys.argv[2]), *map(int, sys.argv[3:])
base = yaml.safe_load(Path(preset).read_text())
pods = {**base, "name": f"pods_{pods_n}to{pods_m}", "method": "pods", "pods": {**base["pods"], "m": pods_m},
        "rollout": {**base["rollout"], "n": pods_n}}
grpo = {k: v for k, v in base.items() if k != "pods"}
grpo.update(name=f"grpo_{grpo_n}", method="grpo", rollout={**base["rollout"], "n": grpo_n})
arms.mkdir(parents=True, exist_ok=True)
for arm in (grpo, pods):  # GRPO first: the report's baseline
    (arms / f"{arm['name']}.yaml").write_text(yaml.safe_dump(arm, sort_keys=False))
    print(arms / f"{arm['name']}.yaml")
EOF
}

# Per run: steps, training clock, mean step / generate / update time and the generation share of the step
# (sum of time/generate over sum of time/step), and the held-out accuracy at the first and last eval.
step_table() {
    "$py" - "$runs/compare" <<'EOF'
import sys
from pathlib import Path

from podsrl.reporting.tracking import read_metrics

print("| config | run | steps | clock s | step s | generate s | update s | generation share | eval acc first -> last |")
print("|---|---|---|---|---|---|---|---|---|")
for metrics in sorted(Path(sys.argv[1]).glob("*/*seed*/metrics.jsonl")):  # .seed<s>.unfinished too
    records = read_metrics(metrics)
    steps = [r for r in records if "reward" in r]
    evals = [r["eval/accuracy"] for r in records if "eval/accuracy" in r]
    if not steps:
        continue
    total = {k: sum(r.get(k, 0.0) for r in steps) for k in ("time/step", "time/generate", "time/update")}
    acc = f"{evals[0]:.3f} -> {evals[-1]:.3f}" if evals else "none"
    print(f"| {metrics.parent.parent.name} | {metrics.parent.name} | {len(steps)} | "
          f"{steps[-1]['time/elapsed']:.1f} | {total['time/step'] / len(steps):.3f} | "
          f"{total['time/generate'] / len(steps):.3f} | {total['time/update'] / len(steps):.3f} | "
          f"{total['time/generate'] / total['time/step']:.0%} | {acc} |")
EOF
}

rm -rf "$runs"
compare=$runs/compare
if part warmup 180 "$py" -m podsrl warmup --config "$preset" "${study[@]}" output_dir="$runs/warmup-run"; then
    cat "$runs"/warmup/*/warmup.json >>"$summary" 2>/dev/null && echo >>"$summary"
    arms=$(write_arms 2>>"$log") || echo "arms: failed (see log.txt)" | tee -a "$summary"
    # Runs go one at a time (podsrl compare has no other mode), seed-major, so a run has the GPU to itself and
    # equal wall-clock means equal GPU time; a call cut short still holds whole (GRPO, PODS) pairs of seeds.
    # A machine's first training run pays one-time costs inside its training clock that the later runs do not (on
    # an H200, 3 steps took 13.2 s of it where a step takes ~1.2 s): a 2-step run of the baseline arm pays them
    # outside the comparison.
    # shellcheck disable=SC2086
    [ -n "$arms" ] && [ "$prime" = 1 ] && part prime 90 "$py" -m podsrl train --config "$(head -n 1 <<<"$arms")" "${study[@]}" \
        train.max_steps=2 output_dir="$runs/prime"
    left=$((deadline > SECONDS + 1 ? deadline - SECONDS : 1))
    # shellcheck disable=SC2086  # $arms and $seeds are lists of words
    [ -n "$arms" ] && part compare "$left" "$py" -m podsrl compare $arms "${study[@]}" \
        --seeds $seeds --budget-seconds "$budget" --out "$compare" --no-progress
else
    echo "compare: not run (no warm-up)" | tee -a "$summary"
fi

if [ -d "$compare" ] && [ ! -f "$compare/results.md" ]; then
    # cut short: report the finished runs alone (a hidden folder is skipped by the report)
    for run in "$compare"/*/seed*; do
        [ -f "$run/summary.json" ] || mv "$run" "$(dirname "$run")/.$(basename "$run").unfinished"
    done
    part report 60 "$py" -m podsrl report "$compare" --out "$compare"
fi
for f in results.md results.csv runs.csv accuracy.png; do
    [ -f "$compare/$f" ] && cp "$compare/$f" "$out/"
done
[ -d "$compare" ] && { step_table >"$out/steps.md" 2>>"$log"; echo "steps: written -> steps.md" | tee -a "$summary"; }
for run_log in "$compare"/logs/*.log; do
    [ -f "$run_log" ] && { echo "== $(basename "$run_log")"; cat "$run_log"; } >>"$log"
done
echo "gpu_pods_study: done in $SECONDS s" | tee -a "$summary"
