"""Weights kept in GGUF's quantized blocks, and the layers that run them as stored.

A `QuantTensor` is a matrix in one of the block types the kernel multiplies
(quant_linear.cpp): the K-quants Q4_K and Q6_K that llama.cpp's Q4_K_M files use, and
Q8_0, Q4_0, Q4_1. Its bytes are GGUF's own, one row of blocks per output, so a GGUF file's
tensors are used without conversion, and a bf16 or fp32 matrix is quantized to Q8_0 or
Q4_0 by the `gguf` package (which also dequantizes, for embeddings and for the tests'
reference).

`QuantLinear` multiplies through the kernel: activations are quantized per row and summed
in integers per block, so each row's output is bitwise independent of how many rows share
the call, as verification needs. `QuantEmbedding` dequantizes only the rows looked up.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, quants

from specdecode.errors import SpecDecodeError
from specdecode.models import kernels

# The block types the kernel runs (it tells them apart by bytes per block).
KERNEL_TYPES = tuple(GGMLQuantizationType[name] for name in ("Q4_K", "Q6_K", "Q8_0", "Q4_0", "Q4_1"))
# What a float matrix may be quantized to here (the `gguf` package quantizes these).
Q8_0, Q4_0 = GGMLQuantizationType.Q8_0, GGMLQuantizationType.Q4_0
QUANTIZABLE = {"q8_0": Q8_0, "q4_0": Q4_0}


@dataclass
class QuantTensor:
    """A (rows, cols) matrix as GGUF blocks: `data` is uint8 (rows, blocks per row, bytes per block)."""

    qtype: GGMLQuantizationType
    data: torch.Tensor

    @property
    def shape(self) -> tuple[int, int]:
        values, _ = GGML_QUANT_SIZES[self.qtype]
        return self.data.shape[0], self.data.shape[1] * values

    @property
    def nbytes(self) -> int:
        return self.data.numel()

    @classmethod
    def from_blocks(cls, qtype: GGMLQuantizationType, raw: np.ndarray, rows: int) -> "QuantTensor":
        """GGUF's bytes of a matrix with `rows` rows (a reader's `data`, any shape), copied."""
        _, size = GGML_QUANT_SIZES[qtype]
        data = torch.from_numpy(np.ascontiguousarray(raw, dtype=np.uint8).reshape(rows, -1, size).copy())
        return cls(qtype, data)

    @classmethod
    def quantize(cls, weight: torch.Tensor, qtype: GGMLQuantizationType) -> "QuantTensor":
        """A float matrix quantized to `qtype` (as llama.cpp's reference quantizer does)."""
        values, _ = GGML_QUANT_SIZES[qtype]
        if weight.dim() != 2 or weight.shape[1] % values:
            raise SpecDecodeError(f"{qtype.name} needs rows of a multiple of {values} values, got {tuple(weight.shape)}")
        raw = quants.quantize(weight.float().numpy(), qtype)
        return cls.from_blocks(qtype, raw, weight.shape[0])

    def dequantize(self, rows: torch.Tensor | slice | None = None) -> torch.Tensor:
        """The exact float32 values of all rows or of the rows asked for."""
        data = self.data if rows is None else self.data[rows]
        flat = data.reshape(-1, data.shape[-2] * data.shape[-1]).numpy()
        return torch.from_numpy(quants.dequantize(flat, self.qtype)).view(*data.shape[:-2], self.shape[1])


def quantize_matrices(weights: dict[str, torch.Tensor], qtype: GGMLQuantizationType) -> dict:
    """Every matrix of a float model's weights quantized to `qtype`; vectors stay float."""
    out = {}
    for name, tensor in weights.items():
        out[name] = QuantTensor.quantize(tensor, qtype) if tensor.dim() == 2 else tensor
    return out


def stack(parts: list[QuantTensor]) -> list[QuantTensor]:
    """Matrices stacked along their rows, neighbours of one type merged (fewer, longer calls)."""
    merged: list[QuantTensor] = []
    for part in parts:
        if merged and merged[-1].qtype == part.qtype:
            merged[-1] = QuantTensor(part.qtype, torch.cat([merged[-1].data, part.data]))
        else:
            merged.append(part)
    return merged


class QuantLinear:
    """y = x @ W.T + bias for W stacked from quantized parts; x (..., in_features) bf16 or fp32."""

    backend = "quant"

    def __init__(self, parts: list[QuantTensor], bias: torch.Tensor | None = None):
        if kernels.kernel() is None:
            raise SpecDecodeError("quantized weights run on the project's AVX2 kernel, which is not available here "
                                  f"(see {kernels.KERNEL_ENV}); use --dtype bf16")
        unsupported = sorted({p.qtype.name for p in parts if p.qtype not in KERNEL_TYPES})
        if unsupported:
            raise SpecDecodeError(f"no kernel for {', '.join(unsupported)} blocks")
        widths = {p.shape[1] for p in parts}
        if len(widths) != 1:
            raise SpecDecodeError(f"stacked parts differ in width: {sorted(widths)}")
        self.parts = stack(parts)
        self.in_features = widths.pop()
        self.out_features = sum(p.shape[0] for p in self.parts)
        self.bias = bias
        self.weight_bytes = sum(p.nbytes for p in self.parts)
        self._data = [p.data for p in self.parts]

    @property
    def types(self) -> list[str]:
        return [p.qtype.name for p in self.parts]

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        lead = x.shape[:-1]
        y = kernels.kernel().quant_linear(x.reshape(-1, self.in_features), self._data, self.bias, self.out_features)
        return y.view(*lead, self.out_features)

    @property
    def nbytes(self) -> int:
        bias_bytes = 0 if self.bias is None else self.bias.numel() * self.bias.element_size()
        return self.weight_bytes + bias_bytes


class QuantEmbedding:
    """An embedding table kept quantized: indexing dequantizes just the rows asked for."""

    def __init__(self, table: QuantTensor, dtype: torch.dtype):
        self.table, self.dtype = table, dtype

    @property
    def shape(self) -> tuple[int, int]:
        return self.table.shape

    def __getitem__(self, tokens: torch.Tensor) -> torch.Tensor:
        tokens = torch.as_tensor(tokens)
        return self.table.dequantize(tokens.reshape(-1)).to(self.dtype).view(*tokens.shape, self.shape[1])

    def numel(self) -> int:
        return self.table.nbytes

    def element_size(self) -> int:
        return 1
