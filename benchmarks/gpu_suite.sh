#!/usr/bin/env bash
# The GPU measurements (docs/gpu.md) in four device calls of under ten minutes each (--parts "machine tests", "default",
# "generation update_memory", "update_speed memory_plan"): every part has its own time limit
# and a part that fails or runs out of time is recorded and the next one runs. Writes at most 8 files (what a device
# call brings back) to --out (default: $OUT, else /tmp/gpu_suite): summary.txt (one line per part), machine.txt,
# tests.txt, generation.txt, update_speed.txt, update_memory.txt, memory_plan.txt, default.txt.
#
#   bash benchmarks/gpu_suite.sh                                # on the GPU machine, all parts
#   bash benchmarks/gpu_suite.sh --parts "default" --scale 3    # one part again, with 3x its time limit
#   bash benchmarks/gpu_suite.sh --smoke --out /tmp/gs          # on a CPU: the plumbing, tiny sizes, ~4 minutes
#
# Wheels carried to the machine (benchmarks/gpu_wheels.sh) are installed first when .whl/ exists. A warm-up cache
# carried in .cache/podsrl/warmup (made by `podsrl warmup` on any machine) is used instead of warming up there.
set -u
cd "$(dirname "$0")/.."

out=${OUT:-/tmp/gpu_suite}
smoke=0
parts="machine tests generation update_speed update_memory memory_plan default"
scale=1
while [ $# -gt 0 ]; do
    case $1 in
        --out) out=$2; shift 2 ;;
        --smoke) smoke=1; shift ;;
        --parts) parts=$2; shift 2 ;;
        --scale) scale=$2; shift 2 ;;
        *) echo "gpu_suite.sh: unknown argument $1 (see the header)" >&2; exit 2 ;;
    esac
done

mkdir -p "$out"
summary=$out/summary.txt
: >"$summary"
# shellcheck source=benchmarks/gpu_common.sh
. benchmarks/gpu_common.sh
gpu_environment "$summary" "$summary"
smoke_settings "$smoke"

# part NAME LIMIT_S FILE CMD...: CMD's output to FILE (emptied at its first part of this suite run, appended to
# after), killed after LIMIT_S x scale; a status line to summary
declare -A written
part() {
    local name=$1 limit file=$3 start=$SECONDS rc
    limit=$(awk -v s="$2" -v k="$scale" 'BEGIN { printf "%d", s * k }')
    shift 3
    [ -n "${written[$file]:-}" ] || : >"$file"
    written[$file]=1
    echo "== $name (limit ${limit}s): $*" | tee -a "$file"
    timeout -k 10 "$limit" "$@" >>"$file" 2>&1
    rc=$?
    echo "$name: $(outcome $rc "$limit"), $((SECONDS - start)) s -> $(basename "$file")" | tee -a "$summary"
}

machine() {
    machine_report "$out/machine.txt"
    echo "machine: written -> machine.txt" | tee -a "$summary"
}

# The modules where the device matters most run first, so their full report exists even if the rest runs out of
# time; -v prints each result as it comes (a run killed by its limit still says which tests passed and failed).
core_tests=(tests/engines/test_engines.py tests/update/test_shared_prompt.py tests/models/test_logprobs.py
            tests/algo/test_grad_noise.py tests/run/test_default_run.py tests/run/test_trainer.py)

tests() {
    local f=$out/tests.txt args=(-v -rfEs -p no:cacheprovider --device "$device" --maxfail=30) rest=()
    if ! has pytest; then
        echo "tests: pytest is not installed here; not run" | tee -a "$summary" "$f"
        return
    fi
    has pytest_timeout && args+=(--timeout=240)
    if [ "$smoke" = 1 ]; then
        part tests 150 "$f" "$py" -m pytest "${args[@]}" tests/engines/test_engines.py::test_logprobs_equal_fresh_forward \
            tests/algo/test_selection.py
        return
    fi
    has xdist && args+=(-n 6 --dist loadfile)  # module fixtures stay in one worker; 6 CUDA contexts fit easily
    for t in "${core_tests[@]}"; do rest+=(--ignore "$t"); done
    part "tests (core)" 90 "$f" "$py" -m pytest "${args[@]}" "${core_tests[@]}"
    part "tests (rest)" 180 "$f" "$py" -m pytest "${args[@]}" "${rest[@]}" tests
}

# The engines at three sizes (hf, fast eager, fast with CUDA graphs), then the graphs' gain at Qwen2.5-0.5B's shape.
generation() {
    local args=(--device "$device") large=(--device "$device" --models 0.5b --engines fast fast-graphs --n 16 64)
    if [ "$smoke" = 1 ]; then
        args+=(--dtype float32 --models tiny --n 2 4 --prompts 2 --prompt-len 8 --max-new-tokens 8 --repeats 1
               --peak-size 256)
        large=(--device cpu --dtype float32 --models tiny --engines fast --n 2 --prompts 2 --prompt-len 8
               --max-new-tokens 8 --repeats 1 --peak-size 256)
    fi
    part generation 200 "$out/generation.txt" "$py" benchmarks/gpu_generation.py "${args[@]}"
    part "generation 0.5b" 150 "$out/generation.txt" "$py" benchmarks/gpu_generation.py "${large[@]}"
}

update_speed() {
    local args=(--device "$device" --repeats 3 --workload default gsm8k gsm8k-large)
    local ckpt=(--device "$device" --repeats 3 --workload gsm8k-large --activation-checkpointing)
    if [ "$smoke" = 1 ]; then
        args=(--device cpu --repeats 1 --workload default --skip-memory)
        ckpt=(--device cpu --repeats 1 --workload default --skip-memory --activation-checkpointing)
    fi
    part update_speed 150 "$out/update_speed.txt" "$py" benchmarks/update_speed.py "${args[@]}"
    part "update_speed checkpointing" 120 "$out/update_speed.txt" "$py" benchmarks/update_speed.py "${ckpt[@]}"
}

update_memory() {
    local args=(--device "$device" --repeats 1)  # CUDA peaks are exact: one child process per setting
    [ "$smoke" = 1 ] && args=(--device cpu --repeats 1 --prompts 1 --length 8 --layers 1 --width 32)
    part update_memory 150 "$out/update_memory.txt" "$py" benchmarks/update_memory.py "${args[@]}"
}

# `podsrl plan --memory` against the allocator's peaks: bf16 compute over float32 masters (what `auto` is on CUDA),
# up to Qwen2.5-0.5B's shape, both phases, then the update with activation checkpointing.
memory_plan() {
    local args=(--device "$device" --models 13M 54M 0.5B --lengths 256 1024 --compute-dtype bfloat16 --rounds 1)
    [ "$smoke" = 1 ] && args=(--device cpu --models 0 --lengths 8 --rounds 1)
    part memory_plan 150 "$out/memory_plan.txt" "$py" benchmarks/memory_plan_check.py "${args[@]}"
    part "memory_plan checkpointing" 120 "$out/memory_plan.txt" "$py" benchmarks/memory_plan_check.py "${args[@]}" \
        --checkpointing --phases update
}

runs=/tmp/gpu_suite_runs

# The overrides of the default run (`podsrl train`, configs/default.yaml) as this suite runs it.
default_args() {
    local args=(warmup.cache_dir="$runs/warmup" log.progress=false log.plot=false model.device="$device")
    [ "$smoke" = 1 ] && args+=(warmup.steps=5 warmup.batch_size=8 rollout.prompts_per_step=2 rollout.n=4 pods.m=2
                               rollout.max_new_tokens=4 task.eval_size=8 train.max_steps=2 train.eval_every=100
                               model.tiny.num_layers=1 model.tiny.hidden_size=32 model.tiny.intermediate_size=64)
    echo "${args[@]}"
}

# One precision's run (NAME DTYPE COMPUTE_DTYPE): its log, then steps done, the training clock and the last eval
# record, appended to default.txt.
default_run() {
    local name=$1 f=$out/default.txt run=$runs/default_$1
    rm -rf "$run"
    # shellcheck disable=SC2046  # default_args' words are whole overrides without spaces
    part "default $name" 150 "$f" "$py" -m podsrl train $(default_args) output_dir="$run" model.dtype="$2" \
        model.compute_dtype="$3"
    "$py" benchmarks/run_summary.py "$run" >>"$f" 2>&1 || echo "no metrics to summarise in $run" >>"$f"
}

# The warm-up is carried or runs once (on model.device: podsrl/run/warmup.py), cached under a key that ignores device and
# dtype: every precision starts from the same weights and their clocks compare the RL steps alone. Its log, if it ran
# here, heads default.txt. The precisions: float32 throughout; mixed (float32 masters, bf16 compute and sampling:
# `auto` on CUDA); pure bfloat16.
default() {
    rm -rf "$runs"
    if [ -d .cache/podsrl/warmup ] && [ "$smoke" = 0 ]; then  # carried from another machine: the same key
        mkdir -p "$runs" && cp -r .cache/podsrl/warmup "$runs/warmup"
        echo "== warm-up: carried in .cache/podsrl/warmup ($(ls .cache/podsrl/warmup))" >"$out/default.txt"
        written[$out/default.txt]=1
    else
        # shellcheck disable=SC2046
        part warmup 90 "$out/default.txt" "$py" -m podsrl warmup $(default_args) output_dir="$runs/warmup-run"
    fi
    default_run float32 float32 float32
    default_run mixed float32 bfloat16
    default_run bfloat16 bfloat16 bfloat16
}

echo "gpu_suite: parts '$parts', device $device, scale $scale, out $out" | tee -a "$summary"
for p in $parts; do
    case $p in
        machine | tests | generation | update_speed | update_memory | memory_plan | default) "$p" ;;
        *) echo "unknown part $p (machine tests generation update_speed update_memory memory_plan default)" \
               | tee -a "$summary" ;;
    esac
done
echo "gpu_suite: done in $SECONDS s" | tee -a "$summary"
