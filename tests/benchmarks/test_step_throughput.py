"""benchmarks/step_throughput.py: the matmul work model of a podsrl step vs TRL's."""

import pytest
import torch

from benchmarks.step_throughput import work_ratios
from podsrl.batch import Problem, RolloutBatch


def test_work_ratios_count_each_framework_s_forwarded_and_trained_tokens():
    # two groups of two rows: prompts of 3 and 2 real tokens (left-padded), completions of 2, 3, 1 and 4 tokens
    prompt_mask = torch.tensor([[1, 1, 1], [1, 1, 1], [0, 1, 1], [0, 1, 1]])
    completion_mask = torch.tensor([[1, 1, 0, 0], [1, 1, 1, 0], [1, 0, 0, 0], [1, 1, 1, 1]]).float()
    batch = RolloutBatch(problems=[Problem("a", "x", "1"), Problem("b", "y", "2")],
                         group_index=torch.tensor([0, 0, 1, 1]), prompt_ids=prompt_mask.clone(),
                         prompt_mask=prompt_mask, completion_ids=completion_mask.long(),
                         completion_mask=completion_mask, truncated=torch.zeros(4, dtype=torch.bool))
    # podsrl forwards 3 + 2 prompt tokens and (2-1) + (3-1) + (1-1) + (4-1) completion tokens = 11, in each pass;
    # TRL prefills 4 rows x 3 tokens, decodes 4 rows x 3 steps, trains 4 rows x (3 + 4) tokens
    gen, update, step = work_ratios(batch, trl_prompt_len=3, new_tokens=4, trl_checkpointing=True)
    assert gen == pytest.approx(2 * 4 * 6 / (2 * 11))
    assert update == pytest.approx(8 * 4 * 7 / (6 * 11))
    assert step == pytest.approx((2 * 4 * 6 + 8 * 4 * 7) / (8 * 11))
    assert work_ratios(batch, 3, 4, trl_checkpointing=False)[1] == pytest.approx(6 * 4 * 7 / (6 * 11))
