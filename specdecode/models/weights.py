"""Read a transformers folder's tensors in the dtype a run asks for.

In the conversion cache's own folders (they have a manifest) each dtype has its own file,
converted from the verified GGUF on first use: `model.bf16.safetensors` for bf16,
`model.safetensors` (float32) for fp32 (see `store.ensure_weights`). A cached file that
safetensors cannot read is rebuilt once, with a one-line warning, before giving up with
a `ModelError` that names the fix. Other folders are read as they are (sharded or not)
and cast in memory; nothing is written into them.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open

from specdecode.errors import ModelError
from specdecode.models.store import WEIGHT_FILES, ensure_weights, read_manifest

BF16_FILE = WEIGHT_FILES["bf16"]


def _read(folder: Path, files: list[str]) -> dict[str, torch.Tensor]:
    weights: dict[str, torch.Tensor] = {}
    for name in files:
        with safe_open(folder / name, framework="pt") as f:
            for key in f.keys():
                weights[key] = f.get_tensor(key)
    return weights


def _cast(weights: dict[str, torch.Tensor], dtype: torch.dtype) -> dict[str, torch.Tensor]:
    return {k: v.to(dtype) if v.is_floating_point() and v.dtype != dtype else v for k, v in weights.items()}


def load_weights(folder: str | Path, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    folder = Path(folder)
    if read_manifest(folder) is not None:
        return _load_cached(folder, dtype)
    if dtype == torch.bfloat16 and (folder / BF16_FILE).exists():
        return _read(folder, [BF16_FILE])
    index = folder / "model.safetensors.index.json"
    files = sorted(set(json.loads(index.read_text())["weight_map"].values())) if index.exists() else ["model.safetensors"]
    weights = _read(folder, files)
    return _cast(weights, dtype) if dtype == torch.bfloat16 else weights


def _load_cached(folder: Path, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    name = "bf16" if dtype == torch.bfloat16 else "fp32"  # other dtypes cast the exact fp32 values
    damaged = None
    for attempt in range(2):
        path = ensure_weights(folder, name, damaged=damaged)
        try:
            weights = _read(folder, [path.name])
        except (SafetensorError, OSError) as err:
            if attempt:
                raise ModelError(f"{path} could not be read even after rebuilding it ({err}); "
                                 f"delete {folder} and load the model again") from None
            damaged = str(err).splitlines()[0] if str(err) else type(err).__name__
            continue
        return _cast(weights, dtype) if name == "fp32" and dtype != torch.float32 else weights
    raise AssertionError("unreachable")
