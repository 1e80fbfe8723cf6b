"""Choosing k: the cost model's decisions on synthetic figures, the adaptive policy in a
simulation with known acceptance (time is simulated from the cost model, never measured),
in the real engine, and tuning profiles."""

import dataclasses
import random
from types import SimpleNamespace

import pytest
import torch

from specdecode.core.draft_length import FixedK
from specdecode.policy.gate import TreeGate
from specdecode.policy.adaptive import (
    AdaptiveK,
    CostModel,
    best_k,
    can_pay,
    best_k_from_rounds,
    speedup_from_rounds,
)
from specdecode.drafters import DraftModel
from specdecode.core.engine import decode
from specdecode.errors import SpecDecodeError
from specdecode.core.events import Round, collect
from specdecode.models.native import NativeModel
from specdecode.core.stopping import StopCondition
from specdecode.policy.costs import cost_model
from specdecode.policy.profile import Profile, alpha_mle

FLAT = (1.0, 1.01, 1.02, 1.03, 1.04, 1.05, 1.06, 1.07, 1.08)


def test_drafting_is_off_when_it_cannot_pay():
    assert best_k(0.0, CostModel(0.4, FLAT), 8) == (0, 1.0)
    assert best_k(0.3, CostModel(0.4, FLAT), 8)[0] == 0  # E(0.3, 1) = 1.3 < cost 1.41


def test_k_maximises_throughput_not_acceptance():
    # α = 0.8, c = 0.4: k=1 gives 1.8/1.41 = 1.28, k=2 2.44/1.82 = 1.34, k=3 2.95/2.23 = 1.32
    k, speedup = best_k(0.8, CostModel(0.4, FLAT), 8)
    assert k == 2  # though k = 8 would be accepted for more tokens a round
    # the promised speedup is what drafting 2 a round gets in a simulation of α = 0.8
    assert speedup == pytest.approx(simulate(FixedK(2), lambda r: 0.8, CostModel(0.4, FLAT), rounds=20_000), rel=0.02)


def test_cheap_drafter_with_high_acceptance_drafts_long():
    assert best_k(0.95, CostModel(0.02, FLAT), 8)[0] >= 7


def test_steep_verify_curve_shortens_k():
    steep = CostModel(0.02, tuple(1 + 0.3 * n for n in range(9)))
    assert best_k(0.9, steep, 8)[0] < best_k(0.9, CostModel(0.02, FLAT), 8)[0]


def test_verify_curve_extends_linearly():
    costs = CostModel(0.1, (1.0, 1.1, 1.3))
    assert costs.verify(3) == 1.3 and costs.verify(5) == pytest.approx(1.7)


def simulate(policy, alpha_of_round, costs: CostModel, rounds=3000, seed=0) -> float:
    """Speedup over plain decoding with i.i.d. acceptance, time from the cost model."""
    rng = random.Random(seed)
    tokens = time = 0.0
    for r in range(rounds):
        k = policy.next_k()
        accepted = 0
        while accepted < k and rng.random() < alpha_of_round(r):
            accepted += 1
        policy.observe(k, accepted)
        tokens += accepted + 1
        time += costs.cost(k)
    return tokens / time  # plain decoding: 1 token per unit


COSTS = CostModel(0.3, FLAT)


def test_adaptive_with_a_useless_drafter_stays_within_a_few_percent_of_plain():
    assert simulate(AdaptiveK(COSTS), lambda r: 0.0, COSTS) >= 0.97


def test_adaptive_with_a_good_drafter_is_close_to_the_best_fixed_k():
    best = max(simulate(FixedK(k), lambda r: 0.85, COSTS) for k in range(1, 9))
    assert simulate(AdaptiveK(COSTS), lambda r: 0.85, COSTS) >= 0.95 * best


def test_adaptive_follows_a_change_of_acceptance():
    switching = lambda r: 0.9 if r < 1500 else 0.05  # noqa: E731
    adaptive = simulate(AdaptiveK(COSTS), switching, COSTS)
    assert adaptive > simulate(FixedK(4), switching, COSTS)
    assert adaptive > 1.0


@pytest.mark.slow
def test_adaptive_in_the_engine_keeps_output_and_mostly_stops_drafting(tiny_llama, tiny_llama_other):
    target = NativeModel.from_folder(tiny_llama, torch.float32)
    useless = DraftModel(NativeModel.from_folder(tiny_llama_other, torch.float32), target.vocab_size)
    prompt, stop = [5, 17, 42, 8, 91], StopCondition(max_new_tokens=60)
    plain, _ = collect(decode(target, prompt, stop))
    policy = AdaptiveK(CostModel(0.3, FLAT))
    rounds = [ev for ev in decode(target, prompt, stop, drafter=useless, k=policy) if isinstance(ev, Round)]
    assert [t for ev in rounds for t in ev.token_ids] == plain
    drafting = sum(1 for ev in rounds if ev.num_drafted)
    assert drafting <= 0.3 * len(rounds)
    assert len(policy.clock.plain) == 4  # the engine told it what its plain steps took (the latest four kept)


def test_a_draft_model_starts_only_where_reading_the_context_repays_itself():
    """A draft model must read the context before it drafts. The quantized 0.5B draft for the
    1.5B target on an AMD EPYC Zen 3 (costs its probe measured: a step 0.45 of a target
    step, a context token 0.12 of one): after a 1,000-token prompt it would spend 120 target
    steps reading it, more than drafts accepted 90% of the time save in 128 tokens (31
    steps), and in `bench` it ran the hybrid at 0.65-0.94x of plain decoding on such
    prompts. After a short prompt, or with thousands of tokens left, it starts; with no
    budget known, as before."""
    zen3 = CostModel(0.45, (1.0, 1.06, 1.15, 1.39, 1.52, 1.74, 1.96, 2.39, 2.81), catch_up_ratio=0.12)
    assert AdaptiveK(zen3).next_k(unread=1000, tokens_left=128) == 0
    assert AdaptiveK(zen3).next_k(unread=60, tokens_left=128) > 0
    assert AdaptiveK(zen3).next_k(unread=1000, tokens_left=4000) > 0
    assert AdaptiveK(zen3).next_k(unread=1000) > 0
    held = AdaptiveK(zen3)
    assert [held.next_k(unread=1000 + i, tokens_left=128 - i) for i in range(40)] == [0] * 40  # probes too
    assert held.describe().startswith("off: the draft would first read 1039 context tokens")
    unmeasured = CostModel(0.375, zen3.verify_ratios)  # a tuning profile's costs: no catch-up figure
    assert AdaptiveK(unmeasured).next_k(unread=1000, tokens_left=128) > 0


@pytest.mark.slow
def test_a_draft_model_held_back_by_its_catch_up_leaves_the_output_alone(tiny_llama):
    """In the engine: the same model as its own draft (every draft accepted) drafts after the
    prompt when reading it is free, not when it costs more than the short answer can save;
    both outputs are plain decoding's."""
    target = NativeModel.from_folder(tiny_llama, torch.float32)
    prompt, stop = [(7 * i) % 97 + 3 for i in range(40)], StopCondition(max_new_tokens=16)
    plain, _ = collect(decode(target, prompt, stop))
    drafted = {}
    for ratio in (0.0, 1.0):
        twin = DraftModel(NativeModel.from_folder(tiny_llama, torch.float32), target.vocab_size)
        policy = AdaptiveK(CostModel(0.3, FLAT, catch_up_ratio=ratio))
        rounds = [ev for ev in decode(target, prompt, stop, drafter=twin, k=policy) if isinstance(ev, Round)]
        assert [t for ev in rounds for t in ev.token_ids] == plain
        drafted[ratio] = sum(ev.num_drafted for ev in rounds)
    assert drafted[0.0] >= 8 and drafted[1.0] == 0


def test_alpha_mle_counts_one_rejection_per_short_or_empty_round():
    assert alpha_mle([4, 4, 4], [4, 1, 0]) == pytest.approx(5 / 7)
    assert alpha_mle([4, 0], [4, 0]) == pytest.approx(4 / 5)  # nothing drafted: like a first rejection
    assert alpha_mle([], []) == 0.0


def test_profile_chooses_drafter_and_k_per_category_and_round_trips(tmp_path):
    verify = {1: 0.10, 2: 0.101, 4: 0.103, 8: 0.11, 16: 0.13}
    drafters = {"draft-model": {"draft": "d", "step_s": 0.03}, "prompt-lookup": {"draft": None, "step_s": 0.0}}
    profile = Profile("t", "bfloat16", verify, drafters)
    assert profile.costs("draft-model").verify_ratios[2] == pytest.approx(1.02)  # n = 3, between 2 and 4
    assert profile.costs("draft-model").draft_ratio == pytest.approx(0.3)
    # the model is accepted far more often on code, but lookup is free and copies the edit
    code = profile.decide("code", {"draft-model": 0.9, "prompt-lookup": 0.3})
    edit = profile.decide("edit", {"draft-model": 0.9, "prompt-lookup": 0.8})
    prose = profile.decide("prose", {"draft-model": 0.1, "prompt-lookup": 0.0})
    assert (code["drafter"], edit["drafter"]) == ("draft-model", "prompt-lookup")
    assert code["k"] >= 3 and edit["k"] >= 6 and prose["k"] == 0
    assert edit["expected_speedup"] > code["expected_speedup"] > 1 == prose["expected_speedup"]
    loaded = Profile.load(profile.save(tmp_path / "p.json"))
    assert loaded == profile
    name, policy = loaded.choose("code")
    assert name == "draft-model" and policy.prior_alpha == 0.9 and policy.costs.draft_ratio == pytest.approx(0.3)
    name, k = loaded.choose("code", drafter="prompt-lookup")  # free drafting: a fixed k
    assert name == "prompt-lookup" and k == best_k(0.3, profile.costs("prompt-lookup"), 8)[0]
    name, k = loaded.choose()  # unknown kind: mean α, 0.37 for lookup beats 0.63 at c = 0.3
    assert name == "prompt-lookup" and k == best_k(1.1 / 3, profile.costs("prompt-lookup"), 8)[0]
    with pytest.raises(SpecDecodeError, match="no category"):
        loaded.choose("poetry")
    with pytest.raises(SpecDecodeError, match="measured"):
        loaded.choose("code", drafter="medusa")
    with pytest.raises(SpecDecodeError, match="no profile"):
        Profile.load(tmp_path / "missing.json")
    (tmp_path / "bad.json").write_text("{}")
    with pytest.raises(SpecDecodeError, match="not a specdecode profile"):
        Profile.load(tmp_path / "bad.json")


def test_cost_model_from_measured_seconds():
    costs = cost_model({1: 2.0, 3: 2.2, 5: 3.0}, draft_step_s=0.5)
    assert costs.draft_ratio == 0.25
    assert costs.verify_ratios == pytest.approx((1.0, 1.05, 1.1, 1.3, 1.5))


def test_speedup_from_rounds_replays_each_round_at_a_shorter_k():
    costs = CostModel(0.1, FLAT)
    # (drafted, accepted) at a probing k of 8: a full copy, a miss, a round rejected at 2
    rounds = [(8, 8), (0, 0), (8, 1)]
    # at k = 2: tokens 3 + 1 + 2; cost: 2 drafts + a pass over 3, one plain step, 2 drafts + 3
    assert speedup_from_rounds(rounds, costs, 2) == pytest.approx(6 / (2 * (0.2 + FLAT[2]) + FLAT[0]))
    assert speedup_from_rounds(rounds, costs, 0) == 1.0 == speedup_from_rounds([], costs, 3)
    k, speedup = best_k_from_rounds(rounds, costs, 8)
    assert speedup == max(speedup_from_rounds(rounds, costs, j) for j in range(9))
    assert speedup_from_rounds(rounds, costs, k) == speedup


def test_profile_values_bursty_lookup_by_its_rounds(tmp_path):
    """Prompt lookup copies whole spans or finds nothing. Its rounds give what that is
    worth (9 tokens for a pass in a third of the rounds, 1 in the rest: 3.5x), where the
    i.i.d. model of its α = 0.8 would promise 3.85x; the profile keeps the rounds' figure."""
    verify = {1: 0.10, 2: 0.101, 4: 0.103, 8: 0.11, 16: 0.13}
    drafters = {"draft-model": {"draft": "d", "step_s": 0.03}, "prompt-lookup": {"draft": None, "step_s": 0.0}}
    profile = Profile("t", "bfloat16", verify, drafters)
    lookup = [(8, 8)] * 4 + [(0, 0)] * 8
    model = [(4, 3), (4, 4), (4, 2), (4, 4), (4, 3)] * 2
    alphas = {"draft-model": alpha_mle(*zip(*model)), "prompt-lookup": alpha_mle(*zip(*lookup))}
    choice = profile.decide("summarization", alphas, {"draft-model": model, "prompt-lookup": lookup})
    assert choice["drafter"] == "prompt-lookup" and choice["k"] == 8
    assert choice["expected_speedup"] == pytest.approx(
        speedup_from_rounds(lookup, profile.costs("prompt-lookup"), 8), abs=1e-3)
    assert choice["expected_speedup"] == pytest.approx(44 / (4 * 1.125 + 8), abs=1e-3)  # a pass over 9: 1.125
    assert best_k(alphas["prompt-lookup"], profile.costs("prompt-lookup"), 8)[1] == pytest.approx(3.85, abs=0.01)
    loaded = Profile.load(profile.save(tmp_path / "p.json"))
    assert loaded.choose("summarization") == ("prompt-lookup", 8)
    name, policy = loaded.choose("summarization", drafter="draft-model")  # a paid drafter adapts
    assert name == "draft-model" and isinstance(policy, AdaptiveK)


def test_profile_picks_the_hybrid_where_its_probe_beats_both_parts(tmp_path):
    """Summaries copy in bursts and paraphrase between them: lookup alone is a plain step
    in most rounds, the model alone pays a pass per draft on the copies too. The hybrid's
    probe (its own rounds, each charged what it cost) is compared with the parts' best."""
    from specdecode.drafters import DraftModel
    from specdecode.drafters.hybrid import LookupOrModel
    from specdecode.plan import tuned_drafter
    from specdecode.commands.tune import hybrid_probe
    from specdecode.policy.profile import HybridK
    from specdecode.core.events import Round

    verify = {1: 0.10, 2: 0.101, 4: 0.103, 8: 0.11, 16: 0.13}
    drafters = {"draft-model": {"draft": "d", "step_s": 0.03}, "prompt-lookup": {"draft": None, "step_s": 0.0},
                "hybrid": {"draft": "d", "step_s": 0.03}}
    profile = Profile("t", "bfloat16", verify, drafters)
    # the same 60 tokens three ways: 4 copies of 8 and 24 misses; 20 model rounds accepting
    # 2 of 3; the same 4 copies and 8 model rounds of 3 drafts (0.09 s, catch-up included)
    lookup = [(8, 8)] * 4 + [(0, 0)] * 24
    model = [(3, 2)] * 20
    rounds = [Round((), 8, 8, 0.0001, 0.11)] * 4 + [Round((), 3, 2, 0.09, 0.101)] * 8
    probe = hybrid_probe(rounds, profile.costs("prompt-lookup"), 0.10, lookup_k=8, model_k=3)
    assert probe["tokens"] == 4 * 9 + 8 * 3
    assert probe["cost"] == pytest.approx(4 * (0.001 + 1.125) + 8 * (0.9 + 1.03), abs=1e-3)  # passes over 9, 4
    alphas = {"draft-model": alpha_mle(*zip(*model)), "prompt-lookup": alpha_mle(*zip(*lookup))}
    choice = profile.decide("summarization", alphas, {"draft-model": model, "prompt-lookup": lookup}, probe)
    assert choice["drafter"] == "hybrid"
    assert choice["expected_speedup"] == pytest.approx(probe["tokens"] / probe["cost"], abs=1e-3)
    assert choice["expected_speedup"] > max(profile.best(n, alphas[n], r)[1]
                                            for n, r in (("draft-model", model), ("prompt-lookup", lookup)))
    # where the copies are missing, the model alone wins
    plain_probe = hybrid_probe([Round((), 3, 2, 0.09, 0.101)] * 8 + [Round((), 3, 0, 0.09, 0.101)] * 4,
                               profile.costs("prompt-lookup"), 0.10, 8, 3)
    assert profile.decide("chat", alphas, {"draft-model": model, "prompt-lookup": [(0, 0)] * 20},
                          plain_probe)["drafter"] == "draft-model"
    loaded = Profile.load(profile.save(tmp_path / "p.json"))
    name, k = loaded.choose("summarization")
    assert name == "hybrid" and isinstance(k, HybridK) and k.lookup_k == 8 and isinstance(k.model, AdaptiveK)
    assert loaded.choose("chat")[0] == "draft-model"

    class FakeModel:
        def new_cache(self, batch, length):
            return None
    drafter, cap = tuned_drafter(loaded, "summarization", DraftModel(FakeModel(), 10))
    assert isinstance(drafter, LookupOrModel) and drafter.lookup_k == 8 and cap == 8
    drafter, policy = tuned_drafter(loaded, "chat", DraftModel(FakeModel(), 10))
    assert isinstance(drafter, DraftModel) and isinstance(policy, AdaptiveK)
    with pytest.raises(SpecDecodeError, match="needs its draft model"):
        tuned_drafter(loaded, "summarization", None)


def simulate_gate(gate: TreeGate, tokens_of_round, rounds=2000) -> float:
    """Speedup of a gated tree drafter over plain decoding, time from its round cost."""
    tokens = time = 0.0
    for r in range(rounds):
        if gate.open():
            emitted = tokens_of_round(r)
            gate.observe(emitted - 1)
            tokens, time = tokens + emitted, time + gate.round_cost
        else:
            tokens, time = tokens + 1, time + 1.0
    return tokens / time


def test_tree_gate_switches_a_useless_tree_off_and_a_paying_one_on():
    # trees chosen for 2.0 tokens a round at 1.25 steps a round, on text they never hit
    assert simulate_gate(TreeGate(1.25, 2.0), lambda r: 1) >= 0.97  # 0.8x if always on
    assert simulate_gate(TreeGate(1.25, 2.0), lambda r: 2) == pytest.approx(2 / 1.25)  # never off
    # predictable text after an unpredictable stretch: the probes notice and it opens again
    assert simulate_gate(TreeGate(1.25, 2.0), lambda r: 1 if r < 1000 else 3) > 1.6
    gate = TreeGate(1.25, 2.0)
    for _ in range(5):
        gate.open() and gate.observe(0)
    assert not gate.open() and gate.fresh().open()  # fresh: the prior again


def test_a_draft_nearly_as_slow_as_the_target_never_drafts_even_to_probe():
    """A 0.5B draft quantized like its 1.5B target cost 0.75 of a target step on an AVX2
    CPU: even drafts always accepted would gain about 1.03x, less than a probe's catch-up
    costs, so the policy stays off and says why."""
    costs = CostModel(0.75, (1.0, 1.19, 1.54, 1.87, 2.21))
    policy = AdaptiveK(costs)
    assert not can_pay(costs, policy.k_max) and can_pay(COSTS, policy.k_max)
    assert simulate(policy, lambda r: 1.0, costs, rounds=200) == 1.0  # plain decoding, exactly
    assert set(policy.history) == {0}
    assert policy.describe().startswith("off: a draft step costs 0.75 of a target step here")


def test_a_draft_that_pays_only_near_full_acceptance_is_never_probed():
    """The same pair on an AMD EPYC Zen 2 after the quantized products got faster: a draft
    step costs 0.47-0.49 of a target step and a pass over 4 tokens 1.68-1.70 (measured
    there, twice). Drafts always accepted would gain 1.26-1.30x, at α = 0.9, the best a
    draft model reaches, 1.08-1.15x: whenever it started (probes, each a catch-up over every
    token since the last, the prompt first) it ran at 0.78-0.97x of plain decoding in
    `bench`. It stays off, and says what α = 0.9 would bring."""
    for costs, at_090 in ((CostModel(0.49, (1.0, 1.33, 1.52, 1.70, 2.21, 2.53, 2.85, 3.28, 3.72)), 1.08),
                          (CostModel(0.466, (1.0, 1.306, 1.433, 1.677, 2.139, 2.47, 2.794, 3.2, 3.603)), 1.15)):
        assert best_k(1.0, costs, 8)[1] > 1.25 and round(best_k(0.9, costs, 8)[1], 2) == at_090
        policy = AdaptiveK(costs)
        assert not can_pay(costs, policy.k_max)
        assert simulate(policy, lambda r: 1.0, costs, rounds=200) == 1.0
        assert set(policy.history) == {0}
        assert f"accepted 90% of the time would gain {at_090:.2f}x" in policy.describe()


def test_the_hybrids_copies_take_the_length_a_pass_here_pays_for():
    """Without a profile the hybrid copies as far as prompt lookup alone would: short where a
    pass over many tokens is dear (AMD EPYC Zen 2, quantized: copies of 8 there lost 11-28%
    on long prompts in `bench`), long where it is nearly free. Each part's policy hears only
    of its own rounds."""
    from specdecode.drafters.hybrid import LookupOrModel

    zen2 = CostModel(0.0, (1.0, 1.33, 1.52, 1.70, 2.21, 2.53, 2.85, 3.28, 3.72))
    context = list(range(20)) * 3 + [0, 1]  # the last tokens occurred before: a copy of up to 18 is there
    lengths = {}
    for name, costs in (("dear", zen2), ("flat", CostModel(0.0, FLAT))):
        never = AdaptiveK(CostModel(0.75, (1.0, 1.19, 1.54, 1.87, 2.21)))  # a model part that never drafts
        hybrid = LookupOrModel(SimpleNamespace(unread=lambda context: 0), AdaptiveK(costs), never)
        lengths[name] = len(hybrid.propose(context, k=hybrid.k_max).tokens)
        assert lengths[name] == best_k(AdaptiveK(costs).alpha, costs, 8)[0]
        # the target rejected the copy's first token: the lookup part hears of it, the model part not
        hybrid.propose(context + [99], k=hybrid.k_max)
        assert hybrid.lookup_policy.positions == 1 and hybrid.lookup_policy.accepted == 0
        assert hybrid.policy.positions == 0
    assert lengths["dear"] == 2 and lengths["flat"] > 4


def simulate_timed(policy, alpha: float, probed: CostModel, real: CostModel, rounds=3000, seed=0) -> float:
    """Speedup over plain decoding when a round really costs `real` (in plain steps) while
    the policy was given `probed`; the policy is told each round's time, as the engine does."""
    rng = random.Random(seed)
    tokens = time = 0.0
    for _ in range(rounds):
        k = policy.next_k()
        accepted = 0
        while accepted < k and rng.random() < alpha:
            accepted += 1
        policy.observe(k, accepted)
        seconds = 0.040 * real.cost(k)  # a 40 ms plain step
        policy.observe_time(k, seconds)
        tokens += accepted + 1
        time += real.cost(k)
    return tokens / time


ZEN3_PROBE = CostModel(0.45, (1.0, 1.06, 1.15, 1.39, 1.52, 1.74, 1.96, 2.39, 2.81))


def scaled(costs: CostModel, factor: float) -> CostModel:
    """Drafting and passes over several tokens `factor` times dearer; a plain step the same."""
    return CostModel(costs.draft_ratio * factor, (1.0,) + tuple(v * factor for v in costs.verify_ratios[1:]))


def test_adaptive_prices_drafting_at_what_its_rounds_cost_not_at_the_probe():
    """On an AMD EPYC a pass over a few tokens cost 1.3-1.5 plain steps inside generations
    where the probe had timed 1.15: the machine's memory phase moved since. Drafts accepted
    75% of the time gain 1.16x at the probe's costs and lose 11% at costs 30% higher; the
    policy times its rounds (a plain step among them now and then), so it stops drafting
    there, and where the probe was right it drafts as before."""
    dearer = scaled(ZEN3_PROBE, 1.3)
    untimed = simulate(AdaptiveK(ZEN3_PROBE), lambda r: 0.75, dearer)
    assert untimed < 0.92  # priced at the probe's costs, it keeps drafting at a loss
    assert simulate_timed(AdaptiveK(ZEN3_PROBE), 0.75, ZEN3_PROBE, dearer) >= 0.97
    as_probed = simulate_timed(AdaptiveK(ZEN3_PROBE), 0.75, ZEN3_PROBE, ZEN3_PROBE)
    assert as_probed >= 0.98 * simulate(AdaptiveK(ZEN3_PROBE), lambda r: 0.75, ZEN3_PROBE) > 1.1
    cheaper = scaled(ZEN3_PROBE, 0.8)
    timed = AdaptiveK(ZEN3_PROBE)  # rounds cheaper than probed: it drafts on at 0.5, where it would stop
    assert simulate_timed(timed, 0.55, ZEN3_PROBE, cheaper) > simulate(AdaptiveK(ZEN3_PROBE), lambda r: 0.55, cheaper)
    assert "drafted rounds cost 0.80x the measured price" in timed.describe()


def test_the_clock_times_a_plain_step_after_the_first_drafted_rounds_then_every_sixteen():
    policy = AdaptiveK(CostModel(0.1, FLAT), prior_alpha=0.9)
    ks = []
    for _ in range(40):
        ks.append(policy.next_k())
        policy.observe(ks[-1], ks[-1])  # every draft accepted
        policy.observe_time(ks[-1], 0.040 * policy.costs.cost(ks[-1]))
    plain = [i for i, k in enumerate(ks) if k == 0]
    assert plain == [3, 20, 37]  # after three timed rounds, then sixteen drafted ones apart
    assert policy.clock.scale() == pytest.approx(1.0)
    reading = AdaptiveK(CostModel(0.1, FLAT), prior_alpha=0.9)  # rounds that read a long context are not timed
    for _ in range(5):
        reading.observe_time(reading.next_k(unread=500), 1.0)
    assert len(reading.clock.drafted) == 0


def test_a_draft_model_judged_not_to_pay_is_not_probed_but_prompt_lookup_is():
    """Off, the policy probes with k = 1 every 16 rounds. A draft model's probe first reads every
    token since it last ran (0.13 of a target step each on the Zen 3), so once its drafts
    were judged not to pay it stays off; prompt lookup reads for free and keeps probing."""
    draft = AdaptiveK(dataclasses.replace(ZEN3_PROBE, catch_up_ratio=0.13))
    lookup = AdaptiveK(CostModel(0.0, (1.0, 1.3, 1.6, 1.9, 2.2)))
    for policy in (draft, lookup):
        for _ in range(20):
            policy.observe(1, 0)  # rejected: α falls below where drafting pays
    draft_ks = [draft.next_k(unread=1 + i, tokens_left=500) for i in range(48)]
    lookup_ks = [lookup.next_k(unread=0, tokens_left=500) for _ in range(48)]
    assert sum(draft_ks) == 0
    assert lookup_ks.count(1) == 3 and lookup_ks[15] == 1
