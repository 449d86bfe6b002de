"""Bad input through the real CLI: malformed configs, reward files, datasets and run directories each give exit
code 2 and one `podsrl: error:` line naming the key / file / row at fault, never a traceback."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import pytest

from podsrl.tasks import TASKS
from tests.faults.common import error_line, tiny

ENVS = Path(__file__).resolve().parents[1] / "fixtures" / "countdown_env.py"
Case = Callable[[Path, str], tuple[list[str], list[str]]]  # (tmp dir, warm-up cache) -> (argv, expected parts)


def _write(tmp: Path, name: str, content: str | bytes) -> Path:
    path = tmp / name
    path.write_bytes(content if isinstance(content, bytes) else content.encode())
    return path


def _train(tmp: Path, cache: str, *extra: str, **overrides) -> list[str]:
    return ["train", "--config", "grpo", *tiny(tmp / "run", cache, **overrides), *extra]


def _config_file(name: str, content: str | bytes, expected: str) -> Case:
    def case(tmp, cache):
        path = _write(tmp, name, content)
        return ["train", "--config", str(path)], [str(path), expected]
    return case


def _override(text: str, *expected: str) -> Case:
    return lambda tmp, cache: (_train(tmp, cache, text), list(expected))


def _reward_file(source: str, *expected: str) -> Case:
    def case(tmp, cache):
        path = _write(tmp, "my_reward.py", source)
        rewards = f"[{{name: correct}}, {{name: mine, function: '{path}:mine'}}]"
        return _train(tmp, cache, rewards=rewards), ["rewards[1].function", str(path), *expected]
    return case


def _dataset(name: str, content: str | bytes | None, *expected: str, **args) -> Case:
    """A dataset task on a local file (content None: the file is not created)."""
    make_dir = args.pop("make_dir", False)

    def case(tmp, cache):
        path = tmp / name if content is None else _write(tmp, name, content)
        if make_dir:
            path.mkdir()
        extra = {f"task.args.{k}": v for k, v in args.items()}
        argv = _train(tmp, cache, **{"task.name": "dataset", "task.args": f"{{path: '{path}'}}", "warmup.steps": 0,
                                     **extra})
        return argv, [str(path), *expected]
    return case


def _rows(*rows) -> str:
    return "".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows)


def _resume_case(setup: Callable[[Path], None], *expected: str) -> Case:
    def case(tmp, cache):
        run = tmp / "old"
        run.mkdir()
        setup(run)
        return ["train", "--resume", str(run)], [str(run), *expected]
    return case


def _existing_run(tmp: Path, cache: str):
    (tmp / "run" / "checkpoints" / "step-00000002").mkdir(parents=True)
    return _train(tmp, cache), ["output_dir", "already holds checkpoints", "--resume"]


def _output_is_file(tmp: Path, cache: str):
    _write(tmp, "run", "not a directory")
    return _train(tmp, cache), ["output_dir: cannot create", str(tmp / "run")]


GOOD = {"question": "1+2=", "answer": "3"}
CASES: dict[str, Case] = {
    # configs: files and overrides
    "unknown_key": _override("rollout.nn=3", "rollout.nn: unknown config key"),
    "not_an_integer": _override("rollout.n=abc", "rollout.n: expected an integer, got 'abc'"),
    "huge_number": _override("train.max_steps=1e400", "train.max_steps: expected an integer"),
    "out_of_range": _override("optim.lr=-1", "optim.lr: must be > 0"),
    "not_a_choice": _override("rollout.engine=turbo", "rollout.engine: 'turbo' is not one of"),
    "section_as_value": _override("rollout=3", "rollout: expected a mapping"),
    "override_without_value": _override("rollout.n", "override 'rollout.n': expected key=value"),
    "cross_field": _override("pods.m=8", "pods.m: must be in [0, rollout.n=4]"),
    "list_expected": _override("rewards=5", "rewards: expected a list"),
    "yaml_syntax": _config_file("bad.yaml", "rollout: [1, 2\n", "not valid YAML"),
    "yaml_not_mapping": _config_file("list.yaml", "- 1\n- 2\n", "the top level must be a mapping"),
    "config_not_utf8": _config_file("latin1.yaml", b"name: caf\xe9\n", "not valid YAML"),
    "config_missing": lambda tmp, cache: (["train", "--config", str(tmp / "nope.yaml")],
                                          ["--config: no such file", str(tmp / "nope.yaml")]),
    "config_is_directory": lambda tmp, cache: (["train", "--config", str(tmp)], ["--config", "is a directory"]),
    # models and reward functions
    "model_path_missing": _override("model.name_or_path=/nonexistent/model", "model.name_or_path",
                                    "'/nonexistent/model' is not a model directory"),
    "reward_unknown_name": _override("rewards=[bogus]", "rewards[0].name: unknown reward 'bogus'"),
    "reward_file_missing": _override("rewards=[{name: x, function: '/nonexistent/r.py:f'}]",
                                     "rewards[0].function", "'/nonexistent/r.py' not found"),
    "reward_syntax_error": _reward_file("def mine(:\n", "importing", "SyntaxError"),
    "reward_not_callable": _reward_file("mine = 3\n", "is not callable"),
    "reward_no_function": _reward_file("def other(p, c, **k):\n    return []\n", "has no attribute 'mine'"),
    "task_unknown": _override("task.name=bogus", f"task.name: unknown task 'bogus' (choose from {', '.join(TASKS)})"),
    "task_argument_unknown": _override("task.args={colour: red}", "task.args (arithmetic)", "'colour'"),
    "dataset_with_warmup": lambda tmp, cache: (
        _train(tmp, cache, **{"task.name": "dataset", "task.args": "{path: x.jsonl}"}),
        ["warmup.steps", "set warmup.steps=0"]),
    # environments from files (task.name: environment)
    "environment_file_missing": lambda tmp, cache: (
        _train(tmp, cache, **{"task.name": "environment", "warmup.steps": 0,
                              "task.args": "{path: x.jsonl, factory: '/nonexistent/my_env.py:MyEnv'}"}),
        ["task.args.factory", "'/nonexistent/my_env.py' not found"]),
    "environment_class_without_step": lambda tmp, cache: (
        _train(tmp, cache, **{"task.name": "environment", "warmup.steps": 0,
                              "task.args": f"{{path: x.jsonl, factory: '{ENVS}:NoStep'}}"}),
        ["task.args.factory", f"{ENVS}:NoStep", "gives a NoStep without a step method"]),
    # datasets
    "data_missing": _dataset("none.jsonl", None, "file not found"),
    "data_empty": _dataset("empty.jsonl", "", "file is empty"),
    "data_directory": _dataset("folder", None, "is a directory", make_dir=True),
    "data_unknown_type": _dataset("data.txt", "1+2=,3\n", "unknown file type '.txt'"),
    "data_not_utf8": _dataset("latin1.jsonl", _rows(GOOD).encode() + b'{"question": "caf\xe9", "answer": "1"}\n',
                              "line 2 is not valid UTF-8"),
    "data_bad_json": _dataset("torn.jsonl", _rows(GOOD, GOOD, '{"question": "1+1='), "line 3 is not valid JSON"),
    "data_missing_column": _dataset("gap.jsonl", _rows(GOOD, {"question": "2+2="}), "line 2: no column 'answer'"),
    "data_no_prompt_column": _dataset("cols.jsonl", _rows({"text": "1+2=", "answer": "3"}), "no prompt column"),
    "data_prompt_not_text": _dataset("type.jsonl", _rows(GOOD, {"question": 12, "answer": "3"}),
                                     "line 2: column 'question' must be non-empty text, got int"),
    "data_answer_not_scalar": _dataset("ans.jsonl", _rows({"question": "1+2=", "answer": {"value": 3}}),
                                       "line 1: column 'answer' must be text or a number, got dict"),
    "data_row_not_object": _dataset("list.jsonl", _rows(GOOD, [1, 2]), "line 2 is a JSON list"),
    "data_huge_line": _dataset("huge.jsonl", _rows(GOOD, {"question": "9" * 5000, "answer": "1"}),
                               "line 2 is longer than 1000 bytes", max_line_bytes=1000),
    "data_no_answer_found": _dataset("gsm.jsonl", _rows(GOOD), "line 1: no answer found in column 'answer'",
                                     answer_format="gsm8k"),
    "csv_extra_field": _dataset("extra.csv", "question,answer\n1+2=,3\n2+2=,4,oops\n",
                                "line 3 has more fields than the header"),
    "csv_not_utf8": _dataset("latin1.csv", b"question,answer\ncaf\xe9,3\n", "not valid UTF-8"),
    "parquet_garbage": _dataset("junk.parquet", b"PAR1 this is not parquet", "cannot read as parquet"),
    # run directories
    "resume_not_a_run": _resume_case(lambda run: None, "--resume", "is not a run directory"),
    "resume_config_corrupt": _resume_case(lambda run: _write(run, "config.yaml", "rollout: [\n"),
                                          "config.yaml: not valid YAML"),
    "fresh_over_checkpoints": _existing_run,
    "output_dir_is_a_file": _output_is_file,
}


@pytest.mark.parametrize("name", sorted(CASES))
def test_bad_input_gives_one_line_and_exit_2(name, tmp_path, launcher, warm_cache):
    argv, expected = CASES[name](tmp_path, warm_cache)
    result = launcher.run(argv, timeout=120)
    assert result.code == 2, f"exit {result.code}\n{result.stderr[-3000:]}"
    line = error_line(result.stderr)
    for part in expected:
        assert part in line, f"{part!r} not in {line!r}"


def test_corpus_is_large_enough():
    assert len(CASES) >= 20


def test_a_real_interpreter_gives_the_same(tmp_path):
    """One case through a plain `python -m podsrl`, without the launcher, to pin that the two agree."""
    import subprocess
    import sys

    from tests.faults.launcher import REPO

    result = subprocess.run([sys.executable, "-m", "podsrl", "train", "--config", "grpo", "optim.lr=-1"],
                            check=False, cwd=REPO, capture_output=True, text=True, timeout=120)
    assert result.returncode == 2
    assert error_line(result.stderr) == "podsrl: error: optim.lr: must be > 0"
