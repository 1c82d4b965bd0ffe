"""Cluster description: machines, device types and links, validated from conf/cluster/*.yaml.

It says what a cluster is; it does not run anything (bench.emulation enforces it on a host).
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import asdict, dataclass, field, replace
from typing import Any, Mapping


class ConfigError(ValueError):
    """Bad user input: the message names the field, the value and the fix."""


@dataclass(frozen=True)
class DeviceType:
    """One kind of accelerator. FLOP/s are fp32; memory in GiB."""

    name: str
    peak_flops: float | None  # datasheet peak; None where there is no datasheet (emulated CPU)
    effective_flops: float | None  # sustained on real models; None = measured at run time
    memory_gib: float


# Static table, keyed <model>-<GiB>. Peak numbers: NVIDIA datasheets (fp32, SXM2 parts).
# Effective numbers: the HAP authors' profile of BERT-style training with their FLOP counter
# (shared/DESIGN.md, "Reference numbers"), i.e. what those GPUs sustained on these models.
DEVICE_TYPES: dict[str, DeviceType] = {
    # V100 SXM2 16 GB: 15.7 TFLOP/s fp32 (datasheet); HAP profile 3.859e12.
    "V100-16": DeviceType("V100-16", 15.7e12, 3.859e12, 16.0),
    "V100-32": DeviceType("V100-32", 15.7e12, 3.859e12, 32.0),
    # P100 SXM2 16 GB: 10.6 TFLOP/s fp32 (datasheet); HAP profile 2.149e12.
    "P100-16": DeviceType("P100-16", 10.6e12, 2.149e12, 16.0),
    # A100 SXM4 40 GB: 19.5 TFLOP/s fp32 (datasheet); HAP's profile lists a third, faster type at
    # 5.712e12, which we take to be the A100 of the paper's motivation setup.
    "A100-40": DeviceType("A100-40", 19.5e12, 5.712e12, 40.0),
    # A worker process on this host. Its speed is measured at run time (bench.profile_host) and
    # scaled by each machine's `speed`; memory is a budget for the simulator, not enforced.
    "cpu": DeviceType("cpu", None, None, 4.0),
}


@dataclass(frozen=True)
class Link:
    """One link level. bandwidth in Gbit/s (per direction), latency in seconds."""

    bandwidth_gbps: float
    latency_s: float

    @property
    def bytes_per_s(self) -> float:
        return self.bandwidth_gbps * 1e9 / 8


@dataclass(frozen=True)
class Device:
    """One physical device (a worker rank in real mode)."""

    rank: int
    machine: int
    type: DeviceType
    speed: float  # multiplier on the type's effective FLOP/s
    step_overhead_s: float = 0.0  # seconds per training step that do not scale with the batch

    @property
    def effective_flops(self) -> float:
        if self.type.effective_flops is None:
            raise ValueError(
                f"device type {self.type.name!r} has no FLOP/s yet: call ClusterSpec.with_host_speed"
            )
        return self.type.effective_flops * self.speed


@dataclass(frozen=True)
class MachineGroup:
    count: int  # number of identical machines
    device: str
    num_devices: int  # devices per machine
    speed: float = 1.0
    memory_gib: float | None = None  # overrides the device type's memory
    effective_flops: float | None = None  # overrides the type's FLOP/s (e.g. a measured profile)


@dataclass(frozen=True)
class ClusterSpec:
    name: str
    machines: tuple[MachineGroup, ...]
    intra_machine: Link
    inter_machine: Link
    emulated: bool = False  # True: worker processes on this host with emulated speeds and links
    virtual_device: str = "machine"  # what the planner shards over: "gpu" or "machine"
    host_flops: float | None = None  # measured FLOP/s of one host worker (emulated clusters)
    host_step_overhead_s: float = 0.0  # measured per-step seconds of one host worker
    devices: tuple[Device, ...] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        devices = []
        machine = 0
        for g in self.machines:
            base = DEVICE_TYPES[g.device]
            dtype = replace(
                base,
                memory_gib=g.memory_gib if g.memory_gib is not None else base.memory_gib,
                effective_flops=g.effective_flops or base.effective_flops or self.host_flops,
            )
            for _ in range(g.count):
                for _ in range(g.num_devices):
                    # A slower emulated device takes 1/speed as long for everything it computes.
                    overhead = self.host_step_overhead_s / g.speed if g.device == "cpu" else 0.0
                    devices.append(Device(len(devices), machine, dtype, g.speed, overhead))
                machine += 1
        object.__setattr__(self, "devices", tuple(devices))

    @property
    def num_devices(self) -> int:
        return len(self.devices)

    @property
    def num_machines(self) -> int:
        return sum(g.count for g in self.machines)

    def link_between(self, ranks: list[int] | tuple[int, ...]) -> Link:
        """The slowest link level a collective over `ranks` crosses."""
        machines = {self.devices[r].machine for r in ranks}
        return self.inter_machine if len(machines) > 1 else self.intra_machine

    def total_effective_flops(self) -> float:
        return sum(d.effective_flops for d in self.devices)

    def with_host_speed(self, flops: float, step_overhead_s: float = 0.0) -> "ClusterSpec":
        """The same cluster with the host worker's measured speed filled in (bench.flops)."""
        return replace(self, host_flops=flops, host_step_overhead_s=step_overhead_s)

    def fingerprint(self) -> str:
        """Short hash of everything that defines the cluster (not the host measurement)."""
        body = {k: v for k, v in asdict(self).items()
                if k not in ("devices", "host_flops", "host_step_overhead_s")}
        return hashlib.sha256(json.dumps(body, sort_keys=True).encode()).hexdigest()[:12]

    def describe(self) -> str:
        parts = [
            f"{g.count}x{g.num_devices} {g.device}" + (f"@{g.speed:g}" if g.speed != 1 else "")
            for g in self.machines
        ]
        return f"{self.name} ({', '.join(parts)}{', emulated' if self.emulated else ''})"

    @classmethod
    def from_config(cls, cfg: Mapping[str, Any]) -> "ClusterSpec":
        """Validate a plain dict (the resolved `cluster` config group) into a ClusterSpec."""
        name = _get(cfg, "name", str, "cluster")
        _check_fields(cfg, _CLUSTER_FIELDS, f"cluster={name}")
        machines_cfg = cfg.get("machines")
        if not machines_cfg:
            raise ConfigError(
                f"cluster.machines={machines_cfg!r} is empty; list at least one machine group "
                "like {count: 1, device: V100-16, num_devices: 8}"
            )
        groups = []
        for i, m in enumerate(machines_cfg):
            where = f"cluster.machines[{i}]"
            _check_fields(m, _MACHINE_FIELDS, where)
            device = m.get("device")
            if device not in DEVICE_TYPES:
                raise ConfigError(
                    f"{where}.device={device!r} is unknown; known: {', '.join(DEVICE_TYPES)}"
                )
            count = _positive_int(m.get("count", 1), f"{where}.count")
            num = _positive_int(m.get("num_devices"), f"{where}.num_devices")
            speed = _positive(m.get("speed", 1.0), f"{where}.speed")
            mem, flops = m.get("memory_gib"), m.get("effective_flops")
            if mem is not None:
                mem = _positive(mem, f"{where}.memory_gib")
            if flops is not None:
                flops = _positive(flops, f"{where}.effective_flops")
            groups.append(MachineGroup(count, device, num, speed, mem, flops))
        links = {}
        for level in ("intra_machine", "inter_machine"):
            lc = cfg.get("links", {}).get(level)
            if lc is None:
                raise ConfigError(
                    f"cluster.links.{level} is missing; give bandwidth_gbps and latency_s"
                )
            bw = _positive(lc.get("bandwidth_gbps"), f"cluster.links.{level}.bandwidth_gbps")
            lat = lc.get("latency_s")
            if not isinstance(lat, (int, float)) or isinstance(lat, bool) or lat < 0:
                raise ConfigError(
                    f"cluster.links.{level}.latency_s={lat!r} must be a number >= 0 (seconds)"
                )
            links[level] = Link(float(bw), float(lat))
        virtual = cfg.get("virtual_device", "machine")
        if virtual not in ("gpu", "machine"):
            raise ConfigError(
                f"cluster.virtual_device={virtual!r} is invalid; use 'gpu' or 'machine'"
            )
        spec = cls(
            name=name,
            machines=tuple(groups),
            intra_machine=links["intra_machine"],
            inter_machine=links["inter_machine"],
            emulated=bool(cfg.get("emulated", False)),
            virtual_device=virtual,
        )
        expected = cfg.get("num_devices")
        if expected is not None and expected != spec.num_devices:
            raise ConfigError(
                f"cluster.num_devices={expected!r} does not add up: the machine groups hold "
                f"{spec.num_devices} devices; fix the counts or drop num_devices"
            )
        if spec.emulated and any(g.device != "cpu" for g in groups):
            raise ConfigError(
                f"cluster.emulated=true needs device 'cpu' on every machine (got "
                f"{sorted({g.device for g in groups})}); emulated devices differ by `speed`"
            )
        return spec


_MACHINE_FIELDS = {"count", "device", "num_devices", "speed", "memory_gib", "effective_flops"}
_CLUSTER_FIELDS = {"name", "machines", "links", "emulated", "virtual_device", "num_devices",
                   "gpus_per_machine"}


def _check_fields(cfg: Mapping[str, Any], valid: set[str], where: str) -> None:
    unknown = set(cfg) - valid
    if unknown:
        raise ConfigError(f"{where} has unknown field(s) {sorted(unknown)}; valid: "
                          f"{', '.join(sorted(valid))}")


def _get(cfg: Mapping[str, Any], key: str, typ: type, where: str) -> Any:
    value = cfg.get(key)
    if not isinstance(value, typ) or not value:
        raise ConfigError(f"{where}.{key}={value!r} must be a non-empty {typ.__name__}")
    return value


def _positive(value: Any, where: str) -> float:
    if not isinstance(value, (int, float)) or isinstance(value, bool) or not value > 0:
        raise ConfigError(f"{where}={value!r} must be a number > 0")
    return float(value)


def _positive_int(value: Any, where: str) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ConfigError(f"{where}={value!r} must be an integer >= 1")
    return value
