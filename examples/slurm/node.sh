#!/usr/bin/env bash
# One node's part of a multi-node podsrl run: this node's torchrun, joined to the others by a c10d rendezvous on the
# head node. Run once per node (train.sbatch does it with srun); a requeued or relaunched job runs the same command
# and resumes: with a run already in RUN_DIR (its config.yaml) every node passes `--resume RUN_DIR`, else the config
# and overrides given here. Tested on one machine as two "nodes" by tests/distributed/test_multinode.py.
#
#   NNODES=2 HEAD=node-a NPROC_PER_NODE=8 RUN_DIR=/shared/runs/pods16 \
#       bash examples/slurm/node.sh --config pods train.strategy=fsdp ...
#
# Environment: NNODES, HEAD (the rendezvous host, reachable from every node: it hosts the rendezvous store),
# NPROC_PER_NODE (ranks on this node, one per GPU), RUN_DIR (output_dir, on storage every node reads and writes);
# RDZV_PORT (29400), RDZV_ID (the job's id: $SLURM_JOB_ID under Slurm), PYTHON (python3). The rendezvous numbers
# the nodes itself: which node's first rank is global rank 0 (the one that writes) is its choice, not an input.
set -euo pipefail

: "${NNODES:?}" "${HEAD:?}" "${NPROC_PER_NODE:?}" "${RUN_DIR:?}"
RDZV_PORT=${RDZV_PORT:-29400}
RDZV_ID=${RDZV_ID:-${SLURM_JOB_ID:-podsrl}}
PYTHON=${PYTHON:-python3}

if [ -f "$RUN_DIR/config.yaml" ]; then
    args=(--resume "$RUN_DIR")           # the run's own config; nothing given here changes it
else
    args=("$@" "output_dir=$RUN_DIR")
fi
# --max-restarts 0: a rank that dies ends the job on every node (the others' collectives fail); the job is then
# requeued or relaunched as a whole and resumes from the last checkpoint.
exec "$PYTHON" -m torch.distributed.run --nnodes "$NNODES" \
    --nproc-per-node "$NPROC_PER_NODE" --max-restarts 0 \
    --rdzv-backend c10d --rdzv-endpoint "$HEAD:$RDZV_PORT" --rdzv-id "$RDZV_ID" \
    -m podsrl train "${args[@]}"
