"""The one price of a Program: seconds per iteration as a function of the sharding ratios.

Every consumer prices a program through `iteration_time`: the simulator with numbers for the
ratios (FloatAlgebra), the load balancer with LP variables (LpAlgebra, methods.hap.balance),
and the search per stage (stage_time). The algebra decides what `max` means: a number, or a
fresh LP variable bounded below by every term (exact at the LP's optimum, since the time is
non-decreasing in each term).

The timeline has two lanes per iteration, computation and the network:
  - a stage without collectives computes after the previous computation;
  - a stage with collectives starts when both lanes are free; its collectives run, then its
    computation (overlap=False), or its computation runs beside them (overlap=True: gradient
    buckets launched while backward goes on, as DDP does);
  - machine-level devices (data parallel inside each machine) have a third lane, the
    intra-machine link: a stage's gradients are all-reduced among the machine's GPUs once the
    stage has computed them, beside the rest of backward (DDP buckets inside the machine);
  - a collective among machines is priced in the paper's three steps: inside each machine to
    its leader, among the leaders, back (collective_price);
  - the iteration ends when all lanes are done, but not before the host of a GPU whose
    profile measured its dispatch cost has queued every kernel of forward and backward
    (host_times: small shares are launch-bound); then the optimizer step of a device with a
    measured profile (its kernels, or its host's queueing of them, whichever is longer), plus
    the slowest device's per-step overhead and the method's own host work (per_step_s).

Where the LP must approximate, it prices more, never less: with free rows a reshard charges
the moved intervals' ends (an upper bound of what moves, bench.core.program.reshard_fractions) and
its latency even where the rows come out equal; with tied rows (every segment's row the same)
the price is exact.
"""

from __future__ import annotations

import itertools
from collections import Counter
from collections.abc import Sequence
from typing import Any

import pulp

from bench.core.cluster import ClusterSpec, Link
from bench.core.program import Affine, Collective, Program, Ratios, Stage, reshard_fractions
from bench.core.shares import round_shares
from bench.cost.devices import VirtualDevice
from bench.cost.links import collective_linear_cost, collective_time_s

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
        return a.const + pulp.lpSum(c * self.ratios[s][device] for s, c in a.coef)

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
        return pulp.lpSum(items)

    def settle(self, x: Value) -> Value:
        """A long sum about to be copied into another expression or a max (the compute lane
        through a model's backward, at every collective stage): one variable bounded below by
        it instead, exact at the optimum as a max is. Without it the LP grows quadratically in
        the stages (results/planner/20261125-planner-time.md)."""
        if not isinstance(x, pulp.LpAffineExpression) or len(x) <= 8:
            return x
        return self.max([x])

    def reshard(self, alpha: float, beta_nbytes: float, src: int, dst: int) -> Value:
        if self.tied_rows:
            return 0.0
        return alpha + beta_nbytes * self.max([self._gap(src, dst, d - 1) + self._gap(src, dst, d)
                                               for d in self._run_ends])

    def _prefix(self, row: int, i: int) -> Value:
        """The sum of `row`'s ratios of devices 0..i, one term per run."""
        terms = []
        for first, last in self._runs:
            if first > i:
                break
            terms.append((min(last, i) - first + 1) * self.ratios[row][first])
        return pulp.lpSum(terms)

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


def _is_zero(x: Value) -> bool:
    return isinstance(x, (int, float)) and x == 0.0


# -- collectives -----------------------------------------------------------------------------
def collective_link(cluster: ClusterSpec, vdevs: list[VirtualDevice], devices: tuple[int, ...] | None) -> Link:
    members = range(len(vdevs)) if devices is None else devices
    return cluster.link_between([r for d in members for r in vdevs[d].ranks])


def collective_cost(c: Collective, cluster: ClusterSpec, vdevs: list[VirtualDevice]) -> tuple[float, float, str]:
    """(alpha_s, beta_s_per_byte, agg) of a collective among its virtual devices (see
    bench.cost.links.collective_linear_cost).

    Members on one machine share its network link. Ring algorithms cross each machine's link
    once per direction, so that changes nothing for them; an all-to-all, though, sends every
    member's off-machine part through it at once: g members per machine of n move
    g * (n - g) / n of a shard each way instead of (n - 1) / n.
    """
    members = list(range(len(vdevs))) if c.devices is None else list(c.devices)
    link = collective_link(cluster, vdevs, c.devices)
    if c.kind == "reshard":
        # One all-to-all in which each device sends and receives only what changes owner
        # (reshard_fractions of the whole tensor); agg "reshard" marks that amount.
        if len(members) <= 1:
            return 0.0, 0.0, "max"
        return link.latency_s, 1.0 / link.bytes_per_s, "reshard"
    alpha, beta, agg = collective_linear_cost(c.kind, c.impl, len(members), link)
    if c.kind == "all_to_all" and link is cluster.inter_machine and len(members) > 1:
        per_machine = Counter(cluster.devices[vdevs[d].ranks[0]].machine for d in members)
        g, n = max(per_machine.values()), len(members)
        if g > 1:
            beta *= g * (n - g) / (n - 1)
    return alpha, beta, agg


def collective_price(c: Collective, cluster: ClusterSpec, vdevs: list[VirtualDevice], alg) -> Value:
    """Seconds of one collective: padded / ring wait for the largest device's bytes, grouped
    calls move every device's bytes (one latency per call), a reshard what changes owner.
    Among machine-level devices, plus the steps inside the machines (hierarchical_steps)."""
    return flat_price(c, cluster, vdevs, alg) + hierarchical_steps(c, cluster, vdevs, alg)


def flat_price(c: Collective, cluster: ClusterSpec, vdevs: list[VirtualDevice], alg) -> Value:
    """Seconds of the collective among the virtual devices themselves (for machines: among
    their leaders, on the slowest link the members span)."""
    costs = alg.__dict__.setdefault("_costs", {})  # per algebra: its cluster and devices are fixed
    key = (c.kind, c.impl, c.devices, id(vdevs))
    members = len(vdevs if c.devices is None else c.devices)
    if key not in costs:
        alpha, beta, agg = collective_cost(c, cluster, vdevs)
        # The host transport's floor for the call (grouped: one broadcast or reduce per member)
        floor = (members * cluster.floor_s("broadcast" if c.kind == "all_gather" else "reduce") if agg == "sum"
                 else cluster.floor_s(c.kind))
        costs[key] = alpha, beta, agg, floor
    alpha, beta, agg, floor = costs[key]
    if alpha == 0.0 and beta == 0.0:
        return 0.0
    if agg == "reshard":
        src, dst = c.rows
        price = 0.0 if src == dst else alg.reshard(alpha, beta * c.nbytes.const, src, dst)
        return 0.0 if _is_zero(price) else floored(alg, price, floor)  # 0: nothing moves, no call
    if c.nbytes.is_constant:
        n = 1 if agg == "max" else members
        return max(alpha + beta * c.nbytes.const * n, floor)
    groups = alike(vdevs, alg) if c.devices is None else [(d, 1) for d in c.devices]
    if agg == "sum":
        return floored(alg, alpha + beta * alg.sum([n * alg.at(c.nbytes, d) if n > 1 else alg.at(c.nbytes, d)
                                                    for d, n in groups]), floor)
    return floored(alg, alpha + beta * alg.max([alg.at(c.nbytes, d) for d, _ in groups]), floor)


def _floor_term(cluster: ClusterSpec, kind: str) -> list[float]:
    """The host transport's floor for a `kind` call as one more term of a max (none: [])."""
    floor = cluster.floor_s(kind)
    return [floor] if floor > 0.0 else []


def floored(alg, price: Value, floor: float) -> Value:
    """A collective's price, no less than the host transport's floor for its calls (emulated CPU
    clusters, bench.runtime.hostlinks): the emulated link paces a real call, which ends when it ends.
    The grouped calls' floor is charged on their sum (exact when every call is at or above its
    floor, or every one below; the least it can be otherwise)."""
    if floor <= 0.0:
        return price
    return max(price, floor) if isinstance(price, (int, float)) else alg.max([price, floor])


def _intra(kind: str, v: VirtualDevice, cluster: ClusterSpec) -> tuple[float, float]:
    """(alpha_s, beta_s_per_byte) of one `kind` call among the GPUs of machine-level device v."""
    link = cluster.intra_machine
    alpha = collective_time_s(kind, 0.0, v.num_gpus, link)
    return alpha, collective_time_s(kind, 1.0, v.num_gpus, link) - alpha


def hierarchical_steps(c: Collective, cluster: ClusterSpec, vdevs: list[VirtualDevice], alg) -> Value:
    """Seconds of the steps inside the machines of a collective among machine-level devices
    (HAP Sec. 3: to the machine's leader, among the leaders (flat_price), back). Zero among
    GPU-level devices and for a collective that spans one device.

    Data parallel inside a machine: each GPU holds its part of the machine's batch of an
    activation, so the leader gathers the parts of the machine's input (intra link) and
    scatters the parts of the output back. Per machine, input and output are: all_reduce the
    buffer and the buffer; all_gather its shard and the gathered tensor (n x the largest shard
    padded, the sum grouped); reduce_scatter the reverse; all_to_all its input buffer both ways.
    A gradient all-reduce (`grad`) starts from the machine's sum (Stage.grad_bytes all-reduced
    it inside the machine), so its leader only broadcasts the result back. The slowest machine
    sets each step's time. Reshards are not hierarchical here (priced flat).
    """
    groups = alike(vdevs, alg) if c.devices is None else [(d, 1) for d in c.devices]
    members = [d for d, _ in groups]
    size = sum(n for _, n in groups)
    inside = [d for d in members if vdevs[d].num_gpus > 1]
    if size <= 1 or not inside or c.kind == "reshard":
        return 0.0
    if c.grad:
        return alg.max([a + b * alg.at(c.nbytes, d) for d in inside for a, b in [_intra("broadcast", vdevs[d], cluster)]]
                       + _floor_term(cluster, "broadcast"))
    own = {d: alg.at(c.nbytes, d) for d in members}
    if c.kind in ("all_gather", "reduce_scatter"):
        full = (alg.sum([n * own[d] if n > 1 else own[d] for d, n in groups]) if c.impl == "grouped"
                else size * alg.max(list(own.values())))
        whole = {d: full for d in members}
        ins, outs = (own, whole) if c.kind == "all_gather" else (whole, own)
    else:  # all_reduce, all_to_all
        ins = outs = own
    to_leader = alg.max([a + b * ins[d] for d in inside for a, b in [_intra("gather", vdevs[d], cluster)]]
                        + _floor_term(cluster, "gather"))
    back = alg.max([a + b * outs[d] for d in inside for a, b in [_intra("scatter", vdevs[d], cluster)]]
                   + _floor_term(cluster, "scatter"))
    return to_leader + back


# -- computation -----------------------------------------------------------------------------
def busiest_gpu_ratios(ratios: Ratios, vdevs: list[VirtualDevice], batch: int) -> Ratios | None:
    """`ratios` with each machine-level device's entry scaled to its busiest GPU: a machine
    splits its share of the `batch` samples over its GPUs in whole samples, evenly (the
    runtime's rule, round_shares, as methods.hap.hierarchy.intra_lengths calls it), so of a share
    of n samples over g GPUs one holds ceil(n / g), not n / g: 11 samples over 2 GPUs are 6
    and 5, priced as 2 x 6. Every row is read as a split of the batch (as the planner rounds
    them, methods.hap.planner._as_run). A share that is not whole samples (the LP's continuous
    answer, before the planner rounds it) keeps n / g per GPU: the LP's own relaxation, so the
    two price such ratios alike. None where no device has several GPUs or the batch is not
    known (0)."""
    machines = [v for v in vdevs if v.num_gpus > 1]
    if not batch or not machines:
        return None
    out = []
    for row in ratios:
        row = list(row)
        for v in machines:
            n = round(row[v.index] * batch)
            if n > 0 and abs(row[v.index] * batch - n) < 1e-6:
                row[v.index] *= v.num_gpus * max(round_shares(n, [1.0] * v.num_gpus)) / n
        out.append(row)
    return out


def device_compute(st: Stage, cluster: ClusterSpec, v: VirtualDevice, alg) -> Value:
    """One device's seconds of a stage's computation: FLOPs / effective FLOP/s, or with a
    measured profile, kernels x fixed cost + FLOPs / the op class's rate. A machine's GPUs
    compute on their own samples at once: its busiest GPU's time (FloatAlgebra.at_busiest)."""
    if v.compute is None:
        t = alg.at_busiest(st.flops, v.index) * (1.0 / v.flops)
    else:  # a measured profile: a fixed cost per kernel plus the op class's rate
        fixed, rate = v.compute.rate(st.op_class)
        t = alg.at_busiest(st.flops, v.index) * (1.0 / (rate * v.speed)) + st.launches * fixed
    return t


def intra_grad_sync(st: Stage, cluster: ClusterSpec, vdevs: list[VirtualDevice], alg, latency_share: float = 1.0) -> Value:
    """Seconds of the all-reduce of a stage's gradients among each machine's GPUs (data
    parallel inside a machine-level device), on the intra-machine link; the slowest machine.
    `latency_share`: the part of the call's latency (and the host transport's floor) charged,
    for gradients that ride in a bucket with others (the search's per-parameter share)."""
    if st.grad_bytes.is_constant and st.grad_bytes.const == 0:
        return 0.0
    terms = [alpha * latency_share + beta * alg.at(st.grad_bytes, d) for d, _ in alike(vdevs, alg)
             if vdevs[d].num_gpus > 1
             for alpha, beta, _ in [collective_linear_cost("all_reduce", "ring", vdevs[d].num_gpus, cluster.intra_machine)]]
    floor = [f * latency_share for f in _floor_term(cluster, "all_reduce")]
    return alg.max(terms + floor) if terms else 0.0


def stage_parts(st: Stage, cluster: ClusterSpec, vdevs: list[VirtualDevice], alg) -> tuple[Value, Value]:
    """(seconds of the stage's collectives, one after another; the slowest device's compute)."""
    comm: Value = 0.0
    for c in st.collectives:
        comm = comm + collective_price(c, cluster, vdevs, alg)
    return comm, alg.max([device_compute(st, cluster, vdevs[d], alg) for d, _ in alike(vdevs, alg)])


def iteration_time(program: Program, cluster: ClusterSpec, vdevs: list[VirtualDevice], alg,
                   stage_log: list | None = None) -> Value:
    """Seconds of one iteration (the timeline in the module docstring); appends each stage's
    (comm, compute) to `stage_log` when given."""
    compute_end: Value = 0.0
    network_end: Value = 0.0
    network_idle = True  # known: network_end <= compute_end (no max needed)
    intra_end: Value = 0.0  # the intra-machine gradient all-reduces (machine-level devices)
    intra_idle = True
    # The LP adds up runs of compute-only stages by the shape of their FLOPs first (exact, see
    # _FlopsRun); numbers are added stage by stage, so the simulator's sums are unchanged.
    run = _FlopsRun(vdevs, alg) if isinstance(alg, LpAlgebra) and stage_log is None else None
    # A stage is priced once per what its price reads (a deep model's layers repeat their stages
    # but for the labels): in numbers the same numbers, once; in the LP the same variables, each
    # a max that the objective, increasing in it, holds at its least (exact at the optimum).
    seen: dict = {}
    for st in program.stages:
        if run is not None and not st.collectives and run.take(st):
            continue
        key = _stage_key(st)
        parts = seen.get(key)
        if parts is None:
            parts = seen[key] = (*stage_parts(st, cluster, vdevs, alg), intra_grad_sync(st, cluster, vdevs, alg))
        comm, comp, sync = parts
        if stage_log is not None:
            stage_log.append((comm + sync, comp))
        if run is not None:
            compute_end += run.flush()  # what came before this stage (in place: an LP sum grows)
        if not st.collectives or (_is_zero(comm) and not st.overlap):
            compute_end += comp
        else:
            compute_end = alg.settle(compute_end)
            start = compute_end if network_idle else alg.max([compute_end, network_end])
            network_end = start + comm
            if st.overlap:
                compute_end += comp
                network_idle = False
            else:
                compute_end = network_end + comp
                network_idle = True
        if not _is_zero(sync):  # launched once the stage's gradients exist, beside what follows
            compute_end = alg.settle(compute_end)
            intra_end = (compute_end if intra_idle else alg.max([compute_end, intra_end])) + sync
            intra_idle = False
    if run is not None:
        compute_end += run.flush()
    ends = [compute_end] + ([] if network_idle else [network_end]) + ([] if intra_idle else [intra_end])
    end = ends[0] if len(ends) == 1 else alg.max(ends)
    # A device runs no kernel before its host has queued it: forward and backward end no
    # sooner than the host has queued them, and the optimizer step, whose kernels wait for
    # backward's, then takes the longer of its kernels and its queueing.
    host_steps, host_optimizer = host_times(program, vdevs)
    if host_steps > 0:
        end = alg.max([end, host_steps])
    optimizer = optimizer_time(program, vdevs, alg)
    if host_optimizer > 0:
        optimizer = alg.max([optimizer, host_optimizer])
    return end + optimizer + per_step_s(program, cluster, vdevs, alg)


def _stage_key(st: Stage) -> tuple:
    """What stage_parts and intra_grad_sync read of a stage (not its labels)."""
    return (st.flops, st.grad_bytes, st.op_class, st.launches,
            tuple((c.kind, c.nbytes, c.impl, c.devices, c.rows, c.grad) for c in st.collectives))


def per_step_s(program: Program, cluster: ClusterSpec, vdevs: list[VirtualDevice], alg) -> Value:
    """Seconds of an iteration charged once, after its stages, on the slowest device: an
    emulated worker's measured per-step overhead (bench.runtime.hostspeed), Adam's per-byte cost over the
    parameter bytes the device holds (all of them under data parallelism, its shard of a
    sharded parameter), plus the method's own host work (Program.host_work_flops, at the
    device's FLOP/s: DeepSpeed's engine on CPU workers)."""
    work = program.host_work_flops
    terms = []
    for d, _ in alike(vdevs, alg):
        devices = [cluster.devices[r] for r in vdevs[d].ranks]  # a machine's GPUs hold its params alike
        for fixed, per_byte in {(dev.step_overhead_s + (work / dev.effective_flops if work else 0.0),
                                 dev.optimizer_s_per_byte) for dev in devices}:
            terms.append(fixed + alg.at(program.memory.params, d) * per_byte if per_byte else fixed)
    return alg.max(terms)


class _FlopsRun:
    """Consecutive stages that only add to the compute lane (no collectives, no gradient sync
    inside machines), kept as one FLOPs sum per shape for the LP. Each device of a stage
    computes FLOPs(ratios) / its FLOP/s, so two stages whose FLOPs are proportional (c1 * a,
    c2 * a) give proportional device vectors, and sum over them of the max over devices is the
    max of the sum (max is positively homogeneous): one LP variable per shape and run instead
    of one per stage (ViT-48: thousands of stages, a handful of shapes). Devices with a measured
    profile (a fixed cost per kernel) are priced stage by stage."""

    def __init__(self, vdevs: list[VirtualDevice], alg):
        self.vdevs, self.alg = vdevs, alg
        self.enabled = all(v.compute is None for v in vdevs)
        self.sums: dict[tuple, Affine] = {}

    def take(self, st: Stage) -> bool:
        """Add a collective-free stage to the run; False when it must be priced alone."""
        if not self.enabled or not (st.grad_bytes.is_constant and st.grad_bytes.const == 0):
            return False
        scale = st.flops.const + sum(c for _, c in st.flops.coef)
        if scale <= 0 or st.flops.const < 0 or any(c < 0 for _, c in st.flops.coef):
            return scale == 0 and st.flops.const == 0  # no FLOPs: nothing to add
        shape = (round(st.flops.const / scale, 12), tuple((seg, round(c / scale, 12)) for seg, c in st.flops.coef))
        self.sums[shape] = self.sums[shape] + st.flops if shape in self.sums else st.flops
        return True

    def flush(self) -> Value:
        """The run's seconds on the compute lane (the slowest device per shape); empties it."""
        total: Value = 0.0
        for flops in self.sums.values():
            total = total + self.alg.max([self.alg.at(flops, d) * (1.0 / self.vdevs[d].flops)
                                          for d, _ in alike(self.vdevs, self.alg)])
        self.sums = {}
        return total


def optimizer_time(program: Program, vdevs: list[VirtualDevice], alg) -> Value:
    """The optimizer step after the last stage, on the slowest device: a profile's fixed part
    plus the parameter bytes each GPU updates over its measured rate (memory-bound). Devices
    without a profile: 0 here (their effective FLOP/s, or an emulated worker's measured
    per-step overhead, already cover it)."""
    terms = [fixed + alg.at(program.memory.params, d) * (1.0 / rate)
             for d, _ in alike(vdevs, alg) if vdevs[d].compute is not None and vdevs[d].compute.optimizer is not None
             for fixed, rate in [vdevs[d].compute.optimizer]]
    return alg.max(terms) if terms else 0.0


def host_times(program: Program, vdevs: list[VirtualDevice]) -> tuple[float, float]:
    """(seconds the host spends queueing one iteration's forward and backward kernels: each
    stage's kernels x its class's dispatch cost; and the optimizer step's) on the slowest
    host, for devices whose profile measured them (GPUs: they run kernels while their host
    queues the next ones, bench.core.device_types.ComputeProfile). The same at any ratios: a rank
    launches the same kernels whatever its share."""
    launches: Counter = Counter()
    for st in program.stages:
        launches[st.op_class] += st.launches
    return launch_times(launches, vdevs)


def launch_times(launches: Counter, vdevs: list[VirtualDevice]) -> tuple[float, float]:
    """host_times of an iteration that launches `launches` kernels per op class."""
    profiles = {id(v.compute): v.compute for v in vdevs if v.compute is not None and v.compute.dispatch}
    if not profiles:
        return 0.0, 0.0
    return (max(sum(n * c.dispatch_s(cls) for cls, n in launches.items()) for c in profiles.values()),
            max(c.optimizer_dispatch_s for c in profiles.values()))


def host_time(program: Program, vdevs: list[VirtualDevice]) -> float:
    """Seconds the host spends queueing one iteration's kernels (host_times, added up)."""
    return sum(host_times(program, vdevs))


# -- the same timeline as maps: what the search prices a partial program with ---------------
# iteration_time's lanes (compute end, network end, intra-machine end) after a stage are
# max-plus linear in the lanes before it: lane i after = max over lanes j before of (lane j +
# S[i][j]). So a run of stages is one such map (their product), and a program's forward part,
# run first, and its backward part, run last, compose around whatever comes between. The search
# (methods.hap.search) walks ops in forward order: it keeps the lanes after the forward of its
# prefix (apply) and, for the backward of its prefix, which runs at the end of the iteration in
# reverse, only how the iteration's end depends on the lanes where that backward starts
# (prepend: the end row of the map). Stage maps are never below the identity (no lane ends
# earlier), so ops inserted between can only make the iteration longer: the price of a prefix
# is a lower bound of every program that extends it. With every stage in, end(row, lanes) is
# the end iteration_time computes before the host's queueing, the optimizer and the per-step
# terms (tests/unit/test_cost_model.py).
NEG = float("-inf")
IDENTITY_MAP = (0.0, NEG, NEG, NEG, 0.0, NEG, NEG, NEG, 0.0)  # 3x3, row-major: S[i * 3 + j]
ZERO_LANES = (0.0, 0.0, 0.0)


def stage_map(comm: float, comp: float, collectives: bool, overlap: bool, sync: float = 0.0) -> tuple:
    """The map of one stage, as iteration_time times it: `comm` seconds of its collectives one
    after another, `comp` of its slowest device's compute, whether it has collectives, whether
    they overlap its compute (gradient buckets), and `sync` seconds of its gradients'
    all-reduce inside the machines (the third lane, launched once it has computed)."""
    if not collectives or (comm == 0.0 and not overlap):  # the compute lane alone
        c = (comp, NEG, NEG)
        w = (NEG, 0.0, NEG)
    elif overlap:  # its collectives start when both lanes are free, its compute goes on beside
        c = (comp, NEG, NEG)
        w = (comm, comm, NEG)
    else:  # its compute waits for its collectives
        c = (comm + comp, comm + comp, NEG)
        w = (comm, comm, NEG)
    a = (NEG, NEG, 0.0) if sync == 0.0 else (c[0] + sync, c[1] + sync, sync)
    return (*c, *w, *a)


def compose(later: tuple, earlier: tuple) -> tuple:
    """The map of `earlier` then `later` (max-plus product later x earlier)."""
    return tuple(max(later[i * 3] + earlier[j], later[i * 3 + 1] + earlier[3 + j], later[i * 3 + 2] + earlier[6 + j])
                 for i in range(3) for j in range(3))


def apply(m: tuple, lanes: tuple) -> tuple:
    """The lanes after map `m`, from `lanes`."""
    c, w, a = lanes
    return (max(m[0] + c, m[1] + w, m[2] + a), max(m[3] + c, m[4] + w, m[5] + a),
            max(m[6] + c, m[7] + w, m[8] + a))


def prepend(row: tuple, m: tuple) -> tuple:
    """The end row of (the map whose end row is `row`) after `m`: how the end depends on the
    lanes before `m` runs, once `m` runs first."""
    r0, r1, r2 = row
    return (max(r0 + m[0], r1 + m[3], r2 + m[6]), max(r0 + m[1], r1 + m[4], r2 + m[7]),
            max(r0 + m[2], r1 + m[5], r2 + m[8]))


def end(row: tuple, lanes: tuple) -> float:
    """The iteration's end (the last lane done) from an end row and the lanes it starts from."""
    return max(row[0] + lanes[0], row[1] + lanes[1], row[2] + lanes[2])


def program_maps(program: Program, cluster: ClusterSpec, vdevs: list[VirtualDevice], alg: FloatAlgebra) -> list:
    """The map of every stage of `program` at the algebra's ratios (stage_parts, intra_grad_sync)."""
    maps = []
    for st in program.stages:
        comm, comp = stage_parts(st, cluster, vdevs, alg)
        maps.append(stage_map(comm, comp, bool(st.collectives), st.overlap, intra_grad_sync(st, cluster, vdevs, alg)))
    return maps


def step_terms(program: Program, cluster: ClusterSpec, vdevs: list[VirtualDevice], alg: FloatAlgebra,
               lanes_end: float, launches: Counter | None = None) -> float:
    """An iteration's seconds from where its lanes end (iteration_time's last lines): no sooner
    than the host has queued its kernels, then the optimizer step and the per-step terms.
    `launches`: the kernels per op class where `program` holds no stages (default: its own)."""
    host_steps, host_optimizer = host_times(program, vdevs) if launches is None else launch_times(launches, vdevs)
    t = max(lanes_end, host_steps) if host_steps > 0 else lanes_end
    optimizer = optimizer_time(program, vdevs, alg)
    if host_optimizer > 0:
        optimizer = max(optimizer, host_optimizer)
    return t + optimizer + per_step_s(program, cluster, vdevs, alg)


# -- numbers ---------------------------------------------------------------------------------
# `ratios` below may also be a FloatAlgebra: a caller pricing many things at the same ratios (the
# search) keeps one, so the grouping of devices that price alike is made once.
def _numbers(ratios: Ratios | FloatAlgebra) -> FloatAlgebra:
    return ratios if isinstance(ratios, FloatAlgebra) else FloatAlgebra(ratios)


def collective_time(c: Collective, cluster: ClusterSpec, vdevs: list[VirtualDevice], ratios: Ratios | FloatAlgebra) -> float:
    """Seconds of one collective at these ratios."""
    return collective_price(c, cluster, vdevs, _numbers(ratios))


def stage_time(st: Stage, cluster: ClusterSpec, vdevs: list[VirtualDevice], ratios: Ratios | FloatAlgebra) -> float:
    """Seconds of a stage run alone: its collectives, then its slowest device's compute (not
    the all-reduce of its gradients inside machines, which runs beside later stages)."""
    comm, comp = stage_parts(st, cluster, vdevs, _numbers(ratios))
    return comm + comp
