import random

import pytest

from bench.core.shares import offsets, round_shares


def test_shares_sum_exactly_and_are_never_negative():
    rng = random.Random(0)
    for _ in range(2000):
        n = rng.randint(1, 9)
        weights = [rng.choice([0.0, rng.random(), rng.random() * 1e12]) for _ in range(n)]
        if not any(weights):
            weights[0] = 1.0
        total = rng.randint(0, 500)
        shares = round_shares(total, weights)
        assert sum(shares) == total and min(shares) >= 0
        # Largest remainder: each share is within one of its exact value.
        exact = [total * w / sum(weights) for w in weights]
        assert all(abs(s - e) < 1 for s, e in zip(shares, exact))


def test_shares_follow_the_weights_and_break_ties_by_index():
    assert round_shares(16, [1.0, 0.4]) == [11, 5]
    assert round_shares(7, [1, 1]) == [4, 3]
    assert round_shares(10, [3, 1, 1]) == [6, 2, 2]


def test_min_share_gives_every_part_something():
    assert round_shares(4, [1000, 1, 1], min_share=1) == [2, 1, 1]
    with pytest.raises(ValueError):
        round_shares(2, [1, 1, 1], min_share=1)


@pytest.mark.parametrize("weights", [[], [0, 0], [1, -1]])
def test_bad_weights_are_refused(weights):
    with pytest.raises(ValueError):
        round_shares(5, weights)


def test_offsets_tile_the_batch():
    assert offsets([3, 0, 2]) == [(0, 3), (3, 3), (3, 5)]
