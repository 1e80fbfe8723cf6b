"""A pass over several sequences gives each bitwise the logits of a pass over it alone."""

from __future__ import annotations

import pytest
import torch

from specdecode.core.trees import build_tree, tree_attention
from specdecode.models import batched
from specdecode.models.batched import SequencePass, can_batch, forward_many
from specdecode.models.native import NativeModel

PROMPTS = [[3, 17, 42, 8, 91, 5], [7, 50, 2], [12, 7, 50, 2, 9, 31, 44, 8, 19, 23, 61], [5]]
NEW = [[4, 9, 33], [6], [8, 8, 1, 2, 3, 4, 5], [10, 11]]  # a ragged batch: 1 to 7 rows each


def prefilled(model, prompt):
    cache = model.new_cache(1, 64)
    model(torch.tensor([prompt]), cache, num_logits=1)
    return cache


@pytest.mark.parametrize("quant", [None, "q8_0", "q4_0"])
@pytest.mark.parametrize("folder", ["tiny_llama", "tiny_qwen2"])
def test_each_sequence_gets_its_own_pass_bitwise(folder, quant, request, kernel_module):
    model = NativeModel.from_folder(request.getfixturevalue(folder), torch.bfloat16, quant)
    assert can_batch(model)
    alone_caches = [prefilled(model, p) for p in PROMPTS]
    alone = [model(torch.tensor([new]), cache).logits[0] for new, cache in zip(NEW, alone_caches)]
    caches = [prefilled(model, p) for p in PROMPTS]
    together = forward_many(model, [SequencePass(new, cache) for new, cache in zip(NEW, caches)])
    for a, b, ca, cb in zip(alone, together, alone_caches, caches):
        assert a.shape == b.shape and torch.equal(a, b)
        assert ca.length == cb.length
        assert torch.equal(ca.keys[:, :, :, :ca.length], cb.keys[:, :, :, :cb.length])


def test_a_tree_pass_shares_the_batch_with_chains(tiny_llama, kernel_module):
    model = NativeModel.from_folder(tiny_llama, torch.bfloat16)
    tree = build_tree([(0,), (1,), (0, 0), (1, 0)])
    tree_tokens = [5, 6, 7, 8, 9]

    def tree_pass(cache):
        positions, mask = tree_attention(tree, cache.length)
        return SequencePass(tree_tokens, cache, mask, positions)

    cache = prefilled(model, PROMPTS[0])
    p = tree_pass(cache)
    alone = model(torch.tensor([tree_tokens]), cache, positions=p.positions, mask=p.mask).logits[0]
    caches = [prefilled(model, PROMPTS[0]), prefilled(model, PROMPTS[1])]
    together = forward_many(model, [tree_pass(caches[0]), SequencePass(NEW[1], caches[1])])
    assert torch.equal(alone, together[0])


def test_products_split_where_rows_stop_being_invariant(tiny_llama, kernel_module, monkeypatch):
    """On oneDNN a bf16 product is row-invariant up to 11 rows: a batch of 17 rows must be
    cut into runs of at most that many, and still give each sequence its own logits."""
    model = NativeModel.from_folder(tiny_llama, torch.bfloat16)
    calls = []
    real = batched._product

    def spy(linear, h, max_rows):
        calls.append((h.shape[1], max_rows))
        return real(linear, h, max_rows)

    monkeypatch.setattr(batched, "_product", spy)
    monkeypatch.setattr(NativeModel, "row_invariant_rows", property(lambda self: 4))
    caches = [prefilled(model, p) for p in PROMPTS]
    together = forward_many(model, [SequencePass(new, cache) for new, cache in zip(NEW, caches)])
    assert calls and all(max_rows == 4 for _, max_rows in calls)
    alone = [model(torch.tensor([new]), prefilled(model, p)).logits[0] for new, p in zip(NEW, PROMPTS)]
    assert all(torch.equal(a, b) for a, b in zip(alone, together))
    assert real(model.layers[0].qkv, torch.zeros(1, 9, model.config.hidden_size, dtype=torch.bfloat16), 4).shape[1] == 9


def test_fp32_passes_run_one_after_another(tiny_llama):
    model = NativeModel.from_folder(tiny_llama, torch.float32)
    assert not can_batch(model)
    caches = [prefilled(model, p) for p in PROMPTS[:2]]
    together = forward_many(model, [SequencePass(new, cache) for new, cache in zip(NEW[:2], caches)])
    alone = [model(torch.tensor([new]), prefilled(model, p)).logits[0] for new, p in zip(NEW[:2], PROMPTS[:2])]
    assert all(torch.equal(a, b) for a, b in zip(alone, together))
    assert [c.length for c in caches] == [len(p) + len(n) for p, n in zip(PROMPTS[:2], NEW[:2])]
