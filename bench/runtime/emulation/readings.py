"""What a row's emulation record says: whether the links ran as declared, and the compute an
iteration held in emulated time (calibration tables and the regression check divide by it).
It reads records; it runs nothing.
"""

from __future__ import annotations

from bench.runtime.emulation.options import DILATION_TOLERANCE


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
    times as much as over this (docs/regression.md, "The figures")."""
    refs = _references(emulation)
    return None if refs is None else sum(ref for ref, _ in refs) / sum(speed for _, speed in refs)
