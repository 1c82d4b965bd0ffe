"""One rank's Emulator: its compute paced against a full-pace reference, in a closed loop, and its
collectives held to the emulated links (link_clock.py keeps their clocks).

The package's docstring says how pacing works and why; this module does not start processes or
wrap collectives itself (link_clock.install_wrappers does, at install).
"""

from __future__ import annotations

import contextlib
import os
import threading
import time

import numpy as np

from bench.core.cluster import ClusterSpec
from bench.runtime.emulation.link_clock import LinkClock, install_wrappers
from bench.runtime.emulation.options import MAX_PAUSE_PENALTY, EmulationSettings


class Emulator:
    """Per-rank time dilation and link emulation. A disabled one does nothing, cheaply."""

    def __init__(
        self,
        cluster: ClusterSpec,
        rank: int,
        enabled: bool,
        settings: EmulationSettings | None = None,
        pace_compute: bool = True,
    ):
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
        self._links = LinkClock(cluster, rank)  # the emulated links' clocks and counts
        self._paused = False
        # Pacing: per-iteration interval lists while referencing, then their medians.
        self._phase = "reference"  # reference -> paced
        self._iteration: list[float] = []
        self._reference_runs: list[list[float]] = []
        self._iteration_wall: list[float] = []  # the same intervals' wall time (diagnostic)
        self._reference_walls: list[list[float]] = []
        self._reference_wall: list[float] | None = None
        self._reference: list[float] | None = None
        self._reference_target = self.settings.reference_iters  # reference iterations to take
        self._iteration_start = time.perf_counter()
        self._reference_pauses: list[float] = []  # per reference iteration: wall less its compute
        self.pause_probe: dict | None = None  # discount_reference's measurement
        if self.settings.reference is not None:
            self._reference = list(self.settings.reference)
        self._debt = 0.0  # wall seconds the rank is behind its target (carried forward)
        self._debt_at_issue = 0.0  # ... when it last issued a collective (absorb_debt)
        # Links are not emulated in the iterations before pacing starts (begin_iteration).
        self._links_emulated = True
        self.slept_s = 0.0  # compute-dilation sleep of this round, for reports and tests
        self.reset_stats()

    def reset_stats(self) -> None:
        """Start counting achieved vs target compute time afresh (at the first measured step)."""
        self.target_s = 0.0  # wall time the compute intervals should have taken
        self.achieved_s = 0.0  # wall time they took (compute + dilation sleep)
        self.reference_s = 0.0  # their full-pace reference
        self.unreferenced = 0  # intervals with no reference (an iteration longer than the ref)
        self._links.reset_stats()
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
        elif self._phase == "reference" and not shared and len(self._reference_runs) >= self._reference_target:
            self._reference = _fastest_per_interval(self._reference_runs)
            self._reference_wall = _fastest_per_interval(self._reference_walls)
            self._phase = "paced"
        # The iterations that set the reference measure compute: there, collectives take what
        # the loopback takes. Emulated links would leave the cores idle between bursts, and a
        # burst after idling computes slower (docs/emulation.md, "Pacing compute against a reference").
        self._links_emulated = not (self.pace_compute and self._phase == "reference")
        self.mark()

    def begin_round(self, rereference: bool = False) -> None:
        """A later round of the case starts after an idle spell: what the rank was behind or
        ahead of its targets at the end of the last round is not carried into it.
        `rereference`: its first `round_reference_iters` iterations set the reference again, at
        full pace (not with a shared reference, EmulationSettings.reference)."""
        self._debt = self._debt_at_issue = 0.0
        self.slept_s = 0.0
        if rereference and self.settings.reference is None and self.pace_compute:
            self._phase = "reference"
            self._reference_target = min(self.settings.round_reference_iters, self.settings.reference_iters)
            self._reference_runs, self._reference_walls, self._reference_pauses = [], [], []
            self._iteration, self._iteration_wall = [], []
            self._reference = self._reference_wall = None
            self.pause_probe = None
            self._links_emulated = False
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
        cluster declares. The probe's
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
        with short sleeps, which a VM oversleeps (docs/emulation.md, "Pacing compute against a reference")."""
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
            # reference came out long: docs/emulation.md, "Pacing compute against a reference"), nor a wait on
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
            return {
                "speed": self.cluster.devices[self.rank].speed,
                "paced": False,
                "probe_flops_per_s": probe_flops,
                "mps_active_thread_percentage": _env_float("CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"),
            }
        # What the rank's timeline was charged: an overrun that a wait hid (absorb_debt) is not.
        achieved = self.achieved_s - self.absorbed_s
        error = None if not self.target_s else achieved / self.target_s - 1.0
        return {
            "speed": 1.0 / self.dilation,
            "target_dilation": self.dilation,
            "achieved_dilation": (None if not self.reference_s else achieved * self.headroom / self.reference_s),
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
            "reference_cold_s_per_iter": (
                None if self.pause_probe is None else sum(self._reference) * self.pause_probe["applied"]
            ),
            "pause_probe": self.pause_probe,
            "slept_s": self.slept_s,
            # Of the measured iterations' emulated collectives, the share whose link time counted
            # from the last member's arrival (the rest: from completion, less the loopback fit).
            "links_from_arrival": self.links[1] / self.links[0] if self.links[0] else None,
            "link_emulated_s": self.link_wall[0] * self.headroom,  # emulated time, measured iterations
            "link_overrun_s": self.link_wall[1] * self.headroom,
            "absorbed_s": self.absorbed_s,  # wall seconds of debt waits absorbed (absorb_debt)
        }

    # -- links (bench.runtime.emulation.link_clock) ----------------------------------------------
    @property
    def links(self) -> list[int]:
        """Emulated collectives since reset_stats: all, and those timed from the last arrival."""
        return self._links.count

    @property
    def link_wall(self) -> list[float]:
        """Of those timed from the last arrival: wall seconds of their emulated link time, and of
        the real run past it (the collective completed after the emulated link would have)."""
        return self._links.wall

    def arrive(self, group) -> tuple[int, int] | None:
        """Note on the board that this rank issues its next collective on `group` now; the
        token names that collective for link_deadline."""
        return self._links.arrive(group)

    def link_deadline(
        self, kind: str, nbytes: int, group, issued: float, token: tuple[int, int] | None = None
    ) -> float:
        """When the emulated link delivers a collective whose real run just completed
        (LinkClock.deadline); now, where links are not emulated (disabled, paused, or while a
        paced rank sets its reference)."""
        if not self.enabled or self._paused or not self._links_emulated:
            return time.perf_counter()
        return self._links.deadline(kind, nbytes, group, issued, token, self.wall_per_emulated_s)

    def reserve_link(self, link, emulated: float) -> float:
        """A point-to-point send posted now on `link` (LinkClock.reserve): when it starts."""
        return self._links.reserve(link, emulated)

    def p2p_delivered(self, emulated: float, overrun: float) -> None:
        """Count a received point-to-point transfer (LinkClock.delivered)."""
        self._links.delivered(emulated, overrun)

    def install(self) -> None:
        """Measure the real loopback collective, then wrap torch.distributed's collectives.

        Every rank calls it at the same point (it runs collectives). Call it before a method
        sets up: DeepSpeed keeps references to the collectives at initialize.
        """
        if self.enabled:
            self._links.open()
            install_wrappers(self)


def _fastest_per_interval(runs: list[list[float]]) -> list[float]:
    """Per interval k, the fastest k-th interval of the reference iterations that have one."""
    return [min(run[k] for run in runs if k < len(run)) for k in range(max(map(len, runs), default=0))]


def _env_float(name: str) -> float | None:
    value = os.environ.get(name)
    return None if value is None else float(value)
