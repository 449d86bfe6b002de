"""Soak test: a longer run with faults injected at random, against the same run left alone.

    python benchmarks/soak.py                      # 40 steps, 10 interruptions, real `python -m podsrl` processes
    python benchmarks/soak.py --fast --kills 20    # processes forked from a pre-imported parent (seconds each)

Faults: SIGKILL at random wall times and inside random checkpoint phases (PODSRL_FAULTS kill@ckpt_*), SIGTERM
(must save and exit 0), a reward function that raises / hangs / returns NaN, None, strings or the wrong count on
a quarter of calls (policy zero), and NaN losses at random steps. Reward and NaN faults are a fixed function of the run
(content hashes, step numbers), so the reference run meets the same ones; only the interruptions differ. Prints the
faults injected and survived, the steps each kill lost (must be <= train.save_every) and whether the final
metrics and weights equal the uninterrupted run's.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from podsrl.reporting.tracking import read_metrics
from podsrl.run.checkpoint import latest_checkpoint
from podsrl.run.faults import SITES

CKPT_SITES = [s for s in SITES if s.startswith("ckpt_")]


class Proc:
    """A real `python -m podsrl` subprocess."""

    def __init__(self, argv: list[str], env: dict[str, str], log: Path) -> None:
        self.log = log
        with open(log, "w") as f:
            self.p = subprocess.Popen([sys.executable, "-m", "podsrl", *argv], cwd=REPO, stdout=f, stderr=f,
                                      env={**os.environ, "PYTHONPATH": str(REPO), **env})

    def poll(self) -> int | None:
        return self.p.poll()

    def signal(self, signum: int) -> None:
        if self.p.poll() is None:
            self.p.send_signal(signum)

    def wait(self) -> int:
        return self.p.wait(timeout=1800)


class ForkedProc:
    """The same command forked from the tests' pre-imported launcher."""

    launcher = None

    def __init__(self, argv: list[str], env: dict[str, str], log: Path) -> None:
        self.child = self.launcher.start(argv, env)

    def poll(self) -> int | None:
        return self.child.poll()

    def signal(self, signum: int) -> None:
        self.child.signal(signum)

    def wait(self) -> int:
        return self.child.wait(1800).code


def overrides(run: Path, cache: Path, args) -> list[str]:
    flaky = f"{REPO / 'benchmarks' / 'soak_rewards.py'}:flaky"
    values = {
        "output_dir": run, "seed": args.seed, "warmup.cache_dir": cache, "warmup.steps": 30, "warmup.batch_size": 16,
        "model.tiny.num_layers": 1, "model.tiny.hidden_size": 32, "model.tiny.num_heads": 2,
        "model.tiny.intermediate_size": 64, "task.args": "{operands: 2, digits: 1}", "task.eval_size": 16,
        "eval.samples": 0, "rollout.prompts_per_step": 4, "rollout.n": 8, "rollout.max_new_tokens": 6,
        "method": "pods", "pods.m": 4, "optim.lr": 0.01,
        "rewards": f"[{{name: correct}}, {{name: flaky, function: '{flaky}'}}]", "reward_on_error": "zero",
        "reward_timeout": 0.2, "train.max_steps": args.steps, "train.save_every": args.save_every,
        "train.eval_every": 10, "train.keep_checkpoints": 2, "train.max_nonfinite_steps": 3,
        "log.progress": False, "log.tensorboard": False, "log.plot": False,
    }
    return [f"{k}={v}" for k, v in values.items()]


def checkpoint_step(run: Path) -> int:
    path = latest_checkpoint(run)
    return int(path.name.removeprefix("step-")) if path else 0


def last_step(run: Path) -> int:
    return max((r["step"] for r in read_metrics(run / "metrics.jsonl") if "reward" in r), default=0)


def comparable(run: Path) -> list[dict]:
    return [{k: v for k, v in r.items() if not k.startswith("time/")} for r in read_metrics(run / "metrics.jsonl")]


def weights_equal(a: Path, b: Path) -> bool:
    import torch
    from safetensors.torch import load_file

    wa = load_file(latest_checkpoint(a) / "model" / "model.safetensors")
    wb = load_file(latest_checkpoint(b) / "model" / "model.safetensors")
    return wa.keys() == wb.keys() and all(torch.equal(wa[k], wb[k]) for k in wa)


def nan_steps(rng: random.Random, steps: int, count: int) -> list[int]:
    """Random steps for NaN losses, never three in a row (that would stop the run by design)."""
    chosen: set[int] = set()
    while len(chosen) < count:
        s = rng.randint(2, steps)
        if not {s - 1, s + 1} & chosen:
            chosen.add(s)
    return sorted(chosen)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--save-every", type=int, default=4)
    parser.add_argument("--kills", type=int, default=10, help="interruptions (SIGKILL or SIGTERM)")
    parser.add_argument("--nan-steps", type=int, default=3)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--reward-fault-rate", type=float, default=0.25, help="share of reward calls that fail")
    parser.add_argument("--fast", action="store_true", help="fork from a pre-imported parent instead of exec")
    parser.add_argument("--workdir", type=Path, default=None)
    args = parser.parse_args()
    rng = random.Random(args.seed)
    work = args.workdir or Path(tempfile.mkdtemp(prefix="podsrl-soak-"))
    work.mkdir(parents=True, exist_ok=True)
    cache, ref, run = work / "warmup", work / "reference", work / "soak"
    make = Proc
    if args.fast:
        from tests.faults.launcher import Launcher

        ForkedProc.launcher = Launcher(work / "launcher")
        make = ForkedProc
    nans = nan_steps(rng, args.steps, args.nan_steps)
    env = {"PODSRL_FAULTS": f"nan@loss:{','.join(map(str, nans))}",
           "SOAK_REWARD_FAULT_RATE": str(args.reward_fault_rate)}
    train = ["train", "--config", "grpo"]

    t0 = time.perf_counter()
    p, first_step = make(train + overrides(ref, cache, args), env, work / "reference.log"), None
    while p.poll() is None:  # also times the start-up (imports, model load) to aim the random kills
        if first_step is None and last_step(ref) >= 1:
            first_step = time.perf_counter() - t0
        time.sleep(0.02)
    assert p.wait() == 0, (work / "reference.log").read_text()[-3000:]
    ref_seconds = time.perf_counter() - t0
    per_step = (ref_seconds - (first_step or 0)) / max(1, args.steps - 1)
    startup = max(0.0, (first_step or 0) - per_step)

    injected: dict[str, int] = {}
    lost: list[int] = []
    attempts = 0
    t0 = time.perf_counter()
    while True:
        attempts += 1
        argv = ["train", "--resume", str(run)] if (run / "config.yaml").is_file() else train + overrides(
            run, cache, args)
        start, interrupt = checkpoint_step(run), len(lost) < args.kills
        faults, how = env["PODSRL_FAULTS"], None
        if interrupt and rng.random() < 0.4 and start + args.save_every <= args.steps:
            site = rng.choice(CKPT_SITES)  # inside a checkpoint write that this attempt will reach
            last = min(args.steps, start + 3 * args.save_every)  # one of the next three checkpoints
            step = rng.randrange(start + args.save_every, last + 1, args.save_every)
            faults, how = f"{faults} kill@{site}:{step}", f"kill@{site}"
        p = make(argv, {**env, "PODSRL_FAULTS": faults}, work / f"attempt{attempts}.log")
        if interrupt and how is None:
            if rng.random() < 0.2:  # while starting up or resuming (imports, loading, rewriting metrics)
                time.sleep(rng.uniform(0, startup))
            else:  # somewhere in the next three checkpoint intervals: the run takes several attempts to finish
                while p.poll() is None and last_step(run) <= start:  # start-up time varies a lot: wait it out
                    time.sleep(0.01)
                time.sleep(rng.uniform(0, min(args.steps - start, 3 * args.save_every) * per_step))
            how = "sigterm" if rng.random() < 0.25 else "sigkill (random time)"
            p.signal(signal.SIGTERM if how == "sigterm" else signal.SIGKILL)
        code = p.wait()
        print(f"attempt {attempts}: from step {start}, {how or 'left alone'} -> exit {code}, "
              f"logged up to step {last_step(run)}, checkpoint {checkpoint_step(run)}", file=sys.stderr)
        if code == 0 and (run / "summary.json").is_file():
            if how is not None:  # delivered as the run was ending: it finished normally
                injected[how] = injected.get(how, 0) + 1
            break
        # Expected endings: SIGKILL; SIGTERM -> checkpoint and exit 0 (or 130 if it came before training began).
        expected = {-signal.SIGKILL} if how != "sigterm" else {0, 130}
        if how is None or code not in expected:
            raise SystemExit(f"attempt {attempts} ({how}) ended with {code}: {work / f'attempt{attempts}.log'}")
        injected[how] = injected.get(how, 0) + 1
        if code == 0 and last_step(run) != checkpoint_step(run):
            raise SystemExit(f"SIGTERM at step {last_step(run)} saved only step {checkpoint_step(run)}")
        lost.append(last_step(run) - checkpoint_step(run))
    soak_seconds = time.perf_counter() - t0

    steps = [r for r in read_metrics(run / "metrics.jsonl") if "reward" in r]
    reward_faults = {k: int(sum(r.get(f"rewards/flaky/{k}") or 0 for r in steps)) for k in ("errors", "timeouts",
                                                                                          "invalid")}
    faulty_calls = sum(1 for r in steps if any(r.get(f"rewards/flaky/{k}") for k in reward_faults))
    skipped = int(sum(r.get("train/nonfinite_skipped") or 0 for r in steps))
    same_metrics = comparable(run) == comparable(ref)
    same_weights = weights_equal(run, ref)
    finished = same_metrics and same_weights
    interruptions = sum(injected.values())
    report = {
        "steps": args.steps, "save_every": args.save_every, "attempts": attempts,
        "faults_injected": {**injected, "nan_loss_steps": len(nans), "faulty_reward_calls": faulty_calls},
        "faulty_reward_values": reward_faults,
        # Survived: each interruption was resumed and each NaN step / faulty reward call was absorbed, and the
        # run still ended exactly where the uninterrupted one did.
        "faults_survived": (interruptions + skipped + faulty_calls) if finished else 0,
        "faults_total": interruptions + len(nans) + faulty_calls,
        "steps_lost_per_interruption": lost,
        "max_steps_lost": max(lost, default=0),
        "steps_lost_within_interval": all(n <= args.save_every for n in lost),
        "final_metrics_match": same_metrics,
        "final_weights_match": same_weights,
        "seconds": {"reference": round(ref_seconds, 1), "soak": round(soak_seconds, 1)},
        "workdir": str(work),
    }
    print(json.dumps(report, indent=1))
    if ForkedProc.launcher is not None:
        ForkedProc.launcher.close()
    if not (same_metrics and same_weights and report["steps_lost_within_interval"]):
        raise SystemExit(1)


if __name__ == "__main__":
    main()
