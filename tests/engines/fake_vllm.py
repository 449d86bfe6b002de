"""A stand-in for the `vllm` package (0.33.0) for the vllm engine's contract test, on machines without vLLM (the
real one, vLLM's CPU build, runs tests/engines/real_vllm/ where it is installed).

The public signatures podsrl calls are those of vLLM 0.33.0 (keyword names, defaults, no **kwargs where vLLM has
none), so a keyword vLLM does not take fails here as there: `LLM(**kwargs)` checks its extra keywords against
EngineArgs' fields (vLLM passes them on to EngineArgs, a dataclass), `SamplingParams` takes only its fields.
The behaviour is reduced to what podsrl depends on, following vLLM 0.33's source:
- start-up loads `model.safetensors` and `config.json` from the model directory; with
  `generation_config="auto"` (the default) the eos ids of generation_config.json become stops; it seeds Python's,
  NumPy's and torch's process-wide generators with `seed` (vllm.utils.torch_utils.set_random_seed);
- `external_launcher` takes the GPU from LOCAL_RANK and needs RANK, other executors use GPU 0 of the device "cuda";
- a token-id prompt is a dict with "prompt_token_ids"; a row's tokens follow from its seed (a hash, not a model);
  it stops at `stop_token_ids`, and unless `ignore_eos` at the generation config's eos ids, the stop token kept;
  unseeded sampling draws from the process-wide torch generator, as vLLM's sampler does from CUDA's;
- `logprobs=0` returns, per position, {sampled token: Logprob}; the values are `fake_logprob(position, token)`;
- `collective_rpc("reload_weights", kwargs={"weights_iterator": ...})` reaches the worker's `reload_weights`, which
  loads each (name, tensor) into a parameter of the loaded checkpoint (unknown names raise KeyError, as vLLM's
  weight loaders do; lm_head is skipped when tied);
- `sleep` needs `enable_sleep_mode`; a sleeping engine neither generates nor loads weights;
- `vllm.platforms.current_platform.is_cpu()` says whether the build is vLLM's CPU build (`platforms.CPU_BUILD`;
  False: a GPU build). The module `platforms` must also be put in sys.modules as "vllm.platforms".
"""

from __future__ import annotations

import json
import os
import random
import types
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
from safetensors.torch import load_file

__version__ = "0.33.0"


class _Platform:
    def is_cpu(self) -> bool:
        return platforms.CPU_BUILD


platforms = types.ModuleType("vllm.platforms")
platforms.CPU_BUILD = False
platforms.current_platform = _Platform()

# vllm.engine.arg_utils.EngineArgs' fields in 0.33.0: the keywords LLM(**kwargs) accepts beside its own.
ENGINE_ARGS = frozenset("""
model enable_return_routed_experts return_sampling_mask model_weights served_model_name tokenizer hf_config_path
runner convert skip_tokenizer_init enable_prompt_embeds tokenizer_mode trust_remote_code
allowed_local_media_path allowed_media_domains download_dir safetensors_load_strategy
safetensors_prefetch_num_threads safetensors_prefetch_block_size load_format config_format dtype kv_cache_dtype
seed max_model_len cudagraph_capture_sizes max_cudagraph_capture_size ir_op_priority
distributed_executor_backend pipeline_parallel_size master_addr master_port nnodes node_rank
distributed_timeout_seconds cpu_distributed_timeout_seconds numa_bind numa_bind_nodes numa_bind_cpus device_ids
tensor_parallel_size prefill_context_parallel_size decode_context_parallel_size dcp_comm_backend dcp_q_replicate
dcp_kv_cache_interleave_size cp_kv_cache_interleave_size data_parallel_size data_parallel_rank
data_parallel_start_rank data_parallel_size_local data_parallel_address data_parallel_rpc_port
data_parallel_hybrid_lb data_parallel_external_lb data_parallel_multi_port_external_lb data_parallel_backend
enable_hc_sp enable_expert_parallel enable_batch_sharded_sampling enable_ep_weight_filter moe_backend
linear_backend sparse_indexer_topk_backend all2all_backend enable_elastic_ep elastic_ep_max_dp_size enable_dbo
ubatch_size dbo_decode_token_threshold dp_sync_interval dbo_prefill_token_threshold
disable_nccl_for_dp_synchronization eplb_config enable_eplb expert_placement_strategy _api_process_count
_api_process_rank max_parallel_loading_workers block_size enable_prefix_caching prefix_caching_hash_algo
prefix_cache_retention_interval disable_sliding_window disable_cascade_attn offload_backend cpu_offload_gb
cpu_offload_params offload_group_size offload_num_in_group offload_prefetch_step offload_params
gpu_memory_utilization kv_cache_memory_bytes max_num_batched_tokens max_num_scheduled_tokens
long_prefill_token_threshold long_prefill_token_threshold_adaptive max_num_seqs max_num_active_seqs
max_num_queued_reqs max_num_queued_tokens max_logprobs logprobs_mode use_fp64_gumbel enable_trace_replay
disable_log_stats aggregate_engine_logging revision code_revision hf_token hf_overrides model_class_overrides
tokenizer_revision quantization quantization_config allow_deprecated_quantization enforce_eager
disable_custom_all_reduce enable_shm_tensor_arena language_model_only limit_mm_per_prompt enable_mm_embeds
interleave_mm_strings media_io_kwargs mm_processor_kwargs mm_processor_cache_gb mm_processor_cache_type
mm_hasher_algorithm mm_shm_cache_max_object_size_mb mm_encoder_only mm_encoder_tp_mode mm_encoder_attn_backend
mm_encoder_attn_dtype mm_encoder_fp8_scale_path mm_encoder_fp8_scale_save_path mm_encoder_fp8_scale_save_margin
io_processor_plugin renderer_num_workers skip_mm_profiling video_pruning_rate video_pruning_method mm_tensor_ipc
mm_processor_device mm_ipc_gpu_memory_gb mm_device_do_normalize enable_lora max_loras max_lora_rank
default_mm_loras fully_sharded_loras max_cpu_loras lora_dtype lora_target_modules enable_tower_connector_lora
specialize_active_lora enable_mixed_moe_lora_format enable_moe_shared_loras max_lora_cls_labels
ray_workers_use_nsight num_gpu_blocks_override model_loader_extra_config ignore_patterns enable_chunked_prefill
disable_chunked_mm_input scheduler_reserve_full_isl prefill_schedule_interval watermark
disable_hybrid_kv_cache_manager structured_outputs_config aux_output_config reasoning_parser
reasoning_parser_plugin speculative_config spec_method spec_model spec_tokens watermark_config diffusion_config
show_hidden_metrics_for_version otlp_traces_endpoint collect_detailed_traces per_request_spec_decode_metrics
kv_cache_metrics kv_cache_metrics_sample custom_histogram_buckets cudagraph_metrics
enable_layerwise_nvtx_tracing enable_mfu_metrics enable_logging_iteration_details jit_monitor_mode
jit_monitor_verbose enable_mm_processor_stats scheduling_policy scheduler_cls pooler_config compilation_config
attention_config engram_config mamba_config kernel_config enable_flashinfer_autotune monokernel worker_cls
worker_extension_cls profiler_config logging_config log_level log_config_file kv_transfer_config
kv_events_config ec_transfer_config ec_manager_config reasoning_config generation_config enable_sleep_mode
sleep_mode_backend sleep_mode_offload_cudagraph sleep_preserve_parameter_names enable_cumem_allocator
enable_nccl_comm_suspend override_generation_config model_impl attention_backend kv_cache_dtype_skip_layers
mamba_cache_dtype mamba_ssm_cache_dtype mamba_block_size prefix_match_unit mamba_cache_mode
enable_mamba_shared_prefix_checkpoint replayssm_buffer_len use_replayssm mamba_backend mamba_ssu_algorithm
enable_mamba_cache_stochastic_rounding mamba_cache_philox_rounds additional_config use_tqdm_on_load
pt_load_map_location logits_processors async_scheduling stream_interval kv_sharing_fast_prefill
swa_bounded_replay optimization_level performance_mode fault_tolerance_config enable_fault_tolerance
kv_offloading_size kv_offloading_backend tokens_only shutdown_timeout watchdog_config weight_transfer_config
fail_on_environ_validation gdn_prefill_backend kda_prefill_backend kda_decode_backend
""".split())


def fake_logprob(position: int, token: int) -> float:
    """The log-prob the fake reports for `token` sampled at `position` (distinct per position and token)."""
    return -0.01 * (position + 1) - 0.001 * token


@dataclass
class SamplingParams:
    """vllm.SamplingParams' fields and defaults in 0.33.0 (a msgspec.Struct there: any other keyword raises)."""

    n: int = 1
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    temperature: float = 1.0
    watermarking: bool | None = None
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    max_tokens: int | None = 16
    min_tokens: int = 0
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    prompt_logprob_token_ids: Any = None
    prompt_logprob_start: int | None = None
    logprob_token_ids: list[int] | None = None
    flat_logprobs: bool = False
    detokenize: bool = True
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    output_kind: Any = None  # RequestOutputKind.CUMULATIVE there
    stream_interval: int | None = None
    skip_clone: bool = False
    output_text_buffer_length: int = 0
    _eos_token_id: int | None = None
    _all_stop_token_ids: set[int] = field(default_factory=set)
    _watermarking_skipped: bool = False
    structured_outputs: Any = None
    logit_bias: dict[int, float] | None = None
    allowed_token_ids: list[int] | None = None
    extra_args: dict[str, Any] | None = None
    bad_words: list[str] | None = None
    _bad_words_token_ids: list[list[int]] | None = None
    skip_reading_prefix_cache: bool | None = None
    thinking_token_budget: int | None = None
    repetition_detection: Any = None
    routed_experts_prompt_start: int = 0
    trace_decode_token_ids: list[int] | None = None

    def __post_init__(self) -> None:  # the checks of 0.33's _verify_args that podsrl's values could meet
        if not 0.0 <= self.temperature <= 2.0:
            raise ValueError(f"temperature must be in [0, 2], got {self.temperature}.")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}.")
        if self.top_k < -1:
            raise ValueError(f"top_k must be 0 (disable), or at least 1, got {self.top_k}.")
        if self.max_tokens is not None and self.max_tokens < 1:
            raise ValueError(f"max_tokens must be at least 1, got {self.max_tokens}.")
        if self.logprobs is not None and self.logprobs != -1 and self.logprobs < 0:
            raise ValueError(f"logprobs must be non-negative or -1, got {self.logprobs}.")


@dataclass
class Logprob:
    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None
    logprobs: list[dict[int, Logprob]] | None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    prompt_logprobs: Any
    outputs: list[CompletionOutput]
    finished: bool = True


class Worker:
    """The one in-process worker (uniproc / external_launcher executors): holds the model's parameters."""

    def __init__(self, weights: dict[str, torch.Tensor], tied: bool) -> None:
        self.params, self.tied = weights, tied
        self.asleep = False
        self.reloads = 0

    def reload_weights(self, weights_iterator=None, weights_path=None, is_checkpoint_format=True) -> None:
        if self.asleep:
            raise RuntimeError("reload_weights on a sleeping engine: its weights are offloaded")
        for name, tensor in weights_iterator:
            if self.tied and name == "lm_head.weight":
                continue
            self.params[name]  # noqa: B018 (vLLM's loaders look the name up: KeyError for a name the model lacks)
            self.params[name] = tensor
        self.reloads += 1


class LLM:
    def __init__(
        self,
        model: str,
        *,
        runner="auto",
        convert="auto",
        tokenizer=None,
        tokenizer_mode="auto",
        skip_tokenizer_init=False,
        trust_remote_code=False,
        allowed_local_media_path="",
        allowed_media_domains=None,
        tensor_parallel_size=1,
        dtype="auto",
        quantization=None,
        revision=None,
        tokenizer_revision=None,
        chat_template=None,
        seed=0,
        gpu_memory_utilization=0.92,
        cpu_offload_gb=0,
        offload_group_size=0,
        offload_num_in_group=1,
        offload_prefetch_step=1,
        offload_params=None,
        enforce_eager=False,
        enable_return_routed_experts=False,
        return_sampling_mask=False,
        disable_custom_all_reduce=False,
        hf_token=None,
        hf_overrides=None,
        mm_processor_kwargs=None,
        pooler_config=None,
        structured_outputs_config=None,
        profiler_config=None,
        attention_config=None,
        kv_cache_memory_bytes=None,
        compilation_config=None,
        quantization_config=None,
        logits_processors=None,
        spec_method=None,
        spec_model=None,
        spec_tokens=None,
        **kwargs: Any,
    ) -> None:
        self.init_kwargs = {k: v for k, v in locals().items() if k not in ("self", "kwargs", "__class__")}
        self.init_kwargs.update(kwargs)
        unknown = sorted(set(kwargs) - ENGINE_ARGS)
        if unknown:
            raise TypeError(f"EngineArgs.__init__() got an unexpected keyword argument '{unknown[0]}'")
        self.multiprocessing_env = os.environ.get("VLLM_ENABLE_V1_MULTIPROCESSING")
        backend = kwargs.get("distributed_executor_backend")
        if backend == "external_launcher":
            if self.multiprocessing_env != "0":
                raise AssertionError("To get deterministic execution, please set VLLM_ENABLE_V1_MULTIPROCESSING=0")
            self.rank, self.gpu = int(os.environ["RANK"]), int(os.environ["LOCAL_RANK"])
        else:
            self.rank, self.gpu = 0, 0
        path = Path(model)
        config = json.loads((path / "config.json").read_text())
        self.vocab_size = config["vocab_size"]
        self.worker = Worker(load_file(path / "model.safetensors"), bool(config.get("tie_word_embeddings")))
        self.generation_eos: set[int] = set()
        if kwargs.get("generation_config", "auto") == "auto" and (path / "generation_config.json").is_file():
            eos = json.loads((path / "generation_config.json").read_text()).get("eos_token_id")
            self.generation_eos = {eos} if isinstance(eos, int) else set(eos or ())
        self.enable_sleep_mode = kwargs.get("enable_sleep_mode", False)
        self.prefix_cache_resets = 0
        random.seed(seed)
        np.random.seed(seed)
        torch.manual_seed(seed)

    def generate(self, prompts, sampling_params=None, *, use_tqdm=True, lora_request=None, priority=None,
                 tokenization_kwargs=None, mm_processor_kwargs=None) -> list[RequestOutput]:
        if self.worker.asleep:
            raise RuntimeError("generate on a sleeping engine (its scheduler is paused)")
        prompts = [prompts] if isinstance(prompts, (str, dict)) else list(prompts)
        params = sampling_params if isinstance(sampling_params, list) else [sampling_params] * len(prompts)
        if len(params) != len(prompts):
            raise ValueError(f"The lengths of prompts ({len(prompts)}) and params ({len(params)}) must be the same.")
        return [self._run(str(i), prompt, sp) for i, (prompt, sp) in enumerate(zip(prompts, params))]

    def _run(self, request_id: str, prompt, sp: SamplingParams) -> RequestOutput:
        if not isinstance(prompt, dict) or not all(isinstance(t, int) for t in prompt.get("prompt_token_ids", [None])):
            raise ValueError(f"not a token-id prompt: {prompt!r}")
        ids = prompt["prompt_token_ids"]
        if sp.seed is None:
            generator = None
            torch.rand(1)  # draws from the process-wide generator
        else:
            generator = torch.Generator().manual_seed(sp.seed * 1_000_003 + sum(ids))
        stops = set(sp.stop_token_ids or ()) | (set() if sp.ignore_eos else self.generation_eos)
        tokens, finish = [], "length"
        for _ in range(sp.max_tokens):
            tokens.append(int(torch.randint(self.vocab_size, (1,), generator=generator)))
            if tokens[-1] in stops:
                finish = "stop"
                break
        logprobs = None
        if sp.logprobs is not None:
            logprobs = [{t: Logprob(fake_logprob(i, t), rank=1)} for i, t in enumerate(tokens)]
        out = CompletionOutput(0, "", tokens, None, logprobs, finish, tokens[-1] if finish == "stop" else None)
        return RequestOutput(request_id, None, ids, None, [out])

    def collective_rpc(self, method, timeout: float | None = None, args: tuple = (),
                       kwargs: dict[str, Any] | None = None) -> list:
        run = getattr(self.worker, method) if isinstance(method, str) else method.__get__(self.worker)
        return [run(*args, **(kwargs or {}))]

    def reset_prefix_cache(self, reset_running_requests: bool = False, reset_connector: bool = False) -> bool:
        self.prefix_cache_resets += 1
        return True

    def sleep(self, level: int = 1, mode: str = "abort"):
        if not self.enable_sleep_mode:
            raise RuntimeError("Sleep mode is not enabled (LLM(enable_sleep_mode=True))")
        self.reset_prefix_cache()
        self.worker.asleep = True

    def wake_up(self, tags: list[str] | None = None) -> bool:
        if tags is None or "weights" in tags:
            self.worker.asleep = False
        return not self.worker.asleep
