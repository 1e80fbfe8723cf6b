"""The EAGLE-3 head (Li et al. 2025) in the layout vLLM, SGLang and `speculators` load.

It reads three (or more) of the target's layers at each position, concatenated as they
are and projected to the hidden size by `fc`; one decoder layer then takes the embedding
of the token that follows, normed, beside that state, normed:

    h_j = fc [l_a ; l_b ; l_c]_j                      (the target's positions)
    a   = Attn(q,k,v of [norm_in(embed(x_{j+1})) ; norm_h(h_j)])
    s   = h_j + o(a);  s = s + MLP(norm_post(s))      (the state the head feeds itself)
    logits = lm_head(norm(s))                         (over its draft vocabulary)

At drafted positions the head reads its own state s in place of h. Unlike the fused head
(model.py), it has its own LM head over a draft vocabulary (`draft_vocab`: its rows'
target token ids) and predicts tokens, not features. The residual is taken before
`hidden_norm` (speculators' `norm_before_residual: false`, the original EAGLE-3 layer).

Parameters carry speculators' names without their module path (exchange.py maps them), so
an export is a renaming and an import trains nothing.
"""

from __future__ import annotations

import math
from typing import Sequence

import torch
import torch.nn.functional as F

from specdecode.heads.draft_vocab import DraftVocab
from specdecode.heads.eagle.parts import EagleConfig, HeadCache, attend, check_feature_layers, rms_norm
from specdecode.models.linear import Linear

LAYOUT = "eagle3"


class Eagle3Head(torch.nn.Module):
    def __init__(self, config: EagleConfig, draft_vocab_size: int):
        super().__init__()
        check_feature_layers(config.feature_layers)
        if not config.feature_layers:
            raise ValueError("an EAGLE-3 head reads two or more target layers")
        self.config = config
        H, hd, nh, nkv = config.hidden_size, config.head_dim, config.num_heads, config.num_kv_heads
        self.fc = torch.nn.Linear(len(config.feature_layers) * H, H, bias=False)
        self.q_proj = torch.nn.Linear(2 * H, nh * hd, bias=False)
        self.k_proj = torch.nn.Linear(2 * H, nkv * hd, bias=False)
        self.v_proj = torch.nn.Linear(2 * H, nkv * hd, bias=False)
        self.o_proj = torch.nn.Linear(nh * hd, H, bias=False)
        self.gate_proj = torch.nn.Linear(H, config.intermediate_size, bias=False)
        self.up_proj = torch.nn.Linear(H, config.intermediate_size, bias=False)
        self.down_proj = torch.nn.Linear(config.intermediate_size, H, bias=False)
        self.input_layernorm = torch.nn.Parameter(torch.ones(H))
        self.hidden_norm = torch.nn.Parameter(torch.ones(H))
        self.post_attention_layernorm = torch.nn.Parameter(torch.ones(H))
        self.norm = torch.nn.Parameter(torch.ones(H))
        self.lm_head = torch.nn.Linear(H, draft_vocab_size, bias=False)
        self.register_buffer("inv_freq", 1.0 / config.rope_theta ** (torch.arange(0, hd, 2).float() / hd),
                             persistent=False)
        self.draft_vocab: torch.Tensor | None = None  # target token id of each lm_head row
        self.products: dict[str, Linear] = {}

    def layers(self, num_layers: int) -> tuple[int, ...]:
        return tuple(self.config.feature_layers)

    def target_features(self, hidden: dict[int, torch.Tensor], num_layers: int) -> torch.Tensor:
        """h at the target's positions: its layers' hidden states, as they are, through fc."""
        return self._product("fc", torch.cat([hidden[layer] for layer in self.config.feature_layers], dim=-1))

    def pack_for_drafting(self) -> "Eagle3Head":
        """The products through the target's packed kernels (as the fused head's); q, k, v
        and gate, up each as one product."""
        def weight(*names):
            return torch.cat([getattr(self, n).weight.detach() for n in names]).contiguous()

        self.products = {"fc": Linear(weight("fc")), "qkv": Linear(weight("q_proj", "k_proj", "v_proj")),
                         "o_proj": Linear(weight("o_proj")), "gate_up": Linear(weight("gate_proj", "up_proj")),
                         "down_proj": Linear(weight("down_proj"))}
        return self

    def _product(self, name: str, x: torch.Tensor) -> torch.Tensor:
        packed = self.products.get(name)
        return getattr(self, name)(x) if packed is None else packed(x)

    def _qkv(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        c = self.config
        sizes = [c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim, c.num_kv_heads * c.head_dim]
        if "qkv" in self.products:
            return self.products["qkv"](x).split(sizes, dim=-1)
        return self.q_proj(x), self.k_proj(x), self.v_proj(x)

    def _mlp(self, x: torch.Tensor) -> torch.Tensor:
        if "gate_up" in self.products:
            gate, up = self.products["gate_up"](x).chunk(2, dim=-1)
        else:
            gate, up = self.gate_proj(x), self.up_proj(x)
        return self._product("down_proj", F.silu(gate) * up)

    def forward(self, states: torch.Tensor, embeds: torch.Tensor, positions: torch.Tensor,
                cache: HeadCache | None = None, mask: torch.Tensor | None = None) -> torch.Tensor:
        """states h (T, H) and the next tokens' embeddings (T, H) -> the head's states s
        (T, H), fed back at drafted positions; `readout` turns them into logits' input.
        Cache and mask as the fused head's forward."""
        c = self.config
        eps = c.rms_norm_eps
        x = torch.cat([rms_norm(embeds, self.input_layernorm, eps), rms_norm(states, self.hidden_norm, eps)], dim=-1)
        s = states + self._product("o_proj", attend(*self._qkv(x), positions, self.inv_freq, cache, mask))
        return s + self._mlp(rms_norm(s, self.post_attention_layernorm, eps))

    def readout(self, states: torch.Tensor) -> torch.Tensor:
        """What the LM head reads: the state, normed."""
        return rms_norm(states, self.norm, self.config.rms_norm_eps)

    def vocabulary(self, target) -> DraftVocab:
        """The LM head it drafts through: its own, over its draft vocabulary, packed like
        the target's products (`target`: a models.load.LoadedModel or the model itself)."""
        dtype = getattr(target, "model", target).dtype
        return DraftVocab(Linear(self.lm_head.weight.detach().to(dtype).contiguous()), self.draft_vocab)


def new_head(target_config, target_name: str, target_sha256: str | None, lm_rows: torch.Tensor,
             draft_vocab: torch.Tensor, feature_layers: Sequence[int], intermediate_size: int | None = None,
             seed: int = 0) -> Eagle3Head:
    """A head shaped like one of the target's layers, its LM head started from the target's
    rows `lm_rows` for the token ids `draft_vocab`."""
    check_feature_layers(feature_layers, target_config.num_layers)
    torch.manual_seed(seed)
    config = EagleConfig(target_name, target_sha256, target_config.hidden_size, target_config.num_heads,
                         target_config.num_kv_heads, intermediate_size or target_config.intermediate_size,
                         target_config.rms_norm_eps, target_config.rope_theta,
                         feature_layers=list(feature_layers), layout=LAYOUT)
    head = Eagle3Head(config, draft_vocab.numel())
    with torch.no_grad():
        head.lm_head.weight.copy_(lm_rows.float())
        H, k = config.hidden_size, len(config.feature_layers)
        head.fc.weight.normal_(0, 1 / math.sqrt(k * H))
    head.draft_vocab = draft_vocab.long()
    return head


def scale_fc(head: Eagle3Head, hidden: dict[int, torch.Tensor]) -> None:
    """Start fc as the mean of the layers each scaled to unit RMS: residual streams grow
    with depth, and a linear scale per layer is exactly what fc can hold."""
    H, k = head.config.hidden_size, len(head.config.feature_layers)
    with torch.no_grad():
        for i, layer in enumerate(head.config.feature_layers):
            rms = hidden[layer].float().pow(2).mean().sqrt().clamp(min=1e-6)
            head.fc.weight[:, i * H:(i + 1) * H] += torch.eye(H) / (k * rms)
