"""TRL's environments as podsrl environments.

A TRL environment is the plain class a user hands to `GRPOTrainer(environment_factory=...)` (TRL 1.16): `reset(**row)`
gets the dataset row and returns None or text appended to the prompt's last user message; its other public methods
are the tools (type hints and an `Args:` docstring, as podsrl's tools); `get_reward()`, if defined, scores the
rollout from the environment's state once the episode is over. TRL generates and calls the tools; here podsrl does,
so the class runs unchanged: a model turn with a tool call runs that method and the episode goes on, a turn without
one is the answer.

The tools run as podsrl's do (`ToolEnvironment`): the calls of a turn concurrently, each against
episode.tool_timeout_s, an error answered to the model and counted; `reset` runs under episode.env_timeout_s like
any environment's. Async tool methods and an async `get_reward` are not supported.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable

from podsrl.batch import Problem
from podsrl.episodes.environment import EnvironmentShapeError, ToolEnvironment

NOT_TOOLS = ("reset", "get_reward")  # TRL's lifecycle methods; every other public method is a tool


def environment_tools(env) -> list[Callable]:
    """The environment's tools as TRL finds them: the functions of its class, bound, less `reset`, `get_reward` and
    names starting with "_" (listed on the class, so properties are not evaluated)."""
    return [getattr(env, name) for name, _ in inspect.getmembers(type(env), predicate=inspect.isfunction)
            if name not in NOT_TOOLS and not name.startswith("_")]


def reset_arguments(problem: Problem) -> dict:
    """The row TRL's `reset(**row)` would get: the problem's `prompt` and `answer` and its other dataset columns."""
    return {"prompt": problem.prompt, "answer": problem.answer, **problem.metadata}


class TRLEnvironment(ToolEnvironment):
    """One episode of the TRL environment `env` (a fresh instance from the user's factory)."""

    def __init__(self, env, tool_timeout_s: float) -> None:
        if not callable(getattr(env, "reset", None)):
            raise TypeError(f"{type(env).__name__} has no reset method: a TRL environment defines reset(**row)")
        super().__init__(environment_tools(env), tool_timeout_s)
        self.env = env
        self.environment_name = type(env).__name__  # what the runner's messages call it: the user's class

    def reset(self, problem: Problem) -> list[dict]:
        messages = super().reset(problem)
        observation = self.env.reset(**reset_arguments(problem))
        if observation is not None:
            if not isinstance(observation, str):
                raise EnvironmentShapeError(f"episode: {type(self.env).__name__}.reset returned "
                                            f"{repr(observation)[:80]} (a {type(observation).__name__}); a TRL "
                                            "environment's reset returns None or text")
            messages[-1]["content"] += observation
        return messages

    def reward(self) -> float:
        """The environment's `get_reward()`, read once its episode is over."""
        get_reward = getattr(self.env, "get_reward", None)
        if get_reward is None:
            raise TypeError(f"{type(self.env).__name__} has no get_reward method to score its episodes")
        return float(get_reward())
