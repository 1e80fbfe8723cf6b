"""The base classes every drafter derives from.

A chain drafter sees the whole token context (prompt + emitted tokens) and proposes up
to k next tokens, with the distribution each was drawn from when it has one. It keeps
its own state (a draft model's KV cache) in line with the context it is given, so the
engine never tells it what was accepted: the next context says so.

A tree drafter proposes a tree of candidates instead (core/trees.py): several
continuations verified in one target pass. Drafters that read the target's own hidden
states (Medusa, EAGLE) name the layers in `target_layers`; the engine then hands them,
after each pass, the hidden states of the positions the target kept (`observe_target`).

The hooks the engine and the server's scheduler call on every drafter (`reset`, `gate`,
`observe_target`, `unread`) do nothing by default, so neither probes for them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch

from specdecode.core.sampling import SamplingConfig
from specdecode.core.trees import Tree
from specdecode.policy.gate import TreeGate


@dataclass(frozen=True)
class Proposal:
    tokens: torch.Tensor  # (k,) long; k may be fewer than asked, even 0
    probs: torch.Tensor | None = None  # (k, V_target) the draft distributions; None = deterministic


@dataclass(frozen=True)
class TreeProposal:
    tree: Tree  # node 0 is the root, the last context token
    tokens: torch.Tensor  # (N,) long, the tokens of nodes 1..N
    probs: torch.Tensor | None = None  # (N, V_target): the distribution each node was drawn from, given
    # its parent and its earlier siblings (acceptance.rejection_tree); None = deterministic


class Drafter:
    """A chain drafter: proposes up to k tokens after a context."""

    name: str = "drafter"
    is_tree: bool = False
    target_layers: tuple[int, ...] = ()  # hidden states it needs from the target (may be empty)

    def propose(self, context: Sequence[int], k: int, sampling: SamplingConfig,
                generator: torch.Generator | None, tokens_left: int | None = None) -> Proposal:
        """Up to k tokens to follow the context; tokens_left: the most the generation may
        still emit (None: unknown), for a drafter that judges whether drafting pays."""
        raise NotImplementedError

    def reset(self) -> None:
        """A new generation starts: forget state that follows the target's features."""

    def unread(self, context: Sequence[int]) -> int:
        """Context tokens it must read before its next proposal (a draft model's catch-up)."""
        return 0

    def gate(self) -> TreeGate | None:
        """A fresh on/off gate for this generation; None: always on."""
        return None

    def observe_target(self, hidden: dict[int, torch.Tensor]) -> None:
        """Hidden states (n, H) per layer of the positions the target just kept, in order."""


class TreeDrafter(Drafter):
    """A drafter that proposes a tree of candidates; `max_nodes` bounds the tree's size."""

    is_tree = True
    max_nodes: int = 0

    def propose_tree(self, context: Sequence[int], max_depth: int, sampling: SamplingConfig,
                     generator: torch.Generator | None) -> TreeProposal:
        raise NotImplementedError
