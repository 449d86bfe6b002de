"""The `python` tool (podsrl/episodes/sandbox.py): the model's code runs in a separate process under CPU-time,
memory, output-size and wall-clock limits, without network, in a scratch directory removed after the call; a failure
or a limit reached is answered to the model and counted as a fault of the tool."""

from __future__ import annotations

import tempfile
import time
from dataclasses import replace
from pathlib import Path

import pytest

from podsrl.episodes import sandbox
from podsrl.episodes.formats import ToolCall
from podsrl.episodes.sandbox import SandboxError, SandboxLimits, python_tool, run_code
from podsrl.episodes.tools import call_tools
from podsrl.sandbox import isolation
from podsrl.sandbox.isolation import probe

LIMITS = SandboxLimits(cpu_s=1, wall_s=3.0, memory_bytes=256 * 2**20, max_output_bytes=1000)


def test_what_the_code_prints_is_the_answer():
    assert run_code("print(sum(range(10)))", LIMITS) == "45\n"


@pytest.mark.parametrize("code, reason", [
    ("1/0", "ZeroDivisionError: division by zero"),
    ("import sys; sys.exit(3)", "exit 3"),
    ("while True: pass", "more than 1 s of CPU time"),
    ("x = bytearray(10**9)", "more than 256 MiB of memory"),
    ("print('x' * 5000)", "more than 1000 bytes of output"),
    ("while True: print('y' * 100)", "more than 1000 bytes of output"),
    ("open('big', 'wb').write(b'z' * 100000)", "more than 1000 bytes of output"),
])
def test_failures_and_limits_are_named(code, reason):
    with pytest.raises(SandboxError, match=reason):  # a wall clock a loaded machine's CPU share cannot reach
        run_code(code, replace(LIMITS, wall_s=60.0))


def test_wall_clock_stops_the_code_and_what_it_started(tmp_path):
    mark = tmp_path / "late"
    code = f"import os, time\nif os.fork() == 0:\n    time.sleep(2.5)\n    open({str(mark)!r}, 'w').close()\n" \
           "time.sleep(30)"
    start = time.monotonic()
    with pytest.raises(SandboxError, match="ran past 1 s"):
        run_code(code, SandboxLimits(wall_s=1.0))
    assert time.monotonic() - start < 2.5
    time.sleep(2.0)
    assert not mark.exists()  # the forked child went with its group


@pytest.mark.parametrize("mode", ["isolated", "unisolated_namespace", "unisolated_refused_sockets"])
def test_no_network(monkeypatch, mode):
    """Isolated: its own network namespace. Unisolated (a machine without isolation, episode.sandbox: unisolated):
    `unshare -rn` where it works, else the socket module refuses."""
    if mode != "unisolated_refused_sockets" and not sandbox.network_namespace():
        pytest.skip("no unprivileged network namespace on this machine")
    if mode != "isolated":
        monkeypatch.setattr(isolation, "probe", lambda: "simulated: no user namespaces")
        monkeypatch.setitem(isolation._state, "allow_unisolated", True)
        monkeypatch.setattr(sandbox, "network_namespace", lambda: mode == "unisolated_namespace")
    code = "import socket\ns = socket.create_connection(('1.1.1.1', 53), timeout=2)\nprint('connected')"
    with pytest.raises(SandboxError, match="Network is unreachable|network access is disabled") as raised:
        run_code(code, LIMITS)
    assert "connected" not in str(raised.value)


def test_the_scratch_directory_is_the_working_directory_and_is_removed():
    before = set(Path(tempfile.gettempdir()).glob("podsrl-sandbox-*"))
    where = run_code("import os; open('f', 'w').write('x'); print(os.getcwd())", LIMITS).strip()
    assert where == "/scratch" if probe() is None else where.startswith(tempfile.gettempdir())
    assert set(Path(tempfile.gettempdir()).glob("podsrl-sandbox-*")) == before  # the host's copy is removed
    assert run_code("import os; print(os.environ.get('PYTHONPATH'))", LIMITS) == "None\n"


def test_a_fault_is_answered_to_the_model_and_counted():
    python = python_tool(LIMITS)
    ok, bad = call_tools([ToolCall("python", {"code": "print(6 * 7)"}), ToolCall("python", {"code": "1/0"})],
                         {"python": python}, timeout_s=30)
    assert (ok.content, ok.fault) == ("42\n", False)
    assert bad.fault and bad.content.startswith("error: python raised SandboxError: exit 1:")
    assert "ZeroDivisionError" in bad.content
