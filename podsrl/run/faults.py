"""Fault injection for the reliability tests and the soak benchmark; inert unless PODSRL_FAULTS is set.

    PODSRL_FAULTS="kill@ckpt_manifest:4; nan@loss:2,3; term@step:5-6"

Each entry is `<action>@<site>:<steps>`, steps being a comma list of numbers and a-b ranges, or `*` for all.
Sites are named points in the trainer, the producer and the checkpoint writer, keyed by the training step they
belong to:
    step            start of training step N (before its prompts are drawn)
    turn            each turn of the episodes of step N's batch, its environments stepped: episodes in flight
    loss            the update of step N: `fire` returns True and the trainer makes the advantages NaN
    ckpt_begin      saving the checkpoint of step N: temporary directory created, nothing written yet
    ckpt_model      ... model weights written, optimiser/RNG/state not yet
    ckpt_manifest   ... every file written, manifest not yet
    ckpt_rename     ... manifest written, not yet renamed into place
    ckpt_prune      ... renamed into place, older checkpoints not yet deleted
Actions: kill (SIGKILL this process), term / int (send SIGTERM / SIGINT to it), raise (RuntimeError),
enospc / erofs (OSError "no space left" / "read-only file system"), nan (only `fire`'s return value).
The variable is read on each call (cached per value), so a test can set it in-process; an unset variable costs
one dictionary lookup per call, and the call sites are once per step, episode turn or checkpoint, never per token.
"""

from __future__ import annotations

import errno
import os
import signal

ENV = "PODSRL_FAULTS"
ACTIONS = ("kill", "term", "int", "raise", "enospc", "erofs", "nan")
SITES = ("step", "turn", "loss", "ckpt_begin", "ckpt_model", "ckpt_manifest", "ckpt_rename", "ckpt_prune")
ALL = -1  # step wildcard

_cache: tuple[str, dict[str, list[tuple[str, frozenset[int]]]]] = ("", {})


def parse(spec: str) -> dict[str, list[tuple[str, frozenset[int]]]]:
    """{site: [(action, steps)]} from a PODSRL_FAULTS value; ValueError names the bad entry."""
    plan: dict[str, list[tuple[str, frozenset[int]]]] = {}
    for entry in spec.replace(";", " ").split():
        action, _, rest = entry.partition("@")
        site, _, steps_text = rest.partition(":")
        if action not in ACTIONS or site not in SITES or not steps_text:
            raise ValueError(f"{ENV}: bad entry {entry!r} (want <action>@<site>:<steps>, actions "
                             f"{'/'.join(ACTIONS)}, sites {'/'.join(SITES)})")
        steps: set[int] = set()
        for part in steps_text.split(","):
            if part == "*":
                steps.add(ALL)
            elif "-" in part:
                lo, hi = part.split("-", 1)
                steps.update(range(int(lo), int(hi) + 1))
            else:
                steps.add(int(part))
        plan.setdefault(site, []).append((action, frozenset(steps)))
    return plan


def _plan() -> dict[str, list[tuple[str, frozenset[int]]]]:
    global _cache
    spec = os.environ.get(ENV, "")
    if spec != _cache[0]:
        _cache = (spec, parse(spec))
    return _cache[1]


def fire(site: str, step: int) -> bool:
    """Trigger the faults armed at (site, step): signals and exceptions happen here; True when a `nan` is armed."""
    if ENV not in os.environ:
        return False
    poison = False
    for action, steps in _plan().get(site, ()):
        if step not in steps and ALL not in steps:
            continue
        if action == "kill":
            os.kill(os.getpid(), signal.SIGKILL)
        elif action in ("term", "int"):
            os.kill(os.getpid(), signal.SIGTERM if action == "term" else signal.SIGINT)
        elif action == "raise":
            raise RuntimeError(f"injected fault at {site}:{step}")
        elif action in ("enospc", "erofs"):
            code = errno.ENOSPC if action == "enospc" else errno.EROFS
            raise OSError(code, os.strerror(code))
        else:
            poison = True
    return poison
