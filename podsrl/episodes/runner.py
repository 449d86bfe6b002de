"""The episode runner: all episodes of a generate call advance together, turn by turn.

Each turn is one generate call of the engine's episode session (`engine.session()`) over the live episodes, each
row's context being its whole episode so far (prompt, model turns, environment messages). The fast engine's session
(also in the Ray pool's actors and on each torchrun rank) keeps each episode's KV cache between turns and prefills
only what it lacks (the environment's tokens, the turn's last token); other engines' sessions re-prefill the whole
context; the runner is the same for both. A turn stops at EOS, at the end of the model's first
tool call, at rollout.max_new_tokens, or where the episode's token budget runs out. Then the environments step, all
at once on a thread pool (their tool calls run there, each against episode.tool_timeout_s), and an episode goes on
with the environment's messages appended, until its environment says it is done, its turns or tokens run out, or
its environment fails (a raising `step` ends that episode, counted).

With an early stop (`GroupStop`, from a method's `episode_stop_rule`), the episodes that end in a turn are scored
then, through the caller's reward path (each once), and the method's rule is asked of every group with episodes
still live, given its finished episodes' rewards; a decided group's live episodes end there ("stopped"), before
their next turn, so their remaining tokens are never generated. Without one, episodes are scored by the caller
after the run, as single-turn rollouts are.

A row's seed for turn t derives from its own seed and t alone, so an episode depends on (weights, problem, seed),
not on which other episodes share its calls. The episode's completion is everything after the prompt; its loss mask
is 1 on the model's tokens only, and its sampler log-probs are 0 on the environment's.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field, replace

import torch

from podsrl.batch import Problem
from podsrl.config import EpisodeConfig
from podsrl.engines.base import EpisodeSession, GenerationOutput, RolloutEngine, SamplingParams, left_pad
from podsrl.engines.sampling import splitmix64
from podsrl.episodes.environment import Environment
from podsrl.episodes.render import EpisodeRenderer
from podsrl.episodes.stats import EpisodeStats
from podsrl.episodes.tools import CALL_END

log = logging.getLogger("podsrl")

MAX_STEP_THREADS = 32  # environments stepping at once; tool calls wait on I/O or on their deadline, not the CPU


def turn_seeds(seeds: torch.Tensor, turn: int) -> torch.Tensor:
    """[R] seeds of turn `turn` of the rows seeded `seeds` (non-negative, like the producer's)."""
    return splitmix64(splitmix64(seeds.long()) + turn) & ((1 << 62) - 1)


@dataclass
class _Episode:
    env: Environment
    renderer: EpisodeRenderer
    prompt: list[int]
    tokens: list[int] = field(default_factory=list)  # the completion so far: model and environment tokens
    generated: list[float] = field(default_factory=list)  # 1.0 where the model generated the token
    logprobs: list[float] = field(default_factory=list)  # the sampler's, 0.0 on environment tokens
    turns: int = 0
    stop_token: int | None = None  # the stop token its last turn ended at, if any
    ending: str | None = None  # one of stats.ENDINGS once over
    truncated: bool = False  # its last turn, or its budget, cut the model off

    def append(self, ids: list[int], generated: bool, logprobs: list[float] | None = None) -> None:
        self.tokens += ids
        self.generated += [float(generated)] * len(ids)
        self.logprobs += logprobs if logprobs is not None else [0.0] * len(ids)


@dataclass
class GroupStop:
    """Stopping a group's live episodes between turns. `score(rows, groups, tokens, environments)` rewards the
    episodes just finished ([len(rows)] rewards; the caller keeps the full result, so no episode is scored twice):
    their row indices, problem indices, completion tokens and environments. `decided(rewards, live)` is the
    method's rule: whether no episode still live (`live` of them) can change what the group trains, given the
    rewards of its finished episodes."""

    score: Callable[[list[int], list[int], list[list[int]], list[Environment]], torch.Tensor]
    decided: Callable[[torch.Tensor, int], bool]


@dataclass
class EpisodeOutput:
    generation: GenerationOutput  # rows grouped by problem, as `engine.generate` gives them
    loss_mask: torch.Tensor  # [R, Lc] float, 1 on the model's tokens
    stats: EpisodeStats
    environments: list[Environment]  # row r's episode's environment (its reward, for an environment that has one)
    stopped: torch.Tensor  # [R] bool: stopped by a GroupStop before its end (unscored, not to be trained)


class EpisodeRunner:
    def __init__(self, engine: RolloutEngine, tokenizer, task, cfg: EpisodeConfig) -> None:
        self.engine, self.tokenizer, self.task, self.cfg = engine, tokenizer, task, cfg
        # where the end of a tool call is one token (Qwen2.5's </tool_call>), the engine stops there itself
        call_end = tokenizer.get_vocab().get(CALL_END)
        self.call_end_ids = () if call_end is None else (call_end,)

    def run(self, problems: list[Problem], counts: list[int], params: SamplingParams, seeds: torch.Tensor,
            stop: GroupStop | None = None, after_turn: Callable[[], None] | None = None) -> EpisodeOutput:
        """counts[j] episodes of problems[j]; `seeds[r]` seeds row r's episode; `stop`: score episodes as they
        finish and stop the live ones of decided groups. `after_turn` is called once each turn's environments have
        stepped (the producer's fault-injection site)."""
        episodes = []
        for problem, count in zip(problems, counts):
            for _ in range(count):
                env = self.task.environment(self.cfg.tool_timeout_s)
                renderer = EpisodeRenderer(self.tokenizer, env.tools)
                episodes.append(_Episode(env, renderer, renderer.prompt(env.reset(problem))))
        params = replace(params, stop_token_ids=tuple(params.stop_token_ids) + self.call_end_ids)
        rewards: dict[int, float] = {}  # row -> reward of a finished episode (with a GroupStop)
        with self.engine.session() as session:  # what it keeps is freed here, before the update
            for turn in range(self.cfg.max_turns):
                live = [i for i, e in enumerate(episodes) if e.ending is None]
                if not live:
                    break
                texts = self._generate_turn(session, live, [episodes[i] for i in live], params, seeds[live], turn)
                stepping = [(i, text) for i, text in zip(live, texts) if episodes[i].ending is None]
                self._step([episodes[i] for i, _ in stepping], [text for _, text in stepping])
                if stop is not None:
                    self._stop_decided(episodes, counts, stop, rewards)
                if after_turn is not None:
                    after_turn()
        return self._output(episodes, counts, params.return_logprobs)

    @staticmethod
    def _stop_decided(episodes: list[_Episode], counts: list[int], stop: GroupStop, rewards: dict[int, float]) -> None:
        """Score the episodes that ended this turn, then stop the live episodes of every group the rule decides."""
        groups = [j for j, count in enumerate(counts) for _ in range(count)]
        finished = [i for i, e in enumerate(episodes) if e.ending is not None and e.ending != "stopped"
                    and i not in rewards]
        if finished:
            values = stop.score(finished, [groups[i] for i in finished], [episodes[i].tokens for i in finished],
                                [episodes[i].env for i in finished])
            rewards.update(zip(finished, values.tolist()))
        start = 0
        for count in counts:
            rows = range(start, start + count)
            start += count
            live = [i for i in rows if episodes[i].ending is None]
            if live and stop.decided(torch.tensor([rewards[i] for i in rows if i in rewards]), len(live)):
                for i in live:
                    episodes[i].ending = "stopped"

    def _generate_turn(self, session: EpisodeSession, keys: list[int], live: list[_Episode], params: SamplingParams,
                       seeds: torch.Tensor, turn: int) -> list[str]:
        """One model turn of each live episode (`keys`: their indices); returns the turns' texts (an episode out of
        tokens ends here)."""
        budgets = [self.cfg.max_tokens - len(e.tokens) for e in live]
        turn_params = replace(params, max_new_tokens=min(params.max_new_tokens, max(budgets)))
        out = session.generate(keys, [e.prompt + e.tokens for e in live], turn_params, turn_seeds(seeds, turn))
        texts = []
        for row, (episode, budget) in enumerate(zip(live, budgets)):
            n = int(out.completion_mask[row].sum())
            ids = out.completion_ids[row, :n].tolist()
            through = self._through_first_call(ids)
            keep = min(through, budget)
            logprobs = out.logprobs[row, :keep].tolist() if out.logprobs is not None else None
            episode.append(ids[:keep], True, logprobs)
            episode.turns += 1
            whole = keep == n  # nothing cut: the turn ended where the engine stopped it
            episode.truncated = keep < through or (whole and bool(out.truncated[row]))
            episode.stop_token = ids[-1] if whole and n and not bool(out.truncated[row]) else None
            if len(episode.tokens) >= self.cfg.max_tokens:
                episode.ending = "tokens"
            texts.append(self.tokenizer.decode(ids[:keep], skip_special_tokens=True))
        return texts

    def _through_first_call(self, ids: list[int]) -> int:
        """How many of a turn's tokens to keep: through the end of its first tool call, or all of them."""
        def holds_end(k: int) -> bool:
            return CALL_END in self.tokenizer.decode(ids[:k], skip_special_tokens=False)

        if not holds_end(len(ids)):
            return len(ids)
        lo, hi = 1, len(ids)  # the shortest prefix holding the end (a longer prefix never loses it)
        while lo < hi:
            mid = (lo + hi) // 2
            lo, hi = (lo, mid) if holds_end(mid) else (mid + 1, hi)
        return lo

    def _step(self, episodes: list[_Episode], texts: list[str]) -> None:
        """Step the environments concurrently, then end each episode or append what its environment answered."""
        if not episodes:
            return
        with ThreadPoolExecutor(max_workers=min(MAX_STEP_THREADS, len(episodes))) as pool:
            futures = [pool.submit(e.env.step, text) for e, text in zip(episodes, texts)]
        for episode, future in zip(episodes, futures):
            try:
                messages, done = future.result()
            except Exception as e:  # the environment's own failure ends its episode, not the run
                log.warning("episode: the environment's step raised %s: %s; the episode ends there",
                            type(e).__name__, e)
                episode.ending = "environment_fault"
                continue
            if done:
                episode.ending = "answer"
            elif episode.turns >= self.cfg.max_turns:  # no turn left to read the answer: it is not appended
                episode.ending = "turns"
            else:
                ids = episode.renderer.continuation(messages, episode.stop_token)
                budget = self.cfg.max_tokens - len(episode.tokens)
                episode.append(ids[:budget], False)
                if len(ids) >= budget:
                    episode.ending, episode.truncated = "tokens", True

    def _output(self, episodes: list[_Episode], counts: list[int], return_logprobs: bool) -> EpisodeOutput:
        pad = self.tokenizer.pad_token_id
        prompt_ids, prompt_mask = left_pad([e.prompt for e in episodes], pad)
        width = max((len(e.tokens) for e in episodes), default=0)

        def right(values: list, fill, dtype) -> torch.Tensor:
            return torch.tensor([v + [fill] * (width - len(v)) for v in values], dtype=dtype).reshape(-1, width)

        stats = EpisodeStats(episodes=len(episodes), turns=sum(e.turns for e in episodes))
        for e in episodes:
            stats.endings[e.ending] += 1
            for result in e.env.tool_results:
                stats.tool_calls[result.name] += 1
                stats.tool_faults[result.name] += int(result.fault)
        generation = GenerationOutput(
            group_index=torch.repeat_interleave(torch.arange(len(counts)), torch.tensor(counts, dtype=torch.long)),
            prompt_ids=prompt_ids, prompt_mask=prompt_mask,
            completion_ids=right([e.tokens for e in episodes], pad, torch.long),
            completion_mask=right([[1.0] * len(e.tokens) for e in episodes], 0.0, torch.float32),
            truncated=torch.tensor([e.truncated for e in episodes], dtype=torch.bool),
            logprobs=right([e.logprobs for e in episodes], 0.0, torch.float32) if return_logprobs else None,
        )
        return EpisodeOutput(generation, right([e.generated for e in episodes], 0.0, torch.float32), stats,
                             [e.env for e in episodes],
                             torch.tensor([e.ending == "stopped" for e in episodes], dtype=torch.bool))


def task_episodes(engine: RolloutEngine, tokenizer, task, cfg: EpisodeConfig) -> EpisodeRunner | None:
    """The runner of `task`'s episodes on `engine`, or None where the task is single-turn (no environment)."""
    return EpisodeRunner(engine, tokenizer, task, cfg) if task.has_environment() else None
