"""The draft length for a running batch: as long as it raises the batch's tokens per second.

Alone, a verify pass over k+1 rows costs little more than one row: decoding waits on the
weights, and the extra rows ride along. A batch of B sequences already fills a pass with
B rows, so speculation adds B·k rows to a pass whose cost now grows with every row, and
its gain shrinks as concurrency rises. Each step the controller picks each sequence's
draft length k_i to maximise expected goodput

    rate = Σ_i E(α_i, k_i) / (V(B + Σ k_i) + Σ k_i · d)

over the batch's sequences i with acceptance α_i (adaptive.expected_tokens), the
measured time V(n) of a pass over n rows on this machine (`measure`/`measured`, cached
like the single-sequence probe) and the drafter's time per draft token d (0 for prompt
lookup). A draft model that has not read a sequence's context yet (a request just
admitted, or one that has not drafted for a while) must first catch up on it, a pass over
those tokens; that one-time cost, spread over the sequence's remaining steps (`start_cost`),
is added to the time of any step in which the sequence drafts, so that a sequence near its
end, or in a batch where drafting barely pays, does not start a draft model for nothing.
How many steps a sequence has left is read from how long this server's recent answers ran
(`RecentAnswers`), not from its max_tokens: most answers end well before it, and the
sequences still running when a batch thins out are the ones past most answers.
All k_i = 0 is plain decoding of the batch: rate B / V(B). When drafting does not pay
it switches off, probing k = 1 every `probe_every` steps so that a batch that turns
repetitive gets it back, unless even drafts always accepted would not pay at this batch
size (then a probe only costs; a batch that shrinks is judged afresh each step). A probe
is a cheap look: it goes only to sequences whose drafter would catch up in less than a
plain step; a draft model that has fallen far behind starts only when its catch-up pays.
Acceptance per sequence is the adaptive policy's estimate (`AdaptiveK.alpha`: prior, then
what its target accepted, with forgetting); the prior is what recent answers' drafts
accepted, so that a server whose traffic is accepted well starts new sequences drafting,
and one whose traffic is not does not.
"""

from __future__ import annotations

import hashlib
import json
import logging
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path
from typing import Sequence

from specdecode.models.store import home
from specdecode.policy import machine
from specdecode.policy.adaptive import PROBE_PAYS
from specdecode.policy.costs import measure_passes
from specdecode.policy.probe import shape_of, write_figures

log = logging.getLogger("specdecode")


@dataclass(frozen=True)
class PassCosts:
    """Seconds of one target pass over n rows, measured at some n and linear in between."""

    seconds: dict[int, float]  # rows -> seconds

    @classmethod
    def monotone(cls, seconds: dict[int, float]) -> "PassCosts":
        """A longer pass never costs less: timing noise must not make drafting look free."""
        fixed, most = {}, 0.0
        for n in sorted(seconds):
            most = fixed[n] = max(most, seconds[n])
        return cls(fixed)

    def __call__(self, rows: int) -> float:
        sizes = sorted(self.seconds)
        if rows <= sizes[0]:
            return self.seconds[sizes[0]]
        for lo, hi in zip(sizes, sizes[1:]):
            if rows <= hi:
                return self.seconds[lo] + (self.seconds[hi] - self.seconds[lo]) * (rows - lo) / (hi - lo)
        lo, hi = sizes[-2:] if len(sizes) > 1 else (sizes[0], sizes[0])
        slope = (self.seconds[hi] - self.seconds[lo]) / (hi - lo) if hi > lo else 0.0
        return self.seconds[hi] + slope * (rows - hi)  # past the last size: its last slope


def start_cost(catch_up_tokens: int, catch_up_token_s: float, remaining_tokens: float, alpha: float) -> float:
    """Seconds per step that drafting for a sequence adds for its catch-up: the drafter's pass
    over the context tokens it has not read, spread over the steps the sequence has left
    (each emits about 1 + α tokens while it drafts)."""
    if catch_up_tokens <= 0:
        return 0.0
    steps_left = max(1.0, remaining_tokens / (1.0 + alpha))
    return catch_up_tokens * catch_up_token_s / steps_left


ANSWERS_KEPT = 64  # recent answers whose lengths predict a running sequence's
ANSWERS_TRUSTED = 4  # fewer than this seen: a sequence may run to its max_tokens


@dataclass
class RecentAnswers:
    """The last ANSWERS_KEPT answers that finished: their token counts (what a running
    sequence may expect still to emit) and what their drafts had accepted (what a new
    sequence may expect to accept before its own drafts are judged)."""

    lengths: deque = field(default_factory=lambda: deque(maxlen=ANSWERS_KEPT))
    judged: deque = field(default_factory=lambda: deque(maxlen=ANSWERS_KEPT))  # (accepted, positions)

    def add(self, tokens: int, accepted: float = 0.0, positions: float = 0.0) -> None:
        self.lengths.append(tokens)
        if positions > 0:
            self.judged.append((accepted, positions))

    def remaining(self, generated: int, budget: int) -> float:
        """Tokens still to come for a sequence that has emitted `generated` of at most
        `budget`: how far past it the recent answers that ran longer went (each capped by the
        budget). Past every answer seen, one: it is expected to end, not to repay a start."""
        left = budget - generated
        if len(self.lengths) < ANSWERS_TRUSTED:
            return float(left)
        longer = [min(n, budget) - generated for n in self.lengths if n > generated]
        return min(float(left), sum(longer) / len(longer)) if longer else float(min(left, 1))

    def alpha(self, default: float) -> float:
        """The acceptance of recent answers' drafts, position by position; `default` when
        none drafted."""
        positions = sum(p for _, p in self.judged)
        return sum(a for a, _ in self.judged) / positions if positions else default


def best_draft_lengths(alphas: Sequence[float], pass_costs: PassCosts, draft_token_s: float, k_max: int,
                       others: Sequence[int] = (), start_s: Sequence[float] = ()) -> tuple[list[int], float]:
    """Each sequence's draft length, maximising the batch's expected tokens per second, and
    that rate over plain decoding's (1.0: drafting off), beside sequences the controller does
    not steer (`others`: their rows, each emitting a token or more). start_s[i] (default 0)
    is what sequence i adds to a step's time if it drafts at all (`start_cost`).

    The j-th draft of sequence i adds α_i^j expected tokens (E(α, k) = Σ α^j, j ≤ k) and one
    row to the pass. So the best use of r extra rows is the r largest α_i^j, and since α_i^j
    falls with j, each sequence's share is a prefix of its drafts: sequences that are
    accepted more draft further. The best r is the one with the highest rate. Start costs
    break that order, so the sequences allowed to draft are tried as those whose start
    costs at most t, for each t among them, keeping the best."""
    base_rows = len(alphas) + sum(others)
    plain = (len(alphas) + len(others)) / pass_costs(base_rows)
    starts = list(start_s) + [0.0] * (len(alphas) - len(start_s))
    best_lengths, best_rate = [0] * len(alphas), plain
    for limit in sorted(set(starts)):
        allowed = [i for i, s in enumerate(starts) if s <= limit]
        lengths, rate = _best_prefix(alphas, allowed, starts, pass_costs, draft_token_s, k_max, base_rows,
                                     len(alphas) + len(others))
        if rate > best_rate:
            best_lengths, best_rate = lengths, rate
    return best_lengths, best_rate / plain


def _best_prefix(alphas: Sequence[float], allowed: Sequence[int], starts: Sequence[float], pass_costs: PassCosts,
                 draft_token_s: float, k_max: int, base_rows: int, tokens: float) -> tuple[list[int], float]:
    """best_draft_lengths over the sequences `allowed` to draft: the best number of the
    largest α_i^j, and its rate."""
    gains = sorted(((alphas[i] ** j, i) for i in allowed for j in range(1, k_max + 1)), reverse=True)
    best_rows, best_rate, started, start_total = 0, tokens / pass_costs(base_rows), set(), 0.0
    for rows, (gain, i) in enumerate(gains, 1):
        tokens += gain
        if i not in started:
            started.add(i)
            start_total += starts[i]
        rate = tokens / (pass_costs(base_rows + rows) + rows * draft_token_s + start_total)
        if rate > best_rate:
            best_rows, best_rate = rows, rate
    lengths = [0] * len(alphas)
    for _, i in gains[:best_rows]:
        lengths[i] += 1
    return lengths, best_rate


@dataclass
class GoodputController:
    pass_costs: PassCosts
    k_max: int
    draft_token_s: float = 0.0
    catch_up_token_s: float = 0.0  # the drafter's time per context token it catches up on (start_cost)
    probe_every: int = 16
    answers: RecentAnswers = field(default_factory=RecentAnswers)  # the scheduler adds and reads them
    steps_off: int = field(default=0, init=False)
    k: int = field(default=0, init=False)  # the longest draft of the last step, for the metrics
    gain: float = field(default=1.0, init=False)  # its expected rate over plain decoding

    def choose(self, alphas: Sequence[float], others: Sequence[int] = (),
               catch_up: Sequence[tuple[int, float]] = ()) -> list[int]:
        """The draft length of each sequence of acceptance alphas in a step, beside others
        (best_draft_lengths); catch_up[i] = (context tokens its drafter has not read, tokens
        it may still emit: `answers.remaining`, or its max_tokens' rest), default (0, any)."""
        if not alphas or self.k_max < 1:
            self.k, self.gain = 0, 1.0
            return [0] * len(alphas)
        start_s = [start_cost(unread, self.catch_up_token_s, left, a) for (unread, left), a in zip(catch_up, alphas)]
        lengths, self.gain = best_draft_lengths(alphas, self.pass_costs, self.draft_token_s, self.k_max, others,
                                                start_s)
        if not any(lengths) and self._could_pay(len(alphas), others, start_s):
            self.steps_off += 1
            if self.steps_off % self.probe_every == 0:  # a cheap look: does drafting pay again?
                step_s = self.pass_costs(len(alphas) + sum(others))
                unread = [c[0] for c in catch_up] + [0] * (len(alphas) - len(catch_up))
                lengths = [int(n * self.catch_up_token_s <= step_s) for n in unread]
        elif any(lengths):
            self.steps_off = 0
        self.k = max(lengths)
        return lengths

    def _could_pay(self, size: int, others: Sequence[int], start_s: Sequence[float]) -> bool:
        """Whether drafts always accepted would gain enough to be worth a probe: in a batch
        that fills the pass, a probe's extra rows cost more than any acceptance could bring."""
        return best_draft_lengths([1.0] * size, self.pass_costs, self.draft_token_s, self.k_max, others,
                                  start_s)[1] >= PROBE_PAYS


# Rows of the passes timed: up to a batch of 16 drafting 7 each, geometric past 8.
PASS_ROWS = (1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64, 96, 128)
PROBE_CONTEXT = 128
PROBE_REPEATS = 3


def cache_path(target_model, most_rows: int) -> Path:
    key = json.dumps(["batch", shape_of(target_model), machine.fingerprint(), PASS_ROWS, most_rows])
    return home() / "costs" / (hashlib.sha256(key.encode()).hexdigest()[:16] + ".json")


def measured(target_model, most_rows: int) -> PassCosts:
    """The target's pass over n rows, n up to most_rows, on this machine: read from the
    cache under $SPECDECODE_HOME, or timed once (interleaved, medians) and cached."""
    rows = [n for n in PASS_ROWS if n < most_rows] + [most_rows]
    path = cache_path(target_model, most_rows)
    try:
        return PassCosts.monotone({int(n): s for n, s in json.loads(path.read_text())["pass_seconds"].items()})
    except (OSError, ValueError, KeyError, TypeError):  # none yet, or unreadable: measure again
        log.warning(f"measuring this machine's target passes over 1-{most_rows} rows, once (seconds to a minute)...")
    seconds = measure_passes({str(n): (target_model, n) for n in rows}, PROBE_CONTEXT, PROBE_REPEATS)
    figures = {"pass_seconds": {n: seconds[str(n)] for n in rows}, "machine": machine.fingerprint()}
    write_figures(path, figures)
    return PassCosts.monotone(figures["pass_seconds"])
