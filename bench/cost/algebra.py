"""What a price is made of: numbers at given ratios, or PuLP expressions of the ratio variables.

bench.cost.price writes every price once, over an algebra: FloatAlgebra evaluates it at fixed
ratios (the simulator, the search), LpAlgebra builds LP expressions (the load balancer,
methods.hap.balance), where `max` is a fresh variable bounded below by every term. `alike`
groups the devices that price the same, so pricing one per group is exact.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from bench.core.program import Affine, Ratios, reshard_fractions
from bench.cost.devices import VirtualDevice

if TYPE_CHECKING:
    import pulp

Value = Any  # a float, or a PuLP expression


class FloatAlgebra:
    """Prices as numbers, at given ratios (the simulator and the search). `busiest`: the ratios
    of each machine-level device's busiest GPU, times its GPU count (busiest_gpu_ratios), for
    what each GPU computes on its own samples; None: an even split inside every machine."""

    def __init__(self, ratios: Ratios, busiest: Ratios | None = None):
        self.ratios = ratios
        self.busiest = busiest

    def at(self, a: Affine, device: int) -> float:
        return a.at(self.ratios, device)

    def at_busiest(self, a: Affine, device: int) -> float:
        """a at the device's busiest GPU's samples, as if every GPU of it had as many."""
        return a.at(self.ratios if self.busiest is None else self.busiest, device)

    def column(self, device: int) -> tuple:
        """What a device's prices depend on besides its hardware: its ratio in every row."""
        return tuple(row[device] for row in self.ratios)

    def max(self, items: Sequence[float]) -> float:
        return max(items)

    def sum(self, items: Sequence[float]) -> float:
        return sum(items)

    def settle(self, x: float) -> float:
        return x

    def reshard(self, alpha: float, beta_nbytes: float, src: int, dst: int) -> float:
        moved = max(reshard_fractions(self.ratios[src], self.ratios[dst]))
        return alpha + beta_nbytes * moved if moved > 1e-12 else 0.0  # equal rows: nothing moves


class LpAlgebra:
    """Prices as PuLP expressions of ratio variables r[segment][device] (the load balancer)."""

    def __init__(self, prob: pulp.LpProblem, ratios: Sequence[Sequence[pulp.LpVariable]], tied_rows: bool = False):
        import pulp  # here, not at import: the emulated links' workers use this package's prices, never an LP

        self._pulp = pulp
        """tied_rows: the caller constrains every segment's row to be the same, so a reshard
        moves nothing and costs nothing (exactly as at equal rows in FloatAlgebra)."""
        self.prob = prob
        self.ratios = ratios
        self.tied_rows = tied_rows
        self._names = itertools.count()
        self._gaps: dict = {}
        # (first, last) device of each run of neighbours that share their ratio variables
        self._runs: list[tuple[int, int]] = []
        for d in range(len(ratios[0]) if ratios else 0):
            if self._runs and self.column(d) == self.column(self._runs[-1][0]):
                self._runs[-1] = (self._runs[-1][0], d)
            else:
                self._runs.append((d, d))
        # The devices whose reshard bound can be the largest: inside a run of devices with the
        # same variables the prefix difference is linear in the device index, so
        # |gap(d-1)| + |gap(d)| is convex along the run and its max is at one of the run's ends
        # (exact, and linear in the number of runs instead of quadratic in the devices).
        self._run_ends = sorted({d for run in self._runs for d in run})

    def at(self, a: Affine, device: int) -> Value:
        if a.is_constant:
            return a.const
        return a.const + self._pulp.lpSum(c * self.ratios[s][device] for s, c in a.coef)

    def at_busiest(self, a: Affine, device: int) -> Value:
        """As `at`: the LP's shares are continuous, a machine's split inside it even (the
        planner prices its rounded answer with the simulator, busiest GPUs included)."""
        return self.at(a, device)

    def column(self, device: int) -> tuple:
        """Its ratio variables: devices of one class share them (methods.hap.balance)."""
        return tuple(id(row[device]) for row in self.ratios)

    def max(self, items: Sequence[Value]) -> Value:
        numbers = [x for x in items if isinstance(x, (int, float))]
        exprs = [x for x in items if not isinstance(x, (int, float))]
        if not exprs:
            return max(numbers)
        t = self.prob.add_variable(f"max_{next(self._names)}")
        for e in exprs + ([max(numbers)] if numbers else []):
            self.prob.addConstraint(t >= e, f"max_{t.name}_{next(self._names)}")
        return t

    def sum(self, items: Sequence[Value]) -> Value:
        return self._pulp.lpSum(items)

    def settle(self, x: Value) -> Value:
        """A long sum about to be copied into another expression or a max (the compute lane
        through a model's backward, at every collective stage): one variable bounded below by
        it instead, exact at the optimum as a max is. Without it the LP grows quadratically in
        the stages (docs/planner.md, "Load balancer")."""
        if not isinstance(x, self._pulp.LpAffineExpression) or len(x) <= 8:
            return x
        return self.max([x])

    def reshard(self, alpha: float, beta_nbytes: float, src: int, dst: int) -> Value:
        if self.tied_rows:
            return 0.0
        return alpha + beta_nbytes * self.max(
            [self._gap(src, dst, d - 1) + self._gap(src, dst, d) for d in self._run_ends]
        )

    def _prefix(self, row: int, i: int) -> Value:
        """The sum of `row`'s ratios of devices 0..i, one term per run."""
        terms = []
        for first, last in self._runs:
            if first > i:
                break
            terms.append((min(last, i) - first + 1) * self.ratios[row][first])
        return self._pulp.lpSum(terms)

    def _gap(self, src: int, dst: int, i: int) -> Value:
        """|prefix sum of src's first i+1 ratios - the same of dst|: how far the boundary
        between devices i and i+1 moves; zero at both ends."""
        if i < 0 or i >= len(self.ratios[0]) - 1:
            return 0.0
        key = (min(src, dst), max(src, dst), i)
        if key not in self._gaps:
            u = self.prob.add_variable(f"gap_{key[0]}_{key[1]}_{i}", lowBound=0)
            diff = self._prefix(src, i) - self._prefix(dst, i)
            self.prob.addConstraint(u >= diff, f"{u.name}_pos")
            self.prob.addConstraint(u >= -diff, f"{u.name}_neg")
            self._gaps[key] = u
        return self._gaps[key]


def alike(vdevs: list[VirtualDevice], alg) -> list[tuple[int, int]]:
    """(a device, how many) per group of devices that price alike: the same hardware and the
    same ratios (numbers, or LP variables) in every row. Every price below is a max or a sum
    over devices of one expression, so pricing one device per group is exact; on a cluster of
    a few device types it makes the cost independent of how many devices there are."""
    cache = alg.__dict__.setdefault("_alike", {})
    key = id(vdevs)
    if key not in cache:
        groups: dict[tuple, list[int]] = {}
        for v in vdevs:
            groups.setdefault((_hardware(v), alg.column(v.index)), []).append(v.index)
        cache[key] = (vdevs, [(members[0], len(members)) for members in groups.values()])
    return cache[key][1]


def _hardware(v: VirtualDevice) -> tuple:
    """What a device's prices and limits depend on besides its ratios (device_compute, the
    steps inside a machine, the LP's memory rows)."""
    return v.flops, v.speed, v.num_gpus, v.memory_bytes, id(v.compute)
