"""Predict one iteration of a bench Program on a ClusterSpec: time per stage, memory, OOM.

The cost model is the one the HAP load balancer optimises (bench.cost); nothing here runs a
model or touches torch.distributed.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

from bench.cluster import ClusterSpec, Link
from bench.cost import collective_linear_cost, collective_time_s
from bench.program import Collective, Program, Ratios, Stage, reshard_fractions

GIB = float(2**30)


@dataclass(frozen=True)
class VirtualDevice:
    """What a planner shards over: one GPU, or one machine running data parallel inside."""

    index: int
    ranks: tuple[int, ...]  # physical ranks it stands for
    flops: float  # effective FLOP/s of all its GPUs together
    memory_bytes: float  # memory of one of its GPUs (the smallest)

    @property
    def num_gpus(self) -> int:
        return len(self.ranks)


def virtual_devices(cluster: ClusterSpec, granularity: str) -> list[VirtualDevice]:
    """The cluster seen as `granularity` ('gpu' or 'machine') devices, in rank order."""
    if granularity == "gpu":
        groups = [(d.rank,) for d in cluster.devices]
    elif granularity == "machine":
        by_machine: dict[int, list[int]] = {}
        for d in cluster.devices:
            by_machine.setdefault(d.machine, []).append(d.rank)
        groups = [tuple(v) for _, v in sorted(by_machine.items())]
    else:
        raise ValueError(f"granularity={granularity!r} is invalid; use 'gpu' or 'machine'")
    out = []
    for i, ranks in enumerate(groups):
        devs = [cluster.devices[r] for r in ranks]
        out.append(
            VirtualDevice(
                i,
                ranks,
                sum(d.effective_flops for d in devs),
                min(d.type.memory_gib for d in devs) * GIB,
            )
        )
    return out


def compute_proportional_ratios(cluster: ClusterSpec, granularity: str, num_segments: int = 1) -> list[list[float]]:
    """Ratios proportional to each virtual device's FLOP/s (DP-CP's split), one row per segment."""
    vdevs = virtual_devices(cluster, granularity)
    total = sum(v.flops for v in vdevs)
    return [[v.flops / total for v in vdevs] for _ in range(num_segments)]


def even_ratios(num_devices: int, num_segments: int = 1) -> list[list[float]]:
    return [[1.0 / num_devices] * num_devices for _ in range(num_segments)]


def collective_link(cluster: ClusterSpec, vdevs: list[VirtualDevice], devices: tuple[int, ...] | None) -> Link:
    members = range(len(vdevs)) if devices is None else devices
    return cluster.link_between([r for d in members for r in vdevs[d].ranks])


def collective_cost(c: Collective, cluster: ClusterSpec, vdevs: list[VirtualDevice]) -> tuple[float, float, str]:
    """(alpha_s, beta_s_per_byte, agg) of a collective among its virtual devices (see
    bench.cost.collective_linear_cost), shared by the simulator and the load balancer.

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


def collective_time(c: Collective, cluster: ClusterSpec, vdevs: list[VirtualDevice], ratios: Ratios) -> float:
    """Seconds of one collective at these ratios (padded = n x largest shard, grouped = sum of
    shards + one latency per call)."""
    members = list(range(len(vdevs))) if c.devices is None else list(c.devices)
    alpha, beta, agg = collective_cost(c, cluster, vdevs)
    if alpha == 0.0 and beta == 0.0:
        return 0.0
    if agg == "reshard":
        moved = max(reshard_fractions(ratios[c.rows[0]], ratios[c.rows[1]]))
        return alpha + beta * c.nbytes.const * moved if moved > 1e-12 else 0.0  # same rows: nothing to do
    per_device = [c.nbytes.at(ratios, d) for d in members]
    amount = sum(per_device) if agg == "sum" else max(per_device)
    return alpha + beta * amount


def device_compute_times(st: Stage, cluster: ClusterSpec, vdevs: list[VirtualDevice], ratios: Ratios) -> list[float]:
    """Per-device seconds of a stage's computation, including the data-parallel gradient
    all-reduce inside a machine-level device."""
    out = []
    for v in vdevs:
        t = st.flops.at(ratios, v.index) / v.flops
        if v.num_gpus > 1:
            nbytes = st.grad_bytes.at(ratios, v.index)
            if nbytes > 0:
                t += collective_time_s("all_reduce", nbytes, v.num_gpus, cluster.intra_machine)
        out.append(t)
    return out


@dataclass
class SimResult:
    iter_time_s: float
    stage_times: list[tuple[float, float]]  # (comm_s, compute_s) per stage
    comm_time_s: float  # sum over stages, before overlap
    compute_time_s: float  # sum over stages of the slowest device's compute
    memory_gib: list[dict[str, float]]  # per virtual device, per GPU of it: params, grads, ...
    peak_mem_gib: list[float]  # per virtual device, per GPU
    oom: bool
    oom_devices: list[int] = field(default_factory=list)

    def to_json(self) -> dict:
        return {
            "predicted_iter_time_s": self.iter_time_s,
            "comm_time_s": self.comm_time_s,
            "compute_time_s": self.compute_time_s,
            "peak_mem_gib": self.peak_mem_gib,
            "oom": self.oom,
            "oom_devices": self.oom_devices,
        }


def simulate(program: Program, cluster: ClusterSpec, ratios: Ratios, memory_reserve_gib: float = 0.0) -> SimResult:
    """Predicted iteration time and memory of `program` on `cluster` with these ratios.

    Args:
        program: the Program; its granularity picks GPUs or machines as devices.
        ratios: [segment][device] sharding ratios, each row summing to 1.
        memory_reserve_gib: memory per GPU the framework takes besides the model (CUDA
            context, allocator slack); subtracted from each GPU's capacity for the OOM flag.

    Stages without overlap start when every device is done with the previous one: a stage
    costs its collectives plus the slowest device's compute. An overlapped stage's
    collectives start when the previous computation ends and run beside its own compute.
    """
    vdevs = virtual_devices(cluster, program.granularity)
    if len(vdevs) != program.num_devices:
        raise ValueError(
            f"the program is for {program.num_devices} {program.granularity} devices, but cluster "
            f"{cluster.name!r} has {len(vdevs)}; plan for this cluster"
        )
    program.check_ratios(ratios)
    compute_end = comm_end = 0.0
    stage_times = []
    for st in program.stages:
        comm = sum(collective_time(c, cluster, vdevs, ratios) for c in st.collectives)
        comp = max(device_compute_times(st, cluster, vdevs, ratios))
        if st.collectives and comm == 0.0 and not st.overlap:
            # Only no-op collectives (a reshard between equal rows): nothing to wait for.
            compute_end += comp
            stage_times.append((comm, comp))
            continue
        start = max(compute_end, comm_end)
        comm_end = start + comm
        if st.overlap:
            compute_end += comp
        else:
            compute_end = comm_end + comp
        stage_times.append((comm, comp))
    memory, peaks, oom_devices = [], [], []
    for v in vdevs:
        parts = {
            "params": program.memory.params.at(ratios, v.index),
            "grads": program.memory.grads.at(ratios, v.index),
            "optimizer": program.memory.optimizer.at(ratios, v.index),
            # Data parallel inside a machine: each GPU keeps the activations of its share.
            "activations": program.memory.activations.at(ratios, v.index) / v.num_gpus,
        }
        gib = {k: val / GIB for k, val in parts.items()}
        memory.append(gib)
        peak = sum(gib.values())
        peaks.append(peak)
        if peak > v.memory_bytes / GIB - memory_reserve_gib:
            oom_devices.append(v.index)
    return SimResult(
        # Per-step work that does not scale with the batch (optimizer, dispatch), as measured
        # for emulated devices (bench.flops); after the last stage, on the slowest device.
        iter_time_s=max(compute_end, comm_end) + max(d.step_overhead_s for d in cluster.devices),
        stage_times=stage_times,
        comm_time_s=sum(c for c, _ in stage_times),
        compute_time_s=sum(p for _, p in stage_times),
        memory_gib=memory,
        peak_mem_gib=peaks,
        oom=bool(oom_devices),
        oom_devices=oom_devices,
    )
