"""Start-up under FSDP2 within the plan, on 2 gloo ranks: a trainer of a 107M-parameter Qwen2 (428 MB in float32,
read from a local safetensors directory) with bfloat16 compute and a reference (algo.beta=0.001) starts on each rank
within 15% of the start-up row of `podsrl plan --memory` (rank 0's, the rank that needs most), the policy's load
alone stays far below the whole float32 model (its shards and one tensor), and the whole start-up (two sets of
shards and the bfloat16 generation copy) below the float32 model with its copy that each rank held before.

Memory is each rank's resident set (VmHWM of /proc/self/status, as benchmarks/rank_loading.py counts it), its peak
reset before each phase (/proc/self/clear_refs), minus the resident set before the trainer starts. The ranks run with
glibc's mmap threshold fixed at 64 KiB (MALLOC_MMAP_THRESHOLD_): by default it rises to the size of the largest block
freed, and a transient freed below that stays in the heap and in the resident set (here ~55 MiB more at the end),
which a GPU's allocator would count as free."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from podsrl.cli import main
from podsrl.models import loading

pytestmark = [pytest.mark.cpu_only("two gloo ranks on CPU"), pytest.mark.slow]

SHAPE = {"hidden_size": 768, "num_hidden_layers": 16, "num_attention_heads": 12, "num_key_value_heads": 4,
         "intermediate_size": 2048, "vocab_size": 8192}
KIB = 1024


def run_overrides(directory: str, run_dir: str) -> list[str]:
    return [f"model.name_or_path={directory}", "model.compute_dtype=bfloat16", "train.strategy=fsdp",
            "algo.beta=0.001", f"output_dir={run_dir}", "task.max_prompt_length=32", "task.eval_size=4",
            "rollout.prompts_per_step=4", "rollout.n=2", "rollout.max_new_tokens=8", "log.progress=false",
            "log.tensorboard=false", "log.plot=false"]


def save_model(directory: Path) -> int:
    """A random-init Qwen2 of SHAPE in float32 as a Hugging Face directory (safetensors, config, char tokenizer);
    its bytes."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(0)
    config = Qwen2Config(**SHAPE, max_position_embeddings=512, tie_word_embeddings=True, pad_token_id=0,
                         eos_token_id=1)
    model = Qwen2ForCausalLM(config)
    model.save_pretrained(str(directory), safe_serialization=True)
    loading.build_char_tokenizer().save_pretrained(str(directory))
    return sum(p.numel() * p.element_size() for p in model.parameters())


def status_kib(field: str) -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith(field + ":"))


def reset_peak() -> None:
    with open("/proc/self/clear_refs", "w") as f:  # "5": the peak resident set starts again from the current one
        f.write("5")


def _rank_main(rank: int, world: int, tmp: str, directory: str) -> None:
    import gc

    from podsrl.config import load_config
    from podsrl.run import assembly
    from podsrl.run.trainer import Trainer

    torch.set_num_threads(1)
    os.environ.update({"RANK": str(rank), "WORLD_SIZE": str(world)})
    dist.init_process_group("gloo", init_method=f"file://{tmp}/init", rank=rank, world_size=world)
    cfg = load_config(None, run_overrides(directory, f"{tmp}/run"))
    peaks: list[int] = []  # after the policy's load, the reference's, the rest of the start-up
    load_model = assembly.load_model

    def measured(*args, **kwargs):
        out = load_model(*args, **kwargs)
        peaks.append(status_kib("VmHWM"))
        reset_peak()
        return out

    assembly.load_model = measured
    gc.collect()
    before = status_kib("VmRSS")
    reset_peak()
    trainer = Trainer(cfg)
    peaks.append(status_kib("VmHWM"))
    trainer.close_engines()
    trainer._release_run_dir()
    Path(tmp, f"rank{rank}.json").write_text(json.dumps({"before": before, "peaks": peaks}))
    dist.destroy_process_group()


@pytest.fixture(scope="module")
def measured(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("startup")
    directory = tmp / "qwen2"
    whole = save_model(directory)
    threshold = os.environ.get("MALLOC_MMAP_THRESHOLD_")
    os.environ["MALLOC_MMAP_THRESHOLD_"] = "65536"  # read by each rank's fresh interpreter at its start
    try:
        mp.spawn(_rank_main, args=(2, str(tmp), str(directory)), nprocs=2, join=True)
    finally:
        os.environ.pop("MALLOC_MMAP_THRESHOLD_")
        if threshold is not None:
            os.environ["MALLOC_MMAP_THRESHOLD_"] = threshold
    ranks = [json.loads((tmp / f"rank{r}.json").read_text()) for r in range(2)]
    report = tmp / "plan.json"
    assert main(["plan", "grpo", *run_overrides(str(directory), str(tmp / "plan-run")), "--memory",
                 "--gpu-memory", "64GiB", "--device", "cpu", "--world-size", "2", "--model", str(directory),
                 "--json", str(report)]) == 0
    return whole, ranks, json.loads(report.read_text())


def test_each_ranks_start_up_is_within_15_percent_of_the_plans_row(measured, capsys):
    whole, ranks, plan = measured
    planned = plan["startup"]["peak"]
    for rank, row in enumerate(ranks):
        peak = (max(row["peaks"]) - row["before"]) * KIB
        print(f"rank {rank}: start-up peak {peak / 2**20:.0f} MiB, plan {planned / 2**20:.0f} MiB, "
              f"phases {[(p - row['before']) // KIB for p in row['peaks']]} MiB; float32 model {whole / 2**20:.0f} MiB")
        assert peak == pytest.approx(planned, rel=0.15), rank
    capsys.readouterr()


def test_no_rank_holds_the_whole_float32_model(measured):
    """The policy's load holds a rank's shards (half the model on 2 ranks) and one tensor at a time; the whole
    start-up, both models' shards and the bfloat16 generation copy: each rank held the float32 model twice (the
    policy and its float32 copy for the generation copy) and the reference before this."""
    whole, ranks, _ = measured
    for row in ranks:
        policy, start_up = (row["peaks"][0] - row["before"]) * KIB, (max(row["peaks"]) - row["before"]) * KIB
        assert policy < 0.65 * whole
        assert start_up < 1.7 * whole < 3 * whole
