"""Continuous batching: sequences that join and leave a running batch, each drafting its
own k, decode exactly what `engine.decode` gives each alone (greedy token for token,
and seeded sampling draw for draw)."""

from __future__ import annotations

import pytest
import torch

from specdecode.core import batch
from specdecode.core.batch import Sequence, prefill, step
from specdecode.core.draft_length import FixedK
from specdecode.core.engine import decode
from specdecode.core.events import collect
from specdecode.core.sampling import SamplingConfig
from specdecode.core.stopping import StopCondition
from specdecode.drafters import DraftModel, PromptLookup
from specdecode.errors import SpecDecodeError
from specdecode.drafters.draft_tree import DraftTree
from specdecode.models.native import NativeModel
from tests.conftest import require_kernel

PROMPTS = [[5, 17, 42, 8, 17, 42, 8, 91, 5, 17, 42], [3, 9, 27, 3, 9, 27, 3], [7, 7, 7, 1, 2], [11, 4, 60, 11, 4],
           [50, 2, 8, 13, 21, 34, 55, 2, 8]]


@pytest.fixture(scope="module")
def tiny(tiny_llama):
    require_kernel()  # the batched pass runs on the fused kernels
    return NativeModel.from_folder(tiny_llama, torch.bfloat16)


@pytest.fixture(scope="module")
def tiny_other(tiny_llama_other):
    return NativeModel.from_folder(tiny_llama_other, torch.bfloat16)


def alone(model, prompt, stop, drafter=None, k=0, sampling=SamplingConfig(), seed=None):
    generator = torch.Generator().manual_seed(seed) if seed is not None else None
    tokens, done = collect(decode(model, prompt, stop, sampling, drafter, k, generator))
    return tokens, done.reason


def run_batch(model, seqs: list[Sequence], join_at: list[int], ks) -> list[list[int]]:
    """Decode seqs together; sequence i joins at step join_at[i] and leaves when done.
    ks(step, seq) gives its k. Returns each sequence's tokens from the Rounds."""
    out = [[] for _ in seqs]
    running: list[int] = []
    for t in range(1000):
        for i, seq in enumerate(seqs):
            if join_at[i] == t:
                out[i] += prefill(model, seq).token_ids
                if not seq.done:
                    running.append(i)
        if not running and t > max(join_at):
            return out
        if running:
            rounds = step(model, [seqs[i] for i in running], [ks(t, seqs[i]) for i in running])
            for i, r in zip(running, rounds):
                out[i] += r.token_ids
            running = [i for i in running if not seqs[i].done]
    raise AssertionError("the batch never finished")


def test_greedy_batch_is_each_sequence_alone(tiny, tiny_other):
    """Ragged joins, lengths, drafters and k, some sequences plain: every one is greedy identical."""
    budgets = [30, 12, 25, 1, 40]
    drafters = [PromptLookup(), None, DraftModel(tiny_other, tiny.vocab_size, 128), PromptLookup(), PromptLookup()]
    ks = [3, 0, 2, 4, 8]
    seqs = [Sequence(p, StopCondition(max_new_tokens=b), drafter=d, policy=FixedK(k), k_max=k)
            for p, b, d, k in zip(PROMPTS, budgets, drafters, ks)]
    got = run_batch(tiny, seqs, [0, 0, 2, 3, 5], lambda t, s: s.k_max if t % 3 else 1)  # k changes per step
    for prompt, budget, tokens, seq in zip(PROMPTS, budgets, got, seqs):
        expected, reason = alone(tiny, prompt, StopCondition(max_new_tokens=budget))
        assert tokens == expected == seq.new_tokens
        assert seq.finish_reason == reason
    assert seqs[4].stats.accepted_tokens > 0  # prompt lookup found copies in the repetitive prompt
    assert seqs[1].stats.draft_tokens == 0


def test_seeded_sampling_in_a_batch_draws_what_it_draws_alone(tiny, tiny_other):
    sampling = SamplingConfig(temperature=0.9, top_k=40)
    seqs = [Sequence(p, StopCondition(max_new_tokens=20), sampling, DraftModel(tiny_other, tiny.vocab_size, 128),
                     FixedK(3), torch.Generator().manual_seed(seed), k_max=3)
            for p, seed in zip(PROMPTS[:3], (1, 2, 3))]
    got = run_batch(tiny, seqs, [0, 1, 1], lambda t, s: 3)
    for prompt, seed, tokens in zip(PROMPTS[:3], (1, 2, 3), got):
        expected, _ = alone(tiny, prompt, StopCondition(max_new_tokens=20),
                            DraftModel(tiny_other, tiny.vocab_size, 128), 3, sampling, seed)
        assert tokens == expected
    assert len({tuple(t) for t in got}) == 3


def test_eos_inside_a_batch_ends_that_sequence_only(tiny):
    expected, _ = alone(tiny, PROMPTS[0], StopCondition(max_new_tokens=30))
    eos = expected[6]
    seqs = [Sequence(PROMPTS[0], StopCondition(frozenset([eos]), max_new_tokens=30), drafter=PromptLookup(),
                     policy=FixedK(4), k_max=4),
            Sequence(PROMPTS[1], StopCondition(max_new_tokens=30))]
    got = run_batch(tiny, seqs, [0, 0], lambda t, s: 4)
    assert got[0] == expected[:expected.index(eos) + 1] and seqs[0].finish_reason == "eos"
    assert len(got[1]) == 30 and seqs[1].finish_reason == "length"


def test_trees_and_finished_sequences_are_refused(tiny, tiny_other):
    tree = Sequence(PROMPTS[0], StopCondition(max_new_tokens=5), drafter=DraftTree(DraftModel(tiny_other, tiny.vocab_size),
                                                                                    (2, 1)))
    with pytest.raises(SpecDecodeError, match="chain drafters"):
        prefill(tiny, tree)
    seq = Sequence(PROMPTS[1], StopCondition(max_new_tokens=1))
    prefill(tiny, seq)
    assert seq.done
    with pytest.raises(SpecDecodeError, match="not done"):
        batch.step(tiny, [seq], [0])


def test_a_lookup_that_finds_no_match_lowers_its_acceptance(tiny):
    """Asked for drafts and given none, a sequence's α falls from the prior, so the
    goodput controller stops giving it rows; a sequence never asked keeps its prior."""
    from specdecode.drafters.base import Proposal
    from specdecode.policy.adaptive import AdaptiveK
    from specdecode.policy.costs import cost_model

    class NeverMatches(PromptLookup):
        def propose(self, context, k, sampling=None, generator=None, tokens_left=None):
            return Proposal(torch.empty(0, dtype=torch.long))

    costs = cost_model({1: 0.01, 2: 0.0101, 4: 0.0103, 8: 0.011, 16: 0.012}, 0.0)
    stop = StopCondition(frozenset(), max_new_tokens=20)
    asked, idle = (Sequence([1, 2, 3, 4, 5], stop, drafter=NeverMatches(), policy=AdaptiveK(costs), k_max=4)
                   for _ in range(2))
    for seq in (asked, idle):
        prefill(tiny, seq)
    before = asked.policy.alpha
    for _ in range(6):
        assert [r.num_drafted for r in step(tiny, [asked, idle], [4, 0])] == [0, 0]
    assert asked.policy.alpha < 0.3 < before == idle.policy.alpha  # six misses outweigh the prior
