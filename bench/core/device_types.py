"""Device types: one kind of accelerator each (FLOP/s, memory, where each number comes from) and
its measured compute profile, read from conf/device/*.yaml (or device/ in a folder of the user's
own configs, which wins) or a cluster file's device_types; bench.core.cluster_config is the files'
shape.

Types only: which machines hold them and how they are linked is bench.core.cluster's.
"""

from __future__ import annotations

import functools
import json
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path
from types import MappingProxyType
from typing import Any

import yaml
from omegaconf import OmegaConf
from omegaconf.errors import OmegaConfBaseException

from bench.core.cluster_config import DeviceTypeConfig
from bench.core.errors import ConfigError
from bench.core.paths import CONF_DIR, config_roots, project_path, show_path
from bench.core.schema import fields_of, parse

DEVICE_DIR = CONF_DIR / "device"


@dataclass(frozen=True)
class DeviceType:
    """One kind of accelerator. FLOP/s are fp32; memory in GiB.

    `sources` says, per number field, where the number comes from (datasheet, profile, or a
    labelled assumption). `profile` is the path of a measured compute profile, if there is one.
    """

    name: str
    peak_flops: float | None  # datasheet peak; None where there is no datasheet (emulated CPU)
    effective_flops: float | None  # sustained on real models; None = measured at run time
    memory_gib: float
    sources: dict[str, str] = field(default_factory=dict, hash=False)
    profile: str | None = None
    compute: ComputeProfile | None = None  # the profile file's numbers, loaded


@dataclass(frozen=True)
class ComputeProfile:
    """Measured compute of one device type (`python -m bench.profile --compute-out`).

    Per op class (bench.core.program.OP_CLASSES): seconds = launches x fixed_s + FLOPs / flops_per_s
    on the device; the optimizer step: fixed_s + parameter bytes / bytes_per_s. A class it did
    not measure is priced as "other". On a GPU the host queues kernels while the device runs
    them: `dispatch_s` is the host's seconds per kernel (per class; the optimizer step's whole),
    and a step takes at least the host's time to queue it (bench.cost.price.host_times). None
    where the host is the device (a CPU worker) or where the profile did not measure it.
    """

    device_type: str
    classes: tuple[tuple[str, float, float], ...]  # (op class, fixed_s, flops_per_s)
    optimizer: tuple[float, float] | None  # (fixed_s, parameter bytes per second)
    path: str
    dispatch: tuple[tuple[str, float], ...] = ()  # (op class, host seconds per kernel); () = not measured
    optimizer_dispatch_s: float = 0.0
    host_probe_s: float | None = (
        None  # the host's speed when the dispatch costs were measured (bench.runtime.hostspeed.host_probe)
    )
    # Bytes the framework keeps on the device beside any tensor (cuBLAS's workspaces, made at a
    # first matrix product and kept): counted in every peak; 0 where not measured (CPU workers)
    workspace_bytes: float = 0.0
    # The precision its kernels ran at (bench.runtime.precision.PRECISIONS), as the profile
    # records it; None for a profile made before profiles recorded it (measured with torch's
    # default switches: TF32 off for matmuls, on for cuDNN's convolutions)
    precision: str | None = None

    def rate(self, op_class: str) -> tuple[float, float]:
        """(fixed_s per kernel, FLOP/s) of an op class."""
        table = {c: (f, r) for c, f, r in self.classes}
        return table.get(op_class) or table["other"]

    def dispatch_s(self, op_class: str) -> float:
        """Host seconds to queue one kernel of an op class (0 if not measured)."""
        table = dict(self.dispatch)
        return table.get(op_class, table.get("other", 0.0))

    def at_host_probe(self, probe_s: float) -> ComputeProfile:
        """The same device behind a host that probes at `probe_s` (bench.runtime.hostspeed.host_probe, timed
        just before a run): every dispatch cost scaled by that over the profile's own probe, the
        device's times unchanged. Unchanged itself where the profile has no probe or no dispatch."""
        if not self.host_probe_s or not self.dispatch:
            return self
        k = probe_s / self.host_probe_s
        return replace(
            self,
            dispatch=tuple((c, s * k) for c, s in self.dispatch),
            optimizer_dispatch_s=self.optimizer_dispatch_s * k,
            host_probe_s=probe_s,
        )


def _read_profile(path: str, where: str, fix: str):
    """A profile file's JSON (path relative to the project); ConfigError naming `where`, the
    path and `fix` when it cannot be read or does not parse."""
    try:
        return json.loads(project_path(path).read_text())
    except OSError as exc:
        raise ConfigError(f"{where}={path!r} cannot be read ({exc.strerror}); {fix}") from None
    except json.JSONDecodeError as exc:
        raise ConfigError(f"{where}={path!r} is not JSON ({exc.msg} at line {exc.lineno}); {fix}") from None


def load_compute_profile(path: str, where: str, type_name: str) -> ComputeProfile:
    """A device type's compute profile; ConfigError naming `where`, the path and the fix when
    it cannot be read, does not parse, lacks the "other" class, or was measured on another
    device type."""
    fix = (
        f"run `python -m bench.profile --device-type {type_name} --compute-out {path}` on that "
        "device, or set profile: null"
    )
    data = _read_profile(path, where, fix)
    if not isinstance(data, dict) or not isinstance(data.get("compute"), dict):
        raise ConfigError(f"{where}={path!r} has no 'compute' mapping (not a compute profile); {fix}")
    measured_on = data.get("device_type")
    if measured_on != type_name:
        raise ConfigError(f"{where}={path!r} was measured on device type {measured_on!r}, not {type_name!r}; {fix}")

    def numbers(entry: Any, key: str, rate: str) -> tuple[float, float]:
        fixed, speed = (entry.get("fixed_s"), entry.get(rate)) if isinstance(entry, dict) else (None, None)
        if not isinstance(fixed, (int, float)) or fixed < 0 or not isinstance(speed, (int, float)) or speed <= 0:
            raise ConfigError(f"{where}={path!r}: {key} needs fixed_s >= 0 and {rate} > 0 (got {entry!r}); {fix}")
        return float(fixed), float(speed)

    def host(entry: Any, key: str) -> float:
        value = entry.get("dispatch_s", 0.0) if isinstance(entry, dict) else 0.0
        if not isinstance(value, (int, float)) or value < 0:
            raise ConfigError(f"{where}={path!r}: {key}.dispatch_s must be a number >= 0 (got {value!r}); {fix}")
        return float(value)

    items = sorted(data["compute"].items())
    classes = tuple((c, *numbers(e, f"compute.{c}", "flops_per_s")) for c, e in items)
    if "other" not in {c for c, _, _ in classes}:
        raise ConfigError(f"{where}={path!r} has no compute.other (the class unmeasured ones fall back to); {fix}")
    opt = data.get("optimizer")
    optimizer = None if opt is None else numbers(opt, "optimizer", "bytes_per_s")
    probe = data.get("host_probe_s")
    if probe is not None and (not isinstance(probe, (int, float)) or probe <= 0):
        raise ConfigError(f"{where}={path!r}: host_probe_s must be a number > 0 (got {probe!r}); {fix}")
    workspace = data.get("workspace_bytes", 0.0)
    if not isinstance(workspace, (int, float)) or workspace < 0:
        raise ConfigError(f"{where}={path!r}: workspace_bytes must be a number >= 0 (got {workspace!r}); {fix}")
    recorded = data.get("precision")
    precision = recorded.get("precision") if isinstance(recorded, dict) else None
    if recorded is not None and not isinstance(precision, str):
        raise ConfigError(
            f"{where}={path!r}: precision must be the mapping bench.profile records, with a "
            f"'precision' name (got {recorded!r}); {fix}"
        )
    return ComputeProfile(
        type_name,
        classes,
        optimizer,
        str(path),
        tuple((c, host(e, f"compute.{c}")) for c, e in items if "dispatch_s" in e),
        0.0 if opt is None else host(opt, "optimizer"),
        None if probe is None else float(probe),
        float(workspace),
        precision,
    )


@functools.cache
def _device_files(directory: Path) -> Mapping[str, tuple[DeviceType, Path]]:
    """The device types of one folder, one `<name>.yaml` each: name -> (type, file)."""
    types = {}
    for path in sorted(Path(directory).glob("*.yaml")):
        where = show_path(path)
        try:
            cfg = OmegaConf.to_container(OmegaConf.load(path), resolve=True)
        except (yaml.YAMLError, OmegaConfBaseException) as e:
            mark = getattr(e, "problem_mark", None)
            at = f" at line {mark.line + 1}" if mark is not None else ""
            problem = getattr(e, "problem", None) or str(e).splitlines()[0]
            raise ConfigError(f"{where} is not valid yaml ({problem}{at}); fix or remove the file") from e
        if not isinstance(cfg, dict):
            raise ConfigError(
                f"{where} must hold a mapping of fields ({', '.join(sorted(fields_of(DeviceTypeConfig)))})"
            )
        if cfg.get("name") != path.stem:
            raise ConfigError(
                f"{where}: name={cfg.get('name')!r} differs from the file name; set "
                f"name: {path.stem} or rename the file to <name>.yaml"
            )
        types[path.stem] = (
            _device_type(parse(DeviceTypeConfig, cfg, f"{where}: ", where), path.stem, f"{where}: "),
            path,
        )
    return MappingProxyType(types)


def device_type_files(roots: tuple[Path, ...] | None = None) -> Mapping[str, tuple[DeviceType, Path]]:
    """Every device type of the config folders' device/ (default: bench.core.paths.config_roots(),
    the user's folders first): name -> (type, the file it came from); the first folder wins."""
    merged: dict[str, tuple[DeviceType, Path]] = {}
    for root in reversed(config_roots() if roots is None else roots):
        merged.update(_device_files(root / "device"))
    return MappingProxyType(dict(sorted(merged.items())))


def device_types(directory: Path | None = None) -> Mapping[str, DeviceType]:
    """The device types of `directory` (one `<name>.yaml` each), or, by default, of every config
    folder's device/ (device_type_files), keyed by name.

    Each folder is loaded once; the result is read-only. A bad file raises ConfigError naming it.
    """
    files = device_type_files() if directory is None else _device_files(Path(directory))
    return MappingProxyType({name: t for name, (t, _) in files.items()})


def _device_type(cfg: DeviceTypeConfig, name: str, prefix: str) -> DeviceType:
    """The device type `name` of a checked config; its compute profile loaded. `prefix` goes
    before each field in messages ("conf/device/T4.yaml: " or "cluster.device_types.MyGPU.")."""
    cfg.check_as(name, prefix)
    profile = cfg.profile
    compute = None if profile is None else load_compute_profile(profile, f"{prefix}profile", name)
    return DeviceType(
        name,
        _float(cfg.peak_flops),
        _float(cfg.effective_flops),
        float(cfg.memory_gib),
        {str(k): v for k, v in cfg.sources.items()},
        profile,
        compute,
    )


def _float(value: float | None) -> float | None:
    return None if value is None else float(value)
