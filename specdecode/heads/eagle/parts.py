"""What both EAGLE head layouts share: the artifact's config, the head's KV cache, and
the norm and rotary embedding of a Llama layer."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Sequence

import torch
import torch.nn.functional as F

from specdecode.errors import SpecDecodeError


@dataclass
class EagleConfig:
    target: str
    target_sha256: str | None
    hidden_size: int
    num_heads: int
    num_kv_heads: int
    intermediate_size: int
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    training: dict = field(default_factory=dict)
    # the dynamic tree for this machine: depth, top_k, num_nodes (+ the measurements behind them)
    tree: dict = field(default_factory=dict)
    # The target layers the head reads. Empty: the final normed layer alone (EAGLE-1 and
    # -2). Two or more: their hidden states fused by a product (EAGLE-3 reads a low, a middle
    # and a high layer), for the target's positions; drafted positions read the head's own.
    feature_layers: list[int] = field(default_factory=list)
    # "fused" (model.py: [feature; embedding] through one product, then a plain layer; the
    # head predicts features) or "eagle3" (eagle3.py: the layout other engines load)
    layout: str = "fused"

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads


class HeadCache:
    """Keys and values (1, nkv, S, hd) of the head's positions; rewind drops the last n."""

    def __init__(self):
        self.keys: torch.Tensor | None = None
        self.values: torch.Tensor | None = None

    @property
    def length(self) -> int:
        return 0 if self.keys is None else self.keys.shape[2]

    def append(self, keys: torch.Tensor, values: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        self.keys = keys if self.keys is None else torch.cat([self.keys, keys], dim=2)
        self.values = values if self.values is None else torch.cat([self.values, values], dim=2)
        return self.keys, self.values

    def truncate(self, length: int) -> None:
        if self.keys is not None:
            self.keys, self.values = self.keys[:, :, :length], self.values[:, :, :length]


def rms_norm(x: torch.Tensor, weight: torch.Tensor | None, eps: float) -> torch.Tensor:
    dtype = x.dtype
    x = x.float()
    x = (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)).to(dtype)
    return x if weight is None else x * weight


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def rope(q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor, inv_freq: torch.Tensor):
    """q, k (1, heads, T, hd) rotated by their positions (T,), as Llama rotates them."""
    freqs = positions.float()[:, None] * inv_freq[None]
    emb = torch.cat([freqs, freqs], dim=-1)
    cos, sin = emb.cos().to(q.dtype), emb.sin().to(q.dtype)
    return q * cos + rotate_half(q) * sin, k * cos + rotate_half(k) * sin


def check_feature_layers(layers: Sequence[int], num_layers: int | None = None) -> None:
    """Fused layers are two or more distinct ones, within the target's (when known)."""
    layers = list(layers)
    if layers and (len(layers) < 2 or len(set(layers)) != len(layers)
                   or any(layer < 1 or num_layers is not None and layer > num_layers for layer in layers)):
        within = f" from 1 to the target's {num_layers}" if num_layers else ""
        raise SpecDecodeError(f"feature layers: two or more distinct layers{within}, not {layers}")


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, positions: torch.Tensor, inv_freq: torch.Tensor,
           cache: HeadCache | None, mask: torch.Tensor | None) -> torch.Tensor:
    """A head's attention: q (T, nh·hd), k and v (T, nkv·hd) rotated by their positions,
    the keys and values appended to `cache`, over the cached positions and each other by
    `mask` (T, cached + T) bool (without one, causally). Returns (T, nh·hd)."""
    T, hd = q.shape[0], inv_freq.numel() * 2
    q, k, v = (t.view(T, -1, hd).transpose(0, 1)[None] for t in (q, k, v))  # (1, heads, T, hd)
    q, k = rope(q, k, positions, inv_freq)
    past = 0
    if cache is not None:
        past = cache.length
        k, v = cache.append(k, v)
    if mask is None:
        mask = torch.ones(T, past + T, dtype=torch.bool).tril(past)
    groups = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
    attn = F.scaled_dot_product_attention(q, k, v, attn_mask=mask[None, None])  # (1, nh, T, hd)
    return attn[0].transpose(0, 1).reshape(T, -1)
