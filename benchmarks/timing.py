"""What every benchmark that prints a ratio shares: interleaved arms, repeats, median and spread, the machine.

- Arms interleaved: round r times every arm once, in an order rotated by r, so a change in the machine's load hits
  every arm alike and no arm always runs first (or right after the same neighbour).
- A ratio is summarised over the per-round ratios (arm A's time in round r over arm B's in the same round): its
  median and its range [min-max] over the rounds, not a ratio of two best-ofs taken minutes apart.
- The machine line records cores, torch threads, torch version and the load average before and after: on a shared
  machine the spread is only meaningful next to the load it was measured under.
- Memory: the peak above the level before one call, sampled while it runs (CPU resident set size or CUDA allocator).
"""

from __future__ import annotations

import os
import platform
import statistics
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

MIN_REPEATS = 5


@dataclass(frozen=True)
class Spread:
    """Median and range of repeated measurements."""

    median: float
    low: float
    high: float
    n: int

    @classmethod
    def of(cls, values: Sequence[float]) -> Spread:
        if not values:
            raise ValueError("no measurements")
        return cls(statistics.median(values), min(values), max(values), len(values))

    def text(self, scale: float = 1.0, digits: int = 2, unit: str = "") -> str:
        """'1.23x [1.10-1.31]' style: median then range, scaled (e.g. 1e3 for ms)."""
        m, lo, hi = (v * scale for v in (self.median, self.low, self.high))
        return f"{m:.{digits}f}{unit} [{lo:.{digits}f}-{hi:.{digits}f}]"


def load_average() -> str:
    try:
        return "/".join(f"{x:.2f}" for x in os.getloadavg())
    except OSError:
        return "unknown"


def machine_line(threads: int | None = None, device: str = "cpu") -> str:
    """Cores, torch threads, torch version and the 1/5/15-minute load average now (the GPU's name on CUDA)."""
    import torch

    if device.startswith("cuda"):
        return f"machine: {torch.cuda.get_device_name(0)}, torch {torch.__version__}, load average {load_average()}"
    threads = torch.get_num_threads() if threads is None else threads
    return (
        f"machine: {platform.processor() or platform.machine()}, {os.cpu_count()} cores, torch {torch.__version__}, "
        f"{threads} torch threads, load average {load_average()} (1/5/15 min)"
    )


def interleaved(
    arms: Mapping[str, Callable[[], object]], repeats: int = MIN_REPEATS, warmup: int = 1
) -> dict[str, list[float]]:
    """Seconds of each arm over `repeats` rounds, arms in rotated order each round; `warmup` untimed rounds first."""
    if repeats < 1:
        raise ValueError(f"repeats must be >= 1, got {repeats}")
    names = list(arms)
    for _ in range(warmup):
        for name in names:
            arms[name]()
    times: dict[str, list[float]] = {name: [] for name in names}
    for r in range(repeats):
        k = r % len(names)
        for name in names[k:] + names[:k]:
            start = time.perf_counter()
            arms[name]()
            times[name].append(time.perf_counter() - start)
    return times


def ratio(numerator: Sequence[float], denominator: Sequence[float]) -> Spread:
    """Per-round ratios numerator[r] / denominator[r], summarised."""
    if len(numerator) != len(denominator):
        raise ValueError(f"{len(numerator)} vs {len(denominator)} rounds")
    return Spread.of([a / b for a, b in zip(numerator, denominator)])


def _rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def memory_levels(call: Callable[[], object], device: str = "cpu") -> dict[str, int]:
    """Bytes in use before `call`, at its peak and after it, and the peak reserved: the CUDA allocator's
    (max_memory_allocated / max_memory_reserved), or on CPU the resident set size sampled every 0.2 ms by a thread
    (run with MALLOC_MMAP_THRESHOLD_ set so freed tensors leave the RSS; reserved is the peak there)."""
    import torch

    if device.startswith("cuda"):
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        before = torch.cuda.memory_allocated()
        call()
        torch.cuda.synchronize()
        return {"before": before, "peak": torch.cuda.max_memory_allocated(),
                "reserved": torch.cuda.max_memory_reserved(), "after": torch.cuda.memory_allocated()}
    before, peak, done = _rss_bytes(), [0], threading.Event()

    def sample() -> None:
        while not done.is_set():
            peak[0] = max(peak[0], _rss_bytes())
            time.sleep(0.0002)

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    call()
    done.set()
    sampler.join()
    after = _rss_bytes()
    top = max(peak[0], after, before)
    return {"before": before, "peak": top, "reserved": top, "after": after}


def peak_memory_during(call: Callable[[], object], device: str = "cpu") -> int:
    """Bytes above the level before `call` at its peak (memory_levels)."""
    levels = memory_levels(call, device)
    return max(levels["peak"] - levels["before"], 0)
