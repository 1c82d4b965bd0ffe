"""Cluster description: machines, device types and links, validated from conf/cluster/*.yaml.

It says what a cluster is; it does not run anything (bench.runtime.emulation enforces it on a host).
Device types are data: one yaml file each under conf/device/ (or device/ in a folder of the user's
own configs, which wins), or inline in a cluster file (bench.core.device_types reads and checks
them). The cluster file's shape is bench.core.cluster_config's.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

from bench.core.cluster_config import MEASURED_TYPE, ClusterConfig, unknown_device
from bench.core.device_types import (
    DeviceType,
    _device_type,
    _read_profile,
    device_type_files,
    device_types,
)
from bench.core.errors import ConfigError
from bench.core.paths import CONF_DIR
from bench.core.schema import parse, plain

# bench.profile's fit keys -> the kind they time: the padded all-gather / reduce-scatter are
# single calls; grouped ones are n broadcasts / reduces, priced from those kinds' fits.
_PROFILE_FIT_KINDS = {
    "all_reduce/ring": "all_reduce",
    "all_gather/padded": "all_gather",
    "reduce_scatter/padded": "reduce_scatter",
    "all_to_all/ring": "all_to_all",
    "broadcast/ring": "broadcast",
    "reduce/ring": "reduce",
}


@dataclass(frozen=True)
class Link:
    """One link level. bandwidth in Gbit/s (per direction), latency in seconds.

    `fits` are measured (kind, latency_s, bytes_per_s) per collective kind (from a
    `bench.profile` file named by `profile`); a kind without one uses bandwidth and latency.
    """

    bandwidth_gbps: float
    latency_s: float
    fits: tuple[tuple[str, float, float], ...] = ()
    profile: str | None = None

    @property
    def bytes_per_s(self) -> float:
        return self.bandwidth_gbps * 1e9 / 8

    def alpha_bandwidth(self, kind: str) -> tuple[float, float]:
        """(latency_s, bytes_per_s) of one `kind` call: its measured fit, else the link's.
        A reduce without a fit of its own takes the broadcast's (the same pipeline reversed)."""
        fits = {k: (a, b) for k, a, b in self.fits}
        fit = fits.get(kind) or (fits.get("broadcast") if kind == "reduce" else None)
        return fit or (self.latency_s, self.bytes_per_s)


def load_link_profile(path: str, where: str) -> tuple[tuple[str, float, float], ...]:
    """The per-kind fits of a `bench.profile` JSON file, for a link; ConfigError naming
    `where` and the path when the file is missing, does not parse or holds no usable fit."""
    fix = "run `python -m bench.profile --out <file>` and give that file"
    data = _read_profile(path, where, fix)
    fits = data.get("fits") if isinstance(data, dict) else None
    if not isinstance(fits, dict):
        raise ConfigError(f"{where}={path!r} has no 'fits' mapping (not a bench.profile file); {fix}")
    out = []
    for key, kind in _PROFILE_FIT_KINDS.items():
        fit = fits.get(key)
        if fit is None:
            continue
        lat, bps = (fit.get("latency_s"), fit.get("bytes_per_s")) if isinstance(fit, dict) else (None, None)
        if not isinstance(lat, (int, float)) or lat < 0 or not isinstance(bps, (int, float)) or bps <= 0:
            raise ConfigError(
                f"{where}={path!r}: fits.{key} needs latency_s >= 0 and bytes_per_s > 0 (got {fit!r}); {fix}"
            )
        out.append((kind, float(lat), float(bps)))
    if not out:
        raise ConfigError(f"{where}={path!r} holds none of the fits {', '.join(_PROFILE_FIT_KINDS)}; {fix}")
    return tuple(out)


@dataclass(frozen=True)
class Device:
    """One physical device (a worker rank in real mode)."""

    rank: int
    machine: int
    type: DeviceType
    speed: float  # multiplier on the type's effective FLOP/s
    step_overhead_s: float = 0.0  # seconds per training step that do not scale with the batch
    # Seconds per parameter byte this device's optimizer step updates (emulated CPU workers: the
    # part of the host's per-step time that a sharded parameter shrinks; step_overhead_s is the rest)
    optimizer_s_per_byte: float = 0.0

    @property
    def effective_flops(self) -> float:
        if self.type.effective_flops is None:
            raise ValueError(f"device type {self.type.name!r} has no FLOP/s yet: call ClusterSpec.with_host_speed")
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
    # Where the ranks compute: "cpu" (gloo) or "cuda". Emulated clusters: cpu by default, cuda =
    # every rank on this host's one GPU under MPS. Real clusters: cuda unless their devices are cpu.
    # None: that default.
    device: str | None = None
    virtual_device: str = "machine"  # what the planner shards over: "gpu" or "machine"
    host_flops: float | None = None  # measured FLOP/s of one host worker (emulated clusters)
    host_step_overhead_s: float = 0.0  # measured per-step seconds of one host worker
    # ... of which Adam's per-byte part: seconds per parameter byte, and the bytes it covered
    host_optimizer_s_per_byte: float = 0.0
    host_param_bytes: float = 0.0
    # Emulated CPU clusters: the least seconds a collective of each kind takes on this host's
    # own transport (bench.runtime.hostlinks), whatever the emulated link; priced as a floor.
    link_floor: tuple[tuple[str, float], ...] = ()
    # Types defined in the cluster file (cluster.device_types); they shadow packaged ones.
    inline_types: tuple[DeviceType, ...] = ()
    # The types its machines take from device files, carried so that a copy in another process
    # reads no files, and the file each came from (name, path): the user's folder or conf/device/.
    file_types: tuple[DeviceType, ...] = field(default=(), repr=False, compare=False)
    type_files: tuple[tuple[str, str], ...] = field(default=(), repr=False, compare=False)
    devices: tuple[Device, ...] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        if self.device is None:
            object.__setattr__(self, "device", _default_device(self.emulated, self.machines))
        devices = []
        machine = 0
        # The host's per-step part splits into Adam's per-byte cost over the model's parameters
        # and the rest; a device pays the rest, and the per-byte cost over what it holds.
        adam_s = min(self.host_optimizer_s_per_byte * self.host_param_bytes, self.host_step_overhead_s)
        per_byte = adam_s / self.host_param_bytes if self.host_param_bytes else 0.0
        for g in self.machines:
            base = self.device_type(g.device)
            dtype = replace(
                base,
                memory_gib=g.memory_gib if g.memory_gib is not None else base.memory_gib,
                effective_flops=g.effective_flops or base.effective_flops or self.host_flops,
            )
            for _ in range(g.count):
                for _ in range(g.num_devices):
                    # A slower emulated device takes 1/speed as long for everything it computes.
                    speed = g.speed
                    host = g.device == "cpu"
                    devices.append(
                        Device(
                            len(devices),
                            machine,
                            dtype,
                            speed,
                            (self.host_step_overhead_s - adam_s) / speed if host else 0.0,
                            per_byte / speed if host else 0.0,
                        )
                    )
                machine += 1
        object.__setattr__(self, "devices", tuple(devices))

    def device_type(self, name: str) -> DeviceType:
        """The type called `name`: the cluster's own (inline) one, else the one from its file."""
        for t in (*self.inline_types, *self.file_types):
            if t.name == name:
                return t
        return device_types()[name]

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

    def with_host_speed(
        self, flops: float, step_overhead_s: float = 0.0, optimizer_s_per_byte: float = 0.0, param_bytes: float = 0.0
    ) -> ClusterSpec:
        """The same cluster with the host worker's measured speed filled in (bench.runtime.hostspeed.HostSpeed:
        its fields in order)."""
        return replace(
            self,
            host_flops=flops,
            host_step_overhead_s=step_overhead_s,
            host_optimizer_s_per_byte=optimizer_s_per_byte,
            host_param_bytes=param_bytes,
        )

    def at_run_speed(self, flops: float, step_overhead_s: float) -> ClusterSpec:
        """The same cluster at the host speed a run's own yardstick measured (whole plain steps,
        bench.runtime.hostspeed.yardstick): Adam's per-byte part scales with the per-step part."""
        scale = step_overhead_s / self.host_step_overhead_s if self.host_step_overhead_s else 1.0
        return self.with_host_speed(
            flops, step_overhead_s, self.host_optimizer_s_per_byte * scale, self.host_param_bytes
        )

    def with_link_floor(self, floor: dict[str, float]) -> ClusterSpec:
        """The same cluster with the host transport's measured floor per collective kind."""
        return replace(self, link_floor=tuple(sorted(floor.items())))

    def floor_s(self, kind: str) -> float:
        """The host transport's least seconds for one `kind` call (0 where none was measured);
        a reshard is one all-to-all."""
        if not self.link_floor:  # every cluster but an emulated CPU one: the search's hot path
            return 0.0
        return dict(self.link_floor).get("all_to_all" if kind == "reshard" else kind, 0.0)

    def with_host_probe(self, probe_s: float) -> ClusterSpec:
        """The same cluster behind a host that probes at `probe_s` (bench.runtime.hostspeed.host_probe): its
        own device types' dispatch costs scaled by it (ComputeProfile.at_host_probe); itself
        where no profile has a probe."""
        types = tuple(
            replace(t, compute=t.compute.at_host_probe(probe_s)) if t.compute else t for t in self.inline_types
        )
        return self if types == self.inline_types else replace(self, inline_types=types)

    def fingerprint(self) -> str:
        """Short hash of everything that defines the cluster (not the host measurement).

        Inline device types count, and so do types from a folder of the user's own; packaged
        ones are keyed by name only. A key left at its default (no inline or own types, the
        default device) is left out of the hash, so adding such a key keeps the hashes already
        recorded in rows."""
        left_out = (
            "devices",
            "host_flops",
            "host_step_overhead_s",
            "host_optimizer_s_per_byte",
            "host_param_bytes",
            "link_floor",
            "file_types",
            "type_files",
        )
        # Field by field, as asdict would give them (asdict of the whole would copy every device)
        body = {f.name: _as_plain(getattr(self, f.name)) for f in dataclasses.fields(self) if f.name not in left_out}
        if not self.inline_types:
            del body["inline_types"]
        own = {name for name, path in self.type_files if not Path(path).resolve().is_relative_to(CONF_DIR.resolve())}
        if own:
            body["own_types"] = [asdict(t) for t in self.file_types if t.name in own]
        if self.device == _default_device(self.emulated, self.machines):
            del body["device"]  # a default key is left out: recorded hashes stay valid
        return hashlib.sha256(json.dumps(body, sort_keys=True).encode()).hexdigest()[:12]

    def describe(self) -> str:
        parts = [
            f"{g.count}x{g.num_devices} {g.device}" + (f"@{g.speed:g}" if g.speed != 1 else "") for g in self.machines
        ]
        where = ""
        if self.emulated:
            where = ", emulated on one GPU" if self.device == "cuda" else ", emulated"
        return f"{self.name} ({', '.join(parts)}{where})"

    @classmethod
    def from_config(cls, cfg: Mapping[str, Any], roots: tuple[Path, ...] | None = None) -> ClusterSpec:
        """Validate a cluster config (a plain dict, or a `cluster` node, resolved here) into a
        ClusterSpec; its device types come from the config folders `roots` (default: this
        process's, bench.core.paths.config_roots; see device_type_files)."""
        data = plain(cfg)
        label = data.get("name") if isinstance(data, Mapping) else None
        c = parse(ClusterConfig, data, "cluster.", f"cluster={label}")
        inline = tuple(
            _device_type(t, key, f"cluster.device_types.{key}.") for key, t in (c.device_types or {}).items()
        )
        files = device_type_files(roots)
        known = {**{name: t for name, (t, _) in files.items()}, **{t.name: t for t in inline}}
        for i, m in enumerate(c.machines):
            if m.device not in known:
                raise unknown_device(m, f"cluster.machines[{i}].", sorted(known))
        links = {}
        for level in ("intra_machine", "inter_machine"):
            lc = getattr(c.links, level)
            fits = () if lc.profile is None else load_link_profile(lc.profile, f"cluster.links.{level}.profile")
            links[level] = Link(float(lc.bandwidth_gbps), float(lc.latency_s), fits, lc.profile)
        from_files = sorted({m.device for m in c.machines} - {t.name for t in inline})
        spec = cls(
            name=c.name,
            machines=tuple(
                MachineGroup(
                    m.count, m.device, m.num_devices, float(m.speed), _float(m.memory_gib), _float(m.effective_flops)
                )
                for m in c.machines
            ),
            intra_machine=links["intra_machine"],
            inter_machine=links["inter_machine"],
            emulated=c.emulated,
            device=c.compute_device(),
            virtual_device=c.virtual_device,
            inline_types=inline,
            file_types=tuple(files[n][0] for n in from_files),
            type_files=tuple((n, str(files[n][1])) for n in from_files),
        )
        c.check_devices("cluster.", spec.num_devices)
        return spec


def _float(value: float | None) -> float | None:
    return None if value is None else float(value)


def _default_device(emulated: bool, machines) -> str:
    """cpu for emulated clusters and for clusters of cpu devices; cuda for real GPU clusters."""
    if emulated or all(g.device == MEASURED_TYPE for g in machines):
        return "cpu"
    return "cuda"


def _as_plain(value):
    """A field's value as dataclasses.asdict gives it."""
    return dataclasses.asdict(_Box(value))["value"]


@dataclasses.dataclass
class _Box:
    value: object
