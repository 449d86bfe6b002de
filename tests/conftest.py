import os

import pytest
import torch

torch.set_num_threads(max(1, min(2, os.cpu_count() or 1)))


@pytest.fixture(scope="session")
def warmup_cache(tmp_path_factory):
    """One warm-up cache for the whole test session (each distinct warm-up config trains once)."""
    return str(tmp_path_factory.mktemp("warmup-cache"))


def tiny_overrides(run_dir, warmup_cache, **extra) -> list[str]:
    """A run small enough for a 2-core CI machine: a 2-layer model, few prompts, short completions."""
    base = {
        "output_dir": str(run_dir),
        "warmup.cache_dir": warmup_cache,
        "warmup.steps": 10,
        "warmup.batch_size": 32,
        "model.tiny.num_layers": 2,
        "model.tiny.hidden_size": 64,
        "model.tiny.intermediate_size": 128,
        "task.eval_size": 16,
        "task.args": "{operands: 2, digits: 1}",
        "eval.samples": 0,
        "rollout.prompts_per_step": 4,
        "rollout.n": 4,
        "rollout.max_new_tokens": 4,
        "train.max_steps": 2,
        "train.eval_every": 100,
        "train.save_every": 100,
        "log.progress": False,
        "log.tensorboard": False,
        "log.plot": False,
    }
    base.update(extra)
    return [f"{k}={v}" for k, v in base.items()]


@pytest.fixture(scope="module")
def one_thread():
    """Tiny models run faster on one thread than on two contended ones; restored for the next test module.
    Modules opt in with `pytestmark = pytest.mark.usefixtures("one_thread")`."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)
