"""What the sandbox says about its isolation, and what it does where there is none (podsrl/sandbox/isolation.py):
one start-up line naming the level; without user namespaces (simulated by replacing the probe) a run whose task
runs programs refuses to start with one line naming episode.sandbox, unless it is 'unisolated', which warns. And
the public `Sandbox` (podsrl/sandbox/box.py): files in and out of its scratch directory."""

from __future__ import annotations

import logging
import os
import shutil
import subprocess
import sys
import time

import pytest

from podsrl.build import load_task
from podsrl.cli import main
from podsrl.config import load_config
from podsrl.episodes.sandbox import SandboxLimits, python_tool
from podsrl.errors import ConfigError
from podsrl.sandbox import Sandbox, isolation, launch

NO_NAMESPACES = "unshare: Operation not permitted"
FULL = isolation.probe() is None


@pytest.fixture
def fresh(monkeypatch):
    """A process whose sandbox has said nothing yet and whose policy is the default."""
    monkeypatch.setitem(isolation._state, "said", False)
    monkeypatch.setitem(isolation._state, "allow_unisolated", False)


@pytest.fixture
def no_namespaces(fresh, monkeypatch):
    monkeypatch.setattr(isolation, "probe", lambda: NO_NAMESPACES)


@pytest.mark.skipif(not FULL, reason=f"this machine cannot isolate: {isolation.probe()}")
def test_the_start_up_line_names_full_isolation_once(fresh, caplog):
    with caplog.at_level(logging.INFO, logger="podsrl.sandbox.isolation"):
        python = python_tool(SandboxLimits(wall_s=20.0))
        python_tool()
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 1 and lines[0].startswith("sandbox: full isolation") and "64 processes" in lines[0]
    assert python("import os; print(os.getcwd())") == "/scratch\n"


def test_without_namespaces_the_tool_refuses_to_start(no_namespaces):
    with pytest.raises(ConfigError, match=f"^episode.sandbox: programs cannot be isolated on this machine "
                                          f"\\({NO_NAMESPACES}\\); set episode.sandbox: unisolated"):
        python_tool()


def test_without_namespaces_a_run_refuses_before_anything_is_generated(no_namespaces, capsys):
    assert main(["eval", "--config", "arithmetic_python", "warmup.steps=0"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("podsrl: error: episode.sandbox: programs cannot be isolated")


def test_unisolated_runs_with_a_warning(no_namespaces, caplog):
    cfg = load_config("podsrl/configs/arithmetic_python.yaml", ["episode.sandbox=unisolated"])
    with caplog.at_level(logging.INFO, logger="podsrl.sandbox.isolation"):
        task, _ = load_task(cfg, None)
    assert [r.levelname for r in caplog.records] == ["WARNING"]
    assert caplog.records[0].getMessage() == isolation.level_line(NO_NAMESPACES, 64)
    assert "NOT isolated (unshare: Operation not permitted)" in caplog.records[0].getMessage()
    where = python_tool(SandboxLimits(wall_s=20.0))("import os; print(os.getcwd())").strip()
    assert where != "/scratch" and os.path.isabs(where)  # the host's own scratch directory


def test_the_setting_is_checked():
    with pytest.raises(ConfigError, match="episode.sandbox"):
        load_config(None, ["episode.sandbox=none"])


@pytest.mark.skipif(not FULL, reason=f"this machine cannot isolate: {isolation.probe()}")
def test_files_go_in_and_out_and_links_are_not_followed_out(tmp_path):
    shown = tmp_path / "shown"
    shown.mkdir()
    (shown / "data.txt").write_text("read-only data")
    with Sandbox(SandboxLimits(wall_s=20.0), read_only=(str(shown),)) as box:
        (box.path / "tests").mkdir()
        (box.path / "tests" / "t.py").write_text(f"print(open('{shown}/data.txt').read().upper())")
        done = box.run([sys.executable, "-I", "-S", "tests/t.py"])
        assert (done.returncode, done.stdout, done.timed_out) == (0, b"READ-ONLY DATA\n", False)
        code = ("import os\nopen('report.txt', 'w').write('2 passed')\nos.symlink('/etc/hostname', 'host')\n"
                f"open('{shown}/data.txt', 'w')")
        done = box.run([sys.executable, "-I", "-S", "-c", code])
        assert done.returncode == 1 and b"Read-only file system" in done.stderr
        assert (box.path / "report.txt").read_text() == "2 passed" and (box.path / "tests" / "t.py").is_file()
        assert not (box.path / "host").exists() and not (box.path / "host").is_symlink()
    assert (shown / "data.txt").read_text() == "read-only data" and not box.path.exists()


@pytest.mark.skipif(not FULL, reason=f"this machine cannot isolate: {isolation.probe()}")
def test_the_wall_clock_kills_everything(tmp_path):
    with Sandbox(SandboxLimits(wall_s=1.0)) as box:
        done = box.run(["sleep", "30"])
    assert done.timed_out and done.returncode == -9


@pytest.mark.skipif(not FULL or os.geteuid() != 0 or shutil.which("unshare") is None,
                    reason="needs root (to mount on the host, in a mount namespace of the test's own) and isolation")
def test_a_submount_of_a_directory_shown_read_only_is_read_only_too(tmp_path):
    shown = tmp_path / "shown"
    (shown / "sub").mkdir(parents=True)
    script = (f"import subprocess, sys\nsubprocess.run(['mount', '-t', 'tmpfs', 'tmpfs', {str(shown / 'sub')!r}], "
              "check=True)\nfrom podsrl.sandbox import Sandbox, SandboxLimits\n"
              f"with Sandbox(SandboxLimits(wall_s=20.0), read_only=({str(shown)!r},)) as box:\n"
              f"    done = box.run_python(\"open({str(shown / 'sub' / 'x')!r}, 'w')\")\n"
              "print(done.returncode, done.stderr.decode().splitlines()[-1])")
    done = subprocess.run(["unshare", "-m", "--propagation", "private", sys.executable, "-c", script],
                          capture_output=True, text=True, timeout=120)
    assert done.stdout.strip() == f"1 OSError: [Errno 30] Read-only file system: '{shown / 'sub' / 'x'}'", done


@pytest.mark.skipif(not FULL or launch.runner_id() is None, reason="needs isolation as root of the initial namespace")
def test_ids_that_cannot_be_mapped_end_the_call_at_once_with_the_reason(monkeypatch, tmp_path):
    monkeypatch.setattr(launch, "NOBODY", 2**32 - 1)  # no valid id outside: the kernel refuses the map
    (tmp_path / "scratch").mkdir()
    start = time.monotonic()
    done = launch.launch([sys.executable, "-I", "-S", "-c", "pass"], b"", {}, SandboxLimits(wall_s=20.0),
                         tmp_path / "scratch", isolated=True)
    assert (done.returncode, done.timed_out) == (126, False) and time.monotonic() - start < 10
    assert done.stderr == b"sandbox: cannot isolate: the user and group ids could not be mapped\n"
