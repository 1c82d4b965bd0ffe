"""bench.launch: what the exit code of a worker that sent no traceback says in its row."""

import signal

from bench.launch import _silent_exit


def test_a_silent_worker_is_named_by_its_exit_code_or_its_signal():
    assert _silent_exit(1) == "exited with code 1 and no traceback"
    assert _silent_exit(-signal.SIGKILL).startswith("killed by SIGKILL (by the kernel when out of memory")
    assert _silent_exit(-signal.SIGABRT).startswith("killed by SIGABRT, in native code")
    realtime = signal.SIGRTMIN + 2  # valid, but without a name of its own
    assert _silent_exit(-realtime).startswith(f"killed by signal {realtime}, in native code")
