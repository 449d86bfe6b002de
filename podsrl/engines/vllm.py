"""`rollout.engine: vllm`: generation with vLLM on a GPU, colocated with the trainer (same process, same GPU).
Not yet run on a GPU (docs/results.md, "GPU paths not yet run").

vLLM is imported only when this engine is built; without it (or without CUDA) the error says what to install.

Design (docs/scale.md has the multi-node picture):
- Start-up: vLLM loads a model directory. The trainer's policy is saved once to a temporary directory (weights and
  tokenizer), so the built-in tiny model and checkpoints work the same way as a hub id; `model_path` overrides it.
- Requests: one request per row with n=1 and `seed=seeds[r]`, so a row's sample depends only on its own seed (the
  same contract as the fast engine, although vLLM's kernels draw different samples than the fast engine's).
- Log-probs: not returned (`logprobs=None`). vLLM's sampled-token log-probs come from different kernels than the
  trainer's forward pass, and the PPO ratio needs the trainer's numbers; with several passes the updater recomputes
  them in one forward pass (PolicyUpdater._precompute), with one pass the ratio is exactly 1 anyway.
- Weight sync: `sync_weights` hands (name, tensor) pairs of the trainer's parameters to vLLM's own
  `model.load_weights` on every vLLM worker through `LLM.collective_rpc`. Colocated, the worker runs in this
  process (V1 multiprocessing off), so the tensors are passed by reference on the same GPU: no copy through host
  memory. For vLLM on other GPUs/nodes the same call site would instead broadcast each tensor over an NCCL group
  shared by trainer rank 0 and the vLLM workers (see docs/scale.md); that mode is not implemented here.

Options: model_path, gpu_memory_utilization (0.4), tensor_parallel_size (1), dtype ("auto"), enforce_eager (False),
llm_options (extra `vllm.LLM` keywords), eos_token_id, pad_token_id.
"""

from __future__ import annotations

import os
import tempfile
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
from podsrl.errors import ConfigError


def _load_weights(worker, weights: list[tuple[str, torch.Tensor]]) -> None:
    """Runs on each vLLM worker (collective_rpc passes the worker first)."""
    worker.model_runner.model.load_weights(weights=weights)


class VLLMEngine(RolloutEngine):
    """vLLM generation colocated with the trainer; see the module docstring."""

    name = "vllm"

    def __init__(self, model: torch.nn.Module, tokenizer: Any = None, *, model_path: str | None = None,
                 gpu_memory_utilization: float = 0.4, tensor_parallel_size: int = 1, dtype: str = "auto",
                 enforce_eager: bool = False, llm_options: dict | None = None, **options: Any) -> None:
        try:
            import vllm
        except ImportError as e:
            raise ConfigError("rollout.engine: 'vllm' needs vLLM and a CUDA GPU (pip install vllm); it is not "
                              "installed here. Use rollout.engine=fast (one process) or ray (actor pool)") from e
        if not torch.cuda.is_available():
            raise ConfigError("rollout.engine: 'vllm' needs a CUDA GPU; none is visible")
        self._vllm = vllm
        self.eos_ids, self.pad_token_id = special_ids(model, tokenizer, options)
        self._tmp = None
        if model_path is None:  # vLLM loads from a directory: write the current policy once
            self._tmp = tempfile.TemporaryDirectory(prefix="podsrl-vllm-")
            model.save_pretrained(self._tmp.name, safe_serialization=True)
            if tokenizer is not None:
                tokenizer.save_pretrained(self._tmp.name)
            model_path = self._tmp.name
        # Colocated: keep vLLM's worker in this process so weight sync passes GPU tensors by reference.
        os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
        self.llm = vllm.LLM(model=model_path, gpu_memory_utilization=gpu_memory_utilization,
                            tensor_parallel_size=tensor_parallel_size, dtype=dtype, enforce_eager=enforce_eager,
                            **(llm_options or {}))

    def generate(self, prompts: list[list[int]], counts: list[int], params: SamplingParams,
                 seeds: torch.Tensor) -> GenerationOutput:
        rows = check_request(prompts, counts, seeds)
        if rows == 0 or params.max_new_tokens <= 0:
            return no_token_output(prompts, counts, rows, self.pad_token_id, False)
        stops = stop_ids(self.eos_ids, params)
        requests, sampling = [], []
        row_seeds = seeds.long().tolist()
        r = 0
        for prompt, count in zip(prompts, counts):
            for _ in range(count):
                requests.append({"prompt_token_ids": prompt})
                sampling.append(self._vllm.SamplingParams(
                    n=1, seed=row_seeds[r] & (2**63 - 1), max_tokens=params.max_new_tokens,
                    temperature=0.0 if params.greedy else params.temperature, top_p=params.top_p,
                    top_k=params.top_k if params.top_k > 0 else -1, stop_token_ids=stops, detokenize=False))
                r += 1
        outputs = self.llm.generate(requests, sampling, use_tqdm=False)
        tokens = [list(o.outputs[0].token_ids) for o in outputs]
        width = max((len(t) for t in tokens), default=0)
        ids = torch.full((rows, width), self.pad_token_id, dtype=torch.long)
        for i, t in enumerate(tokens):
            ids[i, : len(t)] = torch.tensor(t, dtype=torch.long)
        lengths = torch.tensor([len(t) for t in tokens])
        mask, truncated = completion_mask(ids, stops, lengths)
        group_index, prompt_ids, prompt_mask = row_prompts(prompts, counts, self.pad_token_id)
        return GenerationOutput(group_index=group_index, prompt_ids=prompt_ids, prompt_mask=prompt_mask,
                                completion_ids=ids, completion_mask=mask, truncated=truncated, logprobs=None)

    def sync_weights(self, model: torch.nn.Module) -> None:
        weights = [(name, p.detach()) for name, p in model.named_parameters()]
        self.llm.collective_rpc(_load_weights, args=(weights,))
        self.llm.reset_prefix_cache()  # cached prompt K/V were computed with the old weights

    def close(self) -> None:
        self.llm = None
        if self._tmp is not None:
            self._tmp.cleanup()
            self._tmp = None
