"""A compact forward pass for the Llama family (Llama, Mistral, Qwen2, SmolLM2).

What speculative decoding needs from a target, and nothing else:
- several tokens per pass at explicit rotary positions, written into a preallocated
  `KVCache` at slots [cache.length, cache.length + T);
- an optional boolean attention mask over the cache (True = may attend), so that a tree
  of candidates is verified in one pass; without one, attention is causal by slot;
- logits of the last `num_logits` positions only (prefill needs one row, not T), and on
  request the hidden states of chosen layers (index 0 = embeddings, i = output of layer
  i, num_layers = after the final norm, as transformers' `hidden_states` counts them).

The numerics follow transformers' Llama (RMSNorm in fp32, rotate-half rope applied in
the model dtype), so logits match it to rounding. q/k/v and gate/up are fused into one
matrix each: fewer, larger products stream weights faster. Grouped-query attention
folds the query heads of a group into the query length instead of copying keys.

Batch invariance: a verify pass over k+1 tokens must give the same logits as k+1
one-token passes, or greedy speculative output drifts from plain decoding. bf16 products
are row-invariant here. So is bf16 attention on the fused path (passes of up to
FUSED_MAX_ROWS tokens with the extension built: every decoding and verify pass), whose
kernel (attention_host.h) sums each row over the keys it sees, densely and in order, so a
tree pass is exact in one call. torch's attention (fp32, and long prefills) is not: it
splits keys into blocks by their count, so the rounding of a row depends on how many
keys the call sees. Such calls therefore attend over whole 512-key blocks of the cache
buffer (whose length is a multiple of the block, kv_cache.py), masked; masked blocks add
exact zeros, so a call reads only the blocks up to its last new slot. Within a block its
sums group keys by slot too, so there a tree pass attends path by path (path_attention.py).

Left out: sliding windows, rope types other than default and llama3, anything but
silu MLPs; `load.py` sends such models to the transformers adapter.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Sequence

import torch
import torch.nn.functional as F

from specdecode.models import kernels
from specdecode.models.config import ModelConfig
from specdecode.models.draft_head import draft_head_path, with_draft_head
from specdecode.models.kv_cache import BLOCK, KVCache
from specdecode.models.layer_ops import FusedOps, TorchOps, layer_ops
from specdecode.models.linear import ROW_INVARIANT_ROWS, Linear
from specdecode.models.prepared import load_prepared
from specdecode.models.quant import Q8_0, QUANTIZABLE, QuantEmbedding, QuantLinear, QuantTensor, quantize_matrices
from specdecode.models.store import gguf_file
from specdecode.models.path_attention import PathPlan, plan_paths
from specdecode.models.weights import load_weights


@dataclass
class ForwardOutput:
    logits: torch.Tensor  # (B, num_logits, vocab) float32
    hidden_states: dict[int, torch.Tensor] = field(default_factory=dict)  # each (B, T, hidden)


@dataclass
class Layer:
    attn_norm: torch.Tensor
    qkv: Linear
    o: Linear
    mlp_norm: torch.Tensor
    gate_up: Linear
    down: Linear

    @property
    def matrices(self) -> tuple[Linear, ...]:
        return self.qkv, self.o, self.gate_up, self.down

    @property
    def packed(self) -> tuple[list, list, list]:
        """(weights, biases, output widths) of the four matrices, as decoder_layer.cpp takes them."""
        m = self.matrices
        return [l.kernel_parts for l in m], [l.bias for l in m], [l.out_features for l in m]


def rope_inv_freq(config: ModelConfig) -> torch.Tensor:
    hd = config.head_dim
    inv_freq = 1.0 / (config.rope_theta ** (torch.arange(0, hd, 2, dtype=torch.int64).float() / hd))
    s = config.rope_scaling
    if s is None:
        return inv_freq
    # llama3: slow down low frequencies by `factor`, keep high ones, blend in between.
    factor, low, high = s["factor"], s["low_freq_factor"], s["high_freq_factor"]
    old_len = s["original_max_position_embeddings"]
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > old_len / low, inv_freq / factor, inv_freq)
    smooth = (old_len / wavelen - low) / (high - low)
    blended = (1 - smooth) * scaled / factor + smooth * scaled
    medium = (wavelen >= old_len / high) & (wavelen <= old_len / low)
    return torch.where(medium, blended, scaled)


FUSED_MAX_ROWS = 128  # tokens per pass up to which the fused small ops run (layer_ops.py)
ROWS_APART_MAX = 64  # rows per pass up to which torch's bf16 attention takes one row per batch element (_attend)
PREFILL_CHUNK = 512  # tokens per pass of a long causal pass (a prompt's prefill): bounds its memory


def key_slots(end: int, max_len: int) -> int:
    """Slots an attention call reads: whole kernel blocks up to slot `end` (see above)."""
    return min(max_len, -(-end // BLOCK) * BLOCK)


def check_mask_shape(mask: torch.Tensor, T: int, start: int) -> None:
    if mask.shape[-2:] != (T, start + T):
        raise ValueError(f"mask must be (..., {T}, {start + T}) over the cache, got {tuple(mask.shape)}")


def additive_mask(allowed: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return torch.zeros(allowed.shape, dtype=dtype).masked_fill_(~allowed, float("-inf"))


class NativeModel:
    backend = "native"

    def __init__(self, config: ModelConfig, weights: dict[str, torch.Tensor], dtype: torch.dtype = torch.bfloat16,
                 weight_format: str | None = None):
        self.config = config
        self.dtype = dtype
        # what a pass costs depends on, and so a tree fitted to those costs: the float dtype
        # ("bfloat16", "float32") or the quantized format ("gguf", "q8_0", "q4_0")
        self.weight_format = weight_format or str(dtype).removeprefix("torch.")
        c = config

        weights = dict(weights)  # popped as used, so fused copies do not double peak memory

        def w(name: str) -> torch.Tensor | QuantTensor:
            tensor = weights.pop(name)
            return tensor if isinstance(tensor, QuantTensor) else tensor.to(dtype)

        def opt(name: str) -> torch.Tensor | None:
            return weights.pop(name).to(dtype) if name in weights else None

        def matrix(names: list[str], bias_names: list[str]) -> Linear | QuantLinear:
            """One product over the matrices stacked by output: fewer, larger products stream faster."""
            parts = [w(n) for n in names]
            biases = [opt(n) for n in bias_names]
            bias = torch.cat(biases) if all(b is not None for b in biases) else None
            if any(isinstance(p, QuantTensor) for p in parts):  # a float part among quantized ones runs as Q8_0
                return QuantLinear([p if isinstance(p, QuantTensor) else QuantTensor.quantize(p, Q8_0) for p in parts],
                                   bias)
            return Linear(torch.cat(parts) if len(parts) > 1 else parts[0], bias)

        embed = w("model.embed_tokens.weight")
        self.embed = QuantEmbedding(embed, dtype) if isinstance(embed, QuantTensor) else embed
        self.layers: list[Layer] = []
        for i in range(c.num_layers):
            p = f"model.layers.{i}."
            attn, mlp = [p + f"self_attn.{n}_proj." for n in "qkv"], [p + f"mlp.{n}_proj." for n in ("gate", "up")]
            self.layers.append(Layer(
                attn_norm=w(p + "input_layernorm.weight"),
                qkv=matrix([n + "weight" for n in attn], [n + "bias" for n in attn]),
                o=matrix([p + "self_attn.o_proj.weight"], [p + "self_attn.o_proj.bias"]),
                mlp_norm=w(p + "post_attention_layernorm.weight"),
                gate_up=matrix([n + "weight" for n in mlp], [n + "bias" for n in mlp]),
                down=matrix([p + "mlp.down_proj.weight"], [p + "mlp.down_proj.bias"]),
            ))
        self.norm = w("model.norm.weight")
        head = weights.pop("lm_head.weight", None) if not c.tie_word_embeddings or isinstance(embed, QuantTensor) else None
        head = embed if head is None else head  # a GGUF may store a tied model's head apart, in its own type
        # the table held once, as the head (a quantized head is a copy, on huge pages and maybe repacked)
        self.head_is_embedding = head is embed and not isinstance(embed, QuantTensor)
        if isinstance(head, QuantTensor):
            self.lm_head = QuantLinear([head])
        else:
            self.lm_head = Linear(head.to(dtype))
        # The plain matrix, for training drafter heads through it (tied float models only: an
        # untied or quantized head lives packed, and training reads it from the weights file).
        self.lm_head_weight = self.embed if head is embed and not isinstance(embed, QuantTensor) else None
        self.ops = layer_ops(dtype)
        # Every layer in one call (decoder_layer.cpp) where every matrix is on this machine's
        # kernel (bf16 needing no padding, as kernels.linear would add, or quantized). Off: the
        # same kernels one by one.
        self.layer_in_one_call = self.ops is FusedOps and all(
            l.backend == "quant" or (l.backend in kernels.KINDS and not kernels.needs_padding(l.in_features))
            for layer in self.layers for l in layer.matrices)
        self._stack = self._stack_arguments() if self.layer_in_one_call else None  # made once
        self._inv_freq = rope_inv_freq(c)
        self._cos = self._sin = torch.empty(0, c.head_dim)

    def _stack_arguments(self) -> tuple:
        """decoder_stack's weights, biases, output widths and norms, in its order."""
        packed = [layer.packed for layer in self.layers]
        widths = packed[0][2]
        assert all(p[2] == widths for p in packed)  # every layer has the same shapes
        next_norms = [layer.attn_norm for layer in self.layers[1:]] + [self.norm]
        return ([w for p in packed for w in p[0]], [b for p in packed for b in p[1]], widths,
                [layer.mlp_norm for layer in self.layers], next_norms)

    @classmethod
    def from_folder(cls, folder: str | Path, dtype: torch.dtype = torch.bfloat16,
                    quant: str | None = None, as_draft: bool = False) -> "NativeModel":
        """quant: None (float weights in `dtype`), "gguf" (the folder's GGUF blocks as stored)
        or a type to quantize the float weights to ("q8_0", "q4_0"). as_draft: quantized,
        the LM head is read at five bits where stored wider (draft_head.py)."""
        folder = Path(folder)
        config = ModelConfig.from_folder(folder)
        if quant == "gguf":
            gguf = gguf_file(folder)
            weights = load_prepared(gguf, config, folder)
            if as_draft:
                weights = with_draft_head(weights, draft_head_path(gguf, folder))
        elif quant is not None:
            weights = quantize_matrices(load_weights(folder, dtype), QUANTIZABLE[quant])
            if as_draft:
                weights = with_draft_head(weights)
        else:
            weights = load_weights(folder, dtype)
        return cls(config, weights, dtype, quant)

    # ---- cache and bookkeeping -------------------------------------------------------

    @property
    def vocab_size(self) -> int:
        return self.config.vocab_size  # rows of the LM head; may exceed the tokenizer's vocabulary

    @property
    def max_position_embeddings(self) -> int:
        return self.config.max_position_embeddings

    def new_cache(self, batch_size: int = 1, max_len: int | None = None) -> KVCache:
        c = self.config
        max_len = max_len or min(c.max_position_embeddings, 4096)
        return KVCache(c.num_layers, batch_size, c.num_kv_heads, max_len, c.head_dim, self.dtype)

    @property
    def weight_bytes_per_token(self) -> int:
        """Bytes of weights one decoding step streams: every layer and the LM head.

        The embedding lookup reads one row, so it does not count.
        """
        per_layer = [l.qkv.nbytes + l.o.nbytes + l.gate_up.nbytes + l.down.nbytes
                     + 2 * l.attn_norm.numel() * l.attn_norm.element_size() for l in self.layers]
        return sum(per_layer) + self.lm_head.nbytes

    @property
    def matrices(self) -> list[Linear | QuantLinear]:
        """Every layer's matrices, then the LM head."""
        return [l for layer in self.layers for l in layer.matrices] + [self.lm_head]

    @property
    def multiply_adds_per_token(self) -> int:
        """Multiply-adds of one token through every matrix: a pass over n tokens performs n
        times as many, however it reads the weights."""
        return sum(l.in_features * l.out_features for l in self.matrices)

    @property
    def row_invariant_rows(self) -> int | None:
        """The most tokens a pass may hold and still give each bitwise a one-token pass's
        logits (None: any number); linear.py."""
        limits = [ROW_INVARIANT_ROWS[l.backend] for l in self.matrices]
        return min((n for n in limits if n is not None), default=None)

    @property
    def memory_bytes(self) -> int:
        """Bytes of weights held: what decoding streams, plus the embedding table if separate."""
        embed = self.embed.numel() * self.embed.element_size()
        return self.weight_bytes_per_token + (0 if self.head_is_embedding else embed)

    def _rope(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        needed = int(positions.max()) + 1
        if needed > self._cos.shape[0]:
            n = max(needed, 2 * self._cos.shape[0], 1024)
            freqs = torch.outer(torch.arange(n, dtype=torch.float32), self._inv_freq)
            emb = torch.cat((freqs, freqs), dim=-1)
            self._cos, self._sin = emb.cos().to(self.dtype), emb.sin().to(self.dtype)
        return self._cos[positions], self._sin[positions]

    # ---- the forward pass --------------------------------------------------------------

    @torch.inference_mode()
    def forward(
        self,
        tokens: torch.Tensor,  # (B, T) long
        cache: KVCache,
        positions: torch.Tensor | None = None,  # (T,) or (B, T); default: the slot indices
        mask: torch.Tensor | None = None,  # (T, S) or (B, T, S) bool over slots, S = cache.length + T
        hidden_layers: Sequence[int] = (),
        num_logits: int | None = None,  # logits for the last num_logits positions; None = all
    ) -> ForwardOutput:
        c = self.config
        B, T = tokens.shape
        start = cache.length
        cache.check_room(T)
        if positions is None:
            positions = torch.arange(start, start + T)
        if mask is None and T > PREFILL_CHUNK:
            return self._in_chunks(tokens, cache, positions, hidden_layers, num_logits)
        cos, sin = self._rope(positions)  # (T, hd) or (B, T, hd)
        group = c.num_heads // c.num_kv_heads
        # The fused ops are single-threaded loops, made for decoding's few rows; a prefill's
        # many rows go to torch's threaded ops. Both paths of a generation prefill alike,
        # and every verify pass stays under the bound, so exactness does not change.
        ops, eps = (self.ops if B * T <= FUSED_MAX_ROWS else TorchOps), c.rms_norm_eps
        if ops is FusedOps:  # the kernels' attention: exact for any tree in one call, no additive mask
            attention = self._allowed(mask, T, start)
        else:
            plans = plan_paths(mask, start) if mask is not None and B == 1 else None
            if plans is None:
                attention = [(None, self._attention_mask(mask, T, start, cache.max_len))]
            else:
                attention = [(plan, self._path_mask(plan, start, cache.max_len)) for plan in plans]
            # Additive masks made once per pass: given a boolean mask, attention would build this
            # very one again in every layer (0 where allowed, -inf elsewhere, in the query dtype).
            attention = [(plan, additive_mask(allowed, self.dtype)) for plan, allowed in attention]

        x = self.embed[tokens]  # (B, T, H)
        hidden: dict[int, torch.Tensor] = {}
        if 0 in hidden_layers:
            hidden[0] = x
        h = ops.rms_norm(x, self.layers[0].attn_norm, eps)
        if ops is FusedOps and self.layer_in_one_call:  # decoder_layer.cpp: the fused kernels, one call
            cos, sin = ((t if t.dim() == 3 else t[None]).contiguous() for t in (cos, sin))
            allowed = FusedOps.causal if attention is None else attention
            keep = sorted(i for i in set(hidden_layers) if 0 < i < c.num_layers)
            x, h, *kept = kernels.kernel().decoder_stack(x, h, cos, sin, cache.keys, cache.values, cache.length,
                                                     allowed, c.num_heads, c.num_kv_heads, *self._stack, eps, keep)
            hidden.update(zip(keep, kept))
        else:
            for i, layer in enumerate(self.layers):
                next_norm = self.layers[i + 1].attn_norm if i + 1 < c.num_layers else self.norm
                attended = (self._fused_attention(layer, h, cos, sin, cache, i, attention) if ops is FusedOps
                            else self._attention(layer, h, cos, sin, cache, i, attention, group))
                x, h = ops.add_rms_norm(x, attended, layer.mlp_norm, eps)
                x, h = ops.add_rms_norm(x, layer.down(ops.silu_mul(layer.gate_up(h))), next_norm, eps)
                if i + 1 in hidden_layers and i + 1 < c.num_layers:
                    hidden[i + 1] = x
        cache.advance(T)
        x = h  # the final norm of the last residual sum
        if c.num_layers in hidden_layers:
            hidden[c.num_layers] = x
        if num_logits is not None:
            x = x[:, T - num_logits:]
        if x.shape[1] == 0:  # no logits asked for (a chunk of a long pass): skip the vocabulary product
            return ForwardOutput(torch.zeros(B, 0, self.vocab_size), hidden)
        return ForwardOutput(self.logits(x), hidden)

    __call__ = forward

    def logits(self, h: torch.Tensor) -> torch.Tensor:
        """fp32 logits of final hidden states h (..., hidden)."""
        if isinstance(self.lm_head, QuantLinear):  # its product is fp32: asked in fp32, it skips a bf16 round trip
            return self.lm_head(h.float())
        return self.lm_head(h).float()

    def _in_chunks(self, tokens: torch.Tensor, cache: KVCache, positions: torch.Tensor,
                   hidden_layers: Sequence[int], num_logits: int | None) -> ForwardOutput:
        """A long causal pass as passes of PREFILL_CHUNK tokens, one after another over the
        cache: its activations and attention masks stay the size of one chunk, whatever the
        prompt's length. Logits are kept for the chunks holding the last num_logits rows."""
        T = tokens.shape[1]
        first_logit = 0 if num_logits is None else T - num_logits
        logits, hidden = [], {}
        for s in range(0, T, PREFILL_CHUNK):
            e = min(T, s + PREFILL_CHUNK)
            wanted = None if first_logit <= s else max(0, e - first_logit)
            out = self.forward(tokens[:, s:e], cache, positions[..., s:e], None, hidden_layers, wanted)
            if wanted != 0:
                logits.append(out.logits)
            for layer, h in out.hidden_states.items():
                hidden.setdefault(layer, []).append(h)
        return ForwardOutput(torch.cat(logits, dim=1), {layer: torch.cat(h, dim=1) for layer, h in hidden.items()})

    @staticmethod
    def _allowed(mask: torch.Tensor | None, T: int, start: int) -> torch.Tensor | None:
        """The boolean mask as the kernels' attention takes it: (B or 1, T, start + T), or None (causal)."""
        if mask is None:
            return None
        check_mask_shape(mask, T, start)
        return (mask if mask.dim() == 3 else mask[None]).to(torch.bool).contiguous()

    def _fused_attention(self, layer: Layer, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                         cache: KVCache, index: int, allowed: torch.Tensor | None) -> torch.Tensor:
        c = self.config
        roped = FusedOps.rope(layer.qkv(x), cos, sin, c.num_heads, c.num_kv_heads, c.head_dim)
        out = FusedOps.cache_attention(roped, cache.keys[index], cache.values[index], cache.length, allowed,
                                       c.num_heads, c.num_kv_heads)
        return layer.o(out)

    def _attention_mask(self, mask: torch.Tensor | None, T: int, start: int, max_len: int) -> torch.Tensor:
        """Boolean mask (B or 1, T, key slots) over the slots attention reads."""
        if mask is None:
            slots = torch.arange(start + T)
            mask = slots[None, :] <= (start + torch.arange(T))[:, None]  # causal by slot
        else:
            check_mask_shape(mask, T, start)
        if mask.dim() == 2:
            mask = mask[None]
        return F.pad(mask, (0, key_slots(start + T, max_len) - start - T), value=False)  # past the new tokens

    def _path_mask(self, plan: PathPlan, start: int, max_len: int) -> torch.Tensor:
        """Causal mask (1, Q, key slots) for a path's queries over the path written at slots start, start + 1, ..."""
        end = start + len(plan.nodes)
        slots = torch.arange(key_slots(end, max_len))
        rows = start + torch.arange(plan.first_query, len(plan.nodes))
        return (slots[None, :] <= rows[:, None])[None]

    def _attention(self, layer: Layer, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, cache: KVCache,
                   index: int, attention: list[tuple[PathPlan | None, torch.Tensor]], group: int) -> torch.Tensor:
        c = self.config
        B, T, _ = x.shape
        nh, nkv, hd = c.num_heads, c.num_kv_heads, c.head_dim
        q, k, v = self.ops.rope_qkv(layer.qkv(x), cos, sin, nh, nkv, hd)  # (B, nh | nkv, T, hd)
        plan, attn_mask = attention[0]
        if plan is None:
            out = self._attend(q, k, v, cache, index, attn_mask, group)
        else:
            out = torch.empty_like(q)
            for plan, attn_mask in attention:
                out[:, :, plan.queries] = self._attend(
                    q[:, :, plan.queries], k[:, :, plan.nodes], v[:, :, plan.nodes], cache, index, attn_mask, group)
            cache.write(index, k, v)  # every node in its own slot again, for compact
        return layer.o(out.transpose(1, 2).reshape(B, T, nh * hd))

    @staticmethod
    def _attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cache: KVCache, index: int,
                attn_mask: torch.Tensor, group: int) -> torch.Tensor:
        """Write k, v (B, nkv, L, hd) at the cache's next slots; q (B, nh, Q, hd) attends there,
        each row as attn_mask (B or 1, Q, key slots), additive, allows."""
        B, nh, Q, hd = q.shape
        keys, values = cache.write(index, k, v)  # (B, nkv, max_len, hd), the whole buffer
        n = attn_mask.shape[-1]
        keys, values = keys[:, :, :n], values[:, :, :n]
        nkv = nh // group
        if q.dtype != torch.float32 and Q > 1 and B * Q <= ROWS_APART_MAX:
            # One batch element per row: torch's reduced-precision kernel then computes each row
            # exactly as a one-row pass does. Folded into one length, a row's result depends on
            # how many rows share the call (seen on an AVX2 CPU: a SmolLM2 verify pass flipped a
            # greedy token). fp32 rows differ from a one-row pass either way (measured), slightly.
            out = torch.empty_like(q)
            for b in range(B):
                rows = q[b].view(nkv, group, Q, hd).permute(2, 0, 1, 3)  # (Q, nkv, group, hd)
                mask = attn_mask[b if attn_mask.shape[0] > 1 else 0][:, None, None, :]  # (Q, 1, 1, n)
                o = F.scaled_dot_product_attention(rows, keys[b:b + 1].expand(Q, -1, -1, -1),
                                                   values[b:b + 1].expand(Q, -1, -1, -1), attn_mask=mask)
                out[b] = o.permute(1, 2, 0, 3).reshape(nh, Q, hd)
            return out
        # query heads of a group folded into the length, rows (g, t): the mask's T rows once per head
        folded_mask = attn_mask[:, None].repeat(1, 1, group, 1)  # (B or 1, 1, group*Q, n)
        out = F.scaled_dot_product_attention(q.reshape(B, nkv, group * Q, hd), keys, values, attn_mask=folded_mask)
        return out.view(B, nh, Q, hd)
