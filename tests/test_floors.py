"""The floors of podsrl/: which part of the library may import which.

A room is a folder of podsrl/ (run/, config/, ...: its files and subfolders together) or a module at its top
(cli.py, build.py). An arrow is one room importing another at run time, at any depth: test_import_graph's module
graph folded into rooms (imports under TYPE_CHECKING only name a type and are no arrow). FLOORS below is the
layering the library is meant to have, from the top down: a room imports rooms on lower floors only. An arrow to a
room on its own floor or above runs back up; the few that still do are named in BACK_UP with their reason, and no
two rooms import each other.
"""

from __future__ import annotations

from tests.test_import_graph import PACKAGE, import_graph

FLOORS = [  # the top floor first
    ("__main__.py",),  # `python -m podsrl`
    ("cli.py",),  # the command line
    ("experiments/",),  # what runs the loop to measure it: compare and its report, plan's step costs
    ("run/",),  # the loop: trainer, producer, train.async's generator, eval, warm-up, checkpoints
    ("build.py",),  # the parts of a run that train and eval build alike
    ("fsdp.py",),
    ("distributed.py", "update/", "memory_plan.py"),  # memory_plan.py: the memory model applied to a config
    ("config/",),  # the typed config, checked against the registries of tasks, engines and methods; RunFacts
    ("tasks/",),  # the task registry and the tasks: problems, verifiers, environments
    ("episodes/", "rewards.py"),
    ("engines/", "methods/", "integrations/", "sandbox/"),  # sandbox/: running model-written programs isolated
    ("planning/",),  # the memory model of a step, which reads no config: the engines size their KV cache with it
    ("prompt_stats.py", "lora.py", "math_verify_pool.py"),
    ("algo/", "reporting/"),  # the maths; where a run's metrics, progress and plot go
    ("models/", "extras.py", "threads.py"),  # the only code that knows model internals; the process's torch threads
    ("batch.py", "answers.py", "options.py", "fileio.py", "errors.py", "exit_codes.py", "waits.py", "__init__.py"),
]

# The arrows that still run back up, each with the import that draws it. No other may; fewer is better.
BACK_UP: dict[tuple[str, str], str] = {}
MOST_BACK_UP = 0
# the loop's package is the top of the library: besides the tests and benchmarks, only these import it
LOOP_IMPORTERS = {"cli.py", "experiments/"}


def room(module: str) -> str:
    """`podsrl.run.trainer` -> `run/`, `podsrl.cli` -> `cli.py`, `podsrl` -> `__init__.py`."""
    parts = module.split(".")[1:]
    if not parts:
        return "__init__.py"
    return parts[0] + "/" if (PACKAGE / parts[0]).is_dir() else parts[0] + ".py"


def room_arrows(graph: dict[str, set[str]]) -> set[tuple[str, str]]:
    return {(room(a), room(b)) for a, imported in graph.items() for b in imported if room(a) != room(b)}


def floor_of(floors: list[tuple[str, ...]]) -> dict[str, int]:
    """Each room's floor number, the ground floor 1."""
    return {name: len(floors) - i for i, rooms in enumerate(floors) for name in rooms}


def back_up(arrows: set[tuple[str, str]], floors: list[tuple[str, ...]]) -> set[tuple[str, str]]:
    floor = floor_of(floors)
    return {(a, b) for a, b in arrows if floor[b] >= floor[a]}


def test_rooms_and_arrows_are_read_as_drawn():
    assert room("podsrl.run.trainer") == "run/" and room("podsrl.episodes.adapters.trl") == "episodes/"
    assert room("podsrl.cli") == "cli.py" and room("podsrl") == "__init__.py"
    arrows = room_arrows(import_graph())
    assert ("run/", "build.py") in arrows and ("cli.py", "run/") in arrows  # module level, deferred
    floors = [("a",), ("b", "c"), ("d",)]
    assert back_up({("a", "b"), ("b", "d"), ("d", "a"), ("b", "c")}, floors) == {("d", "a"), ("b", "c")}


def test_every_room_stands_on_one_floor():
    placed = [name for rooms in FLOORS for name in rooms]
    assert len(placed) == len(set(placed)), "a room on two floors"
    rooms = {room(module) for module in import_graph()}
    assert rooms == set(placed), (f"rooms without a floor: {sorted(rooms - set(placed))}; floors of rooms that are "
                                  f"gone: {sorted(set(placed) - rooms)}")


def test_only_the_entry_points_import_the_loop():
    importers = {a for a, b in room_arrows(import_graph()) if b == "run/"}
    assert importers <= LOOP_IMPORTERS, f"run/ imported from below: {sorted(importers - LOOP_IMPORTERS)}"


def test_arrows_run_down_the_floors():
    found = back_up(room_arrows(import_graph()), FLOORS)
    assert len(found) <= MOST_BACK_UP, f"{len(found)} arrows run back up (at most {MOST_BACK_UP}): {sorted(found)}"
    assert found == set(BACK_UP), (f"new arrows back up: {sorted(found - set(BACK_UP))}; gone (strike them from "
                                   f"BACK_UP): {sorted(set(BACK_UP) - found)}")


def test_no_two_rooms_import_each_other():
    arrows = room_arrows(import_graph())
    loops = sorted((a, b) for a, b in arrows if (b, a) in arrows and a < b)
    assert not loops, f"rooms importing each other: {loops}"
