"""Load balancing (HAP Sec. 5): the sharding ratios that minimise a fixed Program's time, by LP.

min sum over stages of (slowest device's compute + each collective's time), with every
per-device quantity linear in the ratios; CBC through PuLP. Constant terms are kept, the
per-stage variables are unbounded, and a memory cap per device can be added. It does not
change the program (methods.hap.search does); overlapped stages are costed as sequential.
"""

from __future__ import annotations

from typing import Sequence

import pulp

from bench.cluster import ClusterSpec
from bench.cost import collective_linear_cost
from bench.interfaces import PlanningError
from bench.program import Affine, Program
from bench.shares import round_shares
from bench.simulate import collective_cost, virtual_devices


class InfeasibleError(PlanningError):
    """No ratios satisfy the constraints (e.g. nothing fits in memory)."""

    status = "infeasible"


def _expr(a: Affine, r, device: int):
    return a.const + pulp.lpSum(c * r[s][device] for s, c in a.coef)


def balance_ratios(
    program: Program,
    cluster: ClusterSpec,
    memory_limit: bool = False,
    memory_reserve_gib: float = 0.0,
    time_limit_s: float | None = 30.0,
) -> tuple[list[list[float]], float]:
    """Optimal ratios[segment][device] for `program` on `cluster`, and the LP's objective (s).

    Args:
        memory_limit: also require each device's memory (bench.program.Memory) to fit its GPU.
        memory_reserve_gib: GPU memory kept free for the framework when memory_limit is on.
        time_limit_s: CBC time limit; hitting it is an error, not a silent answer.

    Raises:
        InfeasibleError: the LP has no solution (the message says which constraint family).
    """
    vdevs = virtual_devices(cluster, program.granularity)
    if len(vdevs) != program.num_devices:
        raise ValueError(f"program has {program.num_devices} devices, cluster {cluster.name!r} {len(vdevs)}")
    m, g = program.num_devices, program.num_segments
    prob = pulp.LpProblem("hap_ratios", pulp.LpMinimize)
    r = [[prob.add_variable(f"r_{s}_{d}", lowBound=0) for d in range(m)] for s in range(g)]
    for s in range(g):
        prob += pulp.lpSum(r[s]) == 1, f"sum_{s}"
    objective = []
    moved = _reshard_bounds(prob, r)
    for k, st in enumerate(program.stages):
        comp_exprs = []
        for v in vdevs:
            e = _expr(st.flops, r, v.index) * (1.0 / v.flops)
            if v.num_gpus > 1 and not (st.grad_bytes.is_constant and st.grad_bytes.const == 0):
                alpha, beta, _ = collective_linear_cost("all_reduce", "ring", v.num_gpus, cluster.intra_machine)
                e = e + alpha + beta * _expr(st.grad_bytes, r, v.index)
            comp_exprs.append(e)
        if any(not isinstance(e, (int, float)) for e in comp_exprs):
            t = prob.add_variable(f"comp_{k}")
            for d, e in enumerate(comp_exprs):
                prob += t >= e, f"comp_{k}_{d}"
            objective.append(t)
        else:
            objective.append(max(comp_exprs))
        for j, c in enumerate(st.collectives):
            members = list(range(m)) if c.devices is None else list(c.devices)
            alpha, beta, agg = collective_cost(c, cluster, vdevs)
            if alpha == 0.0 and beta == 0.0:
                continue
            if agg == "reshard":
                src, dst = c.rows
                if src == dst:
                    continue
                t = prob.add_variable(f"comm_{k}_{j}")
                for d in range(m):
                    prob += t >= alpha + beta * c.nbytes.const * moved(src, dst, d), f"comm_{k}_{j}_{d}"
                objective.append(t)
            elif agg == "sum":
                objective.append(alpha + beta * pulp.lpSum(_expr(c.nbytes, r, d) for d in members))
            elif c.nbytes.is_constant:
                objective.append(alpha + beta * c.nbytes.const)
            else:
                t = prob.add_variable(f"comm_{k}_{j}")
                for d in members:
                    prob += t >= alpha + beta * _expr(c.nbytes, r, d), f"comm_{k}_{j}_{d}"
                objective.append(t)
    if memory_limit:
        total = program.memory.params + program.memory.grads + program.memory.optimizer
        for v in vdevs:
            cap = v.memory_bytes - memory_reserve_gib * 2**30
            per_gpu = _expr(total, r, v.index) + _expr(program.memory.activations, r, v.index) * (1.0 / v.num_gpus)
            prob += per_gpu <= cap, f"mem_{v.index}"
    prob += pulp.lpSum(objective)
    # PuLP 3.3 deprecates PULP_CBC_CMD (the bundled CBC) in favour of COIN_CMD with a
    # separately installed CBC; we keep the bundled one (nothing else to install).
    solver = pulp.PULP_CBC_CMD(msg=False, timeLimit=time_limit_s)
    prob.solve(solver)
    status = pulp.LpStatus[prob.status]
    # PuLP reports "Optimal" at a time limit too: sol_status tells the two apart.
    if status != "Optimal" or prob.sol_status != pulp.LpSolutionOptimal:
        what = "memory per device" if memory_limit else "ratio"
        raise InfeasibleError(
            f"load-balancing LP is {status} (solution status {pulp.LpSolution.get(prob.sol_status, prob.sol_status)}); "
            f"the {what} constraints cannot all hold for cluster {cluster.name!r}"
            + ("; the program does not fit in memory with any ratios" if memory_limit else "")
        )
    ratios = [[max(0.0, r[s][d].value() or 0.0) for d in range(m)] for s in range(g)]
    ratios = [[x / sum(row) for x in row] for row in ratios]
    for s in range(1, g):
        # A row the solver left within rounding of an earlier one is that row: a reshard
        # between equal rows moves nothing (and the simulator charges it nothing).
        for p in range(s):
            if max(abs(a - b) for a, b in zip(ratios[s], ratios[p])) < 1e-6:
                ratios[s] = list(ratios[p])
                break
    return ratios, float(pulp.value(prob.objective))


def _reshard_bounds(prob: pulp.LpProblem, r):
    """moved(src, dst, d): an upper bound, linear in the ratios, of the fraction of a tensor
    device d sends or receives when shards move from row src to row dst: the distance its two
    interval ends move, |prefix_src - prefix_dst| before and after it (bench.program
    reshard_fractions is the exact amount the simulator charges)."""
    m = len(r[0])
    gaps: dict = {}

    def gap(src: int, dst: int, i: int):
        # |sum of the first i+1 ratios of src - the same of dst|; zero at both ends.
        if i < 0 or i >= m - 1:
            return 0.0
        key = (min(src, dst), max(src, dst), i)
        if key not in gaps:
            u = prob.add_variable(f"gap_{key[0]}_{key[1]}_{i}", lowBound=0)
            diff = pulp.lpSum(r[src][j] for j in range(i + 1)) - pulp.lpSum(r[dst][j] for j in range(i + 1))
            prob.addConstraint(u >= diff, f"gap_{key[0]}_{key[1]}_{i}_pos")
            prob.addConstraint(u >= -diff, f"gap_{key[0]}_{key[1]}_{i}_neg")
            gaps[key] = u
        return gaps[key]

    return lambda src, dst, d: gap(src, dst, d - 1) + gap(src, dst, d)


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
