"""EAGLE drafting with dynamic trees (EAGLE-2, Li et al. 2024).

The head (eagle.py) keeps a cache of pairs (f_j, x_{j+1}): the target's true feature at
each position it has processed, fused with the token that followed. Each round:

1. feed the pairs the target produced since the last tree round (the engine hands their
   features over with `observe_target`); the last output is the predicted feature at the
   pending token's position, whose LM-head distribution gives the root's children;
2. grow: at each depth, expand the `top_k` nodes of the newest depth with the highest
   path score (the sum of draft log-probabilities from the root): one head pass over
   them (a tree mask over the head's cache), then each gets its `top_k` likeliest
   children;
3. rerank: keep the `num_nodes` nodes of highest path score (a child never scores above
   its parent, so the kept set is a tree) and hand that tree to the target;
4. drop the drafted nodes from the head's cache: the next round's true features replace
   them.

Candidates are deterministic (top ranks), so under sampling the tree rule takes one-hot
draft rows and stays exact.
"""

from __future__ import annotations

from typing import Sequence

import torch

from specdecode.policy.gate import TreeGate
from specdecode.heads.draft_vocab import DraftVocab
from specdecode.errors import SpecDecodeError
from specdecode.core.sampling import SamplingConfig
from specdecode.core.trees import build_tree
from specdecode.heads.eagle.parts import HeadCache
from specdecode.drafters.base import TreeDrafter, TreeProposal


class EagleDrafter(TreeDrafter):
    name = "eagle"

    def __init__(self, target, head, depth: int = 5, top_k: int = 3, num_nodes: int = 10,
                 vocab: DraftVocab | None = None, gate: TreeGate | None = None):
        if not hasattr(target, "lm_head") or not hasattr(target, "embed"):
            raise SpecDecodeError("EAGLE needs the native backend (a Llama-family target)")
        if head.config.hidden_size != target.config.hidden_size:
            raise SpecDecodeError(f"this EAGLE head expects hidden size {head.config.hidden_size}, "
                                  f"the target has {target.config.hidden_size}")
        self.target, self.head = target, head.to(target.dtype).pack_for_drafting()
        self.depth, self.top_k, self.num_nodes = depth, top_k, num_nodes
        # the LM head it drafts through: the target's (fused layout) or its own (EAGLE-3)
        self.vocab = vocab or (DraftVocab(target.lm_head) if head.config.layout == "fused" else head.vocabulary(target))
        self.tree_gate = gate  # None: draft every round
        self.max_nodes = num_nodes + 1
        self.target_layers = self.head.layers(target.config.num_layers)
        self.reset()

    def reset(self) -> None:
        """A new generation: the engine calls this before the prefill."""
        self.cache = HeadCache()
        self.fed = 0  # pairs in the head's cache: positions 0..fed-1
        self.pending: list[dict[int, torch.Tensor]] = []  # the target's hidden states (n, H) not yet fed

    def gate(self) -> TreeGate | None:
        return None if self.tree_gate is None else self.tree_gate.fresh()

    def observe_target(self, hidden: dict[int, torch.Tensor]) -> None:
        self.pending.append(hidden)

    @torch.inference_mode()
    def propose_tree(self, context: Sequence[int], max_depth: int, sampling: SamplingConfig,
                     generator: torch.Generator | None) -> TreeProposal:
        n = len(context)
        if sum(h[self.target_layers[0]].shape[0] for h in self.pending) + self.fed != n - 1:
            raise SpecDecodeError("EAGLE lost track of the target's features; start a new generation")
        depth = max(0, min(max_depth, self.depth))
        if depth == 0:
            # A plain step (the gate is closed): the pairs wait for the next tree round, fed
            # then in one head pass, so a closed gate costs no head pass per token.
            return TreeProposal(build_tree([]), torch.empty(0, dtype=torch.long))
        hidden = {layer: torch.cat([h[layer] for h in self.pending]) for layer in self.target_layers}
        features = self.head.target_features(hidden, self.target.config.num_layers)  # fused if it fuses layers
        self.pending = []
        self.cache.truncate(self.fed)
        # 1. the new pairs (f_j, x_{j+1}), j = fed .. n-2; the last output predicts f at n-1
        tokens = torch.tensor(context[self.fed + 1:n])
        out = self.head(features, self.target.embed[tokens], torch.arange(self.fed, n - 1), self.cache)
        self.fed = n - 1

        # node lists: token, parent (-1 = root), path score, depth, predicted feature of its parent
        node_token, node_parent, node_score, node_depth = [], [], [], []
        parent_feature: dict[int, torch.Tensor] = {-1: out[-1]}
        self._add_children(out[-1:], torch.zeros(1), [-1], node_token, node_parent, node_score, node_depth)
        cached: list[int] = []  # node indices whose pairs sit in the head's cache after the context
        for d in range(2, depth + 1):
            newest = [i for i, nd in enumerate(node_depth) if nd == d - 1]
            frontier = sorted(newest, key=lambda i: -node_score[i])[: self.top_k]
            inputs = torch.stack([parent_feature[node_parent[i]] for i in frontier])
            embeds = self.target.embed[torch.tensor([node_token[i] for i in frontier])]
            positions = torch.full((len(frontier),), n - 2 + d - 1)
            mask = torch.zeros(len(frontier), self.fed + len(cached) + len(frontier), dtype=torch.bool)
            mask[:, : self.fed] = True
            for row, i in enumerate(frontier):
                ancestor = node_parent[i]
                while ancestor != -1:
                    mask[row, self.fed + cached.index(ancestor)] = True
                    ancestor = node_parent[ancestor]
                mask[row, self.fed + len(cached) + row] = True
            predicted = self.head(inputs, embeds, positions, self.cache, mask)
            cached += frontier
            for row, i in enumerate(frontier):
                parent_feature[i] = predicted[row]
            scores = torch.tensor([node_score[i] for i in frontier])
            self._add_children(predicted, scores, frontier, node_token, node_parent, node_score, node_depth)
        self.cache.truncate(self.fed)

        # 3. rerank: the best num_nodes by path score (ties: shallower first, so parents stay)
        keep = sorted(range(len(node_token)), key=lambda i: (-node_score[i], node_depth[i]))[: self.num_nodes]
        kept = set(keep)
        keep = [i for i in keep if self._ancestors_kept(i, node_parent, kept)]
        paths: dict[int, tuple[int, ...]] = {-1: ()}
        rank_count: dict[int, int] = {}
        for i in sorted(keep, key=lambda i: (node_depth[i], -node_score[i])):
            parent = node_parent[i]
            rank = rank_count.get(parent, 0)
            rank_count[parent] = rank + 1
            paths[i] = paths[parent] + (rank,)
        by_path = {paths[i]: node_token[i] for i in keep}
        tree = build_tree(list(by_path))
        return TreeProposal(tree, torch.tensor([by_path[p] for p in tree.paths], dtype=torch.long))

    def _add_children(self, predicted, parent_scores, parents, node_token, node_parent, node_score,
                      node_depth) -> None:
        """Each parent's top_k tokens under the LM head of its predicted feature."""
        logprobs = self.vocab.logits(self.head.readout(predicted)).float().log_softmax(dim=-1)  # (P, V)
        top = logprobs.topk(self.top_k, dim=-1)
        tokens = self.vocab.tokens(top.indices)
        for row, parent in enumerate(parents):
            for lp, token in zip(top.values[row].tolist(), tokens[row].tolist()):
                node_token.append(token)
                node_parent.append(parent)
                node_score.append(float(parent_scores[row]) + lp)
                node_depth.append(1 if parent == -1 else node_depth[parent] + 1)

    @staticmethod
    def _ancestors_kept(i, node_parent, kept) -> bool:
        parent = node_parent[i]
        while parent != -1:
            if parent not in kept:
                return False
            parent = node_parent[parent]
        return True
