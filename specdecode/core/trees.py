"""Trees of draft candidates, as data: the nodes, who is whose parent, and the positions and
attention mask a target forward over all of them needs.

A round of tree speculation drafts several candidates per position instead of one: the
target verifies every node of the tree in one forward pass, each node attending to the
cached context and to its own ancestors only, and an acceptance rule (`greedy_tree`,
`rejection_tree` in acceptance.py) keeps one root-to-node path.

A tree is given by the index paths of its nodes, e.g. [(0,), (1,), (0, 0), (0, 1), (0, 0, 0)]:

    root ─┬─ (0,) ─┬─ (0, 0) ── (0, 0, 0)        node 0 = root
          │        └─ (0, 1)                      nodes 1, 2 = (0,), (1,)
          └─ (1,)                                 nodes 3, 4 = (0, 0), (0, 1); node 5 = (0, 0, 0)

Words:
  root: node 0, the pending token: the last emitted token, which the target has not yet
      processed. It is not drafted and never judged; it is not in the list of paths.
  path: a node's address, the ranks taken from the root: (i, j) is the j-th ranked child
      of the i-th ranked child of the root. The root's path is ().
  rank: a node's place among its siblings (the last element of its path). Rank 0 is the
      drafter's first choice; the acceptance rules try siblings in rank order.
  depth: len(path). A node at depth d proposes the token d positions after the root.
  leaf: a node without children. chain: a tree with one child per node, i.e. a plain
      k-token draft (`chain_tree(k)`).

Node order: nodes are numbered in order of (depth, path), so the root is 0, then its
children by rank, then the depth-2 nodes, and so on. Every parent comes before its
children, so the node indices along any root-to-node path ascend. Node i is written to
cache slot start + i by the verify pass, and an accepted path's slots therefore ascend
too, which is what `KVCache.compact` needs to pack them into contiguous slots.

Everything here is a pure function of its arguments; tensors are on the CPU (move them to
the model's device). Left out: trees that change shape with the drafter's confidences
within a round (build a new Tree per round), batches.
"""

from __future__ import annotations

import itertools
import numbers
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

Path = tuple[int, ...]


@dataclass(frozen=True, eq=False)
class Tree:
    """A tree of draft candidates, N nodes below the root. Build it with `build_tree`.

    Two trees are equal when they have the same paths (everything else follows from them).
    """

    paths: tuple[Path, ...]  # N paths sorted by (len, path); node i+1 is paths[i]
    parents: Tensor  # (N+1,) long, parents[0] = -1
    depths: Tensor  # (N+1,) long, 0 for the root
    ranks: Tensor  # (N+1,) long, the last element of each path; 0 for the root
    mask: Tensor  # (N+1, N+1) bool, True where the column is an ancestor-or-self of the row
    children: tuple[tuple[int, ...], ...]  # per node, its children's indices by rank

    @property
    def num_nodes(self) -> int:
        """N + 1: the drafted nodes and the root."""
        return len(self.paths) + 1

    @property
    def max_depth(self) -> int:
        return len(self.paths[-1]) if self.paths else 0

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Tree) and self.paths == other.paths

    def __hash__(self) -> int:
        return hash(self.paths)

    def __repr__(self) -> str:
        return f"Tree(num_nodes={self.num_nodes}, max_depth={self.max_depth}, paths={list(self.paths)})"


def build_tree(paths: Iterable[Sequence[int]]) -> Tree:
    """A Tree from the index paths of its nodes, in any order (the root () is implicit).

    Every path must be a non-empty tuple of ints >= 0, appear once, and have all its
    prefixes in the list too (a node's parent must be a node). Ranks among siblings need not
    be contiguous: [(0,), (2,)] is a root with two children of ranks 0 and 2.
    An empty list is the root alone (no drafts; the round is a plain decoding step).
    """
    checked = [_check_path(path) for path in paths]
    seen: set[Path] = set()
    for path in checked:
        if path in seen:
            raise ValueError(f"path {path} appears more than once")
        seen.add(path)
    for path in checked:
        if len(path) > 1 and path[:-1] not in seen:
            raise ValueError(f"path {path} has no parent: its prefix {path[:-1]} is not in the tree")

    ordered = tuple(sorted(checked, key=lambda path: (len(path), path)))
    index = {(): 0} | {path: i + 1 for i, path in enumerate(ordered)}
    num_nodes = len(ordered) + 1
    parents = [-1] + [index[path[:-1]] for path in ordered]
    depths = [0] + [len(path) for path in ordered]
    ranks = [0] + [path[-1] for path in ordered]

    children: list[list[int]] = [[] for _ in range(num_nodes)]
    for node in range(1, num_nodes):
        children[parents[node]].append(node)  # nodes ascend by (depth, path), so by rank here

    # Row i = row of its parent (set earlier, since parents come first) plus i itself.
    mask = torch.zeros(num_nodes, num_nodes, dtype=torch.bool)
    mask[0, 0] = True
    for node in range(1, num_nodes):
        mask[node] = mask[parents[node]]
        mask[node, node] = True

    return Tree(
        paths=ordered,
        parents=torch.tensor(parents, dtype=torch.long),
        depths=torch.tensor(depths, dtype=torch.long),
        ranks=torch.tensor(ranks, dtype=torch.long),
        mask=mask,
        children=tuple(tuple(c) for c in children),
    )


def chain_tree(k: int) -> Tree:
    """The chain of k drafts, (0,), (0, 0), ...: what plain speculative decoding verifies."""
    if not _is_int(k) or k < 0:
        raise ValueError(f"k must be an int >= 0, got {k!r}")
    return build_tree([(0,) * depth for depth in range(1, k + 1)])


def full_tree(widths: Sequence[int]) -> Tree:
    """Every node at depth d has widths[d] children: (2, 2, 1) has 2 + 4 + 4 = 10 nodes below
    the root.

    The node count is the sum of the running products of widths, so it grows fast.
    """
    if not all(_is_int(w) and w >= 1 for w in widths):
        raise ValueError(f"widths must be ints >= 1, got {tuple(widths)!r}")
    paths: list[Path] = []
    for depth in range(1, len(widths) + 1):
        paths += itertools.product(*(range(w) for w in widths[:depth]))
    return build_tree(paths)


def tree_attention(tree: Tree, start: int) -> tuple[Tensor, Tensor]:
    """Positions and mask for a target forward over all the tree's nodes at once.

    The forward writes node i to cache slot start + i (the root at `start`, which must be
    cache.length), each node at rotary position start + depth: the cache is assumed compact,
    slot = position for the prefix [0, start), as it is after `KVCache.compact`.
    Returns positions (N+1,) long and mask (N+1, start+N+1) bool (True = may attend): every
    node sees the whole cached prefix and, among the tree's slots, its ancestors and itself.
    """
    if not _is_int(start) or start < 0:
        raise ValueError(f"start must be an int >= 0 (the cache length), got {start!r}")
    positions = start + tree.depths  # (N+1,)
    prefix = torch.ones(tree.num_nodes, start, dtype=torch.bool)  # (N+1, start)
    mask = torch.cat([prefix, tree.mask], dim=1)  # (N+1, start+N+1)
    return positions, mask


def _is_int(value: object) -> bool:
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def _check_path(path: object) -> Path:
    """A path as a tuple of Python ints, or a ValueError saying what is wrong with it."""
    if isinstance(path, (str, bytes)) or not isinstance(path, Sequence):
        raise ValueError(f"each path must be a tuple of ints, got {path!r}")
    if len(path) == 0:
        raise ValueError("empty path (): the root is implicit and must not be listed")
    if not all(_is_int(i) for i in path):
        raise ValueError(f"path {tuple(path)!r} must hold ints only")
    if any(i < 0 for i in path):
        raise ValueError(f"path {tuple(path)!r} has a negative index")
    return tuple(int(i) for i in path)
