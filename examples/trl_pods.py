"""PODS with TRL: generate 16 completions per prompt, train on the 4 with the most reward variance.

Runs on CPU in about a minute with the built-in tiny model (nothing is downloaded):

    python examples/trl_pods.py                       # tiny char-level model, 20 steps
    python examples/trl_pods.py --model Qwen/Qwen2.5-0.5B-Instruct --steps 200   # any causal LM you have

Everything except the four `pods_*`/`filter_zero_variance` fields is plain TRL `GRPOConfig`. A seeded 5% of the
prompts is held out and evaluated by TRL's own evaluation (`--eval-fraction 0` trains without one, and says so).
"""

from __future__ import annotations

import argparse
import random
import re
import tempfile

from datasets import Dataset

from podsrl.integrations.trl import PODSGRPOConfig, PODSGRPOTrainer


def addition_dataset(size: int, seed: int = 0) -> Dataset:
    rng = random.Random(seed)
    pairs = [(rng.randint(10, 49), rng.randint(10, 49)) for _ in range(size)]
    return Dataset.from_dict({"prompt": [f"{a}+{b}=" for a, b in pairs], "answer": [str(a + b) for a, b in pairs]})


def correctness(prompts, completions, answer, **kwargs) -> list[float]:
    """1 for the right sum at the start of the completion, partial credit for each right leading digit."""
    out = []
    for completion, target in zip(completions, answer):
        got = re.match(r"\s*(\d*)", completion).group(1)
        out.append(1.0 if got == target else 0.25 * sum(a == b for a, b in zip(got, target)))
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="tiny", help="'tiny' (built-in) or a local path / hub id")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--n", type=int, default=16, help="completions generated per prompt")
    parser.add_argument("--m", type=int, default=4, help="completions trained on per prompt")
    parser.add_argument("--prompts-per-step", type=int, default=4)
    parser.add_argument("--rule", default="max_variance", choices=["max_variance", "max_reward", "random", "none"])
    parser.add_argument("--eval-fraction", type=float, default=0.05, help="prompts held out for evaluation")
    parser.add_argument("--output-dir", default=None)
    args = parser.parse_args()

    if args.model == "tiny":
        from podsrl.config import TinyModelConfig
        from podsrl.models.loading import build_char_tokenizer, build_tiny_model

        tokenizer = build_char_tokenizer()
        model = build_tiny_model(TinyModelConfig(), tokenizer)
    else:
        from transformers import AutoModelForCausalLM, AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(args.model, padding_side="left")
        model = AutoModelForCausalLM.from_pretrained(args.model)

    config = PODSGRPOConfig(
        output_dir=args.output_dir or tempfile.mkdtemp(prefix="trl_pods_"),
        # TRL meaning kept: per_device_train_batch_size completions are *generated* per micro-step ...
        per_device_train_batch_size=args.prompts_per_step * args.n,
        num_generations=args.n,
        # ... and the loss sees per_device_train_batch_size * m / n of them.
        pods_m=args.m,
        pods_rule=args.rule,
        pods_normalize_over="subset",
        filter_zero_variance=False,
        max_completion_length=4,
        temperature=1.0,
        learning_rate=1e-3,
        max_steps=args.steps,
        logging_steps=5,
        save_strategy="no",
        report_to="none",
        # evaluation on the held-out prompts, halfway and at the end (TRL scores n completions per eval prompt)
        eval_strategy="steps" if args.eval_fraction > 0 else "no",
        eval_steps=max(1, args.steps // 2),
        per_device_eval_batch_size=args.prompts_per_step * args.n,
        bf16=False,
        seed=0,
    )
    data = addition_dataset(512)
    if args.eval_fraction > 0:  # seeded, so every run evaluates the same prompts; never trained on
        split = data.train_test_split(test_size=args.eval_fraction, seed=0)
        data, held_out = split["train"], split["test"]
        print(f"held out {len(held_out)} of {len(data) + len(held_out)} prompts for evaluation")
    else:
        held_out = None
        print("no eval set (--eval-fraction 0): training without evaluation")
    trainer = PODSGRPOTrainer(
        model=model,
        reward_funcs=correctness,
        args=config,
        train_dataset=data,
        eval_dataset=held_out,
        processing_class=tokenizer,
    )
    trainer.train()
    for record in trainer.state.log_history:
        if "pods/completions_trained" in record:
            print(
                f"step {record['step']:>3}: reward {record['reward']:.3f}  "
                f"std before/after selection {record['pods/reward_std_before']:.3f}/"
                f"{record['pods/reward_std_after']:.3f}  trained {record['pods/completions_trained']:.0f} of "
                f"{record['pods/completions_generated']:.0f}"
            )
        if "eval_reward" in record:
            print(f"step {record['step']:>3}: held-out reward {record['eval_reward']:.3f}")


if __name__ == "__main__":
    main()
