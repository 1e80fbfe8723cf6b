"""Batched greedy answers (training text in the target's own words) equal decoding each
prompt alone, token for token, whatever the other rows and the padding."""

import pytest
import torch

from specdecode.core.engine import decode
from specdecode.core.events import collect
from specdecode.models.native import NativeModel
from specdecode.core.stopping import StopCondition
from specdecode.heads.training.batch_greedy import greedy_answers, left_padded

PROMPTS = [[5, 17, 42, 8, 17, 42, 8, 91, 5, 17, 42], [3, 9], [60, 61, 62, 63, 64], [7]]


def alone(model, prompt, max_new, eos=frozenset()):
    answer, _ = collect(decode(model, prompt, StopCondition(eos, max_new_tokens=max_new)))
    return answer


def test_left_padded_masks_hide_pads_only():
    tokens, positions, mask = left_padded([[1, 2, 3], [4]])
    assert tokens.tolist() == [[1, 2, 3], [0, 0, 4]]
    assert positions.tolist() == [[0, 1, 2], [0, 0, 0]]
    assert mask[1].tolist() == [[True, False, False], [False, True, False], [False, False, True]]
    assert mask[0].tolist() == [[True, False, False], [True, True, False], [True, True, True]]


@pytest.mark.slow
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("fixture", ["tiny_llama", "tiny_qwen2"])
def test_batched_answers_equal_each_prompt_alone(request, fixture, dtype):
    model = NativeModel.from_folder(request.getfixturevalue(fixture), dtype)
    answers = greedy_answers(model, PROMPTS, 24, frozenset())
    assert [len(a) for a in answers] == [24] * len(PROMPTS)
    assert answers == [alone(model, p, 24) for p in PROMPTS]


@pytest.mark.slow
def test_answers_stop_at_their_own_eos(tiny_llama):
    model = NativeModel.from_folder(tiny_llama, torch.float32)
    free = greedy_answers(model, PROMPTS, 20, frozenset())
    eos = frozenset({free[0][5]})  # a token the first answer emits at its sixth step
    answers = greedy_answers(model, PROMPTS, 20, eos)
    assert answers[0] == free[0][:free[0].index(free[0][5]) + 1]
    assert answers == [alone(model, p, 20, eos) for p in PROMPTS]
    assert greedy_answers(model, PROMPTS, 0, eos) == [[]] * len(PROMPTS)


@pytest.mark.slow
def test_answer_features_match_a_teacher_forced_pass(tiny_qwen2):
    from specdecode.heads.training.batch_greedy import answer_features
    from specdecode.heads.training.features import collect

    model = NativeModel.from_folder(tiny_qwen2, torch.float32)
    answers = greedy_answers(model, PROMPTS, 12, frozenset())
    layer = model.config.num_layers
    got = answer_features(model, PROMPTS, 12, frozenset(), first_doc=7, layers=(1,))  # and the final layer
    want = collect(model, [p + a[:-1] for p, a in zip(PROMPTS, answers)], (1, layer))
    assert torch.equal(got.tokens, want.tokens)
    assert torch.equal(got.labels, want.labels)
    assert torch.equal(got.doc_ids, want.doc_ids + 7)
    assert sorted(got.hidden) == [1, layer]
    for kept in (1, layer):  # an inner layer's residual stream too, not a buffer written over later
        torch.testing.assert_close(got.hidden[kept].float(), want.hidden[kept].float(), atol=2e-2, rtol=2e-2)
    ends = torch.cumsum(torch.tensor([len(p) + len(a) - 1 for p, a in zip(PROMPTS, answers)]), 0) - 1
    assert got.labels[ends].tolist() == [a[-1] for a in answers]  # each answer's last token: a label only
    within = torch.cat([torch.arange(len(p) + len(a) - 1) for p, a in zip(PROMPTS, answers)])
    prompt_len = torch.cat([torch.full((len(p) + len(a) - 1,), len(p)) for p, a in zip(PROMPTS, answers)])
    assert torch.equal(got.drafted, within >= prompt_len - 1)  # drafting starts at a prompt's last token


def test_concat_renumbers_documents_and_keeps_drafted():
    from specdecode.heads.training.features import Features, concat

    def part(doc_ids, drafted=None):
        n = len(doc_ids)
        return Features(torch.arange(n), torch.arange(n), torch.tensor(doc_ids), {2: torch.zeros(n, 4)}, drafted)

    answers = part([64, 64, 65], torch.tensor([False, True, True]))
    source = part([0, 0, 1, 1])
    both = concat([answers, source])
    assert both.doc_ids.tolist() == [0, 0, 1, 2, 2, 3, 3]
    assert both.drafted.tolist() == [False, True, True, False, False, False, False]
    assert both.drafted_among(torch.tensor([0, 1, 5])).tolist() == [1]
    assert source.drafted_among(torch.tensor([0, 3])).tolist() == [0, 3]  # nothing drafted: all of them


def test_concat_keeps_each_document_with_its_source():
    from specdecode.heads.training.features import Features, concat

    def part(doc_ids, sources):
        n = len(doc_ids)
        return Features(torch.arange(n), torch.arange(n), torch.tensor(doc_ids), {2: torch.zeros(n, 4)},
                        sources=sources)

    # a batch whose first prompt had an empty answer starts at its second document; a gap inside
    batch = part([65, 65, 67], ["b", "c", "d"])  # sources of docs 65, 66 (empty), 67
    source = part([0, 1, 1], ["stdlib/x", "stdlib/y"])
    both = concat([part([0, 1], ["a0", "a1"]), batch, source])
    assert [both.sources[d] for d in both.doc_ids.tolist()] == ["a0", "a1", "b", "b", "d", "stdlib/x", "stdlib/y",
                                                                "stdlib/y"]
    assert concat([batch, part([0], None)]).sources is None  # unknown for a part: unknown for the whole


@pytest.mark.real
def test_answers_are_saved_by_batch_and_reused_by_a_larger_run(smollm2_folder, tmp_path):
    """Asking for more answers reads the batches a smaller run saved, whatever it asked;
    each document keeps the source of its own prompt."""
    from types import SimpleNamespace

    from specdecode.models.load import load
    from specdecode.core.prompts import encode_prompt
    from specdecode.heads.training.data import answer_features
    from specdecode.heads.training.instructions import instructions

    model, tokenizer, info = load(str(smollm2_folder), torch.float32)
    target = SimpleNamespace(model=model, tokenizer=tokenizer, info=info)
    small = answer_features(target, 4, 3, tmp_path, batch_size=2, block=4, log=lambda _: None)
    files = sorted((tmp_path).glob("answers-*/batch-*.safetensors"))
    assert len(files) == 2
    stamps = [f.stat().st_mtime_ns for f in files]
    large = answer_features(target, 6, 3, tmp_path, batch_size=2, block=4, log=lambda _: None)
    assert len(list(tmp_path.glob("answers-*/batch-*.safetensors"))) == 3  # one new batch
    assert [f.stat().st_mtime_ns for f in files] == stamps  # the first two read, not rewritten
    n = len(small)
    assert torch.equal(large.tokens[:n], small.tokens) and torch.equal(large.labels[:n], small.labels)
    # each document's tokens start with its own prompt, whose source it names
    pairs = instructions()[:6]
    for doc in large.doc_ids.unique().tolist():
        text, source = next((t, s) for t, s in pairs if s == large.sources[doc])
        prompt = encode_prompt(tokenizer, text)
        assert large.tokens[large.doc_ids == doc][:len(prompt)].tolist() == prompt
