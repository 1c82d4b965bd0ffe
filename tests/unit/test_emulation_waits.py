"""A wait on an async collective is communication: the emulator does not count the time spent
blocked in it as compute (a leader's gradient sync once did, and its debt cut the pacing)."""

from __future__ import annotations

import threading
import time

import pytest
import torch

from bench.core.cluster import ClusterSpec
from bench.runtime import emulation
from bench.runtime.emulation import link_clock

pytestmark = pytest.mark.alone  # millisecond waits and intervals, timed


class SlowWork:
    """An async handle whose peers arrive late: wait() blocks without using the CPU."""

    def wait(self, *args, **kwargs):
        time.sleep(0.05)
        return True

    def is_completed(self):
        return True


def _cluster() -> ClusterSpec:
    """Two emulated devices, full speed and half."""
    return ClusterSpec.from_config(
        {
            "name": "t",
            "emulated": True,
            "machines": [
                {"count": 1, "device": "cpu", "num_devices": 1, "speed": 1.0},
                {"count": 1, "device": "cpu", "num_devices": 1, "speed": 0.5},
            ],
            "links": {
                level: {"bandwidth_gbps": 1.0, "latency_s": 5e-5} for level in ("intra_machine", "inter_machine")
            },
        }
    ).with_host_speed(1e10)


def test_time_blocked_in_a_wait_is_not_a_compute_interval():
    cluster = _cluster()
    emu = emulation.Emulator(cluster, 1, enabled=True)
    saved = list(link_clock._installed)
    link_clock._installed[:] = [emu]
    try:
        emu.mark()
        end = time.thread_time() + 0.005
        while time.thread_time() < end:  # 5 ms of compute
            pass
        emu.stretch()  # the trainer ends backward's interval
        link_clock._DelayedWork(SlowWork(), time.perf_counter).wait()  # 50 ms blocked
        emu.stretch()  # the next collective's issue ends whatever interval is open
        intervals = len(emu._iteration_wall)
        waiter = threading.Thread(target=link_clock._DelayedWork(SlowWork(), time.perf_counter).wait)
        waiter.start()  # a wait on another thread (a callback) is not the rank's compute
        waiter.join()
        assert len(emu._iteration_wall) == intervals
    finally:
        link_clock._installed[:] = saved
    walls = emu._iteration_wall
    assert walls[0] >= 0.005
    assert max(walls[1:]) < 0.01, f"a wait was counted as compute: intervals {walls}"


class DoneWork:
    """An async handle whose transfer completes when its future does."""

    def __init__(self):
        self.future = torch.futures.Future()

    def get_future(self):
        return self.future

    def wait(self, *args, **kwargs):
        self.future.wait()
        return True

    def is_completed(self):
        return self.future.done()


def test_an_emulated_link_counts_from_the_real_completion_not_from_the_wait():
    """A gradient bucket completes during backward and is waited for at its end: its link time
    ran beside backward, so the wait owes nothing once that time has passed."""
    work = DoneWork()
    handle = link_clock._DelayedWork(work, lambda: time.perf_counter() + 0.02)  # 20 ms on the link
    work.future.set_result(None)  # the real transfer completes now
    assert not handle.is_completed()  # ... the emulated link has not delivered yet
    time.sleep(0.05)  # backward goes on
    assert handle.is_completed()
    start = time.perf_counter()
    handle.wait()
    assert time.perf_counter() - start < 0.01


def test_the_arrival_board_knows_a_collective_once_every_member_has_arrived():
    """Each rank numbers its collectives per process group; the last member's issue time is
    known once every member has written that number, and unknown before (or after a member
    has run SLOTS collectives further)."""
    import types

    import numpy as np

    table = np.zeros((2, emulation.ArrivalBoard.GROUPS, emulation.ArrivalBoard.SLOTS, 2))
    ranks = [emulation.ArrivalBoard(table), emulation.ArrivalBoard(table)]  # two processes' views
    group, other = types.SimpleNamespace(group_name="3"), types.SimpleNamespace(group_name="4")
    token = ranks[0].arrive(group, 0)
    assert ranks[0].last_arrival(token, [0, 1]) is None  # rank 1 has not issued it yet
    ranks[1].arrive(other, 1)  # another group's collective says nothing about this one
    assert ranks[0].last_arrival(token, [0, 1]) is None
    time.sleep(0.002)
    assert ranks[1].arrive(group, 1) == token  # the same collective on both ranks
    last = ranks[0].last_arrival(token, [0, 1])
    assert last == table[1, token[0], token[1], 1] and last > table[0, token[0], token[1], 1]
    for _ in range(emulation.ArrivalBoard.SLOTS):  # rank 1 runs a whole ring of collectives ahead
        ranks[1].arrive(group, 1)
    assert ranks[0].last_arrival(token, [0, 1]) is None


def _busy(seconds: float) -> None:
    end = time.thread_time() + seconds
    while time.thread_time() < end:
        pass


def _to_the_wait(emu: emulation.Emulator, intervals: int) -> float:
    """The seconds from the stretch before a wait to the wait's own, as the emulator measured
    them (an interval whose target is 0: all of it debt). Microseconds on a quiet host; a host
    that takes the thread away between the two lines makes it a tenth of a millisecond or more,
    and the debt then holds that too."""
    return sum(emu._iteration[intervals:])


def _paced_emulator(reference: tuple[float, ...]) -> emulation.Emulator:
    """Rank 1 (speed 0.5) of a two-device cluster, pacing from the start against `reference`."""
    cluster = _cluster()
    settings = emulation.EmulationSettings(headroom=1.0, reference=reference)
    emu = emulation.Emulator(cluster, 1, enabled=True, settings=settings)
    emu.begin_iteration(emulation.EmulationSettings.SKIPPED)
    assert emu.pacing
    return emu


def test_compute_that_overruns_under_an_async_collectives_link_is_not_repaid_after_the_wait():
    """hap's trainer issues its gradient all-reduce, computes the rest of backward while the
    link is busy, waits, then steps Adam. An overrun of that rest (an oversleep of the VM)
    made the rank come to the wait later, not leave it later; repaid from Adam's interval, the
    slow device's step came out short of its speed."""
    # Intervals: up to the issue, after it, the wait's (none), Adam: 2, 2, 0, 8 ms at speed 0.5
    emu = _paced_emulator((0.001, 0.001, 0.0, 0.004))
    saved = list(link_clock._installed)
    link_clock._installed[:] = [emu]
    try:
        emu.mark()
        emu.stretch()  # up to the issue: slept to its 2 ms
        emu.issued()
        at_issue = emu._debt
        work = DoneWork()
        handle = link_clock._DelayedWork(work, lambda: time.perf_counter() + 0.2)  # 200 ms link
        work.future.set_result(None)
        _busy(0.006)  # the rest of backward overruns its 2 ms target by 4 ms or more
        emu.stretch()
        behind, intervals = emu._debt - at_issue, len(emu._iteration)
        handle.wait()  # the link delivers long after the rank came to the wait
        start = time.perf_counter()  # Adam's interval starts at the wait's end: the checks below are in it
        gap = _to_the_wait(emu, intervals)
        assert behind >= 0.0035
        assert emu._debt == pytest.approx(at_issue, abs=1e-4), "an overrun the wait hid was carried past it"
        assert emu.report()["absorbed_s"] == pytest.approx(behind + gap, abs=1e-4)
        emu.stretch()  # Adam's interval (nothing computed): sleeps out its whole 8 ms target
        assert time.perf_counter() - start >= 0.008 - at_issue - 0.0005
    finally:
        link_clock._installed[:] = saved


def test_compute_that_overruns_past_the_links_delivery_is_still_repaid():
    """An overrun that made the rank come to the wait after the link had delivered delayed it:
    it is repaid as before."""
    emu = _paced_emulator((0.001, 0.001, 0.0, 0.004))
    saved = list(link_clock._installed)
    link_clock._installed[:] = [emu]
    try:
        emu.mark()
        emu.stretch()
        emu.issued()
        at_issue = emu._debt
        work = DoneWork()
        handle = link_clock._DelayedWork(work, lambda: time.perf_counter() + 0.001)  # 1 ms link
        work.future.set_result(None)
        _busy(0.006)  # comes to the wait the overrun plus 1 ms after the link delivered
        emu.stretch()
        behind, intervals = emu._debt - at_issue, len(emu._iteration)
        handle.wait()
        assert behind >= 0.0035
        assert emu._debt == pytest.approx(at_issue + behind + _to_the_wait(emu, intervals), abs=1e-4)
        assert emu.report()["absorbed_s"] == 0.0
    finally:
        link_clock._installed[:] = saved
