"""Medusa heads (Cai et al. 2024): extra heads on the target's last hidden state.

Head i (i = 0..K-1) reads the final hidden state h_t (after the final norm) and predicts
the token at offset +2+i, i.e. one past what the target's own LM head predicts from h_t:

    feature_i = h_t + silu(W_i h_t + b_i),   logits_i = lm_head(feature_i)

W_i is hidden × hidden and starts at zero, so an untrained head repeats the LM head's
prediction; the LM head is the target's own, so a head costs one hidden × hidden matrix.

The artifact is a folder with `medusa.safetensors` (the heads, bf16) and `medusa.json`:
the target it was trained on (name and SHA-256), held-out accuracy of each head's top
ranks (the probability that its rank-r candidate is the target's token), and the training
record. `default_dir` is where `specdecode train medusa` writes and `--drafter medusa`
looks: beside the target's cached weights; heads shipped with the package are the
fallback for the small model.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors.torch import load_file

from specdecode.heads.draft_vocab import ARTIFACT_KEY
from specdecode.errors import SpecDecodeError
from specdecode.heads.artifacts import FLOAT_WEIGHTS, find_artifact, local_dir, write_folder
from specdecode.models.linear import Linear

WEIGHTS_FILE = "medusa.safetensors"
CONFIG_FILE = "medusa.json"


class MedusaHeads(torch.nn.Module):
    def __init__(self, num_heads: int, hidden_size: int):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.zeros(num_heads, hidden_size, hidden_size))
        self.bias = torch.nn.Parameter(torch.zeros(num_heads, hidden_size))
        self.draft_vocab: torch.Tensor | None = None  # token ids it drafts from (draft_vocab.py); None: all
        self.products: list[Linear] = []  # packed copies for drafting (pack_for_drafting)

    def pack_for_drafting(self) -> "MedusaHeads":
        """Each head's product through the target's packed bf16 kernels (models/linear.py),
        as for EAGLE's head (eagle.py): one-row bf16 F.linear is slower here."""
        self.products = [Linear(self.weight[i].detach().contiguous(), self.bias[i].detach())
                         for i in range(self.num_heads)]
        return self

    @property
    def num_heads(self) -> int:
        return self.weight.shape[0]

    def forward(self, hidden: torch.Tensor, num_heads: int | None = None) -> torch.Tensor:
        """hidden (..., H) -> features (K, ..., H) of the first num_heads heads."""
        def product(i):
            return self.products[i](hidden) if self.products else F.linear(hidden, self.weight[i], self.bias[i])

        return torch.stack([hidden + F.silu(product(i)) for i in range(num_heads or self.num_heads)])


@dataclass
class MedusaConfig:
    target: str
    target_sha256: str | None
    hidden_size: int
    num_heads: int
    accuracy: list[list[float]] = field(default_factory=list)  # [head][rank], held out
    tree: list[list[int]] = field(default_factory=list)  # the candidate paths chosen for this machine
    training: dict = field(default_factory=dict)  # tokens, steps, losses, time


def save(folder: str | Path, heads: MedusaHeads, config: MedusaConfig) -> Path:
    """Write the artifact; a reader never sees a half-written one (files land by rename)."""
    tensors = {"weight": heads.weight.detach().to(torch.bfloat16).contiguous(),
               "bias": heads.bias.detach().to(torch.bfloat16).contiguous()}
    if heads.draft_vocab is not None:
        tensors[ARTIFACT_KEY] = heads.draft_vocab.long().contiguous()
    return write_folder(folder, WEIGHTS_FILE, tensors, CONFIG_FILE, asdict(config))


def load(folder: str | Path, dtype: torch.dtype = torch.float32) -> tuple[MedusaHeads, MedusaConfig]:
    folder = Path(folder)
    if not (folder / CONFIG_FILE).is_file() or not (folder / WEIGHTS_FILE).is_file():
        raise SpecDecodeError(f"no Medusa heads in {folder}; `specdecode train medusa` makes them")
    config = MedusaConfig(**json.loads((folder / CONFIG_FILE).read_text()))
    tensors = load_file(folder / WEIGHTS_FILE)
    heads = MedusaHeads(config.num_heads, config.hidden_size)
    with torch.no_grad():
        heads.weight.copy_(tensors["weight"])
        heads.bias.copy_(tensors["bias"])
    heads = heads.to(dtype).eval().requires_grad_(False)
    heads.draft_vocab = tensors.get(ARTIFACT_KEY)
    return heads, config


def default_dir(target_folder: str | Path, weights: str = FLOAT_WEIGHTS) -> Path:
    """Beside the target's cached weights: $SPECDECODE_HOME/models/NAME/medusa (medusa-gguf
    for a tree fitted to the GGUF's blocks)."""
    return local_dir("medusa", target_folder, weights)


def find(target_name: str, target_folder: str | Path, weights: str = FLOAT_WEIGHTS) -> Path:
    """The heads for a target: fitted or trained here first, else shipped with the package."""
    return find_artifact("medusa", CONFIG_FILE, target_name, target_folder, "Medusa heads", "--heads", weights)
