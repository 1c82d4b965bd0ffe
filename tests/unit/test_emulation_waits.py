"""A wait on an async collective is communication: the emulator does not count the time spent
blocked in it as compute (a leader's gradient sync once did, and its debt cut the pacing)."""

from __future__ import annotations

import threading
import time

from bench import emulation
from bench.cluster import ClusterSpec


class SlowWork:
    """An async handle whose peers arrive late: wait() blocks without using the CPU."""

    def wait(self, *args, **kwargs):
        time.sleep(0.05)
        return True

    def is_completed(self):
        return True


def test_time_blocked_in_a_wait_is_not_a_compute_interval():
    cluster = ClusterSpec.from_config({
        "name": "t", "emulated": True,
        "machines": [{"count": 1, "device": "cpu", "num_devices": 1, "speed": 1.0},
                     {"count": 1, "device": "cpu", "num_devices": 1, "speed": 0.5}],
        "links": {level: {"bandwidth_gbps": 1.0, "latency_s": 5e-5} for level in ("intra_machine", "inter_machine")},
    }).with_host_speed(1e10)
    emu = emulation.Emulator(cluster, 1, enabled=True)
    saved = list(emulation._installed)
    emulation._installed[:] = [emu]
    try:
        emu.mark()
        end = time.thread_time() + 0.005
        while time.thread_time() < end:  # 5 ms of compute
            pass
        emu.stretch()  # the trainer ends backward's interval
        emulation._DelayedWork(SlowWork(), time.perf_counter).wait()  # 50 ms blocked
        emu.stretch()  # the next collective's issue ends whatever interval is open
        intervals = len(emu._iteration_wall)
        waiter = threading.Thread(target=emulation._DelayedWork(SlowWork(), time.perf_counter).wait)
        waiter.start()  # a wait on another thread (a callback) is not the rank's compute
        waiter.join()
        assert len(emu._iteration_wall) == intervals
    finally:
        emulation._installed[:] = saved
    walls = emu._iteration_wall
    assert walls[0] >= 0.005
    assert max(walls[1:]) < 0.01, f"a wait was counted as compute: intervals {walls}"
