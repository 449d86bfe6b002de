"""KV-cache continuation of episodes in the fast engine: a continued turn gives the tokens of a re-prefilled one and
log-probs equal to a fresh forward over the whole sequence, across waves and the kept-state (graph) path; it
prefills only the tokens its cache lacks; close and release free what a session keeps; the paths without the
static-shape step re-prefill through the same interface."""

from __future__ import annotations

import pytest
import torch

from benchmarks.episode_continuation import count_prefills
from podsrl.engines import SamplingParams
from podsrl.engines.base import EpisodeSession
from podsrl.engines.fast import FastEngine
from tests.engines.test_engines import VOCAB, full_forward_logprobs, make_model, random_prompts
from tests.engines.test_waves import LOGPROB_TOL, graphed
from tests.tiny_lm import TokStub as Tok

pytestmark = pytest.mark.usefixtures("one_thread")
TEMPERATURE = 0.9
SAMPLED = SamplingParams(max_new_tokens=10, temperature=TEMPERATURE, top_p=0.95, top_k=20)


def tool_answer(turn: int, row: int) -> list[int]:
    """An environment's answer: a few tokens, of a length that differs by row and turn."""
    return random_prompts([2 + (row + turn) % 4], seed=100 * turn + row)[0]


def next_contexts(contexts, out, turn: int) -> list[list[int]]:
    """Each context with its turn appended (row 1's cut one token short, as the runner cuts a turn at a tool
    call's end) and then the environment's answer."""
    grown = []
    for row, context in enumerate(contexts):
        n = int(out.completion_mask[row].sum())
        turn_ids = out.completion_ids[row, : n - 1 if row == 1 and n > 1 else n].tolist()
        grown.append(context + turn_ids + tool_answer(turn, row))
    return grown


def test_continued_turns_equal_a_fresh_forward_and_a_reprefilled_generate():
    """Three turns of five episodes (one ends after the second): each continued turn samples the tokens a fresh
    engine samples from the whole context with the same seeds, its log-probs equal theirs and a fresh forward's;
    one row at a time, three (waves refilled from the queue) and all at once, eagerly and on the kept-state path."""
    model = make_model("qwen", peak=3.0, eos_bias=1.0)
    first = random_prompts([3, 7, 5, 2, 6], seed=3)
    for max_rows in (1, 3, None):
        for engine in (FastEngine(model, Tok(), cuda_graphs=False, max_rows=max_rows), graphed(model, max_rows)):
            session = engine.session()
            assert session.continues
            keys, contexts = [0, 1, 2, 3, 4], first
            for turn in range(3):
                seeds = torch.arange(len(keys)) * 7919 + 31 * turn
                out = session.generate(keys, contexts, SAMPLED, seeds)
                fresh = FastEngine(model, Tok(), cuda_graphs=False).generate(contexts, [1] * len(contexts), SAMPLED,
                                                                            seeds)
                assert torch.equal(out.completion_ids, fresh.completion_ids), (max_rows, turn)
                assert torch.equal(out.completion_mask, fresh.completion_mask)
                assert (out.logprobs - fresh.logprobs).abs().max() <= LOGPROB_TOL
                assert torch.allclose(out.logprobs, full_forward_logprobs(model, out, TEMPERATURE), atol=1e-4)
                assert sorted(session.cached) == keys  # every row's cache kept for the next turn
                contexts = next_contexts(contexts, out, turn)
                if turn == 1:  # episode 3 ended: the next call does not ask for it
                    keys, contexts = keys[:3] + keys[4:], contexts[:3] + contexts[4:]
            session.close()
            assert session.cached == {}


def test_a_continued_turn_prefills_only_the_tokens_its_cache_lacks():
    """After a turn, the next prefill computes the turn's last token (sampled, never run through the model) and the
    environment's answer: for two rows, as many columns as the row lacking more needs; a re-prefilling session
    computes every token of the left-padded contexts."""
    model = make_model("qwen", peak=3.0, eos_bias=1.0)
    params = SamplingParams(max_new_tokens=6, temperature=TEMPERATURE)
    engine = FastEngine(model, Tok(), cuda_graphs=False)
    prefills = count_prefills(engine)
    contexts = random_prompts([9, 4], seed=5)
    seeds = torch.tensor([3, 8])
    with engine.session() as session:
        out = session.generate([0, 1], contexts, params, seeds)
        assert prefills == [2 * 9]
        answers = [[5, 6, 7], [5, 6, 7, 8, 9]]
        grown = [c + out.completion_ids[r, : int(out.completion_mask[r].sum())].tolist() + a
                 for r, (c, a) in enumerate(zip(contexts, answers))]
        session.generate([0, 1], grown, params, seeds + 1)
    assert prefills[1] == 2 * (1 + 5)
    reprefill = FastEngine(model, Tok(), cuda_graphs=False)
    counted = count_prefills(reprefill)
    EpisodeSession(reprefill).generate([0, 1], grown, params, seeds + 1)
    assert counted == [2 * max(len(g) for g in grown)]


def test_a_lone_continued_row_prefills_exactly_what_it_lacks():
    """A turn that ran to max_new_tokens, then a four-token answer: the next prefill is those five tokens."""
    model = make_model("qwen", peak=3.0, eos_bias=-5.0)  # no stop: every turn runs max_new_tokens
    params = SamplingParams(max_new_tokens=5, temperature=TEMPERATURE)
    engine = FastEngine(model, Tok(), cuda_graphs=False)
    prefills = count_prefills(engine)
    context = random_prompts([8], seed=2)[0]
    with engine.session() as session:
        out = session.generate(["episode"], [context], params, torch.tensor([4]))
        assert int(out.completion_mask.sum()) == 5
        answer = [VOCAB - 1] * 4
        session.generate(["episode"], [context + out.completion_ids[0].tolist() + answer], params, torch.tensor([5]))
    assert prefills == [8, 1 + 4]


def test_close_and_release_free_a_sessions_caches():
    """The trainer's release before the update frees an open session's caches (its next turn prefills whole and
    gives the same tokens); paths without the static-shape step return the re-prefilling session."""
    model = make_model("qwen", peak=3.0, eos_bias=1.0)
    engine = FastEngine(model, Tok(), cuda_graphs=False)
    contexts = random_prompts([4, 6], seed=7)
    session = engine.session()
    out = session.generate([0, 1], contexts, SAMPLED, torch.tensor([1, 2]))
    assert len(session.cached) == 2
    engine.release()
    assert session.cached == {}
    again = session.generate([0, 1], contexts, SAMPLED, torch.tensor([1, 2]))
    assert torch.equal(again.completion_ids, out.completion_ids)
    for options in ({"cache": "dynamic"}, {"layer_loop": False}):
        assert not FastEngine(model, Tok(), cuda_graphs=False, **options).session().continues
