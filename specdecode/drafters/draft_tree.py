"""A draft model that drafts a tree: its top-w tokens at each node, one pass per depth.

With widths (2, 2, 1) the root gets the draft model's two likeliest next tokens, each of
those two children of its own, and each of those one: 10 candidates on 4 paths, for the
same number of draft passes as a chain 3 long (a pass over all nodes of a depth at once,
each seeing the context and its own ancestors through a tree mask over the draft's
cache). The target then verifies all of them in one pass. A chain dies at the draft
model's first wrong guess; the tree survives it when the target's token was the draft's
second choice.

Candidates are deterministic (top ranks), so under sampling the tree rule takes one-hot
draft rows and stays exact. After drafting, the draft cache is rewound to the context.
"""

from __future__ import annotations

from typing import Sequence

import torch

from specdecode.core.sampling import SamplingConfig
from specdecode.core.trees import Tree, build_tree, full_tree, tree_attention
from specdecode.drafters.base import TreeDrafter, TreeProposal
from specdecode.drafters.draft_model import DraftModel


class DraftTree(TreeDrafter):
    name = "draft-tree"

    def __init__(self, draft: DraftModel, widths: Sequence[int]):
        self.draft = draft
        self.widths = tuple(widths)
        self.tree = full_tree(self.widths)
        self.max_nodes = self.tree.num_nodes
        self._trees = {self.tree.max_depth: self.tree}

    def propose_tree(self, context: Sequence[int], max_depth: int, sampling: SamplingConfig,
                     generator: torch.Generator | None) -> TreeProposal:
        tree = self._tree(max_depth)
        if tree.num_nodes == 1:
            return TreeProposal(tree, torch.empty(0, dtype=torch.long))
        draft = self.draft
        feed = draft.sync(context, tree.num_nodes)
        logits = draft.model(torch.tensor([feed]), draft.cache, num_logits=1).logits[0]  # (1, V)
        draft.cached.extend(feed)
        base = draft.cache.length  # slot of node 1; the root is the last context token, at base - 1
        tokens = torch.zeros(tree.num_nodes, dtype=torch.long)  # by node index; 0 is the root
        parents_logits = {0: logits[0]}
        _, full_mask = tree_attention(tree, base - 1)  # over [context..., root, nodes...]
        for depth in range(1, tree.max_depth + 1):
            nodes = (tree.depths == depth).nonzero()[:, 0]  # contiguous: nodes are ordered by depth
            for node in nodes.tolist():
                parent = int(tree.parents[node])
                ranked = parents_logits[parent].topk(int(tree.ranks[node]) + 1).indices
                tokens[node] = ranked[-1]
            if depth == tree.max_depth:
                break
            first, last = int(nodes[0]), int(nodes[-1])
            # rows of these nodes, columns: context + root (base slots) and nodes 1..last
            mask = full_mask[first:last + 1, : base + last]
            positions = (base - 1) + tree.depths[first:last + 1]
            out = draft.model(tokens[first:last + 1][None], draft.cache, positions=positions, mask=mask)
            for row, node in enumerate(range(first, last + 1)):
                parents_logits[node] = out.logits[0, row]
        draft.cache.rewind(draft.cache.length - base)  # forget the tree: the next context says what stayed
        vocab = draft.target_vocab_size
        return TreeProposal(tree, tokens[1:].clamp(max=vocab - 1))

    def _tree(self, max_depth: int) -> Tree:
        depth = max(0, min(max_depth, self.tree.max_depth))
        if depth not in self._trees:
            self._trees[depth] = build_tree([p for p in self.tree.paths if len(p) <= depth])
        return self._trees[depth]
