"""Aggregates over repeats: median with a distribution-free confidence interval, MLPerf-style
trimmed mean, coefficient of variation.

The interval for the median is the order-statistic (binomial) interval: for N sorted values
x(1) <= ... <= x(N), [x(k), x(N+1-k)] covers the true median with probability
1 - 2 P(B <= k-1), B ~ Binomial(N, 1/2), whatever the distribution of the values (they need only
be independent draws of one distribution). k is the largest with coverage >= 95%; below 6 repeats
none reaches 95% and the interval is [min, max] with its lower coverage stated (N=5: 93.8%).
"""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass


@dataclass(frozen=True)
class Summary:
    n: int
    median: float
    low: float  # confidence interval of the median
    high: float
    coverage: float  # its actual coverage probability
    trimmed_mean: float  # MLPerf: drop the fastest and the slowest run (N >= 5), mean of the rest
    cv: float  # sample std / mean (0 for one value)

    def as_dict(self) -> dict:
        return dict(self.__dict__)

    def overlaps(self, other: Summary) -> bool:
        return self.low <= other.high and other.low <= self.high


def _binom_cdf(k: int, n: int) -> float:
    return sum(math.comb(n, i) for i in range(k + 1)) / 2**n


def median_interval(n: int, confidence: float = 0.95) -> tuple[int, float]:
    """(k, coverage): the interval [x(k), x(n+1-k)] (1-based) and its coverage probability."""
    k, coverage = 1, 1 - 2 * _binom_cdf(0, n)
    while k + 1 <= (n + 1) // 2:
        wider = 1 - 2 * _binom_cdf(k, n)
        if wider < confidence:
            break
        k, coverage = k + 1, wider
    return k, coverage


def trimmed_mean(values: list[float]) -> float:
    ordered = sorted(values)
    if len(ordered) >= 5:
        ordered = ordered[1:-1]
    return statistics.fmean(ordered)


def summarize(values: list[float], confidence: float = 0.95) -> Summary:
    if not values:
        raise ValueError("summarize needs at least one value")
    ordered = sorted(values)
    n = len(ordered)
    k, coverage = median_interval(n, confidence) if n > 1 else (1, 0.0)
    mean = statistics.fmean(ordered)
    cv = statistics.stdev(ordered) / mean if n > 1 and mean else 0.0
    return Summary(n, statistics.median(ordered), ordered[k - 1], ordered[n - k], coverage, trimmed_mean(ordered), cv)


def ranks(summaries: dict[str, Summary]) -> dict[str, int]:
    """Rank 1 = fastest (lowest value). A method's rank is one more than the number of methods
    whose whole interval lies below its own: methods whose intervals overlap share a rank."""
    return {name: 1 + sum(o.high < s.low for o in summaries.values()) for name, s in summaries.items()}
