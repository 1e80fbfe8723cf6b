"""EAGLE: the head, dynamic trees decoded exactly (greedy and sampled), training, artifact."""

import numpy as np
import pytest
import torch

from specdecode.heads.eagle import model as eagle
from specdecode.heads.draft_vocab import DraftVocab
from specdecode.heads.eagle.drafter import EagleDrafter
from specdecode.core.engine import decode
from specdecode.errors import SpecDecodeError
from specdecode.core.events import collect
from specdecode.models.native import NativeModel
from specdecode.core.sampling import SamplingConfig, logits_to_probs
from specdecode.core.stopping import StopCondition
from specdecode.heads.eagle.train import (EagleTrainConfig, choose_shape, documents, measure_shape, pack, packed_loss,
                                       train)
from specdecode.heads.training.features import collect as collect_features

from .conftest import save_tiny
from .test_acceptance import assert_distributed_as


def random_head(model, seed=0):
    head = eagle.new_head(model.config, "tiny", None, intermediate_size=32, seed=seed)
    with torch.no_grad():
        for p in head.parameters():
            p.add_(torch.randn(p.shape, generator=torch.Generator().manual_seed(seed)) * 0.05)
    return head.eval().requires_grad_(False)


def lm_weight_of(folder):
    from safetensors.torch import load_file

    return load_file(f"{folder}/model.safetensors")["lm_head.weight"]


@pytest.mark.slow
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("reduced", [False, True])
def test_eagle_dynamic_tree_greedy_is_identical_to_plain(tiny_llama, dtype, reduced):
    model = NativeModel.from_folder(tiny_llama, dtype)
    stop = StopCondition(frozenset(), max_new_tokens=40)
    subset = torch.arange(0, 96, 2)  # a draft vocabulary of the even tokens
    vocab = DraftVocab.rows(lm_weight_of(tiny_llama), subset, dtype) if reduced else None
    for seed, (depth, top_k) in enumerate([(5, 3), (3, 2), (1, 1)]):
        prompt = torch.randint(0, 96, (9,), generator=torch.Generator().manual_seed(seed)).tolist()
        plain, _ = collect(decode(model, prompt, stop))
        drafter = EagleDrafter(model, random_head(model, seed), depth=depth, top_k=top_k, vocab=vocab)
        proposed = []
        propose = drafter.propose_tree
        drafter.propose_tree = lambda *a: proposed.append(propose(*a)) or proposed[-1]
        tokens, done = collect(decode(model, prompt, stop, drafter=drafter))
        assert tokens == plain
        assert done.stats.rounds < len(plain) or depth == 1
        drafted = torch.cat([p.tokens for p in proposed])
        assert drafted.numel() > 0
        if reduced:  # only the draft vocabulary is proposed; the target still says odd tokens
            assert bool(torch.isin(drafted, subset).all()) and any(t % 2 for t in plain)


@pytest.fixture(scope="module")
def tiny_vocab8(tmp_path_factory):
    """A tiny model over 8 tokens with a flat-ish distribution, for sampling statistics."""
    folder = save_tiny(tmp_path_factory.mktemp("tiny_v8"), "llama", seed=3, vocab_size=8)
    model = NativeModel.from_folder(folder, torch.float32)
    model.lm_head.weight.div_(8.0)  # undo save_tiny's sharpening: every pair of tokens is possible
    return model


@pytest.mark.slow  # 3000 sampled generations
def test_eagle_sampling_keeps_the_target_distribution(tiny_vocab8):
    """The first two sampled tokens (the second from an EAGLE tree) against the exact joint."""
    model = tiny_vocab8
    sampling = SamplingConfig(temperature=0.9)
    prompt = [1, 2, 3]
    cache = model.new_cache(1, 8)
    first = logits_to_probs(model(torch.tensor([prompt]), cache).logits[0, -1], sampling)
    joint = torch.stack([first[a] * logits_to_probs(
        model(torch.tensor([[*prompt, a]]), model.new_cache(1, 8)).logits[0, -1], sampling) for a in range(8)])
    drafter = EagleDrafter(model, random_head(model, 5), depth=3, top_k=2, num_nodes=5)
    stop = StopCondition(frozenset(), max_new_tokens=3)  # room to draft a depth-1 tree after the first
    generator = torch.Generator().manual_seed(0)
    samples, accepted = [], []
    for _ in range(3000):
        tokens, done = collect(decode(model, prompt, stop, sampling, drafter, generator=generator))
        samples.append(tokens[0] * 8 + tokens[1])
        accepted.append(done.stats.accepted_tokens)
    assert_distributed_as(np.array(samples), joint.flatten().double().numpy())
    assert np.mean(accepted) > 0.2  # the second token came from an accepted tree node often


def _grammar_features(model, layers=None):
    """40 documents of an easy grammar (each token has one successor), through the model,
    with the hidden states of `layers` (default: the final one)."""
    g = torch.Generator().manual_seed(0)
    perm = torch.randperm(96, generator=g)
    docs = []
    for start in torch.randint(0, 96, (40,), generator=g).tolist():
        doc = [start]
        while len(doc) < 40:
            doc.append(int(perm[doc[-1]]))
        docs.append(doc)
    return collect_features(model, docs, layers or (model.config.num_layers,))


@pytest.mark.slow
def test_eagle_training_reduces_held_out_loss_and_the_artifact_round_trips(tiny_llama, tmp_path):
    model = NativeModel.from_folder(tiny_llama, torch.float32)
    features = _grammar_features(model)
    lm_weight = lm_weight_of(tiny_llama)
    config = EagleTrainConfig(epochs=6, lr=3e-3, intermediate_size=64, checkpoint_every=20, tokens_per_step=80)
    head, record = train(model, features, lm_weight, config, tmp_path, "tiny", None, log=lambda _: None)
    assert record["held_out_loss_after"] < 0.7 * record["held_out_loss_before"]
    assert record["held_out_top1_after"] > record["held_out_top1_before"]
    assert torch.equal(head.draft_vocab, torch.unique(features.labels))  # the rows its loss used
    vocab = DraftVocab.rows(lm_weight, head.draft_vocab, model.dtype)
    shape = measure_shape(model, head, vocab, features, log=lambda _: None)
    # a tiny model's step is mostly overhead, so whether a tree pays depends on this machine's
    # timings: off (all zero) or a shape within the search bounds (the choice itself is
    # tested on fixed figures below)
    off = shape["depth"] == shape["top_k"] == shape["num_nodes"] == 0 and shape["expected_speedup"] == 1.0
    assert off or (1 <= shape["depth"] <= 5 and 1 <= shape["top_k"] <= 4 and 1 <= shape["num_nodes"] <= 24)
    assert len(shape["accuracy"]) == 5 and all(0 <= a <= 1 for row in shape["accuracy"] for a in row)
    assert shape["accuracy"][0][0] > 0.5  # the grammar is easy: the trained head reads it at depth 1
    head.config.tree = shape
    loaded = eagle.load(eagle.save(tmp_path / "head", head))
    assert loaded.config == head.config
    assert torch.equal(loaded.draft_vocab, head.draft_vocab)
    for (name, a), (_, b) in zip(head.state_dict().items(), loaded.state_dict().items()):
        assert torch.equal(a.to(torch.bfloat16).float(), b), name
    with pytest.raises(Exception, match="no EAGLE head"):
        eagle.load(tmp_path / "missing")


@pytest.mark.slow
def test_training_can_continue_from_a_trained_head(tiny_llama, tmp_path):
    model = NativeModel.from_folder(tiny_llama, torch.float32)
    features = _grammar_features(model)
    lm_weight = lm_weight_of(tiny_llama)
    config = EagleTrainConfig(epochs=3, lr=3e-3, intermediate_size=64, checkpoint_every=1000, tokens_per_step=80)
    quiet = lambda _: None  # noqa: E731
    for work in "abc":
        (tmp_path / work).mkdir()
    first, record = train(model, features, lm_weight, config, tmp_path / "a", "tiny", None, log=quiet)
    saved = eagle.load(eagle.save(tmp_path / "head", first))
    more, again = train(model, features, lm_weight, config, tmp_path / "b", "tiny", None, log=quiet, init=saved)
    # it starts where the first run ended (up to the artifact's bf16 rounding), not from scratch
    assert again["held_out_loss_before"] == pytest.approx(record["held_out_loss_after"], rel=0.05)
    assert again["held_out_loss_before"] < 0.7 * record["held_out_loss_before"]
    assert again["held_out_loss_after"] < again["held_out_loss_before"]
    narrower = EagleTrainConfig(epochs=1, intermediate_size=32)
    with pytest.raises(SpecDecodeError, match="another shape"):
        train(model, features, lm_weight, narrower, tmp_path / "c", "tiny", None, log=quiet, init=saved)


def test_packing_groups_documents_up_to_the_step_size():
    assert pack([3, 4, 2, 9, 1, 1], 8) == [[0, 1], [2], [3], [4, 5]]  # 9 > 8 goes alone
    assert pack([], 8) == []


@pytest.mark.parametrize("rollout", [1, 2])
def test_packed_documents_see_only_themselves(tiny_llama, rollout):
    """A pass over packed documents gives each one's loss and hits as if it ran alone."""
    model = NativeModel.from_folder(tiny_llama, torch.float32)
    g = torch.Generator().manual_seed(1)
    docs = [torch.randint(0, 96, (n,), generator=g).tolist() for n in (7, 12, 5)]
    features = collect_features(model, docs, (model.config.num_layers,))
    lm_weight = lm_weight_of(tiny_llama)
    index = torch.arange(lm_weight.shape[0])
    head = random_head(model)
    positions = documents(features, torch.arange(len(features)))
    args = (head, model.embed, features)
    together = packed_loss(*args, positions, lm_weight, index, rollout)
    alone = [packed_loss(*args, [p], lm_weight, index, rollout) for p in positions]
    count = sum(a[2] for a in alone)
    assert together[2] == count == sum(len(d) - 1 for d in docs)
    assert together[1] == sum(a[1] for a in alone)
    assert float(together[0]) == pytest.approx(sum(float(a[0]) * a[2] for a in alone) / count, rel=1e-5)


def test_tree_shape_choice_follows_acceptance_and_cost():
    flat = [1.0] * 12
    good = [[0.8, 0.1, 0.05]] * 5
    poor = [[0.3, 0.1, 0.05]] * 5
    deep = choose_shape(good, flat, draft_depth_ratio=0.02)
    shallow = choose_shape(poor, flat, draft_depth_ratio=0.2)
    assert deep["depth"] >= 4 and deep["num_nodes"] == 10
    assert shallow["depth"] < deep["depth"]
    useless = choose_shape([[0.01, 0.0]] * 3, flat, draft_depth_ratio=0.2)
    assert useless == {"depth": 0, "top_k": 0, "num_nodes": 0, "expected_speedup": 1.0}  # drafting off


def test_tree_size_is_bounded_where_bf16_rows_are_invariant_only_up_to_a_count():
    from specdecode.heads.medusa.train import MAX_TREE_NODES, max_tree_nodes

    class OneDNN:
        row_invariant_rows = 11

    class Any:
        row_invariant_rows = None

    assert max_tree_nodes(OneDNN()) == 10  # root + 10 nodes = 11 rows
    assert max_tree_nodes(Any()) == MAX_TREE_NODES


class EveryThirdRound:
    """A tree gate stand-in: open on every third round only."""

    def __init__(self):
        self.asked = 0

    def fresh(self):
        return EveryThirdRound()

    def open(self):
        self.asked += 1
        return self.asked % 3 == 0

    def observe(self, num_accepted):
        pass


@pytest.mark.slow
def test_eagle_feeds_its_head_only_on_tree_rounds_and_drafts_as_if_fed_every_round(tiny_llama):
    model = NativeModel.from_folder(tiny_llama, torch.float32)
    stop = StopCondition(frozenset(), max_new_tokens=40)
    prompt = torch.randint(0, 96, (9,), generator=torch.Generator().manual_seed(3)).tolist()
    plain, _ = collect(decode(model, prompt, stop))
    proposals, head_calls = {}, {}
    for gated in (False, True):
        drafter = EagleDrafter(model, random_head(model, 3), depth=3, top_k=2, gate=EveryThirdRound() if gated else None)
        seen = proposals[gated] = {}
        propose, head = drafter.propose_tree, drafter.head
        drafter.propose_tree = lambda context, *a: seen.setdefault(len(context), propose(context, *a))
        calls = head_calls[gated] = []
        head.register_forward_hook(lambda *_: calls.append(1))
        tokens, _ = collect(decode(model, prompt, stop, drafter=drafter))
        assert tokens == plain
    tree_rounds = [p for p in proposals[True].values() if p.tokens.numel()]
    assert 0 < len(tree_rounds) < len(proposals[True]) / 2
    assert len(head_calls[True]) == 3 * len(tree_rounds)  # the feed and two depths, on tree rounds only
    # where both runs drafted at the same context, the deferred feed gave the same tree
    common = [n for n, p in proposals[True].items() if p.tokens.numel() and n in proposals[False]]
    assert common
    for n in common:
        assert proposals[True][n].tokens.tolist() == proposals[False][n].tokens.tolist()


def fused_head(model, seed=0):
    """A random head reading the target's layers 1 and 2 fused (EAGLE-3's way)."""
    head = eagle.new_head(model.config, "tiny", None, intermediate_size=32, seed=seed, feature_layers=(1, 2))
    with torch.no_grad():
        for p in head.parameters():
            p.add_(torch.randn(p.shape, generator=torch.Generator().manual_seed(seed)) * 0.05)
    return head.eval().requires_grad_(False)


@pytest.mark.slow
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_head_fusing_several_layers_drafts_trees_greedy_identical_to_plain(tiny_llama, dtype):
    model = NativeModel.from_folder(tiny_llama, dtype)
    stop = StopCondition(frozenset(), max_new_tokens=40)
    for seed, (depth, top_k) in enumerate([(4, 3), (1, 1)]):
        prompt = torch.randint(0, 96, (9,), generator=torch.Generator().manual_seed(seed)).tolist()
        plain, _ = collect(decode(model, prompt, stop))
        head = fused_head(model, seed)
        drafter = EagleDrafter(model, head, depth=depth, top_k=top_k)
        assert drafter.target_layers == (1, 2)
        seen = []
        observe = drafter.observe_target
        drafter.observe_target = lambda hidden: seen.append(sorted(hidden)) or observe(hidden)
        tokens, done = collect(decode(model, prompt, stop, drafter=drafter))
        assert tokens == plain
        assert seen and all(layers == [1, 2] for layers in seen)  # the engine hands over both layers
        assert done.stats.rounds < len(plain) or depth == 1


@pytest.mark.slow
def test_a_fused_head_trains_and_round_trips(tiny_llama, tmp_path):
    model = NativeModel.from_folder(tiny_llama, torch.float32)
    features = _grammar_features(model, (1, 2))
    lm_weight = lm_weight_of(tiny_llama)
    config = EagleTrainConfig(epochs=6, lr=3e-3, intermediate_size=64, checkpoint_every=1000, tokens_per_step=80,
                              feature_layers=(1, 2))
    head, record = train(model, features, lm_weight, config, tmp_path, "tiny", None, log=lambda _: None)
    assert head.config.feature_layers == [1, 2] and head.fuse_layers is not None
    assert record["held_out_loss_after"] < 0.7 * record["held_out_loss_before"]
    assert record["held_out_top1_after"] > record["held_out_top1_before"]
    loaded = eagle.load(eagle.save(tmp_path / "head", head))
    assert loaded.config.feature_layers == [1, 2]
    assert torch.equal(loaded.fuse_layers.weight, head.fuse_layers.weight.to(torch.bfloat16).float())
    hidden = {layer: features.hidden[layer][:5].float() for layer in (1, 2)}
    torch.testing.assert_close(loaded.target_features(hidden, 2), head.target_features(hidden, 2), atol=0.05, rtol=0.05)


def test_feature_layers_are_checked():
    eagle.check_feature_layers(())
    eagle.check_feature_layers((2, 15, 27), 30)
    for bad in ((30,), (2, 2), (0, 5), (2, 31)):
        with pytest.raises(SpecDecodeError, match="two or more distinct layers"):
            eagle.check_feature_layers(bad, 30)
