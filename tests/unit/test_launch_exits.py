"""bench.runtime.launch: what the exit code of a worker that sent no traceback says in its row; how the
workers' server and its launcher leave."""

import os
import signal
import subprocess
import sys

from bench.runtime.launch import _silent_exit


def test_a_silent_worker_is_named_by_its_exit_code_or_its_signal():
    assert _silent_exit(1) == "exited with code 1 and no traceback"
    assert _silent_exit(-signal.SIGKILL).startswith("killed by SIGKILL (by the kernel when out of memory")
    assert _silent_exit(-signal.SIGABRT).startswith("killed by SIGABRT, in native code")
    realtime = signal.SIGRTMIN + 2  # valid, but without a name of its own
    assert _silent_exit(-realtime).startswith(f"killed by signal {realtime}, in native code")


_SERVER_EXIT = """
import bench.runtime.server_exit
class Held:  # what a server holds: torch, the modules it preloaded
    def __del__(self):
        print("torn down")
held = Held()
print("written", end="")  # buffered (stdout is a pipe): still written
"""


def test_the_workers_server_leaves_without_tearing_down_what_it_imported():
    out = subprocess.run([sys.executable, "-c", _SERVER_EXIT], capture_output=True, text=True, timeout=60)
    assert (out.returncode, out.stdout, out.stderr) == (0, "written", "")
    # without it, the interpreter's teardown runs
    plain = subprocess.run(
        [sys.executable, "-c", _SERVER_EXIT.replace("import bench.runtime.server_exit", "")],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert plain.stdout == "writtentorn down\n"


def test_the_server_preloads_its_exit_first_and_its_launcher_freezes_its_heap_at_exit(monkeypatch):
    import atexit
    import gc
    import multiprocessing.forkserver

    from bench.runtime import launch

    preloads, registered = [], []
    monkeypatch.setattr(
        launch.mp,
        "get_context",
        lambda kind: type("Ctx", (), {"set_forkserver_preload": staticmethod(preloads.append)})(),
    )
    monkeypatch.setattr(multiprocessing.forkserver, "ensure_running", lambda: None)
    monkeypatch.setattr(atexit, "register", registered.append)
    monkeypatch.setattr(atexit, "unregister", lambda f: registered.remove(f) if f in registered else None)

    class Method:
        pass

    for _ in range(3):  # a case each
        launch.start_server(Method(), object())
    assert preloads[0][0] == "bench.runtime.server_exit" and registered == [gc.freeze]


def _sends_its_result(conn):
    conn.send(("result", 0, {"iter_time_s": 0.5}))
    conn.close()


def _dies_mid_message(conn):
    import faulthandler
    import os
    import struct

    faulthandler.disable()  # (the abort is meant)
    os.write(conn.fileno(), struct.pack("!i", 2**20) + b"\x80" * 10)  # a 1 MB message begun
    os.abort()


def test_a_worker_that_dies_halfway_through_a_message_fails_the_case_at_once():
    """Its pipe ends (the launcher holds no writing end of it), so the read stops there rather
    than wait for the rest of the message for good."""
    import multiprocessing
    import time

    import pytest

    from bench.runtime.launch import WorkerError, _collect

    ctx = multiprocessing.get_context("fork")  # the workers touch no torch
    pipes = [ctx.Pipe(duplex=False) for _ in range(2)]
    procs = [
        ctx.Process(target=f, args=(w,), daemon=True)
        for f, (_, w) in zip((_sends_its_result, _dies_mid_message), pipes)
    ]
    for p, (_, w) in zip(procs, pipes):
        p.start()
        w.close()
    t0 = time.monotonic()
    with pytest.raises(WorkerError) as err:
        _collect(procs, [r for r, _ in pipes], timeout_s=60, on_progress=None)
    assert time.monotonic() - t0 < 10
    assert err.value.rank == 1 and err.value.detail.startswith("killed by SIGABRT"), err.value
    for p in procs:
        p.join()


_FORKED_SERVER = """
import multiprocessing.forkserver, sys
import torch
from bench.runtime import launch
if sys.argv[1] == "computed":  # an OpenMP pool: its copy would hang a forked child's parallel work
    torch.set_num_threads(2)
    (torch.ones(256, 256) @ torch.ones(256, 256)).sum()
print("written", end="")  # buffered (no PYTHONUNBUFFERED): written once, not again by a fork
launch.start_server()
pid = multiprocessing.forkserver._forkserver._forkserver_pid
forked = open(f"/proc/{pid}/cmdline", "rb").read() == open("/proc/self/cmdline", "rb").read()
probe = launch.forking_context().Process(target=exec, args=("import sys; sys.exit(7 if 'torch' in sys.modules else 3)",))
probe.start()
probe.join()
# the server's preloads imported once: here where forked, else by the server alone
print("", "forked" if forked else "fresh", probe.exitcode, "torch._dynamo" in sys.modules)
"""


def test_a_launcher_that_has_computed_nothing_forks_its_server_and_one_that_has_starts_it_afresh():
    env = {k: v for k, v in os.environ.items() if k != "PYTHONUNBUFFERED"}
    outs = [
        subprocess.run(
            [sys.executable, "-c", _FORKED_SERVER, how], capture_output=True, text=True, timeout=120, env=env
        )
        for how in ("imported", "computed")
    ]
    assert [(out.returncode, out.stdout, out.stderr) for out in outs] == [
        (0, "written forked 7 True\n", ""),
        (0, "written fresh 7 False\n", ""),
    ]
