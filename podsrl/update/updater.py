"""The policy update: mu passes over the selected rollouts, split into mini-batches (one optimiser step each) and
micro-batches (gradient accumulation). Only the rollouts handed in are forwarded, so memory and time scale with the
number kept by selection, not the number generated. Log-probs come from the shared-prompt path when the model allows
it (`update.shared_prompt`), else from the plain path; micro-batches are the same either way."""

from __future__ import annotations

import logging
import math
from collections import defaultdict
from collections.abc import Callable

import torch

from podsrl.algo.grad_noise import make_probe
from podsrl.algo.loss import LOSS_AGGREGATIONS, aggregation_stats, clipped_policy_loss, k3_kl
from podsrl.algo.rollout_correction import (
    RolloutCorrection,
    rollout_correction,
    uncorrected_staleness,
)
from podsrl.batch import RolloutBatch
from podsrl.config import Config
from podsrl.models.packed import packed_forward_problem
from podsrl.models.precision import compute_autocast, describe_precision
from podsrl.models.transformers_api import adapters_disabled, has_adapters
from podsrl.run.facts import RunFacts
from podsrl.update.plain import enable_activation_checkpointing, plain_logprobs
from podsrl.update.shared_prompt import SharedPromptForward

log = logging.getLogger("podsrl")


class PolicyUpdater:
    """Owns the optimiser step; the trainer hands it a batch with advantages and gets metrics back."""

    def __init__(self, model, optimizer, scheduler, cfg: Config, facts: RunFacts, ref_model=None,
                 modulation: Callable | None = None, data_parallel=None) -> None:
        self.model, self.optimizer, self.scheduler = model, optimizer, scheduler
        self.cfg, self.device, self.ref_model = cfg, facts.device, ref_model
        if cfg.algo.beta > 0 and ref_model is None and not has_adapters(model):
            raise ValueError("algo.beta > 0: a reference model, or LoRA adapters to disable for one")
        self.modulation = modulation  # f(advantages, log_ratio, logprobs, entropy, mask) -> (factor, metrics)
        # podsrl.distributed.DataParallel (or any implementation of its interface): splits each mini-batch across
        # ranks, sums what they computed; None in one process
        self.dp = data_parallel
        # matmuls in the compute dtype through autocast (FSDP2 casts the gathered parameters itself)
        self.param_dtype = facts.master_dtype
        sharded = data_parallel is not None and getattr(data_parallel, "sharded", False)
        self.compute_dtype = self.param_dtype if sharded else facts.compute_dtype
        log.info("precision: %s", describe_precision(facts.master_dtype, facts.compute_dtype,
                                                          lora=cfg.model.lora_rank > 0))
        if cfg.update.activation_checkpointing:  # the plain path's layers (HF's own checkpointing)
            enable_activation_checkpointing(model)
        self.shared = {id(m): self._shared_forward(m, role) for m, role in ((model, "policy"), (ref_model, "reference"))
                       if m is not None}
        self.aggregate = LOSS_AGGREGATIONS[cfg.algo.loss_agg]
        self.nonfinite_in_a_row = 0
        self.rollout_correction = facts.rollout_correction
        self._trainer_logprobs: torch.Tensor | None = None  # [R, Lc], one-pass steps with a correction
        log.info("update: rollout correction %s (algo.rollout_correction: %s; sampler/trainer mismatch: %s)",
                 self.rollout_correction, cfg.algo.rollout_correction,
                 ", ".join(facts.mismatch) or "none")
        unchecked = uncorrected_staleness(cfg)
        if unchecked is not None:
            log.warning("update: %s", unchecked)

    @property
    def needs_sampler_logprobs(self) -> bool:
        """Whether batches must carry the sampler's log-probs: PPO's old log-probs with several passes and no
        correction, or the correction's denominator."""
        return self.cfg.optim.epochs * self.cfg.optim.mini_batches > 1 or self.rollout_correction != "none"

    def _micro_batches(self, rows: torch.Tensor) -> list[torch.Tensor]:
        if self.dp is not None:  # this rank's share; the same number of micro-batches on every rank
            return self.dp.micro_batches(rows, self.cfg.optim.micro_batch_size)
        return list(rows.split(self.cfg.optim.micro_batch_size))

    def _probe(self, batch: RolloutBatch, mini: torch.Tensor, generator: torch.Generator):
        """Split-half gradient-noise probe of this mini-batch (None with fewer than two groups in it)."""
        params = [p for p in self.model.parameters() if p.requires_grad]
        return make_probe(params, batch.group_index[mini], generator)

    def _shared_forward(self, model, role: str) -> SharedPromptForward | None:
        if not self.cfg.update.shared_prompt:
            return None
        reason = packed_forward_problem(model)
        if reason is not None:
            log.warning("update: the shared-prompt path cannot drive the %s model (%s); using the plain path",
                        role, reason)
            return None
        return SharedPromptForward(model, self.cfg.update.logits_chunk, self.cfg.update.activation_checkpointing)

    def _forward(self, model, batch: RolloutBatch, rows: torch.Tensor):
        """(([B, W] log-probs, [B, W] entropies), W), W: the longest completion of these rows."""
        # trim right padding of this slice (FSDP runs empty micro-batches too, to keep ranks in lockstep)
        width = max(1, int(batch.completion_mask[rows].sum(dim=1).max())) if rows.numel() else 1
        temperature, shared = self.cfg.rollout.temperature, self.shared.get(id(model))
        with compute_autocast(self.device, self.compute_dtype, self.param_dtype):
            if shared is not None and rows.numel() and shared.fits(batch, rows, width):
                out = shared(batch, rows, width, self.device, temperature)
                if out is not None:
                    return out, width
            return plain_logprobs(model, batch, rows, width, self.device, temperature,
                                  self.cfg.update.logits_chunk), width

    @torch.no_grad()
    def _precompute(self, model, batch: RolloutBatch) -> torch.Tensor:
        """[R, Lc] log-probs under `model` (old policy or reference), computed once before the first pass."""
        out = torch.zeros_like(batch.completion_mask)
        for rows in self._micro_batches(torch.arange(batch.num_rollouts)):
            (logp, _), width = self._forward(model, batch, rows)
            out[rows, :width] = logp.float().cpu()
        if self.dp is not None:  # each rank filled its rows, zeros elsewhere
            self.dp.all_reduce_(out)
        return out

    def reference_logprobs(self, batch: RolloutBatch) -> torch.Tensor:
        """[R, Lc] log-probs under the reference: its own model, or with LoRA the policy with its adapters disabled
        (the frozen base is the starting policy: no second copy of the weights, as TRL does)."""
        if self.ref_model is not None:
            return self._precompute(self.ref_model, batch)
        with adapters_disabled(self.model):
            return self._precompute(self.model, batch)

    def update(self, batch: RolloutBatch, generator: torch.Generator) -> dict:
        cfg, model = self.cfg, self.model
        passes = cfg.optim.epochs * cfg.optim.mini_batches
        model.train()
        old_logprobs = None  # None: the current log-probs, detached (one pass: ratio = 1 exactly)
        correction = None  # over the whole batch, when the trainer's log-probs are known before the first pass
        if self.rollout_correction == "none":
            if passes > 1:  # the sampler stands in for the old policy (the same module in the same precision)
                old_logprobs = (self._precompute(model, batch) if batch.sampler_logprobs is None
                                else batch.sampler_logprobs)
        else:
            if batch.sampler_logprobs is None:
                raise ValueError(f"algo.rollout_correction {self.rollout_correction}: the batch carries no sampler "
                                 "log-probs (sample with SamplingParams(return_logprobs=True))")
            if passes > 1:  # the old policy is the trainer's, before this step's first optimiser step
                old_logprobs = self._precompute(model, batch)
                correction = self._correction(old_logprobs, batch.sampler_logprobs, batch.trained_mask)
            else:  # filled by the micro-steps with their (detached) log-probs, for the step's metrics
                self._trainer_logprobs = torch.zeros_like(batch.completion_mask)
        ref_logprobs = self.reference_logprobs(batch) if cfg.algo.beta > 0 else None
        sums: dict[str, float] = defaultdict(float)
        weight_sums: dict[str, float] = defaultdict(float)
        skipped = 0
        R = batch.num_rollouts
        noise_metrics: dict[str, float] = {}
        probe_pending = cfg.log.grad_noise  # once a step: the first mini-batch of the first pass
        for _ in range(cfg.optim.epochs):
            order = torch.randperm(R, generator=generator) if cfg.optim.mini_batches > 1 else torch.arange(R)
            for mini in order.tensor_split(cfg.optim.mini_batches):
                if mini.numel() == 0:
                    continue
                probe = self._probe(batch, mini, generator) if probe_pending else None
                probe_pending = False
                stats = aggregation_stats(batch.trained_mask[mini], cfg.rollout.max_new_tokens)
                self.optimizer.zero_grad(set_to_none=True)
                loss_total = self._accumulate(batch, mini, stats, old_logprobs, ref_logprobs, correction, sums,
                                              weight_sums, probe)
                if self.dp is not None:  # global, so every rank takes the same skip decision
                    loss_total = self.dp.sum(loss_total)
                sums["loss"] += loss_total
                weight_sums["loss"] += 1
                if self.dp is not None:
                    self.dp.grad_sync()
                if probe is not None:  # g summed over ranks, before clipping
                    noise_metrics = probe.metrics(self.dp.all_reduce_tensors_ if self.dp is not None else None)
                max_norm = cfg.optim.max_grad_norm if cfg.optim.max_grad_norm > 0 else float("inf")
                grad_norm = float(torch.nn.utils.clip_grad_norm_(
                    [p for p in model.parameters() if p.requires_grad], max_norm))
                if not (math.isfinite(grad_norm) and math.isfinite(loss_total)):
                    skipped += 1
                    self.optimizer.zero_grad(set_to_none=True)
                    continue
                self.optimizer.step()
                self.scheduler.step()
                sums["grad_norm"] += grad_norm
                weight_sums["grad_norm"] += 1
        self.nonfinite_in_a_row = self.nonfinite_in_a_row + 1 if skipped == passes else 0
        if self.dp is not None:  # micro-batch metrics were summed per rank; loss and grad_norm are global
            self.dp.reduce_metrics(sums, weight_sums, exclude=("loss", "grad_norm"))
        metrics = {k: sums[k] / weight_sums[k] for k in sums if weight_sums[k] > 0}
        metrics.update(noise_metrics)
        if self.rollout_correction != "none":
            if correction is None:  # one pass: the trainer's log-probs are the micro-steps' own
                if self.dp is not None:  # each rank filled its rows, zeros elsewhere
                    self.dp.all_reduce_(self._trainer_logprobs)
                correction = self._correction(self._trainer_logprobs, batch.sampler_logprobs, batch.trained_mask)
                self._trainer_logprobs = None
            metrics.update(correction.metric_values())
        metrics["train/nonfinite_skipped"] = float(skipped)
        metrics["learning_rate"] = self.scheduler.get_last_lr()[0]
        return metrics

    def _correction(self, trainer_logprobs, sampler_logprobs, mask) -> RolloutCorrection:
        algo = self.cfg.algo
        return rollout_correction(trainer_logprobs, sampler_logprobs, mask, self.rollout_correction,
                                  algo.rollout_correction_cap, algo.rollout_correction_cap_low)

    def _accumulate(self, batch, mini, stats, old_logprobs, ref_logprobs, correction, sums, weight_sums,
                    probe) -> float:
        """Backward over the mini-batch's micro-batches, adding metrics to `sums`; returns this rank's loss. With a
        probe, half A's micro-batches run first and its gradient is snapshotted before half B's."""
        loss_total = 0.0
        for half, rows_of_half in enumerate(probe.halves(mini) if probe is not None else [mini]):
            for rows in self._micro_batches(rows_of_half):
                loss, m = self._micro_step(batch, rows, stats, old_logprobs, ref_logprobs, correction)
                loss_total += loss
                for k, (v, w) in m.items():
                    sums[k] += v
                    weight_sums[k] += w
            if probe is not None and half == 0:
                probe.snapshot()
        return loss_total

    def _micro_step(self, batch, rows, stats, old_logprobs, ref_logprobs, correction=None):
        cfg = self.cfg
        (logp, entropy), width = self._forward(self.model, batch, rows)
        mask = batch.trained_mask[rows, :width].to(self.device)  # the model's tokens: tool output is context only
        old = logp.detach() if old_logprobs is None else old_logprobs[rows, :width].to(self.device)
        adv = batch.advantages[rows].to(self.device)[:, None].expand_as(logp)
        metrics: dict[str, tuple[float, float]] = {}
        if self.modulation is not None:
            factor, mod_metrics = self.modulation(adv, logp.detach() - old, logp.detach(), entropy.detach(), mask)
            adv = adv * factor.detach()
            n = float(mask.sum())
            metrics.update({k: (v * n, n) for k, v in mod_metrics.items()})
        per_token, low, high = clipped_policy_loss(logp, old, adv, cfg.algo.epsilon_low, cfg.algo.epsilon_high)
        if self.rollout_correction != "none":  # TRL: the weight multiplies the policy loss, not the KL term
            per_token = per_token * self._correction_weight(batch, rows, width, logp, mask, correction)
        if ref_logprobs is not None:
            kl = k3_kl(logp, ref_logprobs[rows, :width].to(self.device))
            if cfg.algo.kl_ratio_weighted:  # TRL's use_bias_correction_kl: the ratio's gradient reaches the KL
                kl = kl * torch.exp(logp - old)
            per_token = per_token + cfg.algo.beta * kl
            metrics["kl"] = (float((kl.detach() * mask).sum()), float(mask.sum()))
        weights = self.aggregate(mask, stats)
        loss = (weights * per_token).sum()
        loss.backward()
        n_tok = float(mask.sum())
        metrics["entropy"] = (float((entropy.detach() * mask).sum()), n_tok)
        metrics["clip_ratio/low_mean"] = (float((low.float() * mask).sum()), n_tok)
        metrics["clip_ratio/high_mean"] = (float((high.float() * mask).sum()), n_tok)
        metrics["clip_ratio/region_mean"] = (float(((low | high).float() * mask).sum()), n_tok)
        return float(loss.detach()), metrics

    def _correction_weight(self, batch, rows, width, logp, mask, correction) -> torch.Tensor:
        """[B, W] rollout-correction weight of these rows: from the whole-batch correction when the trainer's
        log-probs were precomputed, else from this micro-step's own log-probs (recorded for the step's metrics)."""
        if correction is not None:
            return correction.weight[rows, :width].to(self.device)
        self._trainer_logprobs[rows, :width] = logp.detach().float().cpu()
        sampler = batch.sampler_logprobs[rows, :width].to(self.device)
        return self._correction(logp, sampler, mask).weight
