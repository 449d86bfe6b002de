"""The method protocol: a registry the loop looks up once, the loop names no method, removed config keys name their
replacement, each method's own checks, the generic zero-variance refill and advantage clip, the one group-statistics
helper and the per-prompt history."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch

from podsrl.algo.group_stats import group_stats, zero_variance_groups
from podsrl.config import load_config
from podsrl.errors import ConfigError
from podsrl.methods import METHODS, Method
from podsrl.methods.grpo import GRPO
from podsrl.prompt_stats import PromptStats
from podsrl.run.trainer import Trainer
from tests.conftest import tiny_overrides

ROOT = Path(__file__).resolve().parents[2]
# correctness plus a graded reward: most groups have reward variance, the odd one does not
GRADED = f"[correct, {{name: digits, function: '{ROOT / 'tests/fixtures/rewards_ones.py'}:even_digit_share'}}]"
pytestmark = pytest.mark.usefixtures("one_thread")


def test_registry_and_a_loop_that_names_no_method():
    assert {"grpo", "pods", "aero", "dynamo"} <= set(METHODS)
    assert all(issubclass(cls, Method) and cls.name == name for name, cls in METHODS.items())
    source = (ROOT / "podsrl" / "run" / "trainer.py").read_text().lower()
    for name in ("aero", "dynamo", "max_variance", "max_reward", "posterior"):
        assert name not in source, name
    assert not re.search(r"\bpods\b", source)


@pytest.mark.parametrize("override, message", [
    ("select.m=4", "select.m: removed by the methods redesign; use pods.m"),
    ("select.rule=aero", "use method: aero"),
    ("select.rule=none", "use method: grpo"),
    ("select.rule=random", "method: pods with pods.rule: random"),
    ("select.normalize_over=group", "pods.normalize_over"),
    ("select.filter_zero_variance=true", "use filter.zero_variance"),
    ("select.max_refill_rounds=2", "use filter.max_refill_rounds"),
    ("rollout.allocation=variance", "rollout.allocation: removed by the methods redesign; use method: dynamo"),
    ("algo.modulation=dynamo", "algo.modulation: removed by the methods redesign; use method: dynamo with "
                               "dynamo.modulation: true"),
])
def test_removed_keys_name_their_replacement(override, message):
    with pytest.raises(ConfigError, match=re.escape(message)):
        load_config(None, [override])


@pytest.mark.parametrize("overrides, key", [
    (["method=pods", "pods.m=1"], "pods.m"),
    (["method=pods", "rollout.n=4", "pods.m=5"], "pods.m"),
    (["method=dynamo", "log.grad_noise=true"], "log.grad_noise"),
    (["method=dynamo", "rollout.n=30"], "dynamo.n_min"),
    (["method=aero", "aero.n_explore=20"], "aero.n_explore"),
    (["method=aero", "filter.zero_variance=true"], "filter.zero_variance"),
    (["method=grpo", "algo.advantage_clip=-1"], "algo.advantage_clip"),
])
def test_method_checks_name_the_key(overrides, key):
    with pytest.raises(ConfigError, match=re.escape(key)):
        load_config(None, overrides)


def test_dynamo_allocation_alone_may_log_the_gradient_noise():
    cfg = load_config(None, ["method=dynamo", "dynamo.modulation=false", "log.grad_noise=true"])
    assert METHODS[cfg.method](cfg).token_modulation() is None


def test_group_stats_edge_cases():
    values = torch.tensor([0.1, 0.1, 0.1, 1.0, 0.0, 5.0, 2.0, 2.0 + 1e-9], dtype=torch.float64)
    groups = torch.tensor([0, 0, 0, 1, 1, 2, 4, 4])  # group 3 is empty
    s = group_stats(values, groups, 5)
    assert s.count.tolist() == [3, 2, 1, 0, 2]
    assert s.constant.tolist() == [True, False, True, True, False]
    assert s.std[2] == 0 and s.std[3] == 0 and s.mean[3] == 0
    assert s.std[1] == pytest.approx(2 ** -0.5)
    assert zero_variance_groups(values, groups, 5).tolist() == [True, False, True, True, True]  # within 1e-6


def test_prompt_stats_keep_the_last_visit_and_load_older_state():
    stats = PromptStats()
    stats.record(["a", "b"], torch.tensor([0, 0, 1, 0]), torch.tensor([True, False, True, True]))
    stats.record(["a"], torch.tensor([0, 0]), torch.tensor([False, False]))
    assert [t.tolist() for t in stats.counts(["a", "b", "c"])] == [[2, 1, 0], [5, 1, 0]]
    assert [t.tolist() for t in stats.last_visit(["a", "b", "c"])] == [[0, 1, 0], [2, 1, 0]]
    old = {k: v for k, v in stats.state_dict().items() if not k.startswith("last_")}  # a checkpoint before them
    restored = PromptStats()
    restored.load_state_dict(old)
    assert [t.tolist() for t in restored.counts(["a", "b"])] == [[2, 1], [5, 1]]
    assert restored.last_visit(["a"])[1].tolist() == [0]


class WideAdvantages(GRPO):
    """A method of this test: GRPO advantages times 100, and refills that ask for twice the missing prompts."""

    name = "wide"
    refills: list[tuple[int, float]] = []  # (missing, zero-variance fraction) of each refill round

    def select(self, batch, ctx):
        kept, metrics = super().select(batch, ctx)
        kept.advantages = kept.advantages * 100
        return kept, metrics

    def refill_count(self, missing, zero_variance_fraction):
        self.refills.append((missing, zero_variance_fraction))
        return 2 * missing


def test_a_new_method_plugs_in_with_clip_and_refill(tmp_path, warmup_cache, monkeypatch):
    monkeypatch.setitem(METHODS, "wide", WideAdvantages)
    overrides = tiny_overrides(tmp_path / "run", warmup_cache, **{
        "method": "wide", "algo.advantage_clip": 0.5, "filter.zero_variance": True, "filter.max_refill_rounds": 1,
        "rollout.prompts_per_step": 4, "train.max_steps": 1, "rewards": GRADED})
    trainer = Trainer(load_config(ROOT / "podsrl/configs/grpo.yaml", overrides))
    seen = []
    update = trainer.parts.updater.update
    monkeypatch.setattr(trainer.parts.updater, "update",
                        lambda batch, rng: seen.append(batch.advantages) or update(batch, rng))
    record = trainer.train_step()
    trainer.parts.engine.close()
    assert seen and seen[0].abs().max() <= 0.5 and (seen[0].abs() == 0.5).any()
    rounds = int(record.metrics["select/refill_rounds"])
    assert rounds == 1 and WideAdvantages.refills == [(2, 0.5)]  # seeded: 2 of the first 4 groups had no variance
    drawn = 4 + sum(2 * missing for missing, _ in WideAdvantages.refills)
    assert trainer.parts.producer.data_position == drawn and sum(b.num_groups for b in record.generated) == drawn
    assert set(record.timers) >= {"time/generate", "time/score", "time/select", "time/update"}


def test_dynamo_epoch_refresh_uses_the_epoch_of_the_steps_first_problem(tmp_path, warmup_cache):
    # a pool of 6 at 4 prompts a step: step 2 starts at position 4 (epoch 0) and ends in epoch 1, step 3 starts at
    # position 8 (epoch 1). The snapshot of epoch 1 must be taken at step 3, holding every outcome of steps 1-2.
    overrides = tiny_overrides(tmp_path / "run", warmup_cache, **{
        "method": "dynamo", "task.args": "{operands: 2, digits: 1, train_size: 6}", "dynamo.refresh": "epoch",
        "dynamo.n_min": 2, "dynamo.n_max": 6, "dynamo.min_history": 1, "train.max_steps": 3})
    trainer = Trainer(load_config(ROOT / "podsrl/configs/grpo.yaml", overrides))
    epochs, attempts = [], []
    for _ in range(3):
        trainer.train_step()
        state = trainer.parts.producer.method.state_dict()
        epochs.append(state["snapshot_epoch"])
        attempts.append(sum(state["snapshot"]["attempts"]))
    trainer.parts.engine.close()
    assert epochs == [0, 0, 1]
    assert attempts[:2] == [0, 0] and attempts[2] == 2 * 4 * 4  # steps 1 and 2: 8 prompts x 4 rollouts
