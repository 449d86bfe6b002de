# Shared by benchmarks/gpu_check.sh, gpu_suite.sh, gpu_pods_study.sh and gpu_speed.sh (sourced, not run).

# gpu_environment LOG SUMMARY: what every command of the scripts runs with: py (the interpreter, $PYTHON or
# python3), unbuffered offline Python, the carried wheels (install_wheels), and this checkout first on PYTHONPATH.
gpu_environment() {
    py=${PYTHON:-python3}
    export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false HF_HUB_OFFLINE=1
    install_wheels "$py" "$1" "$2"
    export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
}

# smoke_settings SMOKE: device (cuda; cpu under --smoke) and, under --smoke, scale doubled: on a busy CPU child
# processes start slowly
smoke_settings() {
    device=cuda
    if [ "$1" = 1 ]; then
        device=cpu
        scale=$(awk -v k="$scale" 'BEGIN { print 2 * k }')
    fi
}

# install_wheels PY LOG SUMMARY: wheels carried in .whl/ (benchmarks/gpu_wheels.sh) go to /tmp/site, which joins
# PYTHONPATH; pip's complaints go to LOG, and a failed install is said in SUMMARY (the scripts go on without them).
install_wheels() {
    local py=$1 log=$2 summary=$3 wheels=(.whl/*.whl)
    [ -f "${wheels[0]}" ] || return 0
    if "$py" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
        "${wheels[@]}" >>"$log" 2>&1; then
        export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
    else
        echo "wheels: the ${#wheels[@]} in .whl/ did not install (see $(basename "$log")); going on without them" \
            | tee -a "$summary"
    fi
}

# outcome RC LIMIT_S: how a command under `timeout LIMIT_S` ended, in words
outcome() {
    case $1 in 0) echo ok ;; 124 | 137) echo "TIMED OUT at $2s" ;; *) echo "failed (exit $1)" ;; esac
}

# has MODULE: whether $py imports it
has() { timeout 60 "$py" -c "import $1" >/dev/null 2>&1; }

# machine_report FILE: the date, host, GPU (nvidia-smi), Python, torch, CUDA and transformers versions, which optional
# packages import, and pip's list
machine_report() {
    { date -u; uname -a; nproc; free -g; timeout 30 nvidia-smi || echo "no nvidia-smi"
      timeout 60 "$py" -c "import sys, torch, transformers; print(sys.version); print('torch', torch.__version__, 'cuda', \
torch.version.cuda, 'available', torch.cuda.is_available()); print('transformers', transformers.__version__); \
torch.cuda.is_available() and print(torch.cuda.get_device_name(0), torch.cuda.get_device_properties(0))"
      for m in pytest xdist pytest_timeout hypothesis math_verify reasoning_gym datasets peft trl ray tensorboard \
               rich matplotlib; do has "$m" && echo "import $m: ok" || echo "import $m: MISSING"; done
      timeout 60 "$py" -m pip list 2>/dev/null; } >"$1" 2>&1
}
