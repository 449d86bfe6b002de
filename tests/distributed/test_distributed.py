"""Data parallel: a 2-process gloo update equals the one-process update on the same batch (also with PODS
down-sampling, several mini-batches and epochs, uneven groups, an odd row count, one row for two ranks, and the
split-half gradient-noise metrics); sharded generation equals one in-process call; episodes continued on the rank
holding each one's cache; rank agreement; and an end-to-end torchrun run (with resume) against one process."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from podsrl.batch import Problem, RolloutBatch
from podsrl.config import load_config
from podsrl.config.facts import run_facts
from podsrl.engines.base import SamplingParams
from podsrl.engines.fast import FastEngine
from podsrl.methods import METHODS, offline_context
from podsrl.update import PolicyUpdater, UpdateSettings
from tests.tiny_lm import TokStub as Tok
from tests.tiny_lm import tiny_causal_lm

VOCAB = 48
ROOT = Path(__file__).resolve().parents[2]
pytestmark = [pytest.mark.usefixtures("one_thread"), pytest.mark.cpu_only("two gloo ranks on CPU (and torchrun)")]

# name -> (config overrides, generated group sizes, fixed advantages or None = from the selection stage)
SCENARIOS = {
    "grpo": (["optim.micro_batch_size=2"], [4, 4, 4], None),
    "pods": (["rollout.n=6", "method=pods", "pods.m=3", "optim.mini_batches=2", "optim.epochs=2",
              "optim.micro_batch_size=2", "algo.loss_agg=seq_mean_token_mean"], [6, 6, 6, 6], None),
    "uneven": (["optim.micro_batch_size=4", "optim.mini_batches=3", "algo.beta=0.05",
                "algo.loss_agg=seq_mean_token_sum_norm"], [5, 1, 3, 2], None),
    "one_row": (["optim.micro_batch_size=4"], [1], [0.7]),
    # split-half halves formed per rank and summed over ranks; one row of a half may leave a rank idle
    "grad_noise": (["log.grad_noise=true", "optim.micro_batch_size=2", "optim.mini_batches=2"],
                   [5, 1, 3, 2], None),
}



def make_model(seed: int = 0):
    return tiny_causal_lm(VOCAB, hidden=32, intermediate=64, max_positions=64, peak=3.0, seed=seed)


def make_batch(sizes: list[int], seed: int) -> RolloutBatch:
    """Random prompts (one per group, left-padded) and completions of varied lengths, with 0/1 rewards."""
    g = torch.Generator().manual_seed(seed)
    rows = sum(sizes)
    group_index = torch.repeat_interleave(torch.arange(len(sizes)), torch.tensor(sizes))
    prompt_len = torch.randint(2, 7, (len(sizes),), generator=g)[group_index]
    lp, lc = 6, 8
    prompt_mask = (torch.arange(lp) >= lp - prompt_len[:, None]).long()
    prompt_ids = torch.randint(2, VOCAB, (len(sizes), lp), generator=g)[group_index] * prompt_mask
    length = torch.randint(1, lc + 1, (rows,), generator=g)
    completion_mask = (torch.arange(lc) < length[:, None]).float()
    completion_ids = (torch.randint(2, VOCAB, (rows, lc), generator=g) * completion_mask).long()
    return RolloutBatch(
        problems=[Problem(uid=f"p{i}", prompt="", answer="") for i in range(len(sizes))],
        group_index=group_index, prompt_ids=prompt_ids, prompt_mask=prompt_mask, completion_ids=completion_ids,
        completion_mask=completion_mask, truncated=length == lc,
        rewards=torch.randint(0, 2, (rows,), generator=g).float(), correct=torch.zeros(rows, dtype=torch.bool))


def run_scenario(name: str, data_parallel_for=None) -> dict:
    """One update of scenario `name`; with `data_parallel_for(model)` it runs as one rank of a group."""
    overrides, sizes, advantages = SCENARIOS[name]
    cfg = load_config(None, ["optim.max_grad_norm=0.5", "optim.micro_batch_size=256", *overrides])  # auto on the CPU
    batch = make_batch(sizes, seed=len(name))
    kept, _ = METHODS[cfg.method](cfg).select(batch, offline_context(cfg, torch.Generator().manual_seed(1)))
    if advantages is not None:
        kept.advantages = torch.tensor(advantages)
    model, ref = make_model(), (make_model() if cfg.algo.beta > 0 else None)
    if ref is not None:
        ref.requires_grad_(False)
    with torch.no_grad():  # the reference must differ from the policy for the KL term to matter
        for p in model.parameters():
            p.add_(0.01)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5)  # plain SGD: parameters move by the gradient itself
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: 1.0)
    dp = data_parallel_for(model) if data_parallel_for else None
    initial = torch.cat([p.detach().reshape(-1).clone() for p in model.parameters()])
    updater = PolicyUpdater(model, optimizer, scheduler, UpdateSettings.of(cfg),
                            run_facts(cfg, torch.device("cpu")), ref,
                            data_parallel=dp)
    metrics = updater.update(kept.trim_padding(), torch.Generator().manual_seed(2))
    params = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    return {"rows": kept.num_rollouts, "metrics": metrics, "params": params, "initial": initial}


def generation_request():
    g = torch.Generator().manual_seed(5)
    prompts = [torch.randint(2, VOCAB, (int(n),), generator=g).tolist() for n in (3, 5, 2, 4, 1)]
    counts = [3, 4, 1, 5, 2]
    return prompts, counts, torch.randint(0, 2**62, (sum(counts),), generator=g)


def episode_turns(engine, prefills: list[int]) -> dict:
    """Three turns of five episodes (one ends after the second) through `engine`'s session: the turns' contexts,
    seeds and outputs, the episodes its local session held after each turn, and `prefills` once it is released."""
    from tests.engines.test_continuation import SAMPLED, next_contexts
    from tests.engines.test_engines import random_prompts

    session = engine.session()
    record: dict = {"continues": session.continues, "turns": [], "held": []}
    keys, contexts = [0, 1, 2, 3, 4], random_prompts([3, 7, 5, 2, 6], seed=3)
    for turn in range(3):
        seeds = torch.arange(len(keys)) * 7919 + 31 * turn
        out = session.generate(keys, contexts, SAMPLED, seeds)
        record["turns"].append((list(keys), contexts, seeds, out))
        record["held"].append(sorted(getattr(session, "local", session).cached))
        contexts = next_contexts(contexts, out, turn)
        if turn == 1:  # episode 3 ended: the next call does not ask for it
            keys, contexts = keys[:3] + keys[4:], contexts[:3] + contexts[4:]
    engine.release()  # the trainer's, before the update
    record["released"] = getattr(session, "local", session).cached
    record["prefills"] = list(prefills)
    return record


def session_engine():
    from benchmarks.episode_continuation import count_prefills
    from tests.engines.test_engines import make_model as continuation_model

    engine = FastEngine(continuation_model("qwen", peak=3.0, eos_bias=1.0), Tok(), cuda_graphs=False)
    return engine, count_prefills(engine)


def _rank_main(rank: int, world: int, init_file: str, out_dir: str) -> None:
    from podsrl.distributed import init_distributed

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    ctx = init_distributed(torch.device("cpu"))  # joins the existing group
    from podsrl.fsdp import build_data_parallel

    out: dict = {"updates": {name: run_scenario(name, lambda model: build_data_parallel(ctx, model))
                             for name in SCENARIOS}}
    engine = ctx.wrap_engine(FastEngine(make_model(3), Tok()))
    out["generated"] = engine.generate(*generation_request()[:2], SamplingParams(max_new_tokens=8),
                                       generation_request()[2])
    inner, prefills = session_engine()
    out["episodes"] = episode_turns(ctx.wrap_engine(inner), prefills)
    out["agree"] = ctx.agree(rank == 1)  # rank 0 says False
    batch, gen = make_batch([3, 2], seed=9), torch.Generator().manual_seed(4)
    batch.advantages = torch.ones(5)
    out["same_batch_kept"] = ctx.agree_batch(batch, gen) is batch
    if rank == 1:  # diverged: different advantages and RNG
        batch.advantages = batch.advantages * 2
        gen.manual_seed(99)
    agreed = ctx.agree_batch(batch, gen)
    out["agreed"] = (agreed.advantages, gen.get_state())
    torch.save(out, Path(out_dir) / f"rank{rank}.pt")
    dist.destroy_process_group()


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("ddp")
    mp.spawn(_rank_main, args=(2, str(tmp / "init"), str(tmp)), nprocs=2, join=True)
    return [torch.load(tmp / f"rank{r}.pt", weights_only=False) for r in range(2)]



@pytest.mark.parametrize("name", list(SCENARIOS))
def test_two_rank_update_equals_one_process(two_ranks, name):
    single = run_scenario(name)
    ranks = [r["updates"][name] for r in two_ranks]
    assert not torch.equal(single["params"], single["initial"])  # the update moved the weights
    for r in ranks:
        assert r["rows"] == single["rows"]
        assert set(r["metrics"]) == set(single["metrics"])
        for k, v in single["metrics"].items():
            assert r["metrics"][k] == pytest.approx(v, rel=1e-5, abs=1e-6), k
        torch.testing.assert_close(r["params"], single["params"], rtol=0, atol=1e-6)
    assert torch.equal(ranks[0]["params"], ranks[1]["params"])  # the ranks stay in lockstep, bit for bit


def test_scenarios_cover_uneven_work():
    rows = {name: run_scenario(name)["rows"] for name in ("pods", "uneven", "one_row")}
    assert rows == {"pods": 12, "uneven": 11, "one_row": 1}  # PODS kept 3 of 6 per group; odd; fewer than ranks


def test_sharded_generation_equals_one_call(two_ranks):
    prompts, counts, seeds = generation_request()
    whole = FastEngine(make_model(3), Tok()).generate(prompts, counts, SamplingParams(max_new_tokens=8), seeds)
    for r in two_ranks:
        out = r["generated"]
        for f in ("group_index", "prompt_ids", "prompt_mask", "completion_ids", "completion_mask", "truncated"):
            assert torch.equal(getattr(out, f), getattr(whole, f)), f
        torch.testing.assert_close(out.logprobs, whole.logprobs, atol=1e-5, rtol=0)


def test_sharded_sessions_continue_each_episode_on_its_rank(two_ranks):
    """Each rank continues the episodes it generated first (0, 2, 4 and 1, 3), prefilling what one process
    continuing only those episodes prefills; every rank gets every turn, with the tokens of a fresh engine over the
    whole contexts and log-probs of a fresh forward; release leaves no cache."""
    from tests.engines.test_continuation import SAMPLED, TEMPERATURE
    from tests.engines.test_engines import full_forward_logprobs

    for rank, r in enumerate(two_ranks):
        episodes = r["episodes"]
        assert episodes["continues"]
        home = {0: 0, 1: 1, 2: 0, 3: 1, 4: 0}  # episode -> the rank holding its cache
        assert episodes["held"] == [[key for key in keys if home[key] == rank] for keys, *_ in episodes["turns"]]
        assert episodes["released"] == {}
        engine, prefills = session_engine()
        for _, contexts, seeds, out in episodes["turns"]:
            fresh = FastEngine(engine.model, Tok(), cuda_graphs=False).generate(contexts, [1] * len(contexts),
                                                                               SAMPLED, seeds)
            for f in ("completion_ids", "completion_mask", "truncated"):
                assert torch.equal(getattr(out, f), getattr(fresh, f)), f
            assert torch.allclose(out.logprobs, full_forward_logprobs(engine.model, out, TEMPERATURE), atol=1e-4)
        alone = engine.session()  # this rank's episodes only, in one process
        for keys, contexts, seeds, _ in episodes["turns"]:
            mine = [i for i, key in enumerate(keys) if home[key] == rank]
            alone.generate([keys[i] for i in mine], [contexts[i] for i in mine], SAMPLED, seeds[mine])
        assert episodes["prefills"] == prefills


def test_ranks_take_rank_zero_decisions_and_batch(two_ranks):
    assert [r["agree"] for r in two_ranks] == [False, False]
    assert all(r["same_batch_kept"] for r in two_ranks)  # identical batches: no broadcast, same object
    (adv0, rng0), (adv1, rng1) = (r["agreed"] for r in two_ranks)
    assert torch.equal(adv0, torch.ones(5)) and torch.equal(adv1, adv0)
    assert torch.equal(rng0, rng1) and torch.equal(rng0, torch.Generator().manual_seed(4).get_state())


@pytest.mark.parametrize("strategy, cases", [
    ("ddp", [(11, 4, 2), (12, 2, 2), (1, 4, 2), (7, 2, 3), (0, 3, 2)]),
    ("fsdp", [(11, 4, 2), (12, 2, 2), (1, 4, 2), (7, 2, 3), (3, 1, 2)]),
])
def test_micro_batches_split_evenly_with_equal_counts(strategy, cases):
    """One split for both strategies; FSDP2 (lockstep) keeps empty micro-batches so every rank runs as many."""
    from podsrl.distributed import DataParallel, DistContext
    from podsrl.fsdp import FullyShardedDataParallel

    cls = FullyShardedDataParallel if strategy == "fsdp" else DataParallel
    for rows, size, world in cases:
        shares = []
        for rank in range(world):
            dp = cls.__new__(cls)  # the split needs no process group
            dp.ctx = DistContext(torch.device("cpu"), rank, world)
            shares.append(dp.micro_batches(torch.arange(rows), size))
        flat = torch.cat([m for share in shares for m in share]) if rows else torch.zeros(0, dtype=torch.long)
        assert flat.tolist() == list(range(rows))  # every row once, in order
        assert all(m.numel() <= size for share in shares for m in share)
        sizes = [sum(m.numel() for m in share) for share in shares]
        assert max(sizes) - min(sizes) <= 1
        counts = [len(share) for share in shares if sum(m.numel() for m in share) >= size]
        assert len(set(counts)) <= 1  # ranks with a full share run the same number of micro-batches
        if cls.lockstep:
            assert len({len(share) for share in shares}) == 1  # same number of forward/backward passes everywhere


# ------------------------------------------------------------------------------------------ end to end


def _train(tmp: Path, name: str, ranks: int, steps: int, resume: bool = False) -> list[dict]:
    proc = _launch(tmp, name, ranks, steps, resume)
    assert len([line for line in proc.stdout.splitlines() if line.startswith("{")]) == 1  # rank 0 prints
    return [json.loads(line) for line in (tmp / name / "metrics.jsonl").read_text().splitlines()]


def _launch(tmp: Path, name: str, ranks: int, steps: int, resume: bool = False,
            extra: tuple[str, ...] = ()) -> subprocess.CompletedProcess:
    run = tmp / name
    args = ["--resume", str(run), f"train.max_steps={steps}", *extra] if resume else [*extra,
        "--config", "grpo", f"output_dir={run}", f"train.max_steps={steps}", "warmup.steps=0",
        "task.eval_size=8", "eval.samples=0", "log.progress=false", "log.plot=false", "log.tensorboard=false",
        "rollout.prompts_per_step=4", "rollout.n=4", "method=pods", "pods.m=2",
        "model.device=cpu", "model.tiny.hidden_size=32", "model.tiny.num_layers=2", "model.tiny.intermediate_size=64",
        "optim.lr=0.01", "train.save_every=2", f"warmup.cache_dir={tmp / 'warm'}",
        f"rewards=[{ROOT / 'tests' / 'fixtures_distributed.py'}:digit_share]"]
    launcher = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(ranks)
                ] if ranks > 1 else [sys.executable]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run([*launcher, "-m", "podsrl", "train", *args], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=300, check=False)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc


@pytest.mark.slow
def test_torchrun_two_ranks_with_resume_match_one_process(tmp_path):
    single = _train(tmp_path, "one", 1, 3)
    _train(tmp_path, "two", 2, 2)
    two = _train(tmp_path, "two", 2, 3, resume=True)
    # Step records, then the final eval (the first 2-rank run also evaluated at its end, step 2).
    single = [r for r in single if "reward" in r] + single[-1:]
    two = [r for r in two if "reward" in r] + two[-1:]
    assert [r["step"] for r in two] == [r["step"] for r in single] == [1, 2, 3, 3]
    assert all(r["grad_norm"] > 0 and r["reward_std"] > 0 for r in single[:3])  # real updates, not zeros
    for a, b in zip(single, two):
        for k, v in a.items():
            if not k.startswith("time/") and isinstance(v, float):
                assert b[k] == pytest.approx(v, rel=1e-4, abs=1e-5), (a["step"], k)


@pytest.mark.slow
def test_torchrun_logs_once_and_a_resume_says_the_world_size_changed(tmp_path):
    """Rank 0 logs the start-up line and the info lines once; rank 1 only warnings and errors, and with
    log.rank_logs all its lines to its own file. A checkpoint of one process resumed on two ranks says so, in one
    line."""
    _launch(tmp_path, "run", 1, 1)
    err = _launch(tmp_path, "run", 2, 2, resume=True, extra=("log.rank_logs=true",)).stderr
    assert err.count("INFO run: 2 ranks (torchrun, gloo) on cpu, train.strategy=ddp; master float32") == 1
    assert err.count("INFO precision: ") == 1
    assert err.count("WARNING resuming a checkpoint written by 1 rank(s) on 2: each rank now") == 1
    own = (tmp_path / "run" / "ranks" / "rank1.log").read_text()
    assert "INFO run: 2 ranks (torchrun, gloo)" in own and "INFO precision: " in own
    assert not (tmp_path / "run" / "ranks" / "rank0.log").exists()  # rank 0's lines are run.log's
