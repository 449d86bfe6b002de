"""A user's podsrl environment class over a dataset, from the config alone: `task.name: environment`.

`task.args.factory` names it as reward functions are named ("path/to/my_env.py:MyEnv" or "module:MyEnv"): a class,
or any callable returning a fresh environment, called once per episode with `task.args.env_args` as keywords (and
`tool_timeout_s=episode.tool_timeout_s` when it takes that argument, as `ToolEnvironment` subclasses do). The
environment is podsrl's protocol (podsrl/episodes/environment.py): `reset(problem)` returns the first messages,
`step(assistant_text)` returns `(messages, done)` or `(messages, done, reward)`; `tools` (default none) are the
functions the model may call. The problems are a dataset's (`task.args.path` and the `dataset` task's column
arguments); `reset` gets each row as a `Problem` (prompt, answer, the other columns in `metadata`).

An episode's `correct` reward is the environment's `reward()` once the episode is over, when its class has one;
otherwise the sum of the rewards its steps returned (0 when none did).
"""

from __future__ import annotations

import inspect
import numbers

from podsrl.batch import Problem
from podsrl.episodes.environment import ToolEnvironment
from podsrl.errors import ConfigError
from podsrl.tasks.base import environment_task
from podsrl.tasks.datasets import DatasetTask


class CustomEnvironment:
    """One episode of a user's environment: its reset and step as they are (a ToolEnvironment's `configure`
    passed on), its tools (none unless it lists some), the rewards its steps returned, its name in the runner's
    messages."""

    def __init__(self, env) -> None:
        self.env = env
        self.tools = list(getattr(env, "tools", None) or [])
        self.environment_name = type(env).__name__
        self.turn_rewards: list[float] = []

    def configure(self, *settings) -> None:
        if isinstance(self.env, ToolEnvironment):
            self.env.configure(*settings)

    @property
    def tool_results(self) -> list:
        return getattr(self.env, "tool_results", None) or []

    def reset(self, problem: Problem):
        self.turn_rewards = []
        return self.env.reset(problem)

    def step(self, assistant_text: str):
        out = self.env.step(assistant_text)
        if isinstance(out, tuple) and len(out) == 3 and isinstance(out[2], numbers.Real):
            self.turn_rewards.append(float(out[2]))  # the shape is checked by the runner, which reads the same value
        return out

    def reward(self) -> float:
        own = getattr(self.env, "reward", None)
        return float(own()) if callable(own) else sum(self.turn_rewards)


class EnvironmentTask(DatasetTask):
    @classmethod
    def from_config(cls, cfg, tokenizer=None) -> EnvironmentTask:
        return environment_task(cls, cfg, "factory")

    def __init__(self, source: str, *, factory: str, env_args: dict | None = None, seed: int = 0,
                 config: str | None = None, split: str = "train", prompt_column: str | None = None,
                 answer_column: str | None = None, id_column: str | None = None, answer_format: str = "auto",
                 eval_split: str | None = None, eval_path: str | None = None, eval_config: str | None = None,
                 eval_fraction: float = 0.0, eval_limit: int | None = None) -> None:
        from podsrl.rewards import load_function

        try:
            self.factory = load_function(factory)
        except (ValueError, TypeError) as e:
            raise ConfigError(f"task.args.factory: {e}") from None
        if env_args is not None and not isinstance(env_args, dict):
            raise ConfigError(f"task.args.env_args: must be a mapping of keyword arguments for {factory!r}, got "
                              f"{env_args!r}")
        self.env_args = dict(env_args or {})
        self.takes_timeout = _accepts(self.factory, "tool_timeout_s")
        probe = self._make(factory, 60.0)  # one instance up front: a wrong class fails before any rollout
        for method in ("reset", "step"):
            if not callable(getattr(probe, method, None)):
                raise ConfigError(f"task.args.factory: {factory!r} gives a {type(probe).__name__} without a "
                                  f"{method} method (an environment defines reset(problem) and step(assistant_text))")
        tools = getattr(probe, "tools", None)
        if tools is not None and (not isinstance(tools, (list, tuple)) or not all(callable(t) for t in tools)):
            raise ConfigError(f"task.args.factory: {factory!r} gives a {type(probe).__name__} whose tools is "
                              f"{tools!r}; tools is a list of functions")
        super().__init__(source, seed=seed, config=config, split=split, prompt_column=prompt_column,
                         answer_column=answer_column, id_column=id_column, answer_format=answer_format,
                         eval_split=eval_split, eval_path=eval_path, eval_config=eval_config,
                         eval_fraction=eval_fraction, eval_limit=eval_limit)
        self.spec = factory
        self.name = f"environment:{type(probe).__name__}"

    def _make(self, spec: str, tool_timeout_s: float):
        kwargs = {**self.env_args, **({"tool_timeout_s": tool_timeout_s} if self.takes_timeout else {})}
        try:
            return self.factory(**kwargs)
        except TypeError as e:
            raise ConfigError(f"task.args.factory: {spec!r} cannot be called with {kwargs or 'no arguments'} "
                              f"(task.args.env_args): {e}") from None

    def environment(self, tool_timeout_s: float):
        return CustomEnvironment(self._make(self.spec, tool_timeout_s))

    def score_batch(self, completions: list[str], problems: list[Problem],
                    environments: list | None = None) -> list[float]:
        if environments is None:
            raise ValueError(f"task {self.name!r} scores episodes by their environment; these completions came "
                             "without one")
        return [env.reward() for env in environments]


def _accepts(fn, name: str) -> bool:
    try:
        params = inspect.signature(fn).parameters
    except (TypeError, ValueError):  # a builtin without a signature: called with env_args alone
        return False
    return name in params or any(p.kind is p.VAR_KEYWORD for p in params.values())
