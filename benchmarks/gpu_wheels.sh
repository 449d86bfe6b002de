#!/usr/bin/env bash
# Run HERE (a machine with pip and a registry): fetches into .whl/ the wheels podsrl's tests need that the GPU image
# lacks (its package list: torch, transformers, peft, pytest, pytest-xdist, pytest-timeout, hypothesis, rich,
# matplotlib, tensorboard, pandas, pyarrow are there). Python 3.12, manylinux x86_64; no dependencies are resolved,
# so each needed one is named. Versions are those the CPU test machine runs. benchmarks/gpu_suite.sh installs .whl/
# on the GPU machine (pip --no-index --target /tmp/site); .whl/ is git-ignored and must be carried with the call.
#
#   bash benchmarks/gpu_wheels.sh            # math-verify, datasets, trl and their missing dependencies (~2 MB)
# Left out: ray (its wheel, ~70 MB, is over what a device call carries) and reasoning-gym (its dependency pycosat
# publishes no CPython 3.12 wheel, and one built here is for this machine's Python); their tests skip without them.
set -eu
cd "$(dirname "$0")/.."

core=(
    math-verify==0.9.0 latex2sympy2_extended==1.11.0 antlr4-python3-runtime==4.13.2
    datasets==5.2.0 dill==0.4.1 multiprocess==0.70.19
    trl==1.16.0
)

wanted=("${core[@]}")
mkdir -p .whl
platforms=()
for p in manylinux_2_28_x86_64 manylinux_2_27_x86_64 manylinux_2_17_x86_64 manylinux2014_x86_64 manylinux1_x86_64; do
    platforms+=(--platform "$p")
done

# A published wheel for CPython 3.12 on x86-64 Linux; else (a package published as source only) a wheel built here,
# which is right for pure-Python packages and is reported so that a compiled one is noticed.
fetch() {
    python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
        "${platforms[@]}" -d .whl "$1" && return
    echo "gpu_wheels: no wheel published for $1; building one here (check it is pure Python: *-none-any.whl)"
    python3 -m pip wheel -q --no-deps -w .whl "$1"
}

for spec in "${wanted[@]}"; do
    fetch "$spec"
done
ls -l .whl
du -sh .whl
