"""Attacks of model-written code on the run, each through the real `python` tool (podsrl/episodes/sandbox.py), each
of which must fail: files planted outside the scratch directory keep their hash, the calling process (the trainer)
survives, other processes are untouched, and nothing the code started outlives the call.

Where the calling process could die (the code signals its parent), the call is made by a separate trainer process
(`trainer`), so that a successful attack kills that process, not the tests. CI runs as root: file permissions alone
stop nothing there, so every write and read below is stopped by the mount isolation or not at all.
"""

from __future__ import annotations

import hashlib
import os
import signal
import site
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path

import pytest

from podsrl.episodes.sandbox import SandboxError, SandboxLimits, run_code
from podsrl.sandbox.isolation import probe

pytestmark = pytest.mark.skipif(probe() is not None, reason=f"this machine cannot isolate: {probe()}")
LIMITS = SandboxLimits(wall_s=20.0)  # a loaded machine's CPU share still finishes every attack well within it
REPO = Path(__file__).parents[2]


def sha(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def attempt(code: str) -> str:
    """What the attack printed, or the sandbox's error: the attack's own outcome does not matter, its effects do."""
    try:
        return run_code(code, LIMITS)
    except SandboxError as e:
        return f"SandboxError: {e}"


def trainer(code: str, *argv: str) -> subprocess.CompletedProcess:
    """`code` run through the python tool by a trainer process of its own (`argv`: its extra arguments)."""
    script = ("import sys\nfrom podsrl.episodes.sandbox import SandboxError, SandboxLimits, run_code\n"
              "try:\n    print(run_code(sys.stdin.read(), SandboxLimits(wall_s=20.0)))\n"
              "except SandboxError as e:\n    print('SandboxError:', e)\nprint('trainer alive')\n")
    return subprocess.run([sys.executable, "-c", script, *argv], input=code, capture_output=True, text=True,
                          timeout=120, env={**os.environ, "PYTHONPATH": str(REPO)})


def planted(path: Path, text: str = "def reward(completion, answer):\n    return float(completion == answer)\n"):
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    return path, sha(path)


def overwrite(path: Path) -> str:
    return f"open({str(path)!r}, 'w').write('def reward(c, a): return 1.0')\nprint('written')"


def test_the_reward_file_cannot_be_rewritten(tmp_path):
    path, digest = planted(tmp_path / "reward.py")
    attempt(overwrite(path))
    assert sha(path) == digest


def test_the_run_directory_cannot_be_written(tmp_path):
    path, digest = planted(tmp_path / "runs" / "demo" / "checkpoints" / "step_4" / "state.json", "{}")
    attempt(overwrite(path) + f"\nopen({str(path.parent.parent / 'step_99')!r}, 'w').write('x')")
    assert sha(path) == digest and not (path.parent.parent / "step_99").exists()


def test_site_packages_cannot_be_written():
    path, digest = planted(Path(site.getsitepackages()[0]) / f"podsrl_attack_{uuid.uuid4().hex}.py", "x = 1\n")
    try:
        attempt(overwrite(path))
        assert sha(path) == digest
    finally:
        path.unlink()


def test_the_system_temp_directory_cannot_be_written():
    path, digest = planted(Path(tempfile.gettempdir()) / f"podsrl-attack-{uuid.uuid4().hex}", "kept\n")
    try:
        out = attempt("import tempfile, os\nprint(os.listdir(tempfile.gettempdir()))\n" + overwrite(path))
        assert sha(path) == digest and path.name not in out  # nor is the host's temp directory listed inside
    finally:
        path.unlink()


def test_the_home_directory_cannot_be_read():
    secret = uuid.uuid4().hex
    path, _ = planted(Path.home() / f".podsrl-attack-{uuid.uuid4().hex}", secret)
    try:
        out = attempt(f"import os\ntry:\n    print(open({str(path)!r}).read())\nexcept OSError:\n    pass\n"
                      f"print(os.listdir({str(Path.home())!r}))")
        assert secret not in out and path.name not in out
    finally:
        path.unlink()


def test_the_parent_cannot_be_killed():
    done = trainer("import os, signal\nos.kill(os.getppid(), signal.SIGKILL)\nprint('sent')")
    assert done.returncode == 0 and "trainer alive" in done.stdout


def test_the_parent_cannot_be_traced():
    code = ("import ctypes, os\nlibc = ctypes.CDLL(None, use_errno=True)\n"
            "print('attached' if libc.ptrace(16, os.getppid(), 0, 0) == 0 else 'refused', ctypes.get_errno())")
    done = trainer(code)
    assert done.returncode == 0 and "trainer alive" in done.stdout and "attached" not in done.stdout


def test_another_process_cannot_be_signalled():
    victim = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        attempt(f"import os, signal\nos.kill({victim.pid}, signal.SIGKILL)\nprint('sent')")
        time.sleep(0.2)
        assert victim.poll() is None
    finally:
        victim.kill()
        victim.wait()


def running(marker: str) -> list[int]:
    """The host's processes whose command line holds `marker`."""
    found = []
    for entry in Path("/proc").iterdir():
        try:
            if entry.name.isdigit() and marker.encode() in (entry / "cmdline").read_bytes():
                found.append(int(entry.name))
        except OSError:  # gone meanwhile
            pass
    return found


@pytest.mark.parametrize("escape", ["setsid", "daemon"])
def test_nothing_outlives_the_call(escape):
    marker = f"{time.time_ns() % 10**9}.{os.getpid()}"  # a sleep no other process has
    detach = "os.setsid()" + ("" if escape == "setsid" else "\n    if os.fork() != 0:\n        os._exit(0)")
    code = (f"import os\nif os.fork() == 0:\n    {detach}\n    os.execv('/bin/sleep', ['sleep', {marker!r}])\n"
            "print('started')")
    attempt(code)
    time.sleep(0.5)
    alive = running(marker)
    for pid in alive:
        os.kill(pid, signal.SIGKILL)
    assert not alive


def test_a_fork_bomb_is_bounded():
    code = ("import os, time\nmade = 0\nfor _ in range(300):\n    try:\n        pid = os.fork()\n"
            "    except OSError:\n        break\n    if pid == 0:\n        time.sleep(5)\n        os._exit(0)\n"
            "    made += 1\nprint(made)")
    out = attempt(code)
    assert out.strip().isdigit() and int(out) < 64, out  # SandboxLimits.max_processes


def test_the_disk_cannot_be_filled():
    chunk = 12 * 2**10  # under the per-file limit, so only the scratch space stops it
    code = (f"import os\nwritten = 0\ntry:\n    while written < {96 * 2**20}:\n"
            f"        with open(f'f{{written}}', 'wb') as f:\n            f.write(b'x' * {chunk})\n"
            f"        written += {chunk}\nexcept OSError:\n    pass\nprint(written)")
    out = attempt(code)
    assert out.strip().isdigit() and int(out) <= 64 * 2**20, out


@pytest.mark.parametrize("link", ["symlink", "link"])
def test_a_link_cannot_reach_out_of_scratch(tmp_path, link):
    path, digest = planted(tmp_path / "reward.py")
    out = attempt(f"import os\nos.{link}({str(path)!r}, 'l')\nprint(open('l').read())\n"
                  "open('l', 'w').write('def reward(c, a): return 1.0')")
    assert sha(path) == digest and "completion == answer" not in out


def test_the_parent_and_other_processes_are_not_visible_in_proc():
    marker = uuid.uuid4().hex  # on the trainer's command line
    code = ("import os\nfor pid in filter(str.isdigit, os.listdir('/proc')):\n    try:\n"
            "        line = open(f'/proc/{pid}/cmdline', 'rb').read()\n    except OSError:\n        continue\n"
            "    if pid == str(os.getppid()) or b'run_code' in line:\n        print(line)")
    done = trainer(code, marker)
    assert "trainer alive" in done.stdout and marker not in done.stdout


def test_a_socket_cannot_reach_the_host(tmp_path):
    import socket

    server = socket.socket(socket.AF_UNIX)
    server.bind(str(tmp_path / "s"))
    server.listen()
    server.settimeout(0.5)
    try:
        attempt(f"import socket\ns = socket.socket(socket.AF_UNIX)\ns.connect({str(tmp_path / 's')!r})\n"
                "s.sendall(b'hello')")
        with pytest.raises(TimeoutError):
            server.accept()
    finally:
        server.close()


def test_environment_secrets_are_not_visible(monkeypatch):
    secret = uuid.uuid4().hex
    monkeypatch.setenv("PODSRL_ATTACK_SECRET", secret)
    code = ("import os\nprint(dict(os.environ))\nfor pid in ['self', '1', str(os.getppid())]:\n    try:\n"
            "        print(open(f'/proc/{pid}/environ', 'rb').read())\n    except OSError:\n        pass")
    assert secret not in attempt(code)


def test_the_code_has_no_capabilities_and_cannot_get_them_back():
    code = ("import ctypes\nlibc = ctypes.CDLL(None, use_errno=True)\n"
            "print([line for line in open('/proc/self/status') if line.startswith('CapEff')][0].split()[1])\n"
            "print('unshared' if libc.unshare(0x10000000) == 0 else 'refused')")  # a user namespace of its own
    assert attempt(code).split() == ["0000000000000000", "refused"]
