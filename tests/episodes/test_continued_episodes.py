"""The episode runner over the fast engine: with each episode's KV cache continued between turns, the same episodes
(tokens, loss masks, log-probs, endings) as with the whole episode re-prefilled each turn, for fewer prefilled
tokens; the runner's session holds no cache once its episodes are over (before the update)."""

from __future__ import annotations

import pytest
import torch

from benchmarks.episode_continuation import count_prefills
from podsrl.batch import Problem
from podsrl.config import EpisodeConfig, TinyModelConfig
from podsrl.engines.base import EpisodeSession, SamplingParams
from podsrl.engines.fast import FastEngine
from podsrl.episodes.runner import EpisodeRunner
from podsrl.models.loading import build_tiny_model
from tests.conftest import device_under_test
from tests.engines.test_waves import LOGPROB_TOL
from tests.episodes.scripted import TOKENIZER

pytestmark = pytest.mark.usefixtures("one_thread")


class EchoEnvironment:
    """A tool answers every turn with the turn's first characters; a turn with a 0 or a 1 in it is the answer."""

    tools: list = []

    def __init__(self) -> None:
        self.tool_results = []

    def reset(self, problem: Problem) -> list[dict]:
        return [{"role": "user", "content": problem.prompt}]

    def step(self, assistant_text: str) -> tuple[list[dict], bool]:
        if "0" in assistant_text or "1" in assistant_text:
            return [], True
        return [{"role": "tool", "name": "echo", "content": assistant_text[:3]}], False


class EchoTask:
    def environment(self, tool_timeout_s: float) -> EchoEnvironment:
        return EchoEnvironment()


def run_episodes(engine) -> tuple:
    runner = EpisodeRunner(engine, TOKENIZER, EchoTask(), EpisodeConfig(max_turns=4, max_tokens=200))
    problems = [Problem(uid="a", prompt="12+30=", answer="42"), Problem(uid="b", prompt="7*6=", answer="42")]
    params = SamplingParams(max_new_tokens=24, temperature=1.0)
    return runner.run(problems, [3, 3], params, torch.arange(6) * 1009 + 17)


def episode_model(device: torch.device):
    """The built-in char-level model, small, with room for four turns and their tool answers."""
    cfg = TinyModelConfig(hidden_size=64, num_layers=2, num_heads=4, intermediate_size=128,
                          max_position_embeddings=256)
    return build_tiny_model(cfg, TOKENIZER, seed=1).to(device)


def test_continued_episodes_equal_reprefilled_ones_for_fewer_prefilled_tokens():
    model = episode_model(device_under_test())
    prefilled = {}
    outputs = {}
    for continued in (True, False):
        engine = FastEngine(model, TOKENIZER)
        if not continued:
            engine.session = lambda engine=engine: EpisodeSession(engine)
        prefilled[continued] = count_prefills(engine)
        outputs[continued] = run_episodes(engine)
        assert not any(session.cached for session in engine.sessions)  # the runner closed its session
    continued, reprefilled = outputs[True], outputs[False]
    assert continued.stats.turns > 12  # episodes went on past their second turn
    assert torch.equal(continued.generation.completion_ids, reprefilled.generation.completion_ids)
    assert torch.equal(continued.loss_mask, reprefilled.loss_mask)
    assert torch.equal(continued.generation.truncated, reprefilled.generation.truncated)
    assert (continued.generation.logprobs - reprefilled.generation.logprobs).abs().max() <= LOGPROB_TOL
    assert continued.stats.metrics() == reprefilled.stats.metrics()
    # a continued turn prefills each row's last token and its answer, "<tool_response>" + 3 + "</tool_response>"
    assert max(prefilled[True][1:]) <= 6 * (1 + 34)
    assert sum(prefilled[True]) < sum(prefilled[False]) / 2
