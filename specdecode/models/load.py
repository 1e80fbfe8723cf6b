"""Load a model and its tokenizer from a registry name, a transformers folder or a .gguf file.

`load()` returns (model, tokenizer) as mlx-lm does. The model is the native Llama-family
forward when the architecture allows, else the transformers adapter. bf16 is the default
on CPU: decoding streams weights, bf16 halves the bytes, and with packed weights it
streams at the same rate as fp32 (measured in `linear.py`), so a step costs about half.
Quantized weights (`gguf`, `q8_0`, `q4_0`; quant.py) run on the native backend only.
"""

from __future__ import annotations

import functools
import json
from dataclasses import dataclass
from pathlib import Path

import torch

from specdecode.errors import SpecDecodeError
from specdecode.models.config import UnsupportedModel
from specdecode.models.hf_adapter import HFModel
from specdecode.models.native import NativeModel
from specdecode.models.quant import QUANTIZABLE
from specdecode.models.store import resolve

DTYPES = {"bf16": torch.bfloat16, "bfloat16": torch.bfloat16, "fp32": torch.float32, "float32": torch.float32}
# Quantized weights, bf16 activations: "gguf" runs a GGUF file's own blocks, "q8_0" and
# "q4_0" quantize a float model's matrices (quant.py).
QUANT_DTYPES = ("gguf", *QUANTIZABLE)
DEFAULT_DTYPE = "bf16"
BACKENDS = ("auto", "native", "hf")


def parse_dtype(dtype: str | torch.dtype | None) -> torch.dtype:
    """The dtype of activations (and of float weights) a dtype name runs in."""
    if isinstance(dtype, torch.dtype):
        return dtype
    key = (dtype or DEFAULT_DTYPE).lower()
    if key in QUANT_DTYPES:
        return torch.bfloat16
    if key not in DTYPES:
        raise SpecDecodeError(f"unknown dtype {dtype!r}; choose one of bf16, fp32, {', '.join(QUANT_DTYPES)}")
    return DTYPES[key]


def quant_format(dtype: str | torch.dtype | None) -> str | None:
    """"gguf", "q8_0", "q4_0" for quantized weights, None for float ones."""
    key = dtype.lower() if isinstance(dtype, str) else None
    return key if key in QUANT_DTYPES else None


@dataclass(frozen=True)
class ModelInfo:
    """Where a loaded model came from, for reports and benchmark metadata."""

    source: str
    folder: Path
    sha256: str | None
    eos_token_ids: tuple[int, ...]


@dataclass(frozen=True)
class LoadedModel:
    """A loaded model with its tokenizer and where it came from."""

    model: object
    tokenizer: object
    info: ModelInfo


def load_model(source: str, dtype: str | None = None, backend: str = "auto", as_draft: bool = False) -> LoadedModel:
    """`load`, the weights kept for the life of the process. The source is resolved on every
    call (cheap once cached), so a model removed from the cache is fetched again. as_draft:
    a model that will only draft; quantized, its LM head is read at five bits where the
    file stores it wider (draft_head.py), a separate copy from the same model loaded plainly."""
    if backend not in BACKENDS:
        raise SpecDecodeError(f"unknown backend {backend!r}; choose one of {', '.join(BACKENDS)}")
    torch_dtype, quant = parse_dtype(dtype), quant_format(dtype)
    return _loaded(source, _folder(source, torch_dtype, quant, progress=True), torch_dtype, quant, backend,
                   as_draft and quant is not None)


def load(source: str, dtype: str | torch.dtype | None = None, backend: str = "auto", progress: bool = True):
    """Returns (model, tokenizer, info). The model is pulled and converted on first use."""
    if backend not in BACKENDS:
        raise SpecDecodeError(f"unknown backend {backend!r}; choose one of {', '.join(BACKENDS)}")
    torch_dtype, quant = parse_dtype(dtype), quant_format(dtype)
    loaded = _load_folder(source, _folder(source, torch_dtype, quant, progress), torch_dtype, quant, backend)
    return loaded.model, loaded.tokenizer, loaded.info


def _folder(source: str, dtype: torch.dtype, quant: str | None, progress: bool) -> Path:
    # only the weights this dtype reads are converted (and, for the HF backend, linked where
    # transformers looks); see store.ensure_weights. A GGUF's own blocks need none.
    weights = None if quant == "gguf" else "bf16" if dtype == torch.bfloat16 else "fp32"
    return resolve(source, progress=progress, dtype=weights)


def _load_folder(source: str, folder: Path, dtype: torch.dtype, quant: str | None, backend: str,
                 as_draft: bool = False) -> LoadedModel:
    from transformers import AutoTokenizer

    if quant is not None and backend == "hf":
        raise SpecDecodeError(f"--dtype {quant} runs on the native backend only")
    model = NativeModel.from_folder(folder, dtype, quant, as_draft) if quant else _load_model(folder, dtype, backend)
    tokenizer = AutoTokenizer.from_pretrained(str(folder))
    return LoadedModel(model, tokenizer,
                       ModelInfo(source, folder, _manifest(folder).get("sha256"), eos_token_ids(folder, tokenizer)))


_loaded = functools.lru_cache(maxsize=4)(_load_folder)


def _load_model(folder: Path, dtype: torch.dtype, backend: str):
    if backend == "hf":
        return HFModel.from_folder(folder, dtype)
    try:
        return NativeModel.from_folder(folder, dtype)
    except UnsupportedModel as e:
        if backend == "native":
            raise SpecDecodeError(f"the native backend cannot run {folder}: {e}") from e
        return HFModel.from_folder(folder, dtype)


def _manifest(folder: Path) -> dict:
    path = folder / "specdecode.json"
    return json.loads(path.read_text()) if path.exists() else {}


def eos_token_ids(folder: Path, tokenizer) -> tuple[int, ...]:
    """Every id that ends a turn: the manifest's, the configs' and the tokenizer's."""
    ids: set[int] = set(_manifest(folder).get("eos_token_ids") or [])
    for name in ("config.json", "generation_config.json"):
        path = folder / name
        if path.exists():
            eos = json.loads(path.read_text()).get("eos_token_id")
            ids.update(eos if isinstance(eos, list) else [] if eos is None else [eos])
    if tokenizer.eos_token_id is not None:
        ids.add(tokenizer.eos_token_id)
    return tuple(sorted(ids))
