"""The two PODS framings' presets hold equal what their names say against the GRPO baseline (grpo.yaml)."""

from pathlib import Path

from podsrl.config import load_config

CONFIGS = Path(__file__).resolve().parents[2] / "podsrl" / "configs"


def _per_step(name: str) -> tuple[str, int, int, int]:
    """(method, prompts, rollouts generated, rollouts trained) per step of a bundled preset."""
    cfg = load_config(CONFIGS / f"{name}.yaml")
    prompts, n = cfg.rollout.prompts_per_step, cfg.rollout.n
    trained = prompts * (cfg.pods.m if cfg.method == "pods" else n)
    return cfg.method, prompts, prompts * n, trained


def test_equal_prompts_framing():
    grpo, pods = _per_step("grpo"), _per_step("pods_equal_prompts")
    assert grpo == ("grpo", 32, 512, 512)
    assert pods == ("pods", 32, 2048, 512)  # same prompts and update, four times the generation


def test_equal_generation_framing():
    grpo, pods = _per_step("grpo"), _per_step("pods_equal_generation")
    assert pods == ("pods", 8, 512, 128)  # same generation as GRPO's 32x16, a quarter of it trained
    assert pods[2] == grpo[2] and pods[3] * 4 == grpo[3]
