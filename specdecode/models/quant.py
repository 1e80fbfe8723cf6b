"""Weights kept in GGUF's quantized blocks, and the layers that run them as stored.

A `QuantTensor` is a matrix in one of the block types the kernel multiplies
(quant_linear.cpp): the K-quants Q4_K and Q6_K that llama.cpp's Q4_K_M files use, and
Q8_0, Q4_0, Q4_1 and Q5_0 (the types of llama.cpp's small draft models). Its bytes are GGUF's own, one row of blocks per output, so a GGUF file's
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
from specdecode.models.huge_pages import on_huge_pages

# The block types the kernel runs (it tells them apart by bytes per block).
KERNEL_TYPES = tuple(GGMLQuantizationType[name] for name in ("Q4_K", "Q6_K", "Q8_0", "Q4_0", "Q4_1", "Q5_0"))
# What a float matrix may be quantized to here (the `gguf` package quantizes these).
Q8_0, Q4_0 = GGMLQuantizationType.Q8_0, GGMLQuantizationType.Q4_0
QUANTIZABLE = {"q8_0": Q8_0, "q4_0": Q4_0}


@dataclass
class QuantTensor:
    """A (rows, cols) matrix as GGUF blocks: `data` is uint8 (rows, blocks per row, bytes per block).
    `layout`: the bytes the kernel reads (kernel_layout), where made ahead (prepared.py)."""

    qtype: GGMLQuantizationType
    data: torch.Tensor
    layout: torch.Tensor | None = None

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


def stacked_layouts(parts: list[QuantTensor]) -> list[tuple[GGMLQuantizationType, torch.Tensor]]:
    """The kernel's bytes of matrices stacked along their rows, neighbours of one type merged
    (fewer, longer calls). Layouts made ahead are stacked as they are where every part is
    repacked (a repacked matrix's groups of eight rows are its rows' in order); otherwise
    the merged blocks are laid out anew."""
    runs: list[list[QuantTensor]] = []
    for part in parts:
        if runs and runs[-1][0].qtype == part.qtype:
            runs[-1].append(part)
        else:
            runs.append([part])
    layouts = []
    for run in runs:
        qtype = run[0].qtype
        if len(run) == 1:
            layouts.append((qtype, kernel_layout(run[0])))
        elif all(p.layout is not None and p.layout.shape[-1] == X8_BYTES.get(qtype) for p in run):
            layouts.append((qtype, torch.cat([p.layout for p in run])))
        else:
            layouts.append((qtype, kernel_layout(QuantTensor(qtype, torch.cat([p.data for p in run])))))
    return layouts


X8_ROWS = 8  # rows a repacked block interleaves
X8_BYTES = {GGMLQuantizationType.Q4_K: 1216,  # d and dmin (fp32), scales and mins (a byte each), 1024 of nibbles
            GGMLQuantizationType.Q6_K: 1696,  # d (fp32), scales (a byte each), per group 128 of nibbles, 64 of top bits
            GGMLQuantizationType.Q8_0: 272,  # d (fp16), 256 values (a byte each)
            GGMLQuantizationType.Q5_0: 176}  # d (fp16), 128 of nibbles, 32 of fifth bits


def _rows_last(a: np.ndarray, groups: int) -> np.ndarray:
    """(rows, blocks, ...) -> (groups, blocks, ..., 8 rows)."""
    return np.moveaxis(a.reshape(groups, X8_ROWS, *a.shape[1:]), 1, -1)


def _interleave_nibbles(values: np.ndarray) -> np.ndarray:
    """Values (rows, blocks, G groups, 32) below 16 -> (rows / 8, blocks, 128 G): per group g
    and j < 4, byte 4r + i holds row r's value 8j + i (low nibble) and 8j + 4 + i (high)."""
    rows, blocks, groups_of_32 = values.shape[:3]
    v = values.reshape(rows // X8_ROWS, X8_ROWS, blocks, groups_of_32, 4, 2, 4)  # value 8j + 4h + i of group g
    packed = (v[..., 0, :] | (v[..., 1, :] << 4)).transpose(0, 2, 3, 4, 1, 5)  # (groups, blocks, g, j, r, i)
    return packed.reshape(rows // X8_ROWS, blocks, 128 * groups_of_32)


def repack_q4_k_x8(data: torch.Tensor) -> torch.Tensor:
    """Q4_K blocks (rows, blocks, 144) -> eight rows interleaved per block (rows / 8, blocks,
    1216), as quant_linear.cpp's Q4KX8 reads them: the rows' d, dmin (fp32), 6-bit
    scales [group][row] and mins [pair of groups][row][2] decoded to bytes, then the values'
    nibbles (_interleave_nibbles). The values and scales are the file's, unchanged."""
    raw = data.numpy()
    rows, blocks, _ = raw.shape
    groups = rows // X8_ROWS
    d = raw[..., 0:2].copy().view(np.float16)[..., 0].astype(np.float32)
    dmin = raw[..., 2:4].copy().view(np.float16)[..., 0].astype(np.float32)
    s = raw[..., 4:16]
    scales, mins = np.empty((rows, blocks, 8), np.uint8), np.empty((rows, blocks, 8), np.uint8)
    scales[..., :4], mins[..., :4] = s[..., 0:4] & 63, s[..., 4:8] & 63
    scales[..., 4:] = (s[..., 8:12] & 0xF) | ((s[..., 0:4] >> 6) << 4)
    mins[..., 4:] = (s[..., 8:12] >> 4) | ((s[..., 4:8] >> 6) << 4)
    nibbles = raw[..., 16:144].reshape(rows, blocks, 4, 32)
    values = np.empty((rows, blocks, 8, 32), np.uint8)  # [group][value in group]
    values[:, :, 0::2], values[:, :, 1::2] = nibbles & 0xF, nibbles >> 4
    parts = [np.ascontiguousarray(_rows_last(d, groups)).view(np.uint8),
             np.ascontiguousarray(_rows_last(dmin, groups)).view(np.uint8),
             _rows_last(scales, groups).reshape(groups, blocks, 64),
             np.moveaxis(_rows_last(mins.reshape(rows, blocks, 4, 2), groups), -1, -2).reshape(groups, blocks, 64),
             _interleave_nibbles(values)]
    return torch.from_numpy(np.concatenate(parts, axis=-1))


def repack_q6_k_x8(data: torch.Tensor) -> torch.Tensor:
    """Q6_K blocks (rows, blocks, 210) -> eight rows interleaved per block (rows / 8, blocks,
    1696), as quant_linear.cpp's Q6KX8 reads them: the rows' d (fp32), int8 scales [pair of groups of
    16][row][2], then for each group g of 32 values its 192 bytes: the low four bits of its
    values (128, _interleave_nibbles' group g), then for each half h, 32 bytes whose byte
    4r + i holds the top two bits of row r's values 32g + 16h + 4k + i at bits 2k, 2k + 1.
    A group's bytes lie together so that a pass reads each block front to back. The values
    and scales are the file's, unchanged."""
    raw = data.numpy()
    rows, blocks, _ = raw.shape
    groups = rows // X8_ROWS
    ql, qh = raw[..., 0:128].reshape(rows, blocks, 2, 64), raw[..., 128:192].reshape(rows, blocks, 2, 32)
    scales = raw[..., 192:208]
    d = raw[..., 208:210].copy().view(np.float16)[..., 0].astype(np.float32)
    values = np.empty((rows, blocks, 2, 4, 32), np.uint8)  # per half of 128: four runs of 32 (Q6_K's layout)
    values[..., 0, :] = (ql[..., :32] & 0xF) | ((qh & 3) << 4)
    values[..., 1, :] = (ql[..., 32:] & 0xF) | (((qh >> 2) & 3) << 4)
    values[..., 2, :] = (ql[..., :32] >> 4) | (((qh >> 4) & 3) << 4)
    values[..., 3, :] = (ql[..., 32:] >> 4) | (((qh >> 6) & 3) << 4)
    values = values.reshape(rows, blocks, 8, 32)
    top = (values >> 4).reshape(groups, X8_ROWS, blocks, 8, 2, 4, 4)  # value 16h + 4k + i of group g
    top = top[..., 0, :] | (top[..., 1, :] << 2) | (top[..., 2, :] << 4) | (top[..., 3, :] << 6)
    top = top.transpose(0, 2, 3, 4, 1, 5).reshape(groups, blocks, 8, 64)  # (groups, blocks, g, h, r, i)
    low = _interleave_nibbles(values & 0xF).reshape(groups, blocks, 8, 128)
    by_group = np.concatenate([low, top], axis=-1).reshape(groups, blocks, 8 * 192)
    paired = np.moveaxis(_rows_last(scales.reshape(rows, blocks, 8, 2), groups), -1, -2)  # [pair][row][2]
    parts = [np.ascontiguousarray(_rows_last(d, groups)).view(np.uint8), paired.reshape(groups, blocks, 128),
             by_group]
    return torch.from_numpy(np.concatenate(parts, axis=-1))


def _fp16_scales(raw: np.ndarray, groups: int) -> np.ndarray:
    """The fp16 d at the start of each 32-value block (rows, blocks, ...) -> (rows / 8, blocks, 16)."""
    d = raw[..., 0:2].copy().view(np.float16)[..., 0]
    return np.ascontiguousarray(_rows_last(d, groups)).view(np.uint8)


def _values_by_fours(values: np.ndarray, groups: int) -> np.ndarray:
    """Bytes (rows, blocks, 32) -> (rows / 8, blocks, 256): for t < 8, 32 bytes whose byte
    4r + i is row r's value 4t + i."""
    blocks = values.shape[1]
    v = values.reshape(groups, X8_ROWS, blocks, 8, 4).transpose(0, 2, 3, 1, 4)  # (groups, blocks, t, r, i)
    return v.reshape(groups, blocks, 256)


def repack_q8_0_x8(data: torch.Tensor) -> torch.Tensor:
    """Q8_0 blocks (rows, blocks, 34) -> eight rows interleaved per block (rows / 8, blocks,
    272), as quant_linear.cpp's Q80X8 reads them: the rows' d (fp16), then the values by
    fours (_values_by_fours), each plus 128 (an unsigned byte). The file's values and scales."""
    raw = data.numpy()
    groups = raw.shape[0] // X8_ROWS
    unsigned = raw[..., 2:34] ^ np.uint8(0x80)
    return torch.from_numpy(np.concatenate([_fp16_scales(raw, groups), _values_by_fours(unsigned, groups)], axis=-1))


def repack_q5_0_x8(data: torch.Tensor) -> torch.Tensor:
    """Q5_0 blocks (rows, blocks, 22) -> eight rows interleaved per block (rows / 8, blocks,
    176), as quant_linear.cpp's Q50X8 reads them: the rows' d (fp16), the low four bits of
    the values (_interleave_nibbles, one group), then 32 bytes whose byte 4r + i holds the
    fifth bit of row r's value 4k + i at bit k. The file's values and scales, unchanged."""
    raw = data.numpy()
    rows, blocks, _ = raw.shape
    groups = rows // X8_ROWS
    fifth = np.unpackbits(raw[..., 2:6], axis=-1, bitorder="little")  # (rows, blocks, 32): bit j of the uint32
    qs = raw[..., 6:22]
    low = np.concatenate([qs & 0xF, qs >> 4], axis=-1)  # values 0-15 then 16-31
    by_k = fifth.reshape(groups, X8_ROWS, blocks, 8, 4).astype(np.uint8)  # value 4k + i
    top = (by_k << np.arange(8, dtype=np.uint8)[:, None]).sum(axis=3, dtype=np.uint8)  # (groups, r, blocks, i)
    parts = [_fp16_scales(raw, groups), _interleave_nibbles(low[:, :, None, :]),
             top.transpose(0, 2, 1, 3).reshape(groups, blocks, 32)]
    return torch.from_numpy(np.concatenate(parts, axis=-1))


REPACK = {GGMLQuantizationType.Q4_K: repack_q4_k_x8, GGMLQuantizationType.Q6_K: repack_q6_k_x8,
          GGMLQuantizationType.Q8_0: repack_q8_0_x8, GGMLQuantizationType.Q5_0: repack_q5_0_x8}


def kernel_layout(part: QuantTensor) -> torch.Tensor:
    """The bytes the kernel reads for a part: Q4_K, Q6_K, Q8_0 and Q5_0 repacked eight rows
    at a time where the rows allow (their products are then faster), other types as stored."""
    if part.layout is not None:
        return part.layout
    if part.qtype in REPACK and part.shape[0] % X8_ROWS == 0:
        return REPACK[part.qtype](part.data)
    return part.data


class QuantLinear:
    """y = x @ W.T + bias for W stacked from quantized parts; x (..., in_features) bf16 or fp32."""

    backend = "quant"

    def __init__(self, parts: list[QuantTensor], bias: torch.Tensor | None = None):
        if kernels.kernel() is None:
            raise SpecDecodeError("quantized weights run on the project's kernels, which are not available here "
                                  f"(see {kernels.KERNEL_ENV}); use --dtype bf16")
        unsupported = sorted({p.qtype.name for p in parts if p.qtype not in KERNEL_TYPES})
        if unsupported:
            raise SpecDecodeError(f"no kernel for {', '.join(unsupported)} blocks")
        widths = {p.shape[1] for p in parts}
        if len(widths) != 1:
            raise SpecDecodeError(f"stacked parts differ in width: {sorted(widths)}")
        layouts = stacked_layouts(parts)
        self.types = [qtype.name for qtype, _ in layouts]
        self.in_features = widths.pop()
        self.out_features = sum(p.shape[0] for p in parts)
        self.bias = bias
        # on 2 MB pages: a step streams every matrix front to back (huge_pages.py)
        self._data = [on_huge_pages(layout) for _, layout in layouts]
        self.weight_bytes = sum(d.numel() for d in self._data)

    @property
    def kernel_parts(self) -> list[torch.Tensor]:
        """The parts as quant_linear.cpp (and decoder_layer.cpp) take them."""
        return self._data

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
