"""Medusa heads in the format vLLM's Medusa loader reads, and back.

vLLM's head i computes x + silu(W_i x + b_i) from the target's final (normed) hidden state
and reads it through an LM head over `truncated_vocab_size` rows whose token ids are
`token_map`: exactly what a head here computes (model.py), with `original_lm_head` (one LM
head shared by every head, the target's rows for the draft vocabulary).

Files: `config.json` (model_type medusa) and `model.safetensors` with
`blocks.{i}.layers.0.weight|bias`, `lm_head.weight` and, for a draft vocabulary,
`token_map`.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import load_file

from specdecode.errors import SpecDecodeError
from specdecode.heads.artifacts import write_folder
from specdecode.heads.medusa.model import MedusaConfig, MedusaHeads

WEIGHTS = "model.safetensors"
CONFIG = "config.json"


def export(heads: MedusaHeads, config: MedusaConfig, lm_weight: torch.Tensor, out: str | Path) -> Path:
    """Write the heads with the target's LM head rows (`lm_weight`, the whole head) for
    their draft vocabulary; files land by rename."""
    vocab_size = lm_weight.shape[0]
    ids = heads.draft_vocab.long() if heads.draft_vocab is not None else torch.arange(vocab_size)
    tensors = {"lm_head.weight": lm_weight[ids].to(torch.bfloat16).contiguous()}
    for i in range(heads.num_heads):
        tensors[f"blocks.{i}.layers.0.weight"] = heads.weight[i].detach().to(torch.bfloat16).contiguous()
        tensors[f"blocks.{i}.layers.0.bias"] = heads.bias[i].detach().to(torch.bfloat16).contiguous()
    if ids.numel() != vocab_size:
        tensors["token_map"] = ids.contiguous()
    record = {"model_type": "medusa", "architectures": ["MedusaModel"], "hidden_size": config.hidden_size,
              "vocab_size": vocab_size, "truncated_vocab_size": ids.numel(), "num_heads": heads.num_heads,
              "num_hidden_layers": 1, "medusa_fc_bias": True, "original_lm_head": True}
    return write_folder(out, WEIGHTS, tensors, CONFIG, record, indent=2)


def read(folder: str | Path, target_lm_weight: torch.Tensor) -> MedusaHeads:
    """Heads in vLLM's format as heads here, where they compute what heads here do: one
    residual layer each, and the target's own LM head (shared, or per head but equal to
    the target's rows)."""
    folder = Path(folder)
    if not (folder / CONFIG).is_file() or not (folder / WEIGHTS).is_file():
        raise SpecDecodeError(f"no {CONFIG} and {WEIGHTS} in {folder}: not a vLLM Medusa folder")
    record = json.loads((folder / CONFIG).read_text())
    tensors = load_file(folder / WEIGHTS)
    if record.get("model_type") != "medusa":
        raise SpecDecodeError(f"{folder} holds a {record.get('model_type')!r} model, not Medusa heads")
    if record.get("num_hidden_layers", 1) != 1:
        raise SpecDecodeError(f"these heads have {record['num_hidden_layers']} residual layers each; heads here have one")
    count, hidden = record["num_heads"], record["hidden_size"]
    ids = tensors["token_map"].long() if "token_map" in tensors else torch.arange(record["vocab_size"])
    lm_names = ["lm_head.weight"] if "lm_head.weight" in tensors else [f"lm_heads.{i}.weight" for i in range(count)]
    for name in lm_names:
        rows = tensors[name].float()
        rows = rows[ids] if rows.shape[0] > ids.numel() else rows
        if not torch.allclose(rows, target_lm_weight[ids].float(), atol=1e-2, rtol=1e-2):
            raise SpecDecodeError(f"{folder}: {name} is not the target's LM head; heads here read through the "
                                  "target's, so these would draft differently")
    heads = MedusaHeads(count, hidden)
    with torch.no_grad():
        for i in range(count):
            heads.weight[i].copy_(tensors[f"blocks.{i}.layers.0.weight"])
            bias = tensors.get(f"blocks.{i}.layers.0.bias")
            heads.bias[i].copy_(bias if bias is not None else torch.zeros(hidden))
    heads.draft_vocab = None if ids.numel() == record["vocab_size"] else ids
    return heads.eval().requires_grad_(False)
