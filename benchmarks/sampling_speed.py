"""The untruncated sampler's time on the CPU at Qwen2.5's vocabulary, against the two alternatives it was chosen over.

Arms, interleaved, each timed `--repeats` times over the same [rows, 151,936] float32 logits, one thread:
- softmax_cdf: sampling.sample_with_uniforms as it is (a softmax, its cumsum, the search; the log-prob from the
  softmax);
- shifted_cdf: the sampler before (a max, the shifted exponentials, their cumsum, the search; the log-prob from the
  cumsum's total);
- gumbel_hash: Gumbel-max, argmax(logits / T + Gumbel noise) with the log-prob from one logsumexp, its noise from a
  splitmix64 hash of (the row's key, the token) so that a row's draw stays a function of its seed and position
  alone (the property sampling.py keeps): in eager mode the hash is ~20 passes over [rows, vocabulary].

    python benchmarks/sampling_speed.py [--rows 64] [--repeats 5]

prints each arm's median and range in ms.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from podsrl.engines.sampling import _shr, sample_with_uniforms, splitmix64  # noqa: E402

VOCAB = 151_936


def shifted_cdf(logits: torch.Tensor, uniforms: torch.Tensor, temperature: float):
    scaled = logits.float() / temperature if temperature != 1.0 else logits.float()
    top = scaled.amax(dim=-1, keepdim=True)
    cdf = (scaled - top).exp().cumsum(dim=-1)
    total = cdf[..., -1:]
    target = torch.minimum(uniforms.unsqueeze(-1) * total, torch.nextafter(total, torch.zeros_like(total)))
    tokens = torch.searchsorted(cdf, target, right=True).squeeze(-1)
    return tokens, (scaled.gather(-1, tokens.unsqueeze(-1)) - top - total.log()).squeeze(-1)


def gumbel_hash(logits: torch.Tensor, keys: torch.Tensor, temperature: float):
    scaled = logits.float() / temperature if temperature != 1.0 else logits.float()
    noise = splitmix64(keys[:, None] + torch.arange(logits.shape[-1]))
    uniform = (_shr(noise, 40).float() + 0.5) * (1.0 / (1 << 24))  # in (0, 1)
    tokens = (scaled - uniform.log().neg().log()).argmax(dim=-1)
    return tokens, scaled.gather(-1, tokens[:, None])[:, 0] - scaled.logsumexp(dim=-1)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    torch.set_num_threads(1)
    generator = torch.Generator().manual_seed(0)
    logits = torch.randn(args.rows, VOCAB, generator=generator) * 3
    uniforms = torch.rand(args.rows, generator=generator)
    keys = torch.randint(0, 1 << 62, (args.rows,), generator=generator)
    for temperature in (1.0, 0.7):
        arms = {"softmax_cdf": lambda t=temperature: sample_with_uniforms(logits, uniforms, t),
                "shifted_cdf": lambda t=temperature: shifted_cdf(logits, uniforms, t),
                "gumbel_hash": lambda t=temperature: gumbel_hash(logits, keys, t)}
        times: dict[str, list[float]] = {name: [] for name in arms}
        for arm in arms.values():
            arm()  # warm-up
        for _ in range(args.repeats):
            for name, arm in arms.items():
                start = time.perf_counter()
                arm()
                times[name].append((time.perf_counter() - start) * 1e3)
        for name, ts in times.items():
            ts.sort()
            print(f"T={temperature} {name}: median {ts[len(ts) // 2]:.1f} ms (range {ts[0]:.1f}-{ts[-1]:.1f}) "
                  f"over {args.repeats} repeats, {args.rows} rows x {VOCAB} tokens, one thread")


if __name__ == "__main__":
    main()
