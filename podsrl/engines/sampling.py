"""Counter-based per-row randomness and vectorised top-k/top-p sampling.

A row's random number at completion position t is a pure function of (seed, t): a splitmix64 mix computed with
int64 tensor ops. Combined with inverse-CDF sampling, a row's sample depends only on its own logits, its seed and the
position, never on which other rows share the batch or where the row sits in it.
"""

from __future__ import annotations

import torch

_MASK64 = (1 << 64) - 1


def _signed(value: int) -> int:
    """A 64-bit constant in int64 (two's complement) so tensor arithmetic wraps like uint64."""
    value &= _MASK64
    return value - (1 << 64) if value >= 1 << 63 else value


_GOLDEN = _signed(0x9E3779B97F4A7C15)
_MUL1 = _signed(0xBF58476D1CE4E5B9)
_MUL2 = _signed(0x94D049BB133111EB)


def _shr(x: torch.Tensor, bits: int) -> torch.Tensor:
    """Logical right shift of int64 (torch's >> is arithmetic on negative values)."""
    return (x >> bits) & ((1 << (64 - bits)) - 1)


def splitmix64(x: torch.Tensor) -> torch.Tensor:
    """The splitmix64 finaliser applied elementwise to int64 tensors (bit pattern of the uint64 result)."""
    z = x + _GOLDEN
    z = (z ^ _shr(z, 30)) * _MUL1
    z = (z ^ _shr(z, 27)) * _MUL2
    return z ^ _shr(z, 31)


def row_uniforms(seeds: torch.Tensor, position: int | torch.Tensor) -> torch.Tensor:
    """[R] float64 uniforms in [0, 1), one per row, from hash(hash(seed) + position)."""
    z = splitmix64(splitmix64(seeds.long()) + position)
    return _shr(z, 11).double() * (1.0 / (1 << 53))


def derive_seed(seeds: torch.Tensor) -> int:
    """One non-negative 63-bit seed summarising a seeds tensor (for engines without per-row seeds)."""
    if seeds.numel() == 0:
        return 0
    mixed = splitmix64(splitmix64(seeds.long().flatten()) + torch.arange(seeds.numel(), device=seeds.device))
    return int(splitmix64(mixed.sum()).item()) & ((1 << 63) - 1)


def filter_logits(scaled: torch.Tensor, top_k: int, top_p: float) -> torch.Tensor:
    """Top-k then top-p on temperature-scaled logits [B, V], -inf outside the kept set.

    Same semantics as transformers' warpers: top-k keeps every token tied with the k-th largest; top-p keeps the
    smallest high-probability set whose mass reaches top_p (the token crossing the threshold included, at least one).
    """
    out = scaled
    if 0 < top_k < scaled.shape[-1]:
        kth = torch.topk(out, top_k, dim=-1).values[..., -1:]
        out = out.masked_fill(out < kth, float("-inf"))
    if top_p < 1.0:
        sorted_logits, order = torch.sort(out, dim=-1, descending=True)
        probs = sorted_logits.softmax(dim=-1)
        mass_before = probs.cumsum(dim=-1) - probs
        remove_sorted = mass_before >= top_p
        remove_sorted[..., 0] = False
        remove = torch.zeros_like(remove_sorted).scatter(-1, order, remove_sorted)
        out = out.masked_fill(remove, float("-inf"))
    return out


def sample_rows(
    logits: torch.Tensor,
    seeds: torch.Tensor,
    position: int,
    temperature: float,
    top_k: int = 0,
    top_p: float = 1.0,
    greedy: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Tokens [B] and their log-probs [B] = log_softmax(logits / T)[token] (before top-k/top-p truncation).

    Sampling is inverse-CDF: the row's uniform (from its seed and `position`) is scaled by the kept mass and located
    in the cumulative distribution, so no renormalisation pass and no global RNG are needed.
    """
    uniforms = None if greedy or temperature <= 0 else row_uniforms(seeds, position)
    return sample_with_uniforms(logits, uniforms, temperature, top_k, top_p)


def sample_with_uniforms(
    logits: torch.Tensor, uniforms: torch.Tensor | None, temperature: float, top_k: int = 0, top_p: float = 1.0
) -> tuple[torch.Tensor, torch.Tensor]:
    """`sample_rows` with the rows' uniforms [B] given (a decode loop hashes all positions at once); None = greedy.

    Without top-k/top-p (and greedy) the vocabulary is read in two operations after the temperature: one softmax
    (float32) and its cumsum in float64, searched by the (float64) uniform (greedy: an argmax instead of the
    cumsum); the log-prob is the log of the token's probability, read from that softmax (its normaliser is the
    log-softmax's), so no [B, V] log-softmax or shifted exponentials are written. Top-k/top-p search the float64
    CDF of the kept logits' exponentials, shifted by the largest logit (which they keep), and take the log-prob
    before truncation from the same softmax.
    """
    # the temperature applies to float32 logits; dividing by 1 is exact, so skipping it changes nothing
    scaled = logits.float() / temperature if temperature > 0 and temperature != 1.0 else logits.float()
    probs = scaled.softmax(dim=-1)
    if uniforms is None:
        tokens = logits.argmax(dim=-1)
    else:
        kept = filter_logits(scaled, top_k, top_p)
        weights = probs if kept is scaled else (kept - scaled.amax(-1, keepdim=True)).exp()
        # in float64: a float32 CDF near 1 has steps of 6e-8, so over a 152k vocabulary a tail token's share would
        # be rounded to 0 or twice its mass (and CUDA's float32 scan accumulates in float32 too)
        cdf = weights.cumsum(dim=-1, dtype=torch.float64)
        total = cdf[..., -1:]
        target = uniforms.to(cdf.device, cdf.dtype).unsqueeze(-1) * total
        # float rounding must not push the target onto the total (that would pick a trailing zero-mass token)
        target = torch.minimum(target, torch.nextafter(total, torch.zeros_like(total)))
        tokens = torch.searchsorted(cdf, target, right=True).squeeze(-1)
    return tokens, probs.gather(-1, tokens.unsqueeze(-1)).squeeze(-1).log()


def sample_next(
    logits: torch.Tensor,
    uniforms: torch.Tensor | None,
    finished: torch.Tensor,
    is_stop: torch.Tensor,
    pad_token_id: int,
    temperature: float,
    top_k: int = 0,
    top_p: float = 1.0,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """One decode position of a batch: (tokens, log-probs, finished) [B] from `sample_with_uniforms`, rows that
    had finished emitting padding with log-prob 0, a row finished once it emits a stop token (`is_stop` [V] bool,
    a lookup: the same ops for any number of stop tokens). No host synchronisation: a decode step runs it inside
    a CUDA graph."""
    tokens, logprobs = sample_with_uniforms(logits, uniforms, temperature, top_k, top_p)
    tokens = tokens.masked_fill(finished, pad_token_id)
    logprobs = logprobs.masked_fill(finished, 0.0)
    return tokens, logprobs, finished | is_stop[tokens]
