"""Batched greedy answers (training text in the target's own words) equal decoding each
prompt alone, token for token, whatever the other rows and the padding."""

import pytest
import torch

from specdecode.engine import decode
from specdecode.events import collect
from specdecode.models.native import NativeModel
from specdecode.stopping import StopCondition
from specdecode.training.batch_greedy import greedy_answers, left_padded

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


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("fixture", ["tiny_llama", "tiny_qwen2"])
def test_batched_answers_equal_each_prompt_alone(request, fixture, dtype):
    model = NativeModel.from_folder(request.getfixturevalue(fixture), dtype)
    answers = greedy_answers(model, PROMPTS, 24, frozenset())
    assert [len(a) for a in answers] == [24] * len(PROMPTS)
    assert answers == [alone(model, p, 24) for p in PROMPTS]


def test_answers_stop_at_their_own_eos(tiny_llama):
    model = NativeModel.from_folder(tiny_llama, torch.float32)
    free = greedy_answers(model, PROMPTS, 20, frozenset())
    eos = frozenset({free[0][5]})  # a token the first answer emits at its sixth step
    answers = greedy_answers(model, PROMPTS, 20, eos)
    assert answers[0] == free[0][:free[0].index(free[0][5]) + 1]
    assert answers == [alone(model, p, 20, eos) for p in PROMPTS]
    assert greedy_answers(model, PROMPTS, 0, eos) == [[]] * len(PROMPTS)


def test_answer_features_match_a_teacher_forced_pass(tiny_qwen2):
    from specdecode.training.batch_greedy import answer_features
    from specdecode.training.features import collect

    model = NativeModel.from_folder(tiny_qwen2, torch.float32)
    answers = greedy_answers(model, PROMPTS, 12, frozenset())
    got = answer_features(model, PROMPTS, 12, frozenset(), first_doc=7)
    layer = model.config.num_layers
    want = collect(model, [p + a[:-1] for p, a in zip(PROMPTS, answers)], (layer,))
    assert torch.equal(got.tokens, want.tokens)
    assert torch.equal(got.labels, want.labels)
    assert torch.equal(got.doc_ids, want.doc_ids + 7)
    torch.testing.assert_close(got.hidden[layer].float(), want.hidden[layer].float(), atol=2e-2, rtol=2e-2)
    ends = torch.cumsum(torch.tensor([len(p) + len(a) - 1 for p, a in zip(PROMPTS, answers)]), 0) - 1
    assert got.labels[ends].tolist() == [a[-1] for a in answers]  # each answer's last token: a label only
    within = torch.cat([torch.arange(len(p) + len(a) - 1) for p, a in zip(PROMPTS, answers)])
    prompt_len = torch.cat([torch.full((len(p) + len(a) - 1,), len(p)) for p, a in zip(PROMPTS, answers)])
    assert torch.equal(got.drafted, within >= prompt_len - 1)  # drafting starts at a prompt's last token


def test_concat_renumbers_documents_and_keeps_drafted():
    from specdecode.training.features import Features, concat

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
