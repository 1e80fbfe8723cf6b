"""The shape of a Llama-family model, read from a transformers `config.json`.

One frozen dataclass covers Llama, Mistral, Qwen2 and SmolLM2: they differ only in
biases, rope settings and tied embeddings. Unknown keys are ignored (as mlx-lm's
`ModelArgs.from_dict` does); a setting the native forward cannot honour raises
`UnsupportedModel`, so the loader can fall back to the transformers adapter.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

NATIVE_MODEL_TYPES = ("llama", "mistral", "qwen2")


class UnsupportedModel(Exception):
    """The native forward does not implement this architecture or setting."""


@dataclass(frozen=True)
class ModelConfig:
    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    max_position_embeddings: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: dict | None = None  # only llama3-style scaling is supported
    qkv_bias: bool = False
    o_bias: bool = False
    mlp_bias: bool = False
    tie_word_embeddings: bool = False
    eos_token_ids: tuple[int, ...] = field(default_factory=tuple)

    @classmethod
    def from_dict(cls, d: dict) -> "ModelConfig":
        model_type = d.get("model_type", "")
        if model_type not in NATIVE_MODEL_TYPES:
            raise UnsupportedModel(f"model_type {model_type!r} is not one of {NATIVE_MODEL_TYPES}")
        if d.get("hidden_act", "silu") != "silu":
            raise UnsupportedModel(f"hidden_act {d['hidden_act']!r} (only silu)")
        rope = d.get("rope_parameters") or d.get("rope_scaling") or {}
        rope_type = rope.get("rope_type", rope.get("type", "default"))
        if rope_type not in ("default", "llama3"):
            raise UnsupportedModel(f"rope type {rope_type!r}")
        if model_type == "qwen2" and d.get("use_sliding_window"):
            raise UnsupportedModel("Qwen2 sliding-window attention")
        num_heads = d["num_attention_heads"]
        eos = d.get("eos_token_id")
        eos_ids = tuple(eos) if isinstance(eos, list) else (() if eos is None else (eos,))
        attention_bias = bool(d.get("attention_bias", False))
        return cls(
            model_type=model_type,
            vocab_size=d["vocab_size"],
            hidden_size=d["hidden_size"],
            intermediate_size=d["intermediate_size"],
            num_layers=d["num_hidden_layers"],
            num_heads=num_heads,
            num_kv_heads=d.get("num_key_value_heads") or num_heads,
            head_dim=d.get("head_dim") or d["hidden_size"] // num_heads,
            max_position_embeddings=d.get("max_position_embeddings", 4096),
            rms_norm_eps=d.get("rms_norm_eps", 1e-6),
            rope_theta=rope.get("rope_theta", d.get("rope_theta", 10000.0)),
            rope_scaling=dict(rope) if rope_type == "llama3" else None,
            # Qwen2 always has q/k/v biases; Llama and Mistral have them behind a flag.
            qkv_bias=model_type == "qwen2" or attention_bias,
            o_bias=attention_bias and model_type != "qwen2",
            mlp_bias=bool(d.get("mlp_bias", False)),
            tie_word_embeddings=bool(d.get("tie_word_embeddings", False)),
            eos_token_ids=eos_ids,
        )

    @classmethod
    def from_folder(cls, folder: str | Path) -> "ModelConfig":
        return cls.from_dict(json.loads((Path(folder) / "config.json").read_text()))
