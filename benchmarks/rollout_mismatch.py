"""The sampler/trainer mismatch of mixed precision alone, and what each rollout-correction mode makes of it.

The default on CUDA: float32 master weights trained under bfloat16 autocast (model.compute_dtype auto), sampled by
the fast engine from its bfloat16 copy of them. Same weights, same tokens; the only difference is where bfloat16
rounds (the copy rounds the weights and every activation, autocast only the matmul inputs). This script samples
completions of the GSM8K-shaped model (benchmarks/gsm8k_shape.py: a random-init Qwen2, 13M parameters, 32k
vocabulary, 200-token prompts) with the engine the trainer builds (podsrl.build.rollout_engine), recomputes the
sampled tokens' log-probs the way the update does (the shared-prompt path under the update's autocast), and prints
per completion length:
- the token log-ratio d = trainer - sampler log-prob: mean, mean |d|, and quantiles of the token ratio exp(d);
- the sequence ratio exp(sum d) (the sequence modes' weight before the cap): quantiles (0 and 1: min and max), the
  share below 0.1 and above the cap;
- for each rollout-correction mode, the mean weight it puts on a completion's tokens: the median over completions
  and the share of completions it weights below 0.1 (nearly silenced) or masks entirely.
The random init is near uniform over its 32k tokens (10.3 nats a token), where bfloat16's relative rounding of
small logits moves log-probs little; `--logit-scale` multiplies the final norm's weight, so the logits, to give the
peaked distributions of a trained model (10: 0.7 nats a token at temperature 0.9).

    OMP_NUM_THREADS=1 python benchmarks/rollout_mismatch.py    # scales 1 and 10, 256 and 1,024 tokens
    python benchmarks/rollout_mismatch.py --device cuda --prompts 16 --n 16 --micro-batch 16   # on a GPU
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.gsm8k_shape import PROMPT_TOKENS, gsm8k_model
from benchmarks.timing import machine_line
from podsrl.algo.rollout_correction import ROLLOUT_CORRECTION_MODES, rollout_correction
from podsrl.batch import Problem, RolloutBatch
from podsrl.build import rollout_engine
from podsrl.config import load_config
from podsrl.config.facts import run_facts
from podsrl.engines.base import SamplingParams
from podsrl.models.precision import compute_autocast
from podsrl.update.shared_prompt import SharedPromptForward

EOS, PAD = 1, 0
TOKEN_QUANTILES = (0.001, 0.01, 0.5, 0.99, 0.999)
SEQUENCE_QUANTILES = (0.0, 0.1, 0.5, 0.9, 1.0)
SILENCED = 0.1  # a completion weighted below this barely counts


class Tok:
    eos_token_id = EOS
    pad_token_id = PAD


def sample(cfg, model, prompts: int, n: int, length: int, temperature: float, seed: int) -> RolloutBatch:
    """P x n completions of up to `length` tokens from the engine the trainer would build, as the trainer's batch."""
    engine = rollout_engine(cfg, model, Tok(), run_facts(cfg, next(model.parameters()).device).compute_dtype)
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(2, model.config.vocab_size, (prompts, PROMPT_TOKENS), generator=gen)
    seeds = torch.randint(0, 2**31 - 1, (prompts * n,), generator=gen)
    out = engine.generate([row.tolist() for row in ids], [n] * prompts,
                          SamplingParams(max_new_tokens=length, temperature=temperature, return_logprobs=True), seeds)
    return RolloutBatch(
        problems=[Problem(uid=str(p), prompt="", answer="") for p in range(prompts)], group_index=out.group_index,
        prompt_ids=out.prompt_ids, prompt_mask=out.prompt_mask, completion_ids=out.completion_ids,
        completion_mask=out.completion_mask.float(), truncated=out.truncated, sampler_logprobs=out.logprobs)


@torch.no_grad()
def trainer_logprobs(model, batch: RolloutBatch, temperature: float, micro_batch: int,
                     device: torch.device) -> tuple[torch.Tensor, float]:
    """([R, Lc] log-probs of the sampled tokens as the update computes them: the shared-prompt path under bfloat16
    autocast over the float32 masters, the mean entropy of the temperature-scaled policy over the tokens)."""
    forward = SharedPromptForward(model, logits_chunk=1024)
    out = torch.zeros_like(batch.completion_mask)
    entropy_sum = 0.0
    for rows in torch.arange(batch.num_rollouts).split(micro_batch):
        width = int(batch.completion_mask[rows].sum(dim=1).max())
        with compute_autocast(device, torch.bfloat16, torch.float32):
            logp, entropy = forward(batch, rows, width, device, temperature)
        out[rows, :width] = logp.float().cpu()
        entropy_sum += float((entropy.float().cpu() * batch.completion_mask[rows, :width]).sum())
    return out, entropy_sum / float(batch.completion_mask.sum())


def report(trainer: torch.Tensor, batch: RolloutBatch, cap: float) -> list[str]:
    mask = batch.completion_mask
    valid = mask > 0
    diff = (trainer - batch.sampler_logprobs) * mask
    token_ratio = diff[valid].exp()
    seq = diff.sum(dim=1).exp()
    quantiles = torch.quantile(token_ratio.double(), torch.tensor(TOKEN_QUANTILES, dtype=torch.float64))
    seq_quantiles = torch.quantile(seq.double(), torch.tensor(SEQUENCE_QUANTILES, dtype=torch.float64))
    lines = [
        f"  tokens {int(valid.sum())} in {batch.num_rollouts} completions (mean length "
        f"{float(mask.sum(1).mean()):.0f}); token log-ratio d: mean {float(diff[valid].mean()):+.2e}, "
        f"mean |d| {float(diff[valid].abs().mean()):.2e}, max |d| {float(diff[valid].abs().max()):.3f}",
        "  token ratio exp(d) quantiles " + ", ".join(
            f"{q:g}: {float(v):.4f}" for q, v in zip(TOKEN_QUANTILES, quantiles, strict=True)),
        "  sequence ratio exp(sum d) quantiles " + ", ".join(
            f"{q:g}: {float(v):.3f}" for q, v in zip(SEQUENCE_QUANTILES, seq_quantiles, strict=True))
        + f"; below {SILENCED}: {float((seq < SILENCED).float().mean()):.0%}, above the cap {cap:g}: "
        f"{float((seq > cap).float().mean()):.0%}",
    ]
    for mode in (m for m, trl in ROLLOUT_CORRECTION_MODES.items() if trl):
        weight = rollout_correction(trainer, batch.sampler_logprobs, mask, mode, cap).weight
        per_completion = weight.sum(1) / mask.sum(1).clamp(min=1)  # the mean weight on its tokens
        lines.append(f"  {mode:>13}: median completion weight {float(per_completion.quantile(0.5)):.3f}, below "
                     f"{SILENCED}: {float((per_completion < SILENCED).float().mean()):.0%}, masked entirely: "
                     f"{float((per_completion == 0).float().mean()):.0%}")
    return lines


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cpu", help="cpu or cuda")
    ap.add_argument("--lengths", type=int, nargs="+", default=[256, 1024], help="completion lengths (max_new_tokens)")
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--n", type=int, default=8, help="completions per prompt")
    ap.add_argument("--temperature", type=float, default=0.9, help="the GSM8K Qwen presets' rollout.temperature")
    ap.add_argument("--cap", type=float, default=3.0, help="algo.rollout_correction_cap")
    ap.add_argument("--micro-batch", type=int, default=2, help="rows per trainer forward (2: ~1.8 GB peak RSS at "
                    "1,024 tokens on the CPU)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--logit-scale", type=float, nargs="+", default=[1.0, 10.0],
                    help="multiply the final norm's weight (so the logits) by each: a random init is near uniform "
                         "over 32k tokens, a trained model's logits are larger and its sampling entropy lower")
    args = ap.parse_args()
    device = torch.device(args.device)
    print(machine_line(device=args.device))
    cfg = load_config(None, ["model.compute_dtype=bfloat16", f"model.device={device.type}"])
    print(f"GSM8K-shaped Qwen2 in float32, sampled by the fast engine from its bfloat16 copy, trained under "
          f"bfloat16 autocast; {args.prompts} prompts x {args.n}, temperature {args.temperature}")
    for scale in args.logit_scale:
        model = gsm8k_model(args.seed, eos=EOS, pad=PAD, positions=PROMPT_TOKENS + max(args.lengths))
        with torch.no_grad():
            model.model.norm.weight.mul_(scale)
        model.to(device).eval()
        for length in args.lengths:
            start = time.perf_counter()
            batch = sample(cfg, model, args.prompts, args.n, length, args.temperature, args.seed)
            trainer, entropy = trainer_logprobs(model, batch, args.temperature, args.micro_batch, device)
            print(f"logit scale {scale:g}, {length} tokens (sampling entropy {entropy:.2f} nats a token; "
                  f"{time.perf_counter() - start:.0f} s):")
            print("\n".join(report(trainer, batch, args.cap)))


if __name__ == "__main__":
    main()
