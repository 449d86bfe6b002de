"""Speed of the vectorised max-variance selection against a per-group Python loop.

The loop is the straightforward approach: for each group, sort its rewards, build each of the m+1 candidate
subsets ("k highest + m-k lowest") and recompute its variance from scratch. It is timed on a subset of groups
and scaled per group when the full batch would take too long (the output says so).

    python benchmarks/select_speed.py                 # default shapes, about a minute at most
    python benchmarks/select_speed.py --shapes 1024,64,16 --repeats 7   # arms interleaved, median [min-max]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing
from benchmarks.timing import MIN_REPEATS, Spread, interleaved, load_average, machine_line, ratio
from podsrl.algo.selection import select_rollouts

DEFAULT_SHAPES = ["1024,64,16", "8192,256,64"]


def make_rewards(groups: int, n: int, kind: str, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Flat [R] rewards and group_index for `groups` groups of n rollouts (binary: per-group success rate)."""
    gen = torch.Generator().manual_seed(seed)
    if kind == "binary":
        p = torch.rand(groups, 1, generator=gen)
        rewards = (torch.rand(groups, n, generator=gen) < p).float()
    else:
        rewards = (torch.rand(groups, n, generator=gen) < 0.5).float() + 0.1 * torch.rand(
            groups, n, generator=gen
        )
    group_index = torch.arange(groups).repeat_interleave(n)
    return rewards.flatten(), group_index


def loop_select(rewards: torch.Tensor, group_index: torch.Tensor, num_groups: int, m: int) -> torch.Tensor:
    """Per-group reference: sort, then recompute every candidate's variance from scratch."""
    order = torch.argsort(group_index, stable=True)
    per_group = torch.split(order, torch.bincount(group_index, minlength=num_groups).tolist())
    kept: list[torch.Tensor] = []
    for rows in per_group:
        r = rewards[rows]
        n = r.numel()
        if n <= m:
            kept.append(rows)
            continue
        ranked = torch.sort(r, descending=True, stable=True).indices
        best_var, best_k = -1.0, m
        for k in [m, *range(m)]:  # k = m first, then the smallest k: the documented tie order
            subset = torch.cat([ranked[:k], ranked[n - (m - k) :]])
            var = float(r[subset].double().var())
            if var > best_var:
                best_var, best_k = var, k
        kept.append(rows[torch.cat([ranked[:best_k], ranked[n - (m - best_k) :]])])
    return torch.sort(torch.cat(kept)).values


def kept_values(rewards: torch.Tensor, group_index: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    """Kept rewards sorted within each group: equal for two selections that keep the same multisets."""
    by_value = torch.sort(rewards[rows], stable=True)
    by_group = torch.sort(group_index[rows][by_value.indices], stable=True).indices
    return by_value.values[by_group]


def time_pair(
    groups: int, n: int, m: int, kind: str, repeats: int, max_loop_groups: int
) -> tuple[dict[str, list[float]], int]:
    """Seconds per round of the vectorised rule on all groups and of the loop scaled to all groups, interleaved;
    and the number of groups the loop was actually timed on."""
    rewards, group_index = make_rewards(groups, n, kind)
    timed = min(groups, max_loop_groups)
    loop_rewards, loop_index = make_rewards(timed, n, kind)
    times = interleaved(
        {
            "vectorised": lambda: select_rollouts(rewards, group_index, groups, m, "max_variance"),
            "loop": lambda: loop_select(loop_rewards, loop_index, timed, m),
        },
        repeats,
    )
    times["loop"] = [t * groups / timed for t in times["loop"]]
    return times, timed


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--shapes", nargs="+", default=DEFAULT_SHAPES, help="groups,n,m triples")
    parser.add_argument("--kinds", nargs="+", default=["binary", "continuous"])
    parser.add_argument("--repeats", type=int, default=MIN_REPEATS, help="interleaved rounds (median, range)")
    parser.add_argument(
        "--max-loop-groups", type=int, default=256, help="groups timed in the loop, then scaled"
    )
    parser.add_argument(
        "--threads",
        type=int,
        default=1,
        help="torch.set_num_threads; 1 by default since the loop cannot use more (0: leave torch's default)",
    )
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)

    print(machine_line())
    header = (
        f"{'groups':>7} {'n':>5} {'m':>4} {'rewards':>10} {'vectorised ms':>22} {'loop ms':>26} "
        f"{'speed-up':>20}"
    )
    print(header)
    print("-" * len(header))
    scaled = False
    for shape in args.shapes:
        groups, n, m = (int(x) for x in shape.split(","))
        for kind in args.kinds:
            # Same kept reward multisets (rows may differ only among equal rewards) on a slice of groups.
            few = min(groups, 64)
            r, gi = make_rewards(few, n, kind)
            same = torch.equal(
                kept_values(r, gi, select_rollouts(r, gi, few, m, "max_variance")),
                kept_values(r, gi, loop_select(r, gi, few, m)),
            )
            times, timed = time_pair(groups, n, m, kind, args.repeats, args.max_loop_groups)
            note = "" if timed == groups else f"  (loop timed on {timed} groups, scaled)"
            scaled |= timed != groups
            check = "" if same else "  KEPT REWARDS DIFFER"
            vec, loop = Spread.of(times["vectorised"]), Spread.of(times["loop"])
            speedup = ratio(times["loop"], times["vectorised"])
            print(
                f"{groups:>7} {n:>5} {m:>4} {kind:>10} {vec.text(1e3, 2):>22} {loop.text(1e3, 1):>26} "
                f"{speedup.text(1, 0, 'x'):>20}{note}{check}"
            )
    print(f"medians [min-max] over {args.repeats} interleaved rounds; speed-up = per-round loop / vectorised")
    if scaled:
        print("loop times marked 'scaled' = time on a subset of groups x (groups / groups timed)")
    print(f"load average after: {load_average()}")


if __name__ == "__main__":
    main()
