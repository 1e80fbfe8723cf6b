"""Read a transformers folder's tensors, keeping a bf16 copy beside fp32 weights.

The conversion cache stores fp32 (exact de-quantized GGUF values). Most runs want bf16,
and reading 7 GB of fp32 and rounding it costs several seconds for the 1.5B model, so the
first bf16 load writes `model.bf16.safetensors` next to the original (atomically: a
temporary name, then a rename) when the folder is the cache's own, and later bf16 loads
read that half-size file instead.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from specdecode.models.store import MANIFEST  # marks a folder the conversion cache wrote

BF16_FILE = "model.bf16.safetensors"


def _read(folder: Path, files: list[str]) -> dict[str, torch.Tensor]:
    weights: dict[str, torch.Tensor] = {}
    for name in files:
        with safe_open(folder / name, framework="pt") as f:
            for key in f.keys():
                weights[key] = f.get_tensor(key)
    return weights


def load_weights(folder: str | Path, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    folder = Path(folder)
    if dtype == torch.bfloat16 and (folder / BF16_FILE).exists():
        return _read(folder, [BF16_FILE])
    index = folder / "model.safetensors.index.json"
    files = sorted(set(json.loads(index.read_text())["weight_map"].values())) if index.exists() else ["model.safetensors"]
    weights = _read(folder, files)
    if dtype == torch.bfloat16 and (folder / MANIFEST).exists():
        weights = {k: v.to(dtype) if v.is_floating_point() else v for k, v in weights.items()}
        _save_atomically(weights, folder / BF16_FILE)
    return weights


def _save_atomically(weights: dict[str, torch.Tensor], path: Path) -> None:
    partial = path.with_name(f".{path.name}.{os.getpid()}.partial")
    try:
        save_file({k: v.contiguous() for k, v in weights.items()}, str(partial), metadata={"format": "pt"})
        os.replace(partial, path)
    except OSError:
        pass  # a read-only cache only costs speed
    finally:
        partial.unlink(missing_ok=True)
