"""Emulated heterogeneity on one host: slow devices sleep, links take their declared time.

Compute is paced against a reference, in a closed loop. A burst of compute that follows a
pause (a sleep, a wait on a peer, even a spin) runs slower on a shared VM core than the same
burst run back to back (docs/emulation.md; results/emulation/20261123-pacing-and-dilation.md). So
a rank never stretches the compute it just measured; it first runs `reference_iters`
iterations at full pace and records how long each compute interval of an iteration took (the
k-th interval between communication points, the fastest of those iterations). From then on the
k-th interval must last reference_k / (speed x headroom) of wall time: the rank sleeps what is
left, and whatever it over- or undershoots is carried into the next interval (links are emulated
from then on, not while the reference is measured). A rank that waited on its peers through
its reference iterations measured cold bursts: it divides its reference by how much slower a
plain step runs after such a pause (Emulator.discount_reference). `headroom` < 1
runs the whole emulated cluster in slow motion (links too), so that even a speed-1 rank has
time to absorb a slowed-down burst; reported times are emulated time (wall x headroom).

Links: every torch.distributed collective takes at least the alpha-beta time of the emulated link
(bench.cost), stretched by 1 / headroom, counted from the moment its last member arrived (the
ranks of one host note when they issue each collective on a board in shared memory); back-to-back
collectives queue on one link clock.
Real GPUs run with emulation off. An emulated cluster on a GPU (`cluster.device: cuda`) paces
links only (`pace_compute=False`): its ranks' compute runs real kernels at their MPS share of the
GPU (bench.runtime.mps), at headroom 1, and `measure_matmul_flops` checks the speed each rank achieved.
"""

from __future__ import annotations

import atexit
import contextlib
import functools
import inspect
import os
import tempfile
import threading
import time
import zlib
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
import torch.distributed.distributed_c10d as c10d

from bench.core.cluster import ClusterSpec
from bench.cost import collective_time_s, link_bytes
from bench.runtime.hostcpu import host_cores

# An emulated rank whose achieved compute time is off its target by more than this is flagged.
DILATION_TOLERANCE = 0.05
# A rank whose full-pace reference iterations waited at least this share of their compute is
# probed for the pause penalty (Emulator.discount_reference); below it the probe's noise would
# exceed the penalty, a few percent after a pause of half a step
# (results/emulation/20261123-pacing-and-dilation.md).
PAUSE_PROBE_MIN_SHARE = 0.25
MAX_PAUSE_PENALTY = 1.5


@dataclass(frozen=True)
class EmulationSettings:
    """How an emulated cluster is run on this host (the `emulation` config node)."""

    headroom: float = 0.6  # wall time runs 1/headroom slower than emulated time
    reference_iters: int = 12  # full-pace iterations (after SKIPPED ones) that set the reference
    pin_cores: bool = True  # each CPU rank bound to one core (bench.runtime.hostcpu.pin_to_core)
    # A reference measured earlier for this same rank workload (Emulator.report's
    # `reference_s`): the rank is paced against it from the start, so that cases sharing it
    # emulate one device at one speed however this host drifts between them (bench.dilation).
    reference: tuple[float, ...] | None = None
    # A rank that waited on its peers while referencing discounts the pause's slowdown
    # (Emulator.discount_reference).
    pause_discount: bool = True
    # gloo's threads at real-time priority, so that a collective never waits for the rank's
    # compute to give up the core (bench.runtime.hostcpu.realtime_comm_threads). Off by default: a
    # spinning gloo thread then holds its core for up to a second.
    realtime_comm: bool = False
    # gloo's process-group workers at nice -10, so that one woken on the rank's core runs at
    # once rather than at the next scheduler tick (bench.runtime.hostcpu.gloo_workers_first).
    gloo_workers_first: bool = True
    SKIPPED = 2  # iterations of lazy set-up (DDP's bucket rebuild, allocator growth) first

    @staticmethod
    def auto_headroom(num_ranks: int, cores: int | None = None) -> float:
        """0.6 while every rank has a core; less when ranks share cores, so that the busiest
        moment (every rank computing) still fits the cores at the emulated speeds. A rank that
        waited on a slower peer computes slower right after, and 0.6 leaves it 67% of slack to
        absorb that (results/emulation/20261123-pacing-and-dilation.md)."""
        cores = cores or host_cores()
        return round(0.6 * min(1.0, cores / max(num_ranks, 1)), 3)


class Emulator:
    """Per-rank time dilation and link emulation. A disabled one does nothing, cheaply."""

    def __init__(self, cluster: ClusterSpec, rank: int, enabled: bool,
                 settings: EmulationSettings | None = None, pace_compute: bool = True):
        self.enabled = enabled
        # False: links only; compute runs as fast as the hardware lets it (MPS sets its speed).
        self.pace_compute = enabled and pace_compute
        self.cluster = cluster
        self.rank = rank
        self.settings = settings or EmulationSettings()
        speed = cluster.devices[rank].speed if self.pace_compute else 1.0
        # Slow motion exists for sleeping CPU ranks; real kernels run in real time.
        self.headroom = self.settings.headroom if self.pace_compute else 1.0
        self.dilation = 1.0 / speed  # emulated time per unit of full-pace compute
        self.wall_per_emulated_s = 1.0 / self.headroom
        self._last = time.perf_counter()
        self._last_cpu = (threading.get_ident(), time.thread_time())
        self._link_free_at: dict[int, float] = {}  # per link level this rank uses (id of the Link)
        self._loopback = (0.0, float("inf"))  # real collective cost here, measured at install
        self._board: ArrivalBoard | None = None  # when this host's ranks issued each collective
        self._lock = threading.Lock()
        self._paused = False
        # Pacing: per-iteration interval lists while referencing, then their medians.
        self._phase = "reference"  # reference -> paced
        self._iteration: list[float] = []
        self._reference_runs: list[list[float]] = []
        self._iteration_wall: list[float] = []  # the same intervals' wall time (diagnostic)
        self._reference_walls: list[list[float]] = []
        self._reference_wall: list[float] | None = None
        self._reference: list[float] | None = None
        self._iteration_start = time.perf_counter()
        self._reference_pauses: list[float] = []  # per reference iteration: wall less its compute
        self.pause_probe: dict | None = None  # discount_reference's measurement
        if self.settings.reference is not None:
            self._reference = list(self.settings.reference)
        self._debt = 0.0  # wall seconds the rank is behind its target (carried forward)
        self._debt_at_issue = 0.0  # ... when it last issued a collective (absorb_debt)
        # Links are not emulated in the iterations before pacing starts (begin_iteration).
        self._links_emulated = True
        self.slept_s = 0.0  # total compute-dilation sleep, for reports and tests
        self.reset_stats()

    def reset_stats(self) -> None:
        """Start counting achieved vs target compute time afresh (at the first measured step)."""
        self.target_s = 0.0  # wall time the compute intervals should have taken
        self.achieved_s = 0.0  # wall time they took (compute + dilation sleep)
        self.reference_s = 0.0  # their full-pace reference
        self.unreferenced = 0  # intervals with no reference (an iteration longer than the ref)
        self.links = [0, 0]  # emulated collectives: all, and those timed from the last arrival
        # Of those timed from the last arrival: wall seconds of their emulated link time, and of
        # the real run past it (the collective completed after the emulated link would have).
        self.link_wall = [0.0, 0.0]
        self.absorbed_s = 0.0  # debt a wait on an async collective absorbed (absorb_debt)

    # -- compute ---------------------------------------------------------------------------
    @contextlib.contextmanager
    def paused(self):
        """Neither compute nor links are emulated inside (set-up: not measured, not training)."""
        self._paused = True
        try:
            yield
        finally:
            self._paused = False
            self.mark()

    def begin_iteration(self, index: int) -> None:
        """The worker calls this before each iteration: the first SKIPPED iterations (lazy
        set-up, DDP's bucket rebuild) and the next `reference_iters` run at full pace, the
        latter set the reference (per interval, the fastest: a transient slowdown of the host
        only ever makes an interval slower), the rest are paced. With a shared reference
        (`EmulationSettings.reference`) pacing starts right after the SKIPPED iterations."""
        shared = self.settings.reference is not None
        now = time.perf_counter()
        if self._phase == "reference" and self._iteration and index > self.settings.SKIPPED and not shared:
            self._reference_runs.append(self._iteration)
            self._reference_walls.append(self._iteration_wall)
            # Between its compute intervals: collectives and the worker loop. A rank that
            # shares its core is also preempted inside its intervals; that is not a pause.
            self._reference_pauses.append(max(0.0, now - self._iteration_start - sum(self._iteration_wall)))
        self._iteration_start = now
        self._iteration, self._iteration_wall = [], []
        if shared and index >= self.settings.SKIPPED:
            self._phase = "paced"
        elif self._phase == "reference" and not shared and len(self._reference_runs) >= self.settings.reference_iters:
            self._reference = _fastest_per_interval(self._reference_runs)
            self._reference_wall = _fastest_per_interval(self._reference_walls)
            self._phase = "paced"
        # The iterations that set the reference measure compute: there, collectives take what
        # the loopback takes. Emulated links would leave the cores idle between bursts, and a
        # burst after idling computes slower (results/emulation/20261125-reference-without-links.md).
        self._links_emulated = not (self.pace_compute and self._phase == "reference")
        self.mark()

    @property
    def pacing(self) -> bool:
        return self._phase == "paced"

    @property
    def reference_pause_s(self) -> float | None:
        """How long this rank waited per full-pace reference iteration (the median over them of
        the iteration's wall time less its compute intervals' wall time): on peers with more
        work, on the loopback collectives, on the worker loop. None before the reference is set."""
        if self._reference is None or not self._reference_pauses:
            return None
        return float(np.median(self._reference_pauses))

    @property
    def reference_step_s(self) -> float | None:
        return None if self._reference is None else sum(self._reference)

    def discount_reference(self, probe: dict, apply: bool = True) -> None:
        """Take the pause penalty out of the reference (bench.runtime.hostspeed.pause_penalty measured it,
        for this rank's pause, just now).

        At full pace a rank with less work than its peers waits on them at every iteration, and
        a burst that follows a pause computes slower (docs/emulation.md, "The pause discount").
        Its reference is then cold, and pacing against it would emulate a slower device than the
        cluster declares (results/emulation/20261126-pause-discount.md). The probe's
        ratio of a plain step after the same pause to one run back to back divides the reference,
        clamped to [1, MAX_PAUSE_PENALTY] (a noisy probe never makes a reference slower).
        apply=False records the probe only (a rank that hardly waited: its probe is noise)."""
        self.pause_probe = dict(probe)
        factor = min(max(probe["penalty"], 1.0), MAX_PAUSE_PENALTY) if apply else 1.0
        self.pause_probe["applied"] = factor
        self._reference = [r / factor for r in self._reference]

    def mark(self) -> None:
        """Start a new compute interval now (after waiting on communication or data)."""
        self._last = time.perf_counter()
        self._last_cpu = (threading.get_ident(), time.thread_time())

    def issued(self) -> None:
        """The rank issues a collective now (its compute interval has just ended): what it is
        behind from here on is the compute's after this issue (absorb_debt)."""
        self._debt_at_issue = self._debt

    def absorb_debt(self, waited_from: float, done_at: float) -> None:
        """Forgive what the rank fell behind since it last issued a collective, as far as the
        wait on an async collective that ends here hid it. That compute ran while the link was
        busy: had it kept its target, the rank would only have waited longer, and left the wait
        at the same moment, `done_at` (when the link delivered); no later collective's start
        depended on it (it came after the last issue). It only delays the rank where the rank
        came to the wait (`waited_from`) after `done_at`. Carried forward instead, the debt
        would be repaid by the next interval, Adam's step, which would then run short of its
        target: hap's slow rank paces the end of backward after issuing its gradient all-reduce
        with short sleeps, which a VM oversleeps (results/emulation/20261128-absorbed-overrun.md)."""
        behind = self._debt - self._debt_at_issue
        if behind <= 0 or not self.pacing:
            return
        kept = max(0.0, min(behind, waited_from - done_at))
        self.absorbed_s += behind - kept
        self._debt = self._debt_at_issue + kept

    def stretch(self) -> None:
        """End the current compute interval: wait until it has lasted its target."""
        now = time.perf_counter()
        if not self.pace_compute or self._paused:
            self.mark()
            return
        measured = now - self._last
        k = len(self._iteration)
        if self._phase == "reference":
            # The reference is the interval's CPU time on this thread (where a CPU rank
            # computes: one intra-op thread, autograd on the caller): what the device itself
            # spent, not its share of a host crowded with more ranks than cores (a wall-time
            # reference came out long: results/emulation/20261123-pacing-and-dilation.md), nor a wait on
            # a peer inside the interval that the emulator does not see (DDP's buffer broadcast
            # in forward).
            thread, cpu_start = self._last_cpu
            cpu = time.thread_time() - cpu_start if thread == threading.get_ident() else measured
            self._iteration.append(min(cpu, measured))
            self._iteration_wall.append(measured)
            self.mark()
            return
        self._iteration.append(measured)
        if k < len(self._reference):
            reference = self._reference[k]
        else:  # a longer iteration than the reference's: pace what was measured
            reference = measured
            self.unreferenced += 1
        target = reference * self.dilation * self.wall_per_emulated_s
        owed = target - measured - self._debt
        if owed > 0:
            time.sleep(owed)
            after = time.perf_counter()
            self.slept_s += after - now
            now = after
        achieved = now - self._last
        self._debt += achieved - target
        self.target_s += target
        self.achieved_s += achieved
        self.reference_s += reference
        self._last = now

    def report(self, probe_flops: float | None = None) -> dict:
        """What the emulated device achieved over the measured iterations (rows record it).

        Unpaced (on a GPU): the configured speed and the rank's measured matmul FLOP/s
        (`probe_flops`); the runner turns every rank's into achieved speeds (achieved_speeds)."""
        if not self.pace_compute:
            return {"speed": self.cluster.devices[self.rank].speed, "paced": False,
                    "probe_flops_per_s": probe_flops,
                    "mps_active_thread_percentage": _env_float("CUDA_MPS_ACTIVE_THREAD_PERCENTAGE")}
        # What the rank's timeline was charged: an overrun that a wait hid (absorb_debt) is not.
        achieved = self.achieved_s - self.absorbed_s
        error = None if not self.target_s else achieved / self.target_s - 1.0
        return {
            "speed": 1.0 / self.dilation,
            "target_dilation": self.dilation,
            "achieved_dilation": (None if not self.reference_s
                                  else achieved * self.headroom / self.reference_s),
            "error": error,
            "unreferenced_intervals": self.unreferenced,
            "reference_s_per_iter": sum(self._reference or ()),
            # The same reference timed in wall time: above the CPU time when ranks crowd the
            # cores or wait unseen inside an interval (what the CPU-time reference leaves out).
            "reference_wall_s_per_iter": None if self._reference_wall is None else sum(self._reference_wall),
            "reference_s": list(self._reference or ()),
            "reference_wall_s": list(self._reference_wall or ()),
            "shared_reference": self.settings.reference is not None,
            "reference_pause_s": self.reference_pause_s,
            # The reference as measured, before discount_reference divided it (None: not probed).
            "reference_cold_s_per_iter": (None if self.pause_probe is None
                                          else sum(self._reference) * self.pause_probe["applied"]),
            "pause_probe": self.pause_probe,
            "slept_s": self.slept_s,
            # Of the measured iterations' emulated collectives, the share whose link time counted
            # from the last member's arrival (the rest: from completion, less the loopback fit).
            "links_from_arrival": self.links[1] / self.links[0] if self.links[0] else None,
            "link_emulated_s": self.link_wall[0] * self.headroom,  # emulated time, measured iterations
            "link_overrun_s": self.link_wall[1] * self.headroom,
            "absorbed_s": self.absorbed_s,  # wall seconds of debt waits absorbed (absorb_debt)
        }

    # -- links -----------------------------------------------------------------------------
    def arrive(self, group) -> tuple[int, int] | None:
        """Note on the board that this rank issues its next collective on `group` now; the
        token names that collective for link_deadline."""
        return None if self._board is None else self._board.arrive(group, self.rank)

    def link_deadline(self, kind: str, nbytes: int, group, issued: float,
                      token: tuple[int, int] | None = None) -> float:
        """When the emulated link delivers a collective whose real run just completed.

        The link carries the data once every member has arrived. Where the board has every
        member's arrival (`token`), the emulated time counts from the last one and the real
        run, which went on meanwhile, is part of it. Otherwise it counts from the completion,
        the first moment known to follow every arrival (counting from the rank's own issue
        would let an early rank leave before the transfer is done), and the real loopback
        collective's fitted cost is taken off. Collectives queue on one clock per rank and
        link level: a machine's internal link and its network link carry transfers side by
        side. A gather or scatter (to and from a machine's leader) moves the parts of all
        ranks: its size is theirs.
        """
        if not self.enabled or self._paused or not self._links_emulated:
            return time.perf_counter()
        ranks = list(dist.get_process_group_ranks(group) if group is not None
                     else range(dist.get_world_size()))
        link = self.cluster.link_between(ranks)
        if kind in ("gather", "scatter"):
            nbytes *= len(ranks)
        emulated = collective_time_s(kind, nbytes, len(ranks), link) * self.wall_per_emulated_s
        last = None if token is None else self._board.last_arrival(token, ranks)  # a token means a board
        if last is None:
            # A rank that arrived last saw the real cost exactly (issue to completion); the
            # fitted loopback model covers the others.
            alpha, bytes_per_s = self._loopback
            real = min(alpha + link_bytes(kind, nbytes, len(ranks)) / bytes_per_s, time.perf_counter() - issued)
        with self._lock:
            now, free = time.perf_counter(), self._link_free_at.get(id(link), 0.0)
            self.links[0] += 1
            if last is not None:
                self.links[1] += 1
                self.link_wall[0] += emulated
                self.link_wall[1] += max(0.0, now - (max(last, free) + emulated))
                self._link_free_at[id(link)] = max(now, max(last, free) + emulated)
            else:
                self._link_free_at[id(link)] = max(now, free) + max(0.0, emulated - real)
            return self._link_free_at[id(link)]

    def install(self) -> None:
        """Measure the real loopback collective, then wrap torch.distributed's collectives.

        Every rank calls it at the same point (it runs collectives). Call it before a method
        sets up: DeepSpeed keeps references to the collectives at initialize.
        """
        if self.enabled:
            if dist.get_world_size() > 1:
                self._board = ArrivalBoard.open(dist.get_world_size())
            self._loopback = _measure_loopback()  # its collectives: every rank has the board after
            if self._board is not None:
                self._board.unlink()  # mapped by every rank: no file is left, however the run ends
            _install_wrappers(self)


class ArrivalBoard:
    """When each rank of this host issued its k-th collective on each process group, in a file
    in shared memory every rank of the run maps (perf_counter is one clock for all processes
    of a host). Ranks call collectives on a group in the same order, so (group, k) is the same
    collective on every member. A cell holds (k, issue time); a member whose cell holds another
    k (a rank on another host, or one SLOTS collectives ahead) makes the arrival unknown."""

    GROUPS, SLOTS = 64, 256
    ENV = "HETBENCH_ARRIVAL_BOARD"  # bench.runtime.launch names its workers' board here

    def __init__(self, table: np.ndarray, path: Path | None = None):
        self._table = table
        self._path = path
        self._count: dict[str, int] = {}

    def unlink(self) -> None:
        """Remove the board's file once every rank has mapped it (the mappings stay valid)."""
        if self._path is not None:
            self._path.unlink(missing_ok=True)

    @staticmethod
    def path(launcher_pid: int, port: int | str) -> Path:
        """The board of the ranks that process `launcher_pid` started with rendezvous `port`."""
        shm = Path("/dev/shm")
        folder = shm if shm.is_dir() and os.access(shm, os.W_OK) else Path(tempfile.gettempdir())
        return folder / f"hetbench-arrivals-{launcher_pid}-{port}"

    @classmethod
    def open(cls, world_size: int) -> ArrivalBoard:
        """The run's board, created by whichever rank comes first. Unlinked once every rank
        has mapped it (Emulator.install); before that, at a rank's exit and by the launcher once
        its workers are gone (bench.runtime.launch: a killed or forked worker runs no exit handler). A
        process that runs several cases keeps its board and its counts (bench.dilation, tests).
        bench.runtime.launch names the board (its forked workers' parent is a server, not the
        launcher); elsewhere the ranks' parent and MASTER_PORT do (torchrun)."""
        path = Path(os.environ.get(cls.ENV) or cls.path(os.getppid(), os.environ.get("MASTER_PORT", "0")))
        shape = (world_size, cls.GROUPS, cls.SLOTS, 2)
        if (path, shape) in _boards:
            return _boards[path, shape]
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
        try:
            size = int(np.prod(shape)) * 8
            if os.fstat(fd).st_size < size:
                os.ftruncate(fd, size)  # zeros: no collective is numbered 0
        finally:
            os.close(fd)
        board = _boards[path, shape] = cls(np.memmap(path, dtype=np.float64, mode="r+", shape=shape), path)
        atexit.register(path.unlink, missing_ok=True)
        return board

    @classmethod
    def _row(cls, name: str) -> int:
        # torch numbers process groups in creation order, the same on every rank
        return int(name) % cls.GROUPS if name.isdigit() else zlib.crc32(name.encode()) % cls.GROUPS

    def arrive(self, group, rank: int) -> tuple[int, int] | None:
        name = getattr(group if group is not None else c10d._get_default_group(), "group_name", None)
        if not name:
            return None
        k = self._count[name] = self._count.get(name, 0) + 1
        row = self._row(name)
        cell = self._table[rank, row, k % self.SLOTS]
        cell[1] = time.perf_counter()
        cell[0] = k  # last: a reader that sees k sees its time
        return row, k

    def last_arrival(self, token: tuple[int, int], ranks: list[int]) -> float | None:
        row, k = token
        latest = 0.0
        for r in ranks:
            cell = self._table[r, row, k % self.SLOTS]
            if cell[0] != k:
                return None
            t = float(cell[1])
            if cell[0] != k:  # overwritten while read
                return None
            latest = max(latest, t)
        return latest


_boards: dict[tuple[Path, tuple[int, ...]], ArrivalBoard] = {}


def _references(emulation: dict | None) -> list[tuple[float, float]] | None:
    """(full-pace reference seconds per iteration, speed) of every rank of a row's
    `emulation`, or None when any rank has none (unpaced, or it failed): no partial figure."""
    ranks = (emulation or {}).get("ranks") or []
    refs = [(r["reference_s_per_iter"], r["speed"]) for r in ranks if r.get("reference_s_per_iter")]
    return refs if refs and len(refs) == len(ranks) else None


def links_ok(overrun_s: float, iter_s: float) -> bool:
    """Whether the real collectives' overrun of the emulated link time (per iteration) stays
    within DILATION_TOLERANCE of the iteration: the declared links are what ran."""
    return overrun_s <= DILATION_TOLERANCE * iter_s


def emulated_compute_s(emulation: dict | None) -> float | None:
    """The slowest rank's compute per iteration in emulated time: its full-pace reference (CPU
    time, measured by its own worker in this run) over its speed. Calibration tables split an
    iteration by it into compute and the rest (links, waits, pacing, the worker loop). As a
    yardstick of how fast the host ran the workers, pooled_compute_s is steadier."""
    refs = _references(emulation)
    return None if refs is None else max(ref / speed for ref, speed in refs)


def pooled_compute_s(emulation: dict | None) -> float | None:
    """Every rank's full-pace compute per iteration summed, over the ranks' summed speeds: the
    cluster's compute were it spread evenly. The regression check divides iterations by it.

    Each rank's reference is the fastest of a dozen iterations of one process, and an iteration
    need not follow the slowest rank's: hap's and sfb's on local_hetero2 follow the fast rank's
    more, so over the slow rank's compute alone (emulated_compute_s) their figure moves several
    times as much as over this (results/baselines/20261128-regression-check-rules.md, from
    results/baselines/20261126-normaliser-rounds.json)."""
    refs = _references(emulation)
    return None if refs is None else sum(ref for ref, _ in refs) / sum(speed for _, speed in refs)


def _fastest_per_interval(runs: list[list[float]]) -> list[float]:
    """Per interval k, the fastest k-th interval of the reference iterations that have one."""
    return [min(run[k] for run in runs if k < len(run)) for k in range(max(map(len, runs), default=0))]


def achieved_speeds(speeds: list[float], flops: list[float]) -> list[float]:
    """Each rank's achieved speed on the configured scale: its share of the ranks' summed
    measured FLOP/s times the summed configured speeds (equal to `speeds` when the GPU was
    shared exactly in their ratio)."""
    total = sum(flops)
    return [f / total * sum(speeds) for f in flops]


def measure_matmul_flops(device: torch.device, size: int = 4096, reps: int = 20) -> float:
    """FLOP/s of this process on `device`: `reps` fp32 size x size matmuls (at the TF32 setting
    in force), after warm-up, synchronised. Large enough that the SM share, not kernel launches,
    sets the time: 137 GFLOP each, ~3 ms on a whole H100, ~10 ms at a 30% MPS share."""
    gen = torch.Generator(device=device).manual_seed(0)
    a = torch.randn(size, size, device=device, generator=gen)
    b = torch.randn(size, size, device=device, generator=gen)
    for _ in range(3):  # cuBLAS handles and workspaces, clocks up
        a @ b
    _synchronize(device)
    start = time.perf_counter()
    for _ in range(reps):
        a @ b
    _synchronize(device)
    return 2 * size**3 * reps / (time.perf_counter() - start)


def _env_float(name: str) -> float | None:
    value = os.environ.get(name)
    return None if value is None else float(value)


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _measure_loopback() -> tuple[float, float]:
    """(latency s, bytes/s per link) of this host's real all-reduce, fitted from two sizes.

    Fastest of several calls: what the loopback costs at best, so that subtracting it never
    leaves a collective shorter than its emulated time.
    """
    n = dist.get_world_size()
    if n == 1:
        return 0.0, float("inf")

    def fastest(t: torch.Tensor, reps: int) -> float:
        dist.all_reduce(t)  # warm-up; also waits for every rank to arrive
        times = []
        for _ in range(reps):
            start = time.perf_counter()
            dist.all_reduce(t)
            times.append(time.perf_counter() - start)
        return min(times)

    small, big = torch.zeros(1), torch.zeros(2**20)
    alpha = fastest(small, 7)
    slope = max(fastest(big, 3) - alpha, 1e-6)
    return alpha, link_bytes("all_reduce", big.numel() * 4, n) / slope


def _sleep_until(deadline: float) -> None:
    remaining = deadline - time.perf_counter()
    if remaining > 0:
        time.sleep(remaining)


class _DelayedWork:
    """An async collective handle that completes no earlier than the emulated link allows.

    The link's time counts from the real completion, seen by a callback on the work's future
    (gloo completes it on its own thread), not from whenever the rank waits: a gradient bucket
    waited for at the end of backward finished on its link long before."""

    def __init__(self, work, deadline_at_completion):
        self._work = work
        self._deadline_at_completion = deadline_at_completion
        self._deadline = None
        self._lock = threading.Lock()
        try:
            work.get_future().then(lambda _: self._settle())
        except (AttributeError, RuntimeError):  # no future: the link's time counts from the wait
            pass

    def _settle(self) -> float:
        with self._lock:
            if self._deadline is None:
                self._deadline = self._deadline_at_completion()
            return self._deadline

    def _delay(self) -> None:
        _sleep_until(self._settle())

    def wait(self, *args, **kwargs):
        # Waiting is communication, not compute: the compute before it ends here (paced as
        # any interval is) and a new interval starts after it, as around a blocking collective.
        # Without this, a wait between the trainer's stretch() and the next collective's issue
        # (a leader's gradient sync) counted as compute, and its debt cut that rank's pacing.
        emu = _installed[-1] if _installed and not getattr(_state, "active", False) else None
        if emu is not None and emu._last_cpu[0] != threading.get_ident():
            emu = None  # a wait on another thread than the rank's compute (a callback) marks nothing
        if emu is not None:
            emu.stretch()
        waited_from = time.perf_counter()
        out = self._work.wait(*args, **kwargs)
        self._delay()
        if emu is not None:
            emu.absorb_debt(waited_from, self._settle())
            emu.mark()
        return out

    def is_completed(self):
        return self._work.is_completed() and self._deadline is not None and (
            time.perf_counter() >= self._deadline)

    def get_future(self):
        def delay(fut):
            self._delay()
            return fut.value()

        return self._work.get_future().then(delay)

    def __getattr__(self, name):
        return getattr(self._work, name)


# name -> (kind for the cost model, argument holding the tensor whose size that model expects)
_COLLECTIVES = {
    "all_reduce": ("all_reduce", "tensor"),
    "broadcast": ("broadcast", "tensor"),
    "reduce": ("reduce", "tensor"),
    "all_gather_single": ("all_gather", "output_tensor"),
    "all_gather_into_tensor": ("all_gather", "output_tensor"),
    "all_gather": ("all_gather", "tensor_list"),
    "reduce_scatter_single": ("reduce_scatter", "input"),
    "reduce_scatter_tensor": ("reduce_scatter", "input"),
    "all_to_all_single": ("all_to_all", "input"),
    "gather": ("gather", "tensor"),
    "scatter": ("scatter", "tensor"),
}


def _nbytes(t) -> int:
    if isinstance(t, (list, tuple)):
        return sum(_nbytes(x) for x in t)
    return t.numel() * t.element_size()


_state = threading.local()  # reentrancy: old names call new ones inside c10d; count once


_installed: list[Emulator] = []  # the emulator of the case now running in this process


def _wrap(fn, kind, sized_arg):
    signature = inspect.signature(fn)

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        emu = _installed[-1]
        if getattr(_state, "active", False):
            return fn(*args, **kwargs)
        _state.active = True
        try:
            bound = signature.bind(*args, **kwargs).arguments
            emu.stretch()  # the compute since the last communication point ends here
            emu.issued()
            size, group = _nbytes(bound[sized_arg]), bound.get("group")
            token = emu.arrive(group)
            issued = time.perf_counter()
            work = fn(*args, **kwargs)
            if bound.get("async_op"):
                return _DelayedWork(work, lambda: emu.link_deadline(kind, size, group, issued, token))
            _sleep_until(emu.link_deadline(kind, size, group, issued, token))
            emu.mark()
            return work
        finally:
            _state.active = False

    wrapper.__hetbench_wrapped__ = True
    return wrapper


def _install_wrappers(emu: Emulator) -> None:
    """Wrap the collectives once per process; each later case's emulator takes over the
    wrappers (a process may run several cases: bench.dilation, tests)."""
    _installed[:] = [emu]
    for name, (kind, sized_arg) in _COLLECTIVES.items():
        original = getattr(c10d, name, None)
        if original is None or getattr(original, "__hetbench_wrapped__", False):
            continue
        wrapped = _wrap(original, kind, sized_arg)
        setattr(c10d, name, wrapped)
        if getattr(dist, name, None) is original:
            setattr(dist, name, wrapped)
