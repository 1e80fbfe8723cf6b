"""A separate small model that shares the target's tokenizer drafts k tokens, one pass each.

It keeps its own KV cache and the list of tokens that cache holds; each proposal first
rewinds to the longest common prefix with the new context (what the target accepted),
feeds the tokens it has not seen, then drafts autoregressively. Its distributions are
padded with zeros to the target's vocabulary size (checkpoints pad their embedding
tables to different multiples; rows past the tokenizer are never proposed).
"""

from __future__ import annotations

from typing import Sequence

import torch

from specdecode.errors import SpecDecodeError
from specdecode.core.sampling import SamplingConfig, logits_to_probs, sample
from specdecode.drafters.base import Drafter, Proposal


def check_same_tokenizer(target_tokenizer, draft_tokenizer) -> None:
    if target_tokenizer.get_vocab() != draft_tokenizer.get_vocab():
        raise SpecDecodeError(
            "the draft model's tokenizer differs from the target's "
            f"({len(draft_tokenizer.get_vocab())} vs {len(target_tokenizer.get_vocab())} entries); "
            "a draft model must share the target's vocabulary"
        )


def _common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


class DraftModel(Drafter):
    name = "draft-model"

    def __init__(self, model, target_vocab_size: int, max_len: int = 4096):
        self.model = model
        self.target_vocab_size = target_vocab_size
        self.max_len = max_len
        self.cache = model.new_cache(1, max_len)
        self.cached: list[int] = []  # the tokens whose keys and values the cache holds

    def propose(self, context: Sequence[int], k: int, sampling: SamplingConfig,
                generator: torch.Generator | None, tokens_left: int | None = None) -> Proposal:
        feed = self.sync(context, k)
        tokens, probs = [], []
        for _ in range(k):
            logits = self.model(torch.tensor([feed]), self.cache, num_logits=1).logits[0, -1]  # (V_draft,)
            self.cached.extend(feed)
            if sampling.greedy:
                token = int(logits.argmax())
            else:
                row = self._pad(logits_to_probs(logits, sampling))
                token = int(sample(row, generator))
                probs.append(row)
            tokens.append(token)
            feed = [token]
        return Proposal(torch.tensor(tokens, dtype=torch.long), torch.stack(probs) if probs else None)

    def unread(self, context: Sequence[int]) -> int:
        return len(context) - min(_common_prefix(self.cached, context), len(context) - 1)

    def sync(self, context: Sequence[int], room: int) -> list[int]:
        """Rewind the cache to its longest common prefix with the context (always leaving
        the last context token out) and return the context tokens still to feed."""
        if len(context) + room > self.cache.max_len:
            self.cache, self.cached = self.model.new_cache(1, max(2 * self.cache.max_len, len(context) + room)), []
        keep = min(_common_prefix(self.cached, context), len(context) - 1)
        self.cache.rewind(self.cache.length - keep)
        self.cached = list(context[:keep])
        return list(context[keep:])

    def _pad(self, probs: torch.Tensor) -> torch.Tensor:
        extra = self.target_vocab_size - probs.shape[-1]
        if extra > 0:
            return torch.cat([probs, probs.new_zeros(extra)])
        if extra < 0:  # draft rows past the target's vocabulary carry no real token
            probs = probs[: self.target_vocab_size]
            return probs / probs.sum()
        return probs
