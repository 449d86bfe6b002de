#!/usr/bin/env bash
# The GPU step against the hardware and against TRL, in two device calls of at most 7 minutes each (--deadline 420 s:
# no part runs past it). Parts, each with its own time limit (x --scale; the table `limits` below), each writing its
# own result file (JSON: its figures, a readable `summary` line and its targets met / missed; written as it fills, so
# a part cut by its limit keeps what it measured); a part that fails or runs out of time is recorded and the next one
# runs. The parts a call names must fit its deadline by construction: their limits, a kill's grace each and the
# set-up outside them (SETUP_S) add up to at most --deadline, else the script refuses (exit 2) before running any.
#   call 1 (--call 1, 390 s of 420): decode and the TRL comparison first, then the MFU
#   machine   (10 s)  machine.txt: GPU, driver, Python, torch, transformers, which optional packages import
#   decode    (90 s)  decode.json: decode tokens/s at 0.5B with EOS on, 128 and 512 rows, against the bandwidth and
#                     compute rooflines (targets >= 25% and >= 30%); the captures a training step makes and their
#                     time (benchmarks/decode_speed.py)
#   rl       (150 s)  rl.json: one GSM8K-shaped RL step at 0.5B, n = 16, 400 tokens, podsrl against TRL 1.16's
#                     GRPOTrainer in the same process, alternating, 3 rounds after one (target TRL/podsrl >= 3x)
#                     (benchmarks/step_throughput.py --workload gsm8k --shape 0.5b)
#   mfu       (75 s)  mfu.json: the update's MFU at Qwen2.5-0.5B's shape, 64 rows of 256 and of 1,024 completion
#                     tokens (6NT over 989 TFLOP/s; target >= 30% at 1,024) (benchmarks/update_mfu.py)
#   call 2 (--call 2, 355 s of 420): the update
#   machine   (10 s)  as above
#   update   (100 s)  update.json: the study config's update (configs/gpu_pods_study.yaml) in interleaved arms: fresh
#                     batches, the same batch, cuDNN attention off, after a generation and the engine's release,
#                     float32; wall and GPU-event time, the allocator's retries and cudaMalloc/cudaFree per arm; a
#                     profiler top-15 of one update; a fresh process with TORCH_CUDNN_SDPA_DEPRIORITIZED=1; new
#                     attention shapes per update (benchmarks/update_shapes.py, where present)
#                     (benchmarks/update_diagnosis.py)
#   train    (185 s)  train.json: the study's warm-up, then 1 + 15 training steps in two fresh processes, cuDNN
#                     attention preferred and deprioritised: time/update, time/generate, captures per step; target:
#                     the preferred process's median time/update <= 60 ms (benchmarks/study_steps.py)
# then summary.txt: each part's outcome and summary line, every target met / missed with its number, a closing line
# (benchmarks/speed_results.py); log.txt: every part's output. At most 8 files, what a device call brings back.
#
#   bash benchmarks/gpu_speed.sh --call 1                      # on the GPU machine: decode, rl, mfu, <= 7 minutes
#   bash benchmarks/gpu_speed.sh --call 2                      # then: update, train, <= 7 minutes
#   bash benchmarks/gpu_speed.sh --parts rl --scale 2          # one part again with twice its limit
#   bash benchmarks/gpu_speed.sh --call 1 --plan               # the parts' limits against the deadline; runs nothing
#   bash benchmarks/gpu_speed.sh --smoke --out /tmp/gs         # on a CPU: every part's plumbing, tiny sizes
#
# Carry .whl (benchmarks/gpu_wheels.sh: trl, datasets and what they need; the rl part needs them). The study's
# warm-up runs in the train part (~40 s on an H200; its cache is over what a call carries).
set -u
cd "$(dirname "$0")/.."

out=${OUT:-/tmp/gpu_speed}
runs=/tmp/gpu_speed_runs  # outside --out: warm-up cache, run folders
smoke=0
declare -A limits=([machine]=10 [decode]=90 [rl]=150 [mfu]=75 [update]=100 [train]=185)  # seconds, x --scale
calls=("" "machine decode rl mfu" "machine update train")  # --call 1, --call 2
GRACE_S=5  # timeout -k: a part outliving its limit is killed this much later
SETUP_S=45  # outside the parts: the environment (wheels), the rl part's import checks, the closing summary
parts="machine decode rl mfu update train"  # every part: one call under --smoke, two on the GPU (--call)
scale=1
deadline=""  # 420 s on the GPU; an hour for --smoke on a busy CPU
plan_only=0
while [ $# -gt 0 ]; do
    case $1 in
        --out) out=$2; shift 2 ;;
        --runs) runs=$2; shift 2 ;;
        --smoke) smoke=1; shift ;;
        --parts) parts=$2; shift 2 ;;
        --call)
            case $2 in 1 | 2) parts=${calls[$2]} ;; *) echo "gpu_speed.sh: --call is 1 or 2, got '$2'" >&2; exit 2 ;; esac
            shift 2 ;;
        --scale) scale=$2; shift 2 ;;
        --deadline) deadline=$2; shift 2 ;;
        --plan) plan_only=1; shift ;;
        *) echo "gpu_speed.sh: unknown argument $1 (see the header)" >&2; exit 2 ;;
    esac
done

# shellcheck source=benchmarks/gpu_common.sh
. benchmarks/gpu_common.sh
smoke_settings "$smoke"
[ "$smoke" = 1 ] && deadline=${deadline:-3600}
deadline=${deadline:-420}

# part_limit NAME: its limit x scale, in whole seconds (0: no such part)
part_limit() { awk -v s="${limits[$1]:-0}" -v k="$scale" 'BEGIN { printf "%d", s * k }'; }

# the call's time by construction: set-up, then each part's limit and kill grace; past the deadline, nothing runs
needed=$SETUP_S
for p in $parts; do
    [ -n "${limits[$p]:-}" ] && needed=$((needed + $(part_limit "$p") + GRACE_S))
    [ "$plan_only" = 1 ] && [ -n "${limits[$p]:-}" ] && echo "$p $(part_limit "$p")"
done
if [ "$plan_only" = 1 ]; then
    echo "needed $needed of ${deadline}s (set-up ${SETUP_S}s, ${GRACE_S}s kill grace a part)"
    exit 0
fi
if [ "$needed" -gt "$deadline" ]; then
    echo "gpu_speed.sh: the parts '$parts' need ${needed}s (their limits x $scale, ${GRACE_S}s kill grace each," \
        "${SETUP_S}s set-up) past the ${deadline}s deadline: run them in two calls (--call 1, then --call 2)" >&2
    exit 2
fi

mkdir -p "$out" "$runs"
summary=$out/summary.txt log=$out/log.txt
: >"$summary"
: >"$log"
gpu_environment "$log" "$summary"

# part NAME CMD...: CMD's output appended to log.txt, killed after the part's limit x scale seconds or at the
# deadline, whichever comes first; one status line to summary.txt, then the part's summary line from NAME.json
part() {
    local name=$1 limit left start=$SECONDS rc
    limit=$(part_limit "$name")
    shift
    left=$((deadline - SECONDS))
    if [ "$left" -lt 5 ]; then
        echo "$name: not run (the ${deadline}s deadline is reached)" | tee -a "$summary"
        return
    fi
    [ "$left" -lt "$limit" ] && limit=$left
    echo "== $name (limit ${limit}s): $*" >>"$log"
    timeout -k "$GRACE_S" "$limit" "$@" >>"$log" 2>&1
    rc=$?
    echo "$name: $(outcome $rc "$limit"), $((SECONDS - start)) s" | tee -a "$summary"
    if [ -f "$out/$name.json" ]; then
        "$py" -c 'import json, sys; print("  " + (json.load(open(sys.argv[1])).get("summary") or "no summary line"))' \
            "$out/$name.json" 2>/dev/null | tee -a "$summary"
    fi
}

machine() {
    machine_report "$out/machine.txt"
    echo "machine: written -> machine.txt" | tee -a "$summary"
}

update() {
    local args=(--device cuda --repeats 3 --child-timeout 40 --shapes-steps 20)
    [ "$smoke" = 1 ] && args=(--device cpu --smoke --hidden 16 --repeats 1 --child-timeout 120 --shapes-steps 3)
    part update "$py" benchmarks/update_diagnosis.py "${args[@]}" --json "$out/update.json"
}

train() {
    local args=(--steps 15 --warmup-timeout 70 --arm-timeout 55)
    [ "$smoke" = 1 ] && args=(--smoke --steps 1 --warmup-timeout 150 --arm-timeout 150)
    rm -rf "$runs/study"
    part train "$py" benchmarks/study_steps.py "${args[@]}" --runs "$runs/study" --json "$out/train.json"
}

mfu() {
    local args=(--device cuda)
    [ "$smoke" = 1 ] && args=(--device cpu --model tiny --lengths 8 16 --micro-batch 16 --repeats 1 --compute float32)
    part mfu "$py" benchmarks/update_mfu.py "${args[@]}" --json "$out/mfu.json"
}

decode() {
    local args=(--device cuda)
    [ "$smoke" = 1 ] && args=(--device cpu --dtype float32 --model tiny --prompts 2 --n 2 4 --prompt-len 8
                              --max-new-tokens 16 --mean-length 8 --repeats 1 --train-steps 2 --train-shape tiny
                              --train-prompts 2)
    part decode "$py" benchmarks/decode_speed.py "${args[@]}" --json "$out/decode.json"
}

rl() {
    local args=(--shape 0.5b --repeats 3)
    [ "$smoke" = 1 ] && args=(--shape tiny --new-tokens 8 --repeats 1)
    if ! has trl || ! has datasets; then
        echo "rl: trl or datasets is not installed here (carry .whl: benchmarks/gpu_wheels.sh); not run" \
            | tee -a "$summary"
        return
    fi
    part rl "$py" benchmarks/step_throughput.py --workload gsm8k --skip-task "${args[@]}" --json "$out/rl.json"
}

echo "gpu_speed: parts '$parts', device $device, scale $scale, deadline ${deadline}s, out $out" | tee -a "$summary"
for p in $parts; do
    case $p in
        machine | update | train | mfu | decode | rl) "$p" ;;
        *) echo "unknown part $p (machine update train mfu decode rl)" | tee -a "$summary" ;;
    esac
done
echo "== targets ([gpu-speed]), from the part files in $out" | tee -a "$summary"
"$py" benchmarks/speed_results.py "$out" 2>&1 | tee -a "$summary"
echo "gpu_speed: done in $SECONDS s" | tee -a "$summary"
