"""The fast engine in waves against all rows at once, on the CPU where both fit: a GSM8K-shaped model (narrowed to
keep the run to minutes), P prompts x n rollouts, sampled with many stop tokens so completions end at varied lengths;
arms interleaved, tokens per second (median and range of the rounds) and each wave size's time over all-at-once's.

    OMP_NUM_THREADS=1 python benchmarks/waves.py --prompts 8 --n 8 --max-new-tokens 64 --waves 16 32 --repeats 5
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from benchmarks.gsm8k_shape import PROMPT_TOKENS, gsm8k_model, token_prompts  # noqa: E402
from benchmarks.timing import Spread, interleaved, machine_line, ratio  # noqa: E402
from podsrl.engines import SamplingParams  # noqa: E402
from podsrl.engines.fast import FastEngine  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--n", type=int, default=8)
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--waves", type=int, nargs="+", default=[16, 32], help="max_rows of the wave arms")
    parser.add_argument("--hidden", type=int, default=128)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    torch.manual_seed(0)
    model = gsm8k_model(hidden=args.hidden, layers=args.layers).eval()
    g = torch.Generator().manual_seed(1)
    prompts = token_prompts(args.prompts, g)
    counts, seeds = [args.n] * args.prompts, torch.arange(args.prompts * args.n) * 7919
    # stop tokens: 1,000 of the 32k ids (~1/32 a token), so completions end at varied lengths and waves refill
    params = SamplingParams(max_new_tokens=args.max_new_tokens, temperature=1.0, stop_token_ids=list(range(2, 1002)))
    engines = {"all at once": FastEngine(model, eos_token_id=1, pad_token_id=0)}
    engines |= {f"max_rows {w}": FastEngine(model, eos_token_id=1, pad_token_id=0, max_rows=w) for w in args.waves}
    outputs = {name: engine.generate(prompts, counts, params, seeds) for name, engine in engines.items()}
    reference = outputs["all at once"]
    tokens = int(reference.completion_mask.sum())
    lengths = reference.completion_mask.sum(1)
    for name, out in outputs.items():
        assert torch.equal(out.completion_ids, reference.completion_ids), f"{name}: other tokens"
    times = interleaved({name: (lambda e=engine: e.generate(prompts, counts, params, seeds))
                         for name, engine in engines.items()}, repeats=args.repeats)
    print(machine_line())
    print(f"{args.prompts} prompts x {args.n}, prompts ~{PROMPT_TOKENS} tokens, up to {args.max_new_tokens} new "
          f"(mean {lengths.float().mean():.1f}, min {int(lengths.min())}, max {int(lengths.max())}); "
          f"hidden {args.hidden}, {args.layers} layers; {args.repeats} rounds; the same tokens in every arm")
    for name, seconds in times.items():
        rate = Spread.of([tokens / s for s in seconds])
        versus = "" if name == "all at once" else f"; time / all-at-once {ratio(seconds, times['all at once']).text()}x"
        print(f"{name}: {rate.text(digits=0)} tokens/s{versus}")


if __name__ == "__main__":
    main()
