"""What a generation's rounds really cost, against what the cost model said they would.

The adaptive policy's costs are measured once per machine (probe.py) or by `tune`, and a
CPU's costs move after that: on a 2-core AMD EPYC, one-token passes (memory-bound) took
31.5-41.0 ms within one hour while passes over three tokens (compute-bound) moved less, so
a round that the probe priced at 1.15 plain steps cost 1.3-1.5 inside a generation, and a
draft model that the probe said would gain 1.2x ran at 0.93x of plain decoding. The clock
keeps the latest plain steps and drafted rounds of the generation, timed as the engine ran
them, and gives the factor by which the drafted rounds cost more (or less) than the model
predicted, in units of the plain steps timed beside them.
"""

from __future__ import annotations

import statistics
from collections import deque
from dataclasses import dataclass, field

PLAIN_KEPT = 4  # plain steps kept: the median of the latest few, as the machine drifts
DRAFTED_KEPT = 16  # drafted rounds kept
DRAFTED_NEEDED = 3  # drafted rounds timed before their cost is trusted over the model's
SCALE_RANGE = (0.5, 3.0)  # however the timings went, the probe's costs keep some say


@dataclass
class RoundClock:
    plain: deque = field(default_factory=lambda: deque(maxlen=PLAIN_KEPT))  # seconds of a plain step
    drafted: deque = field(default_factory=lambda: deque(maxlen=DRAFTED_KEPT))  # (seconds, predicted plain steps)
    since_plain: int = 0  # drafted rounds since the last plain step, timed or not

    def add_plain(self, seconds: float) -> None:
        self.plain.append(seconds)
        self.since_plain = 0

    def add_drafted(self, seconds: float, predicted_steps: float | None) -> None:
        """A drafted round; predicted_steps None: not timed (it read a long context first)."""
        self.since_plain += 1
        if predicted_steps is not None:
            self.drafted.append((seconds, predicted_steps))

    def plain_step_due(self, every: int) -> bool:
        """Whether the next round should be a plain step, to be timed: once the first drafted
        rounds are timed, then every `every` drafted rounds, so the price stays current."""
        if not self.plain:
            return len(self.drafted) >= DRAFTED_NEEDED
        return self.since_plain >= every

    def scale(self) -> float:
        """How many times the model's price the drafted rounds cost, in plain steps timed in
        the same generation: the median over rounds, so one stalled round does not decide;
        1.0 until a plain step and DRAFTED_NEEDED drafted rounds are timed."""
        if not self.plain or len(self.drafted) < DRAFTED_NEEDED:
            return 1.0
        step = statistics.median(self.plain)
        low, high = SCALE_RANGE
        return min(high, max(low, statistics.median(s / (p * step) for s, p in self.drafted)))
