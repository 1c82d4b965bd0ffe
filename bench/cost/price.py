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

from collections import Counter

from bench.core.cluster import ClusterSpec, Link
from bench.core.program import Affine, Collective, Program, Ratios, Stage
from bench.cost.algebra import FloatAlgebra, LpAlgebra, Value, alike
from bench.cost.devices import VirtualDevice
from bench.cost.lanes import stage_map
from bench.cost.links import collective_linear_cost, collective_time_s


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
        floor = (
            members * cluster.floor_s("broadcast" if c.kind == "all_gather" else "reduce")
            if agg == "sum"
            else cluster.floor_s(c.kind)
        )
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
        return floored(
            alg,
            alpha + beta * alg.sum([n * alg.at(c.nbytes, d) if n > 1 else alg.at(c.nbytes, d) for d, n in groups]),
            floor,
        )
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
        return alg.max(
            [a + b * alg.at(c.nbytes, d) for d in inside for a, b in [_intra("broadcast", vdevs[d], cluster)]]
            + _floor_term(cluster, "broadcast")
        )
    own = {d: alg.at(c.nbytes, d) for d in members}
    if c.kind in ("all_gather", "reduce_scatter"):
        full = (
            alg.sum([n * own[d] if n > 1 else own[d] for d, n in groups])
            if c.impl == "grouped"
            else size * alg.max(list(own.values()))
        )
        whole = {d: full for d in members}
        ins, outs = (own, whole) if c.kind == "all_gather" else (whole, own)
    else:  # all_reduce, all_to_all
        ins = outs = own
    to_leader = alg.max(
        [a + b * ins[d] for d in inside for a, b in [_intra("gather", vdevs[d], cluster)]]
        + _floor_term(cluster, "gather")
    )
    back = alg.max(
        [a + b * outs[d] for d in inside for a, b in [_intra("scatter", vdevs[d], cluster)]]
        + _floor_term(cluster, "scatter")
    )
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
                busiest = -(-n // v.num_gpus)  # max(round_shares(n, [1.0] * v.num_gpus))
                row[v.index] *= v.num_gpus * busiest / n
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


def intra_grad_sync(
    st: Stage, cluster: ClusterSpec, vdevs: list[VirtualDevice], alg, latency_share: float = 1.0
) -> Value:
    """Seconds of the all-reduce of a stage's gradients among each machine's GPUs (data
    parallel inside a machine-level device), on the intra-machine link; the slowest machine.
    `latency_share`: the part of the call's latency (and the host transport's floor) charged,
    for gradients that ride in a bucket with others (the search's per-parameter share)."""
    if st.grad_bytes.is_constant and st.grad_bytes.const == 0:
        return 0.0
    terms = [
        alpha * latency_share + beta * alg.at(st.grad_bytes, d)
        for d, _ in alike(vdevs, alg)
        if vdevs[d].num_gpus > 1
        for alpha, beta, _ in [collective_linear_cost("all_reduce", "ring", vdevs[d].num_gpus, cluster.intra_machine)]
    ]
    floor = [f * latency_share for f in _floor_term(cluster, "all_reduce")]
    return alg.max(terms + floor) if terms else 0.0


def stage_parts(st: Stage, cluster: ClusterSpec, vdevs: list[VirtualDevice], alg) -> tuple[Value, Value]:
    """(seconds of the stage's collectives, one after another; the slowest device's compute)."""
    comm: Value = 0.0
    for c in st.collectives:
        comm = comm + collective_price(c, cluster, vdevs, alg)
    return comm, alg.max([device_compute(st, cluster, vdevs[d], alg) for d, _ in alike(vdevs, alg)])


def iteration_time(
    program: Program, cluster: ClusterSpec, vdevs: list[VirtualDevice], alg, stage_log: list | None = None
) -> Value:
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
    # A stage object the program holds more than once (micro-steps that share one micro-step's
    # stages) is looked up by its id first (the program keeps it alive meanwhile).
    seen: dict = {}
    by_id: dict = {}
    for st in program.stages:
        if run is not None and not st.collectives and run.take(st):
            continue
        parts = by_id.get(id(st))
        if parts is None:
            key = _stage_key(st)
            parts = seen.get(key)
            if parts is None:
                parts = seen[key] = (*stage_parts(st, cluster, vdevs, alg), intra_grad_sync(st, cluster, vdevs, alg))
            by_id[id(st)] = parts
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
    return (
        st.flops,
        st.grad_bytes,
        st.op_class,
        st.launches,
        tuple((c.kind, c.nbytes, c.impl, c.devices, c.rows, c.grad) for c in st.collectives),
    )


def per_step_s(program: Program, cluster: ClusterSpec, vdevs: list[VirtualDevice], alg) -> Value:
    """Seconds of an iteration charged once, after its stages, on the slowest device: an
    emulated worker's measured per-step overhead (bench.runtime.hostspeed), Adam's per-byte cost over the
    parameter bytes the device holds (all of them under data parallelism, its shard of a
    sharded parameter), plus the method's own host work (Program.host_work_flops, at the
    device's FLOP/s: DeepSpeed's engine on CPU workers). With gradient accumulation the
    per-step overhead, most of it the dispatch of forward's and backward's ops, is paid once
    per micro-step (Program.micro_steps; its optimizer's fixed part, once per step, is
    counted as often: the part a plain step's timing cannot tell apart)."""
    work = program.host_work_flops
    terms = []
    for d, _ in alike(vdevs, alg):
        devices = [cluster.devices[r] for r in vdevs[d].ranks]  # a machine's GPUs hold its params alike
        for fixed, per_byte in {
            (
                dev.step_overhead_s * program.micro_steps + (work / dev.effective_flops if work else 0.0),
                dev.optimizer_s_per_byte,
            )
            for dev in devices
        }:
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
            total = total + self.alg.max(
                [self.alg.at(flops, d) * (1.0 / self.vdevs[d].flops) for d, _ in alike(self.vdevs, self.alg)]
            )
        self.sums = {}
        return total


def optimizer_time(program: Program, vdevs: list[VirtualDevice], alg) -> Value:
    """The optimizer step after the last stage, on the slowest device: a profile's fixed part
    plus the parameter bytes each GPU updates over its measured rate (memory-bound). Devices
    without a profile: 0 here (their effective FLOP/s, or an emulated worker's measured
    per-step overhead, already cover it)."""
    terms = [
        fixed + alg.at(program.memory.params, d) * (1.0 / rate)
        for d, _ in alike(vdevs, alg)
        if vdevs[d].compute is not None and vdevs[d].compute.optimizer is not None
        for fixed, rate in [vdevs[d].compute.optimizer]
    ]
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
    return (
        max(sum(n * c.dispatch_s(cls) for cls, n in launches.items()) for c in profiles.values()),
        max(c.optimizer_dispatch_s for c in profiles.values()),
    )


def host_time(program: Program, vdevs: list[VirtualDevice]) -> float:
    """Seconds the host spends queueing one iteration's kernels (host_times, added up)."""
    return sum(host_times(program, vdevs))


def program_maps(program: Program, cluster: ClusterSpec, vdevs: list[VirtualDevice], alg: FloatAlgebra) -> list:
    """The map of every stage of `program` at the algebra's ratios (stage_parts, intra_grad_sync)."""
    maps = []
    for st in program.stages:
        comm, comp = stage_parts(st, cluster, vdevs, alg)
        maps.append(stage_map(comm, comp, bool(st.collectives), st.overlap, intra_grad_sync(st, cluster, vdevs, alg)))
    return maps


def step_terms(
    program: Program,
    cluster: ClusterSpec,
    vdevs: list[VirtualDevice],
    alg: FloatAlgebra,
    lanes_end: float,
    launches: Counter | None = None,
    share: float = 1.0,
) -> float:
    """An iteration's seconds from where its lanes end (iteration_time's last lines): no sooner
    than the host has queued its kernels, then the optimizer step and the per-step terms.
    `launches`: the kernels per op class where `program` holds no stages (default: its own).
    `share`: the part of the optimizer step and per-step terms charged (hap's search prices one
    of k micro-steps, 1/k of what the iteration pays once: methods.hap.pricing)."""
    host_steps, host_optimizer = host_times(program, vdevs) if launches is None else launch_times(launches, vdevs)
    t = max(lanes_end, host_steps) if host_steps > 0 else lanes_end
    optimizer = optimizer_time(program, vdevs, alg)
    if host_optimizer > 0:
        optimizer = max(optimizer, host_optimizer)
    return t + optimizer * share + per_step_s(program, cluster, vdevs, alg) * share


# -- numbers ---------------------------------------------------------------------------------
# `ratios` below may also be a FloatAlgebra: a caller pricing many things at the same ratios (the
# search) keeps one, so the grouping of devices that price alike is made once.
def _numbers(ratios: Ratios | FloatAlgebra) -> FloatAlgebra:
    return ratios if isinstance(ratios, FloatAlgebra) else FloatAlgebra(ratios)


def collective_time(
    c: Collective, cluster: ClusterSpec, vdevs: list[VirtualDevice], ratios: Ratios | FloatAlgebra
) -> float:
    """Seconds of one collective at these ratios."""
    return collective_price(c, cluster, vdevs, _numbers(ratios))


def stage_time(st: Stage, cluster: ClusterSpec, vdevs: list[VirtualDevice], ratios: Ratios | FloatAlgebra) -> float:
    """Seconds of a stage run alone: its collectives, then its slowest device's compute (not
    the all-reduce of its gradients inside machines, which runs beside later stages)."""
    comm, comp = stage_parts(st, cluster, vdevs, _numbers(ratios))
    return comm + comp
