"""Peak host memory of each rank while two gloo ranks load a Qwen2 of 168M parameters as float32 masters (the
default model.dtype) from a safetensors checkpoint saved in bfloat16 (as hub checkpoints mostly are) and in float32:
every rank reading the weights itself (`load_policy`, the load before podsrl/models/rank_loading.py) against rank 0
alone reading them and broadcasting every tensor (`load_policy_on_ranks`, what the trainer does).

Each arm runs in two fresh processes (torch.multiprocessing, gloo over a file rendezvous, one torch thread each), so
a process's resident-set high-water mark (VmHWM in /proc/self/status) is its own arm's; it is read after every
weight was read once (a lazily mapped file is read then, as by a first forward). Both arms end holding the model on
every rank (on the CPU a rank's device is host memory); the difference is what reading it costs on top. At the end,
`RssFile` is the part of the resident set mapped from the checkpoint's file (page cache, one physical copy shared by
the processes that map it) and `RssAnon` the process's own memory.

    OMP_NUM_THREADS=1 python benchmarks/rank_loading.py        # the table in docs/results.md
"""

from __future__ import annotations

import json
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks.timing import machine_line

# Qwen2 layout, tied embeddings: hidden, layers, heads, kv heads, MLP width, vocabulary
SHAPE = {"hidden_size": 1024, "num_hidden_layers": 12, "num_attention_heads": 16, "num_key_value_heads": 4,
         "intermediate_size": 2816, "vocab_size": 32000}
ARMS = ("old", "new")  # every rank reads (load_policy); rank 0 reads and broadcasts (load_policy_on_ranks)
SAVED_DTYPES = ("bfloat16", "float32")  # hub checkpoints are mostly bfloat16; podsrl loads float32 masters
WORLD = 2
MIB = 2**20


def save_model(directory: Path, dtype: str) -> int:
    """A random-init Qwen2 of SHAPE saved in `dtype` as a Hugging Face directory (safetensors, config, tokenizer);
    its parameter count."""
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from podsrl.models.loading import build_char_tokenizer

    torch.manual_seed(0)
    config = Qwen2Config(**SHAPE, max_position_embeddings=512, tie_word_embeddings=True, pad_token_id=0,
                         eos_token_id=1)
    model = Qwen2ForCausalLM(config).to(getattr(torch, dtype))
    model.save_pretrained(str(directory), safe_serialization=True)
    build_char_tokenizer().save_pretrained(str(directory))
    return sum(p.numel() for p in model.parameters())


def memory_kib() -> dict[str, int]:
    with open("/proc/self/status") as f:
        fields = dict(line.split(":", 1) for line in f)
    return {k: int(fields[k].split()[0]) for k in ("VmHWM", "VmRSS", "RssAnon", "RssFile")}


def rank_main(rank: int, world: int, arm: str, directory: str, tmp: str) -> None:
    import torch
    import torch.distributed as dist

    from podsrl.config import ModelConfig
    from podsrl.distributed import init_distributed
    from podsrl.models.loading import load_policy
    from podsrl.models.rank_loading import load_policy_on_ranks

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{tmp}/init-{arm}", rank=rank, world_size=world)
    ctx = init_distributed(torch.device("cpu"))
    cfg = ModelConfig(name_or_path=directory)
    before = memory_kib()["VmRSS"]
    start = time.perf_counter()
    model, _ = load_policy(cfg) if arm == "old" else load_policy_on_ranks(cfg, ctx=ctx)
    seconds = time.perf_counter() - start
    with torch.no_grad():  # reads every weight once, as a first forward would (a lazily mapped file is read here)
        checksum = [float(p.sum()) for p in model.parameters()]
    dist.barrier()
    after = memory_kib()
    Path(tmp, f"{arm}-{rank}.json").write_text(json.dumps(
        {"before": before, **after, "seconds": seconds, "checksum": checksum}))
    dist.destroy_process_group()


def main() -> None:
    import torch.multiprocessing as mp

    print(machine_line(threads=1))
    table = ["| checkpoint | rank | peak RSS, every rank reads (MiB) | peak RSS, rank 0 reads and broadcasts (MiB) | "
             "RSS before loading (MiB) | at the end, anon / file (MiB): every rank reads | rank 0 reads | "
             "load seconds: every rank reads | rank 0 reads |", "|---|---:|---:|---:|---:|---|---|---:|---:|"]
    for saved in SAVED_DTYPES:
        with tempfile.TemporaryDirectory() as tmp:
            directory = Path(tmp, "qwen2")
            params = save_model(directory, saved)
            files = sum(f.stat().st_size for f in directory.glob("*.safetensors"))
            for arm in ARMS:
                mp.spawn(rank_main, args=(WORLD, arm, str(directory), tmp), nprocs=WORLD, join=True)
            rows = {(arm, r): json.loads(Path(tmp, f"{arm}-{r}.json").read_text())
                    for arm in ARMS for r in range(WORLD)}
        assert len({json.dumps(row["checksum"]) for row in rows.values()}) == 1, "the ranks' weights differ"
        for r in range(WORLD):
            old, new = rows["old", r], rows["new", r]
            table.append(
                f"| {saved}, {files / MIB:,.0f} MiB | {r} | {old['VmHWM'] // 1024:,} | {new['VmHWM'] // 1024:,} | "
                f"{new['before'] // 1024:,} | {old['RssAnon'] // 1024:,} / {old['RssFile'] // 1024:,} | "
                f"{new['RssAnon'] // 1024:,} / {new['RssFile'] // 1024:,} | {old['seconds']:.1f} | "
                f"{new['seconds']:.1f} |")
    print(f"model: Qwen2 {SHAPE}, {params / 1e6:.1f}M parameters, loaded in float32 (model.dtype's default)\n")
    print("\n".join(table))


if __name__ == "__main__":
    main()
