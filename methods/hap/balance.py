"""Load balancing (HAP Sec. 5): the sharding ratios that minimise a fixed Program's time, by LP.

min the iteration time of bench.cost.price (the simulator's own price, overlap of gradient
buckets with backward included), built with LP variables for the ratios: every per-device
quantity is linear in them and every max becomes a variable bounded below by its terms, so at
the optimum the objective is the simulator's time (a reshard is priced from above; see
bench.cost.price). CBC through PuLP; a memory cap per device can be added. It does not
change the program (methods.hap.search does).
"""

from __future__ import annotations

from collections.abc import Sequence

import pulp

from bench.core.cluster import ClusterSpec
from bench.core.errors import PlanningError
from bench.core.program import Affine, Program
from bench.core.shares import round_shares
from bench.cost import LpAlgebra, alike, device_classes, iteration_time, virtual_devices


class InfeasibleError(PlanningError):
    """No ratios satisfy the constraints (e.g. nothing fits in memory)."""

    status = "infeasible"


def balance_ratios(
    program: Program,
    cluster: ClusterSpec,
    memory_limit: bool = False,
    memory_reserve_gib: float = 0.0,
    time_limit_s: float | None = 30.0,
    tied_rows: bool = False,
) -> tuple[list[list[float]], float]:
    """Optimal ratios[segment][device] for `program` on `cluster`, and the LP's objective (s).

    Args:
        memory_limit: also require each device's memory (bench.core.program.Memory) to fit its GPU.
        memory_reserve_gib: GPU memory kept free for the framework when memory_limit is on.
        time_limit_s: CBC time limit; hitting it is an error, not a silent answer.
        tied_rows: every segment gets the same row (reshards then move nothing, and the
            objective is exactly the simulator's time at the solution).

    Raises:
        InfeasibleError: the LP has no solution (the message says which constraint family).
    """
    lp = RatioLP(program, cluster, tied_rows, time_limit_s)
    if memory_limit:
        lp.add_memory_rows(memory_reserve_gib)
    return lp.solve()


class RatioLP:
    """The LP of one program's ratios (balance_ratios), kept so that memory rows can be added
    after a solve without them: the planner solves for the fastest ratios first and, when
    those overflow a GPU, again with the rows, building the objective (thousands of rows on a
    deep model) once."""

    def __init__(
        self, program: Program, cluster: ClusterSpec, tied_rows: bool = False, time_limit_s: float | None = 30.0
    ):
        self.program, self.cluster, self.time_limit_s = program, cluster, time_limit_s
        self.vdevs = virtual_devices(cluster, program.granularity)
        if len(self.vdevs) != program.num_devices:
            raise ValueError(f"program has {program.num_devices} devices, cluster {cluster.name!r} {len(self.vdevs)}")
        m, g = program.num_devices, program.num_segments
        self.prob = pulp.LpProblem("hap_ratios", pulp.LpMinimize)
        # One variable per class of interchangeable devices and row (bench.cost.device_classes):
        # the objective is convex and the same under any permutation within a class, so averaging
        # an optimum over those permutations is an optimum with equal ratios in each class (with
        # free rows, the reshard bound depends on device order: there, equal ratios per class is a
        # restriction, and the simulator judges the result). The LP's size and the price's work
        # then depend on the number of device types, not of devices (bench.cost.algebra.alike).
        # Tied rows are one row of variables that every segment reads (not g rows held equal by
        # constraints: the same LP, a quarter of the model for CBC at 4 segments).
        classes = device_classes(cluster, self.vdevs)
        rows = 1 if tied_rows else g
        self.per_class = [
            [self.prob.add_variable(f"r_{s}_{k}", lowBound=0) for k in range(max(classes) + 1)] for s in range(rows)
        ]
        self.r = [[self.per_class[min(s, rows - 1)][classes[d]] for d in range(m)] for s in range(g)]
        for s in range(rows):
            self.prob += pulp.lpSum(self.r[s]) == 1, f"sum_{s}"
        self.alg = LpAlgebra(self.prob, self.r, tied_rows and g > 1)
        self.objective = None  # built at the first solve
        self.memory_limit = False
        self.reserve_bytes = 0.0

    def add_memory_rows(self, memory_reserve_gib: float = 0.0, ask_first: bool = True) -> None:
        """Require each device's memory (bench.core.program.Memory) to fit its GPU, less the reserve;
        a second call adds nothing. Raises InfeasibleError when no ratios fit (ask_first=False:
        solve() does, once the objective is built; the planner builds it either way)."""
        if self.memory_limit:
            return
        self.memory_limit = True
        self.reserve_bytes = memory_reserve_gib * 2**30
        prob = self.prob
        for v in (self.vdevs[d] for d, _ in alike(self.vdevs, self.alg)):
            self._memory_rows(v, 0.0, "mem")
        if ask_first and self.objective is None:
            # Whether any ratios fit is a question of these few rows alone: answer it before the
            # objective is built and solved. (A stand-in objective: PuLP writes an invalid model
            # when re-solving one first solved without.)
            prob.setObjective(pulp.lpSum(self.per_class[0]))
            _solve(prob, self.time_limit_s, "memory per device", self.cluster, True)

    def hold_one_sample_more(self, devices, batch: int) -> None:
        """Memory rows for `devices` that hold with one sample more than their ratios give:
        a share the rows held exactly can overflow once rounded up to whole samples (planner
        _as_run). Only for the devices that did, as a margin on every device may leave no
        split that fits where a whole-sample one exists."""
        for d in devices:
            self._memory_rows(self.vdevs[d], 1.0 / batch, f"mem_whole_{d}")

    def _memory_rows(self, v, extra: float, name: str) -> None:
        """Rows: device v's memory at each of backward's points and at Adam's step (as the
        simulator prices them), at its ratios plus `extra` of the batch, fits its GPU."""
        alg = self.alg
        memory = self.program.memory
        cap = v.memory_bytes - self.reserve_bytes - (v.compute.workspace_bytes if v.compute is not None else 0.0)

        def at(x: Affine):
            return [alg.at(x, v.index), sum(c for _, c in x.coef) * extra]

        for i, (held, acts) in enumerate(memory.backward_points()):
            self.prob += (
                pulp.lpSum(at(held) + [a * (1.0 / v.num_gpus) for a in at(acts)]) <= cap,
                f"{name}_{v.index}_{i}",
            )
        step = memory.optimizer_step(foreach=self.cluster.device == "cuda")
        self.prob += pulp.lpSum(at(step)) <= cap, f"{name}_step_{v.index}"

    def solve(self) -> tuple[list[list[float]], float]:
        """The optimal ratios under the rows added so far, and the LP's objective (s)."""
        prob, r = self.prob, self.r
        if self.objective is None:
            self.objective = iteration_time(self.program, self.cluster, self.vdevs, self.alg)
            prob.setObjective(
                self.objective if not isinstance(self.objective, (int, float)) else pulp.lpSum([self.objective])
            )
        _solve(
            prob,
            self.time_limit_s,
            "memory per device" if self.memory_limit else "ratio",
            self.cluster,
            self.memory_limit,
        )
        m, g = self.program.num_devices, self.program.num_segments
        ratios = [[max(0.0, r[s][d].value() or 0.0) for d in range(m)] for s in range(g)]
        ratios = [[x / total for x in row] for row, total in ((row, sum(row)) for row in ratios)]
        for s in range(1, g):
            # A row the solver left within rounding of an earlier one is that row: a reshard
            # between equal rows moves nothing (and the simulator charges it nothing).
            for p in range(s):
                if max(abs(a - b) for a, b in zip(ratios[s], ratios[p])) < 1e-6:
                    ratios[s] = list(ratios[p])
                    break
        # One device (or nothing the ratios change): the objective is a number, PuLP's value None.
        objective = self.objective
        return ratios, float(objective if isinstance(objective, (int, float)) else pulp.value(prob.objective))


def _solve(
    prob: pulp.LpProblem, time_limit_s: float | None, what: str, cluster: ClusterSpec, memory_limit: bool
) -> None:
    """Solve with PuLP's bundled CBC (PULP_CBC_CMD, deprecated in PuLP 3.3 in favour of
    COIN_CMD with a separately installed CBC; we keep the bundled one: nothing else to install).
    Anything but an optimal solution is an InfeasibleError naming the constraint family."""
    prob.solve(pulp.PULP_CBC_CMD(msg=False, timeLimit=time_limit_s))
    status = pulp.LpStatus[prob.status]
    # PuLP reports "Optimal" at a time limit too: sol_status tells the two apart.
    if status != "Optimal" or prob.sol_status != pulp.LpSolutionOptimal:
        raise InfeasibleError(
            f"load-balancing LP is {status} (solution status {pulp.LpSolution.get(prob.sol_status, prob.sol_status)}); "
            f"the {what} constraints cannot all hold for cluster {cluster.name!r}"
            + ("; the program does not fit in memory with any ratios" if memory_limit else "")
        )


def shard_lengths(length: int, ratios: Sequence[float], unit: int = 1) -> list[int]:
    """Integer shard lengths of a dim of `length` that sum exactly; length-1 dims never split
    (every device holds the one element). Zero-length shards are allowed. With `unit` > 1
    (a divisor of `length`, e.g. the head size of d_model) every shard is a multiple of it."""
    if length == 1:
        return [1] * len(ratios)
    if unit < 1 or length % unit:
        raise ValueError(f"shard unit {unit} must be >= 1 and divide the dim length {length}")
    return [unit * k for k in round_shares(length // unit, ratios)]


def batch_shares(global_batch: int, ratios: Sequence[float]) -> list[int]:
    """Samples per virtual device; sums to the global batch."""
    return round_shares(global_batch, ratios)
