"""Prompt lookup where the context repeats itself, the draft model everywhere else.

Prompt lookup is free and, when the answer copies from the prompt (an edit, a summary's
quotes), right for long spans; elsewhere it finds nothing and a round is a plain step.
A draft model costs a pass per token but guesses well on any text. Per round, this
drafter copies when the context's last `min_ngram` or more tokens occurred before, and
asks the draft model otherwise, so a copy-heavy answer gets both: long free copies, and
model drafts between them.

The two parts keep their own draft lengths: a fixed `lookup_k` (copies come in bursts,
which α-based adaptation undervalues), and the draft model's policy (adaptive.py), which
sees only the model's own rounds. What the target accepted is read from the next
context, as every drafter does: the accepted drafts are the common prefix of the
proposal and the tokens that followed (a correction token never equals the draft token
it replaces, greedy or sampled), so the engine needs no extra call.
"""

from __future__ import annotations

from typing import Sequence

import torch

from specdecode.core.draft_length import FixedK
from specdecode.policy.adaptive import AdaptiveK
from specdecode.drafters.base import Drafter, Proposal
from specdecode.drafters.draft_model import DraftModel, _common_prefix
from specdecode.drafters.prompt_lookup import PromptLookup


class LookupOrModel(Drafter):
    name = "hybrid"

    def __init__(self, model: DraftModel, lookup_k: int = 8, model_k: int | AdaptiveK = 3, min_ngram: int = 2):
        self.model = model
        self.lookup = PromptLookup(max_ngram=max(3, min_ngram), min_ngram=min_ngram)
        self.lookup_k = lookup_k
        self.model_k = model_k
        self.rounds = {"lookup": 0, "model": 0, "none": 0}  # which part drafted, per round, since created
        self.reset()

    @property
    def k_max(self) -> int:
        """The longest proposal: the engine's k for this drafter."""
        return max(self.lookup_k, self.model_k if isinstance(self.model_k, int) else self.model_k.k_max)

    def reset(self) -> None:
        """A new generation: a fresh policy for the draft model, nothing pending."""
        self.lookup.reset()
        self.policy = FixedK(self.model_k) if isinstance(self.model_k, int) else self.model_k.fresh()
        self.pending: tuple[int, list[int]] | None = None  # (context length, tokens) of the last model draft

    def propose(self, context: Sequence[int], k: int, sampling=None, generator=None) -> Proposal:
        self._observe(context)
        copied = self.lookup.propose(context, min(k, self.lookup_k))
        if len(copied.tokens):
            self.rounds["lookup"] += 1
            return copied
        k_model = min(k, self.policy.next_k())
        if k_model < 1:
            self.rounds["none"] += 1
            return Proposal(torch.empty(0, dtype=torch.long))
        self.rounds["model"] += 1
        proposal = self.model.propose(context, k_model, sampling, generator)
        self.pending = (len(context), proposal.tokens.tolist())
        return proposal

    def _observe(self, context: Sequence[int]) -> None:
        """Tell the model's policy how its last draft fared, from what followed it."""
        if self.pending is None:
            return
        start, drafted = self.pending
        self.pending = None
        accepted = _common_prefix(drafted, context[start:])
        self.policy.observe(len(drafted), accepted)
