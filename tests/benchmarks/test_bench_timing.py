"""benchmarks/timing.py: arms interleaved in rotated order, per-round ratios, median and range."""

import time

import pytest

from benchmarks.timing import Spread, interleaved, machine_line, ratio


def test_interleaved_rotates_the_arm_order_each_round():
    calls = []
    times = interleaved({a: (lambda a=a: calls.append(a)) for a in "abc"}, repeats=5, warmup=1)
    assert calls[:3] == list("abc")  # the untimed warm-up round
    assert calls[3:] == list("abc" "bca" "cab" "abc" "bca")
    assert {k: len(v) for k, v in times.items()} == {"a": 5, "b": 5, "c": 5}
    with pytest.raises(ValueError):
        interleaved({"a": lambda: None}, repeats=0)


def test_ratio_is_per_round_and_summarised():
    s = ratio([2.0, 3.0, 9.0, 4.0, 5.0], [1.0, 1.0, 3.0, 2.0, 1.0])
    assert (s.median, s.low, s.high, s.n) == (3.0, 2.0, 5.0, 5)
    assert Spread.of([0.001, 0.002, 0.004]).text(1e3, 1, " ms") == "2.0 ms [1.0-4.0]"
    with pytest.raises(ValueError):
        ratio([1.0], [1.0, 2.0])


def test_machine_line_records_cores_threads_torch_and_load():
    line = machine_line()
    assert "cores" in line and "torch threads" in line and "torch 2." in line and "load average" in line


def test_peak_memory_during_sees_a_transient_allocation():
    import torch

    from benchmarks.timing import peak_memory_during

    def call():  # 64 MiB held for 50 ms, then freed: only a sampled peak sees it
        block = torch.ones(16 * 2**20)
        time.sleep(0.05)
        del block

    peak = peak_memory_during(call)
    assert 48 * 2**20 <= peak <= 200 * 2**20
    assert peak_memory_during(lambda: None) < 8 * 2**20
