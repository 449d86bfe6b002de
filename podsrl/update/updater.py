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
from podsrl.algo.micro_batches import row_tokens, split_rows
from podsrl.algo.rollout_correction import RolloutCorrection, rollout_correction
from podsrl.batch import RolloutBatch
from podsrl.config.facts import RunFacts
from podsrl.models.packed import packed_forward_problem
from podsrl.models.precision import compute_autocast, describe_precision
from podsrl.models.transfer import host_values, to_device
from podsrl.models.transformers_api import adapters_disabled, has_adapters
from podsrl.update.plain import enable_activation_checkpointing, plain_logprobs
from podsrl.update.settings import UpdateSettings
from podsrl.update.shared_prompt import SharedPromptForward

log = logging.getLogger("podsrl")


class PolicyUpdater:
    """Owns the optimiser step; the trainer hands it a batch with advantages and gets metrics back."""

    def __init__(self, model, optimizer, scheduler, cfg: UpdateSettings, facts: RunFacts, ref_model=None,
                 modulation: Callable | None = None, data_parallel=None) -> None:
        self.model, self.optimizer, self.scheduler = model, optimizer, scheduler
        self.cfg, self.device, self.ref_model = cfg, facts.device, ref_model
        if cfg.algo.beta > 0 and ref_model is None and not has_adapters(model):
            raise ValueError("algo.beta > 0: a reference model, or LoRA adapters to disable for one")
        if cfg.micro_batch_size < 1:
            raise ValueError("optim.micro_batch_size=0 (auto) is decided at start-up: pass the size "
                             "podsrl.run.micro_batch.resolve_micro_batch decides (UpdateSettings.of)")
        self.modulation = modulation  # f(advantages, log_ratio, logprobs, entropy, mask) -> (factor, metrics)
        # podsrl.distributed.DataParallel (or any implementation of its interface): splits each mini-batch across
        # ranks, sums what they computed; None in one process
        self.dp = data_parallel
        # matmuls in the compute dtype through autocast (FSDP2 casts the gathered parameters itself)
        self.param_dtype = facts.master_dtype
        sharded = data_parallel is not None and getattr(data_parallel, "sharded", False)
        self.compute_dtype = self.param_dtype if sharded else facts.compute_dtype
        log.info("precision: %s", describe_precision(facts.master_dtype, facts.compute_dtype,
                                                          lora=cfg.lora))
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
        if cfg.unchecked_staleness is not None:
            log.warning("update: %s", cfg.unchecked_staleness)

    @property
    def needs_sampler_logprobs(self) -> bool:
        """Whether batches must carry the sampler's log-probs: PPO's old log-probs with several passes and no
        correction, or the correction's denominator."""
        return self.cfg.optim.epochs * self.cfg.optim.mini_batches > 1 or self.rollout_correction != "none"

    def _micro_batches(self, batch: RolloutBatch, rows: torch.Tensor) -> list[torch.Tensor]:
        size, tokens = self.cfg.micro_batch_size, self.cfg.optim.micro_batch_tokens
        lengths = row_tokens(batch.prompt_mask, batch.completion_mask) if tokens > 0 else None
        if self.dp is not None:  # this rank's share; the same number of micro-batches on every rank
            return self.dp.micro_batches(rows, size, lengths, tokens)
        return split_rows(rows, size, lengths, tokens)

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
        return SharedPromptForward(model, self.cfg.update.logits_chunk, self.cfg.update.activation_checkpointing,
                                   keep_plans=True)

    def _weights_changed(self) -> None:
        """The shared-prompt forwards make their fused weights again (kept across micro-batches until now)."""
        for shared in self.shared.values():
            if shared is not None:
                shared.forward.forget_weights()

    def _forward(self, model, batch: RolloutBatch, rows: torch.Tensor):
        """(([B, W] log-probs, [B, W] entropies), W), W: the longest completion of these rows."""
        # trim right padding of this slice (FSDP runs empty micro-batches too, to keep ranks in lockstep)
        width = max(1, int(batch.completion_mask[rows].sum(dim=1).max())) if rows.numel() else 1
        temperature, shared = self.cfg.temperature, self.shared.get(id(model))
        with compute_autocast(self.device, self.compute_dtype, self.param_dtype):
            if shared is not None and rows.numel() and shared.fits(batch, rows, width):
                out = shared(batch, rows, width, self.device, temperature)
                if out is not None:
                    return out, width
            return plain_logprobs(model, batch, rows, width, self.device, temperature,
                                  self.cfg.update.logits_chunk), width

    @torch.no_grad()
    def _precompute(self, model, batch: RolloutBatch) -> torch.Tensor:
        """[R, Lc] log-probs under `model` (old policy or reference), computed once before the first pass; on the
        device (a copy to the host per micro-batch would make the host wait for each)."""
        out = torch.zeros(batch.completion_mask.shape, device=self.device)
        for rows in self._micro_batches(batch, torch.arange(batch.num_rollouts)):
            (logp, _), width = self._forward(model, batch, rows)
            out[rows, :width] = logp.float()
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
        self._weights_changed()  # changed since the last update, perhaps (a checkpoint load)
        old_logprobs = None  # None: the current log-probs, detached (one pass: ratio = 1 exactly)
        correction = None  # over the whole batch, when the trainer's log-probs are known before the first pass
        if self.rollout_correction == "none":
            if passes > 1:  # the sampler stands in for the old policy (the same module in the same precision)
                old_logprobs = (self._precompute(model, batch) if batch.sampler_logprobs is None
                                else to_device([batch.sampler_logprobs], self.device)[0])
        else:
            if batch.sampler_logprobs is None:
                raise ValueError(f"algo.rollout_correction {self.rollout_correction}: the batch carries no sampler "
                                 "log-probs (sample with SamplingParams(return_logprobs=True))")
            if passes > 1:  # the old policy is the trainer's, before this step's first optimiser step
                old_logprobs = self._precompute(model, batch)
                correction = self._correction(old_logprobs, *to_device([batch.sampler_logprobs, batch.trained_mask],
                                                                       self.device))
            else:  # filled by the micro-steps with their (detached) log-probs, for the step's metrics
                self._trainer_logprobs = torch.zeros(batch.completion_mask.shape, device=self.device)
        ref_logprobs = self.reference_logprobs(batch) if cfg.algo.beta > 0 else None
        sums: dict[str, float] = defaultdict(float)
        weight_sums: dict[str, float] = defaultdict(float)
        skipped = 0
        R = batch.num_rollouts
        noise_metrics: dict[str, float] = {}
        probe_pending = cfg.grad_noise  # once a step: the first mini-batch of the first pass
        for _ in range(cfg.optim.epochs):
            order = torch.randperm(R, generator=generator) if cfg.optim.mini_batches > 1 else torch.arange(R)
            for mini in order.tensor_split(cfg.optim.mini_batches):
                if mini.numel() == 0:
                    continue
                probe = self._probe(batch, mini, generator) if probe_pending else None
                probe_pending = False
                stats = aggregation_stats(batch.trained_mask[mini], cfg.max_new_tokens)
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
                self._weights_changed()
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
                sampler, mask = to_device([batch.sampler_logprobs, batch.trained_mask], self.device)
                correction = self._correction(self._trainer_logprobs, sampler, mask)
                self._trainer_logprobs = None
            metrics.update(correction.metric_values())
        self._weights_changed()  # and the kept fused weights freed
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
        probe, half A's micro-batches run first and its gradient is snapshotted before half B's. The micro-steps'
        losses and metrics stay on the device until all have run, then come back in one read."""
        losses, pending = [], []
        for half, rows_of_half in enumerate(probe.halves(mini) if probe is not None else [mini]):
            for rows in self._micro_batches(batch, rows_of_half):
                loss, m = self._micro_step(batch, rows, stats, old_logprobs, ref_logprobs, correction)
                losses.append(loss)
                pending.extend((k, v, w) for k, (v, w) in m.items())
            if probe is not None and half == 0:
                probe.snapshot()
        values = host_values([*losses, *(x for _, v, w in pending for x in (v, w))])
        loss_total = 0.0
        for _ in losses:  # added one by one as before: the same floats in the same order, so the same sums
            loss_total += next(values)
        for k, _, _ in pending:
            sums[k] += next(values)
            weight_sums[k] += next(values)
        return loss_total

    def _micro_step(self, batch, rows, stats, old_logprobs, ref_logprobs, correction=None):
        """(loss, {metric: (value, weight)}), values and weights 0-dim tensors on the device or floats."""
        cfg = self.cfg
        (logp, entropy), width = self._forward(self.model, batch, rows)
        one_pass_correction = self.rollout_correction != "none" and correction is None
        # this micro-batch's host columns in one transfer per dtype; `rows` too, to index the device's columns
        per_token = batch.token_advantages  # episode.credit: turn; else the row's advantage on each of its tokens
        adv_rows = batch.advantages[rows] if per_token is None else per_token[rows, :width]
        host = [rows, batch.trained_mask[rows, :width], adv_rows]  # mask: the model's tokens only
        rows, mask, adv, *sampler = to_device(host + ([batch.sampler_logprobs[rows, :width]] if one_pass_correction
                                                      else []), self.device)
        old = logp.detach() if old_logprobs is None else old_logprobs[rows, :width]
        adv = adv[:, None].expand_as(logp) if adv.dim() == 1 else adv
        metrics: dict[str, tuple[torch.Tensor | float, torch.Tensor | float]] = {}
        if self.modulation is not None:  # its metrics are floats: one read of the token count here
            factor, mod_metrics = self.modulation(adv, logp.detach() - old, logp.detach(), entropy.detach(), mask)
            adv = adv * factor.detach()
            n = float(mask.sum())
            metrics.update({k: (v * n, n) for k, v in mod_metrics.items()})
        per_token, low, high = clipped_policy_loss(logp, old, adv, cfg.algo.epsilon_low, cfg.algo.epsilon_high)
        if self.rollout_correction != "none":  # TRL: the weight multiplies the policy loss, not the KL term
            weight = (correction.weight[rows, :width] if correction is not None
                      else self._micro_step_correction(rows, width, logp, sampler[0], mask))
            per_token = per_token * weight
        n_tok = mask.sum()
        if ref_logprobs is not None:
            kl = k3_kl(logp, ref_logprobs[rows, :width])
            if cfg.algo.kl_ratio_weighted:  # TRL's use_bias_correction_kl: the ratio's gradient reaches the KL
                kl = kl * torch.exp(logp - old)
            per_token = per_token + cfg.algo.beta * kl
            metrics["kl"] = ((kl.detach() * mask).sum(), n_tok)
        weights = self.aggregate(mask, stats)
        loss = (weights * per_token).sum()
        loss.backward()
        metrics["entropy"] = ((entropy.detach() * mask).sum(), n_tok)
        metrics["clip_ratio/low_mean"] = ((low.float() * mask).sum(), n_tok)
        metrics["clip_ratio/high_mean"] = ((high.float() * mask).sum(), n_tok)
        metrics["clip_ratio/region_mean"] = (((low | high).float() * mask).sum(), n_tok)
        return loss.detach(), metrics

    def _micro_step_correction(self, rows, width, logp, sampler, mask) -> torch.Tensor:
        """[B, W] rollout-correction weight of these rows from this micro-step's own log-probs (one pass: the
        trainer's log-probs are not known before it), which are recorded for the step's metrics."""
        self._trainer_logprobs[rows, :width] = logp.detach().float()
        return self._correction(logp, sampler, mask).weight
