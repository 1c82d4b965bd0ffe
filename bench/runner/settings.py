"""The run protocol's options, each described once: a typed Settings object read from the composed config.

Every option of a case that is not a plugin's (mode, precision, iterations, data, repeats,
emulation, outputs, W&B, test hooks) is a field here with its type, default, unit and rule;
conf/config.yaml only picks the groups. bench.runner.configs registers the schema with Hydra
(bench.core.schema.loose), and Settings.from_config turns a composed config into a checked
Settings at the edge: a bad value is one ConfigError line naming the key, the value and the fix.
The groups' own nodes stay as composed: `model` and `method` are plugin configs instantiated by
their `_target_` (their constructors check them), `cluster` becomes a ClusterSpec
(bench.core.cluster_config is its schema), `logger` holds the chosen loggers' configs.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar

from bench.core.errors import ConfigError
from bench.core.interfaces import BATCH_NORMS
from bench.core.paths import CONF_DIR
from bench.core.schema import MISSING, check_choice, internal, option, parse, plain, require
from bench.records.tracking import WANDB_MODES
from bench.runtime.emulation import EmulationSettings
from bench.runtime.hostcpu import host_cores
from bench.runtime.precision import PRECISIONS

MODES = ("real", "sim")
DATA_SOURCES = ("synthetic", "cifar10", "wikitext2")
_BOOL = "true or false"
# Keys of the schema a config sets only when it uses them: left out of the row while unset, so
# that rows (and their case keys) stay those of configs that never name them.
_UNSET_KEYS = ("ablation", "report", "config_dirs", "config_files")


@dataclass
class DataSettings:
    source: str = option("synthetic", choices=DATA_SOURCES)  # cifar10: vgg19, vit; wikitext2: bert, bert_moe
    path: str | None = None  # a local copy of the dataset; hetbench never downloads data
    split: str = "train"  # cifar10: train | test; wikitext2: train | valid | test


@dataclass
class EmulationOptions:
    """Emulated clusters only (bench.runtime.emulation; docs/emulation.md)."""

    # Wall time runs 1/headroom slower than emulated time; auto: 0.6, less when ranks outnumber cores.
    headroom: float | str = option("auto", rule="auto or a number in (0, 1]", example="0.8")
    # Full-pace iterations that set each rank's pacing reference.
    reference_iters: int = option(12, rule="an integer >= 0 (0: pace the compute just measured)", example="12")
    # Bind each CPU rank to one core (local rank modulo cores; bench.runtime.hostcpu).
    pin_cores: bool = option(True, rule=_BOOL, example="false")
    # A repeated case (bench.compare's rounds) sets the reference again at every round, so that
    # the rounds' interval spans how a reference varies between sets of it (docs/emulation.md).
    reference_each_round: bool = option(True, rule=_BOOL, example="false")
    # Full-pace iterations that set the reference again at a later round (at most reference_iters):
    # fewer save time but set a slower reference, by a measure that differs between methods
    # (docs/emulation.md).
    round_reference_iters: int = option(12, rule="an integer >= 1", example="4")
    # A rank that waited on its peers while referencing takes the measured slowdown after such a
    # pause out of its reference (docs/emulation.md).
    pause_discount: bool = option(True, rule=_BOOL, example="false")
    # gloo's threads of a CPU rank at real-time priority (SCHED_FIFO), so that collectives never
    # wait for the compute to yield the core; a spinning gloo thread can then hold a core for a
    # second (docs/emulation.md).
    realtime_comm: bool = option(False, rule=_BOOL, example="false")
    # gloo's process-group workers of a CPU rank at nice -10, so that a collective's next round is
    # not held to the scheduler's next tick (where the host refuses a negative nice, they stay).
    gloo_workers_first: bool = option(True, rule=_BOOL, example="false")

    def check(self, at: str) -> None:
        h = self.headroom
        require(h == "auto" or (not isinstance(h, str) and 0 < h <= 1), self, at, "headroom")
        require(self.reference_iters >= 0, self, at, "reference_iters")
        require(self.round_reference_iters >= 1, self, at, "round_reference_iters")


@dataclass
class WandbSettings:
    """Settings of logger=wandb (conf/logger/wandb.yaml reads them)."""

    mode: str = option("offline", choices=WANDB_MODES)  # the JSONL row is written first either way
    project: str = "hetbench"


@dataclass
class TestHooks:
    fail_rank: int | None = None  # this rank raises at its first iteration
    oom_rank: int | None = None  # this rank asks the allocator for 1 PiB at its first iteration
    slowdown: float = 0.0  # every rank spins this fraction of each iteration longer


@dataclass
class PresetSettings:
    """A size preset (conf/preset/): the model's sizes follow its name. A preset may hold keys of
    its own beside these (for its model configs to interpolate)."""

    OPEN: ClassVar[bool] = True
    name: str = MISSING
    batch_per_device: int = option(MISSING, rule="an integer >= 1")  # samples per device (weak scaling)
    warmup_iters: int = option(MISSING, rule="an integer >= 0")
    measured_iters: int = option(MISSING, rule="an integer >= 1")


@dataclass
class Settings:
    """One case's settings: the run protocol, checked, and the groups' nodes as composed.

    `config` is the composed config, resolved: what the row records.
    """

    mode: str = option("real", choices=MODES)  # real: train in worker processes | sim: the simulator
    # fp32 (the paper's; TF32 off) | tf32 (TF32 matmuls and convolutions) | bf16 (autocast)
    precision: str = option("fp32", choices=PRECISIONS, note=" (fp32 as in the paper; e.g. precision=bf16)")
    seed: int = 0  # model initialisation and synthetic data
    # Batch norm's training statistics: local (each device's share, as DDP trains) | global (the
    # whole batch, as one device trains); a method that cannot train the choice refuses the case.
    batch_norm: str = option("local", choices=BATCH_NORMS, note=" (e.g. batch_norm=global)")
    # Samples per iteration; null: preset.batch_per_device x devices (weak scaling).
    global_batch: int | None = option(None, rule="an integer (every device needs a sample) or null")
    warmup_iters: int = option("${preset.warmup_iters}", rule="an integer >= 0", example="10")  # run, not measured
    measured_iters: int = option("${preset.measured_iters}", rule="an integer >= 1", example="10")  # in the row
    data: DataSettings = option(factory=DataSettings)
    # Run the case this many times (bench.compare interleaves methods per round).
    repeats: int = option(1, rule="an integer >= 1", example="5")
    emulation: EmulationOptions = option(factory=EmulationOptions)
    timeout_s: float = option(900, rule="a number > 0 (seconds)")  # a case still running then is a timeout
    results_dir: str = option(
        "results/runs", rule="a folder path", example="results/runs"
    )  # rows: ${results_dir}/records.jsonl
    resume: bool = option(False, rule=_BOOL)  # skip cases already recorded ok (or oom) in records.jsonl
    wandb: WandbSettings = option(factory=WandbSettings)
    test: TestHooks = option(factory=TestHooks)
    # The groups' nodes (conf/<group>/<option>.yaml), as composed.
    model: dict[str, Any] = MISSING
    preset: PresetSettings = MISSING
    cluster: dict[str, Any] = MISSING
    method: dict[str, Any] = MISSING
    logger: dict[str, Any] | None = None
    ablation: str | None = None  # the hap part an ablation switches off (conf/ablation/)
    report: dict[str, Any] | None = None  # an experiment's figure layout (bench.report)
    # Where the configs came from: the user's folders (--config-dir, hydra.searchpath) and the
    # file of each chosen group option (bench.runner.configs fills both).
    config_dirs: list[str] | None = None
    config_files: dict[str, str] | None = None
    config: dict[str, Any] = internal()

    def check(self, at: str) -> None:
        check_choice(self, at, "mode")
        require(self.warmup_iters >= 0, self, at, "warmup_iters")
        require(self.measured_iters >= 1, self, at, "measured_iters")
        require(self.repeats >= 1, self, at, "repeats")
        require(self.timeout_s > 0, self, at, "timeout_s")
        check_choice(self.wandb, f"{at}wandb.", "mode")
        check_choice(self.data, f"{at}data.", "source")
        check_choice(self, at, "precision")
        check_choice(self, at, "batch_norm")

    @classmethod
    def from_config(cls, cfg: Any) -> Settings:
        """A composed config (or its plain, resolved dict) as checked Settings."""
        config = recorded_config(cfg)
        settings = parse(cls, {k: v for k, v in config.items() if k in _FIELDS})
        settings.config = config
        return settings

    def config_roots(self) -> tuple[Path, ...]:
        """The folders this case's configs (and its cluster's device types) come from, first wins."""
        return (*map(Path, self.config_dirs or ()), CONF_DIR)

    @property
    def method_name(self) -> str:
        return self.method["name"]

    @property
    def method_target(self) -> str:
        return str(self.method.get("_target_", ""))


_FIELDS = {name for name in Settings.__dataclass_fields__ if name != "config"}


def as_settings(cfg: Any) -> Settings:
    """`cfg` itself if it is Settings, else the composed config `cfg` read into Settings (the edge)."""
    return cfg if isinstance(cfg, Settings) else Settings.from_config(cfg)


def recorded_config(cfg: Any) -> dict[str, Any]:
    """What a row records of a config: the composed config resolved to plain values (keys
    other than the schema's, e.g. `+round=1`, kept), without the optional keys left unset."""
    if isinstance(cfg, Settings):
        return cfg.config
    config = plain(cfg)
    if not isinstance(config, dict):
        raise ConfigError(f"the config is {type(config).__name__}, not a mapping of options")
    return {k: v for k, v in config.items() if not (k in _UNSET_KEYS and v is None)}


def emulation_settings(cfg: Settings, num_ranks: int) -> EmulationSettings:
    """The `emulation` options for `num_ranks` ranks on this host: headroom=auto resolved, and
    real-time gloo threads refused where the ranks outnumber the cores."""
    options = cfg.emulation
    headroom = options.headroom
    if headroom == "auto":
        headroom = EmulationSettings.auto_headroom(num_ranks)
    if options.realtime_comm and num_ranks > host_cores():
        # Two ranks' real-time gloo threads on one core held it for a second (docs/emulation.md).
        raise ConfigError(
            f"emulation.realtime_comm=true needs a core per rank: {num_ranks} ranks on "
            f"{host_cores()} cores; use emulation.realtime_comm=false"
        )
    return EmulationSettings(
        headroom=float(headroom),
        reference_iters=options.reference_iters,
        pin_cores=options.pin_cores,
        reference_each_round=options.reference_each_round,
        round_reference_iters=options.round_reference_iters,
        pause_discount=options.pause_discount,
        realtime_comm=options.realtime_comm,
        gloo_workers_first=options.gloo_workers_first,
    )
