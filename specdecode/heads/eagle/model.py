"""The EAGLE head (Li et al. 2024): one decoder layer that predicts the target's next feature.

At position j the head reads the target's feature f_j (its final hidden state, after the
final norm) fused with the embedding of the token that follows, x_{j+1}:

    z_j = W_fuse [f_j ; embed(x_{j+1})],   f̂_{j+1} = Layer(z_≤j)_j,   logits = lm_head(f̂_{j+1})

so the head knows which token was chosen (which Medusa's heads do not) and the LM head
turns its predicted feature into the distribution of x_{j+2}. It runs autoregressively on
its own predictions for deeper tokens, with its own small KV cache (`HeadCache`), rewound
like the target's. The embedding and LM head are the target's own (frozen, not stored).

This is the "fused" layout, which exports to no other engine; eagle3.py holds the one
they load. The artifact of either is a folder with `eagle.safetensors` and `eagle.json`
(its `layout` says which), stored beside the target's cached weights by `specdecode
train eagle`; `save`, `load` and `find` here serve both.
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict
from pathlib import Path
from typing import Sequence

import torch
import torch.nn.functional as F
from safetensors.torch import load_file

from specdecode.heads import draft_vocab
from specdecode.heads.draft_vocab import ARTIFACT_KEY, DraftVocab
from specdecode.errors import SpecDecodeError
from specdecode.heads.artifacts import FLOAT_WEIGHTS, find_artifact, local_dir, write_folder
from specdecode.heads.eagle import eagle3
from specdecode.heads.eagle.parts import EagleConfig, HeadCache, attend, check_feature_layers, rms_norm
from specdecode.models.linear import Linear

__all__ = ["EagleConfig", "EagleHead", "HeadCache", "check_feature_layers", "new_head", "save", "load", "find"]

WEIGHTS_FILE = "eagle.safetensors"
CONFIG_FILE = "eagle.json"


class EagleHead(torch.nn.Module):
    def __init__(self, config: EagleConfig):
        super().__init__()
        self.config = config
        H, hd = config.hidden_size, config.head_dim
        self.fuse = torch.nn.Linear(2 * H, H)
        self.attn_norm = torch.nn.Parameter(torch.ones(H))
        self.qkv = torch.nn.Linear(H, (config.num_heads + 2 * config.num_kv_heads) * hd)
        self.o = torch.nn.Linear(config.num_heads * hd, H, bias=False)
        self.mlp_norm = torch.nn.Parameter(torch.ones(H))
        self.gate_up = torch.nn.Linear(H, 2 * config.intermediate_size, bias=False)
        self.down = torch.nn.Linear(config.intermediate_size, H, bias=False)
        self.out_norm = torch.nn.Parameter(torch.ones(H))  # the target's features are normed ones
        fused = len(config.feature_layers) > 1
        self.fuse_layers = torch.nn.Linear(len(config.feature_layers) * H, H, bias=False) if fused else None
        self.register_buffer("inv_freq", 1.0 / config.rope_theta ** (torch.arange(0, hd, 2).float() / hd),
                             persistent=False)
        self.draft_vocab: torch.Tensor | None = None  # token ids it drafts from (draft_vocab.py); None: all
        self.products: dict[str, Linear] = {}  # packed copies for drafting (pack_for_drafting)

    PRODUCTS = ("fuse", "qkv", "o", "gate_up", "down", "fuse_layers")

    def layers(self, num_layers: int) -> tuple[int, ...]:
        """The target layers this head reads, for a target of num_layers layers."""
        return tuple(self.config.feature_layers) or (num_layers,)

    def target_features(self, hidden: dict[int, torch.Tensor], num_layers: int) -> torch.Tensor:
        """The feature the head reads at the target's own positions, from its hidden states
        (layer -> (T, H)): the one layer's as it is, or several layers' fused. Each is
        scaled to unit RMS first: a residual stream's scale grows with depth."""
        layers = self.layers(num_layers)
        if len(layers) == 1:
            return hidden[layers[0]]
        dtype = hidden[layers[0]].dtype
        units = [rms_norm(hidden[layer], None, self.config.rms_norm_eps).to(dtype) for layer in layers]
        return self._product("fuse_layers", torch.cat(units, dim=-1))

    def pack_for_drafting(self) -> "EagleHead":
        """Run the products through the target's packed bf16 kernels (models/linear.py): a
        head pass with one new row took 5.7 ms through bf16 nn.Linear on Qwen2.5-1.5B and
        3.5 ms packed (SmolLM2: 0.95 and 0.57 ms), and a draft runs a pass per tree depth.
        Training keeps the nn.Linear modules; drafting needs no gradients."""
        modules = {name: getattr(self, name) for name in self.PRODUCTS if getattr(self, name) is not None}
        self.products = {name: Linear(m.weight.detach(), None if m.bias is None else m.bias.detach())
                         for name, m in modules.items()}
        return self

    def _product(self, name: str, x: torch.Tensor) -> torch.Tensor:
        packed = self.products.get(name)
        return getattr(self, name)(x) if packed is None else packed(x)

    def forward(self, features: torch.Tensor, embeds: torch.Tensor, positions: torch.Tensor,
                cache: HeadCache | None = None, mask: torch.Tensor | None = None) -> torch.Tensor:
        """features, embeds (T, H) -> predicted next features (T, H).

        Without a cache the T positions attend causally to each other (training); with one
        they attend to the cached positions and, by `mask` (T, cache.length + T) bool, to
        each other (drafting, trees); without a mask, causally.
        """
        c = self.config
        nh, nkv, hd = c.num_heads, c.num_kv_heads, c.head_dim
        x = self._product("fuse", torch.cat([features, embeds], dim=-1))  # (T, H)
        h = rms_norm(x, self.attn_norm, c.rms_norm_eps)
        q, k, v = self._product("qkv", h).split([nh * hd, nkv * hd, nkv * hd], dim=-1)
        x = x + self._product("o", attend(q, k, v, positions, self.inv_freq, cache, mask))
        gate, up = self._product("gate_up", rms_norm(x, self.mlp_norm, c.rms_norm_eps)).chunk(2, dim=-1)
        x = x + self._product("down", F.silu(gate) * up)
        return rms_norm(x, self.out_norm, c.rms_norm_eps)

    def vocabulary(self, target) -> DraftVocab:
        """The LM head it drafts through: the target's rows for its draft vocabulary
        (`target`: a models.load.LoadedModel)."""
        return draft_vocab.for_target(target, self.draft_vocab)

    def readout(self, features: torch.Tensor) -> torch.Tensor:
        """What the LM head reads: the predicted feature itself (it is normed already)."""
        return features


def new_head(target_config, target_name: str, target_sha256: str | None, intermediate_size: int | None = None,
             seed: int = 0, feature_layers: Sequence[int] = ()) -> EagleHead:
    """A head shaped like one of the target's layers (optionally with a narrower MLP),
    reading the target's final layer or, fused, `feature_layers`."""
    check_feature_layers(feature_layers, target_config.num_layers)
    torch.manual_seed(seed)
    config = EagleConfig(target_name, target_sha256, target_config.hidden_size, target_config.num_heads,
                         target_config.num_kv_heads, intermediate_size or target_config.intermediate_size,
                         target_config.rms_norm_eps, target_config.rope_theta,
                         feature_layers=list(feature_layers))
    head = EagleHead(config)
    with torch.no_grad():  # small initial steps: the fused input starts near the feature itself
        H = config.hidden_size
        head.fuse.weight.normal_(0, 1 / math.sqrt(2 * H))
        head.fuse.weight[:, :H] += torch.eye(H)
        head.fuse.bias.zero_()
        if head.fuse_layers is not None:  # the layers start equally weighed
            k = len(config.feature_layers)
            head.fuse_layers.weight.normal_(0, 1 / math.sqrt(k * H))
            head.fuse_layers.weight += torch.eye(H).repeat(1, k) / k
    return head


def save(folder: str | Path, head: "EagleHead | eagle3.Eagle3Head") -> Path:
    tensors = {name: p.detach().to(torch.bfloat16).contiguous() for name, p in head.state_dict().items()}
    if head.draft_vocab is not None:
        tensors[ARTIFACT_KEY] = head.draft_vocab.long().contiguous()
    return write_folder(folder, WEIGHTS_FILE, tensors, CONFIG_FILE, asdict(head.config))


def load(folder: str | Path, dtype: torch.dtype = torch.float32) -> "EagleHead | eagle3.Eagle3Head":
    folder = Path(folder)
    if not (folder / CONFIG_FILE).is_file() or not (folder / WEIGHTS_FILE).is_file():
        raise SpecDecodeError(f"no EAGLE head in {folder}; `specdecode train eagle` makes one"
                              + (" (a speculators or EAGLE folder: `specdecode import eagle`)"
                                 if (folder / "config.json").is_file() else ""))
    config = EagleConfig(**json.loads((folder / CONFIG_FILE).read_text()))
    tensors = load_file(folder / WEIGHTS_FILE)
    draft_vocab = tensors.pop(ARTIFACT_KEY, None)
    if config.layout == eagle3.LAYOUT:
        head = eagle3.Eagle3Head(config, tensors["lm_head.weight"].shape[0])
    elif config.layout == "fused":
        head = EagleHead(config)
    else:
        raise SpecDecodeError(f"the head in {folder} has layout {config.layout!r}, which this version does not know")
    head.load_state_dict({k: v.float() for k, v in tensors.items()})
    head = head.to(dtype).eval().requires_grad_(False)
    head.draft_vocab = draft_vocab
    return head


def default_dir(target_folder: str | Path, weights: str = FLOAT_WEIGHTS) -> Path:
    return local_dir("eagle", target_folder, weights)


def find(target_name: str, target_folder: str | Path, weights: str = FLOAT_WEIGHTS) -> Path:
    """The head for a target: trained (or re-shaped) here first, else shipped with the package."""
    return find_artifact("eagle", CONFIG_FILE, target_name, target_folder, "EAGLE head", "--head", weights)
