"""What a worker rank does around its training steps so that they run as its emulated device's,
and the measurements and test hooks that belong to no training loop.

`Pacing` holds the rank's Emulator (bench.runtime.emulation) and, per step (Pacing.step): the
untimed iterations first (lazy set-up, then the full-pace ones that set the pacing reference,
with the host's yardstick before them and the pause discount after), the emulator's phases and
counters, gloo's thread priorities, the tensor bytes a CPU rank counts through its set-up, a GPU's
peak memory per iteration, the clock (emulated time: wall x headroom) and the test hooks
(fail_rank, oom_rank, slowdown). It does not build the model, load data or call the method.
"""

from __future__ import annotations

import contextlib
import resource
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist

from bench.runtime import hostcpu
from bench.runtime.emulation import PAUSE_PROBE_MIN_SHARE, Emulator, measure_matmul_flops
from bench.runtime.hostspeed import pause_penalty, yardstick, yardstick_batches
from bench.runtime.tensor_memory import TensorBytes

# Bytes the oom_rank test hook asks for: 1 PiB, more than any device holds and more than a
# 48-bit address space maps, so the allocator itself refuses (no overcommit lets it through).
_IMPOSSIBLE_BYTES = 2**50


@dataclass(frozen=True)
class RankHooks:
    """What tests (and the regression check's demonstration of a slower loop) ask of the ranks
    beside training; a plain case asks none of it."""

    return_state: bool = False  # rank 0 sends back its gradients and parameters (no untimed iterations)
    fail_rank: int | None = None  # this rank raises at its first iteration
    oom_rank: int | None = None  # this rank asks for more memory than exists, at its first iteration
    slowdown: float = 0.0  # every rank spins this fraction of each iteration longer


@dataclass
class StepTime:
    """One step's time as Pacing.step measured it."""

    seconds: float | None = None  # emulated seconds of a timed iteration; None for an untimed one


class Pacing:
    """One rank's pacing around its training loop (see the module docstring).

    Args:
        case: the bench.runtime.worker.Case this rank trains.
        emulated: the cluster is emulated (links paced; on the CPU, compute too).
        pace_compute: compute is paced (an emulated cluster on the CPU).
        core: the core the rank is pinned to, for its report.
    """

    def __init__(
        self, case, rank: int, device: torch.device, emulated: bool, pace_compute: bool, core: int | None = None
    ):
        self.case, self.rank, self.device = case, rank, device
        self.emulated, self.pace_compute, self.core = emulated, pace_compute, core
        self.emulator = Emulator(
            case.cluster, rank, enabled=emulated, settings=case.emulation, pace_compute=pace_compute
        )
        self.emulator.install()
        self.probe_flops = None
        if emulated and device.type == "cuda":
            dist.barrier()  # every rank probes at once, sharing the GPU as in training
            self.probe_flops = measure_matmul_flops(device)
        settings = self.emulator.settings
        # Emulated ranks first run full-pace iterations that set their pacing reference (not
        # when a test checks exactness step by step: it needs exactly its own steps).
        # A shared reference (EmulationSettings.reference) needs only the lazy set-up iterations.
        self.references = 0 if settings.reference is not None else settings.reference_iters
        shared = settings.reference is not None
        self.untimed = (
            settings.SKIPPED + self.references
            if pace_compute and (self.references or shared) and not case.hooks.return_state
            else 0
        )
        # A CPU rank counts its tensors' bytes from the model's build through the lazy set-up
        # iterations, which no clock times; its peak is that of the last of them (bench.runtime.tensor_memory).
        # ... and fails as out of memory when they pass its emulated device's memory.
        self.tensors = TensorBytes(*device_memory(case.cluster, rank)) if self.untimed else None
        self.yardstick = None
        self.peak = 0.0  # on a GPU, the peaks before each reset (the last one is read at the end)
        self.realtime = None  # gloo's threads at real-time priority: how many (None: off or refused)
        self.workers_first = None  # gloo's workers at nice -10: how many (None: off or refused)
        self.discounted = False  # the pause discount is taken once, after the reference is set

    @property
    def total_iters(self) -> int:
        """Iterations the rank runs: the untimed ones, then warm-up and measured."""
        return self.untimed + self.case.warmup_iters + self.case.measured_iters

    def count(self, tensors) -> None:
        """Tensors made before the count started (the model's buffers) count from now on."""
        if self.tensors is not None:
            for t in tensors:
                self.tensors.count(t)

    def counting_tensors(self):
        """Around the model's build and the method's set-up: their tensors count (CPU ranks)."""
        return self.tensors or contextlib.nullcontext()

    @property
    def rereferences(self) -> bool:
        """Whether a later round sets the reference again (EmulationSettings.reference_each_round)."""
        return bool(self.untimed and self.references and self.emulator.settings.reference_each_round)

    @property
    def round_start(self) -> int:
        """The iteration a later round starts at: the first of its reference iterations (the last
        `round_reference_iters` of the first round's; the lazy set-up ones are the first round's
        alone), or the first timed one where the reference is kept. Every round times the same
        iterations."""
        if not self.rereferences:
            return self.untimed
        return self.untimed - min(self.emulator.settings.round_reference_iters, self.references)

    def begin_round(self) -> None:
        """Before a later round of the same case (bench.runtime.worker.TrainingRank), from a clean
        slate (nothing owed): its first iterations set the reference again (rereferences) and
        the pause discount is taken again after them; otherwise its iterations are paced against
        the reference the first round set."""
        self.emulator.begin_round(rereference=self.rereferences)
        self.discounted = not self.rereferences

    def measure_host(self) -> None:
        """Before the references, every rank at once: the host as this run meets it (the
        yardstick of plain steps, bench.runtime.hostspeed.yardstick)."""
        if self.untimed and self.references:
            case = self.case
            dist.barrier()
            self.yardstick = yardstick(case.workload, yardstick_batches(case.plan.batch_shares), case.seed)
            dist.barrier()

    @contextlib.contextmanager
    def step(self, it: int):
        """Around iteration `it`'s training step: everything before it starts and after it ends
        that is not training; yields its StepTime, filled once the step has ended."""
        case, emulator, settings, device = self.case, self.emulator, self.emulator.settings, self.device
        if self.pace_compute and it <= settings.SKIPPED:
            with emulator.paused():  # again after the lazy set-up, which may start process groups
                self.realtime, self.workers_first = hostcpu.comm_priorities(
                    settings.realtime_comm, settings.gloo_workers_first
                )
        if it == self.untimed + case.warmup_iters:
            emulator.reset_stats()
        if case.hooks.fail_rank == self.rank:
            raise RuntimeError(f"deliberate failure of rank {self.rank} (fail_rank, a test option)")
        if case.hooks.oom_rank == self.rank:
            torch.empty(_IMPOSSIBLE_BYTES, dtype=torch.uint8, device=device)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
            if it >= self.untimed:  # this iteration's own peak (a first step may hold more: kept in peak)
                self.peak = max(self.peak, peak_mem_gib(device))
                torch.cuda.reset_peak_memory_stats(device)
        emulator.begin_iteration(it)
        if self.untimed and self.references and it == self.untimed and settings.pause_discount and not self.discounted:
            self._discount_pause()  # the reference is set: discount its waiting
            self.discounted = True
        counted = self.tensors is not None and it < settings.SKIPPED
        if counted and it == settings.SKIPPED - 1:
            self.tensors.reset_peak()
        timed = StepTime()
        t0 = time.perf_counter()
        with self.tensors if counted else contextlib.nullcontext():
            yield timed
        if case.hooks.slowdown:
            _busy(case.hooks.slowdown * (time.perf_counter() - t0))
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        if it >= self.untimed:  # emulated time: wall time x headroom (1 when not emulated)
            timed.seconds = (time.perf_counter() - t0) * emulator.headroom

    def peak_mem_gib(self) -> float:
        """The rank's peak memory over the run (on a GPU, across the per-iteration resets)."""
        return max(self.peak, peak_mem_gib(self.device))

    @property
    def tensor_peak_gib(self) -> float | None:
        return None if self.tensors is None else self.tensors.peak / 2**30

    def report(self) -> dict | None:
        """The emulation part of the rank's result (None where the cluster is not emulated)."""
        if not self.emulated:
            return None
        return {
            **self.emulator.report(self.probe_flops),
            "yardstick": self.yardstick,
            "core": self.core,
            "realtime_comm_threads": self.realtime,
            "gloo_workers_first_threads": self.workers_first,
        }

    def _discount_pause(self) -> None:
        """A rank whose reference iterations waited (on peers with more work, on the loopback
        collectives) for a quarter of its compute or more measures how much slower a plain step at
        its share runs after that pause, and discounts its reference by it
        (Emulator.discount_reference). When any rank does, every rank probes at once, so that the
        host is as loaded as in training (as for the yardstick); when none does, none probes."""
        emulator, case = self.emulator, self.case
        pause, step = emulator.reference_pause_s, emulator.reference_step_s
        due = pause is not None and step > 0 and pause >= PAUSE_PROBE_MIN_SHARE * step  # a pause means a reference
        with emulator.paused():  # neither the collectives nor the probe are an iteration's
            flags = [False] * dist.get_world_size()
            dist.all_gather_object(flags, due)
            if not any(flags):
                return
            probe = pause_penalty(case.workload, case.plan.batch_shares[self.rank], case.seed, pause or 0.0)
            dist.barrier()
        if step is not None:  # a rank with no reference (no compute interval) has nothing to discount
            emulator.discount_reference(probe, apply=due)


def device_memory(cluster, rank: int) -> tuple[int | None, str]:
    """(bytes, how an error names them) of rank `rank`'s emulated device: its machine group's
    memory_gib, else its device type's (None: the type gives none)."""
    device = cluster.devices[rank]
    first, index = 0, 0
    while rank >= first + cluster.machines[index].count * cluster.machines[index].num_devices:
        first += cluster.machines[index].count * cluster.machines[index].num_devices
        index += 1
    group = cluster.machines[index]
    gib = device.type.memory_gib
    where = (
        f"cluster.machines[{index}].memory_gib={group.memory_gib}"
        if group.memory_gib is not None
        else f"device {group.device}'s memory_gib={gib}"
    )
    return (None if gib is None else int(gib * 2**30)), f"rank {rank} ({where})"


def peak_mem_gib(device: torch.device) -> float:
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**30
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # Linux: KiB


def _busy(seconds: float) -> None:
    """Spin for `seconds` (a deliberate, uniform slowdown of the loop: regression demos)."""
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        pass
