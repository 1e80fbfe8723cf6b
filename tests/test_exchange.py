"""Heads out to vLLM's and SGLang's formats and back; tune's settings as vLLM's config."""

import json
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file

from specdecode.commands import vllm_config
from specdecode.commands.tune import measure_costs
from specdecode.core.engine import decode
from specdecode.core.events import collect
from specdecode.core.stopping import StopCondition
from specdecode.drafters.prompt_lookup import PromptLookup
from specdecode.errors import SpecDecodeError
from specdecode.heads.draft_vocab import DraftVocab
from specdecode.heads.eagle import exchange
from specdecode.heads.eagle.drafter import EagleDrafter
from specdecode.heads.medusa import exchange as medusa_exchange
from specdecode.heads.medusa.model import MedusaConfig, MedusaHeads
from specdecode.models.native import NativeModel
from specdecode.policy.profile import Profile

from .conftest import save_tiny
from .test_eagle import lm_weight_of, random_head
from .test_eagle3 import eagle3_head

SUBSET = torch.arange(1, 96, 3)  # a draft vocabulary not starting at 0, with gaps


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory):
    """Four layers: vLLM's and SGLang's heads read three."""
    return save_tiny(tmp_path_factory.mktemp("tiny4"), "llama", seed=0, num_hidden_layers=4)


def three_layer_head(model, lm_weight, seed=0, vocab=SUBSET):
    return eagle3_head(model, lm_weight, seed, vocab, layers=(1, 2, 4))


def bf16(head):
    """The head as an export carries it: weights rounded to bf16."""
    with torch.no_grad():
        for p in head.parameters():
            p.copy_(p.to(torch.bfloat16).float())
    return head


def test_speculators_export_names_every_field_and_tensor(tiny_llama, tmp_path):
    model = NativeModel.from_folder(tiny_llama, torch.float32)
    head = three_layer_head(model, lm_weight_of(tiny_llama))
    out = exchange.export(head, tmp_path / "x", "org/tiny", ["LlamaForCausalLM"], 96, 256, 4)
    config = json.loads((out / "config.json").read_text())
    assert config["speculators_model_type"] == "eagle3" and config["architectures"] == ["Eagle3Speculator"]
    assert config["norm_before_residual"] is False and config["draft_vocab_size"] == SUBSET.numel()
    assert config["eagle_aux_hidden_state_layer_ids"] == [1, 2, 4] and config["target_hidden_size"] == 64
    assert config["transformer_layer_config"]["num_hidden_layers"] == 1
    assert config["transformer_layer_config"]["vocab_size"] == 96
    spec = config["speculators_config"]
    assert spec["proposal_methods"] == [{"proposal_type": "greedy", "speculative_tokens": 4}]
    assert spec["verifier"] == {"name_or_path": "org/tiny", "architectures": ["LlamaForCausalLM"]}
    tensors = load_file(out / "model.safetensors")
    assert set(tensors) == set(exchange.NAMES.values()) | {"d2t", "t2d"}
    assert tensors["fc.weight"].shape == (64, 3 * 64)
    assert tensors["layers.0.self_attn.q_proj.weight"].shape[1] == 2 * 64
    assert tensors["lm_head.weight"].shape == (SUBSET.numel(), 64)
    assert torch.equal(torch.arange(SUBSET.numel()) + tensors["d2t"], SUBSET)  # draft id d -> d + d2t[d]
    assert torch.equal(tensors["t2d"].nonzero()[:, 0], SUBSET)


@pytest.mark.parametrize("fmt", ["speculators", "eagle"])
def test_an_exported_head_reads_back_and_drafts_greedy_identical_to_plain(tiny_llama, tmp_path, fmt):
    model = NativeModel.from_folder(tiny_llama, torch.float32)
    head = bf16(three_layer_head(model, lm_weight_of(tiny_llama), seed=1))
    out = exchange.export(head, tmp_path / fmt, "org/tiny", [], 96, 256, 3, fmt)
    if fmt == "eagle":
        names = set(load_file(out / "model.safetensors"))
        assert "midlayer.self_attn.q_proj.weight" in names and not any(n.startswith("layers.") for n in names)
    back, meta = exchange.read(out)
    assert meta["format"] == fmt and meta["vocab_size"] == 96
    assert torch.equal(back.draft_vocab, SUBSET) and back.config.feature_layers == [1, 2, 4]
    for name, tensor in head.state_dict().items():
        assert torch.equal(back.state_dict()[name], tensor), name
    stop = StopCondition(frozenset(), max_new_tokens=30)
    prompt = torch.randint(0, 96, (9,), generator=torch.Generator().manual_seed(4)).tolist()
    plain, _ = collect(decode(model, prompt, stop))
    drafts = []
    for h in (head, back):
        drafter = EagleDrafter(model, h, depth=3, top_k=2, num_nodes=6)
        propose, seen = drafter.propose_tree, []
        drafter.propose_tree = lambda *a: seen.append(propose(*a)) or seen[-1]  # noqa: B023
        tokens, _ = collect(decode(model, prompt, stop, drafter=drafter))
        assert tokens == plain
        drafts.append([p.tokens.tolist() for p in seen])
    assert drafts[0] == drafts[1] and any(drafts[0])


def test_a_fused_head_is_refused_with_the_reason(tiny_llama, tmp_path):
    model = NativeModel.from_folder(tiny_llama, torch.float32)
    with pytest.raises(SpecDecodeError, match="fused layout.*--layout eagle3"):
        exchange.export(random_head(model), tmp_path / "x", "org/tiny", [], 96, 256, 3)
    two = eagle3_head(model, lm_weight_of(tiny_llama))
    with pytest.raises(SpecDecodeError, match="read 3 target layers"):
        exchange.export(two, tmp_path / "x", "org/tiny", [], 96, 256, 3)
    assert not (tmp_path / "x").exists()


@pytest.mark.parametrize("change, message", [
    ({"norm_before_residual": True}, "norm_before_residual"),
    ({"fc_norm": True}, "fc_norm"),
    ({"transformer_layer_config": {"num_hidden_layers": 2}}, "2 decoder layers"),
    ({"transformer_layer_config": {"rope_parameters": {"rope_type": "llama3", "rope_theta": 5e5}}}, "llama3 rotary"),
    ({"transformer_layer_config": {"attention_bias": True}}, "biases"),
    ({"speculators_model_type": "mlp_speculator"}, "only eagle3"),
])
def test_a_head_that_would_draft_differently_is_not_imported(tiny_llama, tmp_path, change, message):
    model = NativeModel.from_folder(tiny_llama, torch.float32)
    out = exchange.export(three_layer_head(model, lm_weight_of(tiny_llama)), tmp_path, "org/tiny", [], 96, 256, 3)
    config = json.loads((out / "config.json").read_text())
    for key, value in change.items():
        config[key] = config[key] | value if isinstance(value, dict) else value
    (out / "config.json").write_text(json.dumps(config))
    with pytest.raises(SpecDecodeError, match=message):
        exchange.read(out)


def test_an_imported_head_is_checked_against_the_target(tiny_llama, tmp_path):
    model = NativeModel.from_folder(tiny_llama, torch.float32)
    out = exchange.export(three_layer_head(model, lm_weight_of(tiny_llama)), tmp_path / "x", "org/tiny-llama", [],
                          96, 256, 3)
    target = SimpleNamespace(info=SimpleNamespace(source="tiny-llama", folder=Path(tiny_llama), sha256="abc"))
    head = exchange.match_target(*exchange.read(out), target)
    assert (head.config.target, head.config.target_sha256) == ("tiny-llama", "abc")
    other = SimpleNamespace(info=SimpleNamespace(source="other", folder=Path(tiny_llama), sha256=None))
    with pytest.raises(SpecDecodeError, match="made for org/tiny-llama.*--any-verifier"):
        exchange.match_target(*exchange.read(out), other)
    assert exchange.match_target(*exchange.read(out), other, any_verifier=True).config.target == "other"
    config = json.loads((out / "config.json").read_text())
    config["transformer_layer_config"]["vocab_size"] = 128
    (out / "config.json").write_text(json.dumps(config))
    with pytest.raises(SpecDecodeError, match="a vocabulary of 128"):
        exchange.match_target(*exchange.read(out), target)


def test_medusa_export_computes_what_vllm_computes_from_it(tiny_llama, tmp_path):
    lm_weight = lm_weight_of(tiny_llama)
    heads = MedusaHeads(3, 64)
    with torch.no_grad():
        heads.weight.normal_(0, 0.1)
        heads.bias.normal_(0, 0.1)
        heads.weight.copy_(heads.weight.to(torch.bfloat16).float())
        heads.bias.copy_(heads.bias.to(torch.bfloat16).float())
    heads.draft_vocab = SUBSET
    out = medusa_exchange.export(heads, MedusaConfig("tiny", None, 64, 3), lm_weight, tmp_path)
    config, tensors = json.loads((out / "config.json").read_text()), load_file(out / "model.safetensors")
    assert config["truncated_vocab_size"] == SUBSET.numel() and config["original_lm_head"] is True
    hidden = torch.randn(5, 64)
    ours = DraftVocab.rows(lm_weight, SUBSET, torch.float32)
    for i in range(3):  # vLLM: x + silu(layer(x)), the shared LM head's rows, scattered to token_map
        w, b = tensors[f"blocks.{i}.layers.0.weight"].float(), tensors[f"blocks.{i}.layers.0.bias"].float()
        theirs = (hidden + F.silu(hidden @ w.T + b)) @ tensors["lm_head.weight"].float().T
        full = torch.full((5, 96), float("-inf"))
        full[:, tensors["token_map"]] = theirs
        mine = ours.tokens(ours.logits(heads(hidden)[i]).argmax(-1))
        assert torch.equal(full.argmax(-1), mine)
    back = medusa_exchange.read(out, lm_weight)
    assert torch.equal(back.weight, heads.weight) and torch.equal(back.draft_vocab, SUBSET)
    tensors["lm_head.weight"] = torch.randn_like(tensors["lm_head.weight"])
    save_file(tensors, out / "model.safetensors")
    with pytest.raises(SpecDecodeError, match="not the target's LM head"):
        medusa_exchange.read(out, lm_weight)


def test_tune_writes_each_categorys_speculative_config_for_vllm(tmp_path):
    verify = {1: 0.10, 2: 0.101, 4: 0.103, 8: 0.11, 16: 0.13}
    drafters = {"draft-model": {"draft": "qwen2.5-coder-0.5b-instruct", "step_s": 0.03},
                "prompt-lookup": {"draft": None, "step_s": 0.0}}
    profile = Profile("qwen2.5-coder-1.5b-instruct", "bfloat16", verify, drafters)
    profile.decide("code", {"draft-model": 0.9, "prompt-lookup": 0.3})
    profile.decide("edit", {"draft-model": 0.9, "prompt-lookup": 0.8})
    profile.decide("prose", {"draft-model": 0.1, "prompt-lookup": 0.0})
    written = json.loads(vllm_config.write(profile, tmp_path / "p.vllm.json").read_text())["categories"]
    code, edit, prose = written["code"], written["edit"], written["prose"]
    assert code["speculative_config"] == {"model": "Qwen/Qwen2.5-Coder-0.5B-Instruct",
                                          "num_speculative_tokens": profile.categories["code"]["k"]}
    assert edit["speculative_config"] == {"method": "ngram", "num_speculative_tokens": profile.categories["edit"]["k"],
                                          "prompt_lookup_min": 1, "prompt_lookup_max": 3}
    assert code["alternatives"]["prompt-lookup"]["speculative_config"]["method"] == "ngram"
    assert prose["speculative_config"] is None and "without one" in prose["why"]
    assert not list(tmp_path.glob("*.partial"))


def test_tune_times_prompt_lookup_as_a_lookup(tiny_llama):
    model = NativeModel.from_folder(tiny_llama, torch.float32)
    verify, steps = measure_costs(model, {"prompt-lookup": PromptLookup()}, context=64, repeats=2)
    assert set(verify) >= {1, 8} and all(s > 0 for s in verify.values())
    assert 0 < steps["prompt-lookup"] < verify[1]  # a lookup costs less than a target pass


def test_the_exported_draft_length_is_the_one_that_pays_where_verifying_is_free():
    from specdecode.commands.exchange import free_verify_chain

    # the shipped SmolLM2 head's accuracies: depth 3 adds 0.07 tokens for 0.13 of a step
    assert free_verify_chain({"accuracy": [[0.529], [0.456], [0.277], [0.183]], "head_step_ratio": 0.133}) == 2
    assert free_verify_chain({"accuracy": [[0.9]] * 4, "head_step_ratio": 0.05}) == 4  # accurate and cheap: all
    assert free_verify_chain({"accuracy": [[0.9]] * 4, "head_step_ratio": 2.0}) == 1  # a dear head: one
    assert free_verify_chain({}) == 3  # nothing recorded: a common default


def test_an_eagle_layout_config_without_layer_ids_reads_eagle3s_default_three(tiny_llama, tmp_path):
    model = NativeModel.from_folder(tiny_llama, torch.float32)
    out = exchange.export(three_layer_head(model, lm_weight_of(tiny_llama)), tmp_path, "org/tiny", [], 96, 256, 3,
                          "eagle")
    config = json.loads((out / "config.json").read_text())
    del config["eagle_config"]  # as the EAGLE repository's own configs have it
    (out / "config.json").write_text(json.dumps(config))
    with pytest.raises(SpecDecodeError, match="which target layers"):
        exchange.read(out)
    assert exchange.read(out, target_layers=32)[0].config.feature_layers == [2, 16, 29]
