"""The decoding loop: greedy identity with every drafter and k, exact sampling end to end,
seeded repeatability, and the edges (EOS inside accepted tokens, stop strings, budget)."""

import pytest
import torch
from scipy.stats import chisquare

from specdecode.drafters import DraftModel, PromptLookup
from specdecode.core.engine import decode
from specdecode.errors import SpecDecodeError
from specdecode.core.events import Done, collect
from specdecode.models.native import NativeModel
from specdecode.core.sampling import SamplingConfig, logits_to_probs
from specdecode.core.stopping import StopCondition

PROMPT = [5, 17, 42, 8, 17, 42, 8, 91, 5, 17, 42]


def run(model, prompt, stop, **kw) -> tuple[list[int], Done]:
    return collect(decode(model, prompt, stop, **kw))


@pytest.fixture(scope="module")
def tiny(tiny_llama):
    return NativeModel.from_folder(tiny_llama, torch.float32)


@pytest.fixture(scope="module")
def tiny_other(tiny_llama_other):
    return NativeModel.from_folder(tiny_llama_other, torch.float32)


@pytest.mark.slow
@pytest.mark.parametrize("k", [1, 3, 8])
def test_greedy_identity_tiny_models(tiny, tiny_other, k):
    stop = StopCondition(max_new_tokens=40)
    plain, _ = run(tiny, PROMPT, stop)
    same, done_same = run(tiny, PROMPT, stop, drafter=DraftModel(tiny, tiny.vocab_size), k=k)
    other, done_other = run(tiny, PROMPT, stop, drafter=DraftModel(tiny_other, tiny.vocab_size), k=k)
    lookup, _ = run(tiny, PROMPT, stop, drafter=PromptLookup(), k=k)
    assert same == plain and other == plain and lookup == plain
    assert len(plain) == 40
    assert done_same.stats.acceptance_rate == 1.0  # a drafter equal to the target is always right
    assert done_other.stats.acceptance_rate < 0.5  # an independent random model rarely is


@pytest.mark.real
@pytest.mark.parametrize("k", [1, 3, 8])
def test_greedy_identity_smollm2_prompt_lookup(smollm2_folder, k):
    from transformers import AutoTokenizer

    from specdecode.core.prompts import encode_prompt

    model = NativeModel.from_folder(smollm2_folder, torch.bfloat16)
    tokenizer = AutoTokenizer.from_pretrained(str(smollm2_folder))
    prompt = encode_prompt(tokenizer, "Add type hints to this function:\ndef area(width, height):\n"
                                      "    return width * height\n")
    stop = StopCondition(max_new_tokens=48)
    plain, _ = run(model, prompt, stop)
    lookup, done = run(model, prompt, stop, drafter=PromptLookup(), k=k)
    assert lookup == plain
    assert done.stats.accepted_tokens > 0


def test_eos_inside_accepted_tokens_stops_there(tiny):
    plain, _ = run(tiny, PROMPT, StopCondition(max_new_tokens=30))
    eos = plain[10]
    first = plain.index(eos)
    tokens, done = run(tiny, PROMPT, StopCondition(frozenset([eos]), max_new_tokens=30),
                       drafter=DraftModel(tiny, tiny.vocab_size), k=8)
    assert tokens == plain[:first + 1] and done.reason == "eos"


@pytest.mark.parametrize("budget", [0, 1, 2, 7])
def test_budget_running_out_mid_round(tiny, budget):
    tokens, done = run(tiny, PROMPT, StopCondition(max_new_tokens=budget),
                       drafter=DraftModel(tiny, tiny.vocab_size), k=8)
    assert len(tokens) == budget and done.reason == "length" and done.stats.new_tokens == budget


class Digits:
    """A tokenizer stand-in: token i decodes to chr(ord('a') + i % 26)."""

    def decode(self, ids, **_):
        return "".join(chr(ord("a") + i % 26) for i in ids)


@pytest.mark.slow
def test_stop_string_spanning_rounds(tiny):
    plain, _ = run(tiny, PROMPT, StopCondition(max_new_tokens=30))
    text = Digits().decode(plain)
    stop_string = text[11:14]  # spans tokens 11..13, wherever the rounds split them
    first = text.find(stop_string)
    stop = StopCondition(stop_strings=(stop_string,), max_new_tokens=30, tokenizer=Digits())
    for k in (1, 3, 8):
        tokens, done = run(tiny, PROMPT, stop, drafter=DraftModel(tiny, tiny.vocab_size), k=k)
        assert done.reason == "stop" and tokens == plain[:first + 3]
        assert stop.cut_text(Digits().decode(tokens)) == text[:first]


@pytest.mark.slow
def test_seeded_sampling_repeats_exactly(tiny, tiny_other):
    sampling = SamplingConfig(temperature=0.8, top_p=0.9)
    outs = [run(tiny, PROMPT, StopCondition(max_new_tokens=20), sampling=sampling,
                drafter=DraftModel(tiny_other, tiny.vocab_size), k=3,
                generator=torch.Generator().manual_seed(7))[0] for _ in range(2)]
    assert outs[0] == outs[1]


@pytest.mark.slow  # 6000 seeded generations per drafter: minutes; fewer lose the chi-square's power
@pytest.mark.parametrize("kind", ["draft-model", "hybrid"])
def test_first_two_sampled_tokens_keep_the_target_distribution(tiny_llama, tmp_path, kind):
    """End to end: the joint distribution of the first two tokens, with an independent draft
    model (alone, or as the hybrid's model part beside prompt lookup) and k = 2, equals the
    target's own (computed exactly from its logits). The second token is decided by the
    rejection rule: the first comes from the prefill, and the budget leaves room for 2 drafts.
    The prompt ends in (2, first token), so the hybrid copies when the first token is 3 and
    asks the model otherwise: both of its paths are tested.

    Vocabulary 8 so the joint has 64 cells; 6000 seeded runs. Thresholds: chi-square
    p-value > 1e-3, and total variation < 0.05 (the expected TV of 6000 samples over 64
    cells is about 0.04 / 2 = 0.02... so 0.05 leaves room but catches a biased rule, which
    moves TV by 0.1 or more here).
    """
    from tests.conftest import save_tiny

    from specdecode.drafters.hybrid import LookupOrModel

    target = NativeModel.from_folder(save_tiny(tmp_path / "t", "llama", seed=4, vocab_size=8), torch.float32)
    draft = NativeModel.from_folder(save_tiny(tmp_path / "d", "llama", seed=5, vocab_size=8), torch.float32)
    sampling = SamplingConfig(temperature=1.0, top_k=6)
    prompt = [1, 2, 3, 1, 2]

    probs_first = logits_to_probs(target(torch.tensor([prompt]), target.new_cache()).logits[0, -1], sampling)
    expected = torch.zeros(8, 8)
    for a in range(8):
        row = target(torch.tensor([prompt + [a]]), target.new_cache()).logits[0, -1]
        expected[a] = probs_first[a] * logits_to_probs(row, sampling)

    counts = torch.zeros(8, 8)
    generator = torch.Generator().manual_seed(0)
    drafter = DraftModel(draft, 8) if kind == "draft-model" else LookupOrModel(DraftModel(draft, 8), 2, 2)
    trials, drafted = 6000, 0
    for _ in range(trials):
        tokens, done = run(target, prompt, StopCondition(max_new_tokens=4), sampling=sampling,
                           drafter=drafter, k=2, generator=generator)
        counts[tokens[0], tokens[1]] += 1
        drafted += done.stats.draft_tokens
    assert drafted >= trials  # every run drafted in its first round
    if kind == "hybrid":
        assert drafter.rounds["lookup"] > 100 and drafter.rounds["model"] > 1000
    support = expected.flatten() > 0
    assert counts.flatten()[~support].sum() == 0
    observed, wanted = counts.flatten()[support], expected.flatten()[support] * trials
    assert chisquare(observed.numpy(), wanted.numpy() * observed.sum().item() / wanted.sum().item()).pvalue > 1e-3
    assert 0.5 * (counts / trials - expected).abs().sum() < 0.05


def test_k_below_one_is_refused(tiny):
    with pytest.raises(SpecDecodeError, match="k must be"):
        run(tiny, PROMPT, StopCondition(), drafter=PromptLookup(), k=0)


def test_prompt_longer_than_context_is_refused(tiny):
    with pytest.raises(SpecDecodeError, match="context"):
        run(tiny, list(range(1, 90)) * 3, StopCondition())


class Recorder:
    """A fixed-k policy that records what it is told."""

    def __init__(self, k):
        self.k, self.k_max, self.seen, self.timed = k, k, [], []

    def next_k(self, unread=0, tokens_left=None):
        return self.k

    def observe(self, num_drafted, num_accepted):
        self.seen.append((num_drafted, num_accepted))

    def observe_time(self, num_drafted, seconds):
        self.timed.append((num_drafted, seconds))

    def fresh(self):
        return self


@pytest.mark.slow
def test_hybrid_copies_repeats_drafts_elsewhere_and_is_greedy_identical(tiny, tiny_other):
    """The hybrid drafter copies where the context repeats and asks its model elsewhere;
    its model's policy learns each model round's acceptance from the next context."""
    from specdecode.drafters.hybrid import LookupOrModel

    stop = StopCondition(max_new_tokens=40)
    plain, _ = run(tiny, PROMPT, stop)
    for model, always_right in ((tiny, True), (tiny_other, False)):
        recorder = Recorder(3)
        hybrid = LookupOrModel(DraftModel(model, tiny.vocab_size), lookup_k=5, model_k=recorder)
        tokens, done = run(tiny, PROMPT, stop, drafter=hybrid, k=hybrid.k_max)
        assert tokens == plain
        assert hybrid.rounds["lookup"] > 0 and hybrid.rounds["model"] > 0
        assert len(recorder.seen) >= hybrid.rounds["model"] - 1  # the last draft may end the generation
        assert all(d <= 3 for d, _ in recorder.seen) and recorder.seen[0][0] == 3  # the budget may cut the last
        # each model round timed from its proposal to the next, in the order judged
        assert [d for d, _ in recorder.timed] == [d for d, _ in recorder.seen]
        assert all(seconds > 0 for _, seconds in recorder.timed)
        if always_right:  # the target drafting for itself: every model draft accepted
            assert all(a == d for d, a in recorder.seen)
        else:
            assert any(a < d for d, a in recorder.seen)
        assert done.stats.draft_tokens > 0


@pytest.mark.slow
def test_hybrid_policy_is_fresh_each_generation(tiny, tiny_other):
    from specdecode.policy.adaptive import AdaptiveK, CostModel
    from specdecode.drafters.hybrid import LookupOrModel

    hybrid = LookupOrModel(DraftModel(tiny_other, tiny.vocab_size), 4, AdaptiveK(CostModel(0.3)))
    run(tiny, PROMPT, StopCondition(max_new_tokens=30), drafter=hybrid, k=hybrid.k_max)
    assert hybrid.policy.positions > 0 and hybrid.model_k.positions == 0  # the template is untouched
    hybrid.reset()
    assert hybrid.policy.positions == 0 and hybrid.policy is not hybrid.model_k
    assert hybrid.k_max == 8
