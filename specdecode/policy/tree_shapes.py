"""Choosing a tree's shape from measured acceptance and the measured verify cost.

A drafter that offers ranked candidates per depth (Medusa's heads, a branching draft
model) has, per depth d and rank r, a measured probability `accuracy[d][r]` that its
rank-r candidate is the target's token given that the path so far was accepted. The
target has one token per position, so siblings are mutually exclusive and a node is
accepted with probability the product of its path's accuracies. A tree then emits, per
round, on average

    E[tokens] = 1 + sum over nodes of prod(accuracy[d][r_d] along the node's path)

(the 1 is the correction or bonus token). `grow_tree` adds nodes best-first by that
product, which keeps the tree prefix-closed (a child never beats its parent), so the
tree with n nodes is the best n-node tree under the independence assumption.
`choose_tree` then picks n by expected tokens per second:
E[tokens] / (v(n+1) + c + (leaves - 1) l), with v the target's pass over n+1 tokens
relative to one (tune.py measures it), c the drafter's cost per round relative to a
plain step, and l what each root-to-leaf path beyond the first adds to the pass (where
torch's attention runs, an exact tree attends path by path, models/path_attention.py;
the bf16 kernel's is about 0; tune.measure_leaf_cost).
"""

from __future__ import annotations

import heapq
from typing import Sequence

Path = tuple[int, ...]


def path_probability(path: Path, accuracy: Sequence[Sequence[float]]) -> float:
    p = 1.0
    for depth, rank in enumerate(path):
        p *= accuracy[depth][rank] if depth < len(accuracy) and rank < len(accuracy[depth]) else 0.0
    return p


def expected_tokens_of_tree(paths: Sequence[Path], accuracy: Sequence[Sequence[float]]) -> float:
    return 1.0 + sum(path_probability(p, accuracy) for p in paths)


def grow_tree(accuracy: Sequence[Sequence[float]], num_nodes: int) -> list[Path]:
    """The num_nodes paths of highest acceptance probability, best first."""
    frontier = [(-path_probability((r,), accuracy), (r,)) for r in range(len(accuracy[0]))] if accuracy else []
    heapq.heapify(frontier)
    paths: list[Path] = []
    while frontier and len(paths) < num_nodes:
        negative_p, path = heapq.heappop(frontier)
        if negative_p == 0.0:
            break  # nothing left that could ever be accepted
        paths.append(path)
        if len(path) < len(accuracy):
            for rank in range(len(accuracy[len(path)])):
                child = path + (rank,)
                heapq.heappush(frontier, (-path_probability(child, accuracy), child))
    return paths


def num_leaves(paths: Sequence[Path]) -> int:
    """Root-to-leaf paths of a tree (the root alone is one)."""
    parents = {p[:-1] for p in paths}
    return max(1, sum(1 for p in paths if p not in parents))


def choose_tree(accuracy: Sequence[Sequence[float]], verify_ratios: Sequence[float], draft_ratio: float,
                max_nodes: int, leaf_ratio: float = 0.0) -> tuple[list[Path], float]:
    """(paths, expected speedup over plain decoding) of the best tree of at most max_nodes
    nodes; verify_ratios[n-1] = the target's pass over n tokens / over one; leaf_ratio =
    the pass's extra cost per root-to-leaf path beyond the first."""
    best: tuple[list[Path], float] = ([], 1.0)
    grown = grow_tree(accuracy, max_nodes)
    for n in range(1, len(grown) + 1):
        v = verify_ratios[min(n, len(verify_ratios) - 1)]  # pass over n nodes + the root
        paths_cost = (num_leaves(grown[:n]) - 1) * leaf_ratio
        speedup = expected_tokens_of_tree(grown[:n], accuracy) / (v + draft_ratio + paths_cost)
        if speedup > best[1]:
            best = (grown[:n], speedup)
    return best
