"""benchmarks/gpu_generation.py's CPU-runnable parts: the roofline's byte count, the engine arms, the script at a
tiny size (the CUDA-graph arm and the 0.5B shape run on a GPU only)."""

import sys

import pytest
import torch

from benchmarks.gpu_generation import build_model, decode_bytes, engine_arms, main
from podsrl.engines.fast import FastEngine
from podsrl.errors import ConfigError


def test_decode_bytes_counts_weights_per_step_and_the_filled_cache():
    model, total, _ = build_model("tiny", "cpu", torch.float32)
    # tiny: 2 layers, 2 kv heads of 128 / 4 = 32: per row and position 2 (k, v) x 2 x 2 x 32 x 4 bytes = 1024 bytes
    rows, prompt, new = 3, 5, 4  # steps 1..3 read 6, 7, 8 positions
    assert decode_bytes(model, rows, prompt, new) == 3 * total * 4 + 1024 * rows * (6 + 7 + 8)


def test_engine_arms_turn_cuda_graphs_off_and_on():
    model, _, _ = build_model("tiny", "cpu", torch.float32)
    arms = engine_arms(["hf", "fast"], model)
    assert isinstance(arms["fast"], FastEngine) and arms["fast"].runner.graphs is None
    with pytest.raises(ConfigError, match="cuda_graphs"):  # the graph arm needs a CUDA device
        engine_arms(["fast-graphs"], model)


def test_script_at_a_tiny_size(monkeypatch, capsys):
    monkeypatch.setattr(sys, "argv", ["gpu_generation.py", "--device", "cpu", "--dtype", "float32", "--models",
                                      "tiny", "--n", "2", "--prompts", "2", "--prompt-len", "8",
                                      "--max-new-tokens", "6", "--repeats", "1", "--peak-size", "128"])
    main()
    out = capsys.readouterr().out
    assert "GB/s (measured copy)" in out and "%roofline" in out
    lines = [line for line in out.splitlines() if line.startswith(" tiny")]
    cells = [line.split("|")[1].split() for line in lines]  # engine, rollouts/s, %peak, %roofline
    assert [c[0] for c in cells] == ["hf", "fast"]
    assert all(float(c[1]) >= 0 and float(c[3].rstrip("%")) >= 0 for c in cells)  # a loaded machine rounds to 0
