"""The EAGLE head (Li et al. 2024): one decoder layer that predicts the target's next feature.

At position j the head reads the target's feature f_j (its final hidden state, after the
final norm) fused with the embedding of the token that follows, x_{j+1}:

    z_j = W_fuse [f_j ; embed(x_{j+1})],   f̂_{j+1} = Layer(z_≤j)_j,   logits = lm_head(f̂_{j+1})

so the head knows which token was chosen (which Medusa's heads do not) and the LM head
turns its predicted feature into the distribution of x_{j+2}. It runs autoregressively on
its own predictions for deeper tokens, with its own small KV cache (`HeadCache`), rewound
like the target's. The embedding and LM head are the target's own (frozen, not stored).

The artifact is a folder with `eagle.safetensors` and `eagle.json`, stored beside the
target's cached weights by `specdecode train eagle`.
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Sequence

import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file

from specdecode.heads.draft_vocab import ARTIFACT_KEY
from specdecode.errors import SpecDecodeError
from specdecode.heads.artifacts import find_artifact
from specdecode.models.linear import Linear

WEIGHTS_FILE = "eagle.safetensors"
CONFIG_FILE = "eagle.json"


@dataclass
class EagleConfig:
    target: str
    target_sha256: str | None
    hidden_size: int
    num_heads: int
    num_kv_heads: int
    intermediate_size: int
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    training: dict = field(default_factory=dict)
    # the dynamic tree for this machine: depth, top_k, num_nodes (+ the measurements behind them)
    tree: dict = field(default_factory=dict)
    # The target layers the head reads. Empty: the final normed layer alone (EAGLE-1 and
    # -2). Two or more: their hidden states fused by a product (EAGLE-3 reads a low, a middle
    # and a high layer), for the target's positions; drafted positions read the head's own.
    feature_layers: list[int] = field(default_factory=list)

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads


class HeadCache:
    """Keys and values (1, nkv, S, hd) of the head's positions; rewind drops the last n."""

    def __init__(self):
        self.keys: torch.Tensor | None = None
        self.values: torch.Tensor | None = None

    @property
    def length(self) -> int:
        return 0 if self.keys is None else self.keys.shape[2]

    def append(self, keys: torch.Tensor, values: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        self.keys = keys if self.keys is None else torch.cat([self.keys, keys], dim=2)
        self.values = values if self.values is None else torch.cat([self.values, values], dim=2)
        return self.keys, self.values

    def truncate(self, length: int) -> None:
        if self.keys is not None:
            self.keys, self.values = self.keys[:, :, :length], self.values[:, :, :length]


def _rms_norm(x: torch.Tensor, weight: torch.Tensor | None, eps: float) -> torch.Tensor:
    dtype = x.dtype
    x = x.float()
    x = (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)).to(dtype)
    return x if weight is None else x * weight


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


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
        units = [_rms_norm(hidden[layer], None, self.config.rms_norm_eps).to(dtype) for layer in layers]
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
        T = features.shape[0]
        nh, nkv, hd = c.num_heads, c.num_kv_heads, c.head_dim
        x = self._product("fuse", torch.cat([features, embeds], dim=-1))  # (T, H)
        h = _rms_norm(x, self.attn_norm, c.rms_norm_eps)
        q, k, v = self._product("qkv", h).split([nh * hd, nkv * hd, nkv * hd], dim=-1)
        q, k, v = (t.view(T, -1, hd).transpose(0, 1)[None] for t in (q, k, v))  # (1, heads, T, hd)
        freqs = positions.float()[:, None] * self.inv_freq[None]
        emb = torch.cat([freqs, freqs], dim=-1)
        cos, sin = emb.cos().to(q.dtype), emb.sin().to(q.dtype)
        q, k = q * cos + _rotate_half(q) * sin, k * cos + _rotate_half(k) * sin
        past = 0
        if cache is not None:
            past = cache.length
            k, v = cache.append(k, v)
        if mask is None:
            mask = torch.ones(T, past + T, dtype=torch.bool).tril(past)
        k = k.repeat_interleave(nh // nkv, dim=1)
        v = v.repeat_interleave(nh // nkv, dim=1)
        attn = F.scaled_dot_product_attention(q, k, v, attn_mask=mask[None, None])  # (1, nh, T, hd)
        x = x + self._product("o", attn[0].transpose(0, 1).reshape(T, nh * hd))
        gate, up = self._product("gate_up", _rms_norm(x, self.mlp_norm, c.rms_norm_eps)).chunk(2, dim=-1)
        x = x + self._product("down", F.silu(gate) * up)
        return _rms_norm(x, self.out_norm, c.rms_norm_eps)


def check_feature_layers(layers: Sequence[int], num_layers: int | None = None) -> None:
    """Fused layers are two or more distinct ones, within the target's (when known)."""
    layers = list(layers)
    if layers and (len(layers) < 2 or len(set(layers)) != len(layers)
                   or any(layer < 1 or num_layers is not None and layer > num_layers for layer in layers)):
        within = f" from 1 to the target's {num_layers}" if num_layers else ""
        raise SpecDecodeError(f"feature layers: two or more distinct layers{within}, not {layers}")


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


def save(folder: str | Path, head: EagleHead) -> Path:
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    tensors = {name: p.detach().to(torch.bfloat16).contiguous() for name, p in head.state_dict().items()}
    if head.draft_vocab is not None:
        tensors[ARTIFACT_KEY] = head.draft_vocab.long().contiguous()
    save_file(tensors, folder / (WEIGHTS_FILE + ".partial"))
    (folder / (CONFIG_FILE + ".partial")).write_text(json.dumps(asdict(head.config), indent=1))
    (folder / (WEIGHTS_FILE + ".partial")).replace(folder / WEIGHTS_FILE)
    (folder / (CONFIG_FILE + ".partial")).replace(folder / CONFIG_FILE)
    return folder


def load(folder: str | Path, dtype: torch.dtype = torch.float32) -> EagleHead:
    folder = Path(folder)
    if not (folder / CONFIG_FILE).is_file() or not (folder / WEIGHTS_FILE).is_file():
        raise SpecDecodeError(f"no EAGLE head in {folder}; `specdecode train eagle` makes one")
    head = EagleHead(EagleConfig(**json.loads((folder / CONFIG_FILE).read_text())))
    tensors = load_file(folder / WEIGHTS_FILE)
    draft_vocab = tensors.pop(ARTIFACT_KEY, None)
    head.load_state_dict({k: v.float() for k, v in tensors.items()})
    head = head.to(dtype).eval().requires_grad_(False)
    head.draft_vocab = draft_vocab
    return head


def default_dir(target_folder: str | Path) -> Path:
    return Path(target_folder) / "eagle"


def find(target_name: str, target_folder: str | Path) -> Path:
    """The head for a target: trained (or re-shaped) here first, else shipped with the package."""
    return find_artifact("eagle", CONFIG_FILE, target_name, target_folder, "EAGLE head", "--head")
