"""A resume that toggles train.async says what becomes of the checkpoint's batches in flight: one line each way,
and batches generated ahead are never dropped without being asked."""

from __future__ import annotations

import logging

import torch

from podsrl.exit_codes import ExitCode
from podsrl.run.checkpoint import in_flight_on_resume, latest_checkpoint
from tests.faults.common import error_line, resume_argv, train_argv


def test_resume_toggling_async_says_what_happens_to_the_batches_in_flight(tmp_path, launcher, warm_cache):
    synchronous, asynchronous = tmp_path / "sync", tmp_path / "async"
    for run, enabled in ((synchronous, "false"), (asynchronous, "true")):
        result = launcher.run(train_argv(run, warm_cache, **{"train.async.enabled": enabled}),
                              env={"PODSRL_FAULTS": "term@step:3"})
        assert result.code == ExitCode.STOPPED_RESUMABLE, result.stderr[-3000:]
    checkpoint = latest_checkpoint(synchronous)
    result = launcher.run([*resume_argv(synchronous), "train.async.enabled=true"])
    assert result.code == ExitCode.FINISHED, result.stderr[-3000:]
    assert (f"WARNING resume: train.async.enabled=true on {checkpoint}, a synchronous run's checkpoint: it has no "
            "batch in flight; the generator starts at step 4 from its weights, as a new asynchronous run does"
            in result.stderr.splitlines())
    checkpoint = latest_checkpoint(asynchronous)
    ahead = len(torch.load(checkpoint / "in_flight.pt", weights_only=True))
    assert ahead >= 1
    result = launcher.run([*resume_argv(asynchronous), "train.async.enabled=false"])
    assert result.code == ExitCode.USER_ERROR, result.stderr[-3000:]
    assert error_line(result.stderr) == (
        f"podsrl: error: checkpoint {checkpoint} holds {ahead} batches generated ahead by an asynchronous run "
        "(train.async.enabled=true); resume it with train.async.enabled=true (a synchronous resume would drop them)")


def test_an_asynchronous_checkpoint_without_batches_ahead_resumed_synchronously(tmp_path, caplog):
    torch.save([], tmp_path / "in_flight.pt")
    with caplog.at_level(logging.WARNING, logger="podsrl"):
        assert in_flight_on_resume(tmp_path, asynchronous=True, step=4) == []  # not toggled: nothing to say
        assert in_flight_on_resume(tmp_path, asynchronous=False, step=4) == []
        torch.save({"version": 3, "weights": {}}, tmp_path / "generator.pt")  # a stop abandoned a batch
        assert in_flight_on_resume(tmp_path, asynchronous=False, step=4) == []
    assert caplog.messages == [
        f"resume: train.async.enabled=false on {tmp_path}, an asynchronous run's checkpoint: it had no batch in "
        "flight, so nothing is dropped; the run goes on synchronously from step 5",
        f"resume: train.async.enabled=false on {tmp_path}, an asynchronous run's checkpoint: the batch it was "
        "generating when it stopped is not resumed; step 5's batch is generated afresh from the checkpoint's weights"]
