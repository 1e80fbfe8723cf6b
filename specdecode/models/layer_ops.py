"""The small operations of a decoder layer: torch ops, or the fused ones of ops.cpp.

Both compute transformers' Llama numerics (RMSNorm in fp32, rounded to the model dtype
before the weight; rotate-half rope and SiLU in the model dtype). The fused ones do each
step in one call instead of several, which matters on CPU where a decoding step's small
tensors cost more in dispatch than in arithmetic. They are used for bf16 when the
extension is built (kernels.py); fp32 stays on torch, where plain decoding is tested to
equal transformers' `generate` token for token. The fused set also has the layer's
attention over the cache (attention_host.h), which torch's ops leave to native.py.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from specdecode.models import kernels


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return weight * h.to(x.dtype)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def split_heads(qkv: torch.Tensor, num_heads: int, num_kv_heads: int, head_dim: int):
    """(B, T, (nh + 2 nkv) hd) -> q (B, nh, T, hd), k and v (B, nkv, T, hd)."""
    B, T, _ = qkv.shape
    q, k, v = qkv.split([num_heads * head_dim, num_kv_heads * head_dim, num_kv_heads * head_dim], dim=-1)
    return (q.view(B, T, num_heads, head_dim).transpose(1, 2), k.view(B, T, num_kv_heads, head_dim).transpose(1, 2),
            v.view(B, T, num_kv_heads, head_dim).transpose(1, 2))


class TorchOps:
    rms_norm = staticmethod(rms_norm)

    @staticmethod
    def add_rms_norm(x, delta, weight, eps):
        """(x + delta, rms_norm(x + delta)): a residual add, then the next norm."""
        x = x + delta
        return x, rms_norm(x, weight, eps)

    @staticmethod
    def rope_qkv(qkv, cos, sin, num_heads, num_kv_heads, head_dim):
        """Split a fused qkv product into heads and rotate q and k; cos, sin (T, hd) or (B, T, hd)."""
        q, k, v = split_heads(qkv, num_heads, num_kv_heads, head_dim)
        if cos.dim() == 3:
            cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)  # (B, 1, T, hd) broadcast over heads
        return q * cos + rotate_half(q) * sin, k * cos + rotate_half(k) * sin, v

    @staticmethod
    def silu_mul(gate_up):
        gate, up = gate_up.chunk(2, dim=-1)
        return F.silu(gate) * up


_CAUSAL = torch.empty(0, dtype=torch.bool)  # the kernels' attention's "no mask": causal by slot


class FusedOps:
    causal = _CAUSAL

    @staticmethod
    def rms_norm(x, weight, eps):
        return kernels.kernel().rms_norm(x.contiguous(), weight, eps)

    @staticmethod
    def add_rms_norm(x, delta, weight, eps):
        return tuple(kernels.kernel().add_rms_norm(x.contiguous(), delta.contiguous(), weight, eps))

    @staticmethod
    def rope(qkv, cos, sin, num_heads, num_kv_heads, head_dim):
        """The fused qkv product with q and k rotated, unsplit: (B, T, (nh + 2 nkv) hd)."""
        table = (lambda t: t if t.dim() == 3 else t[None])
        return kernels.kernel().rope_qkv(qkv.contiguous(), table(cos).contiguous(), table(sin).contiguous(),
                                     num_heads + num_kv_heads, head_dim)

    @staticmethod
    def rope_qkv(qkv, cos, sin, num_heads, num_kv_heads, head_dim):
        return split_heads(FusedOps.rope(qkv, cos, sin, num_heads, num_kv_heads, head_dim),
                           num_heads, num_kv_heads, head_dim)

    @staticmethod
    def cache_attention(roped_qkv, keys, values, start, allowed, num_heads, num_kv_heads):
        """Write the new keys and values at slots start, ... of one layer's cache buffers
        (B, nkv, max_len, hd) and attend there (attention_host.h): (B, T, nh hd), each row over
        the slots `allowed` (B or 1, T, start + T) lets it see (None: causal by slot)."""
        return kernels.kernel().cache_attention(roped_qkv, keys, values, start, _CAUSAL if allowed is None else allowed,
                                            num_heads, num_kv_heads)

    @staticmethod
    def silu_mul(gate_up):
        return kernels.kernel().silu_mul(gate_up.contiguous())


def layer_ops(dtype: torch.dtype):
    """The fused ops for bf16 where the extension is built, else torch's."""
    return FusedOps if dtype == torch.bfloat16 and kernels.kernel() is not None else TorchOps
