"""Prompt lookup: propose the tokens that followed the latest earlier occurrence of the
context's last n tokens (n from max_ngram down to min_ngram). No model; it pays on
copy-heavy tasks (code edits, summaries with quotes, answers from retrieved passages).

Long prompts are where it pays most, so a round must not scan the context: an index maps
every n-gram to where it last started, and takes in only the tokens added since the last
round (`NgramIndex`). A round costs a few dictionary lookups whatever the context's length.

Its proposals are deterministic, so the engine verifies them against a one-hot draft
distribution, which keeps sampling exact.
"""

from __future__ import annotations

from typing import Sequence

import torch

from specdecode.errors import SpecDecodeError
from specdecode.drafters.base import Drafter, Proposal


class NgramIndex:
    """For each n in [min_n, max_n]: n-gram -> start of its latest occurrence that ends
    before the context's last token (the context's own suffix does not count as earlier)."""

    def __init__(self, min_n: int, max_n: int):
        self.sizes = range(min_n, max_n + 1)
        self.tokens: list[int] = []  # the context indexed so far
        self.latest: dict[int, dict[tuple[int, ...], int]] = {n: {} for n in self.sizes}

    def update(self, context: Sequence[int]) -> None:
        """Take in the tokens added since the last call; start over if the context is not
        the one indexed plus new tokens (a new generation)."""
        seen = len(self.tokens)
        if len(context) < seen or list(context[:seen]) != self.tokens:
            self.__init__(self.sizes.start, self.sizes.stop - 1)
            seen = 0
        self.tokens.extend(context[seen:])
        t = self.tokens
        # n-grams ending at positions [seen - 1, len - 2]: the old last token now has a successor
        for end in range(max(0, seen - 1), len(t) - 1):
            for n in self.sizes:
                if end + 1 >= n:
                    self.latest[n][tuple(t[end + 1 - n:end + 1])] = end + 1 - n

    def continuation(self, k: int, max_n: int) -> list[int]:
        """Up to k tokens after the latest earlier occurrence of the longest suffix (n <= max_n) found."""
        t = self.tokens
        for n in range(min(max_n, len(t) - 1), self.sizes.start - 1, -1):
            start = self.latest[n].get(tuple(t[-n:]))
            if start is not None:
                return t[start + n:start + n + k]
        return []


class PromptLookup(Drafter):
    name = "prompt-lookup"

    def __init__(self, max_ngram: int = 3, min_ngram: int = 1):
        if not 1 <= min_ngram <= max_ngram:
            raise SpecDecodeError(f"need 1 <= min_ngram <= max_ngram, got {min_ngram}, {max_ngram}")
        self.max_ngram, self.min_ngram = max_ngram, min_ngram
        self.index = NgramIndex(min_ngram, max_ngram)

    def reset(self) -> None:
        self.index = NgramIndex(self.min_ngram, self.max_ngram)

    def propose(self, context: Sequence[int], k: int, sampling=None, generator=None,
                tokens_left: int | None = None) -> Proposal:
        self.index.update(context)
        return Proposal(torch.tensor(self.index.continuation(k, self.max_ngram), dtype=torch.long))
