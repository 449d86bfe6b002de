"""Episodes on the fast engine with each episode's KV cache continued between turns against the whole episode
re-prefilled each turn, on the CPU: a GSM8K-shaped model (narrowed to keep the run to minutes), E episodes of
~200-token prompts, T turns of up to M new tokens (1,000 stop ids, so turns end at varied lengths), a tool answer
of A tokens after each turn but the last. The same episode loop and seeds in both arms (the tokens are checked
equal); arms interleaved, seconds per episode batch (median and range of the rounds), continued over re-prefilled
time per round, and the positions each arm's prefills computed. `--ray-workers N` runs both arms through a local
Ray pool of N one-CPU actors instead of the in-process engine (the positions then summed over the actors).

    OMP_NUM_THREADS=1 python benchmarks/episode_continuation.py --episodes 16 --turns 4 --max-new-tokens 32 \
        --answer-tokens 32 --repeats 5 [--ray-workers 2]
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from benchmarks.gsm8k_shape import PROMPT_TOKENS, gsm8k_model, token_prompts  # noqa: E402
from benchmarks.timing import Spread, interleaved, machine_line, ratio  # noqa: E402
from podsrl.engines import SamplingParams  # noqa: E402
from podsrl.engines.base import EpisodeSession  # noqa: E402
from podsrl.engines.fast import FastEngine  # noqa: E402
from podsrl.engines.ray import RayEngine  # noqa: E402


def episodes(session: EpisodeSession, prompts: list[list[int]], turns: int, answer: list[int],
             params: SamplingParams) -> list[list[int]]:
    """Each episode's tokens after `turns` turns, every turn's tokens followed by the same tool answer (the runner's
    loop without a tokenizer: the engine's work is the same)."""
    contexts, keys = [list(p) for p in prompts], list(range(len(prompts)))
    with session:
        for turn in range(turns):
            out = session.generate(keys, contexts, params, torch.arange(len(keys)) * 7919 + turn)
            for row, context in enumerate(contexts):
                context += out.completion_ids[row, : int(out.completion_mask[row].sum())].tolist()
                if turn < turns - 1:
                    context += answer
    return contexts


def count_prefills(engine: FastEngine) -> list[int]:
    """The positions each of the engine's prefills computes, appended as they run."""
    counts: list[int] = []
    logits = engine.forward.logits

    def counted(ids, *rest):
        counts.append(ids.numel())
        return logits(ids, *rest)

    engine.forward.logits = counted
    return counts


def taken(counts: list[int]) -> int:
    total = sum(counts)
    counts.clear()
    return total


def prefill_counter(engine) -> Callable[[], int]:
    """A function giving the positions the engine's prefills computed since its last call (over every actor of a
    Ray pool)."""
    if not isinstance(engine, RayEngine):
        counts = count_prefills(engine)
        return lambda: taken(counts)
    import ray

    def on_actors(body) -> list:
        return ray.get([w.__ray_call__.remote(body) for w in engine.workers])

    on_actors(lambda worker: setattr(worker, "prefills", count_prefills(worker.engine)))
    return lambda: sum(on_actors(lambda worker: taken(worker.prefills)))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--episodes", type=int, default=16)
    parser.add_argument("--turns", type=int, default=4)
    parser.add_argument("--max-new-tokens", type=int, default=32)
    parser.add_argument("--answer-tokens", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--hidden", type=int, default=128)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--ray-workers", type=int, default=0, help="0: the in-process fast engine")
    args = parser.parse_args()
    torch.manual_seed(0)
    model = gsm8k_model(hidden=args.hidden, layers=args.layers).eval()
    g = torch.Generator().manual_seed(1)
    prompts = token_prompts(args.episodes, g)
    answer = torch.randint(2, 32000, (args.answer_tokens,), generator=g).tolist()
    params = SamplingParams(max_new_tokens=args.max_new_tokens, temperature=1.0, stop_token_ids=list(range(2, 1002)))
    if args.ray_workers:
        engine = RayEngine(model, num_workers=args.ray_workers, num_cpus=args.ray_workers, eos_token_id=1,
                           pad_token_id=0)
        where = f"a local Ray pool of {args.ray_workers} one-CPU actors"
    else:
        engine, where = FastEngine(model, eos_token_id=1, pad_token_id=0), "the in-process fast engine"
    prefilled_since = prefill_counter(engine)
    sessions = {"continued": engine.session, "re-prefilled": lambda: EpisodeSession(engine)}
    results, per_round = {}, {}
    for arm in sessions:
        results[arm] = episodes(sessions[arm](), prompts, args.turns, answer, params)
        per_round[arm] = prefilled_since()
    assert results["continued"] == results["re-prefilled"], "the arms gave other episodes"
    lengths = torch.tensor([len(e) - len(p) for e, p in zip(results["continued"], prompts)])

    def timed(name: str):
        return lambda: episodes(sessions[name](), prompts, args.turns, answer, params)

    times = interleaved({name: timed(name) for name in sessions}, repeats=args.repeats)
    engine.close()
    print(machine_line())
    print(f"{where}: {args.episodes} episodes x {args.turns} turns of up to {args.max_new_tokens} new tokens, "
          f"{args.answer_tokens}-token tool answers; prompts ~{PROMPT_TOKENS} tokens; completion tokens per episode "
          f"mean {lengths.float().mean():.1f} (min {int(lengths.min())}, max {int(lengths.max())}); hidden "
          f"{args.hidden}, {args.layers} layers; {args.repeats} rounds; the same episodes in both arms")
    for name, seconds in times.items():
        print(f"{name}: {Spread.of(seconds).text(digits=2, unit=' s')} per episode batch, "
              f"{per_round[name]} prefilled positions")
    print(f"continued / re-prefilled time: {ratio(times['continued'], times['re-prefilled']).text()}x")


if __name__ == "__main__":
    main()
