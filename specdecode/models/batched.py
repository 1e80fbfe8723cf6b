"""One target pass over several sequences at once, each with its own KV cache.

A server runs many sequences whose caches hold different numbers of tokens and which
accept different numbers of drafts each round. Their rows share the products (every
matrix is streamed once for the whole batch, which is where batching pays) and each
attends over its own cache. Rows are computed independently: every product is
row-invariant (models/linear.py; on oneDNN, products are split into runs of at most
`row_invariant_rows` rows) and attention reads one sequence's cache with the very call a
pass over that sequence alone makes. So each sequence's logits are bitwise the ones a
pass over it alone gives, whatever else shares the batch.

Where the fused kernels are missing (fp32, the transformers adapter) the passes run one
after another: the same numbers, without the shared weight stream.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from specdecode.models.kv_cache import KVCache
from specdecode.models.layer_ops import FusedOps


@dataclass(frozen=True)
class SequencePass:
    tokens: list[int]  # the pass's new tokens, written at the cache's next slots
    cache: KVCache  # this sequence's own cache (batch size 1)
    mask: torch.Tensor | None = None  # (T, cache.length + T) bool, a tree's; None: causal
    positions: torch.Tensor | None = None  # (T,) rotary positions; None: the slots


def can_batch(model) -> bool:
    """Whether passes over several sequences share one pass of `model`."""
    return getattr(model, "ops", None) is FusedOps


def _product(linear, h: torch.Tensor, max_rows: int | None) -> torch.Tensor:
    """linear(h) over (1, N, in), in runs of at most max_rows rows where the product is
    row-invariant only up to that many."""
    n = h.shape[1]
    if max_rows is None or n <= max_rows:
        return linear(h)
    return torch.cat([linear(h[:, s:s + max_rows]) for s in range(0, n, max_rows)], dim=1)


@torch.inference_mode()
def forward_many(model, passes: list[SequencePass]) -> list[torch.Tensor]:
    """Logits (T_i, vocab) float32 of every pass, each cache advanced by its T_i."""
    if not passes:
        return []
    if not can_batch(model) or len(passes) == 1:
        return [model(torch.tensor([p.tokens]), p.cache, positions=p.positions, mask=p.mask).logits[0]
                for p in passes]
    c = model.config
    sizes = [len(p.tokens) for p in passes]
    for p in passes:
        p.cache.check_room(len(p.tokens))
    positions = [p.positions if p.positions is not None else torch.arange(p.cache.length, p.cache.length + len(p.tokens))
                 for p in passes]
    cos, sin = (torch.cat(t)[None].contiguous() for t in zip(*(model._rope(pos) for pos in positions)))
    allowed = [model._allowed(p.mask, len(p.tokens), p.cache.length) for p in passes]
    rows = model.row_invariant_rows
    ops, eps = FusedOps, c.rms_norm_eps

    x = model.embed[torch.tensor([sum((p.tokens for p in passes), [])])]  # (1, N, H)
    h = ops.rms_norm(x, model.layers[0].attn_norm, eps)
    for i, layer in enumerate(model.layers):
        roped = ops.rope(_product(layer.qkv, h, rows), cos, sin, c.num_heads, c.num_kv_heads, c.head_dim)
        attended, start = [], 0
        for p, size, mask in zip(passes, sizes, allowed):
            attended.append(ops.cache_attention(roped[:, start:start + size].contiguous(), p.cache.keys[i],
                                                p.cache.values[i], p.cache.length, mask, c.num_heads,
                                                c.num_kv_heads))
            start += size
        next_norm = model.layers[i + 1].attn_norm if i + 1 < c.num_layers else model.norm
        x, h = ops.add_rms_norm(x, _product(layer.o, torch.cat(attended, dim=1), rows), layer.mlp_norm, eps)
        down = _product(layer.down, ops.silu_mul(_product(layer.gate_up, h, rows)), rows)
        x, h = ops.add_rms_norm(x, down, next_norm, eps)
    for p in passes:
        p.cache.advance(len(p.tokens))
    logits = _product(model.logits, h, rows)[0]  # (N, V)
    return list(logits.split(sizes))
