"""A dataset task whose prompts have spaces, on the built-in model, killed (SIGKILL) and resumed, equals the unkilled
run: the resumed run tokenizes its prompts with the checkpoint's tokenizer (model/), which must be the run's own
(tests/models/test_tokenizer_reload.py)."""

from __future__ import annotations

import json
import signal

import pytest

from podsrl.run.checkpoint import latest_checkpoint
from tests.faults.common import assert_same_run, last_step, resume_argv, train_argv


def _dataset(tmp_path):
    path = tmp_path / "spaced.jsonl"
    rows = [{"question": f"What is {a} plus {b}?", "answer": a + b} for a in range(1, 9) for b in (2, 5)]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    return {"task.name": "dataset", "task.args": f"{{path: '{path}'}}", "warmup.steps": 0, "task.eval_size": 4,
            "rollout.max_new_tokens": 4}


@pytest.mark.slow  # three runs of about 10 s each
def test_sigkill_on_a_dataset_with_spaces_resumes_exactly(tmp_path, launcher, warm_cache):
    extra = _dataset(tmp_path)
    reference, run = tmp_path / "reference", tmp_path / "run"
    result = launcher.run(train_argv(reference, warm_cache, **extra))
    assert result.code == 0, result.stderr[-3000:]
    # killed as step 4 starts, after step 3 is logged; the checkpoint is step 2's: steps 3 to 6 are redone on
    # prompts tokenized by the checkpoint's tokenizer
    result = launcher.run(train_argv(run, warm_cache, **extra), env={"PODSRL_FAULTS": "kill@step:4"})
    assert result.code == -signal.SIGKILL, result.stderr[-3000:]
    assert last_step(run) == 3 and latest_checkpoint(run).name == "step-00000002"
    result = launcher.run(resume_argv(run))
    assert result.code == 0, result.stderr[-3000:]
    assert_same_run(run, reference)
