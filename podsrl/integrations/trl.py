"""PODS down-sampling and zero-variance filtering for TRL's `GRPOTrainer` (trl>=1.0,<2).

`PODSGRPOTrainer` lets TRL generate and score n = `num_generations` completions per prompt exactly as usual (same
dataset handling, generation backends, reward functions and logging), then post-processes the generated batch
before TRL splits it into micro-steps: it keeps m = `pods_m` completions per prompt and recomputes their advantages
with the PODS method's own step (`pods_keep`, TRL's `scale_rewards` semantics), optionally drops zero-variance
prompts, and slices every per-completion entry of the batch. The loss therefore only ever sees the kept rows.

Selection runs on the rewards of the whole (all-process) generation batch, so every process takes the same decision;
each process then keeps its own rows. The config guarantees that each device holds whole prompt groups.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

# Imported first: it checks the TRL version before anything from TRL is touched.
from podsrl.integrations.trl_config import (  # isort: skip
    TRL_SUPPORTED_SPEC,
    PODSConfigError,
    PODSGRPOConfig,
    require_trl,
)
from trl import GRPOTrainer
from trl.trainer.utils import split_pixel_values_by_grid, unsplit_pixel_values_by_grid

from podsrl.algo.group_stats import group_stats, zero_variance_groups
from podsrl.algo.selection import pods_keep, selection_metrics

__all__ = ["TRL_SUPPORTED_SPEC", "PODSGRPOConfig", "PODSGRPOTrainer", "PODSSelection", "pods_select", "slice_batch"]

# Batch entries that describe the whole batch rather than one completion each.
_BATCH_LEVEL_KEYS = frozenset({"num_items_in_batch"})
_TRL_EPSILON = 1e-4  # added to the std in GRPOTrainer's advantage denominator


@dataclass
class PODSSelection:
    """What reaches the loss on this process, plus logging material.

    rows: local row indices (ascending) into the generated batch; advantages: [len(rows)] float32;
    padding: [len(rows)] bool, rows of dropped zero-variance groups kept back (advantage 0) so every micro-step has
    rows; logged_advantages: [R_global] advantage of every generated row, NaN where it is not trained.
    """

    rows: torch.Tensor
    advantages: torch.Tensor
    padding: torch.Tensor
    logged_advantages: torch.Tensor
    metrics: dict[str, float]


def pods_select(
    rewards: torch.Tensor,
    num_generations: int,
    m: int,
    rule: str,
    *,
    scale: str = "group",
    normalize_over: str = "subset",
    filter_zero_variance: bool = False,
    local_rows: slice | None = None,
    steps_per_generation: int = 1,
    generator: torch.Generator | None = None,
) -> PODSSelection:
    """Select, re-normalise and filter a TRL generation batch given its global per-row rewards.

    Rows come in TRL's order: row j belongs to prompt j // num_generations. NaN rewards (unscorable completions) are
    replaced by their group's mean of scorable rewards for selection and statistics, and get advantage 0 (as in TRL).
    `local_rows` is this process's slice of the global rows (default: all); its kept row count must be a multiple of
    `steps_per_generation` (the config enforces it), which zero-variance padding preserves.
    """
    rewards = rewards.detach().double().cpu().flatten()
    total = rewards.numel()
    if total % num_generations:
        raise ValueError(f"{total} generated rows are not whole groups of num_generations={num_generations}")
    num_groups = total // num_generations
    group = torch.arange(total) // num_generations
    finite = torch.isfinite(rewards)
    fill = group_stats(rewards[finite], group[finite], num_groups).mean  # mean of the scorable rewards
    r = torch.where(finite, rewards, fill[group])

    if normalize_over not in ("subset", "group"):
        raise PODSConfigError(f"pods_normalize_over must be 'subset' or 'group'; got {normalize_over!r}")
    # the PODS method's own step: its rule's rows and their advantages (algo/selection.py)
    kept, adv = pods_keep(r, group, num_groups, num_generations, m, rule, normalize_over, scale, _TRL_EPSILON,
                          generator)
    basis_r, basis_g = (r, group) if normalize_over == "group" else (r[kept], group[kept])
    adv = torch.where(finite[kept], adv, torch.zeros_like(adv))

    if filter_zero_variance:
        zero_group = zero_variance_groups(basis_r, basis_g, num_groups)
    else:
        zero_group = torch.zeros(num_groups, dtype=torch.bool)
    trained_global = ~zero_group[group[kept]]
    logged = torch.full((total,), float("nan"))
    logged[kept[trained_global]] = adv[trained_global]

    start, stop = (0, total) if local_rows is None else (local_rows.start, local_rows.stop)
    local = (kept >= start) & (kept < stop)
    local_kept, local_adv, local_train = kept[local] - start, adv[local], trained_global[local]
    survivors = int(local_train.sum())
    spg = steps_per_generation
    # Every micro-step needs at least one row and TRL splits the batch into equal chunks (dropping a remainder),
    # so keep back the fewest filtered rows that make the count a positive multiple of steps_per_generation.
    need = (-survivors) % spg if survivors >= spg else spg - survivors
    dropped = ~local_train
    padding = dropped & (torch.cumsum(dropped.long(), 0) <= need)
    final = local_train | padding
    if int(final.sum()) % spg or not final.any():
        raise ValueError(
            f"{local_kept.numel()} kept rows on this process cannot be split into steps_per_generation={spg} "
            "micro-steps; per_device_train_batch_size * pods_m must be divisible by num_generations"
        )

    metrics = {k.replace("select/", "pods/").replace("frac_zero_std", "frac_reward_zero_std"): v
               for k, v in selection_metrics(r, group, num_groups, kept).items()}
    metrics["pods/completions_generated"] = float(total)
    metrics["pods/completions_selected"] = float(kept.numel())
    metrics["pods/groups_filtered_frac"] = float(zero_group.double().mean()) if filter_zero_variance else 0.0
    metrics["pods/reward_mean_after"] = float(r[kept].mean()) if kept.numel() else float("nan")
    return PODSSelection(
        rows=local_kept[final],
        advantages=torch.where(padding[final], 0.0, local_adv[final]).float(),
        padding=padding[final],
        logged_advantages=logged,
        metrics=metrics,
    )


def slice_batch(batch: dict[str, Any], rows: torch.Tensor, num_rows: int) -> dict[str, Any]:
    """Keep `rows` of every per-completion entry (tensors or lists whose first dimension is `num_rows`).

    Image entries are first split per sample with TRL's own helpers, so they are sliced like the rest.
    """
    split = split_pixel_values_by_grid(batch)
    index = rows.tolist()
    out: dict[str, Any] = {}
    for key, value in split.items():
        if key in _BATCH_LEVEL_KEYS or value is None:
            out[key] = value
        elif isinstance(value, torch.Tensor) and value.dim() >= 1 and value.size(0) == num_rows:
            out[key] = value.index_select(0, rows.to(value.device))
        elif isinstance(value, list) and len(value) == num_rows:
            out[key] = [value[i] for i in index]
        else:
            out[key] = value
    return unsplit_pixel_values_by_grid(out)


class PODSGRPOTrainer(GRPOTrainer):
    """GRPOTrainer that generates n completions per prompt and trains on the m chosen by a PODS rule.

    Takes the same arguments as `GRPOTrainer`; `args` must be a `PODSGRPOConfig`. Evaluation is left untouched.
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        require_trl()
        super().__init__(*args, **kwargs)
        if not isinstance(self.args, PODSGRPOConfig):
            raise PODSConfigError(
                f"PODSGRPOTrainer needs args=PODSGRPOConfig(...), got {type(self.args).__name__}; PODSGRPOConfig "
                "takes every GRPOConfig field plus pods_m, pods_rule, pods_normalize_over and filter_zero_variance."
            )
        self._pods_rewards_per_func: torch.Tensor | None = None
        # Same seed on every process, so the 'random' rule takes the same decision everywhere.
        self._pods_generator = torch.Generator().manual_seed(self.args.seed)

    def _calculate_rewards(self, inputs, prompts, completions, completion_ids_list):
        # TRL returns the rewards of the whole (all-process) batch here but keeps only advantages in its output.
        rewards_per_func = super()._calculate_rewards(inputs, prompts, completions, completion_ids_list)
        self._pods_rewards_per_func = rewards_per_func
        return rewards_per_func

    def _defer_reference_logps(self, inputs) -> bool:
        """Whether the KL reference log-probs can wait until after selection (text-only, separate ref model)."""
        has_images = bool(inputs) and any(key in inputs[0] for key in ("image", "images"))
        return self.beta != 0.0 and self.ref_model is not None and not getattr(self, "_is_vlm", False) and not has_images

    def _generate_and_score_completions(self, inputs):
        if not self.model.training:
            return super()._generate_and_score_completions(inputs)
        # TRL would run the reference model over all n completions; PODS only needs it on the kept m.
        defer_ref = self._defer_reference_logps(inputs)
        beta = self.beta
        if defer_ref:
            self.beta = 0.0  # only read, inside generation, to decide whether to compute reference log-probs
        try:
            output = super()._generate_and_score_completions(inputs)
        finally:
            self.beta = beta
        args: PODSGRPOConfig = self.args
        rewards_per_func = self._pods_rewards_per_func
        self._pods_rewards_per_func = None
        weights = self.reward_weights.to(rewards_per_func.device).unsqueeze(0)
        rewards = (rewards_per_func * weights).nansum(dim=1)
        rewards[torch.isnan(rewards_per_func).all(dim=1)] = float("nan")  # unscorable, as TRL treats them

        num_rows = output["prompt_ids"].size(0)
        start = self.accelerator.process_index * num_rows
        sel = pods_select(
            rewards,
            self.num_generations,
            args.pods_m,
            args.pods_rule,
            scale=self.scale_rewards,
            normalize_over=args.pods_normalize_over,
            filter_zero_variance=args.filter_zero_variance,
            local_rows=slice(start, start + num_rows),
            steps_per_generation=args.steps_per_generation,
            generator=self._pods_generator,
        )
        device = output["prompt_ids"].device
        output = slice_batch(output, sel.rows.to(device), num_rows)
        output["advantages"] = sel.advantages.to(device=device, dtype=output["advantages"].dtype)
        # The token count of the dapo/cispo/vespo normaliser must describe the rows that are actually trained.
        loss_mask = output["completion_mask"]
        if output.get("tool_mask") is not None:
            loss_mask = loss_mask * output["tool_mask"]
        output["num_items_in_batch"] = self.accelerator.gather(loss_mask.sum()).sum()
        if defer_ref:
            output["ref_per_token_logps"] = self._reference_logps(output)

        counts = torch.tensor([float(sel.rows.numel()), float(sel.padding.sum())], device=device)
        trained, padded = self.accelerator.gather(counts).view(-1, 2).sum(dim=0).tolist()
        metrics = self._metrics["train"]
        for name, value in sel.metrics.items():
            metrics[name].append(value)
        metrics["pods/completions_trained"].append(trained)
        metrics["pods/completions_padded"].append(padded)

        # The completions table should show the advantage each completion was trained with (NaN: not trained).
        logged = self._logs["advantages"]
        for _ in range(min(sel.logged_advantages.numel(), len(logged))):
            logged.pop()
        logged.extend(sel.logged_advantages.tolist())
        return output

    @torch.no_grad()
    def _reference_logps(self, batch: dict[str, Any]) -> torch.Tensor:
        completion_ids = batch["completion_ids"]
        ids = torch.cat([batch["prompt_ids"], completion_ids], dim=1)
        mask = torch.cat([batch["prompt_mask"], batch["completion_mask"]], dim=1)
        logps, _, _ = self._get_per_token_logps_and_entropies(
            self.ref_model, ids, mask, completion_ids.size(1), batch_size=self.args.per_device_train_batch_size
        )
        return logps
