"""Throughput of a full RL step: podsrl vs TRL's GRPOTrainer, and PODS 64->16 vs GRPO 16-16 through the trainer.

Part 1 (same model, tokenizer, batch, n = 16, 16 new tokens, beta = 0, lr 1e-4, one process): for 64 and 256
rollouts per step, TRL's GRPOTrainer and podsrl's trainer take steps in strict alternation (a TRL callback runs one
podsrl step after each TRL step), `--repeats` timed steps each after one untimed; prints the median step time, the
min-max spread, generation/update split, and the median of the per-step ratios TRL/podsrl (target: >= 2x).
The tiny model is untrained here, so completions run to the full length in both frameworks. TRL keeps its own
defaults, among them GRPOConfig's gradient_checkpointing=True (a recomputed forward in its backward, which podsrl
does not do; measured ~1.1x of TRL's step here), printed beside its times.

`--model 10m` runs part 1 on a ~10M-parameter model of the same family instead of the built-in one. `--workload
gsm8k` runs it on the GSM8K-shaped workload instead (benchmarks/gsm8k_shape.py: a random-init Qwen2, by default of
~13M parameters with a 32k vocabulary, `--shape 0.5b` Qwen2.5-0.5B's, saved as a local model directory with a jsonl
of 200-token prompts and a reward file, as a user brings them; one prompt x n = 16, up to `--new-tokens` (400) new
tokens: the untrained model reaches the cap in every row, so podsrl's finished-row compaction gains nothing here).
Part 1 also prints the ratio of the two frameworks' matmul work (`work_ratios`): what the full-step ratio would be if
both ran at the same FLOP rate with no other cost; and the CUDA-graph captures each podsrl step made (0 on a CPU).
On CUDA TRL runs with its GRPOConfig's own bf16 default (autocast over float32 weights, as podsrl's `auto`); on the CPU
both compute in float32. `--json FILE` writes the GSM8K-shaped comparison's figures (benchmarks/speed_results.py).

Part 2 (the built-in task with the warmed-up model, as `podsrl train` runs it): PODS 64->16 vs GRPO 16-16 steps,
alternating, with their split into generate/score/select/update (target: ratio <= 1.3).

    python benchmarks/step_throughput.py [--repeats 5] [--threads 1] [--skip-trl] [--skip-task]
                                         [--trl-no-checkpointing] [--model tiny|10m] [--workload gsm8k]
                                         [--shape 13m|0.5b] [--new-tokens 400] [--json FILE]
    python benchmarks/step_throughput.py --workload gsm8k --skip-task --repeats 5    # the CPU's check against TRL
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.speed_results import CaptureCounter, Results  # noqa: E402
from podsrl.config import TinyModelConfig, load_config  # noqa: E402
from podsrl.models.loading import build_char_tokenizer, build_tiny_model  # noqa: E402
from podsrl.run.trainer import Trainer  # noqa: E402

# The built-in model and a ~10M-parameter one of the same shape family (width 384, 6 layers): where per-operation
# cost, which dominates the 0.8M model's steps on a CPU, is a smaller share.
MODELS = {
    "tiny": TinyModelConfig(),
    "10m": TinyModelConfig(hidden_size=384, num_layers=6, num_heads=6, intermediate_size=1024),
}

STEP_KEYS = ("time/generate", "time/score", "time/select", "time/update", "time/step", "tokens/generated",
             "tokens/trained")


def podsrl_trainer(overrides: list[str], preset: str | None = None) -> Trainer:
    out_dir = tempfile.mkdtemp(prefix="podsrl_step_")
    return Trainer(load_config(preset, [f"output_dir={out_dir}", "log.progress=false", "log.tensorboard=false",
                                        "log.plot=false", *overrides]))


def close(trainer: Trainer) -> None:
    trainer.logger.close()
    trainer.parts.engine.close()


def alternate_steps(trainers: dict[str, Trainer], repeats: int) -> dict[str, list[dict]]:
    """Each trainer's step metrics over `repeats` rounds after an untimed one, the order reversed every other round;
    closes the trainers."""
    records: dict[str, list[dict]] = {name: [] for name in trainers}
    for i in range(repeats + 1):
        for name in trainers if i % 2 == 0 else list(trainers)[::-1]:
            metrics = trainers[name].train_step().metrics
            if i > 0:
                records[name].append(metrics)
    for t in trainers.values():
        close(t)
    return records


def med(values: list[float]) -> str:
    return f"{statistics.median(values):.3f} ({min(values):.3f}-{max(values):.3f})"


def work_ratios(batch, trl_prompt_len: int, new_tokens: int, trl_checkpointing: bool) -> tuple[float, float, float]:
    """TRL's matmul work over podsrl's for one step, (generation, update, step), in tokens x FLOPs per parameter
    (the same parameters in both): 2 per token forwarded while generating, 6 per token trained, 8 where TRL
    recomputes its forward for gradient checkpointing. podsrl forwards each distinct prompt once and each completion
    token but the last, in generation and in the update alike; TRL prefills every row's padded prompt, runs
    new_tokens - 1 decode steps over every row (its completions reach the cap in every step here) and trains every
    row's padded prompt + completion."""
    rows = batch.num_rollouts
    first_rows = [int((batch.group_index == g).nonzero()[0]) for g in batch.group_index.unique()]
    prompt_tokens = int(batch.prompt_mask[first_rows].sum())
    forwarded = prompt_tokens + int((batch.completion_mask.sum(1) - 1).clamp(min=0).sum())
    ours = (2 * forwarded, 6 * forwarded)
    theirs = (2 * rows * (trl_prompt_len + new_tokens - 1),
              (8 if trl_checkpointing else 6) * rows * (trl_prompt_len + new_tokens))
    return theirs[0] / ours[0], theirs[1] / ours[1], sum(theirs) / sum(ours)


def recorded_batches(trainer: Trainer) -> list:
    """The list every batch the trainer's updater trains on is appended to from now on."""
    batches: list = []
    update = trainer.parts.updater.update

    def recording_update(batch, generator):
        batches.append(batch)
        return update(batch, generator)

    trainer.parts.updater.update = recording_update
    return batches


def alternating_callback(base: type, ours: Trainer):
    """A TRL callback that times TRL's step, then takes one podsrl step before TRL's next one."""

    class Alternate(base):  # type: ignore[misc,valid-type]
        def __init__(self) -> None:
            self.records: list[dict] = []
            self.trl_steps: list[float] = []
            self.t0 = 0.0

        def on_step_begin(self, args, state, control, **kwargs):
            self.t0 = time.perf_counter()

        def on_step_end(self, args, state, control, **kwargs):
            self.trl_steps.append(time.perf_counter() - self.t0)
            self.records.append(ours.train_step().metrics)

    return Alternate()


def part1(opts) -> None:
    from datasets import Dataset

    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from trl_step import build_trainer

    model = MODELS[opts.model]
    params = build_tiny_model(model, build_char_tokenizer()).num_parameters()
    print(f"== podsrl vs TRL GRPOTrainer: untrained {opts.model} model ({params / 1e6:.1f}M parameters), n = 16, "
          f"16 new tokens, beta = 0, lr 1e-4; {opts.repeats} alternating steps each after one untimed; median "
          f"(min-max) seconds")
    shape = [f"model.tiny.{k}={v}" for k, v in vars(model).items()]
    dataset = Dataset.from_dict({"prompt": [f"{a}+{b}=" for a in range(10, 40) for b in range(10, 20)],
                                 "answer": [str(a + b) for a in range(10, 40) for b in range(10, 20)]})
    for rollouts in (64, 256):
        prompts = rollouts // 16
        ours = podsrl_trainer([f"rollout.prompts_per_step={prompts}", "rollout.n=16", "method=grpo",
                               "rollout.max_new_tokens=16", "warmup.steps=0", "optim.lr=1e-4",
                               f"optim.micro_batch_size={rollouts}", *shape])
        trl_opts = argparse.Namespace(prompts=prompts, max_new_tokens=16, warmup=1, steps=opts.repeats,
                                      trl_no_checkpointing=opts.trl_no_checkpointing, model_config=model)
        trl, gen_times = build_trainer(f"trl{rollouts}", 16, None, trl_opts, dataset)
        prompt_len = max(len(trl.processing_class(p).input_ids) for p in dataset["prompt"])
        against_trl(f"{rollouts} rollouts/step", ours, trl, gen_times, prompt_len, 16)


def part1_gsm8k(opts) -> None:
    """Part 1 on the GSM8K-shaped workload, both frameworks loading the same saved model, data and reward."""
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer

    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from gsm8k_shape import PROMPT_TOKENS, write_workload
    from trl_step import build_trainer

    new_tokens = opts.new_tokens
    paths = write_workload(Path(tempfile.mkdtemp(prefix="gsm8k_shape_")), shape=opts.shape)
    spec = importlib.util.spec_from_file_location("gsm8k_reward", paths["reward"])
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    model = AutoModelForCausalLM.from_pretrained(paths["model"])
    print(f"== podsrl vs TRL GRPOTrainer: GSM8K-shaped workload, untrained Qwen2 ({model.num_parameters() / 1e6:.1f}M "
          f"parameters, {opts.shape} shape, {model.config.vocab_size}-token vocabulary), one {PROMPT_TOKENS}-token "
          f"prompt x n = 16, {new_tokens} new tokens max, "
          f"beta = 0, lr 1e-4; {opts.repeats} alternating steps each after one untimed; median (min-max) seconds")
    task = (f"{{path: {paths['data']}, prompt_column: prompt, answer_column: answer, answer_format: raw, "
            f"prompt_mode: plain}}")
    ours = podsrl_trainer([f"model.name_or_path={paths['model']}", "task.name=dataset", f"task.args={task}",
                           "task.eval_size=0", "task.max_prompt_length=256", "eval.samples=0",
                           f"rewards=[{{name: words, function: '{paths['reward']}:word_reward'}}]",
                           "rollout.prompts_per_step=1", "rollout.n=16", f"rollout.max_new_tokens={new_tokens}",
                           "method=grpo", "optim.lr=1e-4", "optim.micro_batch_size=16"])
    rows = [json.loads(line) for line in paths["data"].read_text().splitlines()]
    trl_opts = argparse.Namespace(prompts=1, max_new_tokens=new_tokens, warmup=1, steps=opts.repeats,
                                  trl_no_checkpointing=opts.trl_no_checkpointing)
    trl, gen_times = build_trainer("trl_gsm8k", 16, None, trl_opts, Dataset.from_list(rows), model=model,
                                   tokenizer=AutoTokenizer.from_pretrained(paths["model"]),
                                   reward_funcs=module.word_reward)
    prompt_len = max(len(trl.processing_class(row["prompt"]).input_ids) for row in rows)
    results = Results(opts.json, "RL step against TRL") if opts.json else None
    if results:
        results.put("setup", {"workload": "gsm8k", "shape": opts.shape, "parameters": model.num_parameters(),
                              "vocabulary": model.config.vocab_size, "prompt_tokens": prompt_len, "n": 16,
                              "new_tokens": new_tokens, "rounds": opts.repeats,
                              "trl_gradient_checkpointing": trl.args.gradient_checkpointing,
                              "trl_bf16": bool(trl.args.bf16)})
    figures = against_trl(f"1 prompt x 16 rollouts/step (prompts of up to {prompt_len} tokens)", ours, trl, gen_times,
                          prompt_len, new_tokens)
    if results:
        results.put("comparison", figures)
        ratio = figures["ratio_median"]
        results.summary(f"GSM8K-shaped step at {opts.shape}, n = 16, {new_tokens} tokens, {opts.repeats} alternating "
                        f"rounds: podsrl {statistics.median(figures['podsrl']['time/step']):.3f} s, TRL "
                        f"{statistics.median(figures['trl_step_s']):.3f} s a step: TRL/podsrl {ratio:.2f}x "
                        f"({min(figures['ratios']):.2f}-{max(figures['ratios']):.2f}x)")
        results.target("RL step, TRL / podsrl", ratio if opts.shape == "0.5b" else None)


def against_trl(label: str, ours: Trainer, trl, gen_times: list[float], prompt_len: int, new_tokens: int) -> dict:
    """Runs TRL's steps with one podsrl step after each (the first of each untimed) and prints both and their
    ratios, and the CUDA-graph captures each podsrl step made; closes podsrl's trainer. Returns the figures."""
    from transformers import TrainerCallback

    batches = recorded_batches(ours)
    alternate = alternating_callback(TrainerCallback, ours)
    trl.add_callback(alternate)
    with CaptureCounter() as captures:
        step = ours.train_step

        def counted_step():
            before = captures.count
            record = step()
            record.metrics["captures"], record.metrics["capture_s"] = captures.since(before)
            return record

        ours.train_step = counted_step
        trl.train()
    close(ours)
    records, trl_steps, gen_times = alternate.records[1:], alternate.trl_steps[1:], gen_times[1:]
    p = {k: [r[k] for r in records] for k in (*STEP_KEYS, "captures", "capture_s")}
    ratios = [t / s for t, s in zip(trl_steps, p["time/step"])]
    trl_update = [t - g for t, g in zip(trl_steps, gen_times)]
    print(label)
    print(f"  podsrl step {med(p['time/step'])}  generate {med(p['time/generate'])}  "
          f"update {med(p['time/update'])}  (tokens generated per step: {med(p['tokens/generated'])})")
    print(f"  TRL    step {med(trl_steps)}  generate {med(gen_times)}  rest {med(trl_update)}  "
          f"(TRL's GRPOConfig, gradient_checkpointing={trl.args.gradient_checkpointing})")
    print(f"  TRL/podsrl full step: median {statistics.median(ratios):.2f}x (per step {min(ratios):.2f}-"
          f"{max(ratios):.2f}x); generation {statistics.median(gen_times) / statistics.median(p['time/generate']):.2f}x; "
          f"update {statistics.median(trl_update) / statistics.median(p['time/update']):.2f}x "
          f"(TRL's 'rest' = step minus generation: scoring, advantages, loss, backward, optimiser)")
    works = [work_ratios(b, prompt_len, new_tokens, trl.args.gradient_checkpointing) for b in batches[1:]]
    gen, upd, step_work = (statistics.median(w[i] for w in works) for i in range(3))
    print(f"  matmul work TRL/podsrl (tokens x FLOPs per parameter, see work_ratios), median: generation "
          f"{gen:.2f}x, update {upd:.2f}x, full step {step_work:.2f}x (the step ratio if both ran their matmuls at "
          f"the same rate and had no other cost)")
    print(f"  podsrl's CUDA-graph captures per step: {p['captures']} ({med(p['capture_s'])} s in them)")
    return {"podsrl": p, "trl_step_s": trl_steps, "trl_generate_s": gen_times, "trl_rest_s": trl_update,
            "ratios": ratios, "ratio_median": statistics.median(ratios),
            "work_ratios": {"generation": gen, "update": upd, "step": step_work}}


def part2(opts) -> None:
    print(f"\n== built-in task, warmed-up model, default engine: PODS 64->16 vs GRPO 16-16 (32 prompts/step), "
          f"{opts.repeats} alternating steps each after one untimed")
    setups = {"grpo 16-16": ["rollout.n=16", "method=grpo"], "pods 64->16": ["rollout.n=64", "method=pods", "pods.m=16"]}
    trainers = {name: podsrl_trainer(o) for name, o in setups.items()}
    records = alternate_steps(trainers, opts.repeats)
    print(f"{'setup':<12} {'step s':>22} {'generate':>9} {'score':>7} {'select':>7} {'update':>7} "
          f"{'gen tokens':>10} {'trained tokens':>14}")
    for name, rs in records.items():
        m = {k: statistics.median(r[k] for r in rs) for k in STEP_KEYS}
        print(f"{name:<12} {med([r['time/step'] for r in rs]):>22} {m['time/generate']:>9.3f} {m['time/score']:>7.3f} "
              f"{m['time/select']:>7.4f} {m['time/update']:>7.3f} {m['tokens/generated']:>10.0f} "
              f"{m['tokens/trained']:>14.0f}")
    ratios = [p["time/step"] / g["time/step"] for p, g in zip(records["pods 64->16"], records["grpo 16-16"])]
    share = statistics.median(r["time/select"] / r["time/step"] for r in records["pods 64->16"])
    print(f"ratio PODS 64->16 / GRPO 16-16 step time: median {statistics.median(ratios):.2f} "
          f"({min(ratios):.2f}-{max(ratios):.2f}; target <= 1.3); selection share of the PODS step: "
          f"{100 * share:.2f}% (target < 1%)")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=5, help="timed steps per setup (after one untimed)")
    parser.add_argument("--threads", type=int, default=1, help="torch threads (0: torch's default)")
    parser.add_argument("--skip-trl", action="store_true")
    parser.add_argument("--trl-no-checkpointing", action="store_true",
                        help="run TRL with gradient_checkpointing=False (its GRPOConfig default is True)")
    parser.add_argument("--skip-task", action="store_true")
    parser.add_argument("--model", choices=list(MODELS), default="tiny",
                        help="model of the TRL comparison: the built-in one or a ~10M-parameter one")
    parser.add_argument("--workload", choices=["tiny", "gsm8k"], default="tiny",
                        help="gsm8k: part 1 on the GSM8K-shaped workload (benchmarks/gsm8k_shape.py) instead")
    parser.add_argument("--shape", choices=["13m", "0.5b", "tiny"], default="13m",
                        help="the GSM8K-shaped workload's model (benchmarks/gsm8k_shape.py SHAPES)")
    parser.add_argument("--new-tokens", type=int, default=400, help="the GSM8K-shaped workload's completion cap")
    parser.add_argument("--json", help="the GSM8K-shaped comparison's result file")
    opts = parser.parse_args()
    if opts.threads:
        torch.set_num_threads(opts.threads)
    load = os.getloadavg()
    print(f"machine: {platform.machine()}, {os.cpu_count()} cores visible, torch {torch.__version__}, "
          f"{torch.get_num_threads()} threads, OMP_NUM_THREADS={os.environ.get('OMP_NUM_THREADS', 'unset')}, "
          f"load average {load[0]:.2f}/{load[1]:.2f}/{load[2]:.2f}")
    t0 = time.perf_counter()
    if not opts.skip_trl:
        part1_gsm8k(opts) if opts.workload == "gsm8k" else part1(opts)
    if not opts.skip_task:
        part2(opts)
    print(f"(benchmark took {time.perf_counter() - t0:.0f}s; end load average {os.getloadavg()[0]:.2f})")


if __name__ == "__main__":
    main()
