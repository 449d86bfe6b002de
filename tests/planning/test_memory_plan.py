"""`podsrl plan --memory`: the activation count against what the real layer saves for its backward, the model shape
from a meta-device build, the terms by hand, the micro-batch search, and the command line (config.json, model
directory, hub id not in the cache, bad sizes). The prediction against measured peaks is
benchmarks/memory_plan_check.py (docs/results.md)."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch
from transformers import Qwen2Config, Qwen2ForCausalLM

from podsrl.batch import Problem, RolloutBatch
from podsrl.cli import main
from podsrl.errors import UserError
from podsrl.planning import memory as mp
from podsrl.planning import workload as mw
from podsrl.update.shared_prompt import SharedPromptForward

pytestmark = pytest.mark.usefixtures("one_thread")


def qwen2(hidden=64, layers=2, heads=4, kv_heads=2, vocab=500) -> Qwen2Config:
    return Qwen2Config(vocab_size=vocab, hidden_size=hidden, intermediate_size=3 * hidden, num_hidden_layers=layers,
                       num_attention_heads=heads, num_key_value_heads=kv_heads, max_position_embeddings=256,
                       tie_word_embeddings=True, pad_token_id=0, eos_token_id=1)


def saved_bytes(config: Qwen2Config, prompts: int, m: int, prompt_length: int, completion_length: int,
                compute: str = "float32", lora_targets: tuple[str, ...] = (), weights: str = "float32",
                checkpointing: bool = False) -> int:
    """Bytes of the distinct floating-point tensors (parameters excepted) the real shared-prompt forward saves for its
    backward, under autocast to `compute` as the updater runs it over float32 masters, with LoRA of rank 4 on
    `lora_targets`; with `weights="bfloat16"` the parameters are bfloat16, as FSDP2 gathers them, and nothing is
    autocast; with `checkpointing`, per decoder layer (update.activation_checkpointing). Index and mask tensors are left out, as the formula leaves them out: they are views of the
    micro-batch's plan, one packed buffer per dtype (podsrl/models/transfer.py) that lives through the micro-batch
    whether or not autograd keeps a view of it."""
    torch.manual_seed(0)
    model = Qwen2ForCausalLM(config).to(getattr(torch, weights))
    if lora_targets:
        from podsrl.lora import apply_lora

        model = apply_lora(model, rank=4, alpha=8, dropout=0.0, target_modules=list(lora_targets))
    rows, vocab = prompts * m, config.vocab_size
    batch = RolloutBatch(
        problems=[Problem(uid=str(i), prompt="", answer="") for i in range(prompts)],
        group_index=torch.arange(prompts).repeat_interleave(m),
        prompt_ids=torch.randint(3, vocab, (prompts, prompt_length)).repeat_interleave(m, 0),
        prompt_mask=torch.ones(rows, prompt_length, dtype=torch.long),
        completion_ids=torch.randint(3, vocab, (rows, completion_length)),
        completion_mask=torch.ones(rows, completion_length), truncated=torch.zeros(rows, dtype=torch.bool),
        rewards=torch.zeros(rows))
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    storages: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        if t.is_floating_point() and t.untyped_storage().data_ptr() not in params:
            storages[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    autocast = torch.autocast("cpu", dtype=torch.bfloat16, enabled=compute == "bfloat16" and weights == "float32")
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), autocast:
        SharedPromptForward(model, 1024, checkpointing)(batch, torch.arange(rows), completion_length,
                                                        torch.device("cpu"), 1.0)
    return sum(storages.values())


@pytest.mark.parametrize("compute", ["float32", "bfloat16"])
@pytest.mark.parametrize("config, prompts, m, lp, lc", [
    (qwen2(), 2, 4, 16, 12),
    (qwen2(hidden=128, layers=3), 3, 5, 20, 30),
    (qwen2(hidden=64, layers=4, heads=8, kv_heads=2), 1, 8, 50, 7),
])
def test_saved_activations_match_what_the_layer_saves(config, prompts, m, lp, lc, compute):
    """The formula counts each tensor the layer keeps for its backward, float32 and under bfloat16 autocast; within
    1.5% of the real forward's saved floating-point storages (what it leaves out: the shapes' rounding, <1% in
    these shapes). A change to the layer that saves another [N, D] tensor moves the count by more than that."""
    work = mw.Workload(prompts, m, m, lp, lc, compute_dtype=compute, device="cpu")
    predicted = sum(mp.activations(mw.model_shape(config), mp.MicroBatch.of(prompts * m, m, work), work,
                                   checkpointing=False).values())
    assert predicted == pytest.approx(saved_bytes(config, prompts, m, lp, lc, compute), rel=0.015)


@pytest.mark.parametrize("compute", ["float32", "bfloat16"])
@pytest.mark.parametrize("targets", [("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"),
                                     ("q_proj", "k_proj", "v_proj", "o_proj"), ("o_proj",), ("gate_proj", "up_proj")])
def test_saved_activations_match_with_lora_on_any_modules(targets, compute):
    """LoRA on the MLP too (the Qwen presets' seven projections): over a frozen base autograd keeps a projection's
    input only where an adapter reads it, and the first layer nothing upstream of its first adapter; the unfused
    gate/up and each adapter's down-projection; as the real forward saves them, within the same 1.5%."""
    config, prompts, m, lp, lc = qwen2(), 2, 4, 16, 12
    work = mw.Workload(prompts, m, m, lp, lc, compute_dtype=compute, device="cpu")
    shape = mw.model_shape(config, 4, targets)
    predicted = sum(mp.activations(shape, mp.MicroBatch.of(prompts * m, m, work), work, checkpointing=False).values())
    assert predicted == pytest.approx(saved_bytes(config, prompts, m, lp, lc, compute, targets), rel=0.015)


def test_model_shape_counts_the_real_parameters_and_lora_adapters():
    config = qwen2()
    real = Qwen2ForCausalLM(config)
    shape = mw.model_shape(config)
    assert shape.params == shape.trained_params == sum(p.numel() for p in real.parameters())
    assert (shape.layers, shape.hidden, shape.heads, shape.kv_heads, shape.head_dim) == (2, 64, 4, 2, 16)
    assert shape.qkv_bias  # Qwen2's q/k/v have biases
    from podsrl.lora import apply_lora

    adapted = apply_lora(Qwen2ForCausalLM(config), rank=4, target_modules=["q_proj", "v_proj"])
    lora = mw.model_shape(config, 4, ["q_proj", "v_proj"])
    assert lora.trained_params == sum(p.numel() for p in adapted.parameters() if p.requires_grad)
    assert lora.lora_qkv and lora.fused_weights == 2 * config.intermediate_size * config.hidden_size
    seven = mw.model_shape(config, 4, mw.LINEAR_MODULES)  # the Qwen presets' LoRA: nothing is fused any more
    everywhere = apply_lora(Qwen2ForCausalLM(config), rank=4, target_modules=list(mw.LINEAR_MODULES))
    assert seven.trained_params == sum(p.numel() for p in everywhere.parameters() if p.requires_grad)
    assert seven.lora_gate_up and seven.fused_weights == 0 and len(seven.lora_targets) == 7
    assert shape.layer_params == sum(p.numel() for p in real.model.layers[0].parameters())
    with pytest.raises(UserError, match="linear projections"):
        mw.model_shape(config, 4, ["lm_head"])


def test_lora_weights_are_a_bfloat16_base_and_float32_adapters():
    """The weights term is what apply_lora leaves on a bfloat16 model: the frozen base in bfloat16, the adapters in
    float32 (peft), byte for byte."""
    from podsrl.lora import apply_lora

    config = qwen2()
    adapted = apply_lora(Qwen2ForCausalLM(config).to(torch.bfloat16), rank=4, target_modules=list(mw.LINEAR_MODULES))
    shape = mw.model_shape(config, 4, mw.LINEAR_MODULES)
    work = mw.Workload(prompts=2, n=4, m=4, prompt_length=16, completion_length=16, dtype="bfloat16",
                       compute_dtype="bfloat16")
    assert mp.model_state(shape, work)["weights"] == sum(p.numel() * p.element_size() for p in adapted.parameters())


def test_a_reference_model_is_counted_without_lora_only():
    """beta > 0 keeps a second copy of the weights; with LoRA the reference is the policy, its adapters disabled."""
    config = qwen2()
    work = mw.Workload(prompts=2, n=4, m=4, prompt_length=16, completion_length=16, beta=0.04)
    full, lora = mw.model_shape(config), mw.model_shape(config, 4, ["q_proj", "v_proj"])
    assert mp.model_state(full, work)["reference"] == full.params * 4
    assert mp.model_state(lora, work)["reference"] == 0


def test_terms_by_hand_for_a_1_5b_shaped_model():
    """Qwen2.5-1.5B's shape (28 layers, hidden 1536, 12/2 heads of 128, MLP 8960, vocabulary 151936), bf16 compute
    with float32 masters: the KV cache and the state by the formulas in the module docstring."""
    config = Qwen2Config(vocab_size=151936, hidden_size=1536, intermediate_size=8960, num_hidden_layers=28,
                         num_attention_heads=12, num_key_value_heads=2, tie_word_embeddings=True)
    shape = mw.model_shape(config)
    assert 1.5e9 < shape.params < 1.6e9
    work = mw.Workload(prompts=8, n=16, m=16, prompt_length=256, completion_length=1024, compute_dtype="bfloat16")
    gen = mp.generation_peak(shape, work)  # the engine samples from a bfloat16 copy of the float32 masters
    # the step's cache of every row at 1,280 positions, the prefill's of the 8 prompts at 256; the state's valid
    # flags and uniforms per position and its row vectors
    assert gen["kv_cache"] == 28 * 2 * 2 * 128 * 2 * (1280 * 128 + 256 * 8) + 128 * 1280 * 9 + 128 * 32
    assert gen["engine_weights"] == shape.params * 2
    assert gen["fused_weights"] == 0  # the copy's projections are views of the fused tensors
    assert gen["weights"] == shape.params * 4 and gen["optimizer"] == 2 * shape.params * 4
    assert gen["gradients"] == 0  # the update frees them when it ends
    same = mp.generation_peak(shape, dataclasses.replace(work, compute_dtype="float32"))  # no copy, fp32 cache
    state = 128 * 1280 * 9 + 128 * 32
    assert same["engine_weights"] == 0 and same["kv_cache"] - state == (gen["kv_cache"] - state) * 2
    assert same["fused_weights"] == 28 * shape.fused_weights * 4  # sampled from the masters: concatenated copies
    upd = mp.update_peak(shape, work, rows=4, checkpointing=False)
    assert upd["gradients"] == shape.params * 4  # 32 micro-batches: the earlier ones' gradients are there
    with_ckpt = mp.update_peak(shape, work, rows=4, checkpointing=True)
    assert with_ckpt["activations"] < upd["activations"] / 5  # 28 layers' activations -> their inputs + one layer


def test_train_async_adds_the_generator_copy_and_overlaps_generation_with_the_update():
    """In process: the generator's copy in the engine's dtype, and the update's peak holds the batch being generated
    meanwhile (so a smaller micro-batch fits); with the Ray pool the copy is in the master dtype and generation is
    elsewhere. Read through the CLI's own mapping from train.async and rollout.engine."""
    from podsrl.config import load_config
    from podsrl.memory_plan import workload_from_config

    config = Qwen2Config(vocab_size=151936, hidden_size=1536, intermediate_size=8960, num_hidden_layers=28,
                         num_attention_heads=12, num_key_value_heads=2, tie_word_embeddings=True)
    shape = mw.model_shape(config)
    base = ["rollout.prompts_per_step=8", "rollout.n=16", "rollout.max_new_tokens=1024", "model.compute_dtype=bfloat16"]
    sync, in_process, ray = (workload_from_config(load_config("podsrl/configs/grpo.yaml", base + extra), 256, "cuda")
                             for extra in ([], ["train.async.enabled=true"],
                                           ["train.async.enabled=true", "rollout.engine=ray"]))
    assert (sync.async_generator, in_process.async_generator, ray.async_generator) == ("none", "in_process", "workers")
    gen, gen_async = mp.generation_peak(shape, sync), mp.generation_peak(shape, in_process)
    assert gen["generator_weights"] == 0 and gen_async["generator_weights"] == shape.params * 2
    assert gen_async["engine_weights"] == shape.params * 2  # the eval engine's copy of the learner's weights
    assert mp.generation_peak(shape, ray)["generator_weights"] == shape.params * 4
    released = dataclasses.replace(sync, kept_decode_state=False)  # the synchronous engine's state freed before it
    upd, upd_async = (mp.update_peak(shape, w, rows=8, checkpointing=False) for w in (released, in_process))
    assert "kv_cache" not in upd and upd_async["kv_cache"] == gen["kv_cache"]
    assert upd_async["workspace"] == gen["workspace"]
    assert sum(upd_async.values()) - sum(upd.values()) == shape.params * 2 + gen["kv_cache"] + gen["workspace"]
    assert "kv_cache" not in mp.update_peak(shape, ray, rows=8, checkpointing=False)
    budget = 72 * 2**30
    assert mp.largest_micro_batch(shape, in_process, budget, False) < mp.largest_micro_batch(shape, sync, budget, False)


def test_the_engines_decode_state_is_counted_through_the_update_or_freed_before_it():
    """Memory is a contract: the fast engine's decode state under CUDA graphs (a synchronous run on CUDA) is either
    counted in the update's peak, its step cache and state and the graphs' pool (a decode step's workspace), or
    freed before the update. The plan keeps it beside each mode's largest micro-batch where that still fits (the
    micro-batch never shrinks for it); the trainer decides the same at its configured micro-batch."""
    from podsrl.config import load_config
    from podsrl.memory_plan import kept_decode_rows, workload_from_config

    config = Qwen2Config(vocab_size=151936, hidden_size=1536, intermediate_size=8960, num_hidden_layers=28,
                         num_attention_heads=12, num_key_value_heads=2, tie_word_embeddings=True)
    shape = mw.model_shape(config)
    base = ["rollout.prompts_per_step=8", "rollout.n=8", "rollout.max_new_tokens=256", "model.compute_dtype=bfloat16"]
    cfg = load_config("podsrl/configs/grpo.yaml", base)
    work = workload_from_config(cfg, 64, "cuda")
    assert work.kept_decode_state
    assert not workload_from_config(cfg, 64, "cpu").kept_decode_state  # eager on the CPU: nothing kept
    run_ahead = load_config("podsrl/configs/grpo.yaml", base + ["train.async.enabled=true"])
    assert not workload_from_config(run_ahead, 64, "cuda").kept_decode_state  # generation_in_flight counts it
    # 64 rows of 64 + 256 positions (whole cache blocks): the cache, the state, the logits and sampling, the scores
    by_hand = (28 * 2 * 2 * 128 * 2 * 64 * 320 + 64 * 320 * 9 + 64 * 32
               + 64 * 151936 * (2 + 4 + 8 + 8) + 2 * 64 * 12 * 320 * 4)
    assert mp.kept_decode_state(shape, work) == by_hand
    kept, released = (mp.update_peak(shape, dataclasses.replace(work, kept_decode_state=k), 8, True)
                      for k in (True, False))
    assert kept["decode_state"] == by_hand and "decode_state" not in released
    assert sum(kept.values()) - sum(released.values()) == by_hand
    plan, without = (mp.make_plan(shape, w, 40 * 2**30)
                     for w in (work, dataclasses.replace(work, kept_decode_state=False)))
    assert plan.micro_batch == without.micro_batch == {False: 6, True: 64}
    assert "decode_state" in plan.update[True] and "decode_state" not in plan.update[False]  # 6 rows fill the budget
    assert all(sum(plan.update[c].values()) <= plan.budget for c in (False, True))
    for checkpointing, fits in ((True, True), (False, False)):  # the configured micro-batch of 6 rows: 35.6 GiB
        configured = load_config("podsrl/configs/grpo.yaml", base + [
            "optim.micro_batch_size=6", f"update.activation_checkpointing={str(checkpointing).lower()}"])
        assert (kept_decode_rows(configured, config, 64, "cuda", 1, 40 * 2**30, 6) > 0) is fits


def test_the_default_pods_step_at_1_5b_generates_in_waves_that_fit():
    """32 prompts x 64 rollouts, 256 + 1,024 tokens, bf16 compute over float32 masters, 80 GiB: all 2,048 rows at
    once would not fit; the plan's generation is one wave, the most rows (a power of two, the engine's bucket) that
    fit beside the resident state, and the update's recommended micro-batches fit too."""
    from podsrl.config import load_config
    from podsrl.memory_plan import workload_from_config

    config = Qwen2Config(vocab_size=151936, hidden_size=1536, intermediate_size=8960, num_hidden_layers=28,
                         num_attention_heads=12, num_key_value_heads=2, tie_word_embeddings=True)
    shape = mw.model_shape(config)
    work = workload_from_config(load_config("podsrl/configs/pods.yaml", ["rollout.max_new_tokens=1024"]), 256, "cuda")
    assert (work.prompts, work.n, work.compute_dtype) == (32, 64, "bfloat16")
    plan = mp.make_plan(shape, work, 80 * 2**30)
    rows = plan.work.generation_rows
    assert sum(mp.generation_peak(shape, work).values()) > plan.budget  # all at once
    assert rows & (rows - 1) == 0 and rows < 2048 and sum(plan.generation.values()) <= plan.budget
    twice = dataclasses.replace(work, rows_in_flight=2 * rows)
    assert sum(mp.generation_peak(shape, twice).values()) > plan.budget
    assert all(sum(plan.update[c].values()) <= plan.budget and plan.micro_batch[c] > 0 for c in (False, True))
    fixed = workload_from_config(load_config("podsrl/configs/pods.yaml", ["rollout.engine_options={max_rows: 256}"]),
                                 256, "cuda")
    assert mp.make_plan(shape, fixed, 80 * 2**30).work.generation_rows == 256


def test_largest_micro_batch_fits_and_one_more_does_not():
    shape = mw.model_shape(qwen2(hidden=256, layers=4, vocab=32000))
    work = mw.Workload(prompts=4, n=8, m=8, prompt_length=128, completion_length=512, device="cpu")
    budget = 700 * 2**20
    for ckpt in (False, True):
        rows = mp.largest_micro_batch(shape, work, budget, ckpt)
        assert 1 <= rows < work.trained_rows
        assert sum(mp.update_peak(shape, work, rows, ckpt).values()) <= budget
        assert sum(mp.update_peak(shape, work, rows + 1, ckpt).values()) > budget
    assert mp.largest_micro_batch(shape, work, budget, True) > mp.largest_micro_batch(shape, work, budget, False)
    assert mp.largest_micro_batch(shape, work, 2**20, False) == 0


@pytest.mark.parametrize("text, size", [("80GiB", 80 * 2**30), ("24GB", 24 * 10**9), ("81920MiB", 80 * 2**30),
                                        ("7.5g", int(7.5 * 2**30)), ("512 mb", 512 * 10**6)])
def test_parse_memory(text, size):
    assert mw.parse_memory(text) == size


@pytest.mark.parametrize("text", ["80", "eighty GiB", "80 GiBs", "-1GiB", "0GB", ""])
def test_parse_memory_refuses_what_is_not_a_size(text):
    with pytest.raises(UserError, match="--gpu-memory"):
        mw.parse_memory(text)


def test_cli_from_a_config_json_and_a_model_directory(tmp_path, capsys):
    config = qwen2(hidden=128, layers=2, vocab=1000)
    config.save_pretrained(tmp_path / "model")
    out = tmp_path / "plan.json"
    args = ["plan", "grpo", "rollout.max_new_tokens=256", "--memory", "--gpu-memory", "1GiB", "--prompt-length",
            "64", "--device", "cpu"]
    assert main([*args, "--model", str(tmp_path / "model" / "config.json"), "--json", str(out)]) == 0
    text = capsys.readouterr().out
    assert "| generation (" in text and "optim.micro_batch_size=" in text and "largest term" in text
    saved = json.loads(out.read_text())
    assert saved["shape"]["hidden"] == 128 and saved["update"]["no_checkpointing"]["micro_batch_size"] >= 1
    assert main([*args, "--model", str(tmp_path / "model")]) == 0
    assert capsys.readouterr().out.split("\n", 1)[1] == text.split("\n", 1)[1]  # all but the model's name


@pytest.mark.parametrize("extra, message", [
    (["--model", "/no/such/dir"], "no such config.json"),
    (["--model", "some-org/not-cached-model"], "not in the local Hugging Face cache"),
    (["--model", "tiny", "--gpu-memory", "lots"], "--gpu-memory: 'lots' is not a memory size"),
])
def test_cli_bad_input_is_one_line_and_exit_2(extra, message, capsys, monkeypatch, tmp_path):
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "empty-cache"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    args = ["plan", "grpo", "--memory", "--prompt-length", "64", *extra]
    if "--gpu-memory" not in extra:
        args += ["--gpu-memory", "80GiB"]
    assert main(args) == 2
    err = capsys.readouterr().err.strip()
    assert message in err and len(err.splitlines()) == 1


# ---- per rank: world size, strategy, offload; every preset; the advice when nothing fits ----

QWEN_1_5B = dict(vocab_size=151936, hidden_size=1536, intermediate_size=8960, num_hidden_layers=28,
                 num_attention_heads=12, num_key_value_heads=2, tie_word_embeddings=True)
QWEN_7B = dict(vocab_size=152064, hidden_size=3584, intermediate_size=18944, num_hidden_layers=28,
               num_attention_heads=28, num_key_value_heads=4, tie_word_embeddings=False)


def pods_work(overrides=(), world_size=1):
    """PODS' default step (32 prompts x 64, 16 trained) at 256 + 1,024 tokens, bf16 compute over float32 masters."""
    from podsrl.config import load_config
    from podsrl.memory_plan import workload_from_config

    cfg = load_config("podsrl/configs/pods.yaml", ["rollout.max_new_tokens=1024", *overrides])
    return workload_from_config(cfg, 256, "cuda", world_size)


def test_ddp_and_fsdp_terms_per_rank_by_hand():
    """DDP: each rank generates its prompts' rows and trains its share, the state whole; FSDP2 over 8: master
    weights, gradients and AdamW state 1/8 each, the gathered root module and two layers in the compute dtype and a
    layer's float32 gradient, the whole generation copy in the compute dtype; train.cpu_offload moves the shards to
    host memory; FSDP2 in one process is the one-process plan."""
    shape = mw.model_shape(Qwen2Config(**QWEN_7B))
    assert shape.root_params == 2 * 152064 * 3584 + 3584  # embeddings, untied head, final norm
    one, ddp = pods_work(), pods_work(world_size=8)
    assert (ddp.rank_prompts, ddp.rank_rows, ddp.trained_rows) == (4, 256, 64)
    assert (one.rank_rows, one.trained_rows) == (2048, 512)
    assert mp.model_state(shape, ddp) == mp.model_state(shape, one)
    fsdp = pods_work(["train.strategy=fsdp"], world_size=8)
    state = mp.model_state(shape, fsdp)
    assert state["weights"] == -(-shape.params * 4 // 8) and state["optimizer"] == -(-2 * shape.params * 4 // 8)
    upd = mp.update_peak(shape, fsdp, rows=8, checkpointing=False)
    assert upd["gradients"] == state["gradients"] == -(-shape.params * 4 // 8)
    assert upd["gathered"] == (shape.root_params + 2 * shape.layer_params) * 2 + shape.layer_params * 4
    gen = mp.generation_peak(shape, fsdp)
    # the generation copy's projections are views of the fused tensors (podsrl/fsdp.py): no fused copies
    assert gen["engine_weights"] == shape.params * 2 and gen["fused_weights"] == 0
    assert "gathered" not in gen
    offload = pods_work(["train.strategy=fsdp", "train.cpu_offload=true"], world_size=8)
    assert not any(mp.model_state(shape, offload).values())
    host = mp.host_memory(shape, offload)  # rank 0 reads one tensor at a time: the head, as stored and in float32
    assert host == {"load": 152064 * 3584 * (4 + 4), "offloaded_state": sum(state.values())}
    assert mp.host_memory(shape, ddp)["load"] == shape.params * 4  # the whole model, then moved
    single = pods_work(["train.strategy=fsdp"], world_size=1)
    assert mp.make_plan(shape, single, 80 * 2**30).update == mp.make_plan(shape, one, 80 * 2**30).update


@pytest.mark.parametrize("world_size", [1, 8])
@pytest.mark.parametrize("strategy", ["ddp", "fsdp"])
@pytest.mark.parametrize("size", ["1.5B", "7B"])
def test_the_readme_shapes_per_rank(size, strategy, world_size):
    """Qwen2.5-1.5B and 7B full fine-tunes on 80 GiB ranks: the 1.5B fits everywhere; the 7B fits on 8 ranks under
    FSDP2 only (its replicated state alone, 7.6B x 16 bytes, outgrows a rank), and the sharded peak is below the
    replicated one."""
    shape = mw.model_shape(Qwen2Config(**(QWEN_1_5B if size == "1.5B" else QWEN_7B)))
    work = pods_work([f"train.strategy={strategy}"], world_size)
    plan = mp.make_plan(shape, work, 80 * 2**30)
    assert plan.fits == (size == "1.5B" or (strategy == "fsdp" and world_size == 8))
    if strategy == "fsdp" and world_size == 8:
        replicated = mp.make_plan(shape, pods_work(world_size=8), 80 * 2**30)
        assert sum(plan.generation.values()) < sum(replicated.generation.values())
        peak = (sum(mp.update_peak(shape, w, 4, True).values()) for w in (work, replicated.work))
        assert next(peak) < next(peak)


def test_a_7b_full_fine_tune_on_one_rank_is_advised_what_fits(tmp_path, capsys):
    """Nothing fits one 80 GiB device: the advice names LoRA and FSDP2 (with and without offload) as overrides,
    each of which the plan says fits, cheapest predicted step first; no "lower the lengths"."""
    from podsrl.config import load_config
    from podsrl.memory_plan import advice, update_flops

    Qwen2Config(**QWEN_7B).save_pretrained(tmp_path / "7b")
    args = ["plan", "pods", "rollout.max_new_tokens=1024", "--memory", "--gpu-memory", "80GiB", "--prompt-length",
            "256", "--model", str(tmp_path / "7b"), "--world-size", "1"]
    assert main(args) == 0
    text = capsys.readouterr().out
    assert "not even a micro-batch of 1 row fits" in text and "what would fit" in text and "lower" not in text
    assert "model.lora_rank=64" in text and "train.strategy=fsdp" in text and "train.cpu_offload=true" in text
    cfg = load_config("podsrl/configs/pods.yaml", ["rollout.max_new_tokens=1024"])
    options = advice(Qwen2Config(**QWEN_7B), cfg, pods_work(), 80 * 2**30, mp.RESERVE)
    assert len(options) == 3 and all(plan.fits for _, plan in options)
    costs = [update_flops(plan) for _, plan in options]
    assert costs == sorted(costs)


def test_the_world_size_defaults_to_torchruns(monkeypatch, capsys):
    args = ["plan", "grpo", "--memory", "--gpu-memory", "1GiB", "--model", "tiny", "--device", "cpu"]
    monkeypatch.setenv("WORLD_SIZE", "4")
    assert main(args) == 0
    out = capsys.readouterr().out
    assert "per rank of 4: train.strategy=ddp; a rank generates 8 prompts' 128 rows" in out
    assert "on rank 0 alone: the other ranks receive its tensors on their device" in out  # not 4 copies in host memory
    monkeypatch.setenv("WORLD_SIZE", "four")
    assert main(args) == 2
    assert "WORLD_SIZE" in capsys.readouterr().err


def test_the_prompt_length_comes_from_the_data_when_unset(capsys):
    """task.max_prompt_length unset: the task's longest prompt in the model's tokens (the built-in task with the
    tiny model's character tokenizer: one token a character), not a refusal."""
    from podsrl.config import load_config
    from podsrl.tasks import build_task

    cfg = load_config("podsrl/configs/grpo.yaml", [])
    assert cfg.task.max_prompt_length == 0
    task = build_task(cfg.task)
    longest = max(len(p.prompt) for p in [*map(task.problem, range(2000)), *task.eval_set()])
    assert main(["plan", "grpo", "--memory", "--gpu-memory", "1GiB", "--model", "tiny", "--device", "cpu"]) == 0
    assert f"prompt {longest} + completion" in capsys.readouterr().out


@pytest.fixture(scope="module")
def stand_in(tmp_path_factory):
    """A local model directory (the tiny model and its tokenizer) and a local data file for the presets that name a
    hub model and dataset: the plan reads both, nothing from the hub."""
    from podsrl.config import TinyModelConfig
    from podsrl.models.loading import build_char_tokenizer, build_tiny_model

    root = tmp_path_factory.mktemp("stand-in")
    tokenizer = build_char_tokenizer()
    build_tiny_model(TinyModelConfig(hidden_size=64, num_layers=2, intermediate_size=128,
                                     max_position_embeddings=512), tokenizer).save_pretrained(root / "model")
    tokenizer.save_pretrained(root / "model")
    rows = [{"question": f"Tom has {a} apples and buys {b}. How many?", "answer": f"{a}+{b}\n#### {a + b}",
             "problem": f"What is {a} + {b}?", "solution": f"\\boxed{{{a + b}}}"} for a in range(1, 7) for b in range(4)]
    (root / "data.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return root


@pytest.mark.parametrize("world_size", [1, 8])
def test_the_plan_runs_on_every_bundled_preset(stand_in, world_size, capsys):
    from podsrl.config import load_config
    from podsrl.config.presets import preset_names, preset_path

    for preset in preset_names():
        cfg = load_config(preset_path(preset), [])
        local = [] if cfg.model.name_or_path == "tiny" else [
            f"model.name_or_path={stand_in / 'model'}", f"task.args.path={stand_in / 'data.jsonl'}",
            "task.args.eval_path=null", "task.args.eval_split=null", "task.args.eval_fraction=0.25",
            "task.args.config=null", "task.args.prompt_mode=plain"]
        args = ["plan", preset, *local, "--memory", "--gpu-memory", "80GiB", "--world-size", str(world_size)]
        assert main(args) == 0, (preset, capsys.readouterr().err)
        assert f"per rank of {world_size}: train.strategy=" in capsys.readouterr().out


def test_an_episode_task_is_planned_with_its_whole_episode_and_the_sessions_caches(capsys):
    """arithmetic_tool's rows hold whole episodes (episode.max_tokens), and between turns the fast engine's session
    keeps every live episode's cache beside the turn's own (engines/continuation.py): the plan counts both."""
    from podsrl.config import load_config
    from podsrl.memory_plan import workload_from_config

    cfg = load_config("podsrl/configs/arithmetic_tool.yaml")
    work = workload_from_config(cfg, 40, "cpu")
    assert work.episodes and work.completion_length == cfg.episode.max_tokens != cfg.rollout.max_new_tokens
    shape = mw.model_shape(qwen2())
    single = dataclasses.replace(work, episodes=False)
    kv_position = shape.layers * 2 * shape.kv_heads * shape.head_dim * work.engine_e
    sessions = kv_position * work.rank_rows * (work.prompt_length + work.completion_length)
    assert (mp.generation_in_flight(shape, work)["kv_cache"]
            == mp.generation_in_flight(shape, single)["kv_cache"] + sessions)
    assert not workload_from_config(load_config(None), 40, "cpu").episodes
    assert main(["plan", "arithmetic_tool", "--memory", "--gpu-memory", "8GiB"]) == 0
    assert f"episode {cfg.episode.max_tokens} tokens" in capsys.readouterr().out


