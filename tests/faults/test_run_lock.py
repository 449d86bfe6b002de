"""One writer per run directory: a second `podsrl train` on a run dir in use stops at start-up with one line
naming the first process (exit 2) and leaves the first run intact; a lock left by a dead process is taken over
with a log line; a clean end releases it."""

from __future__ import annotations

import json
import logging
import os
import signal
import socket

import pytest

from podsrl.errors import UserError
from podsrl.exit_codes import ExitCode
from podsrl.run.lock import LOCK_FILE, RunLock
from tests.faults.common import assert_same_run, error_line, resume_argv, train_argv, wait_for_step


def test_a_second_writer_stops_at_start_up_and_the_first_run_is_intact(tmp_path, launcher, warm_cache,
                                                                       reference_run):
    run = tmp_path / "run"
    hold = tmp_path / "hold"
    first = launcher.start(train_argv(run, warm_cache), env={"SPREAD_SLEEP": "0.2", "SPREAD_HOLD": str(hold)})
    wait_for_step(run, 1, first)
    hold.touch()  # the paced run is still going; from its next reward call it waits until the file is gone
    holder = f"pid {first.pid} on host {socket.gethostname()}"
    # the same launch script run twice, and a retried job resuming while the first still runs
    for argv in (train_argv(run, warm_cache), resume_argv(run)):
        result = launcher.run(argv)
        assert result.code == ExitCode.USER_ERROR, result.stderr[-3000:]
        line = error_line(result.stderr)
        assert f"output_dir: {run} is in use by another podsrl process ({holder}, started " in line, line
    assert first.poll() is None, "the second writer disturbed the first"
    hold.unlink()
    result = first.wait()
    assert result.code == ExitCode.FINISHED, result.stderr[-3000:]
    assert_same_run(run, reference_run)  # no record written twice, the checkpoints are the first run's own
    assert (run / LOCK_FILE).read_text() == ""  # released at the end
    assert "in use by another" not in (run / "run.log").read_text()  # the refused writers never wrote there


def test_a_lock_left_by_a_killed_run_is_taken_over_with_a_log_line(tmp_path, launcher, warm_cache, reference_run):
    run = tmp_path / "run"
    child = launcher.start(train_argv(run, warm_cache), env={"SPREAD_SLEEP": "0.1"})
    wait_for_step(run, 3, child)
    child.signal(signal.SIGKILL)
    assert child.wait().code == -signal.SIGKILL
    assert json.loads((run / LOCK_FILE).read_text())["pid"] == child.pid  # the dead holder's text is left
    result = launcher.run(resume_argv(run))
    assert result.code == ExitCode.FINISHED, result.stderr[-3000:]
    line = f"taking over {run / LOCK_FILE} from a process that ended without releasing it (pid {child.pid} on host "
    assert line in result.stderr and line in (run / "run.log").read_text()
    assert_same_run(run, reference_run)


def test_lock_in_process(tmp_path, caplog):
    """The same rules between two lock holders of one process (a library user's two trainers)."""
    with RunLock(tmp_path / "new" / "run") as lock:  # creates the directory
        with pytest.raises(UserError, match=f"in use by another podsrl process \\(pid {os.getpid()} on host "):
            RunLock(lock.run_dir)
    with caplog.at_level(logging.WARNING, logger="podsrl"):
        RunLock(tmp_path / "new" / "run").close()
    assert not caplog.records  # released cleanly: nothing to take over
    (tmp_path / LOCK_FILE).write_text(json.dumps({"pid": 4242, "host": "node7", "started": "yesterday"}))
    with caplog.at_level(logging.WARNING, logger="podsrl"), RunLock(tmp_path):
        pass
    assert caplog.messages == [f"taking over {tmp_path / LOCK_FILE} from a process that ended without releasing "
                               "it (pid 4242 on host node7, started yesterday)"]
    (tmp_path / "file").write_text("")
    with pytest.raises(UserError, match="output_dir: cannot create"):
        RunLock(tmp_path / "file" / "run")
