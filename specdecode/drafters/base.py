"""The small interfaces drafters implement.

A chain drafter sees the whole token context (prompt + emitted tokens) and proposes up
to k next tokens, with the distribution each was drawn from when it has one. It keeps
its own state (a draft model's KV cache) in line with the context it is given, so the
engine never tells it what was accepted: the next context says so.

A tree drafter proposes a tree of candidates instead (trees.py): several continuations
verified in one target pass. Drafters that read the target's own hidden states (Medusa,
EAGLE) name the layers in `target_layers`; the engine then hands them, after each pass,
the hidden states of the positions the target kept (`observe_target`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol, Sequence

import torch

from ..sampling import SamplingConfig

if TYPE_CHECKING:
    from ..trees import Tree


@dataclass(frozen=True)
class Proposal:
    tokens: torch.Tensor  # (k,) long; k may be fewer than asked, even 0
    probs: torch.Tensor | None = None  # (k, V_target) the draft distributions; None = deterministic


@dataclass(frozen=True)
class TreeProposal:
    tree: "Tree"  # trees.Tree: node 0 is the root, the last context token
    tokens: torch.Tensor  # (N,) long, the tokens of nodes 1..N
    probs: torch.Tensor | None = None  # (N, V_target): the distribution each node was drawn from, given
    # its parent and its earlier siblings (acceptance.rejection_tree); None = deterministic


class TreeDrafter(Protocol):
    name: str
    target_layers: tuple[int, ...]  # hidden states it needs from the target (may be empty)

    def propose_tree(self, context: Sequence[int], max_depth: int, sampling: SamplingConfig,
                     generator: torch.Generator | None) -> TreeProposal: ...

    def observe_target(self, hidden: dict[int, torch.Tensor]) -> None:
        """Hidden states (n, H) per layer of the positions the target just kept, in order."""


class Drafter(Protocol):
    name: str

    def propose(self, context: Sequence[int], k: int, sampling: SamplingConfig,
                generator: torch.Generator | None) -> Proposal: ...
