"""The core sections of the run configuration, and `Config`: these sections plus one per registered method.

Each field is declared with `option` (default, help text and bounds), so docs/config.md documents it; a method's own section
lives in its module (podsrl/methods/<name>.py) and is composed in here from the method registry, so adding a method
never touches this file. The task section is the tasks' own (podsrl/tasks/section.py TaskConfig).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, Literal

from podsrl.engines import DEFAULT_ENGINE, ENGINES, RolloutEngine, engine_class
from podsrl.methods import METHODS
from podsrl.options import option
from podsrl.reporting.trackers import TRACKERS
from podsrl.tasks import TaskConfig

_f = option


@dataclass
class TinyModelConfig:
    hidden_size: int = _f(128, "Width of the built-in Qwen2-style model.")
    num_layers: int = _f(4, "Transformer layers of the built-in model.")
    num_heads: int = _f(4, "Attention heads (key/value heads = half, grouped-query like Qwen2).",
        ge=1, test=lambda v: v % 2 == 0 or v == 1, refusal="must be even (or 1)")
    intermediate_size: int = _f(384, "MLP width of the built-in model.")
    max_position_embeddings: int = _f(64, "Longest sequence the built-in model handles.")


@dataclass
class ModelConfig:
    name_or_path: str = _f("tiny", "'tiny' (built-in char-level Qwen2), a local path, or a Hugging Face hub id.")
    dtype: Literal["float32", "bfloat16", "float16"] = _f(
        "float32", "Parameter dtype of the policy (bfloat16: the weights themselves, no float32 master copy; LoRA "
        "adapters stay float32). float16 is refused: there is no loss scaling.",
        test=lambda v: v != "float16", refusal="float16 is refused: podsrl has no loss scaling, so small float16 "
        "gradients would underflow to zero; use bfloat16 (the same memory) or float32")
    compute_dtype: Literal["auto", "float32", "bfloat16", "float16"] = _f(
        "auto", "Dtype of the forward/backward matmuls of the update (autocast); weights and optimiser state stay in "
        "model.dtype. auto: bfloat16 on CUDA, float32 on CPU (never wider than model.dtype). float32 weights with "
        "bfloat16 compute is mixed precision (float32 masters); model.dtype=bfloat16 is pure bfloat16. Log-probs, "
        "entropy and loss are float32 either way. float16 is refused (no loss scaling).")
    device: str = _f("auto", "'auto' (cuda if available, else cpu), 'cpu', 'cuda', 'cuda:1', ...")
    tiny: TinyModelConfig = field(default_factory=TinyModelConfig)
    lora_rank: int = _f(0, "LoRA rank through peft; 0 trains all weights.", ge=0)
    lora_alpha: int = _f(32, "LoRA alpha.")
    lora_dropout: float = _f(0.0, "LoRA dropout.")
    lora_target_modules: list[str] = _f(["q_proj", "k_proj", "v_proj", "o_proj"], "Modules LoRA adapts.")
    trust_remote_code: bool = _f(False, "Passed to from_pretrained; off unless you trust the model repo.")


@dataclass
class WarmupConfig:
    steps: int = _f(2000, "Most supervised warm-up steps on reference completions (built-in tasks; 0 = none).", ge=0)
    target_accuracy: float = _f(
        0.25, "Stop the warm-up once greedy accuracy on a validation stream reaches this (0 = run all steps), so RL "
        "starts part-way up rather than at 0% or 100%.",
        ge=0, le=1)
    check_every: int = _f(50, "Warm-up steps between validation checks.", ge=1)
    episode_steps: int = _f(
        800, "Tasks with an environment (arithmetic_tool, arithmetic_python): supervised steps on reference episodes "
        "(tool calls, the tools' answers masked from the loss) after the plain warm-up of the same prompts; fixed, no "
        "target.")
    episode_batch_size: int = _f(32, "Problems per step of the episode warm-up (an episode is ~10x a bare answer's "
                                     "tokens).")
    validation_size: int = _f(500, "Validation problems (from the training stream, never the held-out set).", ge=1)
    batch_size: int = _f(128, "Warm-up batch size.")
    lr: float = _f(1e-3, "Warm-up learning rate (AdamW, 50 linear warm-up steps, then constant).")
    cache_dir: str = _f(".cache/podsrl/warmup", "Where warmed-up base checkpoints are cached, keyed by config.")
    seed: int = _f(0, "Warm-up seed; the same for every RL run so they start from the same checkpoint.")
    shipped: bool = _f(True, "Start from the warm-up shipped with podsrl when one matches this config's key (the "
                       "default run's): the same weights on every machine, where a warm-up trained here stops at a "
                       "threshold whose crossing depends on the CPU's rounding. false: this machine's own, trained "
                       "once and cached (`podsrl warmup` builds it).")


@dataclass
class RolloutConfig:
    prompts_per_step: int = _f(32, "Prompts drawn per step (P), for the whole job: under torchrun the ranks share "
                               "them (each generates and trains its share of the groups).", ge=1)
    n: int = _f(16, "Rollouts generated per prompt (TRL: num_generations).", ge=1)
    temperature: float = _f(1.0, "Sampling temperature; log-probs are of the temperature-scaled policy.", gt=0)
    top_p: float = _f(1.0, "Nucleus sampling threshold.", gt=0, le=1)
    top_k: int = _f(0, "Top-k sampling (0 = off).", ge=0)
    max_new_tokens: int = _f(8, "Completion length cap (TRL: max_completion_length).", ge=1)
    # the choices are the engine registry's, read when the config is built (an engine registered later counts)
    engine: Literal[tuple(ENGINES)] = _f(DEFAULT_ENGINE, f"Rollout engine (podsrl.engines.ENGINES): {', '.join(ENGINES)}.")
    engine_options: dict[str, Any] = _f({}, (
        "Engine-specific options, each listed in its engine's docstring (podsrl/engines). fast: cuda_graphs (default "
        "on when the model is on a CUDA device: the decode step is captured as one CUDA graph per (rows, cache "
        "length) bucket on first use and replayed; measured on an H200 in docs/results.md), compile, cache_block, "
        "weights_dtype and more; ray: num_workers, address and more; vllm: gpu_memory_utilization and more. Every "
        "engine: "
        "eos_token_id (default: the tokenizer's EOS and every eos id of the model's generation config; given, it "
        "replaces them) and pad_token_id."))

    @property
    def engine_type(self) -> type[RolloutEngine]:
        """The class registered for `engine`, whose traits (podsrl/engines/base.py) say what differs between engines:
        the one place the code outside engines/ looks the engine up."""
        return engine_class(self.engine)


@dataclass
class EpisodeConfig:
    max_turns: int = _f(4, "Episodes (tasks with an environment): most model turns per episode; an episode still "
                        "calling tools after this many ends there.", ge=1)
    max_tokens: int = _f(256, "Episodes: most completion tokens per episode, the model's turns and the environment's "
                         "messages together (each turn also stops at rollout.max_new_tokens).", ge=1)
    tool_timeout_s: float = _f(10.0, "Episodes: seconds a tool call may take; a call that runs longer answers the "
                               "model with an error and counts as a tool fault.", gt=0)
    env_timeout_s: float = _f(60.0, "Episodes: seconds an environment's reset or step may take (a TRL environment's "
                              "too); one that runs longer ends its episode, counted in episode/ended_by_timeout.", gt=0)
    timeout_s: float = _f(600.0, "Episodes: seconds an episode's environment may take in all (its reset and steps, "
                          "tool calls included; not the model's generation); past it the episode ends, counted in "
                          "episode/ended_by_timeout.", gt=0)
    max_hung_calls: int = _f(32, "Episodes: tool and environment calls that ran past their time limit and never "
                             "returned (each holds a thread: Python cannot stop one); one more stops the run naming "
                             "them.", ge=1)
    max_parallel_calls: int = _f(8, "Episodes: the calls of one model turn run concurrently, this many at once, and "
                                 "are all answered in order (verl: multi_turn.max_parallel_calls, which also drops "
                                 "the calls past it).", ge=1)
    max_response_chars: int = _f(8192, "Episodes: a tool's answer or an environment's message longer than this many "
                                 "characters is cut before it is tokenized, counted in episode/truncated_responses "
                                 "(verl: multi_turn.max_tool_response_length).",
        ge=64, note="a cut answer keeps its cut mark")
    response_truncate_side: Literal["left", "right", "middle"] = _f(
        "middle", "Episodes: what a cut answer keeps: its start (left), its end (right) or both halves (middle) "
        "(verl: multi_turn.tool_response_truncate_side).")
    tool_format: Literal["auto", "hermes", "llama3_json", "mistral"] = _f(
        "auto", "Episodes: how the model writes tool calls; auto reads it from the tokenizer's chat template "
        "(hermes: Qwen2.5/Qwen3 <tool_call> JSON, also without a template; llama3_json: Llama 3.x; mistral: "
        "[TOOL_CALLS]). docs/episodes.md.")
    credit: Literal["episode", "turn"] = _f("episode", "Episodes: how advantages reach tokens. 'episode': every token "
                                            "of an episode gets its advantage; 'turn': each turn's tokens are "
                                            "credited from their turn on, by the rewards the environment's steps "
                                            "give (docs/episodes.md, 'Per-turn rewards').")
    turn_discount: float = _f(1.0, "Episodes under credit=turn: the discount of later turns' rewards, in [0, 1].",
        ge=0, le=1)
    sandbox: Literal["isolated", "unisolated"] = _f(
        "isolated", "Episodes: where model-written programs run (the python tool, podsrl.sandbox.Sandbox). "
        "'isolated': in their own namespaces and root (docs/episodes.md); a machine that cannot isolate refuses to "
        "start. 'unisolated': there, run them anyway with access to your files and processes, with a warning.")


@dataclass
class AlgoConfig:
    scale: Literal["group", "batch", "none"] = _f("group", "Advantage std scaling (TRL: scale_rewards).")
    advantage_epsilon: float = _f(1e-4, "Added to the std in the advantage denominator.", gt=0)
    epsilon_low: float = _f(0.2, "Lower clip range of the ratio (TRL: epsilon).", ge=0)
    epsilon_high: float = _f(0.2, "Upper clip range of the ratio (TRL: epsilon_high; DAPO clip-higher 0.28).", ge=0)
    loss_agg: Literal["token_mean", "seq_mean_token_mean", "seq_mean_token_sum_norm"] = _f(
        "token_mean", "Loss aggregation (TRL: loss_type dapo/grpo/dr_grpo; verl: loss_agg_mode)."
    )
    beta: float = _f(0.0, "KL coefficient to a frozen reference (k3); 0 loads no reference model.", ge=0)
    kl_ratio_weighted: bool = _f(
        False, "Multiply each token's KL term by the PPO ratio pi / pi_old (not detached), so its gradient is the "
        "unbiased reverse-KL gradient (TRL: use_bias_correction_kl, on by default there; DeepSeek-V3.2). It changes "
        "the gradient even on one pass, where the ratio's value is 1. Only with beta > 0.")
    advantage_clip: float = _f(0.0, "Clip every method's advantages to [-c, c] before the update (e.g. 5); "
                               "0 = off.", ge=0, note="0 = off")
    rollout_correction: Literal["auto", "none", "token_tis", "token_mask", "sequence_tis", "sequence_mask"] = _f(
        "auto", "Importance weights for sampler/trainer mismatch (TRL: vllm_importance_sampling_correction + "
        "vllm_importance_sampling_mode token_truncate/token_mask/sequence_truncate/sequence_mask; verl: "
        "algorithm.rollout_correction rollout_is token/sequence). Ratio = trainer/sampler probability of the sampled "
        "tokens, per token or per sequence (product); *_tis truncates it to [cap_low, cap], *_mask zeroes it "
        "outside; it multiplies the token loss, and the PPO old log-probs become the trainer's. auto, per kind of "
        "mismatch: TRL's sequence_mask for the vllm engine's rollouts and for asynchronous generation from older "
        "weights; token_tis when the sampler differs in precision alone (a compute dtype other than model.dtype: "
        "a sequence ratio multiplies every token's rounding gap, docs/results.md); none when the sampler is the "
        "trainer's own module in one precision. The log names the mismatch kinds found.")
    rollout_correction_cap: float = _f(3.0, "Upper bound C_max of the rollout-correction ratio (TRL: "
                                       "vllm_importance_sampling_clip_max; verl: rollout_is_threshold).")
    rollout_correction_cap_low: float = _f(0.0, "Lower bound C_min of the rollout-correction ratio; 0 = none (TRL: "
                                           "vllm_importance_sampling_clip_min, None there).", ge=0)


@dataclass
class FilterConfig:
    zero_variance: bool = _f(False, "Drop groups whose kept rewards all agree (DAPO dynamic sampling), for any method.")
    max_refill_rounds: int = _f(0, "Extra prompt draws to refill a filtered batch; when spent, train on what's there.",
        ge=0)


@dataclass
class OptimConfig:
    lr: float = _f(1e-4, "Policy learning rate (AdamW). RL on tiny models is LR-sensitive: 2e-4 was unstable here.",
        gt=0)
    weight_decay: float = _f(0.0, "AdamW weight decay.")
    betas: list[float] = _f([0.9, 0.999], "AdamW betas.", test=lambda v: len(v) == 2, refusal="needs two values")
    max_grad_norm: float = _f(1.0, "Gradient-norm clip (0 = off).", ge=0)
    scheduler: Literal["constant", "cosine"] = _f("constant", "LR schedule after warm-up.")
    warmup_steps: int = _f(0, "Linear LR warm-up steps.", ge=0)
    epochs: int = _f(1, "Passes over each step's batch (mu; TRL: num_iterations, verl: ppo_epochs).", ge=1)
    mini_batches: int = _f(1, "Optimiser steps per pass; the batch is split into this many mini-batches.", ge=1)
    micro_batch_size: int = _f(0, "Rollouts per forward/backward on each rank (gradient accumulation); memory knob "
                               "only, same gradients at any size. Default 0 (auto; `auto` is accepted too): decided "
                               "once at start-up (one log line says the size and why). On CUDA the largest "
                               "micro-batch the memory plan fits on the run's device (`podsrl plan --memory` shows "
                               "it), at most a rank's mini-batch, so one micro-batch where the plan fits it (each "
                               "costs the update its kernel launches again); on the CPU 256. The run's config.yaml "
                               "keeps auto (a resume decides again, on its device); a number sets it.", ge=0, note="0 = auto")
    micro_batch_tokens: int = _f(0, "Tokens (prompt + completion, per row) per micro-batch on each rank, as verl's "
                                 "ppo_max_token_len_per_gpu: rows in their order are cut where the next would pass "
                                 "the budget (a longer row runs alone), still at most optim.micro_batch_size rows; "
                                 "0 = rows only. With completions of very different lengths it bounds memory by "
                                 "what a micro-batch holds, not by its row count (`podsrl plan --memory` advises "
                                 "it); same gradients either way.", ge=0, note="0 = rows only")


@dataclass
class UpdateConfig:
    shared_prompt: bool = _f(True, "Run each distinct prompt of a micro-batch once and the completions without "
                             "padding (Llama/Mistral/Qwen2/Qwen3; other models use the plain path). Same loss and "
                             "gradients as false, the plain per-row forward kept as the reference.")
    logits_chunk: int = _f(1024, "Tokens per chunk of the log-prob/entropy computation: the float32 softmax of at "
                           "most this many tokens x vocabulary exists at a time.", ge=1)
    activation_checkpointing: bool = _f(
        False, "Keep only each decoder layer's input in the forward and recompute the layer in the backward (TRL: "
        "gradient_checkpointing): activation memory per micro-batch falls from every layer's intermediates to one "
        "hidden state per layer, for about one more forward of time. Turn it on when long completions or a large "
        "optim.micro_batch_size run out of memory; same gradients either way.")


@dataclass
class AsyncConfig:
    enabled: bool = _f(False, "Generate the next steps' rollouts on a background worker while the learner updates "
                       "(one process: a thread with its own copy of the policy; rollout.engine=ray: the actor pool). "
                       "The batch trained at step k is sampled under the weights of step max(k - max_staleness, r), "
                       "r = the step the run started at (0, or the step it resumed from: older weights are not "
                       "kept), a fixed lag, so a run is the same whatever the timing. A checkpoint carries the "
                       "batches already produced under older weights, so a resume with the same max_staleness "
                       "continues the run exactly.")
    max_staleness: int = _f(1, "Optimiser steps between the weights that sampled a batch and the weights it trains "
                            "(1 = one-step off-policy, verl's one_step_off_policy); 0 = the synchronous loop (the same "
                            "run bit for bit, no overlap). A batch older than this (a resume with a smaller value) is "
                            "dropped and counted (async/dropped_batches).", ge=0, note="0 = synchronous")
    generator_threads: int = _f(0, "torch threads of the in-process generator; the learner keeps the process's. 0 = "
                                "split: the generator takes half of torch's threads (at least 1), the learner the rest. "
                                "Not used by rollout.engine=ray (its workers have cpus_per_worker).",
        ge=0, note="0 = half of torch's")

    @property
    def runs_ahead(self) -> bool:
        """Whether generation overlaps the learner (max_staleness 0 is the synchronous loop, same weights)."""
        return self.enabled and self.max_staleness > 0


@dataclass
class TrainConfig:
    max_steps: int = _f(200, "RL steps (the run also stops at max_seconds / max_rollouts if set).", ge=1)
    max_seconds: float = _f(0.0, "Training budget in seconds of train.clock, eval excluded (0 = none): the run stops "
                            "there (`podsrl compare --budget-seconds` sets it for equal wall-clock).", ge=0)
    clock: Literal["wall", "cpu"] = _f(
        "wall", "What max_seconds, warn_seconds and time/elapsed count: wall = wall-clock; cpu = this process's CPU "
        "time (all its threads; not Ray workers or other ranks). With OMP_NUM_THREADS=1, cpu is a training clock "
        "that other jobs on a shared machine do not stretch (equal-time comparisons on a busy CPU).")
    warn_seconds: float = _f(0.0, "Warn once when training passes this many seconds (eval excluded; 0 = never). "
                             "A guard that never stops the run: its outcome stays set by max_steps.", ge=0)
    max_rollouts: int = _f(0, "Budget of generated rollouts (0 = none).", ge=0)
    eval_every: int = _f(20, "Evaluate every N steps (and at the start and end).", ge=1)
    save_every: int = _f(50, "Checkpoint every N steps (and at the end).", ge=1)
    keep_checkpoints: int = _f(2, "Checkpoints kept on disk (older ones are deleted).", ge=1)
    threads: int = _f(0, "torch threads of each process (0 = auto: the usable cores, less those local Ray workers "
                      "take, shared by torchrun's ranks on this node, and fewer at a step where other work takes cores; "
                      "OMP_NUM_THREADS wins). Logged (podsrl/threads.py); a number here is kept all run.", ge=0,
                      note="0 = auto")
    max_nonfinite_steps: int = _f(3, "Consecutive non-finite losses/gradients (each skipped) before the run stops.")
    wait_timeout_s: float = _f(1800.0, "The longest any wait on another process or thread may last (a Ray worker's "
                               "result, a collective, the async generator's batch, vLLM's weight sync): past it the "
                               "run stops with one line naming what it waited for and where, exit code 4.",
                               gt=0, note="seconds")
    # Health checks (podsrl/run/health.py): each warns once, logs health/<check> and is listed in summary.json.
    health_steps: int = _f(10, "Steps in a row a collapse sign must hold before its health warning (0 = no "
                           "health checks): reward 0, empty completions, low entropy, KL or clipped-ratio blow-up.",
        ge=0, note="0 = no health checks")
    health_min_entropy: float = _f(0.01, "Health: mean token entropy (nats) below this is an entropy collapse.", ge=0)
    health_max_kl: float = _f(2.0, "Health: mean per-token KL to the reference (algo.beta > 0) above this is a "
                              "blow-up.", gt=0)
    health_max_clipped: float = _f(0.5, "Health: share of tokens whose probability ratio is clipped "
                                   "(clip_ratio/region_mean) above this is a blow-up.", gt=0, le=1)
    stop_on_collapse: bool = _f(False, "Stop the run (exit code 3) when a health check fires, instead of warning "
                                "and going on.")
    # How the update is spread over torchrun ranks (docs/scale.md); one process ignores these.
    strategy: Literal["ddp", "fsdp"] = _f(
        "ddp", "ddp: every rank holds the whole model, gradients and optimiser state (fits one device); fsdp: "
        "FSDP2, parameters, gradients and AdamW state sharded over ranks (fully_shard per decoder layer).")
    cpu_offload: bool = _f(False, "fsdp: keep the sharded parameters, gradients and optimiser state in CPU memory.")
    fsdp_param_dtype: Literal["auto", "bfloat16", "float32"] = _f(
        "auto", "fsdp: dtype of the forward/backward compute (auto: bfloat16 on CUDA, float32 on CPU); the sharded "
        "master weights and optimiser state stay in model.dtype.")
    fsdp_reduce_dtype: Literal["float32", "bfloat16"] = _f("float32", "fsdp: dtype of the gradient reduce-scatter.")
    fsdp_reshard_after_forward: bool = _f(
        True, "fsdp: free each layer's gathered parameters after its forward (ZeRO-3, least memory); false keeps "
        "them until the backward (ZeRO-2-like, one all-gather less per micro-batch).")
    # YAML/CLI key `train.async` (a Python keyword, so the field has another name; see config_key)
    asynchronous: AsyncConfig = field(default_factory=AsyncConfig, metadata={"key": "async"})


@dataclass
class EvalConfig:
    size: int = _f(0, "Held-out problems used (0 = all of task.eval_size).", ge=0)
    samples: int = _f(4, "k of Avg@k / pass@k (sampled at the rollout temperature); 0 = greedy only.", ge=0)
    batch_size: int = _f(1024, "Rows per generation call during evaluation.", ge=1)


@dataclass
class LogConfig:
    tensorboard: bool = _f(True, "false removes tensorboard from log.report_to (older spelling).")
    progress: bool = _f(True, "Show progress: a live display on a terminal, plain lines when stdout is a file.")
    # Trackers and progress for cluster jobs.
    # the names are the tracker registry's, checked when the config is loaded
    report_to: Any = _f(["tensorboard"], "Trackers (TRL: report_to; podsrl.reporting.trackers.TRACKERS): a list of "
                        f"{', '.join(TRACKERS)}, or 'all' / 'none'. metrics.jsonl is always written. wandb/trackio "
                        "are optional extras.")
    run_name: str = _f("", "Run name shown by trackers (TRL: run_name); default: the config name and seed.")
    project: str = _f("podsrl", "wandb/trackio project (WANDB_PROJECT / TRACKIO_PROJECT override it).")
    log_every: int = _f(10, "When stdout is not a terminal: one plain progress line every N steps ...", ge=1)
    log_every_seconds: float = _f(60.0, "... or after this many seconds, whichever comes first (warm-up too).", gt=0)
    plot: bool = _f(True, "Write plots.png (reward and held-out accuracy) in the run dir.")
    rank_logs: bool = _f(False, "Under torchrun: each rank other than 0, whose console shows its warnings and "
                         "errors only, also writes all its log lines to <output_dir>/ranks/rank<N>.log.")
    grad_noise: bool = _f(False, "Log grad/noise_var (split-half estimate of the gradient's total variance), "
                          "grad/signal (squared norm) and their ratio on each step's first mini-batch. No extra "
                          "passes, one copy of the gradients; the update is the same up to floating-point "
                          "summation order (micro-batches are formed within each half), which is why a method "
                          "that modulates advantages per micro-batch may refuse it.")


@dataclass
class CoreConfig:
    """The sections every run has; `Config` adds one section per registered method."""

    name: str = _f("", "Label of this configuration in comparisons (default: the config file's stem).")
    seed: int = _f(0, "Seed of the RL run (sampling, prompt order, selection).")
    output_dir: str = _f("runs/default", "Run directory: config, metrics, checkpoints, plots. Not set in the file "
                         "or on the command line: runs/<name> (e.g. runs/grpo for --config grpo).",
        test=bool, refusal="must not be empty")
    method: str = _f("grpo", f"The method (podsrl.methods.METHODS): {', '.join(METHODS)}; its options are in the "
                     "section of the same name.")
    model: ModelConfig = field(default_factory=ModelConfig)
    task: TaskConfig = field(default_factory=TaskConfig)
    warmup: WarmupConfig = field(default_factory=WarmupConfig)
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    episode: EpisodeConfig = field(default_factory=EpisodeConfig)
    algo: AlgoConfig = field(default_factory=AlgoConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    update: UpdateConfig = field(default_factory=UpdateConfig)
    rewards: list[Any] = _f([], "Reward functions: names or {name, weight, function}; empty = the task's default.")
    reward_on_error: Literal["zero", "skip", "fail"] = _f("zero", "What a failing reward function's values become.")
    reward_timeout: float = _f(10.0, "Seconds a reward call may take before it counts as failed.", gt=0)
    reward_max_faulty_calls: int = _f(5, "Reward calls in a row (one per step; more with refills or sampling rounds) "
                                      "in which every value of one reward function is faulty before the run stops "
                                      "(exit 2) instead of training on filled-in values.", ge=1)
    train: TrainConfig = field(default_factory=TrainConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    log: LogConfig = field(default_factory=LogConfig)
    filter: FilterConfig = field(default_factory=FilterConfig)


def _compose(methods: dict) -> type:
    """CoreConfig plus a section `<name>` (the method's `section` dataclass) for each method that has options, in
    registry order."""
    sections = [(name, m.section, field(default_factory=m.section)) for name, m in methods.items()
                if m.section is not None]
    cls = dataclasses.make_dataclass("Config", sections, bases=(CoreConfig,))
    cls.__module__, cls.__doc__ = "podsrl.config", "A run's configuration: the core sections and every method's own."
    return cls


Config = _compose(METHODS)
