"""`podsrl train | eval | warmup | compare | report | plan | presets` (user errors: one line on stderr, exit code 2;
every exit code is in podsrl/exit_codes.py)."""

from __future__ import annotations

import argparse
import json
import logging
import os
import signal
import sys
from pathlib import Path

from podsrl.threads import prepare_openmp

# Run as a program (`podsrl`, `python -m podsrl`, torchrun), this process decides its torch threads once the config
# is read; a host program that imported torch before calling main() keeps its own. The OpenMP runtime's wait policy
# is read when torch loads it: set before the imports below bring torch in.
OWNS_THREADS = "torch" not in sys.modules
prepare_openmp()

from podsrl.config.presets import preset_path, preset_table  # noqa: E402  (imports torch)
from podsrl.errors import UnhealthyRun, UserError, WorkerLost  # noqa: E402
from podsrl.exit_codes import ExitCode  # noqa: E402
from podsrl.reporting.streams import guard_std_streams  # noqa: E402
from podsrl.run import supervisor  # noqa: E402
from podsrl.waits import WaitExpired  # noqa: E402

DEFAULT_CONFIG = "default"  # no --config: the built-in task, tuned for a short CPU run (configs/default.yaml)


def _load(args):
    from podsrl.config import load_config

    return load_config(preset_path(args.config or DEFAULT_CONFIG), args.overrides)


def _set_threads(cfg) -> None:
    """This process's torch threads for the run `cfg` (podsrl/threads.py), when the CLI owns the process."""
    if OWNS_THREADS:
        from podsrl.threads import apply_threads

        apply_threads(cfg)


def cmd_train(args) -> int:
    if args.resume:
        from podsrl.config import load_config

        run_dir = Path(args.resume)
        saved = run_dir / "config.yaml"
        if not saved.is_file():
            raise UserError(f"--resume: {run_dir} is not a run directory (no config.yaml)")
        cfg = load_config(saved, args.overrides + [f"output_dir={run_dir}"])
        finished = _finished_at(run_dir, cfg)
        if finished is not None:  # a requeued job of a finished run must not train again, nor fail
            if os.environ.get("RANK", "0") == "0":
                print(f"podsrl: {run_dir} is finished (step {finished}, summary.json); nothing to resume")
            return ExitCode.FINISHED
    else:
        cfg = _load(args)
    if args.print_config:
        from podsrl.config import config_yaml

        print(config_yaml(cfg), end="")
        return 0
    if args.supervised and supervisor.supported():  # the parent waits here, and exits with the trainer's code
        supervisor.supervise(Path(cfg.output_dir))
    _set_threads(cfg)
    from podsrl.run.trainer import Trainer  # after the config: a bad one is reported without importing torch

    trainer = Trainer(cfg, resume=bool(args.resume))
    summary = trainer.train()
    if trainer.stopped_by_signal:  # checkpointed: a scheduler must read "not done yet", not "finished"
        return ExitCode.STOPPED_RESUMABLE
    if os.environ.get("RANK", "0") == "0":  # torchrun: one summary line, from rank 0
        print(json.dumps({k: v for k, v in summary.items() if k.startswith(("eval/", "step", "time/"))}))
    return ExitCode.FINISHED


def _finished_at(run_dir: Path, cfg) -> int | None:
    """The step of a run that already reached the budget of `cfg` (its summary.json says so), else None; a
    resume with a larger budget (e.g. train.max_steps) continues the run."""
    try:
        summary = json.loads((run_dir / "summary.json").read_text(encoding="utf-8"))
        step, elapsed = int(summary["step"]), float(summary["time/elapsed"])
        rollouts = float(summary.get("total/rollouts_generated", 0))
    except (OSError, ValueError, KeyError, TypeError):
        return None
    t = cfg.train
    spent = step >= t.max_steps or 0 < t.max_seconds <= elapsed or 0 < t.max_rollouts <= rollouts
    return step if spent else None


def cmd_presets(args) -> int:
    print(preset_table())
    return 0


def cmd_warmup(args) -> int:
    from podsrl.run.warmup import needs_warmup, run_warmup

    cfg = _load(args)
    _set_threads(cfg)
    if not needs_warmup(cfg):
        print("nothing to do: warm-up applies to model.name_or_path=tiny with warmup.steps > 0")
        return 0
    # this machine's own warm-up, trained unless cached; runs use the shipped one of the same key unless
    # warmup.shipped=false
    print(run_warmup(cfg, progress=cfg.log.progress, use_shipped=False))
    return 0


def cmd_eval(args) -> int:
    from podsrl.run.checkpoint_readers import pinned_model

    # first of all: a checkpoint of a run being trained is pinned against rotation until its weights are loaded
    weights, pin = pinned_model(args.model) if args.model else (None, None)
    try:
        return _evaluate(args, weights, pin)
    finally:
        if pin is not None:
            pin.close()


def _evaluate(args, weights, pin) -> int:
    from podsrl.build import load_model, load_task, reward_manager, rollout_engine, verifier
    from podsrl.config.facts import run_facts
    from podsrl.episodes.runner import task_episodes
    from podsrl.models.loading import resolve_device
    from podsrl.models.transformers_api import model_context
    from podsrl.run.evaluation import evaluate
    from podsrl.run.warmup import base_weights

    cfg = _load(args)
    _set_threads(cfg)
    # The trainer's own builders: a LoRA run's --model is its adapter (on top of the warm-up or model.name_or_path)
    # the warm-up is the base of a LoRA adapter or the model when no --model is given; full weights need none
    base = base_weights(cfg) if weights is None or cfg.model.lora_rank > 0 else None
    model, tokenizer = load_model(cfg, weights, base, trainable=False)
    if pin is not None:  # read: rotation may remove the checkpoint now
        pin.close()
    device = resolve_device(cfg.model.device)
    model.to(device).eval()
    task, problems = load_task(cfg, tokenizer, model)
    if not problems:
        raise UserError(f"task {task.name}: no eval set to evaluate on (task.eval_size, task.eval_fraction, "
                        "task.args.eval_split, task.args.eval_path)")
    engine = rollout_engine(cfg, model, tokenizer, run_facts(cfg, device).compute_dtype)
    verify = verifier(reward_manager(cfg, task), task)  # correctness is the `correct` reward alone, as in training
    try:
        metrics = evaluate(engine, tokenizer, problems, verify, cfg.rollout.max_new_tokens, cfg.eval.samples,
                           cfg.rollout.temperature, cfg.rollout.top_p, cfg.eval.batch_size,
                           task_episodes(engine, tokenizer, task, cfg.episode, model_context(model)))
    finally:
        engine.close()
    print(json.dumps(metrics))
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="podsrl", description=__doc__)
    parser.add_argument("-v", "--verbose", action="store_true", help="debug logging")
    sub = parser.add_subparsers(dest="command", required=True)

    def with_config(p):
        p.add_argument("--config", help="YAML config or bundled preset name (`podsrl presets` lists them); "
                       "default: default (tuned for a short CPU run)")
        p.add_argument("overrides", nargs="*", help="dotted overrides, e.g. rollout.n=16 optim.lr=1e-4")
        return p

    p = with_config(sub.add_parser("train", help="RL training (warm-up first if the built-in model needs it)"))
    p.add_argument("--resume", metavar="RUN_DIR", help="continue the run in RUN_DIR from its latest good checkpoint")
    p.add_argument("--print-config", action="store_true",
                   help="print the resolved config (preset, file and overrides, validated; of the method's sections, "
                   "the chosen one's) as YAML and exit")
    p.set_defaults(func=cmd_train)
    p = sub.add_parser("presets", help="list the bundled presets (--config NAME) and what each is for")
    p.set_defaults(func=cmd_presets)
    p = with_config(sub.add_parser("warmup", help="supervised warm-up of the built-in model (cached)"))
    p.set_defaults(func=cmd_warmup)
    p = with_config(sub.add_parser("eval", help="held-out accuracy of a model"))
    p.add_argument("--model", help="model dir to evaluate (e.g. RUN/checkpoints/step-N/model: full weights, or the "
                   "LoRA adapter of a model.lora_rank > 0 run), or a run dir (its newest complete checkpoint); a "
                   "run's checkpoint is pinned against rotation while it loads; default: the warm-up or "
                   "model.name_or_path")
    p.set_defaults(func=cmd_eval)
    from podsrl.experiments.report import add_report_arguments, report_main
    from podsrl.experiments.runner import add_compare_arguments, compare_main

    p = sub.add_parser("compare", help="train configs x seeds under one budget, then plot and tabulate")
    add_compare_arguments(p)
    p.set_defaults(func=compare_main)
    p = sub.add_parser("report", help="rebuild the comparison plot and tables from saved runs")
    add_report_arguments(p)
    p.set_defaults(func=report_main)
    from podsrl.experiments.step_costs import add_plan_arguments, plan_main
    from podsrl.memory_plan import add_memory_arguments, memory_main

    p = sub.add_parser("plan", help="measure step costs here, predict the step time of (prompts, n, m) settings; "
                       "--memory: predict peak memory and the largest micro-batch that fits a device")
    add_plan_arguments(p)
    add_memory_arguments(p)
    p.set_defaults(func=lambda args: (memory_main if args.memory else plan_main)(args, preset_path(args.config)))
    return parser


def _interrupt(signum, frame) -> None:
    raise KeyboardInterrupt


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The parsed command line; `key=value` overrides may also come after the options (`podsrl plan grpo --memory
    --gpu-memory 80GiB rollout.n=8`), where argparse alone stops taking positionals."""
    parser = build_parser()
    args, rest = parser.parse_known_args(argv)
    late = [item for item in rest if "=" in item and not item.startswith("-")]
    if late and hasattr(args, "overrides"):
        args.overrides = [*args.overrides, *late]
        rest = [item for item in rest if item not in late]
    if rest:
        parser.error(f"unrecognized arguments: {' '.join(rest)}")
    return args


def main(argv: list[str] | None = None) -> int:
    """The CLI. With the process's own command line (argv None: `podsrl`, `python -m podsrl`), `train` runs under
    a supervising parent (podsrl/run/supervisor.py); `main([...])` from Python runs in the calling process."""
    args = parse_args(argv)
    args.supervised = argv is None
    code = _run(args)
    supervisor.report_exit(code)  # the trainer's own exit: its parent passes the code on
    return code


def _run(args: argparse.Namespace) -> int:
    guard_std_streams()  # before logging's console handler takes sys.stderr: a closed pipe never stops a run
    logging.basicConfig(level=logging.DEBUG if args.verbose else logging.INFO, format="%(levelname)s %(message)s")
    logging.getLogger("transformers").setLevel(logging.ERROR)
    # transformers' per-file bars ("Loading weights", "Writing model shards") would interleave with podsrl's own
    # progress at every checkpoint; podsrl reports loading and saving itself.
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    # SIGTERM before training starts (loading, warm-up) ends like Ctrl-C; the trainer then takes it over and
    # turns it into checkpoint-and-exit.
    try:
        signal.signal(signal.SIGTERM, _interrupt)
    except ValueError:  # called from a thread other than the main one: leave signals to the host program
        pass
    try:
        return args.func(args)
    except UserError as e:
        print(f"podsrl: error: {e}", file=sys.stderr)
        return ExitCode.UNHEALTHY if isinstance(e, UnhealthyRun) else ExitCode.USER_ERROR
    except WorkerLost as e:
        print(f"podsrl: error: {e}", file=sys.stderr)
        return ExitCode.WORKER_LOST
    except WaitExpired as e:
        print(f"podsrl: stalled: {e}", file=sys.stderr)
        return ExitCode.STALLED
    except KeyboardInterrupt:
        print("podsrl: interrupted", file=sys.stderr)
        return ExitCode.INTERRUPTED


if __name__ == "__main__":
    sys.exit(main())
