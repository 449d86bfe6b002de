"""Recompute `podsrl compare`'s paired statistics from a saved per-run table, with the current statistics code.

    python benchmarks/paired_from_table.py docs/results/gpu_pods_study_2026-11-27/runs.csv
    python benchmarks/paired_from_table.py docs/results/knapsack.md --baseline grpo_clip5

Input: a report's runs.csv, or its results.md (the "Per run:" table). Per config other than the baseline (the first
config unless named): for each metric the table has (final, peak, plateau, area / T, time to target), the mean paired
difference, the interval at the level its number of pairs gives it, the two-sided sign-flip p with Holm across
those metrics in brackets (one family), the verdict's words and the seeds that would resolve it (podsrl/experiments/stats.py,
paired_test.py; docs/statistics.md). A results.md table holds values rounded to 3 decimals (times to 1): the
p-values of a sign-flip test move only where a rounded difference changes sign or order.
"""

from __future__ import annotations

import argparse
import csv
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from podsrl.experiments.paired_test import format_p, interval_label  # noqa: E402
from podsrl.experiments.stats import ALPHA, paired_family, paired_stat, seeds_range_text  # noqa: E402

# metric -> (column in runs.csv, column in results.md's per-run table, higher is better); the report's order
METRICS = {
    "final": ("final", "final", True),
    "peak": ("peak", "peak", True),
    "plateau": ("plateau", "plateau", True),
    "auc": ("auc", "area / T", True),
    "time_to_target": ("time_to_target_s", "time to target (s)", False),
}


def read_rows(path: Path) -> tuple[list[dict[str, str]], int]:
    """The per-run rows and which of METRICS' column names they use (0: runs.csv, 1: results.md)."""
    if path.suffix == ".csv":
        with path.open(newline="", encoding="utf-8") as f:
            return list(csv.DictReader(f)), 0
    lines = path.read_text(encoding="utf-8").splitlines()
    try:
        start = next(i for i, line in enumerate(lines) if line.strip() == "Per run:")
    except StopIteration:
        raise SystemExit(f"{path}: no 'Per run:' table") from None
    table = [line for line in lines[start + 1:] if line.startswith("|")]
    header = [c.strip() for c in table[0].strip("|").split("|")]
    rows = [dict(zip(header, (c.strip().strip("`") for c in line.strip("|").split("|")))) for line in table[2:]]
    return rows, 1


def number(cell: str | None) -> float | None:
    try:
        return float(cell.replace(",", "").rstrip("×"))  # type: ignore[union-attr]
    except (AttributeError, ValueError):
        return None  # "not reached", absent


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("table", type=Path, help="runs.csv or results.md of a podsrl compare / report")
    parser.add_argument("--baseline", help="config label (default: the first in the table)")
    args = parser.parse_args()
    rows, which = read_rows(args.table)
    configs = list(dict.fromkeys(r["config"] for r in rows))
    baseline = args.baseline or configs[0]
    if baseline not in configs:
        raise SystemExit(f"--baseline {baseline}: not a config of {args.table} ({', '.join(configs)})")
    present = {m: spec for m, spec in METRICS.items() if spec[which] in rows[0]}
    values = {c: {m: {int(r["seed"]): number(r[spec[which]]) for r in rows if r["config"] == c}
                  for m, spec in present.items()} for c in configs}
    print(f"{args.table}: paired by seed against `{baseline}`; Holm across {', '.join(present)}")
    print("| config | metric | mean difference [interval] | sign-flip p, two-sided (Holm) | pairs | verdict "
          "| seeds to resolve |")
    print("|---|---|---|---|---|---|---|")
    for c in configs:
        if c == baseline:
            continue
        family = paired_family({m: paired_stat(m, values[baseline][m], values[c][m], present[m][2]) for m in present})
        for m, p in family.items():
            digits = 1 if m == "time_to_target" else 3
            diff = "—" if p.mean_diff is None else f"{p.mean_diff:+.{digits}f}"
            if p.ci_low is not None:
                diff += f" [{p.ci_low:+.{digits}f}, {p.ci_high:+.{digits}f}] ({interval_label(p.pairs, ALPHA)})"
            tested = "—" if p.p_value is None else f"{format_p(p.p_value)} ({format_p(p.p_holm)})"
            needed = "—" if p.seeds_needed is None else seeds_range_text(p.seeds_needed, p.seeds_low, p.seeds_high)
            print(f"| `{c}` | {m} | {diff} | {tested} | {p.pairs}/{p.seeds} | {p.words} | {needed} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
