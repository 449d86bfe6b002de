"""Security: nothing a user may receive from others is unpickled, model outputs are never executed, and reward code
comes only from the file the config names."""

from __future__ import annotations

import pickletools

import torch

from podsrl.batch import Problem
from podsrl.math_verify_pool import MathVerifyPool
from podsrl.rewards import MathVerifyReward, RewardManager, RewardSpec, load_function
from podsrl.run.checkpoint import latest_checkpoint, load_checkpoint_files
from podsrl.tasks.arithmetic import ArithmeticTask


def test_trainer_checkpoints_hold_safetensors_and_plain_tensors_only(reference_run):
    checkpoint = latest_checkpoint(reference_run)
    names = {p.name for p in (checkpoint / "model").iterdir()}
    assert "model.safetensors" in names and not names & {"pytorch_model.bin", "training_args.bin"}
    _, rng, state = load_checkpoint_files(checkpoint)  # weights_only=True: would refuse any object
    assert isinstance(state, dict) and isinstance(rng["trainer"], torch.Tensor)
    # The pickle streams reference no global but torch's tensor rebuild helpers and OrderedDict.
    import zipfile

    for name in ("optimizer.pt", "rng.pt"):
        with zipfile.ZipFile(checkpoint / name) as z:
            data = z.read(next(n for n in z.namelist() if n.endswith("data.pkl")))
        globals_used = {arg for op, arg, _ in pickletools.genops(data) if op.name in ("GLOBAL", "STACK_GLOBAL")}
        assert all(str(g).startswith(("torch", "collections OrderedDict")) for g in globals_used), globals_used


PAYLOADS = [f"__import__('os').system('touch {{marker}}{i}')" for i in range(3)] + [
    "$__import__('os').system('touch {marker}3')$", "\\boxed{__import__('os').system('touch {marker}4')}",
    "eval(\"__import__('os').system('touch {marker}5')\")", "\\boxed{\\text{exec('open(\"{marker}6\",\"w\")')}}",
]


def test_completions_are_parsed_never_executed(tmp_path):
    marker = tmp_path / "pwned"
    texts = [p.replace("{marker}", str(marker)) for p in PAYLOADS]
    problems = [Problem(uid="p", prompt="1+1=", answer="2")]
    index = torch.zeros(len(texts), dtype=torch.long)
    pool = MathVerifyPool(workers=1, item_timeout_s=20.0)  # the dataset tasks' `correct` (math-verify)
    try:
        manager = RewardManager([RewardSpec("correct", 1.0, MathVerifyReward(pool))],
                                ArithmeticTask(eval_size=1), on_error="zero", timeout_s=30.0)
        result = manager.score(problems, index, texts)
    finally:
        pool.close()
    assert not result.correct.any()
    arithmetic = ArithmeticTask(eval_size=1)  # the built-in task's own verifier
    assert not any(arithmetic.is_correct(t, problems[0]) for t in texts)
    assert not list(tmp_path.glob("pwned*"))


def test_reward_code_comes_only_from_the_named_file(tmp_path, monkeypatch):
    named = tmp_path / "chosen" / "rewards.py"
    decoy = tmp_path / "rewards.py"
    named.parent.mkdir()
    named.write_text("def score(prompts, completions, **kw):\n    return [1.0] * len(completions)\n")
    decoy.write_text(f"open({str(tmp_path / 'decoy-ran')!r}, 'w')\n"
                     "def score(prompts, completions, **kw):\n    return [0.0] * len(completions)\n")
    monkeypatch.chdir(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))  # even with the decoy importable as `rewards`
    fn = load_function(f"{named}:score")
    assert fn([], ["a", "b"]) == [1.0, 1.0]
    assert not (tmp_path / "decoy-ran").exists()
