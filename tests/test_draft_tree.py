"""A draft model drafting trees: greedy output identical to plain, on tiny models."""

import pytest
import torch

from specdecode.drafters import DraftModel
from specdecode.drafters.draft_tree import DraftTree
from specdecode.core.engine import decode
from specdecode.core.events import collect
from specdecode.models.native import NativeModel
from specdecode.core.sampling import SamplingConfig
from specdecode.core.stopping import StopCondition


@pytest.mark.slow
@pytest.mark.parametrize("widths", [(2, 2, 1), (3, 1), (1, 1, 1, 1)])
def test_draft_tree_greedy_is_identical_to_plain(tiny_llama, tiny_llama_other, widths):
    target = NativeModel.from_folder(tiny_llama, torch.bfloat16)
    stop = StopCondition(frozenset(), max_new_tokens=40)
    for draft_folder in (tiny_llama, tiny_llama_other):  # a perfect drafter, then a poor one
        draft = NativeModel.from_folder(draft_folder, torch.bfloat16)
        drafter = DraftTree(DraftModel(draft, target.vocab_size), widths)
        for seed in range(2):
            prompt = torch.randint(0, 96, (10,), generator=torch.Generator().manual_seed(seed)).tolist()
            plain, _ = collect(decode(target, prompt, stop))
            tokens, done = collect(decode(target, prompt, stop, drafter=drafter))
            assert tokens == plain
            if draft_folder == tiny_llama:  # the target drafting for itself: every path's first branch holds
                assert done.stats.mean_accepted_length > len(widths)


@pytest.mark.slow
def test_draft_tree_the_perfect_drafter_fills_every_depth(tiny_llama):
    target = NativeModel.from_folder(tiny_llama, torch.float32)
    drafter = DraftTree(DraftModel(NativeModel.from_folder(tiny_llama, torch.float32), target.vocab_size), (2, 2))
    stop = StopCondition(frozenset(), max_new_tokens=31)
    tokens, done = collect(decode(target, [5, 6, 7], stop, drafter=drafter))
    assert done.stats.acceptance_by_position == [1.0, 1.0]
    sampled, _ = collect(decode(target, [5, 6, 7], stop, SamplingConfig(temperature=1.0), drafter,
                                generator=torch.Generator().manual_seed(0)))
    assert len(sampled) == 31
