"""Start one worker process per device on this host and watch them.

A failing worker ends the whole case: the others are terminated (then killed), its traceback is
raised as WorkerError (WorkerOutOfMemory when it ran out of memory). An emulated cluster on a GPU
runs inside a private MPS daemon (bench.runtime.mps), each worker with its SM share. Across hosts
use torchrun instead (docs/multinode.md); this is not a launcher for many machines.

Workers that compute on the CPU fork from a server process (multiprocessing's forkserver) that
has imported torch, torch._dynamo (DDP's constructor imports it), this module and the first
case's method and model, once per launcher and with GPUs hidden; a series of cases names the
methods of its later ones beforehand (bench.runner.execute.expect_cases), and the server imports
theirs too. A launcher that has run no thread of its own yet (a runner at its start, _forkable)
imports those modules itself (its capture and planning import them anyway) and forks the server
from itself, so they are imported once; one that has (a test process) starts the server as a
fresh interpreter, which imports them for seconds beside the caller's FLOP count: the runner
starts the server as soon as its first case is valid (start_server). (Not the launcher's main module:
each forked process runs it again as __mp_main__, and runpy warns when it finds that module
imported.) Each worker freezes what it inherits (gc.freeze), so its collections never walk the
server's objects. A forked worker starts within a fraction of a second, where a spawned one
spends seconds importing and tearing its interpreter down in every case, and it leaves with
os._exit, as multiprocessing ends its forked children. The server leaves the same way
(bench.runtime.server_exit) and the launcher freezes its heap before its interpreter's last
collections, so a runner's pipes close as soon as it ends (docs/runtime.md, "Workers"). A forked
worker takes the launcher's environment and working directory as they are when the case starts,
as a spawned one would; only what torch read at its import comes from where it was imported (the
server started afresh, or the launcher that forked it). Workers that compute on a GPU are
spawned (CUDA must not be initialised in a process that forks; a server for them has not been
tried on a GPU host).
"""

from __future__ import annotations

import atexit
import contextlib
import ctypes
import faulthandler
import gc
import importlib
import multiprocessing.forkserver
import os
import signal
import socket
import sys
import threading
import time
import traceback
from collections.abc import Callable
from multiprocessing import connection, resource_tracker
from multiprocessing.connection import wait

import torch
import torch.multiprocessing as mp

from bench.core.cluster import ClusterSpec
from bench.runtime import mps
from bench.runtime.emulation import ArrivalBoard
from bench.runtime.worker import CPU_ONLY_ENV, Case, RankOutOfMemory, rank_session

_TERMINATE_GRACE_S = 3.0
# The process that imported this module first; in a worker forked from the server, the server.
_IMPORTED_BY = os.getpid()


def _threads() -> int | None:
    """This process's threads, native ones included (None where /proc does not say: not Linux)."""
    try:
        return len(os.listdir("/proc/self/task"))
    except OSError:
        return None


# Threads a process runs once torch is imported (a BLAS library's pool): a server forked from it
# with no more than these holds what an interpreter that imported torch afresh would (_forkable).
_THREADS_AT_IMPORT = _threads()


class WorkerError(RuntimeError):
    def __init__(self, rank: int, detail: str):
        super().__init__(f"rank {rank} failed:\n{detail}")
        self.rank = rank
        self.detail = detail


class WorkerOutOfMemory(WorkerError):
    def __init__(self, rank: int, detail: str, peak_mem_gib: float):
        super().__init__(rank, detail)
        self.peak_mem_gib = peak_mem_gib


class CaseTimeout(RuntimeError):
    pass


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _die_with_parent(parent: int) -> None:
    """Linux: the kernel kills this worker if the launching process dies (no orphans).

    The request only covers a death after it is made; a launcher that died while this worker
    was still starting (importing torch takes seconds) is caught by the check that follows.
    """
    try:
        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        libc.prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except OSError:
        pass
    if os.getppid() != parent:
        os._exit(1)


def _release_server() -> None:
    """The server exits when the last copy of its launcher's end of a pipe closes, and
    multiprocessing hands each forked worker a copy (for workers that fork their own); a worker
    that keeps it, its launcher killed, keeps the server and so itself alive. Closed, the
    server goes with the launcher, and the worker with the server (PR_SET_PDEATHSIG)."""
    server = multiprocessing.forkserver._forkserver
    fd = getattr(server, "_forkserver_alive_fd", None)
    if fd is not None:
        os.close(fd)
        server._forkserver_alive_fd = None


def _entry(
    rank: int, world_size: int, case: Case, messages, commands, launcher: int, env: dict[str, str], cwd: str
) -> None:
    # MPS settings and a hidden GPU take effect when CUDA initialises: before anything touches it.
    assert not torch.cuda.is_initialized(), "CUDA initialised before the rank's environment"
    os.environ.clear()
    os.environ.update(env)
    os.chdir(cwd)
    # A worker that dies in native code (an abort, a segfault) prints where each of its Python
    # threads was to its stderr, the launcher's: the row can only say which signal ended it.
    faulthandler.enable(all_threads=True)
    forked = os.getpid() != _IMPORTED_BY  # a spawned worker imported this module itself
    # A forked worker's parent is the server, which exits when the launcher does.
    _die_with_parent(_IMPORTED_BY if forked else launcher)
    if forked:
        _release_server()
    # What exists at this point (the server's imports, the case) is never garbage: no collection
    # scans it again, the one at a rank's end (rank_session) included
    # (docs/runtime.md, "Workers").
    gc.freeze()
    try:
        report = (lambda it: messages.send(("progress", rank, it))) if rank == 0 else None
        # A forked worker ends by os._exit (the server's children run no destructors): it can
        # keep its process group past destroy_process_group (rank_session's keep_group).
        with rank_session(case, rank, world_size, local_rank=rank, keep_group=forked) as training:
            # The first round starts with the process; each later one when the launcher asks
            # (CaseWorkers.run_round), until it says stop or goes.
            while True:
                messages.send(("result", rank, training.run_round(report)))
                if not _next_round(commands):
                    break
    except RankOutOfMemory as exc:
        messages.send(("oom", rank, {"detail": exc.detail, "peak_mem_gib": exc.peak_mem_gib}))
        raise SystemExit(1) from None
    except BaseException:
        messages.send(("error", rank, traceback.format_exc()))
        raise SystemExit(1) from None
    finally:
        messages.close()


def _next_round(commands) -> bool:
    """Wait for the launcher's word: another round (True), or stop (False; also when its end of
    the pipe is gone)."""
    try:
        return bool(commands.recv())
    except (EOFError, OSError):
        return False


class CaseWorkers:
    """A case's worker processes, one per rank, kept from one round to the next.

    The first `run_round` starts them (each joins the case's process group, sets the method up
    and runs its untimed iterations, then the round); a later one asks them for another round
    of warm-up and measured iterations. A round that fails (a rank's error, out of memory, a
    timeout) stops every worker; the next round starts fresh ones. `close` stops them. Each
    case has workers of its own: nothing of one case reaches another's.
    """

    def __init__(self, case: Case, world_size: int):
        self.case, self.world_size = case, world_size
        self._stack = contextlib.ExitStack()
        self._procs: list = []
        self._readers: list = []
        self._commands: list = []
        self._board = None

    def run_round(self, timeout_s: float, on_progress: Callable[[int], None] | None = None) -> list[dict]:
        """One round on every rank; their results ordered by rank."""
        try:
            if not self._procs:
                self._start()
            else:
                for conn in self._commands:
                    conn.send(True)
            results = _collect(self._procs, self._readers, timeout_s, on_progress)
            return [results[r] for r in range(self.world_size)]
        except BaseException:
            self.close()
            raise

    def close(self) -> None:
        """Stop the workers (asked first, then terminated, then killed) and free their pipes."""
        for conn in self._commands:
            with contextlib.suppress(OSError):
                conn.send(False)
        end = time.monotonic() + _TERMINATE_GRACE_S
        for p in self._procs:
            p.join(timeout=max(0.0, end - time.monotonic()))
        _stop(self._procs)
        for conn in self._readers + self._commands:
            conn.close()
        if self._board is not None:
            self._board.unlink(missing_ok=True)
        self._procs, self._readers, self._commands, self._board = [], [], [], None
        self._stack.close()

    def __enter__(self) -> CaseWorkers:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _start(self) -> None:
        case, world_size = self.case, self.world_size
        on_gpu = case.cluster.emulated and case.cluster.device == "cuda"
        dirs = self._stack.enter_context(mps.mps_daemon()) if on_gpu else None
        envs = rank_envs(case.cluster, world_size, dirs)
        ctx = _context(case)
        # A pipe per worker, its writing end held by that worker alone once it has started: a
        # worker that dies, even halfway through a message, ends its pipe (a queue's pipe, which
        # the launcher also holds open for writing, left a launcher blocked mid-read for good).
        # The launcher's word for another round goes the other way, on a pipe of its own.
        pipes = [ctx.Pipe(duplex=False) for _ in range(world_size)]
        words = [ctx.Pipe(duplex=False) for _ in range(world_size)]
        port = _free_port()
        self._board = ArrivalBoard.path(os.getpid(), port)  # the workers' link board
        common = {
            **os.environ,
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": str(port),
            ArrivalBoard.ENV: str(self._board),
        }
        procs = [
            ctx.Process(
                target=_entry,
                daemon=True,
                args=(r, world_size, case, pipes[r][1], words[r][0], os.getpid(), {**common, **envs[r]}, os.getcwd()),
            )
            for r in range(world_size)
        ]
        for p, (_, writer), (reader, _) in zip(procs, pipes, words):
            p.start()
            writer.close()
            reader.close()
        self._procs = procs
        self._readers = [reader for reader, _ in pipes]
        self._commands = [writer for _, writer in words]


def launch(
    case: Case, world_size: int, timeout_s: float, on_progress: Callable[[int], None] | None = None
) -> list[dict]:
    """Run `case` on `world_size` local workers for one round; returns their results ordered by
    rank (CaseWorkers keeps workers for several rounds).

    An emulated cluster with `device: cuda` runs under its own MPS daemon, stopped when the
    case ends, failed or not; ConfigError (one line) when MPS is not installed. The workers of
    a cluster that computes on the CPU see no GPU (CPU_ONLY_ENV)."""
    with CaseWorkers(case, world_size) as workers:
        return workers.run_round(timeout_s, on_progress)


def rank_envs(cluster: ClusterSpec, world_size: int, mps_dirs: tuple[str, str] | None) -> list[dict[str, str]]:
    """What each worker adds to its environment first: its MPS share on a shared GPU, no GPU
    at all on a cluster that computes on the CPU, nothing on real GPUs."""
    if mps_dirs is not None:
        return mps.worker_envs(cluster, *mps_dirs)
    return [dict(CPU_ONLY_ENV) if cluster.device == "cpu" else {} for _ in range(world_size)]


# Modules of cases this process will launch later (expect_modules), preloaded with the first's.
_expected: list[str] = []
_SERVER_EXIT = "bench.runtime.server_exit"


def expect_modules(*modules: str) -> None:
    """Name modules that the workers of a later case import (its method's), so that
    the server imports them once when it starts instead of every such worker importing them
    itself. Too late once the server runs."""
    _expected.extend(m for m in modules if m not in _expected)


def start_server(method=None, model_cfg=None) -> None:
    """Start the server CPU workers fork from (see the module's docstring), preloading the
    modules of the case's method (method_modules) and model and those expected (expect_modules)
    besides torch and this module, unless it runs already. A server forked from this process
    (_fork_server) starts once this process has imported those; one started afresh imports them
    for seconds while the caller goes on (bench.run counts the model's FLOPs meanwhile). It lives
    as long as this process; a later case's modules that it did not preload are imported by
    each of that case's workers."""
    modules = [*method_modules(type(method)), type(model_cfg).__module__] if method is not None else []
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload([_SERVER_EXIT, __name__, "torch._dynamo", *modules, *_expected])
    saved = dict(os.environ)
    os.environ.update(CPU_ONLY_ENV)  # the server inherits it: it never sees a GPU
    try:
        if not (multiprocessing.forkserver._forkserver._forkserver_pid is None and _fork_server()):
            multiprocessing.forkserver.ensure_running()
    finally:
        os.environ.clear()
        os.environ.update(saved)
    # This process too holds torch and what the cases made: at its exit, the interpreter's last
    # collections would walk all of it; frozen, they skip it (docs/runtime.md, "Workers").
    atexit.unregister(gc.freeze)  # once, however many cases start it
    atexit.register(gc.freeze)


def _forkable() -> bool:
    """Whether this process can be the server's parent by a plain fork: it runs no thread of its
    own (Python's or a thread pool's) that the library threads torch's import starts do not
    account for, and has not initialised CUDA. A process that has computed with torch holds an
    OpenMP pool, whose copy would hang its children's first parallel region."""
    threads = _threads()
    return (
        threads is not None
        and threads <= _THREADS_AT_IMPORT
        and threading.active_count() == 1
        and not torch.cuda.is_initialized()
    )


def _fork_server() -> bool:
    """Start multiprocessing's forkserver as a fork of this process instead of a fresh interpreter
    (see the module's docstring). This process imports the server's preloads first (it imports
    them for its own cases anyway: capture and planning import torch._dynamo and the methods),
    so that they are imported once, not in both. False, and nothing started, where _forkable
    says no, before or after those imports."""
    if not _forkable():
        return False
    server = multiprocessing.forkserver._forkserver
    for name in server._preload_modules:
        if name != _SERVER_EXIT:  # the server's alone: it ends its process at exit
            with contextlib.suppress(ImportError):  # as the server's own preloading
                importlib.import_module(name)
    if not _forkable():  # an import started a thread of its own
        return False
    resource_tracker.ensure_running()
    for stream in (sys.stdout, sys.stderr):  # unwritten output would be written again by the copy
        stream.flush()
    with socket.socket(socket.AF_UNIX) as listener:
        address = connection.arbitrary_address("AF_UNIX")
        listener.bind(address)
        os.chmod(address, 0o600)
        listener.listen()
        alive_r, alive_w = os.pipe()
        try:
            pid = os.fork()
        except OSError:  # no process to be had: no server, and no pipe left open
            os.close(alive_r)
            os.close(alive_w)
            raise
        if pid == 0:
            os.close(alive_w)  # the server ends when its launcher's copy closes
            _serve(listener.fileno(), alive_r, server._preload_modules)
        os.close(alive_r)
    server._forkserver_address = address
    server._forkserver_alive_fd = alive_w
    server._forkserver_pid = pid
    return True


def _serve(listener_fd: int, alive_r: int, preload: list[str]) -> None:
    """The forked server's life: what multiprocessing's own runs, as the process that forked it."""
    global _IMPORTED_BY
    _IMPORTED_BY = os.getpid()  # its workers' parent (_entry)
    try:
        multiprocessing.forkserver.main(listener_fd, alive_r, preload)
    finally:
        os._exit(0)  # as bench.runtime.server_exit: none of the launcher's exit handlers


def forking_context():
    """The multiprocessing context that forks CPU processes from the server (start_server,
    started here if it runs not yet): a process that computes on the CPU beside the workers (a
    probe's ranks, bench.runtime.method_step) starts in a fraction of a second, where a spawned
    one imports torch again."""
    start_server()
    return mp.get_context("forkserver")


def method_modules(method) -> list[str]:
    """The modules a method's workers import: its own and those it names in `worker_modules`
    (what its set-up imports late: DeepSpeed's engine imports torch's compiler, seconds in every
    worker). `method`: its class, or the function a config names that makes it."""
    return [method.__module__, *getattr(method, "worker_modules", ())]


def _exit_at_once() -> None:
    os._exit(0)


_answered_by: int | None = None  # the server whose first fork wait_for_server saw through


def wait_for_server() -> None:
    """Return once the server has imported what it preloads, so that a timing taken next (the
    host's speed, the planner's time) has both cores to itself: its first fork comes only then.
    A server that has forked once is through its imports: later cases do not wait on it again."""
    global _answered_by
    server = multiprocessing.forkserver._forkserver
    if server._forkserver_pid is not None and server._forkserver_pid == _answered_by:
        return
    probe = mp.get_context("forkserver").Process(target=_exit_at_once, daemon=True)
    probe.start()
    probe.join()
    _answered_by = server._forkserver_pid


def forks_workers(cluster: ClusterSpec) -> bool:
    """Whether this launcher forks the cluster's workers from the server: those that compute on
    the CPU; workers on a GPU are spawned."""
    return cluster.device == "cpu"


def _context(case: Case):
    """Fork CPU workers from the server (start_server); spawn the rest."""
    if not forks_workers(case.cluster):
        return mp.get_context("spawn")
    start_server(case.method, case.workload.model_cfg)
    return mp.get_context("forkserver")


def _collect(procs, readers, timeout_s: float, on_progress: Callable[[int], None] | None) -> dict[int, dict]:
    """Each worker's result, read from its pipe (rank r writes readers[r]'s other end) until
    every rank has sent one. A rank whose pipe ends first failed: WorkerError, with its
    traceback when it sent one, else what its exit says; after `timeout_s`, CaseTimeout."""
    deadline = time.monotonic() + timeout_s
    results: dict[int, dict] = {}
    open_ = {conn: r for r, conn in enumerate(readers)}
    while len(results) < len(procs):
        ready = wait(list(open_), timeout=max(0.0, deadline - time.monotonic()))
        if not ready and time.monotonic() > deadline:
            raise CaseTimeout(f"case did not finish within timeout_s={timeout_s:g}")
        for conn in ready:
            r = open_[conn]
            try:
                kind, rank, payload = conn.recv()
            except (EOFError, OSError):  # ended, between messages or inside one
                del open_[conn]
                if r in results:
                    continue
                procs[r].join(timeout=1.0)  # its pipe closes as it exits: its exit code
                code = procs[r].exitcode
                raise WorkerError(
                    r, "closed its pipe without a result" if code is None else _silent_exit(code)
                ) from None
            if kind == "progress":
                if on_progress:
                    on_progress(payload)
            elif kind == "result":
                results[rank] = payload
            elif kind == "oom":
                raise WorkerOutOfMemory(rank, payload["detail"], payload["peak_mem_gib"])
            else:
                raise _first_cause(procs, WorkerError(rank, payload))
    return results


def _first_cause(procs, error: WorkerError) -> WorkerError:
    """The failure to report for `error`: a worker killed by a signal sends nothing, and its
    peers' collectives then break, so the first traceback to arrive may be a consequence.
    Waits a second for such a death before taking `error` as the cause."""
    end = time.monotonic() + 1.0
    while True:
        killed = [(r, p.exitcode) for r, p in enumerate(procs) if (p.exitcode or 0) < 0]
        if killed:
            rank, code = killed[0]
            then = (error.detail.strip().splitlines() or [""])[-1]
            return WorkerError(rank, f"{_silent_exit(code)}\n(after it, rank {error.rank} failed: {then})")
        if time.monotonic() > end:
            return error
        time.sleep(0.05)


def _silent_exit(code: int) -> str:
    """What the exit code of a worker that sent no traceback says about its end."""
    if code >= 0:
        return f"exited with code {code} and no traceback"
    try:
        name = signal.Signals(-code).name
    except ValueError:  # a real-time signal has no name
        name = f"signal {-code}"
    if -code == signal.SIGKILL:
        return f"killed by {name} (by the kernel when out of memory, or by someone)"
    return (
        f"killed by {name}, in native code or from outside; where its Python threads were is "
        "in the log, after 'Fatal Python error'"
    )


def _stop(procs) -> None:
    for p in procs:
        if p.is_alive():
            p.terminate()
    end = time.monotonic() + _TERMINATE_GRACE_S
    for p in procs:
        p.join(timeout=max(0.0, end - time.monotonic()))
    for p in procs:
        if p.is_alive():
            p.kill()
            p.join()
