"""What the parts of benchmarks/gpu_speed.sh share: a result file written as it fills, the GPU speed targets and
their verdicts, the device's ceilings, CUDA-graph captures counted and timed, and the final summary.

Each part writes one JSON file (`Results`): its figures, a readable `summary` line and its `targets` (each
{"name", "value", "target", "unit", "met"}), saved after every addition so that a part killed by its time limit
keeps what it had measured. `python benchmarks/speed_results.py FOLDER` reads every part's file in FOLDER and
prints each target as met / missed with its number, then one closing line.
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

import torch

# Datasheet ceilings of the H200 SXM (the same Hopper die as the H100: dense bf16 989 TFLOP/s, no sparsity; HBM3e
# 4.8 TB/s). The targets are stated against these; each part also measures the ceilings it meets in its own run.
H200_BF16_FLOPS = 989e12
H200_BANDWIDTH = 4.8e12

# [gpu-speed]'s targets: (name, comparison, threshold, unit)
TARGETS = {
    "study update": ("<=", 0.060, "s"),
    "update MFU, 0.5B, 1,024-token completions": (">=", 0.30, "of peak"),
    "decode, 128 rows, share of the bandwidth roofline": (">=", 0.25, "of roofline"),
    "decode, 512 rows, share of the compute roofline": (">=", 0.30, "of roofline"),
    "RL step, TRL / podsrl": (">=", 3.0, "x"),
}


def verdict(name: str, value: float | None) -> dict:
    """The target `name` against `value` (None: not measured)."""
    comparison, threshold, unit = TARGETS[name]
    met = None if value is None else (value <= threshold if comparison == "<=" else value >= threshold)
    return {"name": name, "value": value, "target": f"{comparison} {threshold:g}", "unit": unit, "met": met}


def verdict_text(v: dict) -> str:
    state = "not measured" if v["met"] is None else "met" if v["met"] else "MISSED"
    value = "-" if v["value"] is None else f"{v['value']:.4g}"
    return f"{v['name']}: {value} {v['unit']} (target {v['target']}): {state}"


class Results:
    """A part's result file: `put` adds a figure and saves; `target` records a verdict; `summary` sets the line."""

    def __init__(self, path: str | Path | None, part: str) -> None:
        self.path = Path(path) if path else None
        self.data: dict = {"part": part, "device": device_name(), "torch": torch.__version__, "summary": "",
                           "targets": []}
        self.save()

    def put(self, key: str, value) -> None:
        self.data[key] = value
        self.save()

    def target(self, name: str, value: float | None) -> dict:
        v = verdict(name, value)
        self.data["targets"] = [t for t in self.data["targets"] if t["name"] != name] + [v]
        self.save()
        print(f"target {verdict_text(v)}", flush=True)
        return v

    def summary(self, line: str) -> None:
        if line != self.data["summary"]:
            print(f"summary: {line}", flush=True)
        self.data["summary"] = line
        self.save()

    def save(self) -> None:
        if self.path is None:
            return
        self.path.parent.mkdir(parents=True, exist_ok=True)
        tmp = self.path.with_suffix(".tmp")
        tmp.write_text(json.dumps(self.data, indent=1, default=float) + "\n")
        os.replace(tmp, self.path)  # a kill mid-write leaves the previous complete file


def device_name() -> str:
    return torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu"


def sync(device: str | torch.device) -> None:
    if str(device).startswith("cuda"):
        torch.cuda.synchronize()


class DeviceTimer:
    """Wall seconds of a region after synchronising, and on CUDA its GPU-event seconds (the device's time from the
    first to the last work queued in the region: equal to the wall time when the host keeps ahead of the device,
    shorter when the device waits for the host at the start)."""

    def __init__(self, device: str | torch.device) -> None:
        self.cuda = str(device).startswith("cuda")
        self.wall = self.gpu = 0.0

    def __enter__(self) -> DeviceTimer:
        sync("cuda" if self.cuda else "cpu")
        if self.cuda:
            self.events = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            self.events[0].record()
        self.t0 = time.perf_counter()
        return self

    def __exit__(self, *exc) -> None:
        if self.cuda:
            self.events[1].record()
        sync("cuda" if self.cuda else "cpu")
        self.wall = time.perf_counter() - self.t0
        self.gpu = self.events[0].elapsed_time(self.events[1]) / 1e3 if self.cuda else float("nan")


class CaptureCounter:
    """CUDA-graph captures made while open, whoever makes them (torch.cuda.CUDAGraph.capture_begin/capture_end are
    wrapped), and the seconds of each from the synchronised start of its capture to the end of its instantiation.
    On a device without CUDA graphs nothing is captured and the count stays 0."""

    def __init__(self) -> None:
        self.seconds: list[float] = []
        self._t0 = 0.0

    @property
    def count(self) -> int:
        return len(self.seconds)

    def __enter__(self) -> CaptureCounter:
        graph = torch.cuda.CUDAGraph
        self._originals = graph.capture_begin, graph.capture_end
        begin, end = self._originals
        counter = self

        def capture_begin(graph_self, *args, **kwargs):
            torch.cuda.synchronize()  # outside the capture: what came before is not the capture's cost
            counter._t0 = time.perf_counter()
            return begin(graph_self, *args, **kwargs)

        def capture_end(graph_self, *args, **kwargs):
            out = end(graph_self, *args, **kwargs)
            torch.cuda.synchronize()
            counter.seconds.append(time.perf_counter() - counter._t0)
            return out

        graph.capture_begin, graph.capture_end = capture_begin, capture_end
        return self

    def __exit__(self, *exc) -> None:
        torch.cuda.CUDAGraph.capture_begin, torch.cuda.CUDAGraph.capture_end = self._originals

    def since(self, start: int) -> tuple[int, float]:
        """(captures, seconds) after the first `start` ones."""
        return len(self.seconds) - start, sum(self.seconds[start:])


def measured_ceilings(device: str, dtype: torch.dtype = torch.bfloat16, size: int = 8192) -> dict:
    """This run's own ceilings: a square matmul's FLOP/s on random data (best of 5 after one) and a device copy's
    bytes/s (read + written, best of 5 after one)."""
    a, b = torch.randn(size, size, device=device, dtype=dtype), torch.randn(size, size, device=device, dtype=dtype)
    x = torch.empty(1 << (30 if device.startswith("cuda") else 24), dtype=torch.uint8, device=device)
    y = torch.empty_like(x)
    best = {"matmul": float("inf"), "copy": float("inf")}
    for i in range(6):
        for name, call in (("matmul", lambda: a @ b), ("copy", lambda: y.copy_(x))):
            with DeviceTimer(device) as t:
                call()
            if i:
                best[name] = min(best[name], t.wall)
    return {"matmul_flops": 2 * size**3 / best["matmul"], "copy_bytes_per_s": 2 * x.numel() / best["copy"],
            "matmul_size": size, "dtype": str(dtype).removeprefix("torch.")}


def add_ceiling_arguments(parser) -> None:
    """The options of a part that measures its ceilings: the matmul's size and the result file."""
    parser.add_argument("--peak-size", type=int, default=0, help="the measured matmul's size (0: 8192 on CUDA, 256)")
    parser.add_argument("--json", help="the result file (written as it fills)")


def start_part(opts, part: str) -> tuple[Results, dict]:
    """The machine line, the part's result file, and this run's measured ceilings beside the datasheet's (in it)."""
    from benchmarks.timing import machine_line

    print(machine_line(device=opts.device), flush=True)
    results = Results(opts.json, part)
    size = opts.peak_size or (8192 if opts.device.startswith("cuda") else 256)
    ceilings = measured_ceilings(opts.device, torch.bfloat16, size)
    results.put("ceilings", {**ceilings, "datasheet_bf16_flops": H200_BF16_FLOPS,
                             "datasheet_bandwidth": H200_BANDWIDTH})
    return results, ceilings


def final_summary(folder: Path) -> list[str]:
    """Each part's summary line and target verdicts, then how many targets were met, missed and not measured."""
    lines, verdicts = [], {}
    for path in sorted(folder.glob("*.json")):
        try:
            data = json.loads(path.read_text())
        except (OSError, ValueError) as err:
            lines.append(f"{path.name}: unreadable ({err})")
            continue
        lines.append(f"{data.get('part', path.stem)} ({path.name}): {data.get('summary') or 'no summary line'}")
        for v in data.get("targets", []):
            verdicts[v["name"]] = v
    for name in TARGETS:
        lines.append("  " + verdict_text(verdicts.get(name, verdict(name, None))))
    states = [verdicts[n]["met"] if n in verdicts else None for n in TARGETS]
    lines.append(f"targets: {states.count(True)} met, {states.count(False)} missed, {states.count(None)} not measured "
                 f"(of {len(TARGETS)})")
    return lines


if __name__ == "__main__":
    if len(sys.argv) != 2 or not Path(sys.argv[1]).is_dir():
        print("usage: python benchmarks/speed_results.py FOLDER (a folder of gpu_speed.sh's part files)",
              file=sys.stderr)
        sys.exit(2)
    print("\n".join(final_summary(Path(sys.argv[1]))))
