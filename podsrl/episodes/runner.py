"""The episode runner: all episodes of a generate call advance together, turn by turn.

Each turn is one generate call of the engine's episode session (`engine.session()`) over the live episodes, each
row's context being its whole episode so far (prompt, model turns, environment messages). The fast engine's session
(also in the Ray pool's actors and on each torchrun rank) keeps each episode's KV cache between turns and prefills
only what it lacks (the environment's tokens, the turn's last token); other engines' sessions re-prefill the whole
context; the runner is the same for both. A turn runs on to the model's end of turn (EOS, or a stop token of the
tool-call format, podsrl/episodes/formats.py), so it may hold several calls, at rollout.max_new_tokens, or where the
episode's budget runs out (episode.max_tokens, or the model's context). Then the environments step, all at once on
the call pool (podsrl/episodes/calls.py: each `reset` and `step` under episode.env_timeout_s and the episode's
remaining episode.timeout_s; their tool calls under episode.tool_timeout_s), and an episode goes on with the
environment's messages (each cut to episode.max_response_chars characters, then rendered) appended, until its
environment says it is done, its turns, tokens or context run out, or its environment fails: a raising or expired
`reset` or `step` ends that episode, counted, with one warning per call and kind; one returning another shape stops
the run naming it. A stop requested of the process (SIGTERM/SIGINT) abandons the episodes in flight (`Interrupted`).

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
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING

import torch

from podsrl.batch import Problem
from podsrl.engines.base import EpisodeSession, GenerationOutput, RolloutEngine, SamplingParams, left_pad
from podsrl.engines.sampling import splitmix64
from podsrl.episodes.calls import CALLS, STOP, Call, Interrupted, Outcome
from podsrl.episodes.environment import Environment, checked_reset, checked_step
from podsrl.episodes.formats import format_for
from podsrl.episodes.render import EpisodeRenderer
from podsrl.episodes.stats import EpisodeStats
from podsrl.episodes.tools import ResponseLimit
from podsrl.errors import UserError

if TYPE_CHECKING:
    from podsrl.config import EpisodeConfig

log = logging.getLogger("podsrl")

MAX_STEP_THREADS = 32  # environments stepping at once; tool calls wait on I/O or on their deadline, not the CPU


def turn_seeds(seeds: torch.Tensor, turn: int) -> torch.Tensor:
    """[R] seeds of turn `turn` of the rows seeded `seeds` (non-negative, like the producer's)."""
    return splitmix64(splitmix64(seeds.long()) + turn) & ((1 << 62) - 1)


@dataclass
class _Episode:
    env: Environment
    renderer: EpisodeRenderer
    prompt: list[int] = field(default_factory=list)
    tokens: list[int] = field(default_factory=list)  # the completion so far: model and environment tokens
    generated: list[float] = field(default_factory=list)  # 1.0 where the model generated the token
    logprobs: list[float] = field(default_factory=list)  # the sampler's, 0.0 on environment tokens
    turns: int = 0
    stop_token: int | None = None  # the stop token its last turn ended at, if any
    ending: str | None = None  # one of stats.ENDINGS once over
    truncated: bool = False  # its last turn, or its budget, cut the model off
    env_seconds: float = 0.0  # spent in its environment's reset and steps (episode.timeout_s bounds it)
    cut_responses: int = 0  # environment messages cut to episode.max_response_chars
    turn_of: list[int] = field(default_factory=list)  # each token's turn (an environment message: the turn before)
    turn_rewards: list[float] = field(default_factory=list)  # the reward each step gave its turn (0.0 for none)

    @property
    def label(self) -> str:
        """The environment's name in messages: its class (an adapter's `environment_name`: the user's class)."""
        return getattr(self.env, "environment_name", type(self.env).__name__)

    def append(self, ids: list[int], generated: bool, logprobs: list[float] | None = None) -> None:
        self.tokens += ids
        self.turn_of += [max(self.turns - (0 if generated else 1), 0)] * len(ids)
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
    turn_index: torch.Tensor | None = None  # [R, Lc] long: the turn of each completion token (episodes/credit.py)
    turn_rewards: torch.Tensor | None = None  # [R, T] float: each turn's reward from its step (0.0 where none)


class EpisodeRunner:
    """`context`: the model's context in tokens (None: unbounded), which no episode's prompt and completion pass."""

    def __init__(self, engine: RolloutEngine, tokenizer, task, cfg: EpisodeConfig, context: int | None = None) -> None:
        self.engine, self.tokenizer, self.task, self.cfg, self.context = engine, tokenizer, task, cfg, context
        self.tool_format = format_for(tokenizer, cfg.tool_format)
        vocab = tokenizer.get_vocab()
        self.stop_ids = tuple(vocab[t] for t in self.tool_format.stop_tokens if t in vocab)
        self.response_limit = ResponseLimit(cfg.max_response_chars, cfg.response_truncate_side)
        CALLS.max_hung = cfg.max_hung_calls

    def run(self, problems: list[Problem], counts: list[int], params: SamplingParams, seeds: torch.Tensor,
            stop: GroupStop | None = None, after_turn: Callable[[], None] | None = None) -> EpisodeOutput:
        """counts[j] episodes of problems[j]; `seeds[r]` seeds row r's episode; `stop`: score episodes as they
        finish and stop the live ones of decided groups. `after_turn` is called once each turn's environments have
        stepped (the producer's fault-injection site)."""
        episodes = []
        for count in counts:
            for _ in range(count):
                env = self.task.environment(self.cfg.tool_timeout_s)
                if callable(getattr(env, "configure", None)):  # a ToolEnvironment, or an adapter passing it on
                    env.configure(self.tool_format, self.cfg.max_parallel_calls, self.response_limit)
                episodes.append(_Episode(env, EpisodeRenderer(self.tokenizer, env.tools)))
        self._reset(episodes, [p for p, count in zip(problems, counts) for _ in range(count)])
        params = replace(params, stop_token_ids=tuple(params.stop_token_ids) + self.stop_ids)
        rewards: dict[int, float] = {}  # row -> reward of a finished episode (with a GroupStop)
        with self.engine.session() as session:  # what it keeps is freed here, before the update
            for turn in range(self.cfg.max_turns):
                live = [i for i, e in enumerate(episodes) if e.ending is None]
                if not live:
                    break
                if STOP.is_set():
                    raise Interrupted("stop requested between turns")
                texts = self._generate_turn(session, live, [episodes[i] for i in live], params, seeds[live], turn)
                stepping = [(i, text) for i, text in zip(live, texts) if episodes[i].ending is None]
                self._step([episodes[i] for i, _ in stepping], [text for _, text in stepping])
                if stop is not None:
                    self._stop_decided(episodes, counts, stop, rewards)
                if after_turn is not None:
                    after_turn()
        CALLS.end_children()  # what these episodes' calls started dies with them
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

    def _budget(self, episode: _Episode) -> tuple[int, str]:
        """Tokens the episode may still take, and the ending it meets there: "tokens" (episode.max_tokens) or
        "context" (the model's)."""
        room = self.cfg.max_tokens - len(episode.tokens)
        if self.context is None:
            return room, "tokens"
        context_room = self.context - len(episode.prompt) - len(episode.tokens)
        return (context_room, "context") if context_room < room else (room, "tokens")

    def _generate_turn(self, session: EpisodeSession, keys: list[int], live: list[_Episode], params: SamplingParams,
                       seeds: torch.Tensor, turn: int) -> list[str]:
        """One model turn of each live episode (`keys`: their indices); returns the turns' texts (an episode out of
        tokens or context ends here)."""
        budgets = [self._budget(e)[0] for e in live]
        turn_params = replace(params, max_new_tokens=min(params.max_new_tokens, max(budgets)))
        out = session.generate(keys, [e.prompt + e.tokens for e in live], turn_params, turn_seeds(seeds, turn))
        texts = []
        for row, (episode, budget) in enumerate(zip(live, budgets)):
            n = int(out.completion_mask[row].sum())
            ids = out.completion_ids[row, :n].tolist()
            through = n if episode.renderer.templated else self._through_calls(ids)
            keep = min(through, budget)
            logprobs = out.logprobs[row, :keep].tolist() if out.logprobs is not None else None
            episode.append(ids[:keep], True, logprobs)
            episode.turns += 1
            whole = keep == n  # nothing cut: the turn ended where the engine stopped it
            episode.truncated = keep < through or (whole and bool(out.truncated[row]))
            episode.stop_token = ids[-1] if whole and n and not bool(out.truncated[row]) else None
            room, limit = self._budget(episode)
            if room <= 0:
                episode.ending = limit
            texts.append(self.tokenizer.decode(ids[:keep], skip_special_tokens=True))
        return texts

    def _through_calls(self, ids: list[int]) -> int:
        """Without a chat template (the built-in model): how many of a turn's tokens to keep, through the end of its
        last tool call (its end of turn and anything after the calls dropped, so the context reads call then
        response, as the warm-up's reference episodes do), or all of them."""
        def calls_end(k: int) -> int:
            return self.tool_format.calls_end(self.tokenizer.decode(ids[:k], skip_special_tokens=False))

        end = calls_end(len(ids))
        if not end:
            return len(ids)
        lo, hi = 1, len(ids)  # the shortest prefix holding every call (a longer prefix never loses one)
        while lo < hi:
            mid = (lo + hi) // 2
            lo, hi = (lo, mid) if calls_end(mid) >= end else (mid + 1, hi)
        return lo

    def _reset(self, episodes: list[_Episode], problems: list[Problem]) -> None:
        """Each environment's first messages, rendered as its episode's prompt. An environment that fails or runs
        past its limit ends its episode at once, on the problem's own prompt."""
        outcomes = self._environment_calls("reset", episodes, problems)
        for episode, problem, outcome in zip(episodes, problems, outcomes):
            messages = [{"role": "user", "content": problem.prompt}]
            if episode.ending is None:
                messages = checked_reset(f"{episode.label}.reset", outcome.value)
            episode.prompt = episode.renderer.prompt(messages)
            if episode.ending is None and self._budget(episode)[0] <= 0:
                episode.ending = "context"

    def _step(self, episodes: list[_Episode], texts: list[str]) -> None:
        """Step the environments concurrently, then end each episode or append what its environment answered."""
        for episode, outcome in zip(episodes, self._environment_calls("step", episodes, texts)):
            if episode.ending is not None:  # its step failed or expired
                continue
            messages, done, turn_reward = checked_step(f"{episode.label}.step", outcome.value)
            episode.turn_rewards += [0.0] * (episode.turns - 1 - len(episode.turn_rewards))
            episode.turn_rewards.append(0.0 if turn_reward is None else turn_reward)
            if done:
                episode.ending = "answer"
            elif episode.turns >= self.cfg.max_turns:  # no turn left to read the answer: it is not appended
                episode.ending = "turns"
            else:
                ids = episode.renderer.continuation(self._cut(episode, messages), episode.stop_token)
                room, limit = self._budget(episode)
                episode.append(ids[:room], False)
                if len(ids) >= room:
                    episode.ending, episode.truncated = limit, True

    def _cut(self, episode: _Episode, messages: list[dict]) -> list[dict]:
        """The messages with each content cut to episode.max_response_chars characters (counted), before they are
        rendered and tokenized."""
        out = []
        for message in messages:
            content, cut = self.response_limit.cut(message["content"])
            episode.cut_responses += cut
            out.append({**message, "content": content} if cut else message)
        return out

    def _environment_calls(self, method: str, episodes: list[_Episode], args: list) -> list[Outcome]:
        """`method` of each episode's environment on its argument, concurrently, each under episode.env_timeout_s
        and what is left of the episode's episode.timeout_s. An episode whose call fails or expires ends there
        ("environment_fault", "timeout"), with one warning per call and kind; podsrl's own errors (a shape, too many
        hung calls) and a requested stop are raised."""
        calls = [Call(f"{e.label}.{method}", getattr(e.env, method), (arg,),
                      limit_s=max(0.0, min(self.cfg.env_timeout_s, self.cfg.timeout_s - e.env_seconds)))
                 for e, arg in zip(episodes, args)]
        outcomes = CALLS.run(calls, MAX_STEP_THREADS)
        failed: dict[tuple[str, str], list[Outcome]] = defaultdict(list)
        for episode, call, outcome in zip(episodes, calls, outcomes):
            episode.env_seconds += outcome.seconds
            if outcome.error is not None and isinstance(outcome.error, (UserError, Interrupted)):
                raise outcome.error
            if outcome.timed_out or outcome.error is not None:
                episode.ending = "timeout" if outcome.timed_out else "environment_fault"
                failed[call.label, episode.ending].append(outcome)
        for (label, ending), faults in failed.items():
            if ending == "timeout":
                log.warning("episode: %s ran past its time limit (episode.env_timeout_s=%g s a call, "
                            "episode.timeout_s=%g s an episode) in %d of %d episodes; they end there "
                            "(episode/ended_by_timeout)", label, self.cfg.env_timeout_s, self.cfg.timeout_s,
                            len(faults), len(episodes))
            else:
                error = faults[0].error
                log.warning("episode: %s raised %s: %s in %d of %d episodes; they end there "
                            "(episode/ended_by_environment_fault)", label, type(error).__name__, str(error)[:200],
                            len(faults), len(episodes))
        return outcomes

    def _output(self, episodes: list[_Episode], counts: list[int], return_logprobs: bool) -> EpisodeOutput:
        pad = self.tokenizer.pad_token_id
        prompt_ids, prompt_mask = left_pad([e.prompt for e in episodes], pad)
        width = max((len(e.tokens) for e in episodes), default=0)

        def right(values: list, fill, dtype) -> torch.Tensor:
            return torch.tensor([v + [fill] * (width - len(v)) for v in values], dtype=dtype).reshape(len(values),
                                                                                                      width)

        stats = EpisodeStats(episodes=len(episodes), turns=sum(e.turns for e in episodes))
        for e in episodes:
            stats.endings[e.ending] += 1
            stats.truncated_responses += e.cut_responses
            for result in getattr(e.env, "tool_results", []):  # none where its reset never ran
                stats.tool_calls[result.name] += 1
                stats.tool_faults[result.name] += int(result.fault)
                stats.truncated_responses += int(getattr(result, "truncated", False))
        generation = GenerationOutput(
            group_index=torch.repeat_interleave(torch.arange(len(counts)), torch.tensor(counts, dtype=torch.long)),
            prompt_ids=prompt_ids, prompt_mask=prompt_mask,
            completion_ids=right([e.tokens for e in episodes], pad, torch.long),
            completion_mask=right([[1.0] * len(e.tokens) for e in episodes], 0.0, torch.float32),
            truncated=torch.tensor([e.truncated for e in episodes], dtype=torch.bool),
            logprobs=right([e.logprobs for e in episodes], 0.0, torch.float32) if return_logprobs else None,
        )
        turns = max((e.turns for e in episodes), default=0)
        turn_rewards = torch.tensor([e.turn_rewards + [0.0] * (turns - len(e.turn_rewards)) for e in episodes],
                                    dtype=torch.float32).reshape(len(episodes), turns)
        return EpisodeOutput(generation, right([e.generated for e in episodes], 0.0, torch.float32), stats,
                             [e.env for e in episodes],
                             torch.tensor([e.ending == "stopped" for e in episodes], dtype=torch.bool),
                             right([e.turn_of for e in episodes], 0, torch.long), turn_rewards)


def task_episodes(engine: RolloutEngine, tokenizer, task, cfg: EpisodeConfig,
                  context: int | None = None) -> EpisodeRunner | None:
    """The runner of `task`'s episodes on `engine` (a model of `context` tokens), or None where the task is
    single-turn (no environment)."""
    return EpisodeRunner(engine, tokenizer, task, cfg, context) if task.has_environment() else None
