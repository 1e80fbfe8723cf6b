"""A head drafter's LM head over the tokens the target actually emits.

Medusa and EAGLE read their candidates through the target's LM head, and on this CPU
that product is most of a draft step: Qwen2.5's head is 151,936 x 1536, 0.47 GB of bf16
streamed per call, a sixth of a whole target step, paid once per tree depth. Most of its
rows are tokens the target almost never emits. Training already keeps only the tokens
its labels use (the target's own argmax over the training text), so the head is stored
with that list and drafts from those rows alone (EAGLE-3 drafts from a reduced
vocabulary the same way).

Exactness does not depend on it: the target verifies over its whole vocabulary, and a
head drafter's candidates are deterministic top ranks (one-hot draft rows under
sampling), so a token outside the list is simply never proposed.
"""

from __future__ import annotations

from pathlib import Path

import torch

from specdecode.models.linear import Linear

ARTIFACT_KEY = "draft_vocab"  # the token ids, stored beside a head's weights in its safetensors


class DraftVocab:
    """Logits of features over a list of token ids (None: the target's whole vocabulary)."""

    def __init__(self, lm_head, token_ids: torch.Tensor | None = None):
        self.lm_head, self.token_ids = lm_head, token_ids

    @classmethod
    def rows(cls, lm_weight: torch.Tensor, token_ids: torch.Tensor, dtype: torch.dtype) -> "DraftVocab":
        """The LM head's rows for `token_ids`, packed like the target's own products."""
        token_ids = token_ids.long()
        return cls(Linear(lm_weight[token_ids].to(dtype).contiguous()), token_ids)

    def logits(self, features: torch.Tensor) -> torch.Tensor:
        return self.lm_head(features)

    def tokens(self, indices: torch.Tensor) -> torch.Tensor:
        """Target token ids of logit columns."""
        return indices if self.token_ids is None else self.token_ids[indices]


def lm_head_weight(target) -> torch.Tensor:
    """The target's LM head as a plain matrix (tied: the embeddings; else from the file,
    as for a quantized target, whose head runs on its blocks)."""
    if target.model.lm_head_weight is not None:
        return target.model.lm_head_weight
    from safetensors import safe_open

    tied = getattr(target.model.config, "tie_word_embeddings", False)
    names = ("lm_head.weight", "model.embed_tokens.weight") if tied else ("lm_head.weight",)
    for path in sorted(Path(target.info.folder).glob("*.safetensors")):  # the bf16 copy sorts first
        with safe_open(path, "pt") as f:
            for name in names:
                if name in f.keys():
                    return f.get_tensor(name)
    raise FileNotFoundError(f"no {' or '.join(names)} in {target.info.folder}")


def for_target(target, token_ids: torch.Tensor | None) -> DraftVocab:
    """The draft vocabulary of a head stored with `token_ids` (None: the whole one)."""
    if token_ids is None:
        return DraftVocab(target.model.lm_head)
    return DraftVocab.rows(lm_head_weight(target), token_ids, target.model.dtype)
