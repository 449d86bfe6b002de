"""benchmarks/gpu_speed.sh on the CPU (--smoke: tiny sizes): every part runs and writes its own result file with its
summary line, what comes back fits a device call (8 files), a part cut by its limit or the deadline is recorded and
the others' files stay; and the counts behind the parts' figures (rooflines, MFU's FLOPs, targets, the shape line)."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from benchmarks import update_diagnosis
from benchmarks.decode_speed import floors
from benchmarks.gpu_generation import build_model
from benchmarks.speed_results import TARGETS, CaptureCounter, Results, final_summary, verdict
from benchmarks.update_mfu import flops

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = str(ROOT / "benchmarks/gpu_speed.sh")
PARTS = ("update", "train", "mfu", "decode", "rl")


def speed(*args: str, timeout: int = 1500) -> subprocess.CompletedProcess:
    # PYTHON: the script's interpreter is this one, whatever `python3` is on PATH
    return subprocess.run(["bash", SCRIPT, *args], capture_output=True, text=True, timeout=timeout, check=False,
                          env={**os.environ, "PYTHON": sys.executable, "OMP_NUM_THREADS": "1"})


def test_smoke_runs_every_part_each_with_its_file_and_summary_line(tmp_path):
    out = tmp_path / "out"
    result = speed("--smoke", "--out", str(out), "--runs", str(tmp_path / "runs"))
    assert result.returncode == 0, result.stderr
    summary = (out / "summary.txt").read_text()
    assert sorted(p.name for p in out.iterdir()) == sorted(["summary.txt", "log.txt", "machine.txt",
                                                            *(f"{p}.json" for p in PARTS)])
    parts = {p: json.loads((out / f"{p}.json").read_text()) for p in PARTS}
    for name, data in parts.items():
        assert f"\n{name}: ok" in summary, summary
        assert data["summary"] and f"  {data['summary']}" in summary, (name, summary)
    update = parts["update"]
    assert set(update["arms"]) == set(update_diagnosis.ARMS)
    assert all(len(arm["wall_s"]) == 1 and arm["median_wall_s"] > 0 for arm in update["arms"].values())
    assert "Self CPU" in update["profile"]["top"]
    assert update["deprioritised_process"]["status"] == "ok" and "fresh" in update["deprioritised_process"]
    assert update["attention_shapes"]["status"] in ("ok", "not present")
    for arm in ("preferred", "deprioritised"):
        train = parts["train"][arm]
        assert train["status"] == "ok" and len(train["steps"]) == 1, train
        assert train["env"] == ({"TORCH_CUDNN_SDPA_DEPRIORITIZED": "1"} if arm == "deprioritised" else {})
        assert all(s["time/update"] > 0 and s["captures"] == 0 for s in train["steps"])  # no graphs on a CPU
    assert sorted(parts["mfu"]["lengths"]) == ["16", "8"]
    engine = parts["decode"]["engine"]["shapes"]
    assert sorted(engine) == ["4", "8"] and all(s["tokens"] > 0 and s["bandwidth_share"] > 0 for s in engine.values())
    assert len(parts["decode"]["training_steps"]["steps"]) == 2
    rl = parts["rl"]["comparison"]
    assert len(rl["ratios"]) == 1 and rl["podsrl"]["captures"] == [0]
    # the targets are stated at the GPU sizes: at the smoke's each is recorded, not measured
    verdicts = {v["name"]: v for data in parts.values() for v in data["targets"]}
    assert set(verdicts) == set(TARGETS) and all(v["met"] is None for v in verdicts.values())
    assert f"targets: 0 met, 0 missed, {len(TARGETS)} not measured" in summary and "gpu_speed: done" in summary


def test_a_part_out_of_time_keeps_the_other_files_and_the_deadline_stops_the_rest(tmp_path):
    out = tmp_path / "out"
    # --scale 0.01: the mfu part's limit becomes 1 s (smoke doubles it), far less than it needs
    result = speed("--smoke", "--out", str(out), "--runs", str(tmp_path / "runs"), "--scale", "0.01",
                   "--parts", "nonsense machine mfu", timeout=300)
    assert result.returncode == 0, result.stderr
    summary = (out / "summary.txt").read_text()
    assert "unknown part nonsense" in summary and "mfu: TIMED OUT at 1s" in summary, summary
    assert "machine: written" in summary and (out / "machine.txt").exists()
    assert "study update: - s (target <= 0.06): not measured" in summary and "gpu_speed: done" in summary
    late = speed("--smoke", "--out", str(tmp_path / "late"), "--runs", str(tmp_path / "runs"), "--deadline", "60",
                 "--parts", "mfu", timeout=120)
    assert late.returncode == 2 and "need 200s" in late.stderr and "past the 60s deadline" in late.stderr
    assert not (tmp_path / "late").exists()  # refused before running anything
    bad = speed("--bogus", timeout=60)
    assert bad.returncode == 2 and "unknown argument --bogus" in bad.stderr


def test_results_file_is_complete_after_every_addition_and_targets_say_met_or_missed(tmp_path):
    results = Results(tmp_path / "part.json", "a part")
    results.put("figure", 1.5)
    assert json.loads((tmp_path / "part.json").read_text())["figure"] == 1.5
    results.target("study update", 0.061)
    results.summary("one line")
    other = Results(tmp_path / "other.json", "another")
    other.target("RL step, TRL / podsrl", 3.2)
    lines = final_summary(tmp_path)
    assert "a part (part.json): one line" in lines and "another (other.json): no summary line" in lines
    assert "  study update: 0.061 s (target <= 0.06): MISSED" in lines
    assert "  RL step, TRL / podsrl: 3.2 x (target >= 3): met" in lines
    assert lines[-1] == f"targets: 1 met, 1 missed, {len(TARGETS) - 2} not measured (of {len(TARGETS)})"
    assert verdict("update MFU, 0.5B, 1,024-token completions", 0.30)["met"] is True
    assert verdict("study update", None)["met"] is None


def test_decode_floors_count_weights_per_step_and_the_cache_of_the_rows_still_generating():
    model, total, matmul = build_model("tiny", "cpu", torch.float32, eos_bias=0.0)
    # tiny: 2 layers, 2 kv heads of 32 (4 heads of 128 / 4): a position of one row is 2 x 2 x 2 x 32 x 4 = 1,024 bytes
    per_position, prompt, weights = 1024, 5, total * 4
    lengths = [1, 3, 2]  # step 1 makes the second token of rows 2 and 3, step 2 the third of row 2
    f = floors(model, prompt, distinct=1, lengths=lengths, matmul_params=matmul)
    assert f["bytes"] == (weights + per_position * prompt) + (weights + 2 * per_position * 6) + (weights + per_position * 7)
    attention = 4 * 2 * 4 * 32
    assert f["flops"] == (2 * matmul * prompt + attention * prompt**2 / 2 + 2 * matmul * 2 + attention * 2 * 6
                          + 2 * matmul + attention * 7)
    assert f["bandwidth_floor_s"] == pytest.approx(f["bytes"] / 4.8e12)


def test_mfu_flops_are_six_per_parameter_and_token_with_the_head_on_completions_only():
    model, total, _ = build_model("tiny", "cpu", torch.float32, eos_bias=None)
    f = flops(model, length=10)
    head = 100 * 128  # the tied embedding, counted once, as the output layer
    tokens, completion = 4 * 200 + 64 * 10, 64 * 10
    assert f["params"] == total and f["tokens"] == tokens
    assert f["matmul"] == 6 * ((total - head) * tokens + head * completion)


def test_attention_shapes_reads_the_scripts_last_line_or_says_it_is_not_there(tmp_path, monkeypatch):
    opts = type("Opts", (), {"device": "cpu", "shapes_steps": 12, "child_timeout": 60})()
    monkeypatch.setattr(update_diagnosis, "SHAPES_SCRIPT", tmp_path / "absent.py")
    assert update_diagnosis.attention_shapes(opts) == {"status": "not present"}
    script = tmp_path / "update_shapes.py"
    script.write_text("import json, sys\nout = sys.argv[sys.argv.index('--out') + 1]\n"
                      "json.dump({'per_update': [6, 0]}, open(out, 'w'))\n"
                      "print('  new attention shapes per update after step 10: 3.00 (distinct in all: 9)')\n"
                      "print('new attention shapes per update after step 10: 0.10 (distinct in all: 7)')\n")
    monkeypatch.setattr(update_diagnosis, "SHAPES_SCRIPT", script)
    shapes = update_diagnosis.attention_shapes(opts)
    assert shapes["status"] == "ok" and shapes["new_per_update"] == 0.1 and shapes["distinct"] == 7
    assert shapes["file"] == {"per_update": [6, 0]}


def test_capture_counter_counts_captures_whoever_makes_them(monkeypatch):
    graph = torch.cuda.CUDAGraph
    monkeypatch.setattr(graph, "capture_begin", lambda self, *a, **k: None)
    monkeypatch.setattr(graph, "capture_end", lambda self, *a, **k: None)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a: None)
    with CaptureCounter() as captures:
        for _ in range(3):
            graph.capture_begin(None)
            graph.capture_end(None)
        assert captures.since(1)[0] == 2
    assert captures.count == 3 and all(s >= 0 for s in captures.seconds)
    graph.capture_begin(None)  # restored on exit: not counted
    assert captures.count == 3


def plan(*args: str) -> tuple[dict[str, int], int, int]:
    """(part -> limit, seconds needed, deadline) as `gpu_speed.sh --plan` counts them."""
    lines = speed(*args, "--plan", timeout=60).stdout.splitlines()
    limits = {name: int(limit) for name, limit in (line.split() for line in lines[:-1])}
    _, needed, _, deadline = lines[-1].split()[:4]
    return limits, int(needed), int(deadline.rstrip("s"))


def test_each_call_fits_its_deadline_by_construction_and_the_two_reach_every_part():
    """The parts' limits, a kill's grace each and the set-up add up to at most the 420 s deadline in each of the two
    calls, decode and the TRL comparison in the first, every part in one of them; the documented command lists both
    calls. Before, one call's limits added to 610 s against its 420 s deadline: decode and rl ran only if the parts
    before them finished early."""
    first, second = plan("--call", "1"), plan("--call", "2")
    for limits, needed, deadline in (first, second):
        assert deadline == 420 and needed <= deadline
        assert needed >= sum(limits.values()) + len(limits) * 5  # the grace and set-up on top of the limits
    assert list(first[0])[1:3] == ["decode", "rl"]
    assert set(first[0]) | set(second[0]) == {"machine", *PARTS}
    everything = plan()
    assert everything[1] > everything[2]  # all parts at once do not fit one call: refused
    refused = speed("--out", "/nonexistent/never", timeout=60)
    assert refused.returncode == 2 and "run them in two calls (--call 1, then --call 2)" in refused.stderr
    docs = (ROOT / "docs/gpu.md").read_text()
    assert "bash benchmarks/gpu_speed.sh --call 1" in docs and "bash benchmarks/gpu_speed.sh --call 2" in docs
