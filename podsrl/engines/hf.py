"""The `hf` engine: transformers' `model.generate` in process, sharing the trainer's module (the reference for the
fast engine, which is the default)."""

from __future__ import annotations

from contextlib import contextmanager
from typing import Any

import torch

from podsrl.engines.base import GenerationOutput, RolloutEngine, SamplingParams
from podsrl.engines.rows import (
    check_request,
    completion_mask,
    no_token_output,
    row_prompts,
    special_ids,
    stop_ids,
)
from podsrl.engines.sampling import derive_seed


@contextmanager
def eval_mode(model: torch.nn.Module):
    """Eval mode (no dropout) for generation; the caller's train/eval state is restored afterwards."""
    was_training = model.training
    model.eval()
    try:
        yield
    finally:
        model.train(was_training)


def model_device(model: torch.nn.Module) -> torch.device:
    try:
        return next(model.parameters()).device
    except StopIteration:
        return torch.device("cpu")


class HFEngine(RolloutEngine):
    """`model.generate` on left-padded prompts, each repeated counts[i] times.

    Transformers draws samples from the global torch RNG, so per-row seeds are impossible: the whole call is seeded
    with one value derived from `seeds` inside a forked RNG, leaving the trainer's RNG stream untouched.
    Options: eos_token_id, pad_token_id (override the tokenizer's). Outputs are CPU tensors.
    """

    name = "hf"

    def __init__(self, model: torch.nn.Module, tokenizer: Any = None, **options: Any) -> None:
        self.model = model
        self.tokenizer = tokenizer
        self.eos_ids, self.pad_token_id = special_ids(model, tokenizer, options)

    def generate(
        self,
        prompts: list[list[int]],
        counts: list[int],
        params: SamplingParams,
        seeds: torch.Tensor,
    ) -> GenerationOutput:
        rows = check_request(prompts, counts, seeds)
        if rows == 0 or params.max_new_tokens <= 0:
            return no_token_output(prompts, counts, rows, self.pad_token_id, params.return_logprobs)
        group_index, prompt_ids, prompt_mask = row_prompts(prompts, counts, self.pad_token_id)
        stops = stop_ids(self.eos_ids, params)
        device = model_device(self.model)
        from transformers import GenerationConfig

        sampling: dict[str, Any] = {}
        if not params.greedy:
            sampling = {
                "do_sample": True,
                "temperature": params.temperature,
                "top_p": params.top_p,
                "top_k": params.top_k,
            }
        config = GenerationConfig(
            max_new_tokens=params.max_new_tokens,
            eos_token_id=stops or None,
            pad_token_id=self.pad_token_id,
            output_logits=params.return_logprobs,
            return_dict_in_generate=True,
            **({"do_sample": False} if params.greedy else sampling),
        )
        fork_devices = [device] if device.type == "cuda" else []
        with torch.random.fork_rng(devices=fork_devices), torch.inference_mode(), eval_mode(self.model):
            torch.manual_seed(derive_seed(seeds))
            out = self.model.generate(
                input_ids=prompt_ids.to(device),
                attention_mask=prompt_mask.to(device),
                generation_config=config,
            )
        tokens = out.sequences[:, prompt_ids.shape[1] :].cpu()
        mask, truncated = completion_mask(tokens, stops)
        logprobs = None
        if params.return_logprobs:
            # gathered on the device: only [rows, tokens] crosses to the host, not [rows, tokens, vocab]
            logits = torch.stack(out.logits, dim=1).float()
            temp = params.temperature if params.temperature > 0 else 1.0
            chosen = out.sequences[:, prompt_ids.shape[1]:].unsqueeze(-1)
            logprobs = (logits / temp).log_softmax(-1).gather(-1, chosen).squeeze(-1).cpu() * mask
        return GenerationOutput(
            group_index=group_index,
            prompt_ids=prompt_ids,
            prompt_mask=prompt_mask,
            completion_ids=tokens.masked_fill(mask == 0, self.pad_token_id),
            completion_mask=mask,
            truncated=truncated,
            logprobs=logprobs,
        )
