"""The devices a planner shards over (GPUs, or machines running data parallel inside) and the
ratio vectors the planner starts from."""

from __future__ import annotations

from dataclasses import dataclass

from bench.core.cluster import ClusterSpec
from bench.core.device_types import ComputeProfile

GIB = float(2**30)


@dataclass(frozen=True)
class VirtualDevice:
    """What a planner shards over: one GPU, or one machine running data parallel inside."""

    index: int
    ranks: tuple[int, ...]  # physical ranks it stands for
    flops: float  # effective FLOP/s of all its GPUs together
    memory_bytes: float  # memory of one of its GPUs (the smallest)
    compute: ComputeProfile | None = None  # its GPUs' measured profile (one type per machine)
    speed: float = 1.0  # sum of its GPUs' speed multipliers: how many profiled GPUs it is worth

    @property
    def num_gpus(self) -> int:
        return len(self.ranks)


def virtual_devices(cluster: ClusterSpec, granularity: str) -> list[VirtualDevice]:
    """The cluster seen as `granularity` ('gpu' or 'machine') devices, in rank order (worked out
    once per cluster object and granularity: a planner asks for them at every price it takes,
    and a cluster of thousands of GPUs makes each answer cost)."""
    memo = cluster.__dict__.setdefault("_virtual_devices", {})  # not a field: eq, hash and asdict ignore it
    if granularity not in memo:
        memo[granularity] = _virtual_devices(cluster, granularity)
    return list(memo[granularity])


def _virtual_devices(cluster: ClusterSpec, granularity: str) -> list[VirtualDevice]:
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
        profiles = {d.type.compute for d in devs}
        out.append(
            VirtualDevice(
                i,
                ranks,
                sum(d.effective_flops for d in devs),
                min(d.type.memory_gib for d in devs) * GIB,
                profiles.pop() if len(profiles) == 1 else None,
                sum(d.speed for d in devs),
            )
        )
    return out


def device_classes(cluster: ClusterSpec, vdevs: list[VirtualDevice]) -> list[int]:
    """A class index per virtual device: devices of one class are interchangeable (same
    hardware, in machines of the same make-up), so a program, which prices every device by the
    same expression, costs the same under any permutation of them. The load balancer gives a
    class one ratio variable (methods.hap.balance)."""
    parts: dict[int, list] = {}
    for d in cluster.devices:
        parts.setdefault(d.machine, []).append((d.type.name, d.speed))
    makeup = {m: tuple(sorted(p)) for m, p in parts.items()}
    keys: dict[tuple, int] = {}
    return [
        keys.setdefault(
            (v.flops, v.memory_bytes, v.speed, v.num_gpus, id(v.compute), makeup[cluster.devices[v.ranks[0]].machine]),
            len(keys),
        )
        for v in vdevs
    ]


def compute_proportional_ratios(cluster: ClusterSpec, granularity: str, num_segments: int = 1) -> list[list[float]]:
    """Ratios proportional to each virtual device's FLOP/s (DP-CP's split), one row per segment."""
    vdevs = virtual_devices(cluster, granularity)
    total = sum(v.flops for v in vdevs)
    return [[v.flops / total for v in vdevs] for _ in range(num_segments)]


def memory_proportional_ratios(cluster: ClusterSpec, granularity: str, num_segments: int = 1) -> list[list[float]]:
    """Ratios proportional to each virtual device's memory (all its GPUs together)."""
    vdevs = virtual_devices(cluster, granularity)
    total = sum(v.memory_bytes * v.num_gpus for v in vdevs)
    return [[v.memory_bytes * v.num_gpus / total for v in vdevs] for _ in range(num_segments)]


def even_ratios(num_devices: int, num_segments: int = 1) -> list[list[float]]:
    return [[1.0 / num_devices] * num_devices for _ in range(num_segments)]
