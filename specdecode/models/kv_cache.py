"""A preallocated, rewindable key/value cache for the native forward.

Keys and values of every layer live in two tensors of shape
(num_layers, batch, num_kv_heads, max_len, head_dim). A forward pass over T tokens
writes slots [length, length + T) and advances `length`. Speculative decoding then
either drops rejected slots with `rewind(n)` (an integer move: the stale values are
simply overwritten later) or packs the accepted path of a tree into contiguous slots
with `compact(indices)` (one gather). Slots are storage, not positions: the rotary
position of each token is given to the forward explicitly, so a tree's nodes can share
positions while occupying distinct slots.

Left out: per-row lengths for batches whose rows accept different numbers of tokens.
"""

from __future__ import annotations

from typing import Sequence

import torch

from specdecode.models.huge_pages import zeros_on_huge_pages

# Buffers are a whole number of the CPU attention kernel's key blocks (see native.py).
BLOCK = 512


class KVCache:
    def __init__(self, num_layers: int, batch_size: int, num_kv_heads: int, max_len: int,
                 head_dim: int, dtype: torch.dtype, device: torch.device | str = "cpu"):
        max_len = -(-max_len // BLOCK) * BLOCK
        shape = (num_layers, batch_size, num_kv_heads, max_len, head_dim)
        if torch.device(device).type == "cpu":  # attention reads each layer's keys cold: 2 MB pages
            self.keys, self.values = zeros_on_huge_pages(shape, dtype), zeros_on_huge_pages(shape, dtype)
        else:
            self.keys = torch.zeros(shape, dtype=dtype, device=device)
            self.values = torch.zeros(shape, dtype=dtype, device=device)
        self.length = 0  # slots [0, length) hold valid entries

    @property
    def max_len(self) -> int:
        return self.keys.shape[3]

    @property
    def batch_size(self) -> int:
        return self.keys.shape[1]

    def check_room(self, num_new: int) -> None:
        if self.length + num_new > self.max_len:
            raise ValueError(
                f"KV cache is full: {self.length} slots used + {num_new} new > max_len {self.max_len}"
            )

    def write(self, layer: int, keys: torch.Tensor, values: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Store (B, n_kv, T, hd) at slots [length, length+T); return the layer's whole buffer."""
        end = self.length + keys.shape[2]
        self.keys[layer, :, :, self.length:end] = keys
        self.values[layer, :, :, self.length:end] = values
        return self.keys[layer], self.values[layer]

    def advance(self, num_new: int) -> None:
        self.length += num_new

    def rewind(self, n: int) -> None:
        """Forget the last n slots."""
        if not 0 <= n <= self.length:
            raise ValueError(f"cannot rewind {n} slots of a cache holding {self.length}")
        self.length -= n

    def compact(self, indices: Sequence[int] | torch.Tensor) -> None:
        """Keep the slots `indices` (ascending), moved to contiguous slots starting at the first.

        Everything before indices[0] stays; everything else after it is dropped. This packs
        an accepted tree path, e.g. slots [10, 11, 13, 16] -> [10, 11, 12, 13], length 14.
        """
        idx = torch.as_tensor(indices, dtype=torch.long, device=self.keys.device)
        if idx.numel() == 0:
            raise ValueError("compact needs at least one slot to keep")
        if bool((idx[1:] <= idx[:-1]).any()) or int(idx[-1]) >= self.length or int(idx[0]) < 0:
            raise ValueError(f"compact indices must ascend within [0, {self.length}): {idx.tolist()}")
        start = int(idx[0])
        end = start + idx.numel()
        if int(idx[-1]) == end - 1:  # already contiguous (a root alone, a path down the first slots): no copy
            self.length = end
            return
        # index_select copies first, so overlapping source and destination slots are safe.
        self.keys[:, :, :, start:end] = self.keys.index_select(3, idx)
        self.values[:, :, :, start:end] = self.values.index_select(3, idx)
        self.length = end
