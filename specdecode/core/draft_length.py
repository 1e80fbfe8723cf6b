"""How the engine asks for the draft length k each round.

A policy answers `next_k(unread, tokens_left)` before a round (the context tokens the
drafter must read first, and the most the generation may still emit, which a policy may
weigh against each other) and is told `observe(num_drafted, num_accepted)` after it, and
`observe_time(num_drafted, seconds)`, the round's wall time (drafting and verifying);
`fresh()` gives an unobserved copy for a new generation.
`FixedK` is the constant policy; the adaptive one lives in policy/adaptive.py.
"""

from __future__ import annotations

from typing import Protocol


class DraftLength(Protocol):
    k_max: int

    def next_k(self, unread: int = 0, tokens_left: int | None = None) -> int: ...

    def observe(self, num_drafted: int, num_accepted: int) -> None: ...

    def observe_time(self, num_drafted: int, seconds: float) -> None: ...

    def fresh(self) -> "DraftLength": ...


class FixedK:
    def __init__(self, k: int):
        self.k = k
        self.k_max = k

    def next_k(self, unread: int = 0, tokens_left: int | None = None) -> int:
        return self.k

    def fresh(self) -> "FixedK":
        return self

    def observe(self, num_drafted: int, num_accepted: int) -> None:
        pass

    def observe_time(self, num_drafted: int, seconds: float) -> None:
        pass
