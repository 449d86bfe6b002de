"""The producing side of a step is its own object (podsrl/run/producer.py): what it needs to go on is its state_dict,
and the learner's state plays no part in what it produces."""

from __future__ import annotations

import torch

from podsrl.config import load_config
from podsrl.run.trainer import Trainer
from tests.conftest import tiny_overrides


def _batch_fields(produced) -> list[torch.Tensor]:
    kept = produced.kept
    return [kept.completion_ids, kept.rewards, kept.advantages, kept.group_index]


def test_a_producer_continues_exactly_from_its_state_dict(tmp_path, warmup_cache):
    """GRESO (per-prompt history, its own skip state) with refills: a producer given another's state_dict after
    step 0 produces the same step-1 batch, with no update and no learner state in between."""
    overrides = tiny_overrides(tmp_path / "a", warmup_cache, **{"method": "greso", "filter.zero_variance": True})
    first = Trainer(load_config(None, overrides))
    first.parts.producer.produce(0)
    state = first.parts.producer.state_dict()
    expected = first.parts.producer.produce(1)
    second = Trainer(load_config(None, tiny_overrides(tmp_path / "b", warmup_cache,
                                                      **{"method": "greso", "filter.zero_variance": True})))
    second.parts.producer.load_state_dict(state)
    got = second.parts.producer.produce(1)
    for a, b in zip(_batch_fields(expected), _batch_fields(got)):
        assert torch.equal(a, b)
    untimed = [{k: v for k, v in m.items() if not k.startswith("time/")} for m in (expected.metrics, got.metrics)]
    assert untimed[0] == untimed[1] and len(untimed[0]) > 10
    assert second.parts.producer.data_position == first.parts.producer.data_position > 0
    for trainer in (first, second):
        trainer.close_engines()


def test_the_learner_does_not_reach_into_the_producer():
    """trainer.py, and the assembly and checkpoint state it hands the producer to, drive the producer through
    produce / state_dict / load_state_dict / rng only: the stages of a step live in the producer."""
    import inspect

    from podsrl.run import assembly, learner_state, trainer

    source = "".join(inspect.getsource(module) for module in (trainer, assembly, learner_state))
    for stage in ("collect_and_select", "generate_and_score", "next_problems", "method.collect", "method.select",
                  "end_step", "stats.record"):
        assert stage not in source, stage
