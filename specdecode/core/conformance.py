"""Statistics for `specdecode check`: is a sample drawn with speculation distributed like
one drawn without it?

Two samples of categories (tokens, say) go into a 2 x C table of counts. Categories so
rare that a cell's expected count would fall below 5 are pooled into one bin (and that
bin into the rarest other category while it is still that rare), since the chi-square
approximation needs expected counts of about 5 or more. The chi-square test of
homogeneity on the pooled table gives a p-value: the chance, were both samples drawn from
one distribution, of a statistic at least this large. With df = C - 1 degrees of freedom
it is the upper tail of the chi-square distribution, Q(df/2, stat/2) (the regularised
upper incomplete gamma function, `torch.special.gammaincc`), so no scipy is needed.
The total variation distance between the two empirical distributions (unpooled) says how
far apart they look, in probability mass.

Many tests at once (positions x prompts) keep a family-wise false-alarm rate alpha by
Bonferroni: each test must reach p < alpha / number_of_tests to count as a failure.

Pure functions of counts; nothing here knows about models.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from typing import Hashable, Sequence

import torch

MIN_EXPECTED = 5.0


@dataclass(frozen=True)
class Homogeneity:
    """A two-sample chi-square test of homogeneity."""

    statistic: float
    df: int
    p_value: float
    tv_distance: float  # between the two empirical distributions, before pooling
    categories: int  # distinct values seen in either sample
    bins: int  # columns of the table tested, after pooling rare categories

    def to_dict(self) -> dict:
        return {"statistic": self.statistic, "df": self.df, "p_value": self.p_value,
                "tv_distance": self.tv_distance, "categories": self.categories, "bins": self.bins}


def chi2_sf(statistic: float, df: int) -> float:
    """P(X >= statistic) for X ~ chi-square with df degrees of freedom (df = 0: 1.0)."""
    if df < 0 or statistic < 0:
        raise ValueError(f"need df >= 0 and statistic >= 0, got df={df}, statistic={statistic}")
    if df == 0:
        return 1.0
    a = torch.tensor(df / 2.0, dtype=torch.float64)
    x = torch.tensor(statistic / 2.0, dtype=torch.float64)
    return float(torch.special.gammaincc(a, x))


def count_table(sample_a: Sequence[Hashable], sample_b: Sequence[Hashable]) -> tuple[list, list[list[int]]]:
    """(categories, 2 x C counts), categories ordered by total count, most common first."""
    counts_a, counts_b = Counter(sample_a), Counter(sample_b)
    both = counts_a + counts_b
    categories = sorted(both, key=lambda c: (-both[c], repr(c)))
    return categories, [[counts_a[c] for c in categories], [counts_b[c] for c in categories]]


def pool_rare(table: list[list[int]], min_expected: float = MIN_EXPECTED) -> list[list[int]]:
    """Merge the columns of a 2 x C count table whose smaller expected cell count is below
    min_expected into one column; while that column is still below it, merge it into the
    rarest remaining one. Returns the pooled 2 x C' table (C' >= 1)."""
    rows = [sum(row) for row in table]
    total = sum(rows)
    if total == 0:
        return [[0], [0]]
    scale = min(rows) / total  # the smaller expected cell of a column = its total * scale

    def rare(column_total: int) -> bool:
        return column_total * scale < min_expected

    columns = [(a, b) for a, b in zip(*table)]
    kept = [c for c in columns if not rare(c[0] + c[1])]
    pooled = [sum(c[0] for c in columns if rare(c[0] + c[1])), sum(c[1] for c in columns if rare(c[0] + c[1]))]
    if sum(pooled):
        kept.sort(key=lambda c: c[0] + c[1])
        while kept and rare(sum(pooled)):
            a, b = kept.pop(0)
            pooled = [pooled[0] + a, pooled[1] + b]
        kept.append(tuple(pooled))
    return [[c[0] for c in kept], [c[1] for c in kept]]


def chi2_statistic(table: list[list[int]]) -> tuple[float, int]:
    """(Pearson's chi-square statistic, degrees of freedom) of a 2 x C table of counts;
    columns with no counts are ignored."""
    columns = [(a, b) for a, b in zip(*table) if a + b > 0]
    rows = [sum(c[0] for c in columns), sum(c[1] for c in columns)]
    total = sum(rows)
    if not columns or min(rows) == 0:
        raise ValueError(f"both samples need observations, got {rows[0]} and {rows[1]}")
    statistic = 0.0
    for column in columns:
        column_total = column[0] + column[1]
        for row_total, observed in zip(rows, column):
            expected = row_total * column_total / total
            statistic += (observed - expected) ** 2 / expected
    return statistic, len(columns) - 1


def total_variation(sample_a: Sequence[Hashable], sample_b: Sequence[Hashable]) -> float:
    """Half the L1 distance between the two samples' empirical distributions, in [0, 1]."""
    if not sample_a or not sample_b:
        raise ValueError("both samples need observations")
    counts_a, counts_b = Counter(sample_a), Counter(sample_b)
    n_a, n_b = len(sample_a), len(sample_b)
    return 0.5 * sum(abs(counts_a[c] / n_a - counts_b[c] / n_b) for c in counts_a.keys() | counts_b.keys())


def homogeneity(sample_a: Sequence[Hashable], sample_b: Sequence[Hashable],
                min_expected: float = MIN_EXPECTED) -> Homogeneity:
    """The chi-square test of homogeneity between two samples of categories, rare
    categories pooled. One category in all (or all pooled into one): df 0, p-value 1."""
    categories, table = count_table(sample_a, sample_b)
    if not sample_a or not sample_b:
        raise ValueError("both samples need observations")
    pooled = pool_rare(table, min_expected)
    statistic, df = chi2_statistic(pooled)
    return Homogeneity(statistic, df, chi2_sf(statistic, df), total_variation(sample_a, sample_b),
                       len(categories), len(pooled[0]))


def bonferroni(alpha: float, tests: int) -> float:
    """The per-test threshold that keeps the chance of any false alarm among `tests` at
    most alpha."""
    if not 0.0 < alpha < 1.0:
        raise ValueError(f"alpha must be in (0, 1), got {alpha}")
    return alpha / max(tests, 1)
