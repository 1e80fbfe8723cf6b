"""Statistical losslessness of the multi-candidate tree rule (acceptance.rejection_tree).

Over many rounds on a seeded random language model, the emitted tokens must be
distributed as sampling the target alone, for three ways of drafting the candidates;
deliberately wrong rules must fail the same check.
"""

import functools
import itertools

import numpy as np
import pytest
import torch

from specdecode.core.acceptance import rejection_tree
from specdecode.core.sampling import sample
from specdecode.core.trees import Tree, build_tree
from tests.test_acceptance import assert_distributed_as
from tests.test_trees import EXAMPLE

# ---- rejection_tree: statistical losslessness ----
#
# A seeded random language model gives the target's p(. | prefix) and a drafter's q(. | prefix)
# over V = 4 tokens (the prefix counts the tokens after the root). Each trial is one round on
# the EXAMPLE tree: candidates are drawn from q given their parent's path, a rule picks a path
# and next_token, and the emitted sequence (accepted tokens, then next_token) is continued from
# the target directly until it has max_depth + 1 = 4 tokens, as the next rounds would (rounds
# that emit more are cut). Sampling the target alone gives sequences with probability
# p(x1) p(x2 | x1) p(x3 | x1 x2) p(x4 | x1 x2 x3), so the first two and all four tokens are
# checked against that joint. Four tokens reach every node of the tree, the bonus at leaf 5
# included.
#
# Thresholds: assert_distributed_as (test_acceptance.py) fails on a chi-square p-value below
# 1e-3, i.e. a correct rule fails a given check about once in 1000 seeds (the seeds here are
# fixed, so a pass is permanent), and on a total variation above a bound a correct rule
# exceeds with probability below 1e-3.

V = 4
NUM_TRIALS = 20_000
DEPTH = 3  # EXAMPLE's max_depth; sequences of DEPTH + 1 tokens are compared


def _seed_of(prefix: tuple[int, ...]) -> int:
    return int("".join(str(x + 1) for x in prefix) or "0")  # V < 10: digits 1..V, injective


@functools.cache
def target_lm(prefix: tuple[int, ...]) -> torch.Tensor:
    """p(. | prefix), (V,) float32. One row in three gives a token no mass."""
    seed = _seed_of(prefix)
    logits = 1.5 * torch.randn(V, generator=torch.Generator().manual_seed(seed))
    if seed % 3 == 0:
        logits[seed % V] = -torch.inf
    return torch.softmax(logits, dim=-1)


def draft_lm(prefix: tuple[int, ...]) -> torch.Tensor:
    """q(. | prefix), (V,) float32: another random model, with full support."""
    logits = 1.5 * torch.randn(V, generator=torch.Generator().manual_seed(7_000_000 + _seed_of(prefix)))
    return torch.softmax(logits, dim=-1)


# Both models tabulated over every prefix of up to DEPTH + 1 tokens, so that a whole batch of
# trials indexes rows by prefix id instead of calling them one prefix at a time.
PREFIXES = [p for n in range(DEPTH + 2) for p in itertools.product(range(V), repeat=n)]
PREFIX_ID = {prefix: i for i, prefix in enumerate(PREFIXES)}
TARGET_TABLE = torch.stack([target_lm(p) for p in PREFIXES])  # (num_prefixes, V)
DRAFT_TABLE = torch.stack([draft_lm(p) for p in PREFIXES])  # (num_prefixes, V)
# EXTEND[i, x] = id of PREFIXES[i] + (x,); -1 past the longest prefix.
EXTEND = np.array([[PREFIX_ID.get(p + (x,), -1) for x in range(V)] for p in PREFIXES])


def draw(rows: np.ndarray, rng: np.random.Generator) -> np.ndarray:
    """One token per row of rows (n, V) float64, by inverse CDF; zero-mass tokens never come."""
    cdf = rows.cumsum(1)  # (n, V)
    u = rng.random(rows.shape[0])[:, None] * cdf[:, -1:]  # (n, 1) in [0, total)
    return (cdf <= u).sum(1)  # (n,) the first index whose cdf exceeds u


def draw_candidates(tree: Tree, mode: str, num_trials: int, rng: np.random.Generator):
    """For num_trials rounds: node tokens (trials, N+1) (root token 0), prefix ids of the
    nodes' paths (trials, N+1), and draft rows (trials, N+1, V), drafted as `mode` says:
    iid: each child drawn from q(. | parent's path), with replacement; row = that q.
    without_replacement: each child from q with its earlier siblings' tokens removed; row = that.
    top_ranked: the rank-r child is q's r-th most likely token (deterministic); row = one-hot.
    """
    tokens = np.zeros((num_trials, tree.num_nodes), dtype=np.int64)
    prefix_ids = np.zeros((num_trials, tree.num_nodes), dtype=np.int64)  # root: id of () = 0
    rows = np.zeros((num_trials, tree.num_nodes, V))
    trials = np.arange(num_trials)
    for node in range(tree.num_nodes):  # parents come first, so their prefixes are known
        q = DRAFT_TABLE.double().numpy()[prefix_ids[:, node]]  # (trials, V)
        taken = np.zeros((num_trials, V), dtype=bool)
        for child in tree.children[node]:
            if mode == "top_ranked":
                row = np.zeros_like(q)
                row[trials, np.argsort(-q, axis=1, kind="stable")[:, int(tree.ranks[child])]] = 1.0
            elif mode == "iid":
                row = q
            else:
                row = np.where(taken, 0.0, q)
                row = row / row.sum(1, keepdims=True)
            tokens[:, child] = draw(row, rng)
            taken[trials, tokens[:, child]] = True
            prefix_ids[:, child] = EXTEND[prefix_ids[:, node], tokens[:, child]]
            rows[:, child] = row
    return tokens, prefix_ids, torch.from_numpy(rows).float()


def accept_any_drawn(node_tokens, tree, draft_probs, target_probs, generator):
    """Wrong on purpose: accepts the first candidate drawn with q > 0 at every node."""
    node, accepted = 0, []
    while tree.children[node]:
        node = tree.children[node][0]
        accepted.append(node)
    return accepted, int(sample(target_probs[node], generator))


def residual_not_carried(node_tokens, tree, draft_probs, target_probs, generator):
    """Wrong on purpose, a plausible bug: after a rejection each sibling is judged against
    norm(max(0, target - q)) of the last rejected sibling alone, forgetting the earlier ones."""
    node, accepted = 0, []
    residual = target_probs[0]
    while True:
        for child in tree.children[node]:
            x = int(node_tokens[child])
            if torch.rand((), generator=generator) * draft_probs[child, x] < residual[x]:
                accepted.append(child)
                node, residual = child, target_probs[child]
                break
            left = (target_probs[node] - draft_probs[child]).clamp_min(0.0)
            residual = left / left.sum() if left.sum() > 0 else target_probs[node]
        else:
            return accepted, int(sample(residual, generator))


RULES = {"rejection_tree": rejection_tree, "accept_any_drawn": accept_any_drawn,
         "residual_not_carried": residual_not_carried}


@functools.cache
@torch.inference_mode()
def simulate(mode: str, rule_name: str) -> np.ndarray:
    """(NUM_TRIALS, DEPTH + 1) emitted sequences, continued from the target where short."""
    rule = RULES[rule_name]
    tree = build_tree(EXAMPLE)
    rng = np.random.default_rng(2024)
    generator = torch.Generator().manual_seed(2025)
    tokens, prefix_ids, draft_rows = draw_candidates(tree, mode, NUM_TRIALS, rng)
    target_rows = TARGET_TABLE[torch.from_numpy(prefix_ids)]  # (trials, N+1, V)
    node_tokens = torch.from_numpy(tokens)
    sequences = np.full((NUM_TRIALS, DEPTH + 1), -1, dtype=np.int64)
    for trial in range(NUM_TRIALS):
        accepted, next_token = rule(node_tokens[trial], tree, draft_rows[trial], target_rows[trial], generator)
        emitted = tokens[trial, accepted].tolist() + [next_token]
        sequences[trial, : len(emitted)] = emitted[: DEPTH + 1]
    # Where a round emitted fewer than DEPTH + 1 tokens, continue from the target directly.
    ids = np.zeros(NUM_TRIALS, dtype=np.int64)  # prefix id of the sequence so far
    for position in range(DEPTH + 1):
        short = sequences[:, position] < 0
        sequences[short, position] = draw(TARGET_TABLE.double().numpy()[ids[short]], rng)
        ids = EXTEND[ids, sequences[:, position]]
    return sequences


def target_joint(length: int) -> np.ndarray:
    """(V**length,) the target's probability of each sequence, in `cells_of` order."""
    joint = []
    for sequence in itertools.product(range(V), repeat=length):  # lexicographic = base-V order
        probability = 1.0
        for i, token in enumerate(sequence):
            row = TARGET_TABLE[PREFIX_ID[sequence[:i]]].double()
            probability *= float(row[token] / row.sum())
        joint.append(probability)
    return np.array(joint)


def cells_of(sequences: np.ndarray) -> np.ndarray:
    """(n, length) token sequences -> (n,) cell indices, the first token most significant."""
    return (sequences * V ** np.arange(sequences.shape[1] - 1, -1, -1)).sum(1)


MODES = ["iid", "without_replacement", "top_ranked"]


# 20k rounds per simulation: at 2k, residual_not_carried on top_ranked already passes the check
@pytest.mark.slow
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("length", [2, DEPTH + 1])
def test_rejection_tree_emits_the_target_distribution(mode, length):
    sequences = simulate(mode, "rejection_tree")
    assert_distributed_as(cells_of(sequences[:, :length]), target_joint(length))


@pytest.mark.slow
@pytest.mark.parametrize("mode, wrong", [("iid", "accept_any_drawn"), ("top_ranked", "residual_not_carried"),
                                         ("without_replacement", "residual_not_carried")])
def test_wrong_rules_fail_the_same_check(mode, wrong):
    # Negative controls: the check above can fail, and does on a wrong rule.
    sequences = simulate(mode, wrong)
    with pytest.raises(AssertionError, match="chi-square|total variation|impossible"):
        assert_distributed_as(cells_of(sequences), target_joint(DEPTH + 1))
