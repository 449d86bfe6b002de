"""benchmarks/rollout_mismatch.py: the ratio statistics on a hand-made batch, and the script end to end on the device
under test (a bfloat16 sampling copy against bfloat16 autocast over float32 masters)."""

import math
import sys

import torch

from benchmarks.rollout_mismatch import main, report
from podsrl.batch import Problem, RolloutBatch
from tests.conftest import device_under_test


def test_report_gives_the_token_and_sequence_ratios_and_each_modes_weights():
    """Row 0: token ratios 2, 2 (sequence 4, above the cap 3); row 1: 1/20 (sequence 0.05, below 0.1)."""
    mask = torch.tensor([[1.0, 1.0], [1.0, 0.0]])
    sampler = torch.tensor([[-2.0, -2.0], [-1.0, 0.0]])
    trainer = sampler + torch.tensor([[math.log(2), math.log(2)], [math.log(0.05), 0.0]])
    batch = RolloutBatch(problems=[Problem(uid="0", prompt="", answer="")], group_index=torch.zeros(2, dtype=torch.long),
                         prompt_ids=torch.ones(2, 1, dtype=torch.long), prompt_mask=torch.ones(2, 1, dtype=torch.long),
                         completion_ids=torch.ones(2, 2, dtype=torch.long), completion_mask=mask,
                         truncated=torch.zeros(2, dtype=torch.bool), sampler_logprobs=sampler)
    lines = report(trainer * mask, batch, cap=3.0)
    assert "quantiles 0: 0.050, 0.1: 0.445, 0.5: 2.025, 0.9: 3.605, 1: 4.000; below 0.1: 50%, above the cap 3: 50%" in \
        lines[2]
    by_mode = {line.split(":")[0].strip(): line for line in lines[3:]}
    # token_tis: row 0 keeps 2 and 2, row 1 0.05; sequence_mask: row 0 masked (4 > 3), row 1 weighted 0.05
    assert "median completion weight 1.025, below 0.1: 50%, masked entirely: 0%" in by_mode["token_tis"]
    assert "median completion weight 0.025, below 0.1: 100%, masked entirely: 50%" in by_mode["sequence_mask"]


def test_script_measures_a_bfloat16_copy_against_autocast(monkeypatch, capsys):
    monkeypatch.setattr(sys, "argv", ["rollout_mismatch.py", "--device", device_under_test().type, "--lengths", "6",
                                      "--prompts", "1", "--n", "2", "--logit-scale", "1", "10"])
    main()
    out = capsys.readouterr().out
    assert "logit scale 1, 6 tokens" in out and "logit scale 10, 6 tokens" in out
    assert out.count("sequence_mask: median completion weight") == 2
    assert out.count(" in 2 completions") == 2
