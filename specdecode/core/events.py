"""What the engine yields, and the statistics it keeps.

The engine yields one `Round` per target pass (the prefill's first token included) and
a final `Done`. Front ends (CLI streaming, server, benchmarks) turn these into text,
tables and JSON; the engine never formats anything itself.

Words, as in design.md: a round proposes `num_drafted` tokens; the first
`num_accepted` emitted tokens are accepted draft tokens, and the last emitted token is
the target's own (a correction at the first rejection, or a bonus when all were
accepted). Plain decoding is the case num_drafted = 0.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Iterable


@dataclass(frozen=True)
class Round:
    token_ids: tuple[int, ...]  # emitted this round, in order (cut at EOS / stop / budget)
    num_drafted: int
    num_accepted: int
    draft_s: float = 0.0
    verify_s: float = 0.0


@dataclass
class Stats:
    prompt_tokens: int = 0
    new_tokens: int = 0
    rounds: int = 0  # target passes after the prefill
    draft_tokens: int = 0
    accepted_tokens: int = 0
    drafted_at: list[int] = field(default_factory=list)  # [i]: rounds that drafted position i
    accepted_at: list[int] = field(default_factory=list)  # [i]: rounds that accepted position i
    prefill_s: float = 0.0
    draft_s: float = 0.0
    verify_s: float = 0.0
    wall_s: float = 0.0

    def add_round(self, num_drafted: int, num_accepted: int, num_emitted: int, draft_s: float, verify_s: float) -> None:
        self.rounds += 1
        self.draft_tokens += num_drafted
        self.accepted_tokens += num_accepted
        self.new_tokens += num_emitted
        self.draft_s += draft_s
        self.verify_s += verify_s
        for counts, n in ((self.drafted_at, num_drafted), (self.accepted_at, num_accepted)):
            counts.extend([0] * (n - len(counts)))
            for i in range(n):
                counts[i] += 1

    @property
    def acceptance_rate(self) -> float:
        """α: accepted draft tokens / drafted tokens."""
        return self.accepted_tokens / self.draft_tokens if self.draft_tokens else 0.0

    @property
    def mean_accepted_length(self) -> float:
        """τ: tokens emitted per target pass after the prefill (plain decoding: 1.0)."""
        decoded = self.new_tokens - (1 if self.new_tokens else 0)  # the prefill emitted the first
        return decoded / self.rounds if self.rounds else 0.0

    @property
    def acceptance_by_position(self) -> list[float]:
        accepted = self.accepted_at + [0] * (len(self.drafted_at) - len(self.accepted_at))
        return [a / d for a, d in zip(accepted, self.drafted_at)]  # every d counts >= 1 round

    @property
    def tokens_per_s(self) -> float:
        return self.new_tokens / self.wall_s if self.wall_s else 0.0

    @property
    def other_s(self) -> float:
        return max(0.0, self.wall_s - self.prefill_s - self.draft_s - self.verify_s)

    def to_dict(self) -> dict:
        return {
            "prompt_tokens": self.prompt_tokens,
            "new_tokens": self.new_tokens,
            "rounds": self.rounds,
            "draft_tokens": self.draft_tokens,
            "accepted_tokens": self.accepted_tokens,
            "acceptance_rate": round(self.acceptance_rate, 4),
            "mean_accepted_length": round(self.mean_accepted_length, 4),
            "acceptance_by_position": [round(a, 4) for a in self.acceptance_by_position],
            "tokens_per_s": round(self.tokens_per_s, 3),
            "prefill_s": round(self.prefill_s, 4),
            "draft_s": round(self.draft_s, 4),
            "verify_s": round(self.verify_s, 4),
            "other_s": round(self.other_s, 4),
            "wall_s": round(self.wall_s, 4),
        }


@dataclass(frozen=True)
class Done:
    reason: str  # "eos", "stop" or "length"
    stats: Stats


def collect(events: Iterable[Round | Done], on_round: Callable[[Round], None] | None = None) -> tuple[list[int], Done]:
    """Run a generation to its end: (every emitted token, the final Done)."""
    tokens: list[int] = []
    for event in events:
        if isinstance(event, Done):
            return tokens, event
        tokens += event.token_ids
        if on_round is not None:
            on_round(event)
    raise RuntimeError("the generation ended without a Done event")
