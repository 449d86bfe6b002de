"""Real `python -m podsrl` processes without paying the torch/transformers import each time.

A zygote process (`python -m tests.faults.launcher`) imports podsrl's trainer once, then forks one child per
request; the child sets its environment, cwd and output files, and runs the `podsrl` module as `__main__`, exactly
what `python -m podsrl ...` runs, and exits with its exit code (an uncaught exception prints its traceback and
exits 1, as Python would). The zygote runs nothing but imports before forking, so no thread or lock is inherited.
Children are ordinary processes: the tests send them SIGKILL / SIGTERM / SIGINT by pid.

Protocol (JSON lines): request {"argv", "env", "cwd", "out", "err", "fsize", "module", "interpreter_exit"} on the
zygote's stdin; it answers {"pid"} at once and {"exited": pid, "code"} when that child ends (code < 0: killed by
signal -code). `module` is run instead of `podsrl` (a test harness around its CLI); with `interpreter_exit` the
child ends as an interpreter does (waiting for its non-daemon threads, then its atexit functions) rather than at
once after its atexit functions.
"""

from __future__ import annotations

import json
import os
import select
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from tests.checkout import pythonpath

REPO = Path(__file__).resolve().parents[2]


# ------------------------------------------------------------------------------------------------ zygote side


def _child(request: dict) -> None:
    """Runs in the forked child; never returns (with `interpreter_exit`, raises SystemExit out of the zygote's
    loop, so the child's interpreter shuts down as any process's does)."""
    code = 1
    interpreter_exit = bool(request.get("interpreter_exit"))
    try:
        signal.signal(signal.SIGINT, signal.default_int_handler)
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        os.chdir(request["cwd"])
        os.environ.update(request.get("env") or {})
        for fd, path in ((1, request["out"]), (2, request["err"])):
            target = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
            os.dup2(target, fd)
            os.close(target)
        null = os.open(os.devnull, os.O_RDONLY)
        os.dup2(null, 0)
        os.close(null)
        if request.get("fsize"):  # a file-size limit: writes past it fail with EFBIG, like a full disk
            import resource

            signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
            resource.setrlimit(resource.RLIMIT_FSIZE, (request["fsize"], request["fsize"]))
        import runpy

        sys.argv = ["podsrl", *request["argv"]]
        try:
            runpy.run_module(request.get("module") or "podsrl", run_name="__main__", alter_sys=True)
            code = 0
        except SystemExit as e:
            if e.code is None or isinstance(e.code, int):
                code = e.code or 0
            else:
                print(e.code, file=sys.stderr)
                code = 1
        except BaseException:  # noqa: BLE001 - what the interpreter would do with an uncaught exception
            sys.excepthook(*sys.exc_info())
            code = 1
        if not interpreter_exit:
            import atexit

            atexit._run_exitfuncs()
    finally:
        try:
            sys.stdout.flush()
            sys.stderr.flush()
        finally:
            if not interpreter_exit:
                os._exit(code)
    raise SystemExit(code)


def zygote_main() -> None:
    import torch

    torch.set_num_threads(1)  # children share 2 cores with the test runner; results are per-thread-count exact
    import podsrl.cli
    import podsrl.run.trainer  # noqa: F401

    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C of the test run is for pytest
    print(json.dumps({"ready": os.getpid()}), flush=True)
    children: set[int] = set()
    buffer = b""
    stdin = sys.stdin.buffer.raw
    while True:
        readable, _, _ = select.select([stdin], [], [], 0.05)
        if readable:
            chunk = os.read(stdin.fileno(), 65536)
            if not chunk:
                break
            buffer += chunk
            while b"\n" in buffer:
                line, buffer = buffer.split(b"\n", 1)
                request = json.loads(line)
                sys.stdout.flush()
                sys.stderr.flush()
                pid = os.fork()
                if pid == 0:
                    _child(request)
                children.add(pid)
                print(json.dumps({"pid": pid}), flush=True)
        for pid in list(children):
            done, status = os.waitpid(pid, os.WNOHANG)
            if done:
                children.discard(pid)
                code = -os.WTERMSIG(status) if os.WIFSIGNALED(status) else os.WEXITSTATUS(status)
                print(json.dumps({"exited": pid, "code": code}), flush=True)
    for pid in children:
        os.kill(pid, signal.SIGKILL)


# ------------------------------------------------------------------------------------------------ test side


@dataclass
class Result:
    code: int
    stdout: str
    stderr: str


class Child:
    def __init__(self, launcher: Launcher, pid: int, out: Path, err: Path) -> None:
        self.launcher, self.pid, self.out, self.err = launcher, pid, out, err

    def signal(self, signum: int) -> None:
        try:
            os.kill(self.pid, signum)
        except ProcessLookupError:
            pass

    def poll(self) -> int | None:
        return self.launcher._poll(self.pid, 0.0)

    def wait(self, timeout: float = 300.0) -> Result:
        code = self.launcher._poll(self.pid, timeout)
        if code is None:
            self.signal(signal.SIGKILL)
            code = self.launcher._poll(self.pid, 30.0)
            raise TimeoutError(f"podsrl child {self.pid} ran past {timeout} s; stderr:\n{self.stderr()[-3000:]}")
        return Result(code, self.out.read_text(errors="replace"), self.stderr())

    def stderr(self) -> str:
        return self.err.read_text(errors="replace") if self.err.exists() else ""


class Launcher:
    """Starts `podsrl` CLI processes through the zygote; one per test session."""

    def __init__(self, workdir: Path) -> None:
        self.workdir = Path(workdir)
        self.workdir.mkdir(parents=True, exist_ok=True)
        env = {**os.environ, "PYTHONPATH": pythonpath(), "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}
        env.pop("PODSRL_FAULTS", None)
        self.proc = subprocess.Popen([sys.executable, "-m", "tests.faults.launcher"], cwd=REPO, env=env,
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE)
        self._exited: dict[int, int] = {}
        self._buffer = b""
        self._count = 0
        message = self._read(300.0)
        if message is None or "ready" not in message:
            raise RuntimeError("the podsrl zygote did not start")

    def _read(self, timeout: float) -> dict | None:
        deadline = time.monotonic() + timeout
        fd = self.proc.stdout.fileno()
        while b"\n" not in self._buffer:
            if not select.select([fd], [], [], max(0.0, deadline - time.monotonic()))[0]:
                return None
            chunk = os.read(fd, 65536)
            if not chunk:
                raise RuntimeError("the podsrl zygote died")
            self._buffer += chunk
        line, self._buffer = self._buffer.split(b"\n", 1)
        return json.loads(line)

    def start(self, argv: list[str], env: dict[str, str] | None = None, cwd: Path | None = None,
              fsize: int | None = None, module: str | None = None, interpreter_exit: bool = False) -> Child:
        self._count += 1
        out, err = self.workdir / f"{self._count}.out", self.workdir / f"{self._count}.err"
        request = {"argv": [str(a) for a in argv], "env": env or {}, "cwd": str(cwd or REPO), "out": str(out),
                   "err": str(err), "fsize": fsize, "module": module, "interpreter_exit": interpreter_exit}
        self.proc.stdin.write((json.dumps(request) + "\n").encode())
        self.proc.stdin.flush()
        while True:
            message = self._read(60.0)
            if message is None:
                raise RuntimeError("the podsrl zygote did not answer")
            if "pid" in message:
                return Child(self, message["pid"], out, err)
            self._exited[message["exited"]] = message["code"]

    def run(self, argv: list[str], env: dict[str, str] | None = None, timeout: float = 300.0, **kw) -> Result:
        return self.start(argv, env, **kw).wait(timeout)

    def _poll(self, pid: int, timeout: float) -> int | None:
        deadline = time.monotonic() + timeout
        while pid not in self._exited:
            message = self._read(max(0.0, deadline - time.monotonic()))
            if message is None:
                return None
            if "exited" in message:
                self._exited[message["exited"]] = message["code"]
        return self._exited[pid]

    def close(self) -> None:
        self.proc.stdin.close()
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.proc.kill()


if __name__ == "__main__":
    zygote_main()
