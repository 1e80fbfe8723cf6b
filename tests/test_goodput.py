"""The goodput controller: speculation pays alone, stops paying as the batch fills a pass
whose cost grows with its rows, and comes back when the batch shrinks."""

from __future__ import annotations

import pytest

from specdecode.policy import goodput
from specdecode.policy.goodput import GoodputController, PassCosts, batch_rate, best_batch_k

# Passes that cost the same up to 8 rows, then grow with every row (a CPU where a pass is
# bound by its weights up to 8 rows and by arithmetic past them), in seconds.
KNEE = PassCosts({1: 0.1, 8: 0.1, 16: 0.2, 64: 0.8})


def test_pass_costs_interpolate_extend_and_never_fall():
    assert KNEE(4) == pytest.approx(0.1) and KNEE(12) == pytest.approx(0.15)
    assert KNEE(128) == pytest.approx(0.8 + 64 * (0.6 / 48))  # past the last size: its last slope
    noisy = PassCosts.monotone({1: 0.10, 2: 0.09, 4: 0.12})
    assert noisy.seconds == {1: 0.10, 2: 0.10, 4: 0.12}


def test_alone_drafting_pays_in_a_full_batch_it_does_not():
    k_alone, gain_alone = best_batch_k([0.8], KNEE, 0.0, 8)
    assert k_alone == 7 and gain_alone == pytest.approx((1 - 0.8 ** 8) / 0.2)  # 8 rows cost one row's pass
    k_full, gain_full = best_batch_k([0.8] * 8, KNEE, 0.0, 8)
    assert k_full == 0 and gain_full == 1.0  # 8 rows already fill the free part of the pass


def test_a_draft_models_cost_per_token_shortens_the_draft():
    free, _ = best_batch_k([0.7], KNEE, 0.0, 8)
    costly, _ = best_batch_k([0.7], KNEE, 0.05, 8)  # each draft token costs half a target pass
    assert costly < free
    assert best_batch_k([0.3], KNEE, 0.05, 8)[0] == 0


def test_sequences_the_controller_does_not_steer_count_their_rows():
    alone = batch_rate([0.8], 3, KNEE, 0.0)
    beside = batch_rate([0.8], 3, KNEE, 0.0, others=[1] * 6)  # six plain sequences: 4 + 6 rows > 8
    assert alone == pytest.approx((1 + 0.8 + 0.64 + 0.512) / 0.1)
    assert beside == pytest.approx((1 + 0.8 + 0.64 + 0.512 + 6) / KNEE(10))


def test_the_controller_switches_off_probes_and_comes_back():
    controller = GoodputController(KNEE, k_max=8, probe_every=4)
    assert controller.choose([0.8]) == 7 and controller.gain > 3
    low = [controller.choose([0.05] * 6) for _ in range(8)]
    assert low == [0, 0, 0, 1, 0, 0, 0, 1]  # off, with a one-token look every 4 steps
    full = [controller.choose([0.8] * 16) for _ in range(8)]
    assert full == [0] * 8  # even drafts always accepted would not pay here: no probe
    assert controller.choose([0.8, 0.8]) > 0  # the batch shrank: drafting pays again
    assert GoodputController(KNEE, k_max=0).choose([0.9]) == 0


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
