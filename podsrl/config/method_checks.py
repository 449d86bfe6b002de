"""The config checks that need a registry: the method's name and its own section's checks, the engine's options,
the trackers. load_config runs them after the plain field checks of podsrl/config/checks.py, so every entry
point (CLI, Python, the experiments) refuses a bad choice with one line naming the key."""

from __future__ import annotations

import types
import typing
from typing import TYPE_CHECKING, Any

from podsrl.config.convert import convert
from podsrl.engines import check_engine_options, engine_class
from podsrl.errors import ConfigError
from podsrl.methods import METHODS
from podsrl.models.precision import check_precision
from podsrl.reporting.tracking import normalize_report_to
from podsrl.tasks import task_class

if TYPE_CHECKING:
    from podsrl.config import Config


def check_choices(cfg: Config) -> None:
    """Raise ConfigError naming the key of a bad task name, method, method option, engine option, tracker or dtype
    pair. Reads only: the config is as loaded afterwards."""
    task_class(cfg.task.name)  # an unknown task: one line naming task.name and the registered tasks
    normalize_report_to(cfg.log.report_to, cfg.log.tensorboard)
    check_engine_options(cfg.rollout.engine, cfg.rollout.engine_options)
    check_engine_option_values(cfg.rollout.engine, cfg.rollout.engine_options)
    check_precision(cfg)
    if cfg.method not in METHODS:
        raise ConfigError(f"method: unknown method {cfg.method!r}; choose one of {', '.join(METHODS)}")
    method = METHODS[cfg.method]
    if cfg.rollout.n < 2 and method.uses_rollout_n:
        raise ConfigError("rollout.n: 1 rollout per prompt makes every group advantage zero, so nothing is learned; "
                          "use >= 2")
    method.validate(cfg)


def check_engine_option_values(name: str, options: dict[str, Any], key: str = "rollout.engine_options") -> None:
    """ConfigError naming the first option whose value does not fit the type its engine declares for it (an int
    for max_rows, a bool for cuda_graphs), here at load rather than after the model has loaded. Types the config
    does not read (torch.dtype) are left to the engine; so are ranges."""
    engine = engine_class(name)
    hints = typing.get_type_hints(engine.__init__)
    for option, value in options.items():
        if option in hints:
            _check_value(value, hints[option], f"{key}.{option}")
    worker = engine.worker_engine(options)
    if worker is not None:
        inner_name, inner_options, inner_key = worker
        check_engine_option_values(inner_name, inner_options, f"{key}.{inner_key}")


def _check_value(value: Any, tp: Any, key: str) -> None:
    """Passes when `value` converts to `tp` or to one member of a union `tp`."""
    members = (typing.get_args(tp) if typing.get_origin(tp) in (typing.Union, types.UnionType) else (tp,))
    if value is None and type(None) in members:
        return
    first = None
    for member in (m for m in members if m is not type(None)):
        try:
            convert(value, member, key)
            return
        except TypeError:  # a type the config does not read
            return
        except ConfigError as e:
            first = first or e
    if first is not None:
        raise first
