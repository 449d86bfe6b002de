"""What a user brings, built offline inside the tests: a local Hugging Face model directory (a small Qwen2 with a
BPE tokenizer trained with `tokenizers` on generated text, and a ChatML chat template), GSM8K-format data as
jsonl, csv (saved with a byte-order mark, as Excel does) and parquet, and a custom reward file."""

from __future__ import annotations

import csv
import json
import os
import random
import subprocess
import sys
from pathlib import Path

from tests.checkout import pythonpath

ROOT = Path(__file__).resolve().parents[2]

CHATML = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
CONTEXT = 256  # the model's max_position_embeddings

REWARD_FILE = '''
def length_penalty(prompts, completions, answer, **columns):
    """A user's reward with TRL's signature: shorter completions are better (and the gold answer is passed)."""
    assert len(answer) == len(completions)
    return [-len(c) / 100 for c in completions]
'''


def gsm8k_rows(count: int, seed: int = 0) -> list[dict]:
    """GSM8K-format problems: a word problem and a worked answer ending in '#### <number>'."""
    rng = random.Random(seed)
    names = ["Tom", "Ana", "Lee", "Sam", "Mia", "Raj"]
    items = ["apples", "pens", "books", "coins", "shells"]
    rows = []
    for i in range(count):
        a, b = rng.randint(2, 60), rng.randint(2, 40)
        name, item = rng.choice(names), rng.choice(items)
        question = f"{name} has {a} {item} and gets {b} more. How many {item} does {name} have now? (#{i})"
        total = a + b if i % 7 else a * 100 + b  # a few answers with thousands separators
        worked = f"{a} + {b} = {a + b}." if i % 7 else f"{a} * 100 + {b} = {total}."
        rows.append({"question": question, "answer": f"{name} has {worked}\n#### {total:,}"})
    return rows


def long_row() -> dict:
    """A prompt longer than the model's context: it must be filtered and counted at start-up."""
    return {"question": "Count the apples: " + "apple " * 600 + "How many?", "answer": "#### 600"}


def build_model_dir(path: Path) -> Path:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast, Qwen2Config, Qwen2ForCausalLM

    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=600, special_tokens=specials,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    corpus = [f"{r['question']}\n{r['answer']}" for r in gsm8k_rows(300, seed=99)]
    corpus += ["<think>\nstep by step\n</think>\n<answer>\n42\n</answer>", "user assistant system"] * 20
    tok.train_from_iterator(corpus, trainer)
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|im_end|>", pad_token="<|endoftext|>",
                                        padding_side="left")
    tokenizer.chat_template = CHATML
    config = Qwen2Config(vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=CONTEXT,
                         tie_word_embeddings=True, eos_token_id=tokenizer.eos_token_id,
                         pad_token_id=tokenizer.pad_token_id, bos_token_id=None)
    import torch

    torch.manual_seed(0)
    model = Qwen2ForCausalLM(config)
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


def write_data(folder: Path, rows: list[dict]) -> dict[str, Path]:
    """The same rows as jsonl, csv (UTF-8 with BOM) and parquet."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    folder.mkdir(parents=True, exist_ok=True)
    out = {"jsonl": folder / "train.jsonl", "csv": folder / "train.csv", "parquet": folder / "train.parquet"}
    out["jsonl"].write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    with open(out["csv"], "w", encoding="utf-8-sig", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=["question", "answer"])
        writer.writeheader()
        writer.writerows(rows)
    pq.write_table(pa.Table.from_pylist(rows), out["parquet"])
    return out


def podsrl(*args: str, cwd: Path, timeout: float = 300, env: dict | None = None,
           python_args: tuple[str, ...] = ("-m", "podsrl.cli")) -> subprocess.CompletedProcess:
    """The real CLI as a subprocess, from this checkout, offline, one thread per process (a 2-core CI box)."""
    full_env = {**os.environ, "PYTHONPATH": pythonpath(), "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1",
                "OMP_NUM_THREADS": "1", "WANDB_MODE": "offline", "TOKENIZERS_PARALLELISM": "false", **(env or {})}
    full_env.pop("WANDB_SERVICE", None)  # a wandb service started by an in-process test is not the CLI's
    return subprocess.run([sys.executable, *python_args, *args], cwd=cwd, env=full_env, capture_output=True,
                          text=True, timeout=timeout)


def ok(done: subprocess.CompletedProcess) -> subprocess.CompletedProcess:
    assert done.returncode == 0, f"exit {done.returncode}\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}"
    return done


# Method sections a user writes for `podsrl compare` (the README uses the same keys); other runs use the default.
PODS = {"method": "pods", "pods": {"m": 2, "rule": "max_variance"}}
GRPO = {"method": "grpo"}
SYSTEM_PROMPT = "Think step by step, then give the answer in <answer></answer>."


def user_config(home: Path, name: str, data: str, *, lora: bool = False, method: dict | None = None,
                **sections) -> Path:
    """A config file as a user would write it for their model, data and rewards (small enough for CI)."""
    import yaml

    cfg = {
        "model": {"name_or_path": str(home / "model"), "lora_rank": 4 if lora else 0},
        "task": {"name": "dataset", "eval_size": 4,
                 "args": {"path": data, "answer_format": "gsm8k", "prompt_mode": "chat",
                          "system_prompt": SYSTEM_PROMPT}},
        "rewards": ["correct", {"name": "format", "weight": 0.2},
                    {"name": "mine", "function": "my_rewards.py:length_penalty", "weight": 0.1}],
        "rollout": {"n": 4, "prompts_per_step": 2, "max_new_tokens": 12},
        **(method or {}),
        "train": {"max_steps": 2, "eval_every": 2, "save_every": 1},
        "eval": {"samples": 0},
        "warmup": {"steps": 0},
        "log": {"plot": False, "log_every": 1},
        "output_dir": f"runs/{name}",
    }
    for section, values in sections.items():
        cfg.setdefault(section, {}).update(values)
    path = home / f"{name}.yaml"
    path.write_text(yaml.safe_dump(cfg, sort_keys=False))
    return path

