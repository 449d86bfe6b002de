"""A user's TRL environment as an episode task: `task.name: trl_environment`.

`task.args.environment` names the factory TRL's `environment_factory` takes ("module:Class" or "file.py:Class", a
class or any callable returning a fresh environment); `task.args.path` and the column arguments name the dataset,
as for the `dataset` task. Each episode gets a fresh environment, reset with its row (`reset_arguments`), and its
reward is the environment's `get_reward()` at the end of the episode, the `correct` reward of the run (an episode
counts as correct at a reward >= 0.5, as for any reward). The prompt goes to the chat template as the user's
message, so it is the dataset's text as it is (no prompt_mode/template).

Held-out evaluation runs episodes too, each in a fresh environment scored by its `get_reward()`; the eval set is the
`dataset` task's (`eval_split` / `eval_path`, else `task.eval_fraction` of the distinct questions held out).
"""

from __future__ import annotations

from podsrl.batch import Problem
from podsrl.episodes.adapters.trl import TRLEnvironment
from podsrl.errors import ConfigError
from podsrl.tasks.base import environment_task
from podsrl.tasks.datasets import DatasetTask


class TRLEnvironmentTask(DatasetTask):
    @classmethod
    def from_config(cls, cfg, tokenizer=None) -> TRLEnvironmentTask:
        return environment_task(cls, cfg, "environment")

    def __init__(self, source: str, *, environment: str, seed: int = 0, config: str | None = None,
                 split: str = "train", prompt_column: str | None = None, answer_column: str | None = None,
                 id_column: str | None = None, answer_format: str = "auto", eval_split: str | None = None,
                 eval_path: str | None = None, eval_config: str | None = None, eval_fraction: float = 0.0,
                 eval_limit: int | None = None) -> None:
        from podsrl.rewards import load_function

        try:
            self.factory = load_function(environment)
        except (ValueError, TypeError) as e:
            raise ConfigError(f"task.args.environment: {e}") from None
        probe = self.factory()  # as TRL does: one instance up front, so a wrong class fails before any rollout
        for method in ("reset", "get_reward"):
            if not callable(getattr(probe, method, None)):
                raise ConfigError(f"task.args.environment: {environment!r} gives a {type(probe).__name__} without "
                                  f"a {method} method (a TRL environment defines reset(**row) and get_reward())")
        super().__init__(source, seed=seed, config=config, split=split, prompt_column=prompt_column,
                         answer_column=answer_column, id_column=id_column, answer_format=answer_format,
                         eval_split=eval_split, eval_path=eval_path, eval_config=eval_config,
                         eval_fraction=eval_fraction, eval_limit=eval_limit)
        self.name = f"trl_environment:{type(probe).__name__}"

    def environment(self, tool_timeout_s: float) -> TRLEnvironment:
        return TRLEnvironment(self.factory(), tool_timeout_s)

    def score_batch(self, completions: list[str], problems: list[Problem],
                    environments: list | None = None) -> list[float]:
        if environments is None:
            raise ValueError(f"task {self.name!r} scores episodes by their environment's get_reward(); these "
                             "completions came without one")
        return [env.reward() for env in environments]
