"""What `podsrl` exit codes mean, for schedulers and wrapper scripts: docs/operations.md lists each one and what to
do with it (tests/test_operations_doc.py keeps it in step with this file).

A requeue policy can retry STOPPED_RESUMABLE (and FAULT, at its discretion) with `podsrl train --resume RUN_DIR`;
USER_ERROR and UNHEALTHY fail the same way on every retry, so they should not be retried unchanged.
"""

from __future__ import annotations

from enum import IntEnum


class ExitCode(IntEnum):
    FINISHED = 0  # the run reached its budget and wrote summary.json (or was already finished)
    # an unexpected error (a bug, a crashed library): Python's own code for an uncaught exception; also a trainer
    # that ended outside podsrl's own exit before finishing (os._exit in user code: podsrl/run/supervisor.py)
    FAULT = 1
    USER_ERROR = 2  # bad config, data, path or reward code; a second writer on a locked run directory
    UNHEALTHY = 3  # training went bad: non-finite losses in a row, or a collapse with train.stop_on_collapse
    # A worker process (a Ray actor) died or failed past rollout.engine_options.max_retries: one line names it and
    # the step. The checkpoints are intact; a resume may succeed once the machine is healthy (retry, with a limit).
    # 69 is sysexits' EX_UNAVAILABLE ("a service is unavailable").
    WORKER_LOST = 69
    # Stopped by SIGTERM/SIGINT after saving a checkpoint: resumable, not finished. 75 is sysexits' EX_TEMPFAIL
    # ("try again later"): non-zero, so SLURM, Kubernetes and TorchElastic do not count the run as done, and
    # distinct from 143 (128 + SIGTERM), which they report when a process is killed before it could checkpoint.
    STOPPED_RESUMABLE = 75
    INTERRUPTED = 130  # 128 + SIGINT: stopped before training started, or a second Ctrl-C aborted a checkpoint
