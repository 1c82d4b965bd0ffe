"""A CPU process that computes the way an emulated device does, so that its step times repeat.

Every process that runs or times emulated compute on this host (the workers, the parent's
host-speed probe, bench.profile's CPU profile) computes through
`emulated_device()`:

- one intra-op thread: an emulated device is one core, and slow ranks sleep rather than spin;
- denormals flushed to zero: denormal softmax gradients make a step several times slower;
- glibc's malloc told to keep what a step frees (`steady_allocator`). By default glibc moves
  its mmap threshold as a process runs, so each process settles on its own split of a step's
  buffers between the heap and fresh mappings, and a step that unmaps and re-maps a buffer
  faults its pages in again on every step: two workers running the same program would differ
  for the whole of their lives, and the parent's probe would be a third draw from the same
  spread (docs/emulation.md, "Devices and compute").
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import platform
import threading
from collections.abc import Callable

import torch

# mallopt parameters (glibc malloc.h). Setting either also turns glibc's dynamic adjustment off.
_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3
# The largest mmap threshold glibc accepts on 64-bit hosts (DEFAULT_MMAP_THRESHOLD_MAX): blocks
# below it come from the heap; only larger ones (paper-size tensors) are mapped per allocation.
MMAP_THRESHOLD_BYTES = 32 << 20
# Free memory at the top of the heap kept rather than returned to the system.
TRIM_THRESHOLD_BYTES = 1 << 30

_steady: bool | None = None


def cpu_model() -> str:
    """The processor's name, from /proc/cpuinfo; else what `platform` says, which asks a child
    process (`uname -p`), so only when there is no cpuinfo to read."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def host_cores() -> int:
    """The cores this process may run on (emulated ranks beyond them take turns or share)."""
    return len(os.sched_getaffinity(0))


def pin_to_core(local_rank: int) -> int:
    """Bind this thread, and every thread it starts from now on (gloo's), to one of the cores it
    may run on: the `local_rank`-th, modulo their number; returns the core.

    An unbound rank that waited on a peer inside a collective computes its next burst slower
    (woken, most likely, on whichever core is free, with caches its peer just filled); a sleep
    of the same length in a lone process costs nothing. Unbound, an emulated rank's pacing
    reference, measured at full pace, charged a rank more the longer it waited, and the slow
    device of a compute-proportional split ran slower than declared
    (docs/emulation.md, "One core per rank").
    """
    cores = sorted(os.sched_getaffinity(0))
    core = cores[local_rank % len(cores)]
    os.sched_setaffinity(0, {core})
    return core


# The threads of torch's gloo backend: the transport's event loop and the process group's workers.
COMM_THREAD_PREFIXES = ("gloo", "pt_gloo")
# The process group's workers (pt_gloo_runloop), which run a collective's algorithm, and their nice.
GLOO_WORKER_PREFIX = "pt_gloo"
GLOO_WORKER_NICE = -10


def _each_thread(prefixes: tuple[str, ...], change: Callable[[int], None]) -> int | None:
    """Call `change(tid)` for each of this process's threads, other than the calling one, whose
    name starts with one of `prefixes`; how many it changed, or None as soon as the host refuses
    (PermissionError). A thread that ends meanwhile is skipped."""
    me = threading.get_native_id()
    count = 0
    for entry in os.listdir("/proc/self/task"):
        tid = int(entry)
        if tid == me:
            continue
        try:
            with open(f"/proc/self/task/{tid}/comm") as f:
                if not f.read().startswith(prefixes):
                    continue
            change(tid)
        except (FileNotFoundError, ProcessLookupError):
            continue
        except PermissionError:
            return None
        count += 1
    return count


def realtime_comm_threads() -> int | None:
    """Put this process's gloo threads at real-time priority (SCHED_FIFO, the lowest level), so
    that a woken one runs at once on a core busy with the rank's compute; returns how many run
    so now, or None where the host refuses it (no CAP_SYS_NICE nor `ulimit -r`). Threads gloo
    starts later (a new process group's) need another call, and so does a thread it has started
    that has not run yet: each names itself when it first runs, and until then carries the
    interpreter's name, and on a busy host a scan right after init_process_group can miss one.
    So call it once the group has done some work; the worker calls it at each of its set-up
    iterations.

    A woken thread of normal priority waits, often, for the core's next timer interrupt, so a
    small collective beside compute completes up to a scheduler tick late; at SCHED_FIFO it runs
    at once. But gloo's event loop spins at times, and at real-time priority nothing of normal
    priority runs on its core until the kernel's real-time throttling (95% of each second by
    default) lets it: with more ranks than cores calls take seconds, so the runner refuses that
    (docs/emulation.md, "gloo's threads")."""

    def fifo(tid: int) -> None:
        if os.sched_getscheduler(tid) != os.SCHED_FIFO:
            os.sched_setscheduler(tid, os.SCHED_FIFO, os.sched_param(1))

    return _each_thread(COMM_THREAD_PREFIXES, fifo)


def gloo_workers_first() -> int | None:
    """Run this process's gloo process-group workers at nice -10 (GLOO_WORKER_NICE), so that a
    worker woken on the rank's core runs at once; returns how many run so now, or None where the
    host refuses (a negative nice needs root, CAP_SYS_NICE or `ulimit -e` of 30 or more). Call it
    as realtime_comm_threads is called: workers name themselves when they first run.

    Why: gloo's ring all-reduce sends each rank's part in several rounds (over 2 ranks, from 3
    elements on; reduce-scatters stalled alike), and a peer's next round can arrive
    before this rank's worker has posted the receive for it. gloo's event loop then polls that
    socket without sleeping until the receive is posted. The worker that would post it is woken
    on the same core as the polling loop (the rank is bound to one), at the same priority, and
    the scheduler lets it in only at the core's next tick (4 ms at 250 Hz): the call ends up
    to a tick late, on both ranks at once. Single-round calls do not stall (all-gathers and
    broadcasts of up to 128 KB, an all-reduce of one element, the calls bench.runtime.hostlinks
    times).
    At nice -10 the woken worker preempts the loop, or the rank's compute, straight away;
    workers sleep while they wait, so they hold the core only for the little work a call gives
    them. What it changes, and the alternatives that were worse (the event loop at nice 19 while
    the rank waits; the workers at SCHED_FIFO): docs/emulation.md, "gloo's threads"."""

    def first(tid: int) -> None:
        if os.getpriority(os.PRIO_PROCESS, tid) != GLOO_WORKER_NICE:
            os.setpriority(os.PRIO_PROCESS, tid, GLOO_WORKER_NICE)

    return _each_thread((GLOO_WORKER_PREFIX,), first)


def comm_priorities(realtime: bool, workers_first: bool) -> tuple[int | None, int | None]:
    """Give this process's gloo threads the priorities an emulated CPU rank runs them at
    (`emulation.realtime_comm`, `emulation.gloo_workers_first`): what realtime_comm_threads and
    gloo_workers_first return, None for a setting that is off. The runs' workers and the host
    floor's probe (bench.runtime.hostlinks) both call this, so that the floor is timed as runs run."""
    return (realtime_comm_threads() if realtime else None, gloo_workers_first() if workers_first else None)


def steady_allocator() -> bool:
    """Fix glibc malloc's mmap and trim thresholds in this process (once; later calls return the
    first answer). False where the C library has no mallopt (not glibc): nothing changes."""
    global _steady
    if _steady is None:
        try:
            # The symbols this process has loaded, the C library's among them. Not
            # ctypes.util.find_library("c"): it runs `ldconfig -p`, a child process that every
            # worker started right after installing its fatal-signal handlers.
            mallopt = ctypes.CDLL(None).mallopt
        except (OSError, AttributeError):
            _steady = False
        else:
            mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
            _steady = bool(mallopt(_M_MMAP_THRESHOLD, MMAP_THRESHOLD_BYTES)) and bool(
                mallopt(_M_TRIM_THRESHOLD, TRIM_THRESHOLD_BYTES)
            )
    return _steady


def configure_process(one_thread: bool = True) -> None:
    """This process computes as an emulated device does from now on (module docstring); a GPU
    rank keeps torch's threads (one_thread=False)."""
    steady_allocator()
    torch.set_flush_denormal(True)
    if one_thread:
        torch.set_num_threads(1)


@contextlib.contextmanager
def emulated_device():
    """Compute inside as one emulated CPU device does. The thread count is restored on the way
    out; the process keeps flushing denormals (torch cannot say what the setting was) and keeps
    the allocator's thresholds."""
    threads = torch.get_num_threads()
    configure_process()
    try:
        yield
    finally:
        torch.set_num_threads(threads)
