"""The checks of a loaded config: first every field's own bounds (declared on the field, podsrl/config/bounds.py),
then the checks across fields here, each naming the offending key; the checks against the registries (engine
options, trackers, the method's own) are podsrl/config/method_checks.py's."""

from __future__ import annotations

from typing import TYPE_CHECKING

from podsrl.config.bounds import check_bounds
from podsrl.config.method_checks import check_choices
from podsrl.engines import ENGINES, engine_class
from podsrl.errors import ConfigError
from podsrl.tasks import task_class

if TYPE_CHECKING:
    from podsrl.config import Config


def validate(cfg: Config) -> None:
    """The fields' bounds, then the cross-field checks, each naming the offending key."""

    def need(cond: bool, key: str, msg: str) -> None:
        if not cond:
            raise ConfigError(f"{key}: {msg}")

    check_bounds(cfg)
    need(cfg.algo.rollout_correction_cap > cfg.algo.rollout_correction_cap_low,
         "algo.rollout_correction_cap", "needs rollout_correction_cap > rollout_correction_cap_low >= 0")
    engine = cfg.rollout.engine_type
    if cfg.train.asynchronous.enabled and not engine.may_run_async:
        able = " or ".join(name for name in ENGINES if engine_class(name).may_run_async)
        need(False, "train.async.enabled",
             f"needs rollout.engine {able} (got {cfg.rollout.engine}): {engine.no_async_reason}")
    fsdp = cfg.train.strategy == "fsdp"
    need(fsdp or not cfg.train.cpu_offload, "train.cpu_offload", "needs train.strategy=fsdp")
    need(not (fsdp and cfg.log.grad_noise), "log.grad_noise", "is not available with train.strategy=fsdp (its "
         "split-half gradients would be sharded); set log.grad_noise=false or train.strategy=ddp")
    t = cfg.model.tiny
    need(t.hidden_size % t.num_heads == 0, "model.tiny.hidden_size", "must be divisible by model.tiny.num_heads")
    need(not (cfg.model.name_or_path == "tiny" and cfg.warmup.steps > 0
             and not task_class(cfg.task.name).gives_references()),
         "warmup.steps", f"the built-in model's warm-up needs reference completions, which a {cfg.task.name} task "
         "does not have: set warmup.steps=0, or give model.name_or_path")
    check_choices(cfg)
