"""Typed run configuration: dataclasses with help text, loaded from YAML plus dotted CLI overrides.

    podsrl train --config configs/grpo.yaml rollout.n=16 optim.lr=1e-4

Unknown keys and bad values raise ConfigError naming the dotted key. Algorithm presets (configs/*.yaml) are bundles
of vetted defaults; the trainer itself is algorithm-blind and reads only these fields.

Where each part lives: the core sections and `Config` (composed from the method registry, so adding a method never
touches them) in sections.py; YAML/CLI values to typed fields in convert.py; loading, overrides and writing back in
loader.py; the generated reference (docs/config.md) in reference.py. A field's own bounds are declared on it with
`option` and checked by bounds.py; the cross-field checks are in checks.py, those that need the registries (engine
options, trackers, the method's own) in method_checks.py.
"""

from podsrl.config.loader import config_yaml, dump_config, load_config
from podsrl.config.reference import config_help, config_reference_markdown
from podsrl.config.sections import (
    AlgoConfig,
    AsyncConfig,
    Config,
    CoreConfig,
    EpisodeConfig,
    EvalConfig,
    FilterConfig,
    LogConfig,
    ModelConfig,
    OptimConfig,
    RolloutConfig,
    TaskConfig,
    TinyModelConfig,
    TrainConfig,
    UpdateConfig,
    WarmupConfig,
)
from podsrl.errors import ConfigError
from podsrl.options import to_dict

__all__ = [
    "AlgoConfig", "AsyncConfig", "Config", "ConfigError", "CoreConfig", "EpisodeConfig", "EvalConfig", "FilterConfig",
    "LogConfig", "ModelConfig", "OptimConfig", "RolloutConfig", "TaskConfig", "TinyModelConfig", "TrainConfig",
    "UpdateConfig", "WarmupConfig", "config_help", "config_reference_markdown", "config_yaml", "dump_config",
    "load_config", "to_dict",
]
