"""Tests for specdecode.trees and the tree rules of specdecode.acceptance.

build_tree / tree_attention / greedy_tree: golden cases written out by hand.
rejection_tree: exact cases (a chain is rejection_chain step for step); its statistical
losslessness is in test_tree_sampling.py.
The tiny random llama: one forward over a tree equals plain forwards over each node's path,
and compacting an accepted path leaves a cache that decodes as if built from scratch.
"""


import numpy as np
import pytest
import torch

from specdecode.core.acceptance import (
    greedy_chain,
    greedy_tree,
    one_hot_probs,
    rejection_chain,
    rejection_tree,
)
from specdecode.models.native import NativeModel
from specdecode.core.sampling import SamplingConfig, logits_to_probs, sample
from specdecode.core.trees import Tree, build_tree, chain_tree, full_tree, tree_attention
from tests.test_acceptance import random_probs

# root ─┬─ 1 = (0,) ─┬─ 3 = (0, 0) ── 5 = (0, 0, 0)
#       │            └─ 4 = (0, 1)
#       └─ 2 = (1,)
EXAMPLE = [(0,), (1,), (0, 0), (0, 1), (0, 0, 0)]


def longs(*values: int) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.long)


def path_to(tree: Tree, node: int) -> list[int]:
    """Node indices from the root (0) to `node` inclusive, by the parents."""
    parents = tree.parents.tolist()
    nodes = [node]
    while nodes[-1] != 0:
        nodes.append(parents[nodes[-1]])
    return nodes[::-1]


def leaves(tree: Tree) -> list[int]:
    return [node for node in range(tree.num_nodes) if not tree.children[node]]


# ---- build_tree ----


def test_build_tree_golden():
    tree = build_tree(EXAMPLE)
    assert tree.paths == ((0,), (1,), (0, 0), (0, 1), (0, 0, 0))
    assert tree.num_nodes == 6 and tree.max_depth == 3
    assert tree.parents.tolist() == [-1, 0, 0, 1, 1, 3]
    assert tree.depths.tolist() == [0, 1, 1, 2, 2, 3]
    assert tree.ranks.tolist() == [0, 0, 1, 0, 1, 0]
    assert tree.children == ((1, 2), (3, 4), (), (5,), (), ())
    assert tree.mask.dtype == torch.bool
    assert tree.mask.int().tolist() == [
        [1, 0, 0, 0, 0, 0],
        [1, 1, 0, 0, 0, 0],
        [1, 0, 1, 0, 0, 0],
        [1, 1, 0, 1, 0, 0],
        [1, 1, 0, 0, 1, 0],
        [1, 1, 0, 1, 0, 1],
    ]
    for name in ("parents", "depths", "ranks"):
        assert getattr(tree, name).dtype == torch.long


def test_build_tree_accepts_any_order_and_sequences():
    shuffled = build_tree([[0, 0, 0], (0, 1), (1,), np.array([0, 0]).tolist(), (np.int64(0),)])
    reference = build_tree(EXAMPLE)
    assert shuffled == reference and hash(shuffled) == hash(reference)
    assert torch.equal(shuffled.mask, reference.mask)
    assert shuffled.paths[0] == (0,) and type(shuffled.paths[0][0]) is int


def test_root_only_and_rank_gaps():
    root = build_tree([])
    assert root.num_nodes == 1 and root.max_depth == 0
    assert root.parents.tolist() == [-1] and root.mask.tolist() == [[True]]
    assert root.children == ((),)
    gap = build_tree([(2,), (0,)])  # ranks need not be contiguous
    assert gap.paths == ((0,), (2,)) and gap.ranks.tolist() == [0, 0, 2] and gap.children[0] == (1, 2)


@pytest.mark.parametrize(
    "paths, match",
    [
        ([(0,), ()], "root is implicit"),
        ([(0,), (-1,)], "negative"),
        ([(0,), (0, 1), (0,)], "more than once"),
        ([(0,), (0, 0, 0)], r"no parent: its prefix \(0, 0\)"),
        ([(1, 0)], r"prefix \(1,\)"),
        ([(0,), (0.0, 1)], "ints only"),
        ([(0,), (True,)], "ints only"),
        ([0, 1], "tuple of ints"),
        (["01"], "tuple of ints"),
    ],
)
def test_build_tree_rejects(paths, match):
    with pytest.raises(ValueError, match=match):
        build_tree(paths)


def test_chain_and_full_trees():
    chain = chain_tree(3)
    assert chain.paths == ((0,), (0, 0), (0, 0, 0))
    assert chain.parents.tolist() == [-1, 0, 1, 2]
    assert torch.equal(chain.mask, torch.ones(4, 4, dtype=torch.bool).tril())  # causal
    assert chain_tree(0) == build_tree([])

    full = full_tree((2, 2, 1))
    assert full.num_nodes == 1 + 2 + 4 + 4
    assert full.paths[:6] == ((0,), (1,), (0, 0), (0, 1), (1, 0), (1, 1))
    assert full.children[0] == (1, 2) and full.children[1] == (3, 4) and full.children[3] == (7,)
    assert [int(full.depths[leaf]) for leaf in leaves(full)] == [3] * 4  # 4 leaves, all at depth 3
    assert full_tree(()) == build_tree([]) and full_tree((1, 1)) == chain_tree(2)
    for bad in ((2, 0), (1.5,), (-1,)):
        with pytest.raises(ValueError, match="widths"):
            full_tree(bad)
    for bad in (-1, 2.0, True):
        with pytest.raises(ValueError, match="k must"):
            chain_tree(bad)


def test_every_parent_precedes_its_children():
    for tree in (build_tree(EXAMPLE), full_tree((3, 2, 2)), random_tree(20, seed=1)):
        parents = tree.parents.tolist()
        assert all(parents[i] < i for i in range(1, tree.num_nodes))
        for node in range(tree.num_nodes):  # the mask's row is the node's path, ascending: compact can pack it
            assert torch.nonzero(tree.mask[node])[:, 0].tolist() == path_to(tree, node)


# ---- tree_attention ----


def test_tree_attention_golden():
    positions, mask = tree_attention(build_tree(EXAMPLE), start=3)
    assert positions.dtype == torch.long and positions.tolist() == [3, 4, 4, 5, 5, 6]
    assert mask.dtype == torch.bool
    assert mask.int().tolist() == [
        [1, 1, 1, 1, 0, 0, 0, 0, 0],
        [1, 1, 1, 1, 1, 0, 0, 0, 0],
        [1, 1, 1, 1, 0, 1, 0, 0, 0],
        [1, 1, 1, 1, 1, 0, 1, 0, 0],
        [1, 1, 1, 1, 1, 0, 0, 1, 0],
        [1, 1, 1, 1, 1, 0, 1, 0, 1],
    ]
    positions, mask = tree_attention(build_tree(EXAMPLE), start=0)
    assert positions.tolist() == [0, 1, 1, 2, 2, 3] and mask.shape == (6, 6)
    with pytest.raises(ValueError, match="start"):
        tree_attention(build_tree(EXAMPLE), start=-1)


# ---- greedy_tree ----

#                     node:  0  1  2  3  4  5
EXAMPLE_TOKENS = longs(9, 5, 7, 1, 2, 3)


@pytest.mark.parametrize(
    "target, expected",
    [
        ((7, 0, 4, 0, 0, 0), ([2], 4)),  # through the second-ranked child (a leaf): bonus 4
        ((8, 1, 1, 3, 3, 3), ([], 8)),  # no child of the root matches: correction 8
        ((5, 1, 0, 3, 0, 6), ([1, 3, 5], 6)),  # all the way to leaf 5, bonus 6
        ((5, 2, 0, 0, 8, 0), ([1, 4], 8)),  # second-ranked grandchild, a leaf
        ((5, 1, 0, 4, 0, 0), ([1, 3], 4)),  # stops at node 3: its child has 3, target 4
        ((5, 9, 0, 0, 0, 0), ([1], 9)),  # neither child of node 1 matches
    ],
)
def test_greedy_tree_golden(target, expected):
    assert greedy_tree(EXAMPLE_TOKENS, build_tree(EXAMPLE), longs(*target)) == expected


def test_greedy_tree_takes_the_first_ranked_of_equal_siblings():
    tree = build_tree([(0,), (1,), (1, 0)])
    assert greedy_tree(longs(0, 4, 4, 6), tree, longs(4, 6, 6, 7)) == ([1], 6)


def test_greedy_tree_on_a_chain_is_greedy_chain():
    generator = torch.Generator().manual_seed(0)
    for trial in range(50):
        draft = torch.randint(0, 3, (4,), generator=generator)
        target = torch.randint(0, 3, (5,), generator=generator)
        n, token = greedy_chain(draft, target)
        assert greedy_tree(torch.cat([longs(0), draft]), chain_tree(4), target) == (list(range(1, n + 1)), token)


def test_tree_rules_check_shapes():
    tree = build_tree(EXAMPLE)
    probs = random_probs(6, 5, seed=0)
    with pytest.raises(ValueError, match="node_tokens"):
        greedy_tree(longs(1, 2, 3), tree, longs(0, 0, 0, 0, 0, 0))
    with pytest.raises(ValueError, match="target_tokens"):
        greedy_tree(EXAMPLE_TOKENS, tree, longs(0, 0, 0, 0, 0, 0)[None])
    with pytest.raises(ValueError, match="node_tokens"):
        rejection_tree(longs(0, 1), tree, probs, probs)
    with pytest.raises(ValueError, match="target_probs"):
        rejection_tree(EXAMPLE_TOKENS % 5, tree, probs, probs[:5])
    with pytest.raises(ValueError, match="draft_probs"):
        rejection_tree(EXAMPLE_TOKENS % 5, tree, probs[:, :4], probs)


# ---- rejection_tree: exact cases ----


@pytest.mark.slow
def test_rejection_tree_on_a_chain_is_rejection_chain():
    # Same generator use (k uniforms, then one row of noise) and the same tests, so the
    # results agree seed for seed, not only in distribution.
    chain = chain_tree(3)
    for seed in range(300):
        generator = torch.Generator().manual_seed(10_000 + seed)
        target_probs = random_probs(4, 6, seed=seed)
        draft_probs = random_probs(3, 6, seed=seed + 1000)
        if seed % 3 == 1:
            draft_probs = logits_to_probs(draft_probs.log(), SamplingConfig(temperature=1.0, top_k=2))
        draft_tokens = sample(draft_probs, generator)
        if seed % 3 == 2:
            draft_probs = one_hot_probs(draft_tokens, 6)  # a deterministic drafter
        n, token = rejection_chain(draft_tokens, draft_probs, target_probs, torch.Generator().manual_seed(seed))
        node_tokens = torch.cat([longs(0), draft_tokens])  # (k+1,)
        padded = torch.cat([torch.zeros(1, 6), draft_probs])  # (k+1, V), row 0 unused
        got = rejection_tree(node_tokens, chain, padded, target_probs, torch.Generator().manual_seed(seed))
        assert got == (list(range(1, n + 1)), token)


def test_rejection_tree_uses_the_generator_a_fixed_amount():
    tree = build_tree(EXAMPLE)
    target_probs, draft_probs = random_probs(6, 5, seed=0), random_probs(6, 5, seed=1)
    node_tokens = sample(draft_probs, torch.Generator().manual_seed(2))
    outcomes = set()
    for seed in range(50):
        generator = torch.Generator().manual_seed(seed)
        result = rejection_tree(node_tokens, tree, draft_probs, target_probs, generator)
        assert result == rejection_tree(node_tokens, tree, draft_probs, target_probs, torch.Generator().manual_seed(seed))
        outcomes.add(tuple(result[0]))
        reference = torch.Generator().manual_seed(seed)
        torch.rand(5, generator=reference)  # N uniforms
        torch.empty(5).exponential_(generator=reference)  # one row of noise for next_token
        assert torch.equal(generator.get_state(), reference.get_state())
    assert len(outcomes) > 2


def test_rejection_tree_root_only_samples_the_target():
    target = torch.tensor([[0.0, 0.0, 1.0]])
    for seed in range(20):
        generator = torch.Generator().manual_seed(seed)
        assert rejection_tree(longs(1), build_tree([]), torch.zeros(1, 3), target, generator) == ([], 2)


def test_rejection_tree_on_greedy_probs_is_greedy_tree():
    # Temperature 0: target rows are one-hot, candidates deterministic (one-hot rows). A
    # candidate is accepted iff it is the argmax, and a rejected one takes no mass from the
    # residual (r(x) = 0 there), so next_token is the argmax: the greedy rule.
    tree = full_tree((2, 2))
    generator = torch.Generator().manual_seed(0)
    for trial in range(50):
        target_logits = torch.randn(tree.num_nodes, 4, generator=generator)  # (N+1, V)
        node_tokens = torch.randint(0, 4, (tree.num_nodes,), generator=generator)
        agree = torch.rand(tree.num_nodes, generator=generator) < 0.5
        node_tokens[1:] = torch.where(agree[1:], target_logits.argmax(-1)[tree.parents[1:]], node_tokens[1:])
        expected = greedy_tree(node_tokens, tree, target_logits.argmax(-1))
        target_probs = logits_to_probs(target_logits, SamplingConfig())
        draft_probs = one_hot_probs(node_tokens, 4)
        assert rejection_tree(node_tokens, tree, draft_probs, target_probs, generator) == expected


def test_a_rejected_deterministic_candidate_leaves_the_residual():
    # Three one-hot candidates under the root; the target has mass only on tokens 0 and 3.
    # Candidate 0 is accepted w.p. 0.4; once rejected, token 0 leaves the residual, so the
    # target's other token (3) is certain: candidate 3 (rank 2) is always accepted then.
    tree = build_tree([(0,), (1,), (2,)])
    target = torch.tensor([0.4, 0.0, 0.0, 0.6])
    target_probs = target.expand(4, 4)
    node_tokens = longs(2, 0, 1, 3)
    counts = {1: 0, 3: 0}
    for seed in range(400):
        accepted, next_token = rejection_tree(node_tokens, tree, one_hot_probs(node_tokens, 4),
                                              target_probs, torch.Generator().manual_seed(seed))
        assert accepted in ([1], [3]) and next_token in (0, 3)
        counts[accepted[0]] += 1
    assert 120 < counts[1] < 200  # 0.4 of 400, sd ~10


def test_candidate_with_zero_draft_probability_is_rejected():
    # Node 1 claims q(x) = 0 for its own token: it cannot have been drawn, so it is rejected
    # even though the target likes it; the residual is then the target minus that q row.
    tree = build_tree([(0,)])
    target_probs = torch.tensor([[0.1, 0.9, 0.0], [1 / 3, 1 / 3, 1 / 3]])
    draft_probs = torch.tensor([[0.0, 0.0, 0.0], [0.5, 0.0, 0.5]])
    for seed in range(100):
        generator = torch.Generator().manual_seed(seed)
        assert rejection_tree(longs(0, 1), tree, draft_probs, target_probs, generator) == ([], 1)


def test_candidates_drawn_from_the_target_are_accepted_at_rank_0():
    tree = full_tree((3, 2))
    for seed in range(100):
        generator = torch.Generator().manual_seed(seed)
        target_probs = random_probs(tree.num_nodes, 5, seed=seed)
        node_tokens = sample(target_probs[tree.parents.clamp_min(0)], generator)  # drawn from the parent's row
        accepted, _ = rejection_tree(node_tokens, tree, target_probs[tree.parents.clamp_min(0)], target_probs, generator)
        assert accepted[0] == 1 and all(tree.ranks[a] == 0 for a in accepted) and len(accepted) == 2


# ---- the tiny llama: a tree forward, then compact ----


def random_tree(num_drafted: int, seed: int) -> Tree:
    """A random tree with num_drafted nodes below the root: each new node hangs from a random
    existing node, with the next free rank there."""
    generator = torch.Generator().manual_seed(seed)
    paths: list[tuple[int, ...]] = [()]
    num_children: dict[tuple[int, ...], int] = {}
    for _ in range(num_drafted):
        parent = paths[int(torch.randint(0, len(paths), (), generator=generator))]
        rank = num_children.get(parent, 0)
        num_children[parent] = rank + 1
        paths.append(parent + (rank,))
    return build_tree(paths[1:])


@pytest.mark.slow
def test_tree_forward_then_compact_equals_recompute(tiny_llama):
    model = NativeModel.from_folder(tiny_llama, torch.float32)
    generator = torch.Generator().manual_seed(0)
    prefix = torch.randint(0, 96, (10,), generator=generator).tolist()
    tree = random_tree(7, seed=3)
    assert tree.num_nodes == 8 and tree.max_depth >= 2
    node_tokens = torch.randint(0, 96, (tree.num_nodes,), generator=generator)  # (N+1,), root first

    def last_logits(tokens: list[int]) -> torch.Tensor:
        return model(torch.tensor([tokens]), model.new_cache(), num_logits=1).logits[0, 0]  # (V,)

    cache = model.new_cache()
    model(torch.tensor([prefix]), cache)
    start = cache.length
    positions, mask = tree_attention(tree, start)
    tree_logits = model(node_tokens[None], cache, positions=positions, mask=mask).logits[0]  # (N+1, V)
    assert cache.length == start + tree.num_nodes
    for node in range(tree.num_nodes):
        path_tokens = node_tokens[path_to(tree, node)].tolist()
        torch.testing.assert_close(tree_logits[node], last_logits(prefix + path_tokens), rtol=0, atol=1e-4)

    # Keep the deepest root-to-leaf path, as if the rule accepted it, then decode greedily.
    path = path_to(tree, int(tree.depths.argmax()))
    cache.compact([start + node for node in path])
    assert cache.length == start + len(path)
    context = prefix + node_tokens[path].tolist()
    token = int(tree_logits[path[-1]].argmax())
    for _ in range(3):
        logits = model(torch.tensor([[token]]), cache).logits[0, 0]  # (V,)
        context.append(token)
        torch.testing.assert_close(logits, last_logits(context), rtol=0, atol=1e-4)
        token = int(logits.argmax())


def assert_tree_pass_is_bitwise_plain(model, prefix_len: int, tree: Tree, vocab: int, seed: int) -> None:
    """Each node's logits from one tree pass are bitwise those of one-token passes along its path."""
    generator = torch.Generator().manual_seed(seed)
    prefix = torch.randint(0, vocab, (1, prefix_len), generator=generator)
    node_tokens = torch.randint(0, vocab, (tree.num_nodes,), generator=generator)
    cache = model.new_cache(max_len=1024)
    model(prefix, cache)
    positions, mask = tree_attention(tree, cache.length)
    tree_logits = model(node_tokens[None], cache, positions=positions, mask=mask).logits[0]  # (N+1, V)
    for leaf in leaves(tree):
        single = model.new_cache(max_len=1024)
        model(prefix, single)
        for node in path_to(tree, leaf):
            logits = model(node_tokens[node].view(1, 1), single).logits[0, 0]  # (V,)
            assert torch.equal(logits, tree_logits[node]), f"node {node} of {tree.paths}"


@pytest.mark.qwen
def test_qwen_bf16_tree_pass_is_bitwise_plain(qwen_folder):
    """The case that failed before path-by-path attention (path_attention.py): on Qwen2.5-1.5B
    a bf16 tree pass differed from plain decoding in the last bit at nodes whose ancestors
    were not in the slots just before them. The second prefix puts the tree across a
    512-key block boundary."""
    model = NativeModel.from_folder(qwen_folder, torch.bfloat16)
    tree = random_tree(10, seed=4)
    assert_tree_pass_is_bitwise_plain(model, 40, tree, vocab=1000, seed=1)
    assert_tree_pass_is_bitwise_plain(model, 505, tree, vocab=1000, seed=2)


def test_bf16_tree_pass_equals_one_token_passes(tiny_llama, bf16_path):
    """Batch invariance for trees: in bf16, each node's logits from one tree pass are bitwise
    those of plain one-token decoding along its path, so greedy tree decoding emits exactly
    plain greedy decoding's tokens (masked sibling slots add exact zeros; native.py)."""
    model = NativeModel.from_folder(tiny_llama, torch.bfloat16)
    generator = torch.Generator().manual_seed(1)
    prefix = torch.randint(0, 96, (1, 20), generator=generator)
    tree = random_tree(15, seed=4)
    node_tokens = torch.randint(0, 96, (tree.num_nodes,), generator=generator)
    cache = model.new_cache()
    model(prefix, cache)
    positions, mask = tree_attention(tree, cache.length)
    tree_logits = model(node_tokens[None], cache, positions=positions, mask=mask).logits[0]  # (N+1, V)
    for leaf in leaves(tree):
        single = model.new_cache()
        model(prefix, single)
        for node in path_to(tree, leaf):
            logits = model(node_tokens[node].view(1, 1), single).logits[0, 0]  # (V,)
            assert torch.equal(logits, tree_logits[node]), node
