"""The on/off gate of a tree drafter: draft a tree only while its rounds pay."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field


@dataclass
class TreeGate:
    """Drafting on or off for a tree drafter (Medusa, EAGLE), within one generation.

    A tree round costs `round_cost` plain steps (drafting plus the verify pass over its
    nodes, measured when the drafter's shape was chosen) and emits 1 + accepted tokens, so
    it pays while tokens per round exceed round_cost. The gate keeps a forgetting mean of
    tokens per round, starting from the drafter's expected figure (`prior_tokens`, from
    held-out acceptance, counted as `prior_weight` rounds and forgotten like them). Below
    round_cost it closes: rounds are plain steps, except one probing tree round every
    `probe_every`, so that it notices when the text turns predictable again. Trees
    trained on code need this on a translation, where they are accepted almost never.
    """

    round_cost: float
    prior_tokens: float
    prior_weight: float = 1.0  # the prior counts as one round: five rounds accepting nothing close a cheap tree
    forget: float = 0.8  # per tree round; about the last 5 dominate
    probe_every: int = 16
    tokens: float = field(default=0.0, init=False)
    rounds: float = field(default=0.0, init=False)
    rounds_off: int = field(default=0, init=False)

    def __post_init__(self):
        self.tokens, self.rounds = self.prior_tokens * self.prior_weight, self.prior_weight

    def fresh(self) -> "TreeGate":
        """The same gate before any observation: one per generation."""
        return dataclasses.replace(self)

    @property
    def tokens_per_round(self) -> float:
        return self.tokens / self.rounds

    def open(self) -> bool:
        """Draft a tree this round?"""
        if self.tokens_per_round > self.round_cost:
            self.rounds_off = 0
            return True
        self.rounds_off += 1
        return self.rounds_off % self.probe_every == 0

    def observe(self, num_accepted: int) -> None:
        """A tree round emitted its accepted path and one token of the target's."""
        self.tokens = self.forget * self.tokens + 1 + num_accepted
        self.rounds = self.forget * self.rounds + 1
