"""benchmarks/decode_overhead.py: the fixed/per-row split of a generate call and the script end to end."""

import sys

import pytest

from benchmarks.decode_overhead import fit, main


def test_fit_recovers_the_fixed_and_per_row_parts():
    rows = [4, 16, 64, 256]
    intercept, slope = fit(rows, [0.028 + 0.0005 * r for r in rows])
    assert intercept == pytest.approx(0.028) and slope == pytest.approx(0.0005)


def test_script_prints_the_split(monkeypatch, capsys):
    monkeypatch.setattr(sys, "argv", ["decode_overhead.py", "--repeats", "1", "--threads", "0"])
    main()
    out = capsys.readouterr().out
    assert "4 rows" in out and "256 rows" in out
    assert "fit: fixed" in out and "ATen operations a call" in out and "GEMM rate" in out


def test_step_table_times_eager_and_compiled_steps(monkeypatch, capsys):
    """--step on the built-in model, dynamo's eager backend (the same compiled-step plumbing without codegen)."""
    monkeypatch.setattr(sys, "argv", ["decode_overhead.py", "--step", "--models", "builtin", "--rows", "2",
                                      "--repeats", "1", "--calls", "2", "--backend", "eager", "--threads", "0"])
    main()
    out = capsys.readouterr().out
    assert "builtin (0.8M), 2 rows, 32 columns: eager" in out and "eager/compiled" in out
