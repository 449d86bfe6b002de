"""The README's "Bring your own" YAML example, read from README.md (so the two cannot drift), trained as written
with only the model path made local and the sizes cut down for CI."""

import json
import re

import yaml

from podsrl.reporting.tracking import read_metrics
from tests.journeys.user_kit import ROOT, ok, podsrl

HUB_MODEL = "Qwen/Qwen2.5-0.5B-Instruct"


def readme_example() -> str:
    text = (ROOT / "README.md").read_text(encoding="utf-8")
    section = text[text.index("## Bring your own model, data and reward"):]
    return re.search(r"```yaml\n(.*?)```", section, re.DOTALL).group(1)


def test_readme_example_trains(user_kit):
    example = readme_example()
    assert HUB_MODEL in example and "data/train.jsonl" in example and "my_rewards.py:length_penalty" in example
    config = user_kit / "my_run.yaml"
    config.write_text(example.replace(HUB_MODEL, str(user_kit / "model")))
    assert yaml.safe_load(config.read_text())["method"] == "pods"
    small = ["rollout.n=4", "rollout.prompts_per_step=2", "rollout.max_new_tokens=12", "task.max_prompt_length=200",
             "pods.m=2", "model.lora_rank=4", "task.eval_size=4",
             "eval.samples=0", "train.max_steps=2", "train.eval_every=2", "output_dir=runs/readme", "log.plot=false"]
    ok(podsrl("train", "--config", str(config), *small, cwd=user_kit))
    summary = json.loads((user_kit / "runs" / "readme" / "summary.json").read_text())
    assert summary["engine"] == "fast" and summary["engine/fallback"] is None, summary
    records = read_metrics(user_kit / "runs" / "readme" / "metrics.jsonl")
    assert [r["step"] for r in records if "reward" in r] == [1, 2]
    assert any("eval/accuracy" in r for r in records)
    assert all(r["rewards/mine/mean"] < 0 for r in records if "reward" in r)
