"""Reward functions for benchmarks/soak.py, imported by path from the soak run's config.

`flaky` fails on a fixed fraction of its calls, chosen by a hash of the completions (not by a call counter), so a
run that is killed and resumed meets exactly the same faults as one that is not.
"""

import hashlib
import os
import time

KINDS = ("raise", "nan", "none", "count", "str", "hang")


def fault_of(completions) -> str | None:
    digest = hashlib.sha256("\x00".join(completions).encode()).digest()
    if digest[0] / 256 >= float(os.environ.get("SOAK_REWARD_FAULT_RATE", "0.15")):
        return None
    return KINDS[digest[1] % len(KINDS)]


def flaky(prompts, completions, **columns):
    values = [(sum(map(ord, c)) % 10) / 10 for c in completions]
    kind = fault_of(completions)
    if kind == "raise":
        raise RuntimeError("flaky reward service")
    if kind == "hang":
        time.sleep(0.5)  # past the soak's reward_timeout
    elif kind == "count":
        return values[1:]
    elif kind is not None:
        bad = {"nan": float("nan"), "none": None, "str": "n/a"}[kind]
        return [bad if i % 3 == 0 else v for i, v in enumerate(values)]
    return values
