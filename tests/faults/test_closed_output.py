"""Output that cannot be written never stops training: `podsrl train ... | head -c 20` (a real process whose stdout,
and stderr too, is a pipe closed before the run writes to it) trains every step, checkpoints, writes summary.json
and exits 0; run.log says once per stream that it was lost and keeps the progress lines; nothing (no traceback, no
"Exception ignored" at interpreter exit, no exit code 120) comes of the broken pipe."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from podsrl.run.checkpoint import latest_checkpoint
from tests.checkout import ROOT, pythonpath
from tests.faults.common import MAX_STEPS, train_argv


@pytest.mark.parametrize("closed", [("stdout",), ("stdout", "stderr")], ids=["stdout", "stdout-and-stderr"])
def test_a_closed_pipe_loses_no_step(tmp_path, warm_cache, closed):
    run = tmp_path / "run"
    argv = train_argv(run, warm_cache, **{"log.progress": True, "log.log_every": 1})
    env = {**os.environ, "PYTHONPATH": pythonpath(), "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}
    env.pop("PODSRL_FAULTS", None)
    with open(tmp_path / "stderr", "wb") as err:
        child = subprocess.Popen([sys.executable, "-m", "podsrl", *map(str, argv)], cwd=ROOT, env=env,
                                 stdout=subprocess.PIPE, stdin=subprocess.DEVNULL,
                                 stderr=subprocess.PIPE if "stderr" in closed else err)
        child.stdout.close()  # the reader is gone before the run writes a byte (`| head -c 0`)
        if child.stderr is not None:
            child.stderr.close()
        code = child.wait(timeout=300)
    stderr = (tmp_path / "stderr").read_text(errors="replace")
    log = (run / "run.log").read_text()
    assert code == 0, stderr[-3000:] + log[-3000:]
    assert json.loads((run / "summary.json").read_text())["step"] == MAX_STEPS
    assert latest_checkpoint(run).name == f"step-{MAX_STEPS:08d}"
    for stream in ("stdout", "stderr"):
        said = [line for line in log.splitlines() if f"{stream} (Broken pipe) cannot be written" in line]
        assert len(said) == (stream in closed), log[-3000:]
    assert f"train step {MAX_STEPS}/{MAX_STEPS}" in log  # the progress the pipe did not take
    assert "Traceback" not in stderr + log and "Exception ignored" not in stderr, stderr[-3000:]
