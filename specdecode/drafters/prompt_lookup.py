"""Prompt lookup: propose the tokens that followed the latest earlier occurrence of the
context's last n tokens (n from max_ngram down to min_ngram). No model, no cost beyond a
scan of the context; it pays on copy-heavy tasks (code edits, summaries with quotes).

Its proposals are deterministic, so the engine verifies them against a one-hot draft
distribution, which keeps sampling exact.
"""

from __future__ import annotations

from typing import Sequence

import torch

from specdecode.errors import SpecDecodeError
from specdecode.drafters.base import Drafter, Proposal


class PromptLookup(Drafter):
    name = "prompt-lookup"

    def __init__(self, max_ngram: int = 3, min_ngram: int = 1):
        if not 1 <= min_ngram <= max_ngram:
            raise SpecDecodeError(f"need 1 <= min_ngram <= max_ngram, got {min_ngram}, {max_ngram}")
        self.max_ngram, self.min_ngram = max_ngram, min_ngram

    def propose(self, context: Sequence[int], k: int, sampling=None, generator=None) -> Proposal:
        ctx = torch.as_tensor(list(context), dtype=torch.long)
        for n in range(min(self.max_ngram, len(ctx) - 1), self.min_ngram - 1, -1):
            suffix = ctx[-n:]
            windows = ctx[:-1].unfold(0, n, 1)  # (L-n, n): every earlier n-gram
            starts = (windows == suffix).all(dim=1).nonzero().flatten()
            if starts.numel():
                begin = int(starts[-1]) + n  # the latest match, whose continuation is freshest
                return Proposal(ctx[begin:begin + k])
        return Proposal(ctx[:0])
