"""The shape of a cluster file (conf/cluster/*.yaml) and of a device-type file (conf/device/*.yaml).

Dataclass schemas read by bench.core.schema.parse: each field's type, default and rule are
written once, here, and every refusal is one line naming the field, the value and the fix. What
needs more than one file (a machine's device type is known; a profile parses) is checked where
the ClusterSpec is built (bench.core.cluster). These are the files' shapes, not the runtime
types: bench.core.cluster turns them into DeviceType, Link and ClusterSpec.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from bench.core.errors import ConfigError
from bench.core.schema import MISSING, check_choice, option, require

NUMBER_FIELDS = ("memory_gib", "peak_flops", "effective_flops")
# The one type whose FLOP/s are measured at run time (ClusterSpec.with_host_speed).
MEASURED_TYPE = "cpu"
# Where a cluster's ranks compute on this host (`cluster.device`): cpu worker processes, or
# processes sharing this host's GPU (emulated clusters, under MPS) / one GPU each (real ones).
COMPUTE_DEVICES = ("cpu", "cuda")

_POSITIVE = "a number > 0"


def _positive(obj: Any, at: str, name: str) -> None:
    value = getattr(obj, name)
    require(value is None or value > 0, obj, at, name)


@dataclass
class DeviceTypeConfig:
    """One kind of accelerator: a conf/device/<name>.yaml file, or an entry of a cluster's
    `device_types`. FLOP/s are fp32; memory in GiB; `sources` says where each number is from."""

    name: str | None = option(None, rule="the type's name")  # a file's must be its stem
    memory_gib: float = option(MISSING, rule=_POSITIVE, missing="add one device's memory in GiB, e.g. memory_gib: 24")
    peak_flops: float | None = option(None, rule=_POSITIVE)  # datasheet peak; null where none
    effective_flops: float | None = option(None, rule=_POSITIVE)  # sustained; null: measured (cpu)
    sources: dict[str, Any] = option(rule="a mapping of each number field to where it comes from", factory=dict)
    profile: str | None = option(None, rule="a profile file's path, or null")  # bench.profile --compute-out

    def check_as(self, key: str, at: str) -> None:
        """The type called `key` (a file's stem or a device_types key); `at` goes before fields."""
        if self.name is not None and self.name != key:
            raise ConfigError(f"{at}name={self.name!r} differs from its key {key!r}; drop it or match them")
        for name in NUMBER_FIELDS:
            _positive(self, at, name)
        if self.effective_flops is None and key != MEASURED_TYPE:
            also = "" if self.peak_flops is not None else ", and peak_flops from the datasheet"
            raise ConfigError(
                f"{at}effective_flops is missing; a GPU type needs the sustained FLOP/s the "
                f"simulator uses: add effective_flops (measured, or an assumption labelled as one in "
                f"sources){also}; only the {MEASURED_TYPE!r} type is measured at run time"
            )
        for name, text in self.sources.items():
            if name not in NUMBER_FIELDS:
                raise ConfigError(f"{at}sources.{name} is not a number field; valid: {', '.join(NUMBER_FIELDS)}")
            if not isinstance(text, str) or not text.strip():
                raise ConfigError(f"{at}sources.{name}={text!r} must say where the number is from")
        for name in NUMBER_FIELDS:
            value = getattr(self, name)
            if value is not None and name not in self.sources:
                raise ConfigError(
                    f"{at}sources.{name} is missing; say where {name}={value:g} comes from "
                    "(a datasheet, a profile, or 'assumption: ...')"
                )
        require(self.profile is None or bool(self.profile), self, at, "profile")


@dataclass
class MachineConfig:
    """A group of identical machines."""

    count: int = option(1, rule="an integer >= 1")  # machines in the group
    device: str = option(
        MISSING,
        rule="a device type's name",
        missing="name a device type (conf/device/<name>.yaml or cluster.device_types)",
    )
    num_devices: int = option(MISSING, rule="an integer >= 1")  # devices per machine
    speed: float = option(1.0, rule=_POSITIVE)  # multiplier on the type's FLOP/s (emulated devices)
    memory_gib: float | None = option(None, rule=_POSITIVE)  # overrides the type's memory
    effective_flops: float | None = option(None, rule=_POSITIVE)  # overrides the type's FLOP/s

    def check(self, at: str) -> None:
        require(self.count >= 1, self, at, "count")
        require(self.num_devices >= 1, self, at, "num_devices")
        for name in ("speed", "memory_gib", "effective_flops"):
            _positive(self, at, name)


@dataclass
class LinkConfig:
    """One link level: bandwidth per direction, latency, and optionally measured fits."""

    bandwidth_gbps: float = option(MISSING, rule=_POSITIVE)
    latency_s: float = option(MISSING, rule="a number >= 0 (seconds)")
    profile: str | None = option(None, rule="a bench.profile file's path, or null")

    def check(self, at: str) -> None:
        _positive(self, at, "bandwidth_gbps")
        require(self.latency_s >= 0, self, at, "latency_s")


_LINK_MISSING = "give bandwidth_gbps and latency_s"


@dataclass
class LinksConfig:
    intra_machine: LinkConfig = option(MISSING, missing=_LINK_MISSING)  # between devices of a machine
    inter_machine: LinkConfig = option(MISSING, missing=_LINK_MISSING)  # between machines


@dataclass
class ClusterConfig:
    """A cluster file: machines, links, and where its ranks compute."""

    name: str = option(MISSING, rule="a non-empty name")
    machines: list[MachineConfig] = option(
        MISSING,
        rule="a list of machine groups",
        missing="list at least one machine group like {count: 1, device: V100-16, num_devices: 8}",
    )
    links: LinksConfig = option(MISSING, missing="give intra_machine and inter_machine, each with " + _LINK_MISSING)
    emulated: bool = option(False, rule="true or false")  # worker processes on this host, paced to the spec
    virtual_device: str = option(
        "machine",
        choices=("gpu", "machine"),  # what the planner shards over
        rule="use 'gpu' or 'machine'",
    )
    # cpu: worker processes on this host's cores; cuda: GPUs (emulated: every rank on this host's
    # GPU under MPS). null: cpu for emulated clusters and clusters of cpu devices, else cuda.
    device: str | None = option(
        None,
        choices=COMPUTE_DEVICES,
        rule="use cpu (worker processes on this host's cores) or cuda (emulated: "
        "every rank on this host's GPU under MPS)",
    )
    num_devices: int | None = option(None, rule="an integer >= 1")  # a check: the groups must add up to it
    gpus_per_machine: int | None = option(None, rule="an integer >= 1")  # for interpolations (paper_*)
    device_types: dict[str, DeviceTypeConfig] | None = option(
        None,
        rule="a mapping of type names to fields, e.g. {MyGPU: {memory_gib: 24, effective_flops: 5.0e12, "
        "sources: {...}}}",
    )

    def check(self, at: str) -> None:
        require(bool(self.name), self, at, "name")
        if not self.machines:
            raise ConfigError(
                f"{at}machines={self.machines!r} is empty; list at least one machine group like "
                "{count: 1, device: V100-16, num_devices: 8}"
            )
        check_choice(self, at, "virtual_device")
        if self.device is not None:
            check_choice(self, at, "device")
        for key, dtype in (self.device_types or {}).items():
            dtype.check_as(key, f"{at}device_types.{key}.")

    def compute_device(self) -> str:
        """`device`, or its default: cpu for emulated clusters and clusters of cpu devices."""
        if self.device is not None:
            return self.device
        if self.emulated or all(m.device == MEASURED_TYPE for m in self.machines):
            return "cpu"
        return "cuda"

    def check_devices(self, at: str, total: int) -> None:
        """What depends on the machines' types and count: num_devices adds up, and an emulated
        cluster's devices suit where its ranks compute."""
        if self.num_devices is not None and self.num_devices != total:
            raise ConfigError(
                f"{at}num_devices={self.num_devices!r} does not add up: the machine groups hold "
                f"{total} devices; fix the counts or drop num_devices"
            )
        types = sorted({m.device for m in self.machines})
        device = self.compute_device()
        if self.emulated and device == "cpu" and types != [MEASURED_TYPE]:
            raise ConfigError(
                f"{at}emulated=true with {at}device=cpu needs device 'cpu' on every machine (got {types}); "
                f"emulated devices differ by `speed`, or set {at}device=cuda to share this host's GPU"
            )
        if self.emulated and device == "cuda" and MEASURED_TYPE in types:
            raise ConfigError(
                f"{at}device=cuda runs the emulated ranks on a GPU, but the machines say device 'cpu' "
                f"(got {types}); give them this GPU's type (e.g. H100-80) or set {at}device=cpu"
            )


def unknown_device(machine: MachineConfig, at: str, known: list[str]) -> ConfigError:
    """One line for a machine group whose device type no file or device_types entry defines."""
    name = machine.device
    return ConfigError(
        f"{at}device={name!r} is unknown; known: {', '.join(known)}; define it under "
        f"cluster.device_types or in conf/device/{name}.yaml (or device/{name}.yaml in a "
        "folder of your own configs, given with --config-dir)"
    )
