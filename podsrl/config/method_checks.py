"""The config checks that need a registry: the method's name and its own section's checks, the engine's options,
the trackers. load_config runs them after the plain field checks of podsrl/config/checks.py, so every entry
point (CLI, Python, the experiments) refuses a bad choice with one line naming the key."""

from __future__ import annotations

from typing import TYPE_CHECKING

from podsrl.engines import check_engine_options
from podsrl.errors import ConfigError
from podsrl.methods import METHODS
from podsrl.models.precision import check_precision
from podsrl.reporting.tracking import normalize_report_to

if TYPE_CHECKING:
    from podsrl.config import Config


def check_choices(cfg: Config) -> None:
    """Raise ConfigError naming the key of a bad method, method option, engine option, tracker or dtype pair.
    Reads only: the config is as loaded afterwards."""
    normalize_report_to(cfg.log.report_to, cfg.log.tensorboard)
    check_engine_options(cfg.rollout.engine, cfg.rollout.engine_options)
    check_precision(cfg)
    if cfg.method not in METHODS:
        raise ConfigError(f"method: unknown method {cfg.method!r}; choose one of {', '.join(METHODS)}")
    method = METHODS[cfg.method]
    if cfg.rollout.n < 2 and method.uses_rollout_n:
        raise ConfigError("rollout.n: 1 rollout per prompt makes every group advantage zero, so nothing is learned; "
                          "use >= 2")
    method.validate(cfg)
