"""Medusa drafting: a tree of candidates from heads on the target's own hidden state.

After each target pass the engine hands over the final hidden state of the positions it
kept; the last one, h_t, is where the target chose the pending token (the tree's root).
Head d's ranked candidates fill depth d+1 of the tree: the node with path (r_1, ..., r_d)
carries head (d-1)'s rank-r_d token. Medusa's heads see only h_t, so every node of a depth
offers the same ranked list; the tree decides which combinations are worth verifying.

Candidates are deterministic (top ranks), so under sampling the tree rule takes one-hot
draft rows and stays exact. The heads' logits go through the target's LM head, or the
rows of it the heads were trained on (draft_vocab.py): one product of K rows, the only
sizeable cost of a draft.
"""

from __future__ import annotations

from typing import Sequence

import torch

from specdecode.policy.gate import TreeGate
from specdecode.heads.draft_vocab import DraftVocab
from specdecode.errors import SpecDecodeError
from specdecode.core.sampling import SamplingConfig
from specdecode.core.trees import Tree, build_tree
from specdecode.drafters.base import TreeDrafter, TreeProposal


class MedusaDrafter(TreeDrafter):
    name = "medusa"

    def __init__(self, target, heads, paths: Sequence[tuple[int, ...]], vocab: DraftVocab | None = None,
                 gate: TreeGate | None = None):
        if not hasattr(target, "lm_head") or not hasattr(target, "config"):
            raise SpecDecodeError("Medusa needs the native backend (a Llama-family target)")
        if heads.weight.shape[-1] != target.config.hidden_size:
            raise SpecDecodeError(f"these Medusa heads expect hidden size {heads.weight.shape[-1]}, "
                                  f"the target has {target.config.hidden_size}")
        self.target = target
        self.vocab = vocab or DraftVocab(target.lm_head)
        self.tree_gate = gate  # None: draft every round
        self.heads = heads.to(target.dtype).pack_for_drafting()
        self.tree = build_tree(paths)
        if self.tree.max_depth > heads.num_heads:
            raise SpecDecodeError(f"a tree {self.tree.max_depth} deep needs {self.tree.max_depth} heads, "
                                  f"these have {heads.num_heads}")
        self.max_nodes = self.tree.num_nodes
        self.target_layers = (target.config.num_layers,)  # after the final norm
        self.hidden: torch.Tensor | None = None  # (H,) the target's state at the root's parent
        self._trees = {self.tree.max_depth: self.tree}

    def gate(self) -> TreeGate | None:
        return None if self.tree_gate is None else self.tree_gate.fresh()

    def observe_target(self, hidden: dict[int, torch.Tensor]) -> None:
        self.hidden = hidden[self.target_layers[0]][-1]

    def propose_tree(self, context: Sequence[int], max_depth: int, sampling: SamplingConfig,
                     generator: torch.Generator | None) -> TreeProposal:
        if self.hidden is None:
            raise SpecDecodeError("Medusa drafts from the target's hidden state; none was observed yet")
        tree = self._tree(max_depth)
        if tree.num_nodes == 1:
            return TreeProposal(tree, torch.empty(0, dtype=torch.long))
        with torch.inference_mode():
            features = self.heads(self.hidden[None], tree.max_depth)[:, 0]  # (D, H)
            logits = self.vocab.logits(features)  # (D, V)
        width = max(path[-1] for path in tree.paths) + 1
        ranked = self.vocab.tokens(logits.topk(width, dim=-1).indices)  # (D, width)
        depth_index = torch.tensor([len(p) - 1 for p in tree.paths])
        rank_index = torch.tensor([p[-1] for p in tree.paths])
        return TreeProposal(tree, ranked[depth_index, rank_index])

    def _tree(self, max_depth: int) -> Tree:
        """The drafter's tree cut to max_depth (near the token budget's end)."""
        depth = max(0, min(max_depth, self.tree.max_depth))
        if depth not in self._trees:
            self._trees[depth] = build_tree([p for p in self.tree.paths if len(p) <= depth])
        return self._trees[depth]
