"""The compare runner (podsrl/experiments/runner.py): a fake trainer stands in for `python -m podsrl`; runs that
finished are skipped, interrupted ones resumed, a failing one does not stop the others, a run another process holds
is left alone."""

from __future__ import annotations

import argparse
import io
import json
import os
import sys
import textwrap
from pathlib import Path

import pytest
import yaml
from rich.console import Console

from podsrl.config.presets import PRESET_DIR
from podsrl.errors import UserError
from podsrl.experiments import runner
from podsrl.experiments.report import add_report_arguments, report_main
from podsrl.experiments.runner import (
    CompareResult,
    add_compare_arguments,
    compare_main,
    run_compare,
    train_argv,
)
from podsrl.run.lock import RunLock

FAKE_TRAINER = textwrap.dedent('''
    """Stands in for `python -m podsrl`: records its argv, writes a synthetic run following the contract."""
    import json, sys
    from pathlib import Path
    import yaml
    argv = sys.argv[1:]
    assert argv[:2] == ["train", "--config"], argv
    config = yaml.safe_load(Path(argv[2]).read_text())
    resume = "--resume" in argv
    kv = dict(a.split("=", 1) for a in argv if "=" in a)
    run_dir, seed = Path(kv["output_dir"]), int(kv["seed"])
    with (run_dir.parent.parent / "calls.jsonl").open("a") as f:
        f.write(json.dumps(argv) + "\\n")
    if config.get("fail"):
        print("boom: simulated trainer failure", file=sys.stderr)
        sys.exit(3)
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "config.yaml").write_text(yaml.safe_dump({"seed": seed, "output_dir": str(run_dir)}))
    budget = float(kv["train.max_seconds"])
    with (run_dir / "metrics.jsonl").open("a") as f:
        for step in range(5):
            acc = min(1.0, 0.1 + config["slope"] * step + 0.01 * seed)
            t = budget * step / 4
            f.write(json.dumps({"step": step, "time/elapsed": t, "time/generate": 0.5,
                                "total/tokens_trained": 10 * step}) + "\\n")
            f.write(json.dumps({"step": step, "time/elapsed": t, "eval/accuracy": acc,
                                "total/tokens_trained": 10 * step}) + "\\n")
    (run_dir / "summary.json").write_text(json.dumps({"resumed": resume}))
''')


@pytest.fixture
def fake(tmp_path):
    script = tmp_path / "fake_trainer.py"
    script.write_text(FAKE_TRAINER)
    configs = {}
    for name, body in {"grpo": {"slope": 0.1}, "pods": {"slope": 0.2}, "broken": {"fail": True}}.items():
        configs[name] = tmp_path / f"{name}.yaml"
        configs[name].write_text(yaml.safe_dump(body))
    return [sys.executable, str(script)], configs


def calls(out: Path) -> list[list[str]]:
    path = out / "calls.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def test_run_compare_runs_skips_and_resumes(tmp_path, fake):
    cmd, cfg = fake
    out = tmp_path / "out"
    console = Console(file=io.StringIO(), width=120)
    kw = {"budget_seconds": 40, "extra_overrides": ["rollout.n=8"], "train_command": cmd, "console": console}
    res = run_compare([cfg["grpo"], cfg["pods"]], [1, 2], out, progress=True, **kw)
    assert res.ok and [o.status for o in res.outcomes] == ["finished"] * 4
    got = calls(out)
    assert [(Path(c[2]).stem, c[3]) for c in got] == [
        ("grpo", "seed=1"),
        ("pods", "seed=1"),
        ("grpo", "seed=2"),
        ("pods", "seed=2"),
    ]  # seed-major
    assert got[0][3:] == [
        "seed=1",
        f"output_dir={out / 'grpo' / 'seed1'}",
        "train.max_seconds=40",
        "rollout.n=8",
    ]
    assert all("--resume" not in c for c in got)
    assert {r["config"] for r in res.rows} == {"grpo", "pods"} and res.rows[1]["speedup_mean"] > 1
    assert (out / "results.md").read_text().startswith("# podsrl compare")
    assert (out / "accuracy.png").is_file() and (out / "results.csv").is_file()

    res2 = run_compare([cfg["grpo"], cfg["pods"]], [1, 2], out, progress=False, **kw)
    assert [o.status for o in res2.outcomes] == ["skipped"] * 4 and len(calls(out)) == 4 and res2.ok

    # interrupted run: checkpoint, partial metrics, no summary -> resumed with --resume
    run_dir = out / "pods" / "seed2"
    (run_dir / "summary.json").unlink()
    (run_dir / "checkpoints" / "step_2").mkdir(parents=True)
    # unfinished run without checkpoint -> started over, partial dir moved aside
    (out / "grpo" / "seed1" / "summary.json").unlink()
    res3 = run_compare([cfg["grpo"], cfg["pods"]], [1, 2], out, progress=False, **kw)
    assert [o.status for o in res3.outcomes] == ["finished", "skipped", "skipped", "resumed"]
    new = calls(out)[4:]
    assert len(new) == 2 and "--resume" not in new[0]
    assert new[1][3:5] == ["--resume", str(run_dir)] and "train.max_seconds=40" in new[1]
    assert (out / "grpo" / ".seed1.stale1" / "metrics.jsonl").is_file()
    assert json.loads((run_dir / "summary.json").read_text()) == {"resumed": True}


def test_failing_run_does_not_stop_the_others(tmp_path, fake):
    cmd, cfg = fake
    out = tmp_path / "out"
    parser = argparse.ArgumentParser()
    add_compare_arguments(parser)
    args = parser.parse_args(
        [
            str(cfg["grpo"]),
            str(cfg["broken"]),
            str(cfg["pods"]),
            "algo.beta=0",
            "--seeds",
            "1",
            "2",
            "--out",
            str(out),
            "--budget-rollouts",
            "100",
            "--train-command",
            " ".join(cmd),
            "--no-progress",
            "--smooth",
            "1",
        ]
    )
    assert args.items[-1] == "algo.beta=0"
    res = run_compare(
        [cfg["grpo"], cfg["broken"], cfg["pods"]],
        [1, 2],
        out,
        budget_seconds=8,
        train_command=cmd,
        progress=False,
        console=Console(file=io.StringIO()),
    )
    assert len(calls(out)) == 6 and not res.ok
    assert [(o.label, o.seed, o.returncode) for o in res.failures] == [("broken", 1, 3), ("broken", 2, 3)]
    assert "boom: simulated trainer failure" in res.failures[0].log_path.read_text()
    assert [r["config"] for r in res.rows] == ["grpo", "pods"]
    # the CLI entry point: finished runs are skipped, the broken ones fail again -> exit code 1
    assert compare_main(args) == 1
    assert len(calls(out)) == 8 and all("train.max_rollouts=100" in c for c in calls(out)[6:])
    with pytest.raises(UserError, match="no such file"):
        run_compare([tmp_path / "missing.yaml"], [1], out)



def test_compare_leaves_a_run_another_process_writes_and_report_reads_while_it_writes(tmp_path, fake, capsys):
    cmd, cfg = fake
    out = tmp_path / "out"
    kw = {"budget_seconds": 8, "train_command": cmd, "progress": False, "console": Console(file=io.StringIO())}
    busy = out / "grpo" / "seed1"
    (busy / "checkpoints" / "step-00000002").mkdir(parents=True)  # a run in progress, with its first checkpoint
    records = [{"step": s, "time/elapsed": 2.0 * s, "eval/accuracy": 0.1 * s, "total/tokens_trained": 10 * s}
               for s in range(3)]
    (busy / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records) + '{"step": 3, "ti')
    with RunLock(busy):
        res = run_compare([cfg["grpo"], cfg["pods"]], [1], out, **kw)
        assert [(o.label, o.status) for o in res.outcomes] == [("grpo", "failed"), ("pods", "finished")]
        assert f"is in use by another podsrl process (pid {os.getpid()} on host " in res.failures[0].message
        assert [Path(c[2]).stem for c in calls(out)] == ["pods"]  # the busy run was neither started nor moved
        assert (busy / "checkpoints" / "step-00000002").is_dir()
        # `podsrl report` reads the runs, the busy one included, without taking their locks
        parser = argparse.ArgumentParser()
        add_report_arguments(parser)
        assert report_main(parser.parse_args([str(out), "--smooth", "1", "--out", str(tmp_path / "report")])) == 0
        assert "grpo" in (tmp_path / "report" / "results.md").read_text()
    res = run_compare([cfg["grpo"], cfg["pods"]], [1], out, **kw)  # once free, compare resumes it
    assert [o.status for o in res.outcomes] == ["resumed", "skipped"] and "--resume" in calls(out)[-1]

def test_train_argv():
    argv = train_argv(["py", "-m", "podsrl"], Path("c.yaml"), 3, Path("o/c/seed3"), 12.5, 1000, ["a=1"], True)
    assert argv == [
        "py",
        "-m",
        "podsrl",
        "train",
        "--config",
        "c.yaml",
        "--resume",
        "o/c/seed3",
        "seed=3",
        "output_dir=o/c/seed3",
        "train.max_seconds=12.5",
        "train.max_rollouts=1000",
        "a=1",
    ]


def test_compare_takes_preset_names_as_train_does(tmp_path, monkeypatch):
    taken = []
    monkeypatch.setattr(runner, "run_compare", lambda configs, *a, **k: taken.extend(configs) or CompareResult())
    parser = argparse.ArgumentParser()
    add_compare_arguments(parser)
    assert compare_main(parser.parse_args(["grpo", "pods", "rollout.n=8", "--out", str(tmp_path)])) == 0
    assert taken == [PRESET_DIR / "grpo.yaml", PRESET_DIR / "pods.yaml"]
    with pytest.raises(UserError, match=r"^podsrl compare: no file 'gpro' and no bundled preset of that name"):
        compare_main(parser.parse_args(["gpro", "--out", str(tmp_path)]))


def test_the_side_named_before_the_runs_binds_every_later_compare_and_report(tmp_path, fake, capsys):
    """`--expect` is fixed with a folder's first runs: recorded in expect.json and the header, kept by a resumed
    compare and by `podsrl report` without the flag, and another side refused with one line (exit 2)."""
    cmd, cfg = fake
    out = tmp_path / "out"
    kw = {"budget_seconds": 8, "train_command": cmd, "progress": False, "console": Console(file=io.StringIO())}
    run_compare([cfg["grpo"], cfg["pods"]], [1, 2], out, report_options={"expect": "worse"}, **kw)
    assert json.loads((out / "expect.json").read_text()) == {"expect": "worse"}
    assert "- side named before the runs: worse (one-sided tests)" in (out / "results.md").read_text()
    resumed = run_compare([cfg["grpo"], cfg["pods"]], [1, 2], out, **kw)  # no --expect: the recorded side
    assert resumed.ok and "one-sided p for worse (Holm)" in (out / "results.md").read_text()
    with pytest.raises(UserError, match=r"--expect better: the runs in .* were started expecting worse"):
        run_compare([cfg["grpo"], cfg["pods"]], [1, 2], out, report_options={"expect": "better"}, **kw)

    parser = argparse.ArgumentParser()
    add_report_arguments(parser)
    report = tmp_path / "report"
    assert report_main(parser.parse_args([str(out), "--out", str(report)])) == 0
    assert "one-sided p for worse (Holm)" in (report / "results.md").read_text()
    # run dirs inside the folder carry its side too
    assert report_main(parser.parse_args([str(out / "grpo"), str(out / "pods"), "--out", str(report)])) == 0
    assert "one-sided p for worse (Holm)" in (report / "results.md").read_text()
    with pytest.raises(UserError, match="a side named after the runs is not a test"):
        report_main(parser.parse_args([str(out), "--out", str(report), "--expect", "better"]))

    two_sided = tmp_path / "two_sided"  # two-sided is recorded and as binding
    run_compare([cfg["grpo"], cfg["pods"]], [1], two_sided, **kw)
    assert json.loads((two_sided / "expect.json").read_text()) == {"expect": None}
    with pytest.raises(UserError, match="were started expecting no side"):
        report_main(parser.parse_args([str(two_sided), "--out", str(report), "--expect", "better"]))
    with pytest.raises(UserError, match="started expecting different sides"):
        report_main(parser.parse_args([str(out), str(two_sided), "--out", str(report)]))
