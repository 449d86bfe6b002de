"""Loading a config: defaults <- YAML file <- dotted `key=value` overrides, then checked; and writing it back."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml

from podsrl.config.checks import validate
from podsrl.config.convert import IGNORED_PREFIX, build
from podsrl.config.removed_keys import reject_removed_keys
from podsrl.config.sections import Config
from podsrl.config.trl_names import translate_trl_names
from podsrl.errors import ConfigError
from podsrl.fileio import write_text_atomic
from podsrl.methods import METHODS
from podsrl.options import to_dict
from podsrl.reporting.tracking import normalize_report_to


def _parse_scalar(text: str) -> Any:
    """CLI values are YAML scalars/flow collections: 1e-4, true, [a, b], {x: 1}."""
    try:
        return yaml.safe_load(text) if text != "" else ""
    except yaml.YAMLError:
        return text


def _set_dotted(tree: dict, dotted: str, value: Any) -> None:
    parts = dotted.split(".")
    node = tree
    for p in parts[:-1]:
        child = node.setdefault(p, {})
        if not isinstance(child, dict):
            raise ConfigError(f"{dotted}: {p} is not a section")
        node = child
    node[parts[-1]] = value


def load_config(path: str | Path | None = None, overrides: list[str] = ()) -> Config:
    """Defaults <- YAML file <- `key=value` overrides, then validated. TRL's names are taken from either (a
    command-line one overrides the file's podsrl key)."""
    tree: dict = {}
    if path is not None:
        path = Path(path)
        if not path.is_file():
            raise ConfigError(f"--config: {path} is a directory, not a YAML file" if path.is_dir() else
                              f"--config: no such file {path}")
        try:
            loaded = yaml.safe_load(path.read_text(encoding="utf-8"))
        except (yaml.YAMLError, UnicodeDecodeError) as e:
            raise ConfigError(f"{path}: not valid YAML ({str(e).splitlines()[0]})") from None
        if loaded is None:
            loaded = {}
        if not isinstance(loaded, dict):
            raise ConfigError(f"{path}: the top level must be a mapping of config keys")
        tree = {k: v for k, v in loaded.items() if not str(k).startswith(IGNORED_PREFIX)}  # YAML anchors' home
    command_line: dict = {}
    for item in overrides:
        if "=" not in item:
            raise ConfigError(f"override {item!r}: expected key=value (e.g. rollout.n=16)")
        key, text = item.split("=", 1)
        _set_dotted(command_line, key.strip(), _parse_scalar(text))
    for source in (tree, command_line):  # shorthand: `model: tiny` / `model=path`
        if isinstance(source.get("model"), str):
            source["model"] = {"name_or_path": source["model"]}
    tree = translate_trl_names(tree, command_line)
    reject_removed_keys(tree)
    optim = tree.get("optim")
    if isinstance(optim, dict) and optim.get("micro_batch_size") == "auto":  # 0 as DeepSpeed configs spell it
        tree["optim"] = {**optim, "micro_batch_size": 0}
    cfg = build(Config, tree)
    if not cfg.name and path is not None:
        cfg.name = Path(path).stem
    if "output_dir" not in tree and cfg.name:  # presets run one after another must not share a run directory
        cfg.output_dir = f"runs/{cfg.name}"
    cfg.log.report_to = normalize_report_to(cfg.log.report_to, cfg.log.tensorboard)  # TRL's values as a list
    validate(cfg)  # reads only: what it accepts is the config the run gets
    return cfg


def config_yaml(cfg: Config) -> str:
    """The config as YAML with the chosen method's section only: the other methods' sections are not read."""
    tree = to_dict(cfg)
    for name in METHODS:
        if name != cfg.method:
            tree.pop(name, None)
    return yaml.safe_dump(tree, sort_keys=False)


def dump_config(cfg: Config, path: Path) -> None:
    write_text_atomic(path, config_yaml(cfg))
