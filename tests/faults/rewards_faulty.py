"""Custom reward functions for the fault tests, imported by path from the run's config.

`spread` (a hash of the text) gives every group some reward spread, so updates move the weights. `faulty`
misbehaves on purpose: the k-th call of a run does what the k-th entry of FAULTY_REWARD says (cycling), to half
of the rows for per-value faults (nan, inf, none, str) and to the whole call otherwise (raise, hang, count);
"ok" behaves.
"""

import os
import time

_calls = 0  # this module is imported afresh for each run, so the count starts at 0 for each


def spread(prompts, completions, **columns):
    time.sleep(float(os.environ.get("SPREAD_SLEEP", "0")))  # paces a run for kills at random times; values unchanged
    hold = os.environ.get("SPREAD_HOLD")  # holds a run mid-way while this file exists, however fast the machine
    while hold and os.path.exists(hold):
        time.sleep(0.02)
    return [(sum(map(ord, c)) % 10) / 10 for c in completions]


def faulty(prompts, completions, **columns):
    global _calls
    modes = os.environ.get("FAULTY_REWARD", "ok").split(",")
    mode = modes[_calls % len(modes)]
    _calls += 1
    values = [len(c) / 10 for c in completions]
    bad = {"nan": float("nan"), "inf": float("inf"), "none": None, "str": "not a number"}
    if mode == "raise":
        raise ValueError("injected reward failure")
    if mode == "hang":
        time.sleep(float(os.environ.get("FAULTY_REWARD_HANG", "1.0")))
    elif mode == "count":
        return values[:-1]
    elif mode in bad:
        return [bad[mode] if i % 2 == 0 else v for i, v in enumerate(values)]
    return values
