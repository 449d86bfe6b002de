import pytest

from tests.faults.common import tiny
from tests.faults.launcher import Launcher


@pytest.fixture(scope="session")
def warm_cache(tmp_path_factory):
    """The warm-up of the tiny test model, trained once and shared by every run of the session."""
    from podsrl.config import load_config
    from podsrl.run.warmup import run_warmup

    cache = tmp_path_factory.mktemp("warmup-cache")
    run_warmup(load_config(None, tiny(tmp_path_factory.mktemp("unused"), cache)), progress=False)
    return str(cache)


@pytest.fixture(scope="session")
def launcher(tmp_path_factory):
    """`python -m podsrl` processes forked from a pre-imported parent (see launcher.py)."""
    launcher = Launcher(tmp_path_factory.mktemp("launcher"))
    yield launcher
    launcher.close()


@pytest.fixture(scope="session")
def reference_run(tmp_path_factory, launcher, warm_cache):
    """The uninterrupted run every interrupted one must reproduce exactly."""
    from tests.faults.common import train_argv

    run = tmp_path_factory.mktemp("reference") / "run"
    result = launcher.run(train_argv(run, warm_cache))
    assert result.code == 0, result.stderr[-3000:]
    return run



@pytest.fixture(autouse=True)
def one_torch_thread():
    """In-process runs on one thread: faster on a shared 2-core machine, and restored for other tests."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)
