"""Defaults that never lose: without --k, the draft length comes from the adaptive policy
seeded with costs measured once on this machine (policy/probe.py), and bad flags fail
before anything loads."""

import json

import pytest
import torch

from specdecode.commands.cli import main
from specdecode.drafters import DraftModel, PromptLookup
from specdecode.models import load as models_load
from specdecode.models.load import LoadedModel
from specdecode.models.native import NativeModel
from specdecode.plan import LOOKUP_K_MAX, plan, policy_for
from specdecode.policy import probe
from specdecode.policy.adaptive import AdaptiveK, CostModel, best_k, break_even_alpha


@pytest.fixture
def home(tmp_path, monkeypatch):
    """The costs' cache in a folder of the test's own (the kernels stay where they were built)."""
    monkeypatch.setattr(probe, "home", lambda: tmp_path)
    return tmp_path


@pytest.fixture(scope="module")
def tiny_pair(tiny_llama, tiny_llama_other):
    return NativeModel.from_folder(tiny_llama, torch.float32), NativeModel.from_folder(tiny_llama_other, torch.float32)


@pytest.mark.slow
def test_costs_are_measured_once_then_read_back(home, tiny_pair, monkeypatch):
    target, draft = tiny_pair
    costs = probe.measured_costs(target, draft)
    files = list((home / "costs").glob("*.json"))
    assert len(files) == 1 and not list((home / "costs").glob("*.partial"))
    figures = json.loads(files[0].read_text())
    assert set(figures["verify_seconds"]) == {str(n) for n in probe.PROBE_SIZES}
    assert figures["draft_step_s"] > 0 and figures["machine"]["threads"] == torch.get_num_threads()
    assert figures["catch_up_token_s"] > 0 and costs.catch_up_ratio == pytest.approx(
        figures["catch_up_token_s"] / figures["verify_seconds"]["1"])  # what reading a prompt costs the draft
    assert len(costs.verify_ratios) == max(probe.PROBE_SIZES) and costs.verify_ratios[0] == 1.0
    assert all(b >= a for a, b in zip(costs.verify_ratios, costs.verify_ratios[1:]))  # never cheaper for more rows

    monkeypatch.setattr(probe, "measure", lambda *a: pytest.fail("measured again"))
    assert probe.measured_costs(target, draft) == costs
    monkeypatch.setattr(probe.machine, "fingerprint", lambda: {"cpu": "another CPU", "kernel": "avx2", "threads": 2})
    assert probe.cache_path(target, draft) != files[0]  # another machine measures its own
    monkeypatch.undo()
    monkeypatch.setattr(probe.kernels, "kernel_kind", lambda: "avx2")
    monkeypatch.setattr(probe.kernels, "source_tag", lambda kind: "another version")
    assert probe.cache_path(target, draft) != files[0]  # so do other kernels on this one
    monkeypatch.undo()
    monkeypatch.setattr(probe, "home", lambda: home)
    # prompt lookup (no draft model) gets figures of its own
    lookup_costs = probe.measured_costs(target, None)
    assert lookup_costs.draft_ratio == 0.0 and lookup_costs.catch_up_ratio == 0.0 and len(list((home / "costs").glob("*.json"))) == 2


def test_a_damaged_cost_file_is_measured_again(home, tiny_pair):
    target, _ = tiny_pair
    path = probe.cache_path(target, None)
    path.parent.mkdir(parents=True)
    path.write_text("{not json")
    costs = probe.measured_costs(target, None)
    assert costs.verify_ratios[0] == 1.0 and json.loads(path.read_text())["draft_step_s"] is None


@pytest.mark.slow
def test_without_k_the_policy_is_adaptive_on_measured_costs(home, tiny_pair):
    target_model, draft_model = tiny_pair
    target = LoadedModel(target_model, None, None)  # planning a chain drafter reads neither
    drafter = DraftModel(draft_model, target_model.vocab_size)
    policy = policy_for(target, drafter)
    assert isinstance(policy, AdaptiveK)
    assert policy.costs == probe.measured_costs(target_model, draft_model)
    chosen, k = plan(target, "prompt-lookup", None, None, None, None)
    assert isinstance(chosen, PromptLookup) and isinstance(k, AdaptiveK) and k.costs.draft_ratio == 0.0
    rows = target_model.row_invariant_rows
    assert k.k_max == (LOOKUP_K_MAX if rows is None else min(LOOKUP_K_MAX, rows - 1)) > 8  # copies may run long
    assert plan(target, "prompt-lookup", None, 3, None, None)[1] == 3  # a fixed k stays available


def test_break_even_alpha_is_where_drafting_starts_to_pay():
    steep = CostModel(0.35, (1.0, 1.2, 1.45, 1.7, 2.0, 2.2, 2.5, 2.8, 3.1))
    flat = CostModel(0.35, (1.0, 1.01, 1.02, 1.03, 1.04, 1.05, 1.06, 1.07, 1.08))
    for costs in (steep, flat):
        alpha = break_even_alpha(costs, 8)
        assert best_k(alpha, costs, 8)[0] > 0 and best_k(round(alpha - 0.01, 2), costs, 8)[0] == 0
    assert break_even_alpha(steep, 8) > break_even_alpha(flat, 8)  # costly verify passes need better drafts


def test_free_copies_grow_as_far_as_the_verify_costs_pay():
    flat = CostModel(0.0, (1.0, 1.01, 1.02, 1.03, 1.04, 1.05, 1.06, 1.07, 1.08))  # AMX-like verify passes
    steep = CostModel(0.0, (1.0, 1.13, 1.3, 1.49, 1.7, 1.9, 2.1, 2.3, 2.53))  # a 2-core AVX2 CPU, quantized
    history = {}
    for name, costs in (("flat", flat), ("steep", steep)):
        policy = AdaptiveK(costs, k_max=LOOKUP_K_MAX)
        for _ in range(30):  # a long copy: every draft accepted
            k = policy.next_k()
            policy.observe(k, k)
        history[name] = policy.history
    assert history["flat"][1:] == [LOOKUP_K_MAX] * 29  # nearly free passes: the longest copy at once
    steep = history["steep"]  # costly passes: k grows only as the copies keep being accepted
    assert steep[0] < 4 and steep == sorted(steep) and steep[-1] == LOOKUP_K_MAX


def test_the_policy_says_what_it_chose():
    costs = CostModel(0.35, (1.0, 1.2, 1.45, 1.7, 2.0, 2.2, 2.5, 2.8, 3.1))
    poor = AdaptiveK(costs)
    for _ in range(40):
        k = poor.next_k()
        poor.observe(k, 0)  # every draft rejected
    assert poor.describe().startswith("off: acceptance 0.") and f"{break_even_alpha(costs, 8):.2f}" in poor.describe()
    poor.observe(1, 1)  # a probe accepted at the end raises the estimate, not the reason it stopped
    stopped_at = float(poor.describe().split()[2])
    assert stopped_at < break_even_alpha(costs, 8)
    good = AdaptiveK(costs)
    for _ in range(40):
        k = good.next_k()
        good.observe(k, k)  # every draft accepted
    assert good.alpha > 0.9 and max(good.history) > 1  # it drafts further as the drafts keep being right
    assert good.describe() == f"k adaptive {min(good.history)}-{max(good.history)}, acceptance {good.alpha:.2f}"


@pytest.mark.parametrize("argv, message", [
    (["generate", "--prompt", "hi", "--drafter", "prompt-lookup", "--k", "0"], "k must be >= 1"),
    (["generate", "--prompt", "hi", "--k", "3"], "--k needs a drafter"),
    (["generate", "--prompt", "hi", "--drafter", "medusa", "--k", "3"], "does not apply"),
    (["generate", "--prompt", "hi", "--drafter", "hybrid", "--k", "2"], "does not apply"),
    (["generate", "--prompt", "hi", "--profile", "p.json", "--k", "2"], "not both"),
    (["generate", "--prompt", "hi", "--category", "chat"], "selects a category of a --profile"),
    (["generate", "--prompt", "hi", "--max-new-tokens", "-1"], "--max-new-tokens"),
    (["demo", "--k", "0"], "k must be >= 1"),
])
def test_bad_flags_fail_before_any_model_loads(capsys, monkeypatch, argv, message):
    monkeypatch.setattr(models_load, "load", lambda *a, **kw: pytest.fail("a model was loaded"))
    assert main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("specdecode: error:") and message in err[0]
