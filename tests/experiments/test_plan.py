"""`podsrl plan`: the cost fit on synthetic steps with known coefficients, the fit design, and a short real
measurement on the tiny model through the CLI."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from podsrl.cli import main
from podsrl.config.presets import preset_path
from podsrl.errors import UserError
from podsrl.experiments import step_costs as plan
from podsrl.experiments.step_costs import (
    CostModel,
    Setting,
    StepSample,
    default_candidates,
    design,
    fit_line,
    make_plan,
    nnls,
    round_order,
)
from tests.conftest import tiny_overrides

pytestmark = pytest.mark.usefixtures("one_thread")

# Known costs: generation 0.2 s + 1 ms/token, score+select 0.01 s + 0.1 ms/rollout, update 0.3 s + 4 ms/token-pass,
# 0.05 s other; 5 tokens per rollout.
TRUE = {"g": (0.2, 1e-3), "s": (0.01, 1e-4), "u": (0.3, 4e-3), "other": 0.05, "tokens": 5.0}


def _sample(setting: Setting) -> StepSample:
    rollouts = setting.prompts * setting.n
    gen_tokens = rollouts * TRUE["tokens"]
    trained_tokens = setting.prompts * setting.m * TRUE["tokens"]
    gen = TRUE["g"][0] + TRUE["g"][1] * gen_tokens
    score = TRUE["s"][0] + TRUE["s"][1] * rollouts
    upd = TRUE["u"][0] + TRUE["u"][1] * trained_tokens
    return StepSample(setting, rollouts, gen_tokens, trained_tokens, gen, score, upd, gen + score + upd + 0.05)


def test_setting_parse_and_labels():
    assert Setting.parse("32x16") == Setting(32, 16, 16)
    assert Setting.parse("8x64:16") == Setting.parse("8x64->16") == Setting(8, 64, 16)
    assert Setting(8, 64, 16).label == "8x64->16" and Setting(32, 16, 16).label == "32x16"
    for bad in ("32", "8x16:32", "0x4", "axb", "4x4:1"):
        with pytest.raises(UserError, match="candidate"):
            Setting.parse(bad)


def test_fit_line_exact_and_degenerate():
    assert fit_line([1, 2, 3], [3, 5, 7]) == pytest.approx((1.0, 2.0))
    with pytest.raises(ValueError, match="distinct"):
        fit_line([4, 4, 4], [1, 2, 3])


def test_fit_line_never_returns_a_negative_cost():
    """Medians whose unconstrained line crosses below zero at no work (intercept -0.2 s): the fit is the best line
    with both costs >= 0, i.e. through the origin, slope sum(xy) / sum(x^2)."""
    x, y = [100, 200, 300], [0.5, 1.2, 1.9]
    assert np.polyfit(x, y, 1)[1] == pytest.approx(-0.2)  # what plain least squares gives
    a, b = fit_line(x, y)
    assert a == 0.0 and b == pytest.approx(np.dot(x, y) / np.dot(x, x))
    # a negative slope (more work, less time: noise) becomes a flat line at the mean
    assert fit_line([1, 2, 3], [3.0, 2.0, 1.0]) == pytest.approx((2.0, 0.0))


def test_nnls_meets_the_optimality_conditions_on_random_problems():
    """Karush-Kuhn-Tucker: x >= 0; the residual's gradient is 0 on the positive coefficients and <= 0 on the
    zero ones. Tolerance: 1e-8 relative to the problem's scale (float64 least squares on <= 8 x 3 systems)."""
    rng = np.random.default_rng(0)
    negative_seen = 0
    for _ in range(500):
        a = rng.normal(size=(int(rng.integers(3, 9)), int(rng.integers(1, 4))))
        y = rng.normal(size=a.shape[0])
        x = nnls(a, y)
        negative_seen += bool((np.linalg.lstsq(a, y, rcond=None)[0] < 0).any())
        gradient = a.T @ (y - a @ x)
        scale = 1e-8 * (1 + np.abs(a).max() * (np.abs(y).max() + np.abs(a).max() * np.abs(x).max()))
        assert (x >= 0).all() and (np.abs(gradient[x > 0]) <= scale).all() and (gradient[x == 0] <= scale).all()
    assert negative_seen > 100  # the constraint was active on many of them


def test_cost_model_fit_is_non_negative_where_least_squares_is_not():
    """Generation times whose unconstrained fit has a negative fixed cost (as -0.019 s per step was fitted): every
    fitted coefficient, and every phase predicted for any setting, stays >= 0."""
    samples = []
    for setting in design(default_candidates(32, 16)):
        s = _sample(setting)
        generate = 2e-4 * s.generated_tokens - 0.05  # below zero at no work
        samples.append(StepSample(setting, s.generated_rollouts, s.generated_tokens, s.trained_tokens, generate,
                                  s.score_select, s.update, generate + s.score_select + s.update + 0.05))
    model = CostModel.fit(samples)
    assert min(*model.generate, *model.score_select, *model.update, model.other) >= 0 and model.generate[0] == 0
    for setting in [Setting(1, 2, 2), Setting(64, 64, 16)]:
        assert min(model.predict(setting).values()) >= 0


def test_round_order_rotates_so_every_setting_leads_once_per_cycle():
    assert [round_order(3, r) for r in range(4)] == [[0, 1, 2], [1, 2, 0], [2, 0, 1], [0, 1, 2]]
    for r in range(5):
        assert sorted(round_order(5, r)) == list(range(5))


def test_measure_interleaves_the_settings(monkeypatch):
    """Steps go round-robin across every setting's trainer (rotated each round), not one setting's steps back to
    back; --sequential keeps them back to back."""
    calls = []

    class Recorder:
        def __init__(self, cfg):
            self.label = (cfg.rollout.prompts_per_step, cfg.rollout.n)

        def train_step(self):
            calls.append(self.label)
            metrics = {k: 1.0 for k in ("rollouts/generated", "tokens/generated", "tokens/trained", "time/generate",
                                        "time/score", "time/select", "time/update", "time/step")}
            return type("Step", (), {"metrics": metrics})()

        def close(self):
            pass

    monkeypatch.setattr("podsrl.run.trainer.Trainer", Recorder)
    settings = [Setting(4, 4, 4), Setting(2, 4, 4), Setting(1, 2, 2)]
    labels = [(s.prompts, s.n) for s in settings]
    plan.measure(preset_path("grpo"), [], settings, steps=2)
    assert calls == [labels[i] for r in range(3) for i in round_order(3, r)]
    calls.clear()
    plan.measure(preset_path("grpo"), [], settings, steps=2, interleave=False)
    assert calls == [label for label in labels for _ in range(3)]


def test_measure_closes_its_trainers_as_a_run_closes_on_an_async_config(tmp_path, warmup_cache, monkeypatch):
    """train.async: each trainer `measure` builds has a generator thread, an engine and an eval engine of its own,
    and the generator takes half of torch's threads. All are closed, and the threads given back, as a run closes
    them: at the end no generator runs, every engine is closed and torch has the threads it had before."""
    from podsrl.engines.base import RolloutEngine
    from podsrl.run import trainer as trainer_module

    built, closed = [], []

    class Kept(trainer_module.Trainer):
        def __init__(self, cfg):
            super().__init__(cfg)
            built.append(self)

    monkeypatch.setattr(trainer_module, "Trainer", Kept)
    monkeypatch.setattr(RolloutEngine, "close", lambda engine: closed.append(engine))
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        overrides = tiny_overrides(tmp_path / "unused", warmup_cache)
        plan.measure(preset_path("grpo_async"), overrides, [Setting(2, 2, 2), Setting(1, 2, 2)], steps=1)
        threads_after = torch.get_num_threads()
    finally:
        torch.set_num_threads(before)
    assert len(built) == 2 and all(t.generator is not None and t.parts.eval_engine is not t.parts.engine
                                   for t in built)
    assert not any(t.generator._thread.is_alive() for t in built)
    assert all(any(e is t.parts.engine for e in closed) and any(e is t.parts.eval_engine for e in closed)
               for t in built)
    assert threads_after == 2


def test_design_spans_the_candidates_and_varies_work_apart():
    candidates = default_candidates(32, 16)
    assert candidates == [Setting(32, 16, 16), Setting(32, 64, 16), Setting(8, 64, 16)]
    fit = design(candidates)
    assert fit == [Setting(32, 64, 16), Setting(32, 64, 4), Setting(8, 64, 16), Setting(8, 16, 4)]
    generated = {s.prompts * s.n for s in fit}
    trained = {s.prompts * s.m for s in fit}
    assert min(generated) <= 512 <= max(generated) and len(trained) >= 3


def test_cost_model_recovers_known_costs_and_predicts_unseen_settings():
    model = CostModel.fit([_sample(s) for s in design(default_candidates(32, 16))])
    assert model.generate == pytest.approx(TRUE["g"]) and model.update == pytest.approx(TRUE["u"])
    assert model.score_select == pytest.approx(TRUE["s"]) and model.other == pytest.approx(0.05)
    unseen = Setting(16, 32, 8)
    assert model.predict(unseen)["step"] == pytest.approx(_sample(unseen).step)
    rows = make_plan(model, default_candidates(32, 16), {Setting(32, 16, 16): [_sample(Setting(32, 16, 16))]})
    grpo, pods, pods_gen = rows
    assert grpo.break_even_gain == 1.0 and grpo.error == pytest.approx(0.0, abs=1e-12)
    # PODS 32x64->16 generates 4x, same update: slower; 8x64->16 generates the same, trains a quarter: faster.
    assert pods.break_even_gain > 1 > pods_gen.break_even_gain and pods.error is None
    assert pods.generation_share == pytest.approx(pods.predicted["generate"] / pods.predicted["step"])


@pytest.mark.parametrize("sequential", [False, True])
def test_plan_measures_the_tiny_model(tmp_path, warmup_cache, capsys, sequential):
    overrides = [o for o in tiny_overrides(tmp_path / "unused", warmup_cache) if not o.startswith("select.")]
    out = tmp_path / "plan.json"
    code = main(["plan", "grpo", *overrides, "--candidates", "8x4", "8x8:2", "--steps", "2", "--json", str(out)]
                + (["--sequential"] if sequential else []))
    assert code == 0
    text = capsys.readouterr().out
    assert "ms per generated token" in text and "| 8x8->2 | 64 / 16 |" in text and "1 threads" in text
    saved = json.loads(out.read_text())
    assert [c["setting"] for c in saved["candidates"]] == ["8x4", "8x8->2"]
    assert len(saved["fit_steps"]) == 4 * 2
    for c in saved["candidates"]:
        # Real timings on a shared machine: only a gross bound (a unit slip, seconds for milliseconds, or a fit on
        # the wrong columns, is off by orders of magnitude); the 15% aim is checked by hand (docs/statistics.md).
        assert c["measured_median"] > 0 and c["predicted"]["step"] > 0 and abs(c["error"]) < 5
    assert len({s["setting"] for s in saved["fit_steps"]}) == 4


def test_plan_rejects_bad_candidates(capsys):
    assert main(["plan", "grpo", "--candidates", "8x4:9"]) == 2
    assert "candidate '8x4:9'" in capsys.readouterr().err


def test_one_slow_step_barely_moves_the_fit():
    """A step slowed 10x by the machine's load: each setting enters the fit as its median step."""
    samples = []
    for setting in design(default_candidates(32, 16)):
        steps = [_sample(setting) for _ in range(3)]
        slow = steps[0]
        steps[0] = StepSample(setting, slow.generated_rollouts, slow.generated_tokens, slow.trained_tokens,
                              slow.generate * 10, slow.score_select, slow.update * 10, slow.step * 10)
        samples += steps
    model = CostModel.fit(samples)
    assert model.generate == pytest.approx(TRUE["g"]) and model.update == pytest.approx(TRUE["u"])
