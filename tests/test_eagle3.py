"""The EAGLE-3 layout head: exact drafting and training here."""

import pytest
import torch

from specdecode.core.engine import decode
from specdecode.core.events import collect
from specdecode.core.stopping import StopCondition
from specdecode.heads.eagle import eagle3
from specdecode.heads.eagle import model as eagle
from specdecode.heads.eagle.drafter import EagleDrafter
from specdecode.heads.eagle.parts import HeadCache
from specdecode.heads.eagle.train import (EagleTrainConfig, chain_mask, default_feature_layers, documents,
                                          measure_shape, packed_loss, train)
from specdecode.heads.training.features import collect as collect_features
from specdecode.models.native import NativeModel

from .test_eagle import _grammar_features, lm_weight_of


def eagle3_head(model, lm_weight, seed=0, vocab=None, layers=(1, 2)):
    """A random EAGLE-3 head over the target's `layers` (a draft vocabulary of `vocab`,
    default all tokens), its weights perturbed off their initial values."""
    vocab = torch.arange(lm_weight.shape[0]) if vocab is None else vocab
    head = eagle3.new_head(model.config, "tiny", None, lm_weight[vocab], vocab, layers, intermediate_size=32, seed=seed)
    with torch.no_grad():
        for p in head.parameters():
            p.add_(torch.randn(p.shape, generator=torch.Generator().manual_seed(seed)) * 0.05)
    return head.eval().requires_grad_(False)


def test_default_feature_layers_are_a_low_a_middle_and_a_high_one():
    assert default_feature_layers(30) == (2, 15, 27)
    assert default_feature_layers(28) == (2, 14, 25)
    assert default_feature_layers(2) == (1, 2)


@pytest.mark.slow
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_an_eagle3_head_drafts_trees_greedy_identical_to_plain(tiny_llama, dtype):
    model = NativeModel.from_folder(tiny_llama, dtype)
    lm_weight = lm_weight_of(tiny_llama)
    stop = StopCondition(frozenset(), max_new_tokens=40)
    subset = torch.arange(0, 96, 2)
    for seed, (depth, top_k, vocab) in enumerate([(4, 3, None), (3, 2, subset), (1, 1, None)]):
        prompt = torch.randint(0, 96, (9,), generator=torch.Generator().manual_seed(seed)).tolist()
        plain, _ = collect(decode(model, prompt, stop))
        drafter = EagleDrafter(model, eagle3_head(model, lm_weight, seed, vocab), depth=depth, top_k=top_k)
        assert drafter.target_layers == (1, 2)
        proposed = []
        propose = drafter.propose_tree
        drafter.propose_tree = lambda *a: proposed.append(propose(*a)) or proposed[-1]
        tokens, done = collect(decode(model, prompt, stop, drafter=drafter))
        assert tokens == plain
        drafted = torch.cat([p.tokens for p in proposed])
        assert drafted.numel() > 0
        if vocab is not None:  # it proposes only from its draft vocabulary
            assert bool(torch.isin(drafted, vocab).all())


@pytest.mark.slow
def test_an_eagle3_head_trains_and_round_trips(tiny_llama, tmp_path):
    model = NativeModel.from_folder(tiny_llama, torch.float32)
    features = _grammar_features(model, (1, 2))
    lm_weight = lm_weight_of(tiny_llama)
    config = EagleTrainConfig(epochs=6, lr=3e-3, intermediate_size=64, checkpoint_every=1000, tokens_per_step=80,
                              layout="eagle3")
    head, record = train(model, features, lm_weight, config, tmp_path, "tiny", None, log=lambda _: None)
    assert isinstance(head, eagle3.Eagle3Head) and head.config.feature_layers == [1, 2]
    assert record["held_out_loss_after"] < 0.5 * record["held_out_loss_before"]
    assert record["held_out_top1_after"] > 0.5 > record["held_out_top1_before"]
    assert torch.equal(head.draft_vocab, torch.unique(features.labels))
    head.config.tree = measure_shape(model, head, head.vocabulary(model), features, log=lambda _: None)
    assert head.config.tree["accuracy"][0][0] > 0.5  # the grammar is easy: read at depth 1
    loaded = eagle.load(eagle.save(tmp_path / "head", head))
    assert isinstance(loaded, eagle3.Eagle3Head) and loaded.config == head.config
    assert torch.equal(loaded.draft_vocab, head.draft_vocab)
    for (name, a), (_, b) in zip(head.state_dict().items(), loaded.state_dict().items()):
        assert torch.equal(a.to(torch.bfloat16).float(), b), name


def test_chain_mask_shows_each_rollout_row_its_root_context_and_its_chain():
    doc, positions = torch.tensor([0, 0, 0, 1, 1]), torch.tensor([0, 1, 2, 0, 1])
    assert torch.equal(chain_mask(doc, positions, 0), (doc[:, None] == doc[None]) & (positions[:, None] >= positions[None]))
    two = chain_mask(doc, positions, 2)  # row 2 (pair 2 of document 0): the chain rooted at pair 0
    assert two.shape == (5, 15)
    assert two[2].nonzero()[:, 0].tolist() == [0, 5 + 1, 10 + 2]  # pair 0; step 1's row 1; itself
    assert not two[3:, :5].any()  # document 1 has no pair two back: no root, no context


@pytest.mark.parametrize("rollout", [2, 3])
def test_rollout_steps_compute_what_drafting_computes(tiny_llama, rollout):
    """Row j of rollout step s is the node at depth s + 1 of the chain drafted from pair
    j - s with the text's own tokens: the same state as drafting it with the head's cache."""
    model = NativeModel.from_folder(tiny_llama, torch.float32)
    g = torch.Generator().manual_seed(2)
    docs = [torch.randint(0, 96, (n,), generator=g).tolist() for n in (9, 6)]
    features = collect_features(model, docs, (1, 2))
    lm_weight = lm_weight_of(tiny_llama)
    head = eagle3_head(model, lm_weight, seed=3)
    steps = []
    hook = head.register_forward_hook(lambda _m, _a, out: steps.append(out.detach()))
    rows = documents(features, torch.arange(len(features)))
    packed_loss(head, model.embed, features, rows, lm_weight, torch.arange(96), rollout)
    hook.remove()
    assert len(steps) == rollout
    first = rows[0]  # the first document's rows come first in the packed pass
    tokens, L = features.tokens[first], len(first)
    with torch.no_grad():
        states = head.target_features({l: features.hidden[l][first[:-1]].float() for l in (1, 2)}, 2)
        for root in range(L - rollout):
            cache = HeadCache()
            node = head(states[:root + 1], model.embed[tokens[1:root + 2]], torch.arange(root + 1), cache)[-1:]
            torch.testing.assert_close(node[0], steps[0][root])
            for depth in range(1, rollout):  # the chain's next node: the state before, the text's next token
                node = head(node, model.embed[tokens[root + depth + 1:root + depth + 2]],
                            torch.tensor([root + depth]), cache)
                torch.testing.assert_close(node[0], steps[depth][root + depth], atol=1e-5, rtol=1e-5)
