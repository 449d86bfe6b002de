"""KV-cache continuation of episodes in the fast engine: between turns, each episode's keys and values stay on the
device, and its next turn prefills only the tokens its cache lacks.

What a row's cache holds after a turn is its context and the turn's tokens but the last (a sampled token never runs
through the model until the next turn). The session keeps, per episode, those tokens and their keys and values; on
the next turn it matches them against the episode's new context (the runner may cut a turn short, or append an
environment's answer), hands the engine the longest cached prefix, and the engine prefills the rest on top of it
(fast.py `_prefill`). A context that shares nothing with the cache is prefilled whole, so a session is always
correct, only more or less fast; a row's tokens still depend only on (weights, context, seed).

Memory: between turns the session holds each live episode's keys and values (the context a re-prefill would
recompute), on the model's device; during a turn, also the new caches of the rows that finished. `close` (the runner,
at the end of its episodes) and the engine's `release` (the trainer: after an eval, before an update the plan keeps no
state through) free them.
"""

from __future__ import annotations

from collections.abc import Hashable
from typing import TYPE_CHECKING

import torch

from podsrl.engines.base import EpisodeSession, GenerationOutput, SamplingParams

if TYPE_CHECKING:
    from podsrl.engines.fast import FastEngine


class CachedSession(EpisodeSession):
    """The fast engine's episode session (see the module docstring)."""

    continues = True

    def __init__(self, engine: FastEngine) -> None:
        super().__init__(engine)
        # episode -> (the tokens in its cache, their keys and values [layers, 2, kv_heads, tokens, d])
        self.cached: dict[Hashable, tuple[list[int], torch.Tensor]] = {}

    def generate(self, keys: list, contexts: list[list[int]], params: SamplingParams,
                 seeds: torch.Tensor) -> GenerationOutput:
        prefixes = [self._prefix(key, context) for key, context in zip(keys, contexts)]
        self.cached = {}  # the prefixes hold what the call reads; an episode not asked for has ended
        out, kept = self.engine.generate_keeping(contexts, params, seeds, prefixes)
        del prefixes
        for row, (key, context, kv) in enumerate(zip(keys, contexts, kept)):
            if kv is not None:
                n = int(out.completion_mask[row].sum())
                tokens = (context + out.completion_ids[row, :n].tolist())[: kv.shape[3]]
                self.cached[key] = (tokens, kv)
        return out

    def _prefix(self, key: Hashable, context: list[int]) -> torch.Tensor | None:
        """The keys and values of the longest cached prefix of `context`, short of its last token (whose logits
        the prefill must give); None when nothing is cached."""
        tokens, kv = self.cached.get(key, ([], None))
        if kv is None:
            return None
        same = 0
        for cached, token in zip(tokens, context[:-1]):
            if cached != token:
                break
            same += 1
        return kv[:, :, :, :same] if same else None

    def close(self) -> None:
        self.cached = {}
