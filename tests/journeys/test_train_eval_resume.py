"""A user's model, data and rewards through `podsrl train`, `podsrl eval` and `podsrl train --resume`."""

import importlib.util
import json

from podsrl.reporting.tracking import read_metrics
from tests.journeys.user_kit import ok, podsrl, user_config


def test_lora_jsonl_train_eval_merged_resume(user_kit):
    cfg = user_config(user_kit, "lora", "data/train.jsonl", lora=True)
    done = ok(podsrl("train", "--config", str(cfg), cwd=user_kit))
    run = user_kit / "runs" / "lora"
    # a cluster job's log (stdout is a pipe here): plain progress lines as the run goes
    lines = [line for line in done.stdout.splitlines() if line.startswith("train ")]
    assert lines[0] == "train start | step 0/2" and lines[1].startswith("train step 1/2 | reward -0.0")
    assert lines[2].startswith("train step 2/2 | reward ") and "train_acc " in lines[2] and "eval_acc " in lines[2]
    assert "s/step | elapsed 0:00:0" in lines[2] and lines[2].endswith("eta 0:00:00")
    # start-up says what it did with the data: a held-out eval set, the overlong prompt filtered
    assert "held out for evaluation and never trained on" in done.stderr
    assert "filtered: 1" in done.stderr, done.stderr
    records = read_metrics(run / "metrics.jsonl")
    steps = [r for r in records if "reward" in r]
    assert [r["step"] for r in steps] == [1, 2]
    for name in ("correct", "format", "mine"):
        assert all(f"rewards/{name}/mean" in r and r[f"rewards/{name}/errors"] == 0 for r in steps)
    assert all(r["rewards/mine/mean"] < 0 for r in steps)  # the custom reward really ran
    assert [r["step"] for r in records if "eval/accuracy" in r] == [0, 2]
    # a LoRA-wrapped Qwen2 is sampled by the fast engine itself, not by a quiet fallback to model.generate
    summary = json.loads((run / "summary.json").read_text())
    assert summary["engine"] == "fast" and summary["engine/fallback"] is None, summary

    # the merged export loads with plain transformers ...
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(run / "merged")
    tokenizer = AutoTokenizer.from_pretrained(run / "merged")
    assert not any("lora" in n for n, _ in model.named_parameters()) and tokenizer.chat_template
    # ... and `podsrl eval` scores it on the same held-out set
    done = ok(podsrl("eval", "--config", str(cfg), "--model", str(run / "merged"), cwd=user_kit))
    metrics = json.loads(done.stdout.strip().splitlines()[-1])
    assert 0.0 <= metrics["eval/accuracy"] <= 1.0

    # resume: one more step from the last checkpoint, history kept
    done = ok(podsrl("train", "--resume", str(run), "train.max_steps=3", cwd=user_kit))
    records = read_metrics(run / "metrics.jsonl")
    assert [r["step"] for r in records if "reward" in r] == [1, 2, 3]
    assert json.loads((run / "summary.json").read_text())["step"] == 3


def test_full_finetune_excel_csv_and_checkpoint_eval(user_kit):
    cfg = user_config(user_kit, "full", "data/train.csv")  # saved with a byte-order mark, as Excel does
    wandb = importlib.util.find_spec("wandb") is not None  # a dependency of the test extra; optional elsewhere
    report_to = "[tensorboard, wandb]" if wandb else "[tensorboard]"
    ok(podsrl("train", "--config", str(cfg), f"log.report_to={report_to}", cwd=user_kit))  # WANDB_MODE=offline
    run = user_kit / "runs" / "full"
    assert list((run / "tensorboard").glob("events.*"))
    assert not wandb or list((run / "wandb").glob("offline-run-*/run-*.wandb"))
    checkpoint = run / "checkpoints" / "step-00000002" / "model"
    done = ok(podsrl("eval", "--config", str(cfg), "--model", str(checkpoint), cwd=user_kit))
    assert "eval/accuracy" in json.loads(done.stdout.strip().splitlines()[-1])
