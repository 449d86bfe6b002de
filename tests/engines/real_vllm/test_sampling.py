"""The engine contract (podsrl/engines/base.py) held by the vllm engine on real vLLM (CPU build), beside the fast
engine on the same float32 weights: greedy tokens equal; sampled log-probs equal the update's own recomputation
within 1e-4 (the sampler/trainer mismatch measured as k3 KL per token, printed); stop ids, max_new_tokens and the
truncation flags; per-row seeds; and after optimiser updates and weight syncs (plain and LoRA-merged) greedy tokens
still equal the fast engine's, with no stale weights or prefix-cache K/V."""

from __future__ import annotations

import pytest

from tests.engines.real_vllm.helpers import SKIP_REASON

pytest.importorskip("vllm", reason=SKIP_REASON)
# one torch thread, as the main suite's engine tests: two threads on two busy cores spin (10 s for a 0.1 s step)
pytestmark = pytest.mark.usefixtures("one_thread")

import torch

from podsrl.algo.loss import k3_kl
from podsrl.batch import RolloutBatch
from podsrl.engines.base import SamplingParams
from podsrl.update.plain import plain_logprobs
from tests.engines.real_vllm.helpers import (
    completions,
    fast_engine,
    load_policy,
    task_prompts,
    vllm_engine,
)
from tests.tiny_lm import assert_rows_end_at_their_first_stop

GREEDY = SamplingParams(max_new_tokens=8, greedy=True, return_logprobs=False)
LOGPROB_ATOL = 1e-4  # float32 both ways: vLLM's CPU kernels against the update's forward differ by rounding only


@pytest.fixture(scope="module")
def policy():
    return load_policy()


@pytest.fixture(scope="module")
def engines(policy, tokenizer):
    vllm, fast = vllm_engine(policy, tokenizer), fast_engine(policy, tokenizer)
    yield vllm, fast
    vllm.close()


def seeds_for(rows: int, base: int = 11) -> torch.Tensor:
    return torch.arange(rows) * 7919 + base


def assert_same_greedy(vllm, fast, prompts):
    counts = [1] * len(prompts)
    a = vllm.generate(prompts, counts, GREEDY, seeds_for(len(prompts)))
    b = fast.generate(prompts, counts, GREEDY, seeds_for(len(prompts)))
    assert completions(a) == completions(b)
    assert torch.equal(a.truncated, b.truncated)
    return completions(a)


def test_greedy_tokens_equal_the_fast_engines(engines, tokenizer):
    vllm, fast = engines
    got = assert_same_greedy(vllm, fast, task_prompts(tokenizer, 64))
    assert len({tuple(c) for c in got}) > 10  # answers to different sums, not one constant row


def test_threads_and_set_num_threads_survive_start_up(engines):
    before = torch.get_num_threads()
    torch.set_num_threads(1 if before != 1 else 2)  # the real function: vLLM's CPU worker replaced it with a no-op
    assert torch.get_num_threads() != before
    torch.set_num_threads(before)


def recomputed_logprobs(model, out, temperature: float) -> torch.Tensor:
    """The update's reference forward (podsrl/update/plain.py) over the engine's rows."""
    batch = RolloutBatch(problems=[], group_index=out.group_index, prompt_ids=out.prompt_ids,
                         prompt_mask=out.prompt_mask, completion_ids=out.completion_ids,
                         completion_mask=out.completion_mask, truncated=out.truncated)
    rows = torch.arange(out.completion_ids.shape[0])
    with torch.no_grad():
        logprobs, _ = plain_logprobs(model, batch, rows, out.completion_ids.shape[1], torch.device("cpu"),
                                     temperature, 4096)
    return logprobs * out.completion_mask


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_sampled_logprobs_equal_the_updates_recomputation(engines, policy, tokenizer, temperature):
    vllm, _ = engines
    prompts = task_prompts(tokenizer, 16, offset=100)
    out = vllm.generate(prompts, [8] * 16, SamplingParams(max_new_tokens=8, temperature=temperature),
                        seeds_for(128))
    trainer = recomputed_logprobs(policy, out, temperature)
    mask = out.completion_mask.bool()
    diff = (out.logprobs - trainer)[mask].abs()
    # KL(sampler || trainer) per token, estimated on the sampled tokens; in float64, where float32 rounds it to 0
    k3 = k3_kl(out.logprobs.double(), trainer.double())[mask]
    print(f"\nvllm vs update log-probs, T={temperature}: {int(mask.sum())} tokens, max |diff| {diff.max():.3e}, "
          f"mean |diff| {diff.mean():.3e}, k3 KL per token mean {k3.mean():.3e} max {k3.max():.3e}")
    assert out.logprobs[mask].lt(0).any()  # real log-probs, not a zero tensor
    assert diff.max() < LOGPROB_ATOL


def test_stops_max_new_tokens_and_truncation_flags(engines, tokenizer):
    vllm, fast = engines
    one = tokenizer.convert_tokens_to_ids("1")  # an extra stop id the model does emit (sums reach 297)
    eos = tokenizer.eos_token_id
    prompts = task_prompts(tokenizer, 8, offset=200)
    ended, truncated = {}, 0
    for max_new_tokens in (1, 2, 3, 6):
        params = SamplingParams(max_new_tokens=max_new_tokens, temperature=1.0, stop_token_ids=(one,))
        out = vllm.generate(prompts, [8] * 8, params, seeds_for(64))
        assert out.completion_ids.shape[1] <= max_new_tokens
        for stop, rows in assert_rows_end_at_their_first_stop(out, {eos, one}, max_new_tokens).items():
            ended[stop] = ended.get(stop, 0) + rows
        truncated += int(out.truncated.sum())
    assert ended.get(eos, 0) > 0 and ended.get(one, 0) > 0 and truncated > 0  # each kind of ending occurred
    greedy_stop = SamplingParams(max_new_tokens=8, greedy=True, stop_token_ids=(one,), return_logprobs=False)
    a = vllm.generate(prompts, [1] * 8, greedy_stop, seeds_for(8))
    b = fast.generate(prompts, [1] * 8, greedy_stop, seeds_for(8))
    assert completions(a) == completions(b) and torch.equal(a.truncated, b.truncated)
    empty = vllm.generate(prompts, [2] * 8, SamplingParams(max_new_tokens=0), seeds_for(16))
    assert empty.completion_ids.shape == (16, 0) and empty.truncated.all()


def test_a_rows_sample_depends_on_its_own_seed_only(engines, tokenizer):
    vllm, _ = engines
    prompts = task_prompts(tokenizer, 6, offset=300)
    params = SamplingParams(max_new_tokens=8, temperature=1.0)
    seeds = seeds_for(6 * 4)
    whole = vllm.generate(prompts, [4] * 6, params, seeds)
    # prompt 2's rows alone, in reverse order: the same (prompt, seed) gives the same row
    alone = vllm.generate([prompts[2]] * 4, [1] * 4, params, seeds[8:12].flip(0))
    assert completions(alone) == completions(whole)[8:12][::-1]
    assert torch.equal(alone.logprobs.flip(0)[:, : whole.logprobs.shape[1]],
                       whole.logprobs[8:12, : alone.logprobs.shape[1]])
    again = vllm.generate(prompts, [4] * 6, params, seeds + 1)
    assert completions(again) != completions(whole)  # other seeds, other samples


def update_towards(model, tokenizer, prompts, answer: str, steps: int, lr: float = 3e-3):
    """`steps` AdamW steps of a supervised loss pulling every prompt's completion towards `answer`: real updates
    that move the greedy tokens."""
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=lr)
    target = tokenizer(answer, add_special_tokens=False).input_ids + [tokenizer.eos_token_id]
    ids = torch.tensor([p + target for p in prompts])
    labels = ids.clone()
    labels[:, : len(prompts[0])] = -100
    model.train()
    for _ in range(steps):
        loss = model(input_ids=ids, labels=labels).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    model.eval()


def test_greedy_after_updates_and_syncs_equals_the_fast_engines(tokenizer):
    model = load_policy()
    # block_size 32 (the CPU's smallest): these 40-token prompts fill a block, so vLLM's prefix cache holds its K/V
    # between calls
    vllm = vllm_engine(model, tokenizer, llm_options={"block_size": 32})
    fast = fast_engine(model, tokenizer)
    prompts = [[int(t) for t in torch.randint(2, 60, (40,), generator=torch.Generator().manual_seed(i))]
               for i in range(8)]
    same_length = task_prompts(tokenizer, 32, offset=400)
    same_length = [p for p in same_length if len(p) == len(same_length[0])][:8]
    before = assert_same_greedy(vllm, fast, prompts)
    seen = [before]
    for answer in ("77", "123", "5"):
        update_towards(model, tokenizer, same_length, answer, steps=3)
        vllm.sync_weights(model)
        fast.sync_weights(model)  # as the trainer does after each update
        seen.append(assert_same_greedy(vllm, fast, prompts))
        assert_same_greedy(vllm, fast, same_length)
    assert len({tuple(map(tuple, s)) for s in seen}) == len(seen)  # every update changed the greedy tokens
    vllm.close()


def test_lora_merged_weights_at_start_and_after_syncs(tokenizer):
    from podsrl.lora import apply_lora

    model = apply_lora(load_policy(), rank=4, alpha=8, target_modules=["q_proj", "v_proj", "down_proj"])
    prompts = task_prompts(tokenizer, 32, offset=500)

    def train_adapter(seed):
        with torch.no_grad():
            generator = torch.Generator().manual_seed(seed)
            for name, p in model.named_parameters():
                if ".lora_B." in name:
                    p.copy_(torch.randn(p.shape, generator=generator) * 0.3)

    train_adapter(1)
    vllm, fast = vllm_engine(model, tokenizer), fast_engine(model, tokenizer)
    seen = [assert_same_greedy(vllm, fast, prompts)]
    for seed in (2, 3):
        train_adapter(seed)
        vllm.sync_weights(model)
        fast.sync_weights(model)
        seen.append(assert_same_greedy(vllm, fast, prompts))
    assert len({tuple(map(tuple, s)) for s in seen}) == len(seen)
    vllm.close()


def test_seeded_rows_whose_prompts_split_across_forward_passes(tokenizer):
    """vLLM's CPU sampler cannot rewind a seeded row's generator (CPU generators have no offset), which chunked
    prefill does when a prompt is split across forward passes: on the CPU the engine turns chunked prefill off."""
    model = load_policy()
    vllm = vllm_engine(model, tokenizer, max_num_batched_tokens=64)  # a pass holds 64 prompt tokens: splits
    prompts = [[int(t) for t in torch.randint(2, 60, (40,), generator=torch.Generator().manual_seed(i))]
               for i in range(4)]
    params = SamplingParams(max_new_tokens=8, temperature=1.0)
    out = vllm.generate(prompts, [4] * 4, params, seeds_for(16))
    alone = vllm.generate(prompts[1:2], [4], params, seeds_for(16)[4:8])
    assert completions(alone) == completions(out)[4:8]
    vllm.close()
