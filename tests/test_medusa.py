"""Medusa: heads, artifact, training on a tiny model, and exact decoding with its trees."""

import pytest
import torch

from specdecode.heads.medusa import model as medusa
from specdecode.heads.draft_vocab import DraftVocab
from specdecode.heads.medusa.drafter import MedusaDrafter
from specdecode.core.engine import decode
from specdecode.core.events import collect
from specdecode.models.native import NativeModel
from specdecode.core.stopping import StopCondition
from specdecode.heads.training.features import Features, collect as collect_features
from specdecode.heads.medusa.train import TrainConfig, head_labels, split, train
from specdecode.policy.tree_shapes import choose_tree, expected_tokens_of_tree, grow_tree, num_leaves

TREE = [(0,), (1,), (2,), (0, 0), (0, 1), (1, 0), (0, 0, 0), (0, 0, 1), (0, 1, 0), (0, 0, 0, 0)]


def lm_weight_of(folder):
    from safetensors.torch import load_file

    return load_file(f"{folder}/model.safetensors")["lm_head.weight"]


def random_heads(hidden_size: int, num_heads: int = 4, seed: int = 0) -> medusa.MedusaHeads:
    heads = medusa.MedusaHeads(num_heads, hidden_size)
    with torch.no_grad():
        heads.weight.normal_(0, 0.3, generator=torch.Generator().manual_seed(seed))
    return heads.requires_grad_(False)


@pytest.mark.slow
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("reduced", [False, True])
def test_medusa_tree_decoding_is_identical_to_plain_greedy(tiny_llama, dtype, reduced):
    model = NativeModel.from_folder(tiny_llama, dtype)
    stop = StopCondition(frozenset(), max_new_tokens=40)
    subset = torch.arange(1, 96, 2)  # a draft vocabulary of the odd tokens
    vocab = DraftVocab.rows(lm_weight_of(tiny_llama), subset, dtype) if reduced else None
    for seed in range(3):
        prompt = torch.randint(0, 96, (12,), generator=torch.Generator().manual_seed(seed)).tolist()
        plain, _ = collect(decode(model, prompt, stop))
        drafter = MedusaDrafter(model, random_heads(64, seed=seed), TREE, vocab)
        proposed = []
        propose = drafter.propose_tree
        drafter.propose_tree = lambda *a: proposed.append(propose(*a)) or proposed[-1]
        tokens, done = collect(decode(model, prompt, stop, drafter=drafter))
        assert tokens == plain
        assert done.stats.rounds < len(plain)  # the heads' trees were accepted sometimes
        assert max(done.stats.drafted_at and [len(done.stats.drafted_at)]) <= 4
        if reduced:  # only the draft vocabulary is proposed; the target still says even tokens
            assert bool(torch.isin(torch.cat([p.tokens for p in proposed]), subset).all())
            assert any(t % 2 == 0 for t in plain)


@pytest.mark.slow
def test_medusa_sampling_keeps_the_stream_valid_and_seeded(tiny_llama):
    from specdecode.core.sampling import SamplingConfig

    model = NativeModel.from_folder(tiny_llama, torch.float32)
    stop = StopCondition(frozenset(), max_new_tokens=30)
    drafter = MedusaDrafter(model, random_heads(64), TREE)
    runs = [collect(decode(model, [1, 2, 3], stop, SamplingConfig(temperature=0.8), drafter,
                           generator=torch.Generator().manual_seed(7)))[0] for _ in range(2)]
    assert runs[0] == runs[1] and len(runs[0]) == 30


def tiny_features(model, num_docs=40, length=48, seed=0) -> Features:
    """Documents of a fixed "grammar" (each token followed by perm[token]): what comes two
    tokens later is predictable from the current one, as in real text (and unlike i.i.d.
    random tokens); held-out documents start elsewhere but follow the same grammar."""
    g = torch.Generator().manual_seed(seed)
    perm = torch.randperm(96, generator=g)
    docs = []
    for start in torch.randint(0, 96, (num_docs,), generator=g).tolist():
        doc = [start]
        while len(doc) < length:
            doc.append(int(perm[doc[-1]]))
        docs.append(doc)
    return collect_features(model, docs, (model.config.num_layers,))


def test_head_labels_stay_inside_a_document():
    f = Features(torch.arange(6), torch.tensor([10, 11, 12, 13, 14, 15]), torch.tensor([0, 0, 0, 1, 1, 1]), {})
    labels, valid = head_labels(f, 2)
    assert labels[:, 0].tolist()[:5] == [11, 12, 13, 14, 15] and labels[:, 1].tolist()[:4] == [12, 13, 14, 15]
    assert valid[:, 0].tolist() == [True, True, False, True, True, False]
    assert valid[:, 1].tolist() == [True, False, False, True, False, False]


def test_held_out_split_keeps_each_source_on_one_side():
    # 200 documents of 3 positions from 40 sources, 5 documents each
    doc_ids = torch.arange(200).repeat_interleave(3)
    sources = [f"stdlib/module{d % 40}" for d in range(200)]
    f = Features(torch.zeros(600, dtype=torch.long), torch.zeros(600, dtype=torch.long), doc_ids, {}, sources=sources)
    train_idx, held_idx = split(f)
    assert len(held_idx) and len(train_idx) and len(held_idx) + len(train_idx) == 600
    held_sources = {sources[d] for d in doc_ids[held_idx].tolist()}
    train_sources = {sources[d] for d in doc_ids[train_idx].tolist()}
    assert not held_sources & train_sources
    # whole documents either side; by document (every 20th) where sources are unknown
    f.sources = None
    train_idx, held_idx = split(f)
    assert set(doc_ids[held_idx].tolist()) == set(range(19, 200, 20))


@pytest.mark.slow
def test_training_reduces_held_out_loss_and_resumes(tiny_llama, tmp_path):
    model = NativeModel.from_folder(tiny_llama, torch.float32)
    features = tiny_features(model)
    lm_weight = lm_weight_of(tiny_llama)
    config = TrainConfig(num_heads=2, epochs=6, batch_size=64, lr=3e-3, checkpoint_every=5)
    heads, record = train(model, features, lm_weight, config, tmp_path, log=lambda _: None)
    assert record["held_out_loss_after"] < 0.8 * record["held_out_loss_before"]
    assert len(record["accuracy"]) == 2 and all(0 <= a <= 1 for row in record["accuracy"] for a in row)
    assert torch.equal(heads.draft_vocab, torch.unique(features.labels))  # the rows its loss used
    # a rerun with the same settings finds the finished checkpoint and does no more steps
    again, record2 = train(model, features, lm_weight, config, tmp_path, log=lambda _: None)
    assert torch.equal(again.weight, heads.weight) and record2["held_out_loss_after"] == record["held_out_loss_after"]


def test_artifact_round_trip_and_missing_heads(tmp_path):
    heads = random_heads(16, num_heads=2)
    config = medusa.MedusaConfig("t", "abc", 16, 2, [[0.5, 0.1], [0.3, 0.1]], [[0], [0, 0]], {"steps": 1})
    loaded, loaded_config = medusa.load(medusa.save(tmp_path / "m", heads, config))
    assert loaded_config == config and loaded.draft_vocab is None
    assert torch.equal(loaded.weight, heads.weight.to(torch.bfloat16).float())
    heads.draft_vocab = torch.tensor([3, 5, 8])
    assert torch.equal(medusa.load(medusa.save(tmp_path / "v", heads, config))[0].draft_vocab, heads.draft_vocab)
    assert not list((tmp_path / "m").glob("*.partial"))
    from specdecode.errors import SpecDecodeError
    with pytest.raises(SpecDecodeError, match="no Medusa heads"):
        medusa.load(tmp_path / "nothing")


def test_tree_shape_grows_best_first_and_pays_for_its_cost():
    accuracy = [[0.6, 0.2, 0.1], [0.5, 0.25, 0.1], [0.4, 0.1, 0.05]]
    grown = grow_tree(accuracy, 5)
    assert grown == [(0,), (0, 0), (1,), (0, 1), (0, 0, 0)]  # 0.6, 0.3, 0.2, 0.15, 0.12
    assert expected_tokens_of_tree(grown, accuracy) == pytest.approx(1 + 0.6 + 0.3 + 0.2 + 0.15 + 0.12)
    flat = [1.0] * 12
    paths, speedup = choose_tree(accuracy, flat, 0.05, 10)
    assert len(paths) == 10 and speedup > 1  # verifying more is free: take every node offered
    steep = [1.0 + 0.3 * n for n in range(12)]
    paths, _ = choose_tree(accuracy, steep, 0.05, 10)
    assert len(paths) <= 2  # each extra node costs 30% of a step: only the likeliest pay
    assert choose_tree([[0.01]], steep, 0.5, 10) == ([], 1.0)  # nothing pays: off


def test_each_extra_root_to_leaf_path_costs_its_attention():
    assert num_leaves([]) == 1 and num_leaves([(0,), (0, 0), (0, 0, 0)]) == 1
    assert num_leaves([(0,), (1,), (0, 0), (0, 1), (0, 0, 0)]) == 3  # leaves (1,), (0, 1), (0, 0, 0)
    accuracy = [[0.6, 0.2, 0.1], [0.5, 0.25, 0.1], [0.4, 0.1, 0.05]]
    flat = [1.0] * 12
    free, free_speedup = choose_tree(accuracy, flat, 0.05, 10, leaf_ratio=0.0)
    dear, speedup = choose_tree(accuracy, flat, 0.05, 10, leaf_ratio=0.2)
    assert num_leaves(dear) < num_leaves(free)  # paid paths: fewer branches
    assert 1 < speedup < free_speedup  # and the branches it keeps are paid for
    # a chain has one path: what extra paths cost does not touch it
    chain_only = [[0.9, 0.0, 0.0]] * 4
    chain, chain_speedup = choose_tree(chain_only, flat, 0.05, 10, leaf_ratio=0.0)
    assert num_leaves(chain) == 1 and choose_tree(chain_only, flat, 0.05, 10, leaf_ratio=5.0) == (chain, chain_speedup)


@pytest.mark.slow
def test_a_gated_medusa_drafter_stops_drafting_where_it_is_never_accepted(tiny_llama):
    from specdecode.policy.gate import TreeGate
    from specdecode.core.events import Round

    model = NativeModel.from_folder(tiny_llama, torch.float32)
    prompt, stop = [5, 17, 42, 8, 91], StopCondition(max_new_tokens=60)
    plain, _ = collect(decode(model, prompt, stop))
    useless = random_heads(64, seed=5)
    useless.weight.mul_(40.0)  # candidates far from what the target says
    rounds = {}
    for gated in (False, True):
        gate = TreeGate(round_cost=1.3, prior_tokens=2.5) if gated else None
        drafter = MedusaDrafter(model, useless, TREE, gate=gate)
        events = [ev for ev in decode(model, prompt, stop, drafter=drafter) if isinstance(ev, Round)]
        assert [t for ev in events for t in ev.token_ids] == plain
        rounds[gated] = events
    assert sum(ev.num_accepted for ev in rounds[False]) <= 0.1 * len(rounds[False])  # useless indeed
    assert sum(1 for ev in rounds[True] if ev.num_drafted) <= 0.3 * len(rounds[True])
