"""What `podsrl plan --memory` plans for: the model's shape, read off its config on the meta device (no weights), and
the step's workload (prompts, rollouts, lengths, precision, ranks) and a micro-batch's geometry; parse_memory reads
a device size. The memory model over them is podsrl/planning/memory.py."""

from __future__ import annotations

import math
import re
import warnings
from dataclasses import dataclass
from pathlib import Path

from podsrl.errors import UserError

DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}
LLAMA_FAMILY = ("llama", "mistral", "qwen2", "qwen3")  # the layer podsrl runs itself (podsrl/models/llama.py)
LINEAR_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")  # what LoRA may wrap
_UNITS = {"b": 1, "kb": 1e3, "mb": 1e6, "gb": 1e9, "tb": 1e12, "kib": 2**10, "mib": 2**20, "gib": 2**30,
          "tib": 2**40, "k": 2**10, "m": 2**20, "g": 2**30, "t": 2**40}


def parse_memory(text: str) -> int:
    """'80GiB', '80 GB', '81920MiB', '7.5g' -> bytes (G/GiB binary, GB decimal); a bare number is refused (80 what?)."""
    match = re.fullmatch(r"\s*(\d+(?:\.\d*)?)\s*([a-zA-Z]*)\s*", text)
    unit = match.group(2).lower() if match else None
    if not match or unit not in _UNITS or float(match.group(1)) <= 0:
        raise UserError(f"--gpu-memory: {text!r} is not a memory size (write e.g. 80GiB, 24GB or 81920MiB)")
    return int(float(match.group(1)) * _UNITS[unit])


@dataclass(frozen=True)
class ModelShape:
    """What the memory of a Llama-family causal LM depends on, read from its config and its meta-device build."""

    model_type: str
    layers: int
    hidden: int
    intermediate: int
    heads: int
    kv_heads: int
    head_dim: int
    vocab: int
    params: int  # distinct parameters (tied embeddings once)
    trained_params: int  # all of them, or the LoRA adapters'
    qkv_bias: bool
    lora_rank: int = 0  # 0: no adapters
    lora_targets: tuple[str, ...] = ()  # the adapted projections of each decoder layer (LINEAR_MODULES)
    layer_params: int = 0  # parameters of one decoder layer (what FSDP2 gathers per layer)
    stored_dtype: str = "float32"  # the dtype its config says the checkpoint stores (what loading reads)

    @property
    def lora(self) -> bool:
        return self.lora_rank > 0

    @property
    def lora_qkv(self) -> bool:
        """LoRA wraps a q/k/v projection: they run one by one, not as one fused matmul."""
        return bool(set(self.lora_targets) & {"q_proj", "k_proj", "v_proj"})

    @property
    def lora_gate_up(self) -> bool:
        """LoRA wraps gate_proj or up_proj: they run one by one, not as one fused matmul."""
        return bool(set(self.lora_targets) & {"gate_proj", "up_proj"})

    @property
    def qkv_width(self) -> int:
        return (self.heads + 2 * self.kv_heads) * self.head_dim

    @property
    def fused_weights(self) -> int:
        """Elements of one layer's q/k/v and gate/up weights concatenated (podsrl/models/llama.py fused_qkv and
        fused_gate_up: rebuilt by every update forward and generate call; LoRA-wrapped projections are not fused)."""
        return (0 if self.lora_qkv else self.qkv_elements) + (0 if self.lora_gate_up else self.gate_up_elements)

    @property
    def qkv_elements(self) -> int:
        return self.qkv_width * (self.hidden + self.qkv_bias)

    @property
    def gate_up_elements(self) -> int:
        return 2 * self.intermediate * self.hidden

    @property
    def root_params(self) -> int:
        """Parameters outside the decoder layers: embeddings, final norm, an untied head."""
        return self.params - self.layers * self.layer_params


def load_model_config(name_or_path: str):
    """The transformers config of a local model directory, a config.json file, or a hub id in the local Hugging Face
    cache (nothing is downloaded)."""
    from transformers import AutoConfig

    local = Path(name_or_path).expanduser()
    looks_local = local.exists() or name_or_path.startswith((".", "/", "~")) or name_or_path.endswith(".json")
    if looks_local:
        file = local if local.is_file() else local / "config.json"
        if not file.is_file():
            raise UserError(f"model {name_or_path!r}: no such config.json (give a model directory, its "
                            "config.json, or a hub id in the local Hugging Face cache)")
        try:
            return AutoConfig.from_pretrained(str(file))
        except (OSError, ValueError, KeyError) as e:
            raise UserError(f"model {name_or_path!r}: {file} is not a transformers config ({_first_line(e)})") from None
    try:
        return AutoConfig.from_pretrained(name_or_path, local_files_only=True)
    except (OSError, ValueError) as e:
        raise UserError(f"model {name_or_path!r}: not a local path, and its config is not in the local Hugging Face "
                        f"cache (download it first, e.g. `hf download {name_or_path} config.json`): "
                        f"{_first_line(e)}") from None


def _first_line(e: Exception) -> str:
    return str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__


def model_shape(config, lora_rank: int = 0, lora_targets: list[str] | tuple[str, ...] = ()) -> ModelShape:
    """The shape of `config`'s model, its parameters counted on a meta-device build (with LoRA adapters applied as
    podsrl/lora.py applies them, when lora_rank > 0, on model.lora_target_modules)."""
    import torch
    from transformers import AutoModelForCausalLM

    model_type = getattr(config, "model_type", None)
    if model_type not in LLAMA_FAMILY:
        raise UserError(f"model type {model_type!r}: the memory plan knows the layer podsrl runs itself "
                        f"({', '.join(LLAMA_FAMILY)}) only")
    targets = set(lora_targets) if lora_rank > 0 else set()
    if targets - set(LINEAR_MODULES):
        raise UserError(f"model.lora_target_modules {sorted(targets)}: the memory plan predicts LoRA on the decoder "
                        f"layers' linear projections ({', '.join(LINEAR_MODULES)})")
    with torch.device("meta"), warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)  # peft asks the model a deprecated question; not ours to act on
        model = AutoModelForCausalLM.from_config(config)
        if lora_rank > 0:
            from podsrl.lora import apply_lora

            model = apply_lora(model, rank=lora_rank, alpha=2 * lora_rank, dropout=0.0,
                               target_modules=sorted(targets))
    params = sum(p.numel() for p in model.parameters())
    layer = next(m for name, m in model.named_modules() if re.search(r"layers\.0$", name))
    trained = sum(p.numel() for p in model.parameters() if p.requires_grad)
    heads = config.num_attention_heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    return ModelShape(
        model_type=model_type, layers=config.num_hidden_layers, hidden=config.hidden_size,
        intermediate=config.intermediate_size, heads=heads,
        kv_heads=getattr(config, "num_key_value_heads", None) or heads, head_dim=head_dim,
        vocab=config.vocab_size, params=params, trained_params=trained,
        qkv_bias=bool(getattr(config, "attention_bias", model_type == "qwen2")), lora_rank=lora_rank,
        lora_targets=tuple(m for m in LINEAR_MODULES if m in targets),
        layer_params=sum(p.numel() for p in layer.parameters()),
        stored_dtype=str(getattr(config, "dtype", None) or getattr(config, "torch_dtype", None) or "float32"
                         ).removeprefix("torch."),
    )


CACHE_BLOCK = 64  # on CUDA a decode step's cache positions are a multiple of it: the fast engine's default cache_block


@dataclass(frozen=True)
class EngineMemory:
    """What a rollout engine holds on the device to sample, as the memory plan prices it; each engine declares its
    own (RolloutEngine.device_memory). The defaults are the fast engine's at its defaults.
    - kv_cache: it decodes from a KV cache of its rows in flight (each row's prompt and completion positions, the
      prefill's cache of the wave's prompts); without one, each step runs the model's forward over every row's
      whole sequence, and that forward's workspace is what it holds (memory.whole_sequence_workspace);
    - cache_block: on CUDA a row's cache positions are rounded up to a multiple of it;
    - fused_weights: it samples through the decode stack's fused q/k/v and gate/up weights (models/decode.py
      DecodeStack) and keeps them between calls;
    - waves: unless its `rows_option` is set, it decodes as many rows at once as fit the device, refilling
      finished ones from the queue (memory.rows_in_flight); False: all of a rank's rows at once."""

    kv_cache: bool = True
    cache_block: int = CACHE_BLOCK
    fused_weights: bool = True
    waves: bool = True


@dataclass(frozen=True)
class Workload:
    """One step's shape and the precision it runs in."""

    prompts: int  # P
    n: int  # rollouts generated per prompt
    m: int  # rollouts trained per prompt
    prompt_length: int  # Lp
    completion_length: int  # Lc
    dtype: str = "float32"  # master weights and AdamW state (model.dtype)
    compute_dtype: str = "float32"  # forward/backward and the engine's weights (model.compute_dtype)
    beta: float = 0.0  # > 0 keeps a reference model
    logits_chunk: int = 1024  # update.logits_chunk
    top_p: float = 1.0
    device: str = "cuda"  # how attention runs: matmuls + softmax on CPU, scaled_dot_product_attention elsewhere
    # a training run: the update's gradients and AdamW state stay allocated through generation, and the fast engine's
    # fused weights through the update (False: each phase alone, as benchmarks/memory_plan_check.py measures them)
    training_run: bool = True
    # train.async: "in_process" (a generator thread with its own weights copy in the engine's dtype, sampling while
    # the update runs on the same device), "workers" (an engine whose worker processes sample, the Ray pool: the
    # generator's full copy stays here)
    async_generator: str = "none"
    rows_in_flight: int = 0  # rows the engine decodes at once (one wave; 0: all of a rank's rows)
    # the fast engine keeps its decode state (KV cache, step state, CUDA graphs) through the update (make_plan keeps
    # it only where it fits: memory.decode_state_fits)
    kept_decode_state: bool = False
    # an episode task (podsrl/episodes): completion_length is then the episode's budget (episode.max_tokens), and
    # the fast engine's session keeps every live episode's cache between turns beside the turn's own
    episodes: bool = False
    world_size: int = 1  # torchrun ranks (N)
    strategy: str = "ddp"  # train.strategy
    cpu_offload: bool = False  # train.cpu_offload (fsdp)
    engine: EngineMemory = EngineMemory()  # what the rollout engine holds on the device to sample

    @property
    def sharded(self) -> bool:
        """FSDP2 shards only over more than one rank (one process trains the whole model: podsrl/fsdp.py)."""
        return self.strategy == "fsdp" and self.world_size > 1

    @property
    def offloaded(self) -> bool:
        return self.sharded and self.cpu_offload

    @property
    def rank_prompts(self) -> int:
        """Prompts whose rows one rank generates (ShardedEngine: whole groups, the first ranks one more)."""
        return -(-self.prompts // self.world_size)

    @property
    def rank_rows(self) -> int:
        return self.rank_prompts * self.n

    @property
    def generation_rows(self) -> int:
        return min(self.rows_in_flight or self.rank_rows, self.rank_rows)

    @property
    def e(self) -> int:
        return DTYPE_BYTES[self.compute_dtype]

    @property
    def stream_bytes(self) -> int:
        """Bytes of an element of the residual stream and of what the forward keeps of it: the master dtype's
        (autocast casts only the matmuls' operands), but under FSDP2 the parameters are gathered in the compute dtype
        (its mixed-precision policy, podsrl/fsdp.py) and the whole forward runs in it, without autocast."""
        return self.e if self.sharded else self.p

    @property
    def p(self) -> int:
        return DTYPE_BYTES[self.dtype]

    @property
    def engine_e(self) -> int:
        """Bytes of the engine's weights, KV cache and logits: the fast engine samples in the compute dtype (from
        a copy of the weights when it is narrower than the masters, podsrl/build.py)."""
        return self.e

    @property
    def trained_rows(self) -> int:
        """A rank's share of a step's trained rows (DataParallel.micro_batches: equal shares, one more for some)."""
        return -(-self.prompts * self.m // self.world_size)


@dataclass(frozen=True)
class MicroBatch:
    """Geometry of one micro-batch's packed stream (podsrl/models/packed_layout.py) with every row at full length:
    G distinct prompts of Lp tokens, then each row's Lc - 1 completion inputs; T positions predict a token."""

    rows: int
    groups: int
    prompt_length: int
    completion_length: int

    @classmethod
    def of(cls, rows: int, m: int, work: Workload) -> MicroBatch:
        # rows run in group order, m per prompt: a micro-batch spans rows/m prompts, one more where it straddles
        groups = math.ceil(rows / m) + (0 if rows % m == 0 or m % rows == 0 else 1)
        return cls(rows, min(groups, rows), work.prompt_length, work.completion_length)

    @property
    def width(self) -> int:  # completion inputs per row
        return self.completion_length - 1

    @property
    def tokens(self) -> int:  # N
        return self.groups * self.prompt_length + self.rows * self.width

    @property
    def predicted(self) -> int:  # T
        return self.rows * self.completion_length
