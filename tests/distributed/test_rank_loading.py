"""Loading under torchrun: on two gloo ranks, rank 0 alone reads the weights and every rank ends with the model a
one-process load gives, bit for bit (every parameter and buffer, the rotary frequencies included, the tied output
head still the embedding), for the built-in tiny model, a local Hugging Face Qwen2 directory (also in bfloat16) and
LoRA on top; and a trainer built on two ranks (policy and reference) never reads the weights on rank 1.
Loaded straight into FSDP2's shards (train.strategy=fsdp), the same cases plus a checkpoint stored in bfloat16 read
as float32 masters: the gathered shards are the one-process load bit for bit, rank 0 reads a safetensors directory
tensor by tensor (no load_pretrained) and builds the whole model only for the built-in model and LoRA, and the
generation copy made from the shards equals the one-process model with its q/k/v and gate/up projections views of
one fused tensor each."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from podsrl.build import load_model
from podsrl.config import TinyModelConfig, load_config
from podsrl.models import loading
from podsrl.models.rank_loading import model_tensors

pytestmark = [pytest.mark.usefixtures("one_thread"), pytest.mark.cpu_only("two gloo ranks on CPU")]

# name -> config overrides (`{dir}`: the local Qwen2 directory saved by the fixture)
CASES = {
    "tiny": ["model.tiny.num_layers=2", "model.tiny.hidden_size=64", "model.tiny.intermediate_size=128"],
    "local_qwen2": ["model.name_or_path={dir}"],
    "local_qwen2_bfloat16": ["model.name_or_path={dir}", "model.dtype=bfloat16"],
    "lora": ["model.name_or_path={dir}", "model.lora_rank=4"],
}
# loaded into shards: the cases above, and a checkpoint stored in bfloat16 read as float32 masters
SHARDED = {**CASES, "stored_bfloat16": ["model.name_or_path={dir}_bf16"]}


def save_qwen2(path: Path, dtype: torch.dtype = torch.float32) -> str:
    """A Qwen2 checkpoint directory (safetensors, config, char tokenizer), as any Hugging Face model is saved."""
    tokenizer = loading.build_char_tokenizer()
    shape = TinyModelConfig(hidden_size=64, num_layers=3, num_heads=4, intermediate_size=96)
    model = loading.build_tiny_model(shape, tokenizer, seed=7).to(dtype)
    model.save_pretrained(str(path), safe_serialization=True)
    tokenizer.save_pretrained(str(path))
    return str(path)


def case_config(name: str, directory: str, **extra: str):
    return load_config(None, [o.format(dir=directory) for o in SHARDED[name]] + [f"{k}={v}" for k, v in extra.items()])


def snapshot(model: torch.nn.Module) -> dict:
    """Every tensor the model holds (a sharded one whole), its tied output head and what else a rank builds besides
    the weights."""
    from podsrl.fsdp import full_tensor

    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    return {"tensors": {name: full_tensor(t, t.device).detach().clone() for name, t in model_tensors(model)},
            "state_keys": sorted(model.state_dict()),
            "tied": base.lm_head.weight is base.model.embed_tokens.weight,
            "training": model.training, "generation": base.generation_config.to_dict(),
            "trainable": sorted(n for n, p in model.named_parameters() if p.requires_grad)}


def one_process_load(name: str, directory: str) -> dict:
    cfg = case_config(name, directory)
    torch.manual_seed(cfg.seed)  # as the trainer seeds before loading (fresh LoRA adapters draw from it)
    return snapshot(load_model(cfg, None, None, trainable=True)[0])


def count_weight_reads(reads: list[str]) -> None:
    """Records every call of the functions that produce a model's weights (read from disk, or initialised)."""
    for name in ("load_pretrained", "build_tiny_model"):
        real = getattr(loading, name)

        def counted(*args, _real=real, _name=name, **kwargs):
            reads.append(_name)
            return _real(*args, **kwargs)

        setattr(loading, name, counted)


def build_trainer(directory: str, run_dir: Path):
    """A trainer on the local Qwen2 with a reference model (algo.beta > 0), built and not run."""
    from podsrl.run.trainer import Trainer

    cfg = load_config(None, [f"model.name_or_path={directory}", "algo.beta=0.05", f"output_dir={run_dir}",
                             "task.eval_size=4", "log.progress=false", "log.tensorboard=false", "log.plot=false"])
    trainer = Trainer(cfg)
    trainer.close_engines()
    trainer._release_run_dir()
    return trainer


def _rank_main(rank: int, world: int, tmp: str, directory: str) -> None:
    from podsrl.distributed import init_distributed

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{tmp}/init", rank=rank, world_size=world)
    ctx = init_distributed(torch.device("cpu"))  # joins the existing group
    reads: list[str] = []
    count_weight_reads(reads)
    out: dict = {}
    for name in CASES:
        cfg = case_config(name, directory)
        torch.manual_seed(cfg.seed)
        out[name] = snapshot(load_model(cfg, None, None, trainable=True, ctx=ctx)[0])
    trainer = build_trainer(directory, Path(tmp) / "run")
    out["trainer"] = {"policy": snapshot(trainer.parts.model), "reference": snapshot(trainer.parts.ref_model)}
    out["reads"] = list(reads)
    out["sharded"], sharded_reads = {}, len(reads)
    for name in SHARDED:
        out["sharded"][name] = sharded_load(name, directory, ctx)
    out["sharded_reads"] = reads[sharded_reads:]
    torch.save(out, Path(tmp) / f"rank{rank}.pt")
    dist.destroy_process_group()


def sharded_load(name: str, directory: str, ctx) -> dict:
    """The case loaded into FSDP2's shards as the trainer loads it; its snapshot and its generation copy's."""
    from podsrl.config.facts import run_facts
    from podsrl.fsdp import build_data_parallel, fsdp_sharding

    cfg = case_config(name, directory, **{"train.strategy": "fsdp"})
    torch.manual_seed(cfg.seed)
    facts = run_facts(cfg, ctx.device)
    sharding = fsdp_sharding(ctx, cfg, facts.compute_dtype)
    model = load_model(cfg, None, None, trainable=True, ctx=ctx, shard=sharding.shard)[0]
    sharded = [isinstance(p, torch.distributed.tensor.DTensor) for p in model.parameters()]
    copy = build_data_parallel(ctx, model, None, cfg, facts, sharding).generation_model
    layer = (copy.get_base_model() if hasattr(copy, "get_base_model") else copy).model.layers[0]
    fused = [layer.self_attn.q_proj.weight.untyped_storage().data_ptr() ==
             layer.self_attn.v_proj.weight.untyped_storage().data_ptr(),
             layer.mlp.gate_proj.weight.untyped_storage().data_ptr() ==
             layer.mlp.up_proj.weight.untyped_storage().data_ptr()]
    return {**snapshot(model), "all_sharded": all(sharded), "copy": snapshot(copy), "fused_views": fused}


@pytest.fixture(scope="module")
def local_qwen2(tmp_path_factory) -> str:
    path = tmp_path_factory.mktemp("qwen2")
    save_qwen2(Path(f"{path}_bf16"), torch.bfloat16)
    return save_qwen2(path)


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory, local_qwen2):
    tmp = tmp_path_factory.mktemp("rank-loading")
    mp.spawn(_rank_main, args=(2, str(tmp), local_qwen2), nprocs=2, join=True)
    return [torch.load(tmp / f"rank{r}.pt", weights_only=False) for r in range(2)]


def assert_same_model(got: dict, want: dict) -> None:
    assert got["state_keys"] == want["state_keys"]
    assert list(got["tensors"]) == list(want["tensors"])
    for name, tensor in want["tensors"].items():
        assert got["tensors"][name].dtype == tensor.dtype, name
        assert torch.equal(got["tensors"][name], tensor), name  # bit for bit
    for key in ("tied", "training", "generation", "trainable"):
        assert got[key] == want[key], key


@pytest.mark.parametrize("name", list(CASES))
def test_every_rank_ends_with_the_one_process_load(two_ranks, local_qwen2, name):
    want = one_process_load(name, local_qwen2)
    assert want["tied"]  # Qwen2 ties the output head to the embedding: the tie must survive the broadcast
    assert any("rotary_emb.inv_freq" in n for n in want["tensors"])  # a non-persistent buffer, compared too
    if name == "lora":
        assert any("lora_A" in n for n in want["trainable"]) and not any("lora" not in n for n in want["trainable"])
    for rank in two_ranks:
        assert_same_model(rank[name], want)


def test_rank_1_never_reads_the_weights(two_ranks):
    """Rank 0 reads each model once (policy and reference included); rank 1 reads none and builds it from rank 0's
    tensors."""
    assert two_ranks[1]["reads"] == []
    assert two_ranks[0]["reads"] == ["build_tiny_model"] + ["load_pretrained"] * (len(CASES) - 1 + 2)


def test_trainer_policy_and_reference_are_rank_0s(two_ranks):
    zero, one = two_ranks[0]["trainer"], two_ranks[1]["trainer"]
    for role in ("policy", "reference"):
        assert_same_model(one[role], zero[role])
    assert not zero["reference"]["trainable"]


@pytest.mark.parametrize("name", list(SHARDED))
def test_loaded_into_shards_every_rank_gathers_the_one_process_load(two_ranks, local_qwen2, name):
    want = one_process_load(name, local_qwen2)
    for rank in two_ranks:
        got = rank["sharded"][name]
        assert got["all_sharded"]
        assert_same_model(got, want)
        copy = got["copy"]  # float32 compute on the CPU: the generation copy is the model itself, unsharded
        assert copy["tensors"].keys() == want["tensors"].keys() and copy["tied"] == want["tied"]
        assert all(torch.equal(copy["tensors"][k], v) for k, v in want["tensors"].items())
        # fused into one tensor each, where LoRA leaves q/k/v and gate/up plain (the Qwen presets wrap all seven)
        assert got["fused_views"] == [True, True] if name != "lora" else got["fused_views"][1]


def test_loaded_into_shards_rank_0_streams_safetensors_and_rank_1_reads_nothing(two_ranks):
    """Rank 0 builds or loads the whole model only where it cannot stream (the built-in model, built from code; LoRA,
    whose adapters peft makes); the local directories, in float32 or bfloat16, are read tensor by tensor."""
    assert two_ranks[1]["sharded_reads"] == []
    assert two_ranks[0]["sharded_reads"] == ["build_tiny_model", "load_pretrained"]
