"""Tasks are registered in one place: podsrl.tasks.TASKS maps a name to its class, which says how the config builds
it (`Task.from_config`) and what the warm-up reads of it, so adding a task is one entry there. The config's help for
task.name and its check of the name read that registry, and no module outside podsrl/tasks/ holds a task's name (a
list of names, or a branch on one).

Exempt: podsrl/extras.py, whose `reasoning_gym` is the import name of the reasoning-gym package, not the task.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from podsrl.config import ConfigError, TaskConfig, load_config
from podsrl.config.reference import config_help
from podsrl.tasks import DEFAULT_TASK, TASKS, Task, build_task, task_class

PACKAGE = Path(__file__).parents[2] / "podsrl"
EXEMPT_FILES = {"extras.py"}
# what a registered task refuses when built from task.args alone: the argument it needs, in the message it gives
REFUSED = {
    "dataset": "task.args.path: a dataset task needs a file path or a Hugging Face dataset name",
    "reasoning_gym": "task.args.name: a reasoning_gym task needs a dataset name",
    "trl_environment": "task.args.path: a trl_environment task needs its dataset (path) and its environment class "
                       "(environment: ",
    "environment": "task.args.path: a environment task needs its dataset (path) and its environment class (factory: ",
}


def task_strings(source: str) -> list[tuple[int, str]]:
    """(line, name) of every string constant that is exactly a registered task's name."""
    return [(node.lineno, node.value) for node in ast.walk(ast.parse(source))
            if isinstance(node, ast.Constant) and isinstance(node.value, str) and node.value in TASKS]


def checked_modules() -> list[Path]:
    return [p for p in sorted(PACKAGE.rglob("*.py")) if p.relative_to(PACKAGE).parts[0] != "tasks"
            and p.relative_to(PACKAGE).as_posix() not in EXEMPT_FILES]


@pytest.mark.parametrize("name", list(TASKS))
def test_every_registered_task_builds_or_names_what_it_needs(name):
    cls = task_class(name)
    assert issubclass(cls, Task)
    cfg = TaskConfig(name=name, eval_size=4)
    if name in REFUSED:
        with pytest.raises(ConfigError) as refused:
            build_task(cfg)
        assert str(refused.value).startswith(REFUSED[name]) and "\n" not in str(refused.value)
    else:
        task = build_task(cfg)
        assert type(task) is cls and len(task.eval_set()) == 4 and task.problem(0).prompt


def test_the_default_and_the_help_come_from_the_registry():
    assert TaskConfig().name == DEFAULT_TASK and DEFAULT_TASK in TASKS
    (text,) = [help_text for key, _, help_text in config_help() if key == "task.name"]
    for name, (_, about) in TASKS.items():
        assert f"'{name}' ({about})" in text


def test_an_unknown_task_is_one_line_naming_the_registered_ones():
    with pytest.raises(ConfigError) as refused:
        load_config(None, ["task.name=turbo"])
    assert str(refused.value) == f"task.name: unknown task 'turbo' (choose from {', '.join(TASKS)})"


def test_a_task_registered_later_is_loaded_and_built(monkeypatch):
    monkeypatch.setitem(TASKS, "sums", ("podsrl.tasks.arithmetic:ArithmeticTask", "sums again"))
    cfg = load_config(None, ["task.name=sums", "task.eval_size=3", "task.args={operands: 2}"])
    assert len(build_task(cfg.task).eval_set()) == 3


def test_the_guard_reads_the_registry_and_finds_names():
    assert task_strings('if cfg.task.name == "dataset":\n    x = ("arithmetic_tool", 1)\n') == [
        (1, "dataset"), (2, "arithmetic_tool")]
    assert task_strings('"""the dataset task"""\nhelp = "task.name=dataset: a file"\n') == []
    assert task_strings((PACKAGE / "tasks" / "registry.py").read_text(encoding="utf-8"))  # the registry
    assert len(checked_modules()) > 50 and PACKAGE / "run" / "warmup.py" in checked_modules()


def test_no_module_outside_tasks_names_a_task():
    found = {}
    for path in checked_modules():
        names = task_strings(path.read_text(encoding="utf-8"))
        if names:
            found[path.relative_to(PACKAGE).as_posix()] = names
    assert not found, f"modules outside podsrl/tasks/ name a task (read its class from podsrl.tasks instead): {found}"
