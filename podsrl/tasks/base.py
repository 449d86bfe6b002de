"""A task is a source of problems plus how to check answers.

Training problems are addressed by an integer index (`problem(i)`), deterministic for a given task config and
seed, so the data position of a run is a single integer that a checkpoint stores and resume restores exactly.
"""

from __future__ import annotations

import inspect
from abc import ABC, abstractmethod
from typing import TYPE_CHECKING, Any

from podsrl.batch import Problem
from podsrl.errors import ConfigError
from podsrl.tasks.section import TaskConfig
from podsrl.tasks.templates import prompt_formatter

if TYPE_CHECKING:
    from podsrl.episodes.environment import Environment

PROMPT_KEYS = ("prompt_mode", "system_prompt", "template")  # task.args that format a dataset's questions


class Task(ABC):
    name: str = "task"
    # Reward functions (names in podsrl.rewards' registry, or "module:function") used when the config lists none.
    default_rewards: tuple[str, ...] = ("correct",)
    # The warm-up's version of this task, in its cache key (bumped when the task's warm-up changes), or None.
    warmup_version: int | None = None
    # The registered single-turn task of the same prompts whose warm-up this episode task's continues, or None.
    plain_task: str | None = None
    # True: its environment runs model-written programs in the sandbox, so the run checks the isolation at start-up
    runs_programs: bool = False

    @classmethod
    def from_config(cls, cfg: TaskConfig, tokenizer: Any = None) -> Task:
        """The task of the config's task section (task.name registers this class in podsrl.tasks.TASKS): by
        default its constructor with the problem seed, the eval set's size and task.args."""
        return construct(cls, cfg.name, seed=cfg.seed, eval_size=cfg.eval_size, **cfg.args)

    @classmethod
    def plain_args(cls, args: dict) -> dict:
        """The task.args of `plain_task` for this task's problems (its warm-up's start): `args` less this task's own."""
        return dict(args)

    @classmethod
    def gives_references(cls) -> bool:
        """True when the task has reference completions, which the built-in model's warm-up trains on."""
        return cls.reference_completion is not Task.reference_completion or \
            cls.reference_turns is not Task.reference_turns

    @abstractmethod
    def problem(self, index: int) -> Problem:
        """Training problem number `index` (0, 1, 2, ...; datasets wrap around in reshuffled epochs)."""

    @abstractmethod
    def eval_set(self) -> list[Problem]:
        """The fixed held-out problems (same list every call for a given config)."""

    def is_correct(self, completion: str, problem: Problem) -> bool:
        """The verifier's correctness bit. Tasks with their own verifier override this."""
        raise NotImplementedError(f"task {self.name!r} has no built-in verifier; configure a 'correct' reward")

    def score(self, completion: str, problem: Problem) -> float:
        """The verifier's reward in [0, 1] (1.0/0.0 unless the task gives partial credit); see `has_verifier`."""
        return 1.0 if self.is_correct(completion, problem) else 0.0

    def score_batch(self, completions: list[str], problems: list[Problem],
                    environments: list[Environment] | None = None) -> list[float]:
        """`score` for many rollouts at once (the `correct` reward calls this; override to vectorise).
        `environments`: each episode's environment, once it is over (None for single-turn completions)."""
        return [self.score(c, p) for c, p in zip(completions, problems)]

    def has_verifier(self) -> bool:
        """True when the task overrides `is_correct`, `score` or `score_batch`: the `correct` reward then uses the
        task's own verifier; otherwise it falls back to math-verify against `Problem.answer`."""
        cls = type(self)
        return (cls.is_correct is not Task.is_correct or cls.score is not Task.score
                or cls.score_batch is not Task.score_batch)

    def environment(self, tool_timeout_s: float) -> Environment | None:
        """A fresh environment for one episode (podsrl/episodes), or None: the task's rollouts are single-turn
        completions of the prompt. `tool_timeout_s` is episode.tool_timeout_s."""
        return None

    def has_environment(self) -> bool:
        """True when the task overrides `environment`: its rollouts are episodes."""
        return type(self).environment is not Task.environment

    def reference_completion(self, problem: Problem) -> str:
        """A correct completion for supervised warm-up (built-in tasks only)."""
        raise NotImplementedError(f"task {self.name!r} has no reference completions for warm-up")

    def reference_turns(self, problem: Problem) -> list[tuple[str, str]]:
        """A correct episode as the warm-up trains on it: (context, model turn) pairs, each context the text the
        model reads before that turn (the prompt, earlier turns and the environment's answers), on which there is
        no loss. A single-turn task's is its prompt and reference completion."""
        return [(problem.prompt, self.reference_completion(problem))]


def construct(cls: type[Task], name: str, *args: Any, **kwargs: Any) -> Task:
    """Call a task constructor, turning unknown/missing arguments into an error naming task.args."""
    try:
        inspect.signature(cls).bind(*args, **kwargs)
    except TypeError as e:
        raise ConfigError(f"task.args ({name}): {e}") from None
    return cls(*args, **kwargs)


def with_eval_set(args: dict, cfg: TaskConfig) -> dict:
    """A dataset's task args with its eval set's size (task.eval_size) and, where no eval split or file is given,
    the share of its questions held out (task.eval_fraction, unless the args say)."""
    args.setdefault("eval_limit", cfg.eval_size)
    if args.get("eval_split") is None and args.get("eval_path") is None:
        args.setdefault("eval_fraction", cfg.eval_fraction if cfg.eval_size else 0.0)
    return args


def pop_prompt_formatter(args: dict, tokenizer: Any):
    """The question formatter task.args' prompt keys (PROMPT_KEYS, popped from `args`) ask for: the model's chat
    template by default where it has one."""
    prompt_args = {k: args.pop(k) for k in PROMPT_KEYS if k in args}
    mode = prompt_args.get("prompt_mode", "chat" if getattr(tokenizer, "chat_template", None) else "plain")
    return prompt_formatter(tokenizer, mode, prompt_args.get("system_prompt"), prompt_args.get("template", "{question}"))


def environment_task(cls: type[Task], cfg: TaskConfig, key: str) -> Task:
    """An episode task over a dataset: task.args.path, and the environment class task.args.<key> names."""
    args = dict(cfg.args)
    for needed in ("path", key):
        if needed not in args:
            raise ConfigError(f"task.args.{needed}: a {cfg.name} task needs its dataset (path) and its "
                              f"environment class ({key}: 'my_env.py:MyEnv' or 'module:MyEnv')")
    return construct(cls, cfg.name, args.pop("path"), seed=cfg.seed, **with_eval_set(args, cfg))
