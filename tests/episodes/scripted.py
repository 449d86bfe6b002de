"""A scripted engine for episode tests: each row's turn is a text chosen by a script from the row's context and
seed, tokenized by the built-in char-level tokenizer, stopped as a real engine stops it."""

from __future__ import annotations

from collections.abc import Callable

import torch

from podsrl.engines.base import GenerationOutput, RolloutEngine, SamplingParams
from podsrl.engines.rows import completion_mask, row_prompts
from podsrl.models.loading import build_char_tokenizer

TOKENIZER = build_char_tokenizer()
EOS_TEXT = TOKENIZER.eos_token


class ScriptedEngine(RolloutEngine):
    """`script(context_text, seed) -> turn text` (the text may end with EOS_TEXT). Records each call's contexts,
    seeds and max_new_tokens. `tokenizer`: another one (a chat template's special tokens added to the char-level
    one), whose decoded contexts keep their special tokens."""

    name = "scripted"

    def __init__(self, script: Callable[[str, int], str], tokenizer=TOKENIZER) -> None:
        self.script, self.tokenizer = script, tokenizer
        self.pad_token_id = tokenizer.pad_token_id
        self.calls: list[dict] = []

    def generate(self, prompts: list[list[int]], counts: list[int], params: SamplingParams,
                 seeds: torch.Tensor) -> GenerationOutput:
        assert counts == [1] * len(prompts)  # episodes ask for one row per context
        tok = self.tokenizer
        contexts = [tok.decode(p) for p in prompts]
        self.calls.append({"contexts": contexts, "seeds": seeds.clone(), "max_new_tokens": params.max_new_tokens})
        turns = [tok(self.script(c, int(s)), add_special_tokens=False).input_ids[:params.max_new_tokens]
                 for c, s in zip(contexts, seeds)]
        width = max(len(t) for t in turns)
        tokens = torch.tensor([t + [tok.pad_token_id] * (width - len(t)) for t in turns], dtype=torch.long)
        lengths = torch.tensor([len(t) for t in turns])
        mask, truncated = completion_mask(tokens, [tok.eos_token_id, *params.stop_token_ids], lengths)
        group_index, prompt_ids, prompt_mask = row_prompts(prompts, counts, tok.pad_token_id)
        positions = torch.arange(1, width + 1, dtype=torch.float32)
        return GenerationOutput(group_index=group_index, prompt_ids=prompt_ids, prompt_mask=prompt_mask,
                                completion_ids=tokens * mask.long(), completion_mask=mask, truncated=truncated,
                                logprobs=(-0.01 * positions).expand(len(turns), -1) * mask)
