"""Keys that no longer exist, each a ConfigError naming what to write instead: the layout before methods were
modules (select.*, rollout.allocation, algo.modulation; the table names methods because the old keys did), and the
keys of removed features."""

from __future__ import annotations

from podsrl.errors import ConfigError

# Keys removed by the methods redesign -> what to write instead (docs/architecture.md has the table).
_MOVED = {
    "select.m": "pods.m (with method: pods)",
    "select.normalize_over": "pods.normalize_over (with method: pods)",
    "select.filter_zero_variance": "filter.zero_variance",
    "select.max_refill_rounds": "filter.max_refill_rounds",
    "select.rule=none": "method: grpo",
    "select.rule=aero": "method: aero",
    "select.rule=max_variance": "method: pods (pods.rule: max_variance)",
    "select.rule=random": "method: pods with pods.rule: random",
    "select.rule=max_reward": "method: pods with pods.rule: max_reward",
    "rollout.allocation=variance": "method: dynamo (dynamo.modulation: false for the allocation alone)",
    "algo.modulation=dynamo": "method: dynamo with dynamo.modulation: true",
}


# Keys whose feature was removed -> what the error says instead.
_DROPPED = {
    "update.reuse_sampling_forward": "the update no longer takes projection outputs from sampling; leave it out",
    "update.sampling_forward_max_mb": "it capped the sampling-forward reuse, which was removed; leave it out",
}


def reject_removed_keys(tree: dict) -> None:
    """A ConfigError naming the replacement of any key of the pre-methods layout (select.*, rollout.allocation,
    algo.modulation) or the removal of a dropped feature's key."""
    for dotted, why in _DROPPED.items():
        section, key = dotted.split(".")
        if isinstance(tree.get(section), dict) and key in tree[section]:
            raise ConfigError(f"{dotted}: removed ({why})")
    for section, keys in (("select", None), ("rollout", ("allocation",)), ("algo", ("modulation",))):
        values = tree.get(section)
        if not isinstance(values, dict):
            if section == "select" and values is not None:
                raise ConfigError("select: removed; choose `method: <name>` and set its own section")
            continue
        for key, value in values.items():
            if keys is not None and key not in keys:
                continue
            dotted = f"{section}.{key}"
            new = (_MOVED.get(dotted) or _MOVED.get(f"{dotted}={value}")
                   or ("method: <name>" if dotted == "select.rule" else "nothing (leave it out: the default)"))
            raise ConfigError(f"{dotted}: removed by the methods redesign; use {new}")
