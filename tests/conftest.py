import os

import pytest

# before torch loads OpenMP: waiting threads sleep, here and in every `podsrl` subprocess the tests start (a set
# policy also keeps their thread count fixed: podsrl/threads.py), since the suite's own processes share the cores
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
import torch  # noqa: E402

# Each pytest-xdist worker gets its share of the cores (threads x processes <= cores, as podsrl/threads.py decides
# for a run's processes); serially, two threads as before.
_WORKERS = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
torch.set_num_threads(max(1, min(2, (os.cpu_count() or 1) // _WORKERS)))

DEVICE_ENV = "PODSRL_TEST_DEVICE"
DEVICES = ("cpu", "cuda")


def pytest_addoption(parser):
    parser.addoption("--device", choices=DEVICES, default=os.environ.get(DEVICE_ENV, "cpu"),
                     help=f"device the device-independent tests build their models and runs on (env {DEVICE_ENV}); "
                          "tests marked cpu_only are skipped off the CPU")


def pytest_configure(config):
    config.addinivalue_line("markers", "cpu_only(reason): CPU by nature (gloo/torchrun ranks, numbers recorded "
                                       "on CPU); skipped under --device cuda")
    device = config.getoption("--device")
    if device == "cuda" and not torch.cuda.is_available():
        raise pytest.UsageError(f"--device cuda: torch {torch.__version__} sees no CUDA device "
                                f"(its CUDA build: {torch.version.cuda or 'none'})")
    # the environment reaches subprocess runs too; on CPU the GPUs are hidden so `model.device=auto` stays there
    os.environ[DEVICE_ENV] = device
    if device == "cpu":
        os.environ["CUDA_VISIBLE_DEVICES"] = ""


def pytest_collection_modifyitems(config, items):
    if config.getoption("--device") == "cpu":
        return
    for item in items:
        marker = item.get_closest_marker("cpu_only")
        if marker is not None:
            why = marker.args[0] if marker.args else "CPU by nature"
            item.add_marker(pytest.mark.skip(reason=f"cpu_only: {why}"))


def device_under_test() -> torch.device:
    """The device chosen with --device (the tests' helpers move models and name `model.device` with it)."""
    return torch.device(os.environ.get(DEVICE_ENV, "cpu"))


@pytest.fixture(scope="session")
def warmup_cache(tmp_path_factory):
    """One warm-up cache for the whole test session (each distinct warm-up config trains once)."""
    return str(tmp_path_factory.mktemp("warmup-cache"))


def tiny_overrides(run_dir, warmup_cache, **extra) -> list[str]:
    """A run small enough for a 2-core CI machine: a 2-layer model, few prompts, short completions."""
    base = {
        "output_dir": str(run_dir),
        "model.device": device_under_test().type,
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
