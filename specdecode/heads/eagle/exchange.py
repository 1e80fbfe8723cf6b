"""EAGLE-3 heads in the formats other engines load, and back.

Two layouts, one set of tensors (eagle3.py names them):
- `speculators` (vLLM loads it as it is): `config.json` with `speculators_model_type:
  eagle3`, the decoder layer as a Llama config, the verifier; `model.safetensors` with
  `fc`, `layers.0.*`, `norm`, `lm_head` over the draft vocabulary, `d2t` and `t2d`.
- `eagle`, the original EAGLE repository's (SGLang loads it): a Llama config with
  `draft_vocab_size`; the layer's tensors under `midlayer.`.

Only what drafts exactly as it does here is written or read: a fused-layout head, or a
head elsewhere with options this head does not compute (more layers, norms around `fc`,
biases, scaled rotary embeddings), is refused with the reason. The target's embedding is
not stored (both engines take the target's).
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import load_file

from specdecode.errors import SpecDecodeError
from specdecode.heads.artifacts import write_folder
from specdecode.heads.eagle.eagle3 import LAYOUT, Eagle3Head
from specdecode.heads.eagle.parts import EagleConfig
from specdecode.models.registry import REGISTRY

FORMATS = ("speculators", "eagle")
WEIGHTS = "model.safetensors"
CONFIG = "config.json"
AUX_LAYERS = 3  # vLLM's and SGLang's fc reads three target layers

# our parameter -> the speculators name (the EAGLE layout writes "midlayer." for "layers.0.")
NAMES = {
    "fc.weight": "fc.weight",
    "q_proj.weight": "layers.0.self_attn.q_proj.weight",
    "k_proj.weight": "layers.0.self_attn.k_proj.weight",
    "v_proj.weight": "layers.0.self_attn.v_proj.weight",
    "o_proj.weight": "layers.0.self_attn.o_proj.weight",
    "gate_proj.weight": "layers.0.mlp.gate_proj.weight",
    "up_proj.weight": "layers.0.mlp.up_proj.weight",
    "down_proj.weight": "layers.0.mlp.down_proj.weight",
    "input_layernorm": "layers.0.input_layernorm.weight",
    "hidden_norm": "layers.0.hidden_norm.weight",
    "post_attention_layernorm": "layers.0.post_attention_layernorm.weight",
    "norm": "norm.weight",
    "lm_head.weight": "lm_head.weight",
}


def _file_name(name: str, fmt: str) -> str:
    return name.replace("layers.0.", "midlayer.") if fmt == "eagle" else name


def layer_config(config: EagleConfig, vocab_size: int, max_positions: int) -> dict:
    """The head's decoder layer as a Llama config, every field it computes by written out."""
    return {"model_type": "llama", "architectures": ["LlamaForCausalLM"], "hidden_size": config.hidden_size,
            "intermediate_size": config.intermediate_size, "num_attention_heads": config.num_heads,
            "num_key_value_heads": config.num_kv_heads, "head_dim": config.head_dim, "num_hidden_layers": 1,
            "hidden_act": "silu", "rms_norm_eps": config.rms_norm_eps, "vocab_size": vocab_size,
            "max_position_embeddings": max_positions, "attention_bias": False, "mlp_bias": False,
            "tie_word_embeddings": False, "rope_theta": config.rope_theta,
            "rope_parameters": {"rope_type": "default", "rope_theta": config.rope_theta}}


def exportable(head) -> Eagle3Head:
    """The head, where another engine would draft exactly as it does here; else why not."""
    if getattr(head.config, "layout", "fused") != LAYOUT:
        raise SpecDecodeError(
            "this EAGLE head has the fused layout: it passes [feature; embedding] through one product before a "
            "plain decoder layer and predicts the target's features, where EAGLE-3 (vLLM, SGLang) puts the normed "
            "embedding and state straight into attention and has its own LM head; no renaming maps one onto the "
            "other. Train one with `specdecode train eagle --layout eagle3` (the default)")
    if len(head.config.feature_layers) != AUX_LAYERS:
        raise SpecDecodeError(f"vLLM and SGLang read {AUX_LAYERS} target layers; this head reads "
                              f"{head.config.feature_layers}")
    return head


def export(head, out: str | Path, verifier: str, architectures: list[str], vocab_size: int, max_positions: int,
           speculative_tokens: int, fmt: str = "speculators") -> Path:
    """Write the head to `out` in `fmt`; files land by rename, so a reader never sees half."""
    if fmt not in FORMATS:
        raise SpecDecodeError(f"--format: one of {', '.join(FORMATS)}, not {fmt!r}")
    head = exportable(head)
    c = head.config
    ids = head.draft_vocab.long()
    layer = layer_config(c, vocab_size, max_positions)
    tensors = {_file_name(NAMES[name], fmt): t.detach().to(torch.bfloat16).contiguous()
               for name, t in head.state_dict().items()}
    if ids.numel() != vocab_size:  # both engines map a draft id d to the target's d + d2t[d]
        tensors["d2t"] = (ids - torch.arange(ids.numel())).contiguous()
        t2d = torch.zeros(vocab_size, dtype=torch.bool)
        t2d[ids] = True
        tensors["t2d"] = t2d
    elif not torch.equal(ids, torch.arange(vocab_size)):
        raise SpecDecodeError("a draft vocabulary of every token must be in the target's order")
    aux = {"eagle_aux_hidden_state_layer_ids": list(c.feature_layers), "use_aux_hidden_state": True}
    if fmt == "speculators":
        config = {
            "speculators_model_type": "eagle3", "architectures": ["Eagle3Speculator"],
            "transformer_layer_config": layer, "draft_vocab_size": ids.numel(), "norm_before_residual": False,
            "norm_before_fc": False, "fc_norm": False, "norm_output": False, "target_hidden_size": c.hidden_size,
            "eagle_aux_hidden_state_layer_ids": list(c.feature_layers),
            "speculators_config": {
                "algorithm": "eagle3",
                "proposal_methods": [{"proposal_type": "greedy", "speculative_tokens": speculative_tokens}],
                "default_proposal_method": "greedy",
                "verifier": {"name_or_path": verifier, "architectures": architectures}},
        }
    else:
        config = layer | {"architectures": ["LlamaForCausalLMEagle3"], "draft_vocab_size": ids.numel(),
                          "target_hidden_size": c.hidden_size, "eagle_config": aux}
    return write_folder(out, WEIGHTS, tensors, CONFIG, config, indent=2)


def read(folder: str | Path, target_layers: int | None = None) -> tuple[Eagle3Head, dict]:
    """A head in either layout as an Eagle3Head (fp32), with what its config says of the
    verifier and the draft length: {"verifier", "architectures", "vocab_size",
    "speculative_tokens", "format"}. Refuses what it would not draft exactly. A config
    that names no target layers (the EAGLE repository's) reads EAGLE-3's default three,
    2, L/2 and L-3, of a target of `target_layers` layers."""
    folder = Path(folder)
    raw, layer, fmt = read_config(folder)
    tensors = _tensors(folder)
    hidden = layer["hidden_size"]
    aux = raw.get("eagle_aux_hidden_state_layer_ids") or (raw.get("eagle_config") or {}).get(
        "eagle_aux_hidden_state_layer_ids")
    if not aux and target_layers:
        aux = [2, target_layers // 2, target_layers - 3]
    if not aux:
        raise SpecDecodeError(f"{folder} does not say which target layers the head reads "
                              "(eagle_aux_hidden_state_layer_ids)")
    rope = layer.get("rope_parameters") or {}
    config = EagleConfig(
        target=(raw.get("speculators_config") or {}).get("verifier", {}).get("name_or_path") or "unknown",
        target_sha256=None, hidden_size=hidden, num_heads=layer["num_attention_heads"],
        num_kv_heads=layer.get("num_key_value_heads", layer["num_attention_heads"]),
        intermediate_size=layer["intermediate_size"], rms_norm_eps=layer.get("rms_norm_eps", 1e-6),
        rope_theta=rope.get("rope_theta", layer.get("rope_theta", 10000.0)), feature_layers=list(aux), layout=LAYOUT)
    head_dim = layer.get("head_dim") or hidden // config.num_heads
    if head_dim != config.head_dim:
        raise SpecDecodeError(f"the head's attention heads are {head_dim} wide; this head computes {config.head_dim}")
    lm = tensors[_file_name(NAMES["lm_head.weight"], fmt)]
    head = Eagle3Head(config, lm.shape[0])
    state = {}
    for name, file_name in NAMES.items():
        key = _file_name(file_name, fmt)
        if key not in tensors:
            raise SpecDecodeError(f"{folder}: no tensor {key}")
        state[name] = tensors[key].float()
    head.load_state_dict(state)
    vocab_size = layer["vocab_size"]
    if "d2t" in tensors:
        head.draft_vocab = tensors["d2t"].long() + torch.arange(lm.shape[0])
    elif lm.shape[0] == vocab_size:
        head.draft_vocab = torch.arange(vocab_size)
    else:
        raise SpecDecodeError(f"{folder}: a draft vocabulary of {lm.shape[0]} tokens needs d2t")
    head = head.eval().requires_grad_(False)
    verifier = (raw.get("speculators_config") or {}).get("verifier") or {}
    proposals = (raw.get("speculators_config") or {}).get("proposal_methods") or [{}]
    return head, {"verifier": verifier.get("name_or_path"), "architectures": verifier.get("architectures") or [],
                  "vocab_size": vocab_size, "speculative_tokens": proposals[0].get("speculative_tokens"),
                  "format": fmt}


def read_config(folder: str | Path) -> tuple[dict, dict, str]:
    """(config, its decoder layer's config, "speculators" | "eagle") of a head folder, where
    the head is one this project drafts exactly; cheap: the weights are not read."""
    folder = Path(folder)
    if not (folder / CONFIG).is_file():
        raise SpecDecodeError(f"no {CONFIG} in {folder}: not a speculators or EAGLE head folder")
    raw = json.loads((folder / CONFIG).read_text())
    if raw.get("speculators_model_type") not in (None, "eagle3"):
        raise SpecDecodeError(f"{folder} holds a speculators {raw['speculators_model_type']!r} model; "
                              "only eagle3 heads are read")
    fmt = "speculators" if "speculators_model_type" in raw else "eagle"
    layer = raw["transformer_layer_config"] if fmt == "speculators" else raw
    _refuse_what_differs(raw, layer, fmt, folder)
    return raw, layer, fmt


def _refuse_what_differs(raw: dict, layer: dict, fmt: str, folder: Path) -> None:
    """The options of other heads this one does not compute, each with its name."""
    differs = []
    if raw.get("norm_before_residual"):
        differs.append("norm_before_residual (the residual taken after hidden_norm)")
    for flag in ("norm_before_fc", "fc_norm", "norm_output"):
        if raw.get(flag):
            differs.append(flag)
    if layer.get("num_hidden_layers", 1) != 1:
        differs.append(f"{layer['num_hidden_layers']} decoder layers")
    if layer.get("model_type", "llama") != "llama":
        differs.append(f"a {layer['model_type']} decoder layer")
    if layer.get("attention_bias") or layer.get("mlp_bias"):
        differs.append("biases")
    if layer.get("hidden_act", "silu") != "silu":
        differs.append(f"the {layer['hidden_act']} activation")
    rope_type = (layer.get("rope_parameters") or layer.get("rope_scaling") or {}).get("rope_type", "default")
    if rope_type != "default":
        differs.append(f"{rope_type} rotary scaling")
    if differs:
        raise SpecDecodeError(f"the head in {folder} uses {', '.join(differs)}, which heads here do not compute; "
                              "it would draft differently, so it is not imported")


def _tensors(folder: Path) -> dict[str, torch.Tensor]:
    files = sorted(folder.glob("*.safetensors"))
    if files:
        return {k: v for f in files for k, v in load_file(f).items()}
    bins = sorted(folder.glob("pytorch_model*.bin"))
    if bins:  # the EAGLE repository's own checkpoints
        return {k: v for f in bins for k, v in torch.load(f, map_location="cpu", weights_only=True).items()}
    raise SpecDecodeError(f"no weights (*.safetensors or pytorch_model.bin) in {folder}")


def match_target(head: Eagle3Head, meta: dict, target, any_verifier: bool = False) -> Eagle3Head:
    """The imported head, bound to `target` (a models.load.LoadedModel) after checking that
    it was made for it: its shapes always; the verifier's name unless `any_verifier` (a
    fine-tune of the verifier has its shapes but other hidden states)."""
    config = json.loads((Path(target.info.folder) / CONFIG).read_text())
    config = config.get("text_config", config)
    problems = []
    if config["hidden_size"] != head.config.hidden_size:
        problems.append(f"hidden size {head.config.hidden_size}, the target's {config['hidden_size']}")
    if meta["vocab_size"] != config["vocab_size"]:
        problems.append(f"a vocabulary of {meta['vocab_size']}, the target's {config['vocab_size']}")
    if max(head.config.feature_layers) > config["num_hidden_layers"]:
        problems.append(f"layers {head.config.feature_layers}, the target has {config['num_hidden_layers']}")
    theirs, ours = set(meta["architectures"]), set(config.get("architectures") or [])
    if theirs and ours and not theirs & ours:
        problems.append(f"a {'/'.join(sorted(theirs))} verifier, the target is {'/'.join(sorted(ours))}")
    if problems:
        raise SpecDecodeError(f"this head does not fit {target.info.source}: it expects {'; '.join(problems)}")
    spec = REGISTRY.get(target.info.source)
    known = {Path(target.info.source).name.lower(), Path(target.info.folder).name.lower()}
    if spec is not None and spec.origin:
        known.add(spec.origin.split("/")[-1].lower())
    verifier = meta.get("verifier")
    if verifier and Path(verifier).name.lower() not in known and not any_verifier:
        raise SpecDecodeError(f"this head was made for {verifier}, not {target.info.source}; where the target is "
                              "that model (or a copy of it), pass --any-verifier")
    head.config.target, head.config.target_sha256 = target.info.source, target.info.sha256
    return head
