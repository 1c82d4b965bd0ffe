"""The contracts between the harness and its plugins (methods/, models/).

The harness owns these types; it never names a concrete method or model (Hydra wires them).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable

import torch
from torch import nn

from bench.core.cluster import ClusterSpec
from bench.core.errors import PlanningError  # noqa: F401  (part of the plugin contract)


@runtime_checkable
class ModelConfig(Protocol):
    """What the harness needs from a models.* config dataclass."""

    name: str

    def build(self) -> nn.Module: ...

    @property
    def targets_per_sample(self) -> int: ...

    @property
    def tokens_per_sample(self) -> int | None: ...

    def synthetic_batch(self, batch_size: int, generator: torch.Generator) -> tuple: ...

    def dataset(self, source: str, path: str | None, split: str, seed: int) -> Any: ...


BATCH_NORMS = ("local", "global")


@dataclass
class Workload:
    """One model at one preset and global batch, with what the metrics need to know of it."""

    name: str
    preset: str
    model_cfg: Any  # a ModelConfig; picklable, so it travels to worker processes
    global_batch: int
    flops_per_sample: float  # forward + backward model FLOPs (bench.runtime.hostspeed)
    data: dict = field(default_factory=lambda: {"source": "synthetic", "path": None, "split": "train"})
    # fp32 (TF32 off), tf32 or bf16 (autocast): the worker applies it around every step, and a
    # method whose engine has precision settings of its own sets them to the same (DeepSpeed)
    precision: str = "fp32"
    # Training-mode batch norm's statistics: "local", each device's share of the batch (as DDP's
    # ranks normalise), or "global", the whole batch (as one device trains it).
    batch_norm: str = "local"

    @property
    def targets_per_iter(self) -> int:
        """Loss terms in one global batch: what a summed loss is divided by to give the mean."""
        return self.global_batch * self.model_cfg.targets_per_sample

    @property
    def flops_per_iter(self) -> float:
        return self.flops_per_sample * self.global_batch

    def build(self, seed: int) -> nn.Module:
        """The single-device model, initialised identically wherever it is built."""
        torch.manual_seed(seed)
        return self.model_cfg.build()


@dataclass
class Plan:
    """A method's decisions for one case, made once on the CPU before any worker starts."""

    method: str
    batch_shares: list[int]  # samples of the global batch each rank loads
    details: dict = field(default_factory=dict)  # JSON-ready, recorded in the row
    program: Any = None  # a bench.core.program.Program: what the simulator scores
    ratios: list[list[float]] | None = None  # per segment, per virtual device; sums to 1
    # [start, stop) of the global batch each rank loads, where ranks load the same samples (a
    # pipeline's first stage its inputs, its last stage their targets); None: each rank loads
    # its batch share, the shares one after another in rank order.
    data_slices: list[tuple[int, int]] | None = None


@dataclass
class RankContext:
    """What a worker rank gives a method's setup."""

    rank: int
    world_size: int
    device: torch.device
    cluster: ClusterSpec
    workload: Workload
    emulator: Any  # bench.runtime.emulation.Emulator: stretch() at compute boundaries, mark() after waits


class Trainer(Protocol):
    def step(self, batch: tuple[torch.Tensor, ...]) -> torch.Tensor:
        """One training iteration on this rank's slice; returns the rank's summed loss, detached.

        The gradients of this iteration stay in `.grad` until the next step (tests read them).
        """
        ...


class Method(Protocol):
    """A training method. `modes` lists what it supports: "sim" needs plan() to return a
    Program and ratios, "real" needs setup(). bench.compare runs the methods that support the
    requested mode. Optionally `worker_modules`: modules setup() imports that the server CPU
    workers fork from should import once instead (bench.runtime.launch.method_modules)."""

    name: str
    modes: tuple[str, ...]

    def plan(self, workload: Workload, cluster: ClusterSpec) -> Plan: ...

    def setup(self, plan: Plan, model: nn.Module, ctx: RankContext) -> Trainer: ...
