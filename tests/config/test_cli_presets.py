"""`podsrl presets` lists every bundled preset with its purpose, and an unknown preset's error lists them;
`podsrl train --print-config` prints the resolved config and trains nothing; float16 is refused with the reason;
a bad task.args.eval_path stops the run with one line naming the field (exit 2)."""

import json

import pytest
import yaml

from podsrl.cli import main, parse_args
from podsrl.config import load_config, to_dict
from podsrl.config.presets import PRESET_DIR, preset_names
from podsrl.methods import METHODS

RECIPES = ("gsm8k_qwen_grpo", "gsm8k_qwen_pods", "math_qwen_grpo", "math_qwen_pods")


def test_presets_lists_each_with_its_purpose(capsys):
    assert main(["presets"]) == 0
    lines = capsys.readouterr().out.splitlines()
    names = preset_names()
    assert [line.split()[0] for line in lines] == names and set(RECIPES) <= set(names)
    assert len(names) == len(list(PRESET_DIR.glob("*.yaml")))
    for line in lines:
        purpose = line.split(None, 1)[1]
        assert len(purpose) > 20 and "no description" not in purpose, line
    assert any(line.startswith("math_qwen_pods ") and "MATH-500" in line for line in lines)


def test_unknown_preset_lists_the_presets(capsys):
    assert main(["train", "--config", "gsm8k_pods"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "no bundled preset of that name" in err
    assert all(name in err for name in preset_names())


def test_print_config_prints_the_resolved_config_and_trains_nothing(tmp_path, capsys):
    run = tmp_path / "run"
    overrides = ["rollout.n=32", f"output_dir={run}"]
    assert main(["train", "--config", "math_qwen_pods", "--print-config", *overrides]) == 0
    printed = yaml.safe_load(capsys.readouterr().out)
    others = set(METHODS) - {"pods"}  # the other methods' sections are not read: not printed
    resolved = to_dict(load_config(PRESET_DIR / "math_qwen_pods.yaml", overrides))
    assert "pods" in printed and not others & set(printed)
    assert printed == {key: value for key, value in resolved.items() if key not in others}
    assert printed["rollout"]["n"] == 32 and printed["name"] == "math_qwen_pods" and printed["optim"]["lr"] == 1e-5
    assert not run.exists()


def test_float16_is_refused_with_the_reason(capsys):
    assert main(["train", "--print-config", "model.dtype=float16"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("podsrl: error: model.dtype: float16 is refused") and "loss scaling" in err
    assert "bfloat16" in err and len(err.strip().splitlines()) == 1


def test_bad_eval_path_is_one_line_naming_the_field(tmp_path, capsys):
    data = tmp_path / "train.jsonl"
    data.write_text("".join(json.dumps({"question": f"{i}+1?", "answer": f"#### {i + 1}"}) + "\n" for i in range(8)))
    missing = tmp_path / "missing.jsonl"
    code = main(["train", "--config", "gsm8k_qwen_grpo", "model.name_or_path=tiny", "model.dtype=float32",
                 "model.lora_rank=0", f"task.args.path={data}", "task.args.config=null", "task.args.eval_split=null",
                 f"task.args.eval_path={missing}", "task.args.prompt_mode=plain", f"output_dir={tmp_path / 'run'}",
                 "log.progress=false"])
    err = capsys.readouterr().err.strip()
    assert code == 2 and len(err.splitlines()) == 1, err
    assert err.startswith("podsrl: error: task.args.eval_path: ") and "missing.jsonl: file not found" in err


def test_each_preset_has_its_own_run_directory():
    """Presets run one after another (gsm8k_qwen_grpo, then gsm8k_qwen_pods) must not write into one folder."""
    dirs = {name: load_config(PRESET_DIR / f"{name}.yaml").output_dir for name in preset_names()}
    assert dirs["gsm8k_qwen_grpo"] == "runs/gsm8k_qwen_grpo" and dirs["default"] == "runs/default"
    assert len(set(dirs.values())) == len(dirs)
    assert load_config(PRESET_DIR / "grpo.yaml", ["output_dir=elsewhere"]).output_dir == "elsewhere"


def test_plan_takes_overrides_after_its_options(capsys):
    argv = ["plan", "grpo", "--memory", "--gpu-memory", "80GiB", "--prompt-length", "16", "rollout.n=8"]
    assert parse_args(argv).overrides == ["rollout.n=8"]
    assert main(argv) == 0
    assert "256 of 256 rows" in capsys.readouterr().out  # 32 prompts x the overridden 8 rollouts, not the preset's 16
    assert parse_args(["train", "--config", "grpo", "--print-config", "rollout.n=8"]).overrides == ["rollout.n=8"]
    with pytest.raises(SystemExit):  # anything else left over is still an error
        parse_args(["plan", "grpo", "--memory", "stray"])
