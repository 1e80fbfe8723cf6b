"""The goodput controller: speculation pays alone, stops paying as the batch fills a pass
whose cost grows with its rows, and comes back when the batch shrinks."""

from __future__ import annotations

import pytest

from specdecode.policy import goodput
from specdecode.policy.goodput import RecentAnswers, GoodputController, PassCosts, best_draft_lengths, start_cost

# Passes that cost the same up to 8 rows, then grow with every row (a CPU where a pass is
# bound by its weights up to 8 rows and by arithmetic past them), in seconds.
KNEE = PassCosts({1: 0.1, 8: 0.1, 16: 0.2, 64: 0.8})
STEEP = PassCosts({1: 0.1, 2: 0.15, 64: 3.2})  # every row adds half a one-row pass


def test_pass_costs_interpolate_extend_and_never_fall():
    assert KNEE(4) == pytest.approx(0.1) and KNEE(12) == pytest.approx(0.15)
    assert KNEE(128) == pytest.approx(0.8 + 64 * (0.6 / 48))  # past the last size: its last slope
    noisy = PassCosts.monotone({1: 0.10, 2: 0.09, 4: 0.12})
    assert noisy.seconds == {1: 0.10, 2: 0.10, 4: 0.12}


def test_alone_drafting_pays_in_a_full_batch_it_does_not():
    alone, gain_alone = best_draft_lengths([0.8], KNEE, 0.0, 8)
    assert alone == [7] and gain_alone == pytest.approx((1 - 0.8 ** 8) / 0.2)  # 8 rows cost one row's pass
    full, gain_full = best_draft_lengths([0.8] * 8, KNEE, 0.0, 8)
    assert full == [0] * 8 and gain_full == 1.0  # 8 rows already fill the free part of the pass


def test_sequences_accepted_more_draft_further():
    lengths, gain = best_draft_lengths([0.9, 0.2, 0.2, 0.2], KNEE, 0.0, 8)
    # 4 free rows: the next drafts worth most are 0.9, 0.81, 0.729, 0.656 (all the first one's)
    assert lengths == [4, 0, 0, 0]
    assert gain == pytest.approx((4 + 0.9 + 0.81 + 0.729 + 0.6561) / 4)
    uniform = max(sum((1 - a ** (k + 1)) / (1 - a) for a in (0.9, 0.2, 0.2, 0.2)) / KNEE(4 * (k + 1))
                  for k in range(9)) / (4 / KNEE(4))
    assert gain > uniform  # one k for all would do worse


def test_a_draft_models_cost_per_token_shortens_the_draft():
    free, _ = best_draft_lengths([0.7], KNEE, 0.0, 8)
    costly, _ = best_draft_lengths([0.7], KNEE, 0.05, 8)  # each draft token costs half a target pass
    assert costly[0] < free[0]
    assert best_draft_lengths([0.3], KNEE, 0.05, 8)[0] == [0]


def test_sequences_the_controller_does_not_steer_count_their_rows():
    alone, _ = best_draft_lengths([0.8], KNEE, 0.0, 8)
    beside, gain = best_draft_lengths([0.8], KNEE, 0.0, 8, others=[1] * 5)  # 5 plain rows: 2 rows left free
    assert alone == [7] and beside == [2]
    assert gain == pytest.approx((6 + 0.8 + 0.64) / 6)


def test_a_catch_up_is_spread_over_the_steps_a_sequence_has_left():
    assert start_cost(0, 0.01, 50, 0.8) == 0.0  # a drafter in step with the context starts free
    assert start_cost(200, 0.01, 90, 0.8) == pytest.approx(200 * 0.01 / 50)  # 90 tokens at 1.8 a step
    assert start_cost(200, 0.01, 1, 0.8) == pytest.approx(2.0)  # the last step bears it whole


def test_a_sequence_whose_drafter_must_catch_up_drafts_only_where_that_pays():
    # two sequences alike but for their start cost: one row each is free (KNEE), so both
    # would draft; the one whose catch-up outweighs its gain stays plain
    free, _ = best_draft_lengths([0.8, 0.8], KNEE, 0.0, 8)
    assert free[0] > 0 and free[1] > 0
    lengths, gain = best_draft_lengths([0.8, 0.8], KNEE, 0.0, 8, start_s=[0.0, 0.5])
    assert lengths[0] > 0 and lengths[1] == 0
    assert gain == pytest.approx(best_draft_lengths([0.8], KNEE, 0.0, 8, others=[1])[1])


def test_the_controller_starts_a_draft_model_early_in_a_generation_not_at_its_end():
    controller = GoodputController(KNEE, k_max=8, catch_up_token_s=0.002)
    # 300 unread context tokens: 0.6 s, over 200 tokens left (~110 steps) it pays, over 3 it does not
    assert controller.choose([0.8], catch_up=[(300, 200)])[0] > 0
    assert controller.choose([0.8], catch_up=[(300, 3)]) == [0]
    assert controller.choose([0.8], catch_up=[(1, 3)])[0] > 0  # in step with the context: no catch-up


def test_what_a_sequence_has_left_is_read_from_how_long_recent_answers_ran():
    answers = RecentAnswers()
    for n in (40, 100, 120):
        answers.add(n)
    assert answers.remaining(50, 256) == 206  # too few answers seen to judge: its max_tokens
    answers.add(256)
    assert answers.remaining(50, 256) == pytest.approx((50 + 70 + 206) / 3)  # those that ran past 50
    assert answers.remaining(50, 110) == pytest.approx((50 + 60 + 60) / 3)  # each capped by its budget
    assert answers.remaining(130, 256) == 126
    assert answers.remaining(300, 301) == 1  # past every answer seen: about to end


def test_a_new_sequence_expects_the_acceptance_recent_answers_had():
    answers = RecentAnswers()
    assert answers.alpha(0.6) == 0.6  # none drafted yet
    answers.add(100)  # plain: its length counts, not its acceptance
    answers.add(80, accepted=9.0, positions=10.0)
    answers.add(80, accepted=1.0, positions=10.0)
    assert answers.alpha(0.6) == pytest.approx(0.5)  # position by position, not answer by answer
    assert len(answers.lengths) == 3


def test_a_sequence_past_most_answers_does_not_start_a_draft_model():
    # alone drafting pays over 4x, but a 0.6 s catch-up does not repay itself in one step
    controller = GoodputController(KNEE, k_max=8, catch_up_token_s=0.002)
    left = controller.answers.remaining
    assert controller.choose([0.8], catch_up=[(300, left(100, 256))])[0] > 0  # nothing seen yet: 156 to come
    for _ in range(4):
        controller.answers.add(100)
    assert controller.choose([0.8], catch_up=[(300, left(100, 256))]) == [0]
    assert controller.choose([0.8], catch_up=[(300, left(20, 256))])[0] > 0  # early on, 80 tokens to come


def test_the_controller_switches_off_probes_and_comes_back():
    controller = GoodputController(KNEE, k_max=8, probe_every=4)
    assert controller.choose([0.8]) == [7] and controller.gain > 3 and controller.k == 7
    controller.pass_costs = STEEP
    low = [controller.choose([0.05] * 6) for _ in range(8)]
    assert low == [[0] * 6] * 3 + [[1] * 6] + [[0] * 6] * 3 + [[1] * 6]  # off, a one-token look every 4 steps
    controller.pass_costs = KNEE
    full = [controller.choose([0.8] * 16) for _ in range(8)]
    assert full == [[0] * 16] * 8  # even drafts always accepted would not pay here: no probe
    assert max(controller.choose([0.8, 0.8])) > 0  # the batch shrank: drafting pays again
    assert GoodputController(KNEE, k_max=0).choose([0.9]) == [0]


def test_a_probe_does_not_start_a_draft_model_that_has_fallen_far_behind():
    controller = GoodputController(STEEP, k_max=8, catch_up_token_s=0.002, probe_every=4)
    # the first sequence's drafter would read 300 tokens (0.6 s, four plain steps) just to look
    looks = [controller.choose([0.05, 0.05], catch_up=[(300, 246), (5, 246)]) for _ in range(4)]
    assert looks == [[0, 0]] * 3 + [[0, 1]]


def test_measured_costs_are_cached_and_read_back(tmp_path, monkeypatch, tiny_llama):
    import torch

    from specdecode.models.native import NativeModel

    monkeypatch.setattr(goodput, "home", lambda: tmp_path)  # not the kernels too: they would build again
    model = NativeModel.from_folder(tiny_llama, torch.float32)
    calls = []
    real = goodput.measure_passes
    monkeypatch.setattr(goodput, "measure_passes", lambda *a, **kw: calls.append(a) or real(*a, **kw))
    first = goodput.measured(model, 20)
    assert sorted(first.seconds) == [1, 2, 3, 4, 6, 8, 12, 16, 20]
    again = goodput.measured(model, 20)
    assert len(calls) == 1 and again.seconds == first.seconds
    assert all(first(a) <= first(b) for a, b in zip(range(1, 20), range(2, 21)))
