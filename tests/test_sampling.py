"""Tests for specdecode.sampling: golden probabilities for each transform, and a statistical
check that sample() draws from the distribution it is given."""

import math

import pytest
import torch
from scipy.stats import chisquare

from specdecode.core.sampling import SamplingConfig, logits_to_probs, sample


def probs_of(logits, **config) -> list[float]:
    return logits_to_probs(torch.tensor(logits), SamplingConfig(**config)).tolist()


def normalised(weights: list[float]) -> list[float]:
    total = sum(weights)
    return [w / total for w in weights]


# ---- SamplingConfig ----


def test_default_config_is_greedy():
    assert SamplingConfig().greedy
    assert not SamplingConfig(temperature=0.7).greedy


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"temperature": -0.1}, "temperature"),
        ({"temperature": math.nan}, "temperature"),
        ({"temperature": math.inf}, "temperature"),
        ({"top_k": -1}, "top_k"),
        ({"top_k": 2.5}, "top_k"),
        ({"top_k": True}, "top_k"),
        ({"top_p": 0.0}, "top_p"),
        ({"top_p": 1.5}, "top_p"),
        ({"top_p": -0.2}, "top_p"),
        ({"top_p": math.nan}, "top_p"),
    ],
)
def test_bad_config_raises(kwargs, message):
    with pytest.raises(ValueError, match=message):
        SamplingConfig(**kwargs)


# ---- logits_to_probs: golden values ----


def test_greedy_is_one_hot_at_argmax_lowest_id_on_ties():
    assert probs_of([0.5, 3.0, -1.0, 2.0]) == [0.0, 1.0, 0.0, 0.0]
    assert probs_of([1.0, 3.0, 3.0]) == [0.0, 1.0, 0.0]  # tie: lowest id
    # top-k / top-p do not change a greedy choice.
    assert probs_of([1.0, 3.0, 3.0], top_k=1, top_p=0.1) == [0.0, 1.0, 0.0]


@pytest.mark.parametrize(
    "temperature, expected",
    [
        (1.0, [0.1, 0.2, 0.3, 0.4]),
        (0.5, normalised([0.01, 0.04, 0.09, 0.16])),  # p^(1/T) = p^2
        (2.0, normalised([math.sqrt(x) for x in (0.1, 0.2, 0.3, 0.4)])),
    ],
)
def test_temperature(temperature, expected):
    logits = [math.log(x) + 7.0 for x in (0.1, 0.2, 0.3, 0.4)]  # a shift changes nothing
    assert probs_of(logits, temperature=temperature) == pytest.approx(expected, abs=1e-6)


def test_tiny_temperature_does_not_overflow():
    probs = probs_of([1000.0, 999.0, -1000.0], temperature=1e-30)
    assert probs == [1.0, 0.0, 0.0]


def test_top_k():
    expected = normalised([0.0, math.exp(3), math.exp(2), 0.0])
    assert probs_of([1.0, 3.0, 2.0, 0.0], temperature=1.0, top_k=2) == pytest.approx(expected)


def test_top_k_keeps_ties_at_the_boundary():
    # The 2nd largest logit (1.0) is shared by tokens 1 and 2: both are kept.
    expected = normalised([math.exp(2), math.e, math.e, 0.0])
    assert probs_of([2.0, 1.0, 1.0, 0.0], temperature=1.0, top_k=2) == pytest.approx(expected)


def test_top_k_at_least_vocab_is_off():
    logits = [0.3, -1.0, 2.0]
    assert probs_of(logits, temperature=1.0, top_k=3) == probs_of(logits, temperature=1.0)
    assert probs_of(logits, temperature=1.0, top_k=50) == probs_of(logits, temperature=1.0)


@pytest.mark.parametrize(
    "top_p, expected",
    [
        (0.45, [1.0, 0.0, 0.0, 0.0]),  # the top token alone reaches 0.45
        (0.7, [2 / 3, 1 / 3, 0.0, 0.0]),  # 0.5 < 0.7 <= 0.75
        (0.8, normalised([0.5, 0.25, 0.15, 0.0])),  # 0.75 < 0.8 <= 0.9
        (0.95, [0.5, 0.25, 0.15, 0.1]),
        (1e-6, [1.0, 0.0, 0.0, 0.0]),  # always at least one token
    ],
)
def test_top_p(top_p, expected):
    logits = [math.log(x) for x in (0.5, 0.25, 0.15, 0.1)]
    assert probs_of(logits, temperature=1.0, top_p=top_p) == pytest.approx(expected, abs=1e-6)


def test_top_p_keeps_ties_at_the_boundary():
    # probs [0.4, 0.2, 0.2, 0.2] exactly tied; top_p = 0.5 needs one 0.2 token, all are kept.
    logits = [math.log(2.0), 0.0, 0.0, 0.0]
    assert probs_of(logits, temperature=1.0, top_p=0.5) == pytest.approx([0.4, 0.2, 0.2, 0.2])


def test_order_temperature_then_top_k_then_top_p():
    logits = [2.0, 1.0, 0.0, -1.0]
    # T = 2 -> weights exp([1, 0.5, 0, -0.5]); top_k = 3 drops the last token;
    # top_p = 0.6 keeps tokens 0 and 1 (mass before token 1 is 0.506 < 0.6, before 2 is 0.81).
    weights = [math.exp(1.0), math.exp(0.5), 1.0]
    assert weights[0] / sum(weights) < 0.6 < (weights[0] + weights[1]) / sum(weights)
    expected = normalised([weights[0], weights[1], 0.0, 0.0])
    got = probs_of(logits, temperature=2.0, top_k=3, top_p=0.6)
    assert got == pytest.approx(expected, abs=1e-6)


@pytest.mark.parametrize("top_p", [0.3, 0.6, 0.9, 0.99])
def test_top_p_after_top_k_equals_top_p_on_the_masked_logits(top_p):
    # logits_to_probs sorts only the top_k candidates for top-p; it must agree with a full
    # sort over the top-k-masked logits, ties included (small integer logits tie often).
    generator = torch.Generator().manual_seed(0)
    logits = torch.randint(-3, 4, (200, 12), generator=generator).float()  # (rows, V)
    for top_k in (1, 3, 5, 11):
        kth = torch.topk(logits, top_k, dim=-1).values[:, -1:]
        masked = logits.masked_fill(logits < kth, -math.inf)
        fast = logits_to_probs(logits, SamplingConfig(temperature=0.9, top_k=top_k, top_p=top_p))
        full = logits_to_probs(masked, SamplingConfig(temperature=0.9, top_p=top_p))
        assert torch.allclose(fast, full, atol=1e-6), top_k
        assert torch.equal(fast > 0, full > 0), top_k


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32, torch.float64])
def test_any_leading_shape_and_dtype(dtype):
    config = SamplingConfig(temperature=0.8, top_k=5, top_p=0.9)
    logits = torch.randn(2, 3, 11, generator=torch.Generator().manual_seed(0)).to(dtype)
    probs = logits_to_probs(logits, config)  # (B, T, V)
    assert probs.shape == (2, 3, 11) and probs.dtype == torch.float32
    assert torch.allclose(probs.sum(-1), torch.ones(2, 3))
    rows = torch.stack([logits_to_probs(row, config) for row in logits.reshape(6, 11)])
    assert torch.equal(probs.reshape(6, 11), rows)


# ---- sample ----


def test_sample_matches_distribution_chi_square():
    probs = torch.tensor([0.05, 0.1, 0.0, 0.35, 0.2, 0.3])
    n = 200_000
    tokens = sample(probs.expand(n, -1), torch.Generator().manual_seed(1234))  # (n,)
    counts = torch.bincount(tokens, minlength=6)
    assert counts[2] == 0  # a zero-probability token is never drawn
    support = probs > 0
    expected = probs[support].double() / probs[support].double().sum() * n
    result = chisquare(counts[support].double().numpy(), expected.numpy())
    assert result.pvalue > 1e-3, result
    # |freq - p| has standard deviation <= 0.5 / sqrt(n) = 0.0011 per token.
    assert torch.allclose(counts.double() / n, probs.double(), atol=0.006)


def test_sample_accepts_unnormalised_rows():
    weights = torch.tensor([0.0, 3.0, 1.0])  # sums to 4: tokens 1, 2 with 0.75, 0.25
    n = 100_000
    tokens = sample(weights.expand(n, -1), torch.Generator().manual_seed(7))
    counts = torch.bincount(tokens, minlength=3)
    assert counts[0] == 0
    assert abs(counts[1].item() / n - 0.75) < 0.006  # sd = 0.0014


def test_sample_never_picks_zero_probability_even_when_mass_is_tiny():
    probs = torch.zeros(10_000, 50)
    probs[:, 17] = 1e-30  # the only token with mass, and a tiny one
    tokens = sample(probs, torch.Generator().manual_seed(3))
    assert torch.all(tokens == 17)


def test_sample_shapes_and_one_hot():
    probs = logits_to_probs(torch.randn(2, 3, 7), SamplingConfig())  # one-hot rows
    tokens = sample(probs, torch.Generator().manual_seed(0))  # (2, 3)
    assert tokens.shape == (2, 3) and tokens.dtype == torch.long
    assert torch.equal(tokens, probs.argmax(-1))


def test_same_seed_same_tokens():
    probs = torch.softmax(torch.randn(64, 100, generator=torch.Generator().manual_seed(0)), -1)
    first = sample(probs, torch.Generator().manual_seed(42))
    second = sample(probs, torch.Generator().manual_seed(42))
    other = sample(probs, torch.Generator().manual_seed(43))
    assert torch.equal(first, second)
    assert not torch.equal(first, other)
