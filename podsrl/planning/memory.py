"""The memory model behind `podsrl plan --memory`: the predicted peak memory of a step's generation and of its update,
from the model's config alone (built on the meta device, no weights), and the largest micro-batch that fits a device.
What it plans for (the model's shape, the step's workload) is podsrl/planning/workload.py; its table and command
line are podsrl/memory_plan.py; what a run holds before its first step (the start-up row, rank 0's host
memory) and each checkpoint's size are podsrl/planning/startup.py.

Every term is bytes = count x element size, the count read off the code that allocates it (each function's
docstring names that code); all rows are taken at the full prompt and completion lengths (the worst case a step can
meet). Notation: L layers, D hidden, I MLP width, H query heads, Hkv key/value heads, d head dim, V vocabulary; e
the compute dtype's bytes, p the master (model.dtype) bytes; G prompts and b rows in a micro-batch, Lp prompt and Lc
completion tokens, N = G Lp + b (Lc - 1) packed tokens, T = b Lc predicting positions.

Generation (the rollout engine as it declares what it holds, workload.EngineMemory: by default the fast engine's; a
wave of rows in flight, by default as many as fit beside the resident state):
    resident state (master weights; in a training run also their AdamW state; a reference model)
  + the engine's weights copy in the compute dtype when it is narrower than the masters (podsrl/build.py)
  + fused q/k/v and gate/up weights (DecodeStack binds them per generate call and keeps them), unless the engine
    has that copy: its projections are then views of the fused tensors (models/llama.py share_fused_storage)
  + KV cache  L x 2 x Hkv x d x ((Lp + Lc) x rows + Lp x P) x bytes  (static buffers of full capacity, the
    prefill's cache of the wave's distinct prompts)
  + the larger of the prefill's and a decode step's workspace (logits and sampling over [rows, V] in float32)
  + the runtime's own growth (calibrated per device).
Update (the shared-prompt path of podsrl/models/packed.py, one micro-batch of b rows):
    master weights + gradients + AdamW state (2 per trained parameter, master dtype) + a reference model
  + the activations autograd saves (`layer_activations` per decoder layer, read off the layer's code and checked
    against what it saves in tests/planning/test_memory_plan.py), or with activation checkpointing each layer's
    input, then one layer's recomputed activations under its backward
  + the largest transient on top of them: the log-prob head's backward (a [V, D] weight gradient and one
    update.logits_chunk x V float32 chunk twice) or a layer's attention or MLP backward
  + in a training run the fast engine's weights copy and fused weights, kept from the last generate call; the
    runtime's growth; and where it keeps them (CUDA graphs: Workload.kept_decode_state, `decode_state_fits`), its
    step state, KV cache and graphs' pool (`kept_decode_state`), else the trainer releases them before the update.

Per rank (torchrun, `world_size` N): generation is sharded by prompt groups (podsrl/distributed.py ShardedEngine),
so a rank decodes ceil(P/N) prompts' rows; the update gives each rank ceil(P m / N) rows of a step
(DataParallel.micro_batches), and optim.micro_batch_size is a rank's micro-batch. train.strategy=ddp replicates
the state above on every rank; fsdp (podsrl/fsdp.py, N > 1) shards the master weights, gradients, AdamW state and
reference over N, adds the layers it gathers to run (the root module's embeddings, norm and head, the layer in use
and the next one prefetched, in the compute dtype; in the backward a layer's unsharded gradient in float32 before
its reduce-scatter), and keeps one unsharded generation copy in the compute dtype that the engine samples from;
train.cpu_offload moves the sharded state to host memory (`host_memory`).

What a CUDA device adds (context, allocator fragmentation, cuBLAS and attention workspaces) is not calibrated: the
CPU's counterpart is (benchmarks/memory_plan_check.py), a GPU run measures it (benchmarks/gpu_suite.sh) and
`--reserve` keeps that share of the device free meanwhile.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

from podsrl.planning.attention import attention_saved
from podsrl.planning.startup import ADAM_STATES, host_load, startup_peak
from podsrl.planning.workload import MicroBatch, ModelShape, Workload

GIB = 2**30
# What a phase costs beyond its tensors, per device: on CPU the process's growth around a phase of a negligible model
# (malloc arenas, the autograd engine's thread, oneDNN's kernels), calibrated by `python
# benchmarks/memory_plan_check.py --models 0` (median of its rounds). On CUDA the allocator's share: cuBLAS's
# workspaces per stream that ran a matmul (33 MiB on an H200, less on older GPUs), kept for the process's life: the
# default stream's, and in generation also the graphs' capture stream's (engines/decode_step.py capture_stream;
# 66.0 MiB for both, benchmarks/kept_memory.py). The context and the allocator's fragmentation are outside the
# allocator's count: --reserve keeps a share of the device for them.
CUBLAS_WORKSPACE = 33 * 2**20
RUNTIME_BYTES = {"cpu": {"update": 17 * 2**20, "generation": 14 * 2**20},
                 "cuda": {"update": CUBLAS_WORKSPACE, "generation": 2 * CUBLAS_WORKSPACE}}
RESERVE = 0.1  # share of the device kept free by default (--reserve; the fast engine's default rows in flight)


# ---- the update ----


def layer_activations(shape: ModelShape, mb: MicroBatch, work: Workload, last: bool = False,
                      first: bool = False) -> int:
    """Bytes one decoder layer saves for its backward (podsrl/models/llama.py decoder_layer with the autograd
    functions of kernels.py), N packed tokens in, the last layer's MLP over the T predicting positions only:
    - each RMSNorm (`norm_saved`, on the residual stream: in the master dtype, under FSDP2 in the compute dtype,
      Workload.stream_bytes), and the output the next matmul reads (under autocast, a compute dtype narrower than
      the stream, that matmul's compute-dtype copy of it);
    - the fused q/k/v and gate/up weights (llama.fused_qkv / fused_gate_up: fresh concatenations, saved by the
      matmuls that read them); under autocast every projection's compute-dtype copy (o and down too);
    - attention (`attention_saved`), its output (o_proj's input);
    - SwiGLU (kernels._SwiGLU): the gate/up projection [2I] and silu(gate) [I]; its output [I] (down's input);
    - LoRA (not fused): each adapter's [N, r] down-projection (the unfused rotation, kernels.rotate, saves only the
      shared cos and sin); LoRA-wrapped gate/up run as the module's down(act(gate(x)) * up(x)), which
      saves gate(x), act(gate(x)), up(x) and the product: the same 4I per token as the fused SwiGLU.
    With LoRA the base is frozen, so autograd keeps only what a gradient flows through: a projection's input only
    where an adapter reads it (each adapter its own compute-dtype copy under autocast), and in the first layer
    (`first`: its input, the embeddings' output, needs no gradient) nothing upstream of the first adapter. Not
    modelled: the first layer with adapters on only some of q/k/v or of gate/up, or on down_proj alone, saves less
    than counted (a frozen partner's output needs no gradient), so its count is an upper bound there."""
    e, r, n, d = work.e, work.stream_bytes, mb.tokens, shape.head_dim
    autocast = e < r
    mlp_tokens = mb.predicted if last else n
    adapted = set(shape.lora_targets)
    frozen = shape.lora
    # where a gradient flows: into the layer's input, out of q/k/v, out of the attention block, out of gate/up
    live_in = not (frozen and first)
    live_qkv = live_in or shape.lora_qkv
    live_attention = live_qkv or "o_proj" in adapted
    live_gate_up = live_attention or shape.lora_gate_up

    def norm(tokens: int, live: bool, readers: list[str]) -> int:
        """A norm's own saved tensors (when a gradient flows into its input) and its output as the projections
        read it: one (fused) read when they train, else one per adapter (autocast casts each read anew)."""
        own = norm_saved(tokens, shape.hidden, r) if live else 0
        reads = 1 if not frozen else sum(m in adapted for m in readers) if autocast else int(
            any(m in adapted for m in readers))
        return own + reads * tokens * shape.hidden * (e if autocast else r)

    total = norm(n, live_in, ["q_proj", "k_proj", "v_proj"])
    qkv_weights = 0 if shape.lora_qkv else shape.qkv_elements  # the fused copy, or under autocast the casts
    qkv_weights += shape.qkv_elements if shape.lora_qkv and autocast else 0
    total += qkv_weights * e if live_in else 0
    if live_qkv:
        total += attention_saved(shape, mb, work)
        total += shape.heads * d * shape.hidden * e if autocast else 0  # o_proj's cast weight
    if not frozen or "o_proj" in adapted:
        total += n * shape.heads * d * e
    total += norm(mlp_tokens, live_attention, ["gate_proj", "up_proj"])
    gate_up_weights = (0 if shape.lora_gate_up else shape.gate_up_elements) + (
        shape.gate_up_elements if shape.lora_gate_up and autocast else 0)
    total += gate_up_weights * e if live_attention else 0
    if live_gate_up:
        total += mlp_tokens * 3 * shape.intermediate * e + (shape.intermediate * shape.hidden * e if autocast else 0)
    if not frozen or "down_proj" in adapted:
        total += mlp_tokens * shape.intermediate * e
    mlp_modules = {"gate_proj", "up_proj", "down_proj"}
    total += shape.lora_rank * e * (n * len(adapted - mlp_modules) + mlp_tokens * len(adapted & mlp_modules))
    return total


def norm_saved(tokens: int, hidden: int, stream: int) -> int:
    """Bytes an RMSNorm keeps for its backward beside its output: on a float32 stream (kernels._RMSNorm) the
    normalised input and 1/rms; on a narrower one the transformers module, which normalises in float32, keeps its
    float32 input, 1/rms and the normalised values cast back to the stream's dtype."""
    return tokens * (hidden * 4 + 4) if stream == 4 else tokens * (hidden * (4 + stream) + 4)


def activations(shape: ModelShape, mb: MicroBatch, work: Workload, checkpointing: bool) -> dict[str, int]:
    """Saved activations of a micro-batch's forward: per layer, or with checkpointing (torch.utils.checkpoint per
    decoder layer, podsrl/models/packed.py) each layer's input, the [N, D] residual stream (the recomputed layer's
    own tensors are in `update_peak`'s transient); the stream's shared tensors (rotary cos and sin [N, d] twice,
    index tensors); the final norm and the head's saved hidden states [T, D], log-sum-exp and entropy. The stream,
    the final norm and the head's input are in the master dtype, under FSDP2 in the compute dtype its parameters are
    gathered in (Workload.stream_bytes)."""
    r, L = work.stream_bytes, shape.layers
    shared = 2 * mb.tokens * shape.head_dim * r + 8 * (3 * mb.tokens + 2 * mb.predicted)
    head = norm_saved(mb.predicted, shape.hidden, r) + mb.predicted * (shape.hidden * r + 8)
    if checkpointing:
        layers = L * mb.tokens * shape.hidden * r
    else:
        first, middle = layer_activations(shape, mb, work, first=True), layer_activations(shape, mb, work)
        last = layer_activations(shape, mb, work, last=True, first=L == 1)
        layers = last + (first + (L - 2) * middle if L > 1 else 0)
    return {"layers": layers, "shared": shared, "head": head}


def backward_transient(shape: ModelShape, mb: MicroBatch, work: Workload) -> dict[str, int]:
    """The largest buffer set live on top of the saved activations, at the end of the forward or in the backward:
    - the head's forward (logprobs._FromHidden, float32 outside autocast): one chunk of update.logits_chunk x V
      float32 logits and torch.logsumexp's two temporaries of its size;
    - the head's backward: that chunk's recomputed logits and probabilities (and under autocast their
      compute-dtype cast), the [V, D] weight gradient (and the compute-dtype product added to it; under FSDP2 the
      compute-dtype gradient and its float32 copy for the reduce-scatter), the [T, D] hidden gradient in the
      stream's dtype;
    - a layer's attention (CPU): the gradient of the scores through the softmax, masking and scaling, two
      float32 tensors of the largest block's scores at a time;
    - a layer's MLP: the [N, 2I] gate/up gradient, the [N, I] product, the fused [2I, D] weight's gradient and
      the [N, D] input gradient."""
    e, p, chunk, v = work.e, work.p, min(work.logits_chunk, mb.predicted), shape.vocab
    narrow = e < p  # autocast
    head_weight_grad = 0 if shape.lora else v * shape.hidden * (p + (e if narrow else 0))
    head_backward = (head_weight_grad + mb.predicted * shape.hidden * work.stream_bytes
                     + chunk * v * (8 + (e if narrow else 0)))
    scores = max(mb.groups * mb.prompt_length**2, mb.rows * mb.width * (mb.prompt_length + mb.width)) * shape.heads
    attention = 2 * scores * 4 if work.device == "cpu" else 0
    mlp = mb.tokens * (3 * shape.intermediate + shape.hidden) * e + 2 * shape.intermediate * shape.hidden * e
    return {"head_forward": 3 * chunk * v * 4, "head": head_backward, "attention": attention, "mlp": mlp}


def model_state(shape: ModelShape, work: Workload) -> dict[str, int]:
    """Resident through the update on the device: master weights, gradients and AdamW's two moments of the trained
    parameters (model.dtype; LoRA adapters stay float32), the reference model (a second copy, model.dtype) when
    beta > 0 without LoRA (with LoRA the reference is the policy with its adapters disabled: no copy). FSDP2 holds
    1/N of each; with train.cpu_offload none of it is on the device (`host_memory`)."""
    if work.offloaded:
        return dict.fromkeys(("weights", "gradients", "optimizer", "reference"), 0)
    return sharded_state(shape, work)


def sharded_state(shape: ModelShape, work: Workload) -> dict[str, int]:
    """model_state's terms as a rank holds them, wherever they live: whole (ddp), or 1/N of each (fsdp)."""
    trained = shape.trained_params * (4 if shape.lora else work.p)
    whole = {
        "weights": (shape.params - shape.trained_params) * work.p + trained,  # LoRA: frozen base + float32 adapters
        "gradients": trained,
        "optimizer": ADAM_STATES * trained,
        "reference": shape.params * work.p if work.beta > 0 and not shape.lora else 0,
    }
    return {k: -(-v // work.world_size) for k, v in whole.items()} if work.sharded else whole


def gathered_layers(shape: ModelShape, work: Workload) -> int:
    """FSDP2's unsharded parameters during the update, in the compute dtype: the root module's (embeddings, norm,
    head: gathered for the whole forward and backward), the layer running and the next one prefetched, and in the
    backward one layer's full gradient in float32 (train.fsdp_reduce_dtype) before its reduce-scatter."""
    if not work.sharded:
        return 0
    return (shape.root_params + 2 * shape.layer_params) * work.e + shape.layer_params * 4


def host_memory(shape: ModelShape, work: Workload) -> dict[str, int]:
    """Host (CPU) memory of the rank that needs most: what rank 0 loads the model through (startup.host_load: one
    tensor at a time under FSDP2, else the whole model in the master dtype; under torchrun the others receive it on
    their device), and with train.cpu_offload the sharded state kept there."""
    offloaded = sum(sharded_state(shape, work).values()) if work.offloaded else 0
    return {"load": host_load(shape, work), "offloaded_state": offloaded}


def update_peak(shape: ModelShape, work: Workload, rows: int, checkpointing: bool) -> dict[str, int]:
    """Terms of the update's peak with micro-batches of `rows` rows (optim.micro_batch_size): the state, the saved
    activations and the largest transient. With one micro-batch the gradients do not exist yet while the
    activations do (they appear as the backward frees them), so the larger of the two counts; with more, the
    earlier micro-batches' gradients are there throughout."""
    state = model_state(shape, work)
    mb = MicroBatch.of(min(rows, work.trained_rows), work.m, work)
    act = activations(shape, mb, work, checkpointing)
    transient = backward_transient(shape, mb, work)
    if checkpointing:  # a layer's backward runs on its recomputed activations
        layer = layer_activations(shape, mb, work)
        transient = {"head": max(transient["head"], transient["head_forward"]),
                     "layer": layer + max(transient["attention"], transient["mlp"])}
    terms = {**{k: v for k, v in state.items() if k != "gradients"}, "activations": sum(act.values()),
             "transient": max(transient.values()), "runtime": RUNTIME_BYTES[work.device]["update"]}
    if work.sharded:  # and FSDP2's generation copy, kept by its data-parallel object whatever the engine
        terms["gathered"] = gathered_layers(shape, work)
        terms["engine_weights"] = engine_weights(shape, work)
    if work.training_run:  # the fast engine keeps its weights copy and the last call's fused weights
        terms["fused_weights"] = engine_fused_weights(shape, work)
        terms["engine_weights"] = engine_weights(shape, work)
        terms["generator_weights"] = generator_weights(shape, work)
        if work.async_generator == "in_process":  # the next batch is sampled meanwhile: its cache and workspace
            terms.update(generation_in_flight(shape, work))
        elif work.kept_decode_state:
            terms["decode_state"] = kept_decode_state(shape, work)
    one_micro_batch = rows >= work.trained_rows
    if one_micro_batch and state["gradients"] > terms["activations"] + terms["transient"]:
        terms["gradients"], terms["activations"], terms["transient"] = state["gradients"], 0, 0
    else:
        terms["gradients"] = 0 if one_micro_batch else state["gradients"]
    return terms


# ---- generation ----


def engine_weights(shape: ModelShape, work: Workload) -> int:
    """The weights the engine samples from beside the masters, in the compute dtype: the fast engine's own copy,
    made when the compute dtype is narrower than the masters; under FSDP2 the unsharded generation copy
    (podsrl/fsdp.py), always. Under train.async it is the eval engine's (podsrl/run/async_generation.py: it samples the
    learner's current weights, which the generator's older copy, generator_weights, does not hold)."""
    return shape.params * work.e if work.compute_dtype != work.dtype or work.sharded else 0


def engine_has_own_copy(work: Workload) -> bool:
    """The weights the fast engine samples are a copy only sampled from: its own, made when the masters are wider
    than the compute dtype (podsrl/build.py sampling_dtype), or FSDP2's generation copy (podsrl/fsdp.py), whose
    projections share_fused_weights makes views of the fused tensors too."""
    return work.compute_dtype != work.dtype or work.sharded


def engine_fused_weights(shape: ModelShape, work: Workload) -> int:
    """The decode step's fused q/k/v and gate/up weights (models/decode.py DecodeStack.begin), for an engine that
    samples through them (EngineMemory.fused_weights): concatenated copies when it samples weights it does not own;
    nothing when it has its own copy, whose projections are views of the fused tensors (models/llama.py
    share_fused_storage)."""
    if not work.engine.fused_weights or engine_has_own_copy(work):
        return 0
    return shape.layers * shape.fused_weights * work.engine_e


def generator_weights(shape: ModelShape, work: Workload) -> int:
    """train.async's generator copy (podsrl/run/async_generation.py async_engines): in the fast engine's dtype, its
    projections the decode step's fused weights; for the Ray pool a full copy in the master dtype."""
    return {"in_process": shape.params * work.engine_e, "workers": shape.params * work.p}.get(work.async_generator, 0)


def generation_in_flight(shape: ModelShape, work: Workload) -> dict[str, int]:
    """What a generate call allocates for its rows in flight, one wave of work.generation_rows (see
    generation_peak): the step's KV cache and state, the prefill's cache, and the larger workspace; for an engine
    without a KV cache (EngineMemory.kv_cache) the workspace of a forward over the rows' whole sequences."""
    if not work.engine.kv_cache:
        return {"kv_cache": 0, "workspace": whole_sequence_workspace(shape, work)}
    rows, length, e = work.generation_rows, kept_positions(work), work.engine_e
    kv_position = shape.layers * 2 * shape.kv_heads * shape.head_dim * e
    prompts = min(work.rank_prompts, rows)  # distinct prompts prefilled at once (a wave's)
    step_cache, step_workspace = decode_step_terms(shape, work)
    prefill_tokens = prompts * work.prompt_length
    prefill = forward_workspace(shape, prompts, work.prompt_length, e)
    # episodes: the session's copies of the rank's live episodes' caches (engines/continuation.py), kept between
    # turns and through the next turn's call
    sessions = kv_position * work.rank_rows * length if work.episodes else 0
    return {"kv_cache": step_cache + kv_position * prefill_tokens + sessions,
            "workspace": max(step_workspace, prefill)}


def forward_workspace(shape: ModelShape, sequences: int, length: int, e: int) -> int:
    """A forward's workspace over `sequences` of `length` tokens without a cache (the prefill's): the [G, H, L, L]
    float32 attention scores twice, and per token the MLP's gate/up and product, q/k/v and two hidden-sized
    tensors in the compute dtype."""
    return (2 * sequences * shape.heads * length**2 * 4
            + sequences * length * (3 * shape.intermediate + shape.qkv_width + 2 * shape.hidden) * e)


def whole_sequence_workspace(shape: ModelShape, work: Workload) -> int:
    """An engine without a KV cache runs each step's forward over every row in flight's whole sequence (at most
    prompt + completion tokens): that forward's workspace, and its logits [rows, L, V] at every position."""
    rows, length, e = work.generation_rows, work.prompt_length + work.completion_length, work.engine_e
    return forward_workspace(shape, rows, length, e) + rows * length * shape.vocab * e


def decode_step_terms(shape: ModelShape, work: Workload) -> tuple[int, int]:
    """(the step's KV cache and state, a decode step's workspace) at work.generation_rows rows: the StepCache and
    StepState's per-column valid (bool) and uniforms (float64) and row vectors (engines/decode_step.py); the logits
    [rows, V] (and their float32 copy), float32 log-softmax and shifted exponentials, the sampling's float64 CDF
    (top-p: a sort, its int64 order and probabilities) and the attention scores over the cache."""
    rows, length, e = work.generation_rows, kept_positions(work), work.engine_e
    kv_position = shape.layers * 2 * shape.kv_heads * shape.head_dim * e
    state = rows * length * (1 + 8) + rows * 8 * 4
    sampling = rows * shape.vocab * (e + (4 if e < 4 else 0) + 4 * 2 + 8 + (4 * 2 + 8 if work.top_p < 1 else 0))
    return kv_position * rows * length + state, sampling + 2 * rows * shape.heads * length * 4


def kept_decode_state(shape: ModelShape, work: Workload) -> int:
    """What the fast engine keeps between generate calls under CUDA graphs (engines/fast.py `_step_state`): the step
    state and KV cache, and the graphs' pool (decode_step.py CudaGraphs), the largest captured step's workspace."""
    return sum(decode_step_terms(shape, work))


def decode_state_fits(shape: ModelShape, work: Workload, budget: int, rows: int, checkpointing: bool) -> bool:
    """Whether the update in micro-batches of `rows` rows fits `budget` beside the engine's kept decode state."""
    kept = replace(work, kept_decode_state=True)
    return sum(update_peak(shape, kept, max(1, rows), checkpointing).values()) <= budget


def kept_positions(work: Workload) -> int:
    """Cache positions of a row: prompt + completion, on CUDA rounded up to the engine's cache block (its buckets)."""
    length, block = work.prompt_length + work.completion_length, work.engine.cache_block
    return -(-length // block) * block if work.device == "cuda" else length


def rows_in_flight(shape: ModelShape, work: Workload, available: int) -> int:
    """The most rows (at most a rank's P x n / N, at least 1) whose in-flight generation fits `available` bytes; on CUDA a power
    of two (the fast engine's buckets keep that many rows). The fast engine's default max_rows."""
    def fits(rows: int) -> bool:
        return sum(generation_in_flight(shape, replace(work, rows_in_flight=rows)).values()) <= available

    lo, hi = 1, work.rank_rows
    while lo < hi:
        mid = (lo + hi + 1) // 2
        lo, hi = (mid, hi) if fits(mid) else (lo, mid - 1)
    return 1 << (lo.bit_length() - 1) if work.device == "cuda" else lo


def generation_peak(shape: ModelShape, work: Workload) -> dict[str, int]:
    """Terms of generation's peak (podsrl/engines/fast.py, work.generation_rows rows in flight):
    - the master weights; in a training run also the AdamW state (the trainer frees the gradients after each update:
      podsrl/run/trainer.py); the reference model;
    - the engine's weights copy in the compute dtype, when it differs from the master dtype;
    - the fused q/k/v and gate/up weights of every layer, unless the engine has its own copy (engine_fused_weights);
    - train.async's generator copy (generator_weights);
    - the KV cache (models/static_cache.py StepCache): L x 2 x Hkv x d x (Lp + Lc) x rows x e (on CUDA the
      positions rounded up to the cache block), the step state, plus the prefill cache of the distinct prompts it is
      loaded from (SlotLayer, Lp positions);
    - the larger workspace: a decode step's (decode_step_terms) or the prefill's [G, H, Lp, Lp] float32 scores
      twice and its MLP."""
    state = model_state(shape, work)
    state["gradients"] = 0
    if not work.training_run:
        state["optimizer"] = 0
    return {
        **state,
        "engine_weights": engine_weights(shape, work),
        "fused_weights": engine_fused_weights(shape, work),
        "generator_weights": generator_weights(shape, work) if work.training_run else 0,
        **generation_in_flight(shape, work),
        "runtime": RUNTIME_BYTES[work.device]["generation"],
    }


# ---- the plan ----


@dataclass
class MemoryPlan:
    shape: ModelShape
    work: Workload
    memory: int  # bytes of the device
    reserve: float  # share kept free for what is not predicted
    generation: dict[str, int]
    update: dict[bool, dict[str, int]]  # checkpointing -> terms at the recommended (or smallest) micro-batch
    micro_batch: dict[bool, int]  # checkpointing -> largest micro-batch that fits (0: none)
    host: dict[str, int]  # host memory of the rank that needs most, rank 0 (host_memory)
    startup: dict[str, int] = field(default_factory=dict)  # rank 0's start-up peak (startup_terms)

    @property
    def budget(self) -> int:
        return int(self.memory * (1 - self.reserve))

    def micro_batch_tokens(self, checkpointing: bool) -> int:
        """optim.micro_batch_tokens of the largest micro-batch, its rows at full length: activations grow with the
        tokens (attention with tokens x keys, which full-length rows maximise), so any cut under it fits too."""
        return self.micro_batch[checkpointing] * (self.work.prompt_length + self.work.completion_length)

    @property
    def fits(self) -> bool:
        """Start-up fits, generation fits (at least one row at a time) and so does an update micro-batch of at least
        one row."""
        return (sum(self.startup.values()) <= self.budget and sum(self.generation.values()) <= self.budget
                and max(self.micro_batch.values()) > 0)


def largest_micro_batch(shape: ModelShape, work: Workload, budget: int, checkpointing: bool) -> int:
    """The largest micro-batch (rows) whose update peak fits `budget` bytes, at most the trained rows of a step;
    0 when not even one row fits. The peak grows with the rows, so a bisection finds it."""
    def fits(rows: int) -> bool:
        return sum(update_peak(shape, work, rows, checkpointing).values()) <= budget

    lo, hi = 0, work.trained_rows
    while lo < hi:
        mid = (lo + hi + 1) // 2
        lo, hi = (mid, hi) if fits(mid) else (lo, mid - 1)
    return lo


def make_plan(shape: ModelShape, work: Workload, memory: int, reserve: float = RESERVE) -> MemoryPlan:
    """The plan: generation's rows in flight are what the budget holds beside the resident state (the fast engine's
    default max_rows), then the largest micro-batch of each update."""
    budget = int(memory * (1 - reserve))
    work = with_rows_in_flight(shape, work, budget)
    released = replace(work, kept_decode_state=False)
    micro = {c: largest_micro_batch(shape, released, budget, c) for c in (False, True)}
    # the engine's decode state is kept (counted) where it costs the update no rows of its largest micro-batch
    update = {c: update_peak(shape, work if micro[c] and decode_state_fits(shape, work, budget, micro[c], c)
                             else released, max(1, micro[c]), c) for c in (False, True)}
    return MemoryPlan(shape, work, memory, reserve, generation_peak(shape, work), update, micro,
                      host_memory(shape, work), startup_terms(shape, work))


def with_rows_in_flight(shape: ModelShape, work: Workload, budget: int) -> Workload:
    """`work` with its rows in flight set (when 0, for an engine that decodes in waves) to what `budget` holds beside
    generation's resident state."""
    if work.rows_in_flight or not work.engine.waves:
        return work
    resident = {k: v for k, v in generation_peak(shape, work).items() if k not in ("kv_cache", "workspace")}
    return replace(work, rows_in_flight=rows_in_flight(shape, work, budget - sum(resident.values())))


def startup_terms(shape: ModelShape, work: Workload) -> dict[str, int]:
    """Rank 0's start-up peak (podsrl/planning/startup.py) over what this plan keeps resident from then on: the
    weights and reference (model_state), the engine's weights copy and train.async's generator copy."""
    state = model_state(shape, work)
    resident = {"weights": state["weights"], "reference": state["reference"],
                "engine_weights": engine_weights(shape, work),
                "generator_weights": generator_weights(shape, work) if work.training_run else 0}
    return startup_peak(shape, work, resident)
