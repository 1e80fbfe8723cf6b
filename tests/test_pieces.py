"""Small pure pieces: prompt lookup, statistics, the speedup model, text streaming, stops."""

import random

import pytest

from specdecode.policy.adaptive import expected_tokens
from specdecode.commands.bench import theoretical_speedup
from specdecode.drafters import PromptLookup
from specdecode.errors import SpecDecodeError
from specdecode.core.events import Stats
from specdecode.core.stopping import StopCondition
from specdecode.commands.textstream import TextStream


def test_prompt_lookup_copies_what_followed_the_latest_match():
    context = [1, 2, 3, 9, 9, 1, 2, 3, 7, 8, 5, 1, 2, 3]
    assert PromptLookup(max_ngram=3).propose(context, 2).tokens.tolist() == [7, 8]
    assert PromptLookup(max_ngram=3).propose(context, 10).tokens.tolist() == [7, 8, 5, 1, 2, 3]


def test_prompt_lookup_falls_back_to_shorter_ngrams_and_to_nothing():
    assert PromptLookup(max_ngram=3).propose([4, 6, 5, 6], 3).tokens.tolist() == [5, 6]
    assert PromptLookup().propose([1, 2, 3, 4], 3).tokens.numel() == 0
    with pytest.raises(SpecDecodeError):
        PromptLookup(max_ngram=1, min_ngram=2)


def scanned_lookup(context: list[int], k: int, max_ngram: int, min_ngram: int) -> list[int]:
    """Prompt lookup by scanning the whole context, as the definition reads."""
    for n in range(min(max_ngram, len(context) - 1), min_ngram - 1, -1):
        starts = [s for s in range(len(context) - n) if context[s:s + n] == context[-n:]]
        if starts:
            return context[starts[-1] + n:starts[-1] + n + k]
    return []


def test_prompt_lookup_index_follows_a_growing_context_as_a_scan_would():
    rng = random.Random(0)
    lookup = PromptLookup(max_ngram=4, min_ngram=2)
    for generation in range(3):  # a new context each time: the index starts over by itself
        context = [rng.randrange(6) for _ in range(rng.randrange(1, 5))]
        for _ in range(150):
            k = rng.randrange(1, 9)
            assert lookup.propose(context, k).tokens.tolist() == scanned_lookup(context, k, 4, 2)
            context = context + [rng.randrange(6) for _ in range(rng.randrange(1, 4))]


def test_stats_rates_and_positions():
    stats = Stats(new_tokens=1)  # the prefill's token
    stats.add_round(num_drafted=4, num_accepted=4, num_emitted=5, draft_s=0, verify_s=0)
    stats.add_round(num_drafted=4, num_accepted=1, num_emitted=2, draft_s=0, verify_s=0)
    stats.add_round(num_drafted=2, num_accepted=0, num_emitted=1, draft_s=0, verify_s=0)
    assert stats.acceptance_rate == 5 / 10
    assert stats.mean_accepted_length == 8 / 3
    assert stats.acceptance_by_position == [2 / 3, 1 / 3, 1 / 2, 1 / 2]


def simulated_rounds(alpha: float, k: int, rounds: int = 20_000, seed: int = 0) -> list[int]:
    """Tokens emitted by each of `rounds` rounds of k drafts, each accepted with probability
    alpha until the first rejection, plus the target's own token."""
    rng = random.Random(seed)
    emitted = []
    for _ in range(rounds):
        accepted = 0
        while accepted < k and rng.random() < alpha:
            accepted += 1
        emitted.append(accepted + 1)
    return emitted


@pytest.mark.parametrize("alpha, k", [(0.0, 5), (0.5, 2), (0.8, 4), (0.95, 8), (1.0, 5)])
def test_expected_tokens_is_the_mean_of_simulated_rounds(alpha, k):
    rounds = simulated_rounds(alpha, k)
    assert expected_tokens(alpha, k) == pytest.approx(sum(rounds) / len(rounds), rel=0.015)


@pytest.mark.parametrize("alpha, k, plain_s, draft_s, verify_s", [
    (0.8, 4, 1.0, 0.25, 1.1), (0.0, 1, 1.0, 0.0, 1.0), (0.6, 3, 0.02, 0.004, 0.025)])
def test_theoretical_speedup_is_the_simulated_one(alpha, k, plain_s, draft_s, verify_s):
    # speculative decoding's tokens per second, each round costing k draft steps and a
    # verify pass, over plain decoding's one token per plain step
    rounds = simulated_rounds(alpha, k)
    tokens_per_s = sum(rounds) / (len(rounds) * (k * draft_s + verify_s))
    assert theoretical_speedup(alpha, k, plain_s, draft_s, verify_s) == pytest.approx(tokens_per_s * plain_s,
                                                                                       rel=0.015)


class Bytes:
    """A tokenizer stand-in whose tokens are raw UTF-8 bytes."""

    def decode(self, ids, **_):
        return bytes(ids).decode("utf-8", errors="replace")


def test_text_stream_holds_back_split_characters():
    stream = TextStream(Bytes())
    euro = list("€".encode())
    assert stream.add([ord("a")] + euro[:1]) == ""
    assert stream.add(euro[1:]) == "a€"
    assert stream.add([ord("b")]) == "b"


def test_stop_condition_checks():
    with pytest.raises(SpecDecodeError):
        StopCondition(max_new_tokens=-1)
    with pytest.raises(SpecDecodeError):
        StopCondition(stop_strings=("x",))  # no tokenizer to decode with
    stop = StopCondition(frozenset([7]), max_new_tokens=5)
    assert stop.check([1, 2, 7, 3], 0) == (3, "eos")
    assert stop.check([1, 2, 3, 4, 5, 6], 2) == (5, "length")
    assert stop.check([1, 2], 0) == (2, None)
