"""Choosing the draft length k: the cost model, and a policy that adapts k at run time.

Cost model (docs/design.md). With per-position acceptance α (i.i.d.), a round with k drafts
emits E(α, k) = (1 - α^(k+1)) / (1 - α) tokens and costs k draft steps plus a target pass
over k+1 tokens. In units of one plain decoding step:

    cost(k) = k · c + v(k+1),   c = draft step / plain step,  v(n) = pass over n / pass over 1

so the expected speedup over plain decoding is E(α, k) / cost(k), and k = 0 (drafting
off) is plain decoding, speedup 1. `best_k` maximises expected tokens per second, not
acceptance: a longer draft is accepted more in total but may cost more than it brings.

`AdaptiveK` re-estimates α during a generation from what the target accepted (the
maximum-likelihood estimate for a geometric run: accepted / (accepted + rejections)),
with exponential forgetting so a change of topic is followed, and picks the best k each
round. When drafting does not pay it switches off, and probes with k = 1 every
`probe_every` rounds so that it notices when drafting starts to pay again. Where drafts
accepted as often as they are on the prompts that suit them best (`GOOD_ALPHA`) would
gain less than `DRAFT_PAYS` (a draft model almost as slow as the target, as a quantized
0.5B draft for a quantized 1.5B target is on an AVX2 CPU), it never drafts at all: probes
then cost more than drafting could bring back. A draft model must first catch up on every
token since it last ran (on a long prompt, the whole prompt), and the estimate of α climbs
a few hundredths a probe, so a draft that pays only near α = 1 would be probed for a
hundred rounds before it ran, at a loss each time. For the same reason a draft model
starts only when its catch-up (the context it has not read, at the cost per token the probe
measured) costs fewer target steps than drafting would save over the tokens the generation
may still emit, at the acceptance it estimates (`start_pays`): after a long prompt, a short
answer stays undrafted, and a draft model judged not to pay is not probed again, since each
probe would first read every token since it last ran (on an AMD EPYC Zen 3, 0.13 of a
target step a token: more than 13% of the rounds between probes). The probe's costs are
another moment's: the policy also times its own rounds (round_clock.py), a plain step
every `time_every` drafted rounds among them, and scales the cost of drafting by how far
the drafted rounds missed the model's price.

It follows the engine's draft-length interface (core/draft_length.py), as `FixedK` does
for a constant k; a drafter that keeps a policy of its own (the hybrid) takes a `fresh()`
copy per generation. TreeGate (gate.py) is the on/off counterpart for tree drafters.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Sequence

from specdecode.policy.round_clock import RoundClock

# Target pass over n tokens / over one, n = 1..12: Qwen2.5-Coder-1.5B, bf16, 2 cores, after
# 256 cached tokens, medians of 5 (`specdecode tune` measures it for any model and machine;
# past 16 tokens it climbs: 1.4 at 24, 1.9 at 64). Used when no profile is given.
DEFAULT_VERIFY_RATIOS = (1.0, 1.01, 1.01, 1.01, 1.01, 1.02, 1.02, 1.02, 1.03, 1.04, 1.04, 1.04)


def expected_tokens(alpha: float, k: int) -> float:
    """E(α, k) = 1 + α + ... + α^k: tokens a round emits (accepted drafts + 1)."""
    if alpha >= 1.0:
        return k + 1.0
    return (1 - alpha ** (k + 1)) / (1 - alpha)


@dataclass(frozen=True)
class CostModel:
    draft_ratio: float  # c: one draft step / one plain target step
    verify_ratios: Sequence[float] = DEFAULT_VERIFY_RATIOS  # [n-1]: pass over n tokens / pass over 1
    catch_up_ratio: float = 0.0  # the draft's pass per context token it has not read / one plain target step

    def verify(self, num_tokens: int) -> float:
        ratios = self.verify_ratios
        if num_tokens <= len(ratios):
            return ratios[num_tokens - 1]
        slope = ratios[-1] - ratios[-2] if len(ratios) > 1 else 0.0  # extend the last step linearly
        return ratios[-1] + slope * (num_tokens - len(ratios))

    def cost(self, k: int) -> float:
        return k * self.draft_ratio + self.verify(k + 1)

    def speedup(self, alpha: float, k: int) -> float:
        return expected_tokens(alpha, k) / self.cost(k) if k else 1.0


def best_k(alpha: float, costs: CostModel, k_max: int) -> tuple[int, float]:
    """(k, expected speedup) maximising expected tokens per second; k = 0 means off."""
    return max(((k, costs.speedup(alpha, k)) for k in range(k_max + 1)), key=lambda kv: kv[1])


def speedup_from_rounds(rounds: Sequence[tuple[int, int]], costs: CostModel, k: int) -> float:
    """Expected speedup at draft length k, from greedy rounds (drafted d, accepted a)
    observed at a probing length >= k.

    With k drafts a round would have drafted min(d, k) and accepted min(a, k): greedy
    drafts are the same first k tokens either way. No i.i.d. assumption, so bursty
    acceptance (prompt lookup copying a long span, then finding nothing) counts as it is.
    """
    if k == 0 or not rounds:
        return 1.0
    tokens = sum(1 + min(a, k) for _, a in rounds)
    cost = sum(costs.cost(min(d, k)) for d, _ in rounds)
    return tokens / cost


def best_k_from_rounds(rounds: Sequence[tuple[int, int]], costs: CostModel, k_max: int) -> tuple[int, float]:
    """(k, expected speedup) maximising speedup_from_rounds; k = 0 means off."""
    return max(((k, speedup_from_rounds(rounds, costs, k)) for k in range(k_max + 1)), key=lambda kv: kv[1])


# Rows of catch-up a draft model's step already pays for in c: each round it first reads the
# target's accepted tokens and its correction (probe.py times that pass).
CATCH_UP_ROWS = 3
PROBE_PAYS = 1.1  # a batch's probe (goodput.py): the best speedup at full acceptance it needs
# Acceptance on the prompts that suit a drafter best: the Qwen2.5-Coder pair's draft model
# is accepted 0.87-0.91 of the time on code (README, Results).
GOOD_ALPHA = 0.9
# The best speedup at GOOD_ALPHA below which drafting never starts. It must cover the
# probes' catch-up too: on an AMD EPYC Zen 2 the quantized 0.5B draft, at 1.08-1.15x there
# by its measured costs, ran at 0.78-0.97x of plain decoding in `bench` whenever it started.
DRAFT_PAYS = 1.2


def can_pay(costs: CostModel, k_max: int) -> bool:
    """Whether drafting could pay enough to be tried: its best speedup at GOOD_ALPHA."""
    return best_k(GOOD_ALPHA, costs, k_max)[1] >= DRAFT_PAYS


def break_even_alpha(costs: CostModel, k_max: int) -> float:
    """The lowest acceptance α, in hundredths, at which drafting pays at all (best_k > 0)."""
    return next((i / 100 for i in range(101) if best_k(i / 100, costs, k_max)[0] > 0), 1.0)


@dataclass
class AdaptiveK:
    costs: CostModel
    k_max: int = 8
    prior_alpha: float = 0.6
    prior_weight: float = 4.0  # the prior counts as this many observed positions
    forget: float = 0.9  # per round; about the last 10 rounds dominate
    probe_every: int = 16
    time_every: int = 16  # drafted rounds between plain steps timed for the clock
    accepted: float = field(default=0.0, init=False)
    positions: float = field(default=0.0, init=False)  # draft positions the target judged
    rounds_off: int = field(default=0, init=False)
    alpha_when_off: float = field(default=0.0, init=False)  # the estimate the last time it chose to stop
    history: list[int] = field(default_factory=list, init=False)  # k chosen each round
    held_back: tuple[int, int] | None = field(default=None, init=False)  # (unread, tokens left) when a catch-up did not pay
    clock: RoundClock = field(default_factory=RoundClock, init=False)  # this generation's rounds, timed
    last_unread: int = field(default=0, init=False)  # context the drafter read before the round: a long read is not timed

    def fresh(self) -> "AdaptiveK":
        """The same policy before any observation: one per generation."""
        return dataclasses.replace(self)

    @property
    def alpha(self) -> float:
        return (self.accepted + self.prior_alpha * self.prior_weight) / (self.positions + self.prior_weight)

    @property
    def live_costs(self) -> CostModel:
        """The cost model with drafting priced as this generation's rounds cost (round_clock.py).
        The catch-up's price stays the probe's: rounds that read a prompt are not timed."""
        scale = self.clock.scale()
        if scale == 1.0:
            return self.costs
        return dataclasses.replace(self.costs, draft_ratio=self.costs.draft_ratio * scale,
                                   verify_ratios=tuple(v * scale for v in self.costs.verify_ratios))

    def next_k(self, unread: int = 0, tokens_left: int | None = None) -> int:
        """The draft length for the next round; `unread`: context tokens the drafter must read
        before it drafts, `tokens_left`: the most the generation may still emit (None: unknown)."""
        self.last_unread = unread
        if not can_pay(self.costs, self.k_max):  # the machine's gate: on the costs it measured
            self.history.append(0)
            return 0
        k, _ = best_k(self.alpha, self.live_costs, self.k_max)
        probing = False
        if k == 0:
            self.alpha_when_off = self.alpha
            self.rounds_off += 1
            probing = self.rounds_off % self.probe_every == 0
            k = 1 if probing else 0  # a cheap look: does drafting pay again?
        else:
            self.rounds_off = 0
        if k and not self.start_pays(unread, tokens_left):
            if not probing:  # drafting would pay but for the reading: say so
                self.held_back = (unread, tokens_left)
            k = 0
        if k and self.clock.plain_step_due(self.time_every):
            k = 0  # a plain step, timed: the drafted rounds are priced against it
        self.history.append(k)
        return k

    def start_pays(self, unread: int, tokens_left: int | None) -> bool:
        """Whether drafting now can repay the draft's catch-up: its pass over the unread context
        tokens beyond the few a round already pays for, in target steps, against the steps
        drafting saves over the tokens left at the acceptance estimated now. A draft model
        that has not read a long prompt would spend longer reading it than a short answer
        can give back; a probe while drafting does not pay at the estimate (k = 1 every
        `probe_every` rounds) is a reading of every token since the draft last ran, which
        only a drafter that reads for free (prompt lookup) can afford."""
        extra = unread - CATCH_UP_ROWS
        if extra <= 0 or tokens_left is None or self.costs.catch_up_ratio <= 0:
            return True
        speedup = best_k(self.alpha, self.live_costs, self.k_max)[1]
        saved = tokens_left * (1 - 1 / speedup)  # target steps, were every token left emitted
        return saved > extra * self.costs.catch_up_ratio

    def describe(self) -> str:
        """What the policy chose over a generation, and why, in one line."""
        drafting = [k for k in self.history if k > 0]
        off = len(self.history) - len(drafting)
        if not can_pay(self.costs, self.k_max):
            return (f"off: a draft step costs {self.costs.draft_ratio:.2f} of a target step here; drafts "
                    f"accepted {GOOD_ALPHA:.0%} of the time would gain "
                    f"{best_k(GOOD_ALPHA, self.costs, self.k_max)[1]:.2f}x")
        if self.held_back is not None and off > len(self.history) / 2:
            unread, left = self.held_back
            return (f"off: the draft would first read {unread} context tokens, which costs "
                    f"{(unread - CATCH_UP_ROWS) * self.costs.catch_up_ratio:.0f} target steps, more than drafting "
                    f"saves in {left} tokens")
        scale = self.clock.scale()
        priced = f", drafted rounds cost {scale:.2f}x the measured price" if scale != 1.0 else ""
        if not self.history or off > len(self.history) / 2:
            # the estimate that switched it off: a probe accepted since may have raised the current one
            return (f"off: acceptance {self.alpha_when_off:.2f} does not pay for the draft "
                    f"(it pays from {break_even_alpha(self.live_costs, self.k_max):.2f} here{priced})")
        span = f"{min(drafting)}-{max(drafting)}" if min(drafting) < max(drafting) else f"{drafting[0]}"
        return (f"k adaptive {span}, acceptance {self.alpha:.2f}" + (f", off {off} of {len(self.history)} rounds" if off else "")
                + priced)

    def observe_time(self, num_drafted: int, seconds: float) -> None:
        """The wall time of the round just observed, drafting and verifying, for the clock.
        A round whose drafter first read more context than a round's catch-up is not timed."""
        if num_drafted == 0:
            self.clock.add_plain(seconds)
        else:
            timed = self.last_unread <= CATCH_UP_ROWS
            self.clock.add_drafted(seconds, self.costs.cost(num_drafted) if timed else None)

    def observe(self, num_drafted: int, num_accepted: int) -> None:
        if num_drafted == 0:
            return
        rejected = 1 if num_accepted < num_drafted else 0
        self.accepted = self.forget * self.accepted + num_accepted
        self.positions = self.forget * self.positions + num_accepted + rejected
