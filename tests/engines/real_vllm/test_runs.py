"""The vllm engine on real vLLM (CPU build) inside podsrl's runs: tool episodes (multi-turn, a calculator call and
its answer in the context) equal the fast engine's, and `podsrl train rollout.engine=vllm` resumed from a
checkpoint equals the uninterrupted run."""

from __future__ import annotations

import json

import pytest

from tests.engines.real_vllm.helpers import SKIP_REASON

pytest.importorskip("vllm", reason=SKIP_REASON)
# one torch thread, as the main suite's engine tests: two threads on two busy cores spin (10 s for a 0.1 s step)
pytestmark = pytest.mark.usefixtures("one_thread")

import torch

from podsrl.config import EpisodeConfig
from podsrl.engines.base import SamplingParams
from podsrl.episodes.runner import EpisodeRunner
from podsrl.models.loading import load_tiny_at_context
from podsrl.run.warmup import reference_rows, sft_batch
from podsrl.tasks.arithmetic_tool import ArithmeticToolTask
from tests.engines.real_vllm.helpers import WARMUP, completions, fast_engine, vllm_engine
from tests.faults.common import assert_same_run
from tests.journeys.user_kit import ok, podsrl


def taught_tool_calls(tokenizer, task, problems, steps: int = 100):
    """The built-in model at the episodes' context (160), taught these problems' reference episodes (a calculator
    call, then the answer after the tool's reply) until it makes the calls itself."""
    torch.manual_seed(0)
    model = load_tiny_at_context(WARMUP, 160)
    ids, mask, labels = sft_batch(tokenizer, *reference_rows(task, problems))
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    model.train()
    for _ in range(steps):
        model(input_ids=ids, attention_mask=mask, labels=labels).loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    return model.eval()


def test_tool_episodes_through_vllm_equal_the_fast_engines(tokenizer):
    task = ArithmeticToolTask(tool_share=1.0, seed=0)
    problems = [task.problem(i) for i in range(8)]
    model = taught_tool_calls(tokenizer, task, problems)
    params = SamplingParams(max_new_tokens=96, greedy=True, return_logprobs=False)
    cfg = EpisodeConfig(max_turns=3, max_tokens=128)
    outputs = {}
    for name, engine in (("vllm", vllm_engine(model, tokenizer)), ("fast", fast_engine(model, tokenizer))):
        outputs[name] = EpisodeRunner(engine, tokenizer, task, cfg).run(problems, [1] * 8, params,
                                                                         torch.arange(8) + 5)
        engine.close()
    vllm, fast = outputs["vllm"], outputs["fast"]
    assert completions(vllm.generation) == completions(fast.generation)
    assert torch.equal(vllm.loss_mask, fast.loss_mask)
    # multi-turn: the calculator's reply sits in the context (not trained on) between the model's turns
    texts = tokenizer.batch_decode(vllm.generation.completion_ids, skip_special_tokens=True)
    with_reply = [i for i, t in enumerate(texts) if "</tool_response>" in t]
    assert len(with_reply) >= 4, texts
    for i in with_reply:
        n = int(vllm.generation.completion_mask[i].sum())
        assert 0 < int(vllm.loss_mask[i, :n].sum()) < n


def train_args(run, steps: int) -> list[str]:
    # a constant LR: a cosine schedule would follow train.max_steps, which the resumed run changes
    return ["train", "rollout.engine=vllm", "rollout.engine_options.enforce_eager=true",
            "rollout.engine_options.kv_cache_gib=0.25", "rollout.prompts_per_step=4", "rollout.n=8", "pods.m=4",
            "optim.scheduler=constant", "eval.size=64", "train.eval_every=1", f"train.max_steps={steps}",
            "train.save_every=1", f"output_dir={run}"]


def test_train_on_vllm_and_resume_equals_the_uninterrupted_run(tmp_path):
    straight, resumed = tmp_path / "straight", tmp_path / "resumed"
    ok(podsrl(*train_args(straight, 3), cwd=tmp_path, timeout=600))
    ok(podsrl(*train_args(resumed, 2), cwd=tmp_path, timeout=600))
    ok(podsrl("train", "--resume", str(resumed), "train.max_steps=3", cwd=tmp_path, timeout=600))
    summary = json.loads((resumed / "summary.json").read_text())
    assert summary["engine"] == "vllm" and summary["step"] == 3
    # vLLM restarted from the checkpoint samples step 3 as the engine synced twice did: every metric (the
    # sampler/trainer log-prob mismatch included) and the final weights equal
    assert_same_run(resumed, straight)
