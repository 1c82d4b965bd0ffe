"""Integer shares of a batch (or of a tensor dimension) in proportion to weights.

Largest-remainder rounding: the shares sum exactly to the total and are never negative.
"""

from __future__ import annotations

from collections.abc import Sequence


def round_shares(total: int, weights: Sequence[float], min_share: int = 0) -> list[int]:
    """Split `total` into len(weights) integers proportional to `weights`.

    Args:
        total: the integer to split (e.g. the global batch).
        weights: non-negative weights, at least one positive.
        min_share: every share gets at least this many (needs total >= min_share * n).

    Ties in the remainders go to the lower index, so the result is deterministic.
    """
    n = len(weights)
    if n == 0 or total < 0:
        raise ValueError(f"cannot split {total} over {n} parts")
    if any(w < 0 for w in weights) or not any(w > 0 for w in weights):
        raise ValueError(f"weights {list(weights)} must be >= 0 with one > 0")
    if total < min_share * n:
        raise ValueError(f"total={total} is smaller than min_share={min_share} x {n} parts")
    rest = total - min_share * n
    wsum = float(sum(weights))
    exact = [rest * w / wsum for w in weights]
    shares = [int(x) for x in exact]
    order = sorted(range(n), key=lambda i: (-(exact[i] - shares[i]), i))
    for i in order[: rest - sum(shares)]:
        shares[i] += 1
    return [s + min_share for s in shares]


def offsets(shares: Sequence[int]) -> list[tuple[int, int]]:
    """[start, stop) of each share in the concatenation."""
    out, start = [], 0
    for s in shares:
        out.append((start, start + s))
        start += s
    return out
