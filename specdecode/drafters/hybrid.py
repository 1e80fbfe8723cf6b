"""Prompt lookup where the context repeats itself, the draft model everywhere else.

Prompt lookup is free and, when the answer copies from the prompt (an edit, a summary's
quotes), right for long spans; elsewhere it finds nothing and a round is a plain step.
A draft model costs a pass per token but guesses well on any text. Per round, this
drafter copies when the context's last `min_ngram` or more tokens occurred before, and
asks the draft model otherwise, so a copy-heavy answer gets both: long free copies, and
model drafts between them.

The two parts keep their own draft lengths, each fixed or adaptive (adaptive.py) and each
told only of its own rounds: `lookup_k` (a `tune` profile fixes it from probes, since
copies come in bursts; without one it adapts on this machine's costs, as prompt lookup
alone does, so that copies stay short where a pass over many tokens is dear, as on AVX2
CPUs) and `model_k`. What the target accepted is read from the next
context, as every drafter does: the accepted drafts are the common prefix of the
proposal and the tokens that followed (a correction token never equals the draft token
it replaces, greedy or sampled), so the engine needs no extra call. What a round cost is
read the same way, as the time from one proposal to the next: the model part's policy is
told of its own rounds and of the plain steps (rounds where neither part drafted), which
its clock prices drafting against (policy/round_clock.py).
"""

from __future__ import annotations

import time
from typing import Sequence

import torch

from specdecode.core.draft_length import DraftLength, FixedK
from specdecode.policy.adaptive import AdaptiveK
from specdecode.drafters.base import Drafter, Proposal
from specdecode.drafters.draft_model import DraftModel, _common_prefix
from specdecode.drafters.prompt_lookup import PromptLookup


class LookupOrModel(Drafter):
    name = "hybrid"

    def __init__(self, model: DraftModel, lookup_k: int | AdaptiveK = 8, model_k: int | AdaptiveK = 3,
                 min_ngram: int = 2):
        self.model = model
        self.lookup = PromptLookup(max_ngram=max(3, min_ngram), min_ngram=min_ngram)
        self.lookup_k = lookup_k
        self.model_k = model_k
        self.rounds = {"lookup": 0, "model": 0, "none": 0}  # which part drafted, per round, since created
        self.reset()

    @property
    def k_max(self) -> int:
        """The longest proposal: the engine's k for this drafter."""
        return max(_longest(self.lookup_k), _longest(self.model_k))

    def reset(self) -> None:
        """A new generation: fresh policies for both parts, nothing pending."""
        self.lookup.reset()
        self.lookup_policy = _policy(self.lookup_k)
        self.policy = _policy(self.model_k)
        # (policy or None for a plain step, context length, tokens, when the round began) last proposed
        self.pending: tuple[DraftLength | None, int, list[int], float] | None = None

    def propose(self, context: Sequence[int], k: int, sampling=None, generator=None,
                tokens_left: int | None = None) -> Proposal:
        now = time.perf_counter()
        self._observe(context, now)
        k_lookup = min(k, self.lookup_policy.next_k())
        copied = self.lookup.propose(context, k_lookup) if k_lookup else Proposal(torch.empty(0, dtype=torch.long))
        if len(copied.tokens):
            self.rounds["lookup"] += 1
            self.pending = (self.lookup_policy, len(context), copied.tokens.tolist(), now)
            return copied
        k_model = min(k, self.policy.next_k(self.model.unread(context), tokens_left))
        if k_model < 1:
            self.rounds["none"] += 1
            self.pending = (None, len(context), [], now)
            return Proposal(torch.empty(0, dtype=torch.long))
        self.rounds["model"] += 1
        proposal = self.model.propose(context, k_model, sampling, generator)
        self.pending = (self.policy, len(context), proposal.tokens.tolist(), now)
        return proposal

    def _observe(self, context: Sequence[int], now: float) -> None:
        """Tell the policy of the part that drafted last how its draft fared, from what followed
        it, and the model part's policy what its round or a plain step took."""
        if self.pending is None:
            return
        policy, start, drafted, began = self.pending
        self.pending = None
        if policy is not None:
            policy.observe(len(drafted), _common_prefix(drafted, context[start:]))
        if policy is None or policy is self.policy:
            self.policy.observe_time(len(drafted), now - began)


def _policy(k: int | AdaptiveK) -> DraftLength:
    return FixedK(k) if isinstance(k, int) else k.fresh()


def _longest(k: int | AdaptiveK) -> int:
    return k if isinstance(k, int) else k.k_max
