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
from podsrl.planning.workload import EngineMemory


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


class StepLogprobs:
    """A logits processor that records, step by step, the log-prob of each row's sampled token under the
    temperature-scaled policy: it runs before transformers' temperature, top-k and top-p warpers (custom processors
    come first), so it sees the raw logits; the token sampled from step t is the last input id at step t + 1, and the
    last step's is handed to `finish`. Only one step's [rows, vocab] log-softmax is alive at a time: asking `generate`
    for every step's logits instead (output_logits) keeps [rows, new tokens, vocab], 74 GiB for 512 rows of 256
    tokens at Qwen2's 151,936-token vocabulary (measured on an H200)."""

    def __init__(self, temperature: float) -> None:
        self.temperature = temperature
        self.pending: torch.Tensor | None = None  # [rows, vocab] log-softmax of the step whose token is not seen yet
        self.steps: list[torch.Tensor] = []

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        if self.pending is not None:
            self._take(input_ids[:, -1])
        self.pending = (scores.float() / self.temperature).log_softmax(-1)
        return scores

    def _take(self, chosen: torch.Tensor) -> None:
        self.steps.append(self.pending.gather(-1, chosen[:, None]).squeeze(-1))
        self.pending = None

    def finish(self, last_tokens: torch.Tensor) -> torch.Tensor:
        """[rows, steps] log-probs, the last step's token given."""
        self._take(last_tokens)
        return torch.stack(self.steps, dim=1)


class HFEngine(RolloutEngine):
    """`model.generate` on left-padded prompts, each repeated counts[i] times.

    Transformers draws samples from the global torch RNG, so per-row seeds are impossible: the whole call is seeded
    with one value derived from `seeds` inside a forked RNG, leaving the trainer's RNG stream untouched.
    Options: eos_token_id, pad_token_id (override the tokenizer's). Outputs are CPU tensors.
    """

    name = "hf"
    no_async_reason = "it seeds sampling through the process-wide torch RNG that the learner shares"

    @classmethod
    def device_memory(cls, options: dict) -> EngineMemory:
        """transformers' `generate`: one call over all of a rank's rows (no waves), a cache that grows a position
        at a time (no blocks), the model's own projections (no fused copies)."""
        return EngineMemory(cache_block=1, fused_weights=False, waves=False)

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
            return_dict_in_generate=True,
            **({"do_sample": False} if params.greedy else sampling),
        )
        recorder = StepLogprobs(params.temperature if params.temperature > 0 else 1.0)
        fork_devices = [device] if device.type == "cuda" else []
        with torch.random.fork_rng(devices=fork_devices), torch.inference_mode(), eval_mode(self.model):
            torch.manual_seed(derive_seed(seeds))
            out = self.model.generate(
                input_ids=prompt_ids.to(device),
                attention_mask=prompt_mask.to(device),
                generation_config=config,
                logits_processor=[recorder] if params.return_logprobs else None,
            )
        tokens = out.sequences[:, prompt_ids.shape[1] :].cpu()
        mask, truncated = completion_mask(tokens, stops)
        logprobs = recorder.finish(out.sequences[:, -1]).cpu() * mask if params.return_logprobs else None
        return GenerationOutput(
            group_index=group_index,
            prompt_ids=prompt_ids,
            prompt_mask=prompt_mask,
            completion_ids=tokens.masked_fill(mask == 0, self.pad_token_id),
            completion_mask=mask,
            truncated=truncated,
            logprobs=logprobs,
        )
