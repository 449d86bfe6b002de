"""The loop and the infrastructure name no engine: outside podsrl/engines/ no string in the code is an engine's name
(read from the registry), so what differs between engines is read from their traits (RolloutEngine's class
attributes) and adding an engine touches engines/ alone. Names in prose (comments, docstrings, help text) are fine:
only a string that is exactly a name, what a branch on the name compares with, is refused.

Exempt: podsrl/config/trl_names.py and trl_table.py, the table of TRL's names, which maps TRL's `use_vllm` to the
engine it means and reads that engine's defaults.
"""

from __future__ import annotations

import ast
import typing
from pathlib import Path

import pytest
import torch

from podsrl.config import ConfigError, load_config
from podsrl.config.sections import RolloutConfig
from podsrl.engines import DEFAULT_ENGINE, ENGINES, engine_class
from podsrl.engines.base import RolloutEngine

PACKAGE = Path(__file__).parents[2] / "podsrl"
EXEMPT_FILES = {"config/trl_names.py", "config/trl_table.py"}
TRAITS = ("may_run_async", "no_async_reason", "own_kernels", "compute_dtype_option", "generation_device",
          "rows_option", "in_process")


def engine_strings(source: str) -> list[tuple[int, str]]:
    """(line, name) of every string constant that is exactly an engine's name."""
    return [(node.lineno, node.value) for node in ast.walk(ast.parse(source))
            if isinstance(node, ast.Constant) and isinstance(node.value, str) and node.value in ENGINES]


def checked_modules() -> list[Path]:
    return [p for p in sorted(PACKAGE.rglob("*.py"))
            if p.relative_to(PACKAGE).parts[0] != "engines" and p.relative_to(PACKAGE).as_posix() not in EXEMPT_FILES]


def test_the_guard_reads_the_registry_and_finds_names():
    assert {"fast", "hf", "ray", "vllm"} <= set(ENGINES)
    branch = 'if cfg.rollout.engine == "ray":\n    x = opts.get("engine", "fast")  # the fast engine\n'
    assert engine_strings(branch) == [(1, "ray"), (2, "fast")]
    assert engine_strings('"""the fast engine"""\nhelp = "rollout.engine=ray: the pool"\n') == []
    assert engine_strings((PACKAGE / "engines" / "__init__.py").read_text(encoding="utf-8"))  # the registry
    assert len(checked_modules()) > 50 and PACKAGE / "run" / "trainer.py" in checked_modules()


def test_no_module_outside_engines_names_an_engine():
    found = {}
    for path in checked_modules():
        names = engine_strings(path.read_text(encoding="utf-8"))
        if names:
            found[path.relative_to(PACKAGE).as_posix()] = names
    assert not found, f"modules outside podsrl/engines/ name an engine (read a trait of its class instead): {found}"


def test_every_engine_declares_its_traits_on_its_class():
    for name in ENGINES:
        cls = engine_class(name)
        assert issubclass(cls, RolloutEngine) and cls.name == name
        for trait in TRAITS:
            assert hasattr(cls, trait), (name, trait)
        if cls.rows_option is not None or cls.compute_dtype_option is not None:  # options the engine really takes
            assert {cls.rows_option, cls.compute_dtype_option} - {None} <= set(typing.get_type_hints(cls.__init__))


def test_the_config_choices_and_default_are_the_registry():
    (choices,) = [typing.get_args(tp) for field, tp in typing.get_type_hints(RolloutConfig).items()
                  if field == "engine"]
    assert choices == tuple(ENGINES) and RolloutConfig().engine == DEFAULT_ENGINE
    with pytest.raises(ConfigError, match="rollout.engine: 'turbo' is not one of " + ", ".join(ENGINES)):
        load_config(None, ["rollout.engine=turbo"])


def test_an_engine_that_may_not_run_async_is_refused_with_its_reason():
    for name in ENGINES:
        cls = engine_class(name)
        if cls.may_run_async:
            load_config(None, ["train.async.enabled=true", f"rollout.engine={name}"])
        else:
            with pytest.raises(ConfigError, match=f"train.async.enabled: .*{cls.no_async_reason}"):
                load_config(None, ["train.async.enabled=true", f"rollout.engine={name}"])


@pytest.mark.parametrize("overrides, message", [
    (["rollout.engine_options.max_rows=lots"], "rollout.engine_options.max_rows: expected an integer, got 'lots'"),
    (["rollout.engine_options.cuda_graphs=maybe"], "rollout.engine_options.cuda_graphs: expected true or false"),
    (["rollout.engine=ray", "rollout.engine_options.engine_options={compact_fraction: half}"],
     "rollout.engine_options.engine_options.compact_fraction: expected a finite number, got 'half'"),
])
def test_engine_option_values_are_checked_when_the_config_loads(overrides, message):
    with pytest.raises(ConfigError, match=message):
        load_config(None, overrides)


def test_option_values_of_other_types_pass_at_load():
    for overrides in (["rollout.engine_options.compile=max-autotune"], ["rollout.engine_options.compile=true"],
                      ["rollout.engine_options.weights_dtype=bfloat16"], ["rollout.engine_options.max_rows=null"],
                      ["rollout.engine=ray", "rollout.engine_options.cpus_per_worker=2"]):
        load_config(None, overrides)


def test_what_the_loop_and_the_planner_read_follows_the_traits():
    from podsrl.config.facts import async_generator, generation_device, rows_in_flight

    pool, default = (load_config(None, ["rollout.engine=ray", "train.async.enabled=true"]),
                     load_config(None, ["train.async.enabled=true", "rollout.engine_options.max_rows=12"]))
    assert generation_device(pool) == torch.device("cpu") and generation_device(default) is None
    assert (async_generator(pool), async_generator(default)) == ("workers", "in_process")
    assert async_generator(load_config(None, [])) == "none"
    assert (rows_in_flight(pool), rows_in_flight(default)) == (0, 12)
