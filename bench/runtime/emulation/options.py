"""How an emulated cluster is run on this host: the `emulation` options and the tolerances the
runner judges a run by. Settings only; the Emulator (emulator.py) applies them.
"""

from __future__ import annotations

from dataclasses import dataclass

from bench.runtime.hostcpu import host_cores

# An emulated rank whose achieved compute time is off its target by more than this is flagged.
DILATION_TOLERANCE = 0.05
# A rank whose full-pace reference iterations waited at least this share of their compute is
# probed for the pause penalty (Emulator.discount_reference); below it the probe's noise would
# exceed the penalty, a few percent after a pause of half a step
# (docs/emulation.md, "The pause discount").
PAUSE_PROBE_MIN_SHARE = 0.25
MAX_PAUSE_PENALTY = 1.5


@dataclass(frozen=True)
class EmulationSettings:
    """How an emulated cluster is run on this host (the `emulation` config node)."""

    headroom: float = 0.6  # wall time runs 1/headroom slower than emulated time
    reference_iters: int = 12  # full-pace iterations (after SKIPPED ones) that set the reference
    pin_cores: bool = True  # each CPU rank bound to one core (bench.runtime.hostcpu.pin_to_core)
    # A later round of a repeated case sets the reference again (Pacing.begin_round), from this
    # many full-pace iterations (at most reference_iters).
    reference_each_round: bool = True
    round_reference_iters: int = 12
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
        absorb that (docs/emulation.md, "Pacing compute against a reference")."""
        cores = cores or host_cores()
        return round(0.6 * min(1.0, cores / max(num_ranks, 1)), 3)
