"""Any transformers causal LM behind the native model's interface, perhaps slower.

This is the fallback for architectures the native forward does not implement (Gemma,
Phi, ...). It verifies chains: its cache is transformers' `DynamicCache`, which can be
cropped (rewound) but not packed, and it takes no tree masks.

Left out: tree verification (`compact` and `mask`), which need the native backend.
"""

from __future__ import annotations

from pathlib import Path
from typing import Sequence

import torch

from specdecode.models.native import ForwardOutput


class HFCache:
    """A DynamicCache with the native cache's integer bookkeeping."""

    def __init__(self, batch_size: int, max_len: int):
        from transformers import DynamicCache

        self.inner = DynamicCache()
        self.batch_size = batch_size
        self.max_len = max_len
        self.length = 0

    def check_room(self, num_new: int) -> None:
        if self.length + num_new > self.max_len:
            raise ValueError(f"KV cache is full: {self.length} slots used + {num_new} new > max_len {self.max_len}")

    def rewind(self, n: int) -> None:
        if not 0 <= n <= self.length:
            raise ValueError(f"cannot rewind {n} slots of a cache holding {self.length}")
        self.length -= n
        if n:
            self.inner.crop(-n)  # transformers 5 crops by a negative count of tokens to drop

    def compact(self, indices) -> None:
        raise ValueError("the transformers adapter verifies chains only; trees need the native backend")


class HFModel:
    backend = "hf"

    def __init__(self, model, dtype: torch.dtype):
        self.model = model.eval()
        self.dtype = dtype
        cfg = model.config
        self.vocab_size = cfg.vocab_size
        self.num_layers = cfg.num_hidden_layers
        self.max_position_embeddings = getattr(cfg, "max_position_embeddings", 4096)

    @classmethod
    def from_folder(cls, folder: str | Path, dtype: torch.dtype = torch.bfloat16) -> "HFModel":
        from transformers import AutoModelForCausalLM

        return cls(AutoModelForCausalLM.from_pretrained(str(folder), dtype=dtype), dtype)

    def new_cache(self, batch_size: int = 1, max_len: int | None = None) -> HFCache:
        return HFCache(batch_size, max_len or min(self.max_position_embeddings, 4096))

    @property
    def weight_bytes_per_token(self) -> int:
        embed = self.model.get_input_embeddings().weight
        total = sum(p.numel() * p.element_size() for p in self.model.parameters())
        tied = self.model.get_output_embeddings().weight is embed
        return total if tied else total - embed.numel() * embed.element_size()

    @property
    def memory_bytes(self) -> int:
        return sum(p.numel() * p.element_size() for p in self.model.parameters())

    @torch.inference_mode()
    def forward(self, tokens: torch.Tensor, cache: HFCache, positions: torch.Tensor | None = None,
                mask: torch.Tensor | None = None, hidden_layers: Sequence[int] = (),
                num_logits: int | None = None) -> ForwardOutput:
        if mask is not None:
            raise ValueError("the transformers adapter takes no attention masks; trees need the native backend")
        B, T = tokens.shape
        cache.check_room(T)
        if positions is None:
            positions = torch.arange(cache.length, cache.length + T)
        out = self.model(
            input_ids=tokens,
            position_ids=positions.expand(B, T),
            cache=cache.inner,  # transformers 5.24 renamed past_key_values (removed in 5.40)
            use_cache=True,
            output_hidden_states=bool(hidden_layers),
            logits_to_keep=num_logits or 0,
        )
        cache.length += T
        hidden = {i: out.hidden_states[i] for i in hidden_layers} if hidden_layers else {}
        return ForwardOutput(out.logits.float(), hidden)

    __call__ = forward
