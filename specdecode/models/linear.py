"""A linear layer that streams bf16 weights at memory speed on CPU.

bf16 weights go through the project's kernel for this CPU (kernels.py): on AMX it streams at
about 25 GB/s on the machine measured below; on AVX2-only CPUs (AMD Zen 3) the AVX2
kernel. Both compute every row alike for any number of rows. Where neither is built, they
are packed for oneDNN, as measured below, or, where oneDNN refuses bf16, go to F.linear.

Decoding one token is a chain of matrix-vector products, so its speed is the rate at
which weights stream from memory. Measured here on weights far larger than the 480 MB
L3 (2 cores): oneDNN with the weight reordered once into its blocked layout streams bf16
at 24-25 GB/s for 1 to 8 rows alike, `F.linear` at 18-20 GB/s, `x @ W.T` from a
transposed copy at 13 GB/s; fp32 streams at about 30 GB/s through MKL, but bf16 moves
half the bytes. (Matrices that fit in L3 run at about 49 GB/s, which is what a naive
benchmark of one matrix reports.) So bf16 weights on CPU are packed once at load time,
and everything else uses `F.linear`. The packed product of a row does not depend on how
many rows are in the call, up to 11 rows (tested), which keeps verification of chains
of up to 10 drafts batch-invariant.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F

from specdecode.models import kernels


@functools.cache
def onednn_packs_bf16() -> bool:
    """Whether oneDNN can reorder a bf16 weight on this CPU: it needs AVX-512 (bw, vl, dq)
    or AVX-NE-CONVERT, and refuses otherwise (an AVX2-only CPU such as AMD Zen 3)."""
    if not (torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")):
        return False
    try:
        torch.ops.mkldnn._reorder_linear_weight(torch.zeros(16, 16, dtype=torch.bfloat16), 1)
    except RuntimeError:
        return False
    return True


def _is_cpu_bf16(weight: torch.Tensor) -> bool:
    return weight.device.type == "cpu" and weight.dtype == torch.bfloat16


# Rows up to which a product's rows are bitwise independent of the row count, per backend:
# any number on the AMX, AVX-512 and AVX2 kernels and on quantized blocks (one code path per row),
# 11 on oneDNN's packing
# (measured); F.linear: bf16 on an AVX2-only CPU measured to 64 rows. A bf16 verify pass
# must stay within it. fp32 F.linear is not invariant at all (on Zen 3 a one-row product
# rounds differently from two rows, MKL's GEMV against its GEMM), so fp32 speculative
# output equals plain decoding only up to those last-bit differences: no bound helps there.
ROW_INVARIANT_ROWS = {"amx": None, "avx512": None, "avx2": None, "onednn": 11, "torch": None, "quant": None}


class Linear:
    """y = x @ weight.T + bias, for x of shape (..., in_features)."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None, pack: bool = True):
        self.out_features, self.in_features = weight.shape
        self.bias = bias
        self.weight_bytes = weight.numel() * weight.element_size()
        kernel = kernels.kernel_kind() if pack and _is_cpu_bf16(weight) else None
        self.packed = kernel is not None or (pack and _is_cpu_bf16(weight) and onednn_packs_bf16())
        self.backend = kernel or ("onednn" if self.packed else "torch")
        if kernel is not None:
            self.weight = kernels.pack(weight)
            return
        # The reorder takes a batch-size hint. With hint 1, a row's product is bit-identical
        # whether the call has 1 or up to 11 rows (measured on every shape of the models
        # here; from 12 rows on the kernel changes). Hint 8 streams 4% faster but its rows
        # depend on the row count, which would break greedy identity, so: 1.
        self.weight = torch.ops.mkldnn._reorder_linear_weight(weight, 1) if self.packed else weight

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if not self.packed:
            return F.linear(x, self.weight, self.bias)
        lead = x.shape[:-1]
        if self.backend in kernels.KINDS:  # this machine's kernel
            return kernels.linear(x.reshape(-1, self.in_features), self.weight, self.bias, self.out_features).view(*lead, self.out_features)
        y = torch.ops.mkldnn._linear_pointwise(x.reshape(-1, self.in_features), self.weight, self.bias, "none", [], "")
        return y.view(*lead, self.out_features)

    @property
    def kernel_parts(self) -> list[torch.Tensor]:
        """The weight as decoder_layer.cpp takes it (packed for this machine's kernel)."""
        return [self.weight]

    @property
    def nbytes(self) -> int:
        bias_bytes = 0 if self.bias is None else self.bias.numel() * self.bias.element_size()
        return self.weight_bytes + bias_bytes
