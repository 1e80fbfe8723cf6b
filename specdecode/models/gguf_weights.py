"""A GGUF file's tensors under transformers' names, matrices kept in their quantized blocks.

The `gguf` package reads the file; each matrix becomes a `QuantTensor` holding the file's
own bytes (types the kernel has no product for, such as Q5_1, are dequantized by the
package and quantized again to Q8_0, with a note), and vectors (norms, biases) become
float tensors. llama.cpp's converter permutes the rows of a Llama model's q and k
projections for its rope; those rows are put back in transformers' order, which moves
whole rows of blocks and changes no value.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import NamedTuple

import numpy as np
import torch
from gguf import GGMLQuantizationType, GGUFReader, quants

from specdecode.errors import ModelError
from specdecode.models.config import ModelConfig
from specdecode.models.quant import KERNEL_TYPES, QuantTensor

log = logging.getLogger("specdecode")

FLOAT_TYPES = (GGMLQuantizationType.F32, GGMLQuantizationType.F16, GGMLQuantizationType.BF16)
PERMUTED_ARCHS = ("llama",)  # whose q and k rows llama.cpp's converter permutes

_LAYER = {  # GGUF's names in block i -> transformers'
    "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj", "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj", "attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm",
}
_GLOBAL = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}


def hf_name(gguf_name: str) -> str | None:
    """transformers' name for a GGUF tensor name, or None for one the model does not use."""
    stem, _, kind = gguf_name.rpartition(".")
    if stem.startswith("blk."):
        _, index, part = stem.split(".", 2)
        return f"model.layers.{index}.{_LAYER[part]}.{kind}" if part in _LAYER else None
    return f"{_GLOBAL[stem]}.{kind}" if stem in _GLOBAL else None


def unpermute_rows(rows: int, heads: int) -> torch.Tensor:
    """The order that takes llama.cpp's rope-permuted rows back to transformers' order."""
    permuted = torch.arange(rows).view(heads, 2, rows // heads // 2).transpose(1, 2).reshape(rows)
    return torch.argsort(permuted)


class GGUFWeights(NamedTuple):
    """What `read_gguf` found: the tensors by transformers' name; the offset in the file of
    each matrix whose blocks are the file's bytes unchanged (neither requantized nor put
    back in order); the types that had no kernel here and were requantized."""

    tensors: dict[str, torch.Tensor | QuantTensor]
    offsets: dict[str, int]
    requantized: tuple[str, ...]


def load_gguf_weights(path: str | Path, config: ModelConfig) -> dict[str, torch.Tensor | QuantTensor]:
    """Every tensor the model reads, by transformers' name: matrices as QuantTensor, vectors as float32."""
    return read_gguf(path, config).tensors


def requantized_note(path: str | Path, types: tuple[str, ...]) -> None:
    """The one-line warning that a file's matrices of these types run as Q8_0."""
    if types:
        log.warning("%s: %s matrices have no kernel here; they run as Q8_0", Path(path).name, ", ".join(types))


def read_gguf(path: str | Path, config: ModelConfig) -> GGUFWeights:
    """load_gguf_weights, with where each matrix lies in the file (GGUFWeights)."""
    try:
        reader = GGUFReader(str(path))
    except (ValueError, OSError) as err:
        raise ModelError(f"cannot read {path} as GGUF: {err}") from None
    arch_field = reader.get_field("general.architecture")
    arch = bytes(arch_field.parts[arch_field.data[0]]).decode() if arch_field is not None else ""
    weights: dict[str, torch.Tensor | QuantTensor] = {}
    offsets: dict[str, int] = {}
    requantized: set[str] = set()
    for tensor in reader.tensors:
        name = hf_name(tensor.name)
        if name is None:
            continue
        rows = int(tensor.shape[-1]) if len(tensor.shape) > 1 else 1
        if len(tensor.shape) == 1:
            weights[name] = torch.from_numpy(np.array(tensor.data, dtype=np.float32)).reshape(-1)
            continue
        if tensor.tensor_type in KERNEL_TYPES:
            matrix = QuantTensor.from_blocks(tensor.tensor_type, tensor.data, rows)
            offsets[name] = int(tensor.data_offset)
        else:
            values = tensor.data if tensor.tensor_type in FLOAT_TYPES else quants.dequantize(tensor.data, tensor.tensor_type)
            matrix = QuantTensor.quantize(torch.from_numpy(np.asarray(values, dtype=np.float32)).reshape(rows, -1),
                                          GGMLQuantizationType.Q8_0)
            requantized.add(tensor.tensor_type.name)
        weights[name] = matrix
    requantized_note(path, tuple(sorted(requantized)))
    if arch in PERMUTED_ARCHS:
        for i in range(config.num_layers):
            for proj, heads in (("q_proj", config.num_heads), ("k_proj", config.num_kv_heads)):
                name = f"model.layers.{i}.self_attn.{proj}.weight"
                matrix = weights[name]
                weights[name] = QuantTensor(matrix.qtype, matrix.data[unpermute_rows(matrix.shape[0], heads)].contiguous())
                offsets.pop(name, None)
    return GGUFWeights(weights, offsets, tuple(sorted(requantized)))
