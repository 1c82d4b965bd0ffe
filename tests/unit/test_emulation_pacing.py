"""The emulator's pacing and turn-taking, on a simulated clock: what it sleeps and what it
counts follow from its inputs alone, not from how busy the machine running the test is.

(These tests once spun the CPU for real and asserted wall times within 2 ms; a test process
preempted for 3.5 ms on a 2-core machine failed them.)"""

from __future__ import annotations

import pytest

from bench.core.cluster import ClusterSpec
from bench.runtime import emulation
from bench.runtime.emulation import EmulationSettings, Emulator, emulator, link_clock


class FakeClock:
    """Stands in for the `time` module inside bench.runtime.emulation's emulator and link_clock:
    compute advances the wall and the thread's CPU clock, a sleep or a preemption only the wall."""

    def __init__(self):
        self.wall = 100.0
        self.cpu = 10.0
        self.slept = []

    def perf_counter(self) -> float:
        return self.wall

    def thread_time(self) -> float:
        return self.cpu

    def sleep(self, seconds: float) -> None:
        self.slept.append(seconds)
        self.wall += max(seconds, 0.0)

    def compute(self, seconds: float) -> None:
        self.wall += seconds
        self.cpu += seconds

    def preempt(self, seconds: float) -> None:
        self.wall += seconds


@pytest.fixture
def clock(monkeypatch):
    fake = FakeClock()
    monkeypatch.setattr(emulator, "time", fake)
    monkeypatch.setattr(link_clock, "time", fake)
    return fake


def _one_device(speed: float) -> ClusterSpec:
    return ClusterSpec.from_config(
        {
            "name": "one",
            "emulated": True,
            "machines": [{"count": 1, "device": "cpu", "num_devices": 1, "speed": speed}],
            "links": {
                "intra_machine": {"bandwidth_gbps": 1.0, "latency_s": 0.0},
                "inter_machine": {"bandwidth_gbps": 1.0, "latency_s": 0.0},
            },
        }
    )


def _iterate(emu: Emulator, clock: FakeClock, busy: dict[int, float], preempted: dict[int, float] | None = None):
    """One compute interval per iteration; returns each iteration's wall time."""
    walls = []
    for it, seconds in busy.items():
        emu.begin_iteration(it)
        start = clock.wall
        clock.compute(seconds)
        clock.preempt((preempted or {}).get(it, 0.0))
        emu.stretch()
        walls.append(clock.wall - start)
    return walls


def test_pacing_follows_the_reference_not_the_slowed_burst(clock):
    """A burst that ran slower than its reference (a cold core) is not stretched: the rank
    sleeps only what its target has left, and carries any overshoot into the next interval."""
    emu = Emulator(_one_device(0.5), 0, enabled=True, settings=EmulationSettings(headroom=1.0, reference_iters=2))
    # Iterations 0-1 are skipped, 2-3 set the reference (4 ms); iteration 4 runs cold (12 ms).
    walls = _iterate(emu, clock, {0: 0.004, 1: 0.004, 2: 0.004, 3: 0.004, 4: 0.012, 5: 0.004, 6: 0.004})
    assert walls[:4] == pytest.approx([0.004] * 4)  # full pace until the reference is set
    assert walls[4] == pytest.approx(0.012)  # over its 8 ms target: no sleep
    assert walls[5] == pytest.approx(0.004)  # its 4 ms overshoot is owed back at once
    assert walls[6] == pytest.approx(0.008)  # 2 x the 4 ms reference
    assert emu.report()["error"] == pytest.approx(0.0, abs=1e-9)


def test_a_reference_is_cpu_time_so_a_preempted_interval_does_not_lengthen_it(clock):
    """The reference is the interval's CPU time: a rank preempted while it measured (the host
    busy with others) still paces to what it computed."""
    emu = Emulator(_one_device(0.25), 0, enabled=True, settings=EmulationSettings(headroom=1.0, reference_iters=2))
    walls = _iterate(emu, clock, {i: 0.002 for i in range(5)}, preempted={2: 0.003, 3: 0.001})
    assert emu.report()["reference_s"] == pytest.approx([0.002])
    assert emu.report()["reference_wall_s"] == pytest.approx([0.003])
    assert walls[4] == pytest.approx(0.008)


def test_a_later_round_sets_its_reference_from_its_own_round_reference_iters(clock):
    """A later round (begin_round with rereference) runs round_reference_iters full-pace
    iterations, its last before the timed ones (Pacing.round_start), and paces against what they
    measured, not the first round's reference."""
    settings = EmulationSettings(headroom=1.0, reference_iters=4, round_reference_iters=2)
    emu = Emulator(_one_device(0.5), 0, enabled=True, settings=settings)
    first = EmulationSettings.SKIPPED + 4  # the first round's first timed iteration
    walls = _iterate(emu, clock, {i: 0.002 for i in range(first + 1)})
    assert walls[-1] == pytest.approx(0.004) and emu.report()["reference_s"] == pytest.approx([0.002])
    emu.begin_round(rereference=True)
    assert not emu.pacing
    # The host now runs the rank 1.5x slower: iterations first - 2 and first - 1 measure it.
    walls = _iterate(emu, clock, {i: 0.003 for i in range(first - 2, first + 2)})
    assert walls[:2] == pytest.approx([0.003, 0.003])  # full pace
    assert emu.pacing and emu.report()["reference_s"] == pytest.approx([0.003])
    assert walls[2:] == pytest.approx([0.006, 0.006])  # 2 x the new 3 ms


def test_a_shared_reference_paces_from_the_first_iteration_after_set_up(clock):
    """Given a reference (EmulationSettings.reference), a rank measures none of its own: only
    the SKIPPED set-up iterations run at full pace, every later one lasts reference / speed."""
    settings = EmulationSettings(headroom=1.0, reference_iters=12, reference=(0.005,))
    emu = Emulator(_one_device(0.5), 0, enabled=True, settings=settings)
    walls = _iterate(emu, clock, {i: 0.002 for i in range(4)})
    assert walls[: EmulationSettings.SKIPPED] == pytest.approx([0.002] * EmulationSettings.SKIPPED)
    assert walls[EmulationSettings.SKIPPED :] == pytest.approx([0.010] * 2)  # 2 x the shared 5 ms
    assert emu.report()["shared_reference"] and emu.report()["reference_s"] == [0.005]


def test_headroom_runs_the_rank_in_slow_motion(clock):
    """headroom h: every interval lasts 1 / h as long in wall time as it does in emulated time."""
    emu = Emulator(_one_device(0.5), 0, enabled=True, settings=EmulationSettings(headroom=0.5, reference_iters=1))
    walls = _iterate(emu, clock, {i: 0.002 for i in range(5)})
    assert walls[3:] == pytest.approx([0.008, 0.008])  # 2 ms x dilation 2 / headroom 0.5
    assert emu.report()["achieved_dilation"] == pytest.approx(2.0)


def test_links_are_emulated_once_pacing_starts_not_while_the_reference_is_measured(clock):
    """The iterations that set the reference measure compute: a collective there takes what
    the loopback takes (no emulated link to sleep out); paced iterations pay the link."""
    emu = Emulator(_one_device(0.5), 0, enabled=True, settings=EmulationSettings(headroom=1.0, reference_iters=1))
    assert emu._links_emulated  # a worker that never begins iterations (a link test) has links
    emu.begin_iteration(0)
    issued = clock.wall
    clock.preempt(0.001)
    assert emu.link_deadline("all_reduce", 10**9, None, issued) == clock.wall  # owes nothing
    _iterate(emu, clock, {it: 0.002 for it in range(1, EmulationSettings.SKIPPED + 1)})
    assert not emu._links_emulated
    emu.begin_iteration(EmulationSettings.SKIPPED + 1)
    assert emu.pacing and emu._links_emulated


def test_the_pooled_compute_is_every_ranks_reference_over_the_summed_speeds():
    ranks = [{"speed": 1.0, "reference_s_per_iter": 0.009}, {"speed": 0.4, "reference_s_per_iter": 0.005}]
    assert emulation.pooled_compute_s({"ranks": ranks}) == pytest.approx(0.014 / 1.4)
    assert emulation.emulated_compute_s({"ranks": ranks}) == pytest.approx(0.0125)  # the slow rank's
    # A rank with no reference (unpaced, or it failed) leaves no figure, not a partial one.
    assert emulation.pooled_compute_s({"ranks": [ranks[0], {"speed": 0.4}]}) is None
    assert emulation.pooled_compute_s(None) is None


def _waiting_iterations(
    emu: Emulator, clock: FakeClock, count: int, busy: float, wait: float, preempted: float = 0.0
) -> None:
    """`count` iterations of `busy` compute (preempted inside for `preempted`), each followed
    by `wait` spent waiting on peers."""
    for it in range(count):
        emu.begin_iteration(it)
        clock.compute(busy)
        clock.preempt(preempted)
        emu.stretch()
        clock.preempt(wait)
        emu.mark()


def test_the_pause_of_the_reference_iterations_is_their_wall_time_less_their_compute(clock):
    """A rank with less work than its peers waits on them at every full-pace iteration: that
    wait is its reference pause (what discount_reference is measured for). Being preempted
    inside an interval (a core shared with another rank) is not a pause."""
    emu = Emulator(_one_device(0.5), 0, enabled=True, settings=EmulationSettings(headroom=1.0, reference_iters=3))
    _waiting_iterations(emu, clock, EmulationSettings.SKIPPED + 3, busy=0.004, wait=0.003, preempted=0.002)
    assert emu.reference_pause_s is None  # the reference is set at the next iteration's start
    emu.begin_iteration(EmulationSettings.SKIPPED + 3)
    assert emu.reference_pause_s == pytest.approx(0.003)
    assert emu.reference_step_s == pytest.approx(0.004)


@pytest.mark.parametrize(
    "penalty, apply, factor",
    [
        (1.2, True, 1.2),  # measured slowdown after the pause: taken out
        (0.95, True, 1.0),  # a noisy probe never makes the reference slower
        (3.0, True, emulation.MAX_PAUSE_PENALTY),  # nor takes out more than the clamp
        (1.2, False, 1.0),  # a rank that hardly waited: recorded, not applied
    ],
)
def test_the_pause_discount_divides_the_reference_by_the_measured_penalty(clock, penalty, apply, factor):
    emu = Emulator(_one_device(0.5), 0, enabled=True, settings=EmulationSettings(headroom=1.0, reference_iters=2))
    _waiting_iterations(emu, clock, EmulationSettings.SKIPPED + 3, busy=0.006, wait=0.004)
    assert emu.pacing
    emu.discount_reference(
        {"pause_s": 0.004, "warm_s": 0.005, "cold_s": 0.005 * penalty, "penalty": penalty}, apply=apply
    )
    report = emu.report()
    assert report["reference_s_per_iter"] == pytest.approx(0.006 / factor)
    assert report["reference_cold_s_per_iter"] == pytest.approx(0.006)
    assert report["pause_probe"]["applied"] == pytest.approx(factor)
    # Paced against the discounted reference: 2 x (6 ms / factor).
    start = clock.wall
    emu.begin_iteration(10)
    clock.compute(0.006)
    emu.stretch()
    assert clock.wall - start == pytest.approx(max(0.012 / factor, 0.006))
