"""Small importable helpers for the reward tests (custom rewards by import path, worker-pool functions)."""

import time


def length_reward(prompts, completions, **columns):
    """A custom reward: completion length / 10."""
    return [len(c) / 10 for c in completions]


def sleep_then_echo(seconds: float) -> float:
    """Pool worker function: sleeps, then returns its argument (a hang when long enough)."""
    time.sleep(seconds)
    return seconds


def crash_if_negative(x: float) -> float:
    """Pool worker function whose process dies on a negative input (like a segfault in native code)."""
    import os

    if x < 0:
        os._exit(3)
    return x
