"""The producing side of a step: from the sampler's next problems to the batch the learner trains on.

    problems -> method.collect -> stats.record -> method.select -> zero-variance filter / refill
             -> advantage clip -> method.end_step

`BatchProducer.produce(step)` runs these stages and names no method (it is looked up by name once). Everything they
read and write is the producer's own: the data position, its RNG stream (sampling seeds, prompt order, selection),
the per-prompt history, the method's state, the engine it samples with, the rewards. The synchronous loop calls
`produce` in process; under train.async the background generator calls it on its thread
(podsrl/run/async_generation.py), and the learner (podsrl/run/trainer.py) touches none of it while that thread runs: it
reads the producer only through `state_dict` once the generator is quiet (checkpoints).
"""

from __future__ import annotations

import copy
import time
from dataclasses import dataclass, field, fields

import torch

from podsrl.algo.group_stats import group_stats, zero_variance_groups
from podsrl.batch import Problem, RolloutBatch, concat_batches
from podsrl.config import Config
from podsrl.engines import SamplingParams
from podsrl.engines.base import RolloutEngine
from podsrl.episodes.calls import Interrupted
from podsrl.episodes.credit import turn_credit
from podsrl.episodes.runner import GroupStop, task_episodes
from podsrl.episodes.stats import EpisodeStats, trained_metrics
from podsrl.methods import StepContext
from podsrl.methods.base import Method
from podsrl.prompt_stats import PromptStats
from podsrl.rewards import RewardManager, RewardResult, merge_results
from podsrl.run import faults

TIMERS = ("time/generate", "time/score", "time/select", "time/update")


@dataclass
class ProducedBatch:
    """One step's batch as the generator hands it over: the rows that train (with advantages and policy_version),
    the generation-side metrics, what was generated (for the compute accounting: the model's tokens, and apart
    the environment's tokens of episodes) and the generator's timers."""

    kept: RolloutBatch
    metrics: dict[str, float]
    generated_rollouts: int
    generated_tokens: int
    environment_tokens: int = 0
    timers: dict[str, float] = field(default_factory=dict)
    version: int = 0  # the step whose weights sampled it
    generator_idle: float = 0.0  # seconds the generator waited for those weights before producing it
    generated: list[RolloutBatch] = field(default_factory=list)  # every collected batch (not saved: metrics are)

    def state_dict(self) -> dict:
        """Tensors and plain values only (checkpoints load with torch.load(weights_only=True))."""
        batch = {}
        for f in fields(self.kept):
            value = getattr(self.kept, f.name)
            batch[f.name] = [vars(p) for p in value] if f.name == "problems" else value
        return {"kept": batch, "metrics": self.metrics, "generated_rollouts": self.generated_rollouts,
                "generated_tokens": self.generated_tokens, "environment_tokens": self.environment_tokens,
                "timers": self.timers, "version": self.version}

    @classmethod
    def from_state(cls, state: dict) -> ProducedBatch:
        batch = dict(state["kept"])
        batch["problems"] = [Problem(**p) for p in batch["problems"]]
        return cls(kept=RolloutBatch(**batch), metrics=state["metrics"],
                   generated_rollouts=state["generated_rollouts"], generated_tokens=state["generated_tokens"],
                   environment_tokens=state.get("environment_tokens", 0), timers=state["timers"],
                   version=state["version"])


@dataclass
class StepRecord:
    """What one step produced: its logged metrics, and the material they were computed from (filled while the
    batch is produced; a batch restored from a checkpoint keeps only its metrics)."""

    metrics: dict[str, float] = field(default_factory=dict)
    timers: dict[str, float] = field(default_factory=lambda: dict.fromkeys(TIMERS, 0.0))
    generated: list[RolloutBatch] = field(default_factory=list)  # every collected batch, before selection
    reward_metrics: list[dict] = field(default_factory=list)  # one per generate call
    collect_metrics: list[dict] = field(default_factory=list)  # one per method.collect
    skipped_rollouts: int = 0  # generated, then dropped by the reward policy 'skip' (still compute spent)
    stopped_rollouts: int = 0  # episodes a method's rule stopped between turns: the turns they took were spent
    dropped: list[RolloutBatch] = field(default_factory=list)  # the rows of those two (their tokens were spent)
    episodes: EpisodeStats = field(default_factory=EpisodeStats)  # what the step's episodes did (if any)


class FinishedScores:
    """A generate call's episodes scored as the runner finishes them (GroupStop.score): each through the rewards
    once, the results kept (`parts`, each with its rows) for the batch."""

    def __init__(self, producer: BatchProducer, problems: list[Problem], index_map: torch.Tensor) -> None:
        self.producer, self.problems, self.index_map = producer, problems, index_map
        self.parts: list[tuple[list[int], RewardResult]] = []

    def __call__(self, rows: list[int], groups: list[int], tokens: list[list[int]], environments: list) -> torch.Tensor:
        result = self.producer.rewards.score(self.problems, self.index_map[groups], self.producer.decode(tokens),
                                             environments)
        self.parts.append((rows, result))
        return result.rewards


class BatchProducer:
    """Produces each step's batch; see the module docstring. `sampler_logprobs`: whether the update needs the
    sampler's log-probs (PolicyUpdater.needs_sampler_logprobs)."""

    def __init__(self, cfg: Config, task, tokenizer, engine: RolloutEngine, rewards: RewardManager, method: Method,
                 sampler_logprobs: bool, context: int | None = None) -> None:
        self.cfg, self.task, self.tokenizer, self.engine = cfg, task, tokenizer, engine
        self.rewards, self.method = rewards, method
        # a task with an environment samples episodes (a row is one episode); otherwise one completion a row
        self.episodes = task_episodes(engine, tokenizer, task, cfg.episode, context)
        r = cfg.rollout
        self.sampling = SamplingParams(max_new_tokens=r.max_new_tokens, temperature=r.temperature, top_p=r.top_p,
                                       top_k=r.top_k, return_logprobs=sampler_logprobs)
        self.epoch_size = len(task) if hasattr(task, "__len__") else 0  # 0: an unbounded stream
        self.stats = PromptStats()
        self.rng = torch.Generator().manual_seed(cfg.seed)
        self.data_position = 0

    def state_dict(self) -> dict:
        """What a checkpoint holds of this side: the data position, the per-prompt history and the method's state
        (plain values), and the RNG stream (`rng`, a tensor)."""
        return {"data_position": self.data_position, "prompt_stats": self.stats.state_dict(),
                "method": self.method.state_dict(), "rng": self.rng.get_state()}

    def load_state_dict(self, state: dict) -> None:
        self.data_position = state["data_position"]
        self.stats.load_state_dict(state["prompt_stats"])
        self.method.load_state_dict(state.get("method", {}))
        self.rng.set_state(state["rng"])

    def produce(self, step: int) -> ProducedBatch:
        """Step `step`'s batch: draw its problems, collect, select (with refills), clip advantages, end the method's
        step. A step of episodes abandoned by a stop request (`Interrupted`) leaves this side as it was before it,
        so a checkpoint then holds the last completed step and a resume regenerates the abandoned one."""
        if self.episodes is None:
            return self._produce(step)
        before = copy.deepcopy(self.state_dict())
        try:
            return self._produce(step)
        except Interrupted:
            self.load_state_dict(before)
            raise

    def _produce(self, step: int) -> ProducedBatch:
        cfg = self.cfg
        record = StepRecord()
        ctx = self._context(record, step)  # before drawing: the epoch is that of the step's first problem
        kept, select_metrics = self.collect_and_select(self.next_problems(cfg.rollout.prompts_per_step), ctx, record)
        if kept.turn_index is not None:  # episode.credit: turn
            kept.token_advantages = turn_credit(kept.advantages, kept.rewards, kept.group_index, kept.num_groups,
                                                kept.turn_index, kept.turn_rewards, cfg.episode.turn_discount,
                                                cfg.algo.scale, cfg.algo.advantage_epsilon)
        if cfg.algo.advantage_clip > 0:
            kept.advantages = kept.advantages.clamp(-cfg.algo.advantage_clip, cfg.algo.advantage_clip)
            if kept.token_advantages is not None:
                kept.token_advantages = kept.token_advantages.clamp(-cfg.algo.advantage_clip, cfg.algo.advantage_clip)
        # the method's per-step state moves here, in step order, on the side that reads it (collect)
        method_metrics = self.method.end_step(record.generated, ctx)
        metrics = self._generation_metrics(record, {**select_metrics, **method_metrics})
        if self.episodes is not None:
            metrics.update(trained_metrics(kept))
        spent = record.generated + record.dropped
        model_tokens = sum(int(b.trained_mask.sum()) for b in spent)  # an episode's model tokens: its loss mask
        return ProducedBatch(kept=kept, metrics=metrics,
                             generated_rollouts=sum(b.num_rollouts for b in record.generated)
                             + record.skipped_rollouts + record.stopped_rollouts,
                             generated_tokens=model_tokens,
                             environment_tokens=sum(int(b.completion_mask.sum()) for b in spent) - model_tokens,
                             timers=record.timers, generated=record.generated)

    def _context(self, record: StepRecord, step: int) -> StepContext:
        return StepContext(
            cfg=self.cfg, stats=self.stats, rng=self.rng, step=step,
            epoch=self.data_position // self.epoch_size if self.epoch_size else 0, epoch_size=self.epoch_size,
            pad_token_id=self.tokenizer.pad_token_id,
            generate=lambda problems, indices, counts: self.generate_and_score(problems, indices, counts, record,
                                                                               step),
            draw=self.next_problems)

    def next_problems(self, count: int) -> list[Problem]:
        problems = [self.task.problem(self.data_position + i) for i in range(count)]
        self.data_position += count
        return problems

    def collect_and_select(self, problems: list[Problem], ctx: StepContext,
                           record: StepRecord) -> tuple[RolloutBatch, dict]:
        """The method's collect + select; with filter.zero_variance, groups whose kept rewards all agree are dropped
        and new prompts drawn (at most filter.max_refill_rounds times) until prompts_per_step groups carry signal."""
        cfg = self.cfg
        kept, metrics = self._collect_and_select_once(problems, ctx, record)
        if not cfg.filter.zero_variance:
            return kept, metrics
        parts, live_groups, rounds = [], 0, 0
        while True:
            dead = zero_variance_groups(kept.rewards, kept.group_index, kept.num_groups)
            present = kept.group_sizes() > 0
            live = ~dead & present
            # the zero-variance fraction of the round just sampled (DAPO's and the refill estimates' input)
            zero_variance_fraction = 1.0 - int(live.sum()) / max(int(present.sum()), 1)
            surplus = live_groups + int(live.sum()) - cfg.rollout.prompts_per_step
            if surplus > 0:  # a refill that drew more than missing: train the first groups, as DAPO does
                live[live.nonzero().flatten()[-surplus:]] = False
            kept = kept.select_rows(live[kept.group_index])
            live_groups += int(live.sum())
            parts.append(kept)
            missing = cfg.rollout.prompts_per_step - live_groups
            if missing <= 0 or rounds >= cfg.filter.max_refill_rounds:
                break
            rounds += 1
            count = self.method.refill_count(missing, zero_variance_fraction)
            kept, _ = self._collect_and_select_once(ctx.draw(count), ctx, record)
        metrics["select/refill_rounds"] = float(rounds)
        metrics["select/groups_trained"] = float(live_groups)
        # Bound hit with too few informative groups: train on what there is, and say so.
        metrics["select/refill_exhausted"] = float(live_groups < cfg.rollout.prompts_per_step)
        return concat_batches(parts, self.tokenizer.pad_token_id, disjoint=True), metrics

    def _collect_and_select_once(self, problems: list[Problem], ctx: StepContext,
                                 record: StepRecord) -> tuple[RolloutBatch, dict]:
        batch, collect_metrics = self.method.collect(problems, ctx)
        record.collect_metrics.append(collect_metrics)
        self.stats.record([p.uid for p in batch.problems], batch.group_index, batch.correct)
        record.generated.append(batch)
        t0 = time.perf_counter()
        kept, metrics = self.method.select(batch, ctx)
        record.timers["time/select"] += time.perf_counter() - t0
        return kept, metrics

    def generate_and_score(self, problems: list[Problem], indices: list[int], counts: list[int],
                           record: StepRecord, step: int) -> RolloutBatch:
        """Sample counts[j] rollouts of problems[indices[j]] (for the batch of step `step`, 0-based) and score them;
        group_index refers to `problems`."""
        t0 = time.perf_counter()
        seeds = torch.randint(0, 2**62, (sum(counts),), generator=self.rng)
        loss_mask = environments = stopped = turn_index = turn_rewards = None
        index_map = torch.tensor(indices, dtype=torch.long)
        finished = None  # the episodes' rewards, scored by the runner as they finished (with a method's stop rule)
        if self.episodes is None:
            prompts = [self.tokenizer(problems[i].prompt, add_special_tokens=False).input_ids for i in indices]
            out = self.engine.generate(prompts, counts, self.sampling, seeds)
        else:
            rule = self.method.episode_stop_rule()
            finished = None if rule is None else FinishedScores(self, problems, index_map)
            stop = None if rule is None else GroupStop(finished, rule)
            episodes = self.episodes.run([problems[i] for i in indices], counts, self.sampling, seeds, stop,
                                         after_turn=lambda: faults.fire("turn", step + 1))
            out, loss_mask, stopped = episodes.generation, episodes.loss_mask, episodes.stopped
            environments = episodes.environments
            if self.cfg.episode.credit == "turn":
                turn_index, turn_rewards = episodes.turn_index, episodes.turn_rewards
            record.episodes.add(episodes.stats)
        t1 = time.perf_counter()
        batch = RolloutBatch(
            problems=problems, group_index=index_map[out.group_index], prompt_ids=out.prompt_ids,
            prompt_mask=out.prompt_mask, completion_ids=out.completion_ids,
            completion_mask=out.completion_mask.float(), truncated=out.truncated, sampler_logprobs=out.logprobs,
            loss_mask=loss_mask, turn_index=turn_index, turn_rewards=turn_rewards,
        )
        if stopped is not None and bool(stopped.any()):  # spent, never scored, not trained
            record.stopped_rollouts += int(stopped.sum())
            record.dropped.append(batch.select_rows(stopped))
            batch = batch.select_rows(~stopped)
            environments = [e for e, s in zip(environments, stopped.tolist()) if not s]
        batch.completions = self.decode([row[mask > 0].tolist() for row, mask in
                                         zip(batch.completion_ids, batch.completion_mask)])
        if finished is not None and finished.parts:
            result = merge_results(finished.parts)
        else:
            result = self.rewards.score(problems, batch.group_index, batch.completions, environments)
        batch.rewards, batch.reward_components, batch.correct = result.rewards, result.components, result.correct
        if not bool(result.valid.all()):  # reward policy 'skip': those rollouts never reach the update
            record.skipped_rollouts += int((~result.valid).sum())  # ... but were generated: they count as compute
            record.dropped.append(batch.select_rows(~result.valid))
            batch = batch.select_rows(result.valid)
        record.timers["time/generate"] += t1 - t0
        record.timers["time/score"] += time.perf_counter() - t1
        record.reward_metrics.append(result.metrics)
        return batch

    def decode(self, completions: list[list[int]]) -> list[str]:
        """The texts the rewards read (and the batch keeps)."""
        return self.tokenizer.batch_decode(completions, skip_special_tokens=True)

    def _generation_metrics(self, record: StepRecord, select_metrics: dict) -> dict[str, float]:
        generated = record.generated
        rewards = torch.cat([b.rewards for b in generated])
        lengths = torch.cat([b.completion_lengths() for b in generated]).float()
        zero_std = torch.cat([zero_variance_groups(b.rewards, b.group_index, b.num_groups) for b in generated])
        group_std = torch.cat([group_stats(b.rewards, b.group_index, b.num_groups).std for b in generated])
        metrics = {
            "reward": float(rewards.mean()),
            "reward_std": float(group_std.mean()),
            "frac_reward_zero_std": float(zero_std.float().mean()),
            "completions/mean_length": float(lengths.mean()),
            "completions/clipped_ratio": float(torch.cat([b.truncated for b in generated]).float().mean()),
            "correct": float(torch.cat([b.correct for b in generated]).float().mean()),
        }
        for parts in (record.reward_metrics, record.collect_metrics):
            for part in parts:
                for k, v in part.items():
                    metrics[k] = metrics.get(k, 0.0) + v / len(parts)
        if record.episodes.episodes:
            metrics.update(record.episodes.metrics())
        metrics.update(select_metrics)
        return metrics
