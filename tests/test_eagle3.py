"""The EAGLE-3 layout head: exact drafting and training here."""

import pytest
import torch

from specdecode.core.engine import decode
from specdecode.core.events import collect
from specdecode.core.stopping import StopCondition
from specdecode.heads.eagle import eagle3
from specdecode.heads.eagle import model as eagle
from specdecode.heads.eagle.drafter import EagleDrafter
from specdecode.heads.eagle.train import EagleTrainConfig, default_feature_layers, measure_shape, train
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
