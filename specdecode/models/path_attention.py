"""Exact attention for a tree pass: each root-to-leaf path attends as a chain would.

A tree pass writes node i to slot start + i, so a node's ancestors are generally not in
the slots just before it: node 5 of a tree may attend to slots start, start + 1 and
start + 5, where plain decoding of the same tokens would have them at start, start + 1,
start + 2. Masked slots add exact zeros, but the attention kernel's vectorised sums
group keys by their slot, so the non-zero terms round differently and a bf16 tree pass
can differ from plain decoding in the last bit (seen on Qwen2.5-1.5B: a near-tie in a
chat answer flipped). Chains are unaffected: their ancestors are contiguous.

The exact alternative: for each root-to-leaf path, write its nodes' keys and values to
the slots start, start + 1, ... in path order, and let the path's nodes that no earlier
path answered attend causally there: exactly the layout plain decoding has. Every node
is answered once; a tree with n leaves costs n attention calls per layer instead of one
(attention is a small part of a step; the linear layers are shared, one pass).

This is for torch's attention (fp32 models, long passes). bf16 decoding and verify
passes go through the kernels' cache attention (attention_host.h), which is exact for a tree in one call.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class PathPlan:
    """One root-to-leaf path of a tree pass."""

    nodes: torch.Tensor  # (L,) long: the path's tokens, indices into the pass, ascending
    queries: torch.Tensor  # (Q,) long: the nodes this path answers, a suffix of `nodes`

    @property
    def first_query(self) -> int:
        return len(self.nodes) - len(self.queries)


def plan_paths(mask: torch.Tensor, start: int) -> list[PathPlan] | None:
    """The paths of the tree that `mask` (T, start + T) or (1, T, start + T) describes.

    None when one pass is already exact (the new tokens attend causally, as a chain) or
    when the mask is not a tree over a fully visible prefix (then no chain layout exists
    and the caller attends in one pass).
    """
    if mask.dim() == 3:
        if mask.shape[0] != 1:
            return None
        mask = mask[0]
    T = mask.shape[0]
    if not bool(mask[:, :start].all()):
        return None
    new = mask[:, start:]
    if torch.equal(new, torch.ones(T, T, dtype=torch.bool).tril()):
        return None
    ancestors = [[j for j, seen in enumerate(row) if seen] for row in new.tolist()]
    for i, path in enumerate(ancestors):
        # a tree row: the node itself last, and above it exactly its parent's row
        if not path or path[-1] != i or (len(path) > 1 and ancestors[path[-2]] != path[:-1]):
            return None
    has_child = {path[-2] for path in ancestors if len(path) > 1}
    answered: set[int] = set()
    plans = []
    for leaf in (i for i in range(T) if i not in has_child):
        path = ancestors[leaf]
        queries = [n for n in path if n not in answered]
        answered.update(queries)
        plans.append(PathPlan(torch.tensor(path), torch.tensor(queries)))
    return plans
