"""The TRL migration table of docs/trl.md, generated from the name map (podsrl/config/trl_names.py) and the config
defaults (podsrl/config/sections.py, which itself reads the map to accept TRL names)."""

from __future__ import annotations

from typing import Any

from podsrl.config import config_help
from podsrl.config.trl_names import ROWS
from podsrl.engines import engine_option_default

ENGINE_OPTION = "rollout.engine_options."  # TRL's vllm_* settings map to options of podsrl's vllm engine


def _cell(value: Any) -> str:
    return f"`{value}`" if isinstance(value, str) else f"`{value!r}`"


def _podsrl_default(key: str, defaults: dict[str, str]) -> Any:
    if key.startswith(ENGINE_OPTION):
        return engine_option_default("vllm", key.removeprefix(ENGINE_OPTION))
    return defaults[key]


def trl_table_markdown() -> str:
    """The migration table: TRL name and default, podsrl key and default, what differs."""
    defaults = {key: default.strip("'") for key, default, _ in config_help()}  # config_help gives reprs
    lines = ["| TRL `GRPOConfig` | TRL default | podsrl key | podsrl default | accepted by name | note |",
             "|---|---|---|---|---|---|"]
    for row in ROWS:
        keys = ", ".join(f"`{k}`" for k in row.podsrl) or "none"
        podsrl_default = ", ".join(f"`{_podsrl_default(k, defaults)}`" for k in row.podsrl) or "none"
        lines.append(f"| `{row.trl}` | {_cell(row.trl_default)} | {keys} | {podsrl_default} | "
                     f"{'yes' if row.accepted else 'no'} | {row.note} |")
    return "\n".join(lines) + "\n"
