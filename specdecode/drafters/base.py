"""The one small interface every drafter implements.

A drafter sees the whole token context (prompt + emitted tokens) and proposes up to k
next tokens, with the distribution each was drawn from when it has one. It keeps its
own state (a draft model's KV cache) in line with the context it is given, so the
engine never tells it what was accepted: the next context says so.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol, Sequence

import torch

from ..sampling import SamplingConfig


@dataclass(frozen=True)
class Proposal:
    tokens: torch.Tensor  # (k,) long; k may be fewer than asked, even 0
    probs: torch.Tensor | None = None  # (k, V_target) the draft distributions; None = deterministic


class Drafter(Protocol):
    name: str

    def propose(self, context: Sequence[int], k: int, sampling: SamplingConfig,
                generator: torch.Generator | None) -> Proposal: ...
