"""The engine interface. The trainer only ever talks to this, so the in-process sampler, a Ray actor pool and vLLM
are interchangeable.

Contract of `generate`:
- `prompts[i]` is a list of token ids (no padding); prompt i gets `counts[i]` rollouts; rows come out grouped by
  prompt in order (prompt 0's rollouts first), and `group_index[r]` names the prompt of row r.
- `seeds[r]` seeds row r's sampling. Engines that support per-row seeds (the fast sampler) make a row's completion
  depend only on (weights, prompt, seed, params): independent of batch composition, sharding or compaction.
- Completions are right-padded with `pad_token_id`; `completion_mask` is 1 on every generated token up to and
  including the first stop token; generation of a row ends at a stop token or `max_new_tokens`.
- `logprobs[r, t]` (when returned) is log_softmax(logits / temperature)[token] of the sampled token, i.e. the
  log-prob under the temperature-scaled policy *before* top-p/top-k truncation: exactly what the trainer's forward
  pass computes, so it can serve as the old log-probs of the PPO ratio.
- `session()` serves episodes turn by turn (`EpisodeSession`): by default each turn is a `generate` over the whole
  contexts; the fast engine's continues each episode's KV cache instead, with the same outputs, and so do the Ray
  pool's and torchrun's sharded engine's over it (each episode stays where its cache is).
- `sync_weights(model)` is called after every optimiser update with the trainer's policy; engines that hold their
  own copy (Ray actors, vLLM) must load the new weights before the next `generate`.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass

import torch

from podsrl.planning.workload import EngineMemory


@dataclass(frozen=True)
class SamplingParams:
    max_new_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 = off
    greedy: bool = False  # argmax decoding (evaluation); ignores temperature/top-p/top-k for the choice
    stop_token_ids: tuple[int, ...] = ()  # in addition to the engine's EOS ids (rows.special_ids)
    return_logprobs: bool = True


@dataclass
class GenerationOutput:
    group_index: torch.Tensor  # [R] long
    prompt_ids: torch.Tensor  # [R, Lp] long, left-padded
    prompt_mask: torch.Tensor  # [R, Lp] long
    completion_ids: torch.Tensor  # [R, Lc] long, right-padded
    completion_mask: torch.Tensor  # [R, Lc] float
    truncated: torch.Tensor  # [R] bool
    logprobs: torch.Tensor | None  # [R, Lc] float or None


class RolloutEngine(ABC):
    """Samples completions from the current policy."""

    name: str = "base"
    # why this engine runs another one's path instead of its own (None: it runs its own); recorded in the summary
    fallback_reason: str | None = None
    # whether it keeps device state between calls (a KV cache, captured CUDA graphs) that stays valid through an
    # update; the trainer then skips `release` before the update where the memory plan counts that state
    keeps_state_across_updates: bool = False

    # Traits: what the loop, the config checks and the memory planner read about an engine, instead of its name
    # (the device memory it holds: `device_memory`).
    # may sample in train.async's generator thread while the learner updates (else `no_async_reason` says why not)
    may_run_async: bool = False
    no_async_reason: str = "it cannot sample beside the learner"
    # samples with kernels of its own, not the update's forward: its log-probs differ beyond rounding (TRL's case
    # for importance sampling, algo.rollout_correction's "engine" mismatch)
    own_kernels: bool = False
    # the option through which it samples from a copy of the weights in model.compute_dtype (None: it samples the
    # weights it is given); build.py fills it in, and train.async's generator copy is made in that dtype
    compute_dtype_option: str | None = None
    # where the unsharded copy of the policy it samples from lives under FSDP (None: the run's device)
    generation_device: str | None = None
    # its option bounding the rows decoded at once, which the memory planner counts (None: no such option)
    rows_option: str | None = None
    # samples in this process; False: in worker processes that are sent the weights pickled (so no views of one
    # shared tensor, and no torch threads of this process for the generator)
    in_process: bool = True

    @classmethod
    def keeps_decode_state(cls, options: dict, device: str) -> bool:
        """Whether an engine of these options on this device keeps a decode state between calls (what
        keeps_state_across_updates says of a built one), for the planner to count before anything is built."""
        return False

    @classmethod
    def device_memory(cls, options: dict) -> EngineMemory:
        """What an engine of these options holds on the device to sample, which the memory plan prices (the plan of
        `podsrl plan --memory`, optim.micro_batch_size=auto, the decode state kept through the update): by default
        the fast engine's at its defaults, a KV cache of its rows in flight and the decode stack's fused weights."""
        return EngineMemory()

    @classmethod
    def local_worker_cores(cls, options: dict) -> int:
        """Cores its worker processes on this machine take (the trainer's torch threads leave them free); 0: it
        samples in this process, or on other machines."""
        return 0

    @classmethod
    def worker_engine(cls, options: dict) -> tuple[str, dict, str] | None:
        """(name, options, the option key they sit under) of the engine this one runs in its workers, which is
        also the one that evaluates in process during train.async; None: it samples itself."""
        return None

    @property
    def sampler(self) -> str:
        """The name of the engine whose code really samples: this one, or the one it fell back to."""
        return self.name

    @abstractmethod
    def generate(
        self,
        prompts: list[list[int]],
        counts: list[int],
        params: SamplingParams,
        seeds: torch.Tensor,
    ) -> GenerationOutput: ...

    def session(self) -> EpisodeSession:
        """Generation over the turns of episodes (see `EpisodeSession`): this one re-prefills each whole context."""
        return EpisodeSession(self)

    def sync_weights(self, model: torch.nn.Module) -> None:  # noqa: B027 (optional hook)
        """Called after each update. In-process engines share the trainer's module, so nothing to do."""

    def plan_rows(self, rows: int) -> None:  # noqa: B027 (optional hook)
        """The most rows the run's memory plan counted in flight beside the update (where the trainer keeps the
        decode state through it): an engine that sizes its waves by the device's free memory decodes no more."""

    def release(self) -> None:  # noqa: B027 (optional hook)
        """Frees what the engine keeps on the device between calls (the trainer calls it before the update, unless
        keeps_state_across_updates and the memory plan fits that state beside the update)."""

    def close(self) -> None:  # noqa: B027 (optional hook)
        """Release workers, processes, GPU memory."""


class EpisodeSession:
    """Generation over the turns of episodes: `generate(keys, contexts, params, seeds)` samples one row per context,
    `keys[i]` naming context i's episode across calls (an episode not in a call has ended). This one re-prefills each
    whole context through `engine.generate`; an engine that keeps each episode's KV cache between turns returns its
    own from `RolloutEngine.session` (`continues`), whose turns prefill only the tokens the cache lacks. `close`
    frees what the session keeps; it is a context manager."""

    continues = False

    def __init__(self, engine: RolloutEngine) -> None:
        self.engine = engine

    def generate(self, keys: list, contexts: list[list[int]], params: SamplingParams,
                 seeds: torch.Tensor) -> GenerationOutput:
        return self.engine.generate(contexts, [1] * len(contexts), params, seeds)

    def close(self) -> None:  # noqa: B027 (optional hook)
        """Frees what the session keeps between turns (nothing here)."""

    def __enter__(self) -> EpisodeSession:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def left_pad(prompts: list[list[int]], pad_token_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """[N, L] ids and mask for token lists, padded on the left (decoder-only generation convention)."""
    width = max((len(p) for p in prompts), default=0)
    ids = torch.full((len(prompts), width), pad_token_id, dtype=torch.long)
    mask = torch.zeros((len(prompts), width), dtype=torch.long)
    for i, p in enumerate(prompts):
        if p:
            ids[i, width - len(p) :] = torch.tensor(p, dtype=torch.long)
            mask[i, width - len(p) :] = 1
    return ids, mask
