#!/usr/bin/env bash
# The GPU check (docs/gpu.md): the figures a lent GPU must give, in one device call of at most 8 minutes by its parts'
# own limits (485 s, on an H100 or H200), so the call can run once, be read, and have its failed parts re-run within a
# 15-minute lease. Parts, in order of value, each with its own limit; a part that fails or runs out of time is
# recorded in summary.txt and the next one runs:
#   machine   (10 s)  machine.txt: GPU, driver, Python, torch, transformers, which optional packages import
#   tests     (60 s)  tests.txt: `pytest --device cuda` on the tests where the device matters (below)
#   decode   (150 s)  decode.txt: Qwen2.5-0.5B's shape, random init, bf16, 8 prompts x n = 16 and 64, 256 new tokens:
#                     model.generate vs the fast engine eager vs with CUDA graphs (benchmarks/gpu_generation.py)
#   memory   (110 s)  memory.txt: the same shape, an eval call then GRPO 8 x 16 steps, per phase the allocator's
#                     peaks against `podsrl plan --memory`, with and without checkpointing (benchmarks/phase_memory.py)
#   train     (85 s)  train.txt: the default run (configs/default.yaml) on CUDA, compute `auto` (bf16 over float32
#                     masters), from the carried warm-up; step time, held-out accuracy, sampling/* mismatch metrics
#   async  (40+30 s)  async.txt: 20 steps of the default run with train.async and CUDA graphs, then 20 synchronous
# and, named with --parts only (over the 8 minutes of the others):
#   update    (90 s)  update.txt: the update of configs/gpu_pods_study.yaml timed in four interleaved arms that
#                     separate per-shape set-up, cuDNN attention and the allocator after the engine's release
#                     (`benchmarks/update_ops.py --diagnose cuda`; docs/results.md, "The update's launch and sync count")
# Writes at most 8 files (what a device call brings back) to --out (default: $OUT, else /tmp/gpu_check); the runs'
# directories go to --runs (default /tmp/gpu_check_runs).
#
#   bash benchmarks/gpu_check.sh                                   # on the GPU machine, all parts (485 s by the limits)
#   bash benchmarks/gpu_check.sh --parts "memory async"            # failed parts again
#   bash benchmarks/gpu_check.sh --parts train --scale 2           # one part with twice its limit
#   bash benchmarks/gpu_check.sh --parts "update memory"           # the update's diagnosis, the memory plan again
#   bash benchmarks/gpu_check.sh --smoke --out /tmp/gc             # on a CPU: the plumbing, tiny sizes, ~2 minutes
#
# Carry .whl (benchmarks/gpu_wheels.sh: what the GPU image lacks) and .cache/podsrl/warmup (`podsrl warmup` here: the
# default run then starts from the CPU's warm-up weights, the same as the CPU runs in docs/results.md).
set -u
cd "$(dirname "$0")/.."

out=${OUT:-/tmp/gpu_check}
runs=/tmp/gpu_check_runs  # outside --out: run dirs hold checkpoints, too big to bring back
smoke=0
parts="machine tests decode memory train async"
scale=1
while [ $# -gt 0 ]; do
    case $1 in
        --out) out=$2; shift 2 ;;
        --runs) runs=$2; shift 2 ;;
        --smoke) smoke=1; shift ;;
        --parts) parts=$2; shift 2 ;;
        --scale) scale=$2; shift 2 ;;
        *) echo "gpu_check.sh: unknown argument $1 (see the header)" >&2; exit 2 ;;
    esac
done

mkdir -p "$out"
summary=$out/summary.txt
: >"$summary"
# shellcheck source=benchmarks/gpu_common.sh
. benchmarks/gpu_common.sh
gpu_environment "$summary" "$summary"
smoke_settings "$smoke"

# part NAME FILE LIMIT_S CMD...: CMD's output appended to FILE.txt in --out, killed after LIMIT_S x scale seconds;
# one status line to summary.txt
part() {
    local name=$1 file=$out/$2.txt limit start=$SECONDS rc
    limit=$(awk -v s="$3" -v k="$scale" 'BEGIN { printf "%d", s * k }')
    shift 3
    echo "== $name (limit ${limit}s): $*" >>"$file"
    timeout -k 5 "$limit" "$@" >>"$file" 2>&1
    rc=$?
    echo "$name: $(outcome $rc "$limit"), $((SECONDS - start)) s -> $(basename "$file")" | tee -a "$summary"
}

machine() {
    machine_report "$out/machine.txt"
    echo "machine: written -> machine.txt" | tee -a "$summary"
}

# The tests where the device matters: the engines (CUDA graphs vs eager, log-probs vs a fresh forward, stop tokens,
# waves and the state kept between calls), the two update paths, precision and checkpointing, log-probs at any
# temperature, the KL term, the rollout correction (and its mismatch script), train.async (graphs captured on its
# generator thread beside the learner).
device_tests=(tests/engines/test_engines.py tests/engines/test_decode_graph.py tests/engines/test_fused_storage.py
              tests/engines/test_waves.py tests/engines/test_stop_tokens.py
              tests/update/test_shared_prompt.py tests/update/test_precision.py tests/models/test_logprobs.py
              tests/update/test_activation_checkpointing.py tests/algo/test_grad_noise.py tests/update/test_kl.py
              tests/update/test_rollout_correction_update.py tests/benchmarks/test_rollout_mismatch.py
              tests/algo/test_rollout_correction.py tests/run/test_async_generation.py tests/faults/test_async_capture.py)

tests() {
    local args=(-q -rfEs -p no:cacheprovider --device "$device" --maxfail=20)
    if ! has pytest; then
        echo "tests: pytest is not installed here; not run" | tee -a "$summary" "$out/tests.txt"
        return
    fi
    if [ "$smoke" = 1 ]; then
        part tests tests 120 "$py" -m pytest "${args[@]}" tests/engines/test_engines.py::test_logprobs_equal_fresh_forward
        return
    fi
    has pytest_timeout && args+=(--timeout=60)
    has xdist && args+=(-n 8 --dist loadfile)  # module fixtures stay in one worker
    part tests tests 60 "$py" -m pytest "${args[@]}" "${device_tests[@]}"
}

decode() {
    local args=(--device cuda --dtype bfloat16 --models 0.5b --engines hf fast fast-graphs --n 16 64 --prompts 8
                --max-new-tokens 256 --repeats 2)
    [ "$smoke" = 1 ] && args=(--device cpu --dtype float32 --models tiny --engines hf fast --n 2 4 --prompts 2
                              --prompt-len 8 --max-new-tokens 8 --repeats 1 --peak-size 256)
    part decode decode 150 "$py" benchmarks/gpu_generation.py "${args[@]}"
}

memory() {
    local args=(--device cuda)
    [ "$smoke" = 1 ] && args=(--device cpu --model tiny --prompts 2 --n 2 --length 8 --eval-rows 4 --micro-batch 2)
    part memory memory 110 "$py" benchmarks/phase_memory.py "${args[@]}"
}

# The default run's overrides as this check runs it (all runs find the warm-up under one cache key).
run_args() {
    local args=(warmup.cache_dir="$runs/warmup" log.plot=false model.device="$device")
    [ "$smoke" = 1 ] && args+=(warmup.steps=5 warmup.batch_size=8 rollout.prompts_per_step=2 rollout.n=4 pods.m=2
                               rollout.max_new_tokens=4 task.eval_size=8 train.max_steps=2 train.eval_every=100
                               model.tiny.num_layers=1 model.tiny.hidden_size=32 model.tiny.intermediate_size=64)
    echo "${args[@]}"
}

# The warm-up: carried in .cache/podsrl/warmup, else made here once (on the GPU it takes ~30 s of the train part).
warmup_cache() {
    [ -d "$runs/warmup" ] && return
    mkdir -p "$runs"
    if [ -d .cache/podsrl/warmup ] && [ "$smoke" = 0 ]; then
        cp -r .cache/podsrl/warmup "$runs/warmup"
        echo "== warm-up: carried in .cache/podsrl/warmup ($(ls .cache/podsrl/warmup))" >>"$out/train.txt"
    fi
}

# summarise RUN FILE: steps, clock, first and last eval, the sampling/* metrics' means
summarise() {
    "$py" benchmarks/run_summary.py "$1" >>"$2" 2>&1 || echo "no metrics to summarise in $1" >>"$2"
}

update() {
    local cmd=(benchmarks/update_ops.py --diagnose cuda)
    # the CPU's bfloat16 is slow: the smoke's arms run float32 at one layer (update_diagnosis.py --smoke)
    [ "$smoke" = 1 ] && cmd=(benchmarks/update_diagnosis.py --device cpu --smoke --hidden 16 --repeats 1 --no-children)
    part update update 90 "$py" "${cmd[@]}"
}

train() {
    warmup_cache
    rm -rf "$runs/default"
    # shellcheck disable=SC2046  # run_args' words are whole overrides without spaces
    part train train 85 "$py" -m podsrl train $(run_args) output_dir="$runs/default"
    summarise "$runs/default" "$out/train.txt"
}

# train.async with CUDA graphs (the generator thread captures while the learner trains), then the same steps
# synchronously: no crash, and steps/s side by side.
async_part() {
    local steps=(train.max_steps=20 train.eval_every=1000 train.save_every=1000)
    [ "$smoke" = 1 ] && steps=(train.max_steps=3 train.eval_every=1000 train.save_every=1000)
    warmup_cache
    rm -rf "$runs/async" "$runs/sync"
    # shellcheck disable=SC2046
    part async async 40 "$py" -m podsrl train $(run_args) "${steps[@]}" train.async.enabled=true \
        output_dir="$runs/async"
    # shellcheck disable=SC2046
    part "async: the synchronous loop" async 30 "$py" -m podsrl train $(run_args) "${steps[@]}" output_dir="$runs/sync"
    summarise "$runs/async" "$out/async.txt"
    summarise "$runs/sync" "$out/async.txt"
}

echo "gpu_check: parts '$parts', device $device, scale $scale, out $out" | tee -a "$summary"
for p in $parts; do
    case $p in
        machine | tests | decode | memory | train | update) "$p" ;;
        async) async_part ;;
        *) echo "unknown part $p (machine tests decode memory train async update)" | tee -a "$summary" ;;
    esac
done
echo "gpu_check: done in $SECONDS s" | tee -a "$summary"
