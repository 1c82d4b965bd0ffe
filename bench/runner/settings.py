"""The run protocol's settings (mode, iterations, repeats, emulation, data, precision), validated once.

Each bad value is one ConfigError line naming the key, the value and the fix.
"""

from __future__ import annotations

from omegaconf import DictConfig

from bench.core.errors import ConfigError
from bench.records.tracking import WANDB_MODES
from bench.runtime.emulation import EmulationSettings
from bench.runtime.hostcpu import host_cores
from bench.runtime.worker import (
    PRECISIONS,
)

MODES = ("real", "sim")


DATA_SOURCES = ("synthetic", "cifar10", "wikitext2")


def check_protocol(cfg: DictConfig) -> None:
    if cfg.mode not in MODES:
        raise ConfigError(f"mode={cfg.mode!r} is invalid; valid: {', '.join(MODES)}")
    for key, low in (("measured_iters", 1), ("warmup_iters", 0)):
        value = cfg[key]
        if not isinstance(value, int) or isinstance(value, bool) or value < low:
            raise ConfigError(f"{key}={value!r} must be an integer >= {low}; e.g. {key}={max(low, 10)}")
    check_repeats(cfg.repeats)
    emulation_settings(cfg, 1)  # validates the emulation node
    if cfg.wandb.mode not in WANDB_MODES:
        raise ConfigError(f"wandb.mode={cfg.wandb.mode!r} is invalid; valid: {', '.join(WANDB_MODES)}")
    if cfg.data.source not in DATA_SOURCES:
        raise ConfigError(f"data.source={cfg.data.source!r} is invalid; valid: {', '.join(DATA_SOURCES)}")
    if cfg.precision not in PRECISIONS:
        raise ConfigError(f"precision={cfg.precision!r} is invalid; valid: {', '.join(PRECISIONS)} "
                          "(fp32 as in the paper; e.g. precision=bf16)")


def check_repeats(value) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ConfigError(f"repeats={value!r} must be an integer >= 1; e.g. repeats=5")
    return value


def emulation_settings(cfg: DictConfig, num_ranks: int) -> EmulationSettings:
    """The `emulation` node, validated; headroom=auto resolved for `num_ranks` on this host."""
    node = cfg.emulation
    headroom, refs = node.headroom, node.reference_iters
    if headroom == "auto":
        headroom = EmulationSettings.auto_headroom(num_ranks)
    elif isinstance(headroom, bool) or not isinstance(headroom, (int, float)) or not 0 < headroom <= 1:
        raise ConfigError(f"emulation.headroom={headroom!r} must be auto or a number in (0, 1]; "
                          "e.g. emulation.headroom=0.8")
    if not isinstance(refs, int) or isinstance(refs, bool) or refs < 0:
        raise ConfigError(f"emulation.reference_iters={refs!r} must be an integer >= 0 "
                          "(0: pace the compute just measured); e.g. emulation.reference_iters=12")
    pin = node.get("pin_cores", True)
    if not isinstance(pin, bool):
        raise ConfigError(f"emulation.pin_cores={pin!r} must be true or false; e.g. emulation.pin_cores=false")
    discount = node.get("pause_discount", True)
    if not isinstance(discount, bool):
        raise ConfigError(f"emulation.pause_discount={discount!r} must be true or false; "
                          "e.g. emulation.pause_discount=false")
    realtime = node.get("realtime_comm", False)
    if not isinstance(realtime, bool):
        raise ConfigError(f"emulation.realtime_comm={realtime!r} must be true or false; "
                          "e.g. emulation.realtime_comm=false")
    if realtime and num_ranks > host_cores():
        # Two ranks' real-time gloo threads on one core held it for a second (docs/emulation.md).
        raise ConfigError(f"emulation.realtime_comm=true needs a core per rank: {num_ranks} ranks on "
                          f"{host_cores()} cores; use emulation.realtime_comm=false")
    workers_first = node.get("gloo_workers_first", True)
    if not isinstance(workers_first, bool):
        raise ConfigError(f"emulation.gloo_workers_first={workers_first!r} must be true or false; "
                          "e.g. emulation.gloo_workers_first=false")
    return EmulationSettings(headroom=float(headroom), reference_iters=refs, pin_cores=pin,
                             pause_discount=discount, realtime_comm=realtime,
                             gloo_workers_first=workers_first)
