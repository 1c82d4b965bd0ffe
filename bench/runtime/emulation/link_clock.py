"""Emulated links: every torch.distributed collective takes at least its link's alpha-beta time
(bench.cost), counted from its last member's arrival where the board knows it, else from its
completion less the loopback's own cost; back-to-back collectives queue on one clock per link level.

LinkClock keeps one rank's clocks; the wrappers hold each collective (and each async handle's
wait) to its deadline and end the caller's compute interval there. Pacing is emulator.py's.
"""

from __future__ import annotations

import functools
import inspect
import threading
import time

import torch
import torch.distributed as dist
import torch.distributed.distributed_c10d as c10d

from bench.core.cluster import ClusterSpec
from bench.cost import collective_time_s, link_bytes
from bench.runtime.emulation.board import ArrivalBoard


class LinkClock:
    """One rank's emulated links: when each collective's transfer ends on its emulated link, on
    one clock per link level, and how many there were. It does not decide whether links are
    emulated at a moment (the Emulator does) and paces no compute."""

    def __init__(self, cluster: ClusterSpec, rank: int):
        self.cluster = cluster
        self.rank = rank
        self._free_at: dict[int, float] = {}  # per link level this rank uses (id of the Link)
        self._loopback = (0.0, float("inf"))  # real collective cost here, measured at open
        self._board: ArrivalBoard | None = None  # when this host's ranks issued each collective
        self._lock = threading.Lock()
        self.reset_stats()

    def reset_stats(self) -> None:
        self.count = [0, 0]  # emulated collectives: all, and those timed from the last arrival
        # Of those timed from the last arrival: wall seconds of their emulated link time, and of
        # the real run past it (the collective completed after the emulated link would have).
        self.wall = [0.0, 0.0]

    def open(self) -> None:
        """Map this run's arrival board, then measure the real loopback collective. Every rank
        calls it at the same point (it runs collectives)."""
        if dist.get_world_size() > 1:
            self._board = ArrivalBoard.open(dist.get_world_size())
        self._loopback = measure_loopback()  # its collectives: every rank has the board after
        if self._board is not None:
            self._board.unlink()  # mapped by every rank: no file is left, however the run ends

    def arrive(self, group) -> tuple[int, int] | None:
        """Note on the board that this rank issues its next collective on `group` now."""
        return None if self._board is None else self._board.arrive(group, self.rank)

    def deadline(
        self, kind: str, nbytes: int, group, issued: float, token: tuple[int, int] | None, wall_per_emulated_s: float
    ) -> float:
        """When the emulated link delivers a collective whose real run just completed.

        The link carries the data once every member has arrived. Where the board has every
        member's arrival (`token`), the emulated time counts from the last one and the real
        run, which went on meanwhile, is part of it. Otherwise it counts from the completion,
        the first moment known to follow every arrival (counting from the rank's own issue
        would let an early rank leave before the transfer is done), and the real loopback
        collective's fitted cost is taken off. Collectives queue on one clock per rank and
        link level: a machine's internal link and its network link carry transfers side by
        side. A gather or scatter (to and from a machine's leader) moves the parts of all
        ranks: its size is theirs. `wall_per_emulated_s`: the run's slow motion (1 / headroom).
        """
        ranks = list(dist.get_process_group_ranks(group) if group is not None else range(dist.get_world_size()))
        link = self.cluster.link_between(ranks)
        if kind in ("gather", "scatter"):
            nbytes *= len(ranks)
        emulated = collective_time_s(kind, nbytes, len(ranks), link) * wall_per_emulated_s
        last = None if token is None else self._board.last_arrival(token, ranks)  # a token means a board
        if last is None:
            # A rank that arrived last saw the real cost exactly (issue to completion); the
            # fitted loopback model covers the others.
            alpha, bytes_per_s = self._loopback
            real = min(alpha + link_bytes(kind, nbytes, len(ranks)) / bytes_per_s, time.perf_counter() - issued)
        with self._lock:
            now, free = time.perf_counter(), self._free_at.get(id(link), 0.0)
            self.count[0] += 1
            if last is not None:
                self.count[1] += 1
                self.wall[0] += emulated
                self.wall[1] += max(0.0, now - (max(last, free) + emulated))
                self._free_at[id(link)] = max(now, max(last, free) + emulated)
            else:
                self._free_at[id(link)] = max(now, free) + max(0.0, emulated - real)
            return self._free_at[id(link)]

    def reserve(self, link, emulated: float) -> float:
        """A point-to-point transfer of `emulated` wall seconds posted now on `link`
        (bench.runtime.p2p): queued on the link's clock behind its earlier transfers and
        collectives. Returns when it starts."""
        with self._lock:
            start = max(time.perf_counter(), self._free_at.get(id(link), 0.0))
            self._free_at[id(link)] = start + emulated
            return start

    def delivered(self, emulated: float, overrun: float) -> None:
        """Count a received point-to-point transfer timed from its sender's start: its emulated
        wall seconds and the real run's past it."""
        with self._lock:
            self.count[0] += 1
            self.count[1] += 1
            self.wall[0] += emulated
            self.wall[1] += overrun


def measure_loopback() -> tuple[float, float]:
    """(latency s, bytes/s per link) of this host's real all-reduce, fitted from two sizes.

    Fastest of several calls: what the loopback costs at best, so that subtracting it never
    leaves a collective shorter than its emulated time.
    """
    n = dist.get_world_size()
    if n == 1:
        return 0.0, float("inf")

    def fastest(t: torch.Tensor, reps: int) -> float:
        dist.all_reduce(t)  # warm-up; also waits for every rank to arrive
        times = []
        for _ in range(reps):
            start = time.perf_counter()
            dist.all_reduce(t)
            times.append(time.perf_counter() - start)
        return min(times)

    small, big = torch.zeros(1), torch.zeros(2**20)
    alpha = fastest(small, 7)
    slope = max(fastest(big, 3) - alpha, 1e-6)
    return alpha, link_bytes("all_reduce", big.numel() * 4, n) / slope


def _sleep_until(deadline: float) -> None:
    remaining = deadline - time.perf_counter()
    if remaining > 0:
        time.sleep(remaining)


class _DelayedWork:
    """An async collective handle that completes no earlier than the emulated link allows.

    The link's time counts from the real completion, seen by a callback on the work's future
    (gloo completes it on its own thread), not from whenever the rank waits: a gradient bucket
    waited for at the end of backward finished on its link long before."""

    def __init__(self, work, deadline_at_completion):
        self._work = work
        self._deadline_at_completion = deadline_at_completion
        self._deadline = None
        self._lock = threading.Lock()
        try:
            work.get_future().then(lambda _: self._settle())
        except (AttributeError, RuntimeError):  # no future: the link's time counts from the wait
            pass

    def _settle(self) -> float:
        with self._lock:
            if self._deadline is None:
                self._deadline = self._deadline_at_completion()
            return self._deadline

    def _delay(self) -> None:
        _sleep_until(self._settle())

    def wait(self, *args, **kwargs):
        # Waiting is communication, not compute: the compute before it ends here (paced as
        # any interval is) and a new interval starts after it, as around a blocking collective.
        # Without this, a wait between the trainer's stretch() and the next collective's issue
        # (a leader's gradient sync) counted as compute, and its debt cut that rank's pacing.
        emu = _installed[-1] if _installed and not getattr(_state, "active", False) else None
        if emu is not None and emu._last_cpu[0] != threading.get_ident():
            emu = None  # a wait on another thread than the rank's compute (a callback) marks nothing
        if emu is not None:
            emu.stretch()
        waited_from = time.perf_counter()
        out = self._work.wait(*args, **kwargs)
        self._delay()
        if emu is not None:
            emu.absorb_debt(waited_from, self._settle())
            emu.mark()
        return out

    def is_completed(self):
        return self._work.is_completed() and self._deadline is not None and (time.perf_counter() >= self._deadline)

    def get_future(self):
        def delay(fut):
            self._delay()
            return fut.value()

        return self._work.get_future().then(delay)

    def __getattr__(self, name):
        return getattr(self._work, name)


# name -> (kind for the cost model, argument holding the tensor whose size that model expects)
_COLLECTIVES = {
    "all_reduce": ("all_reduce", "tensor"),
    "broadcast": ("broadcast", "tensor"),
    "reduce": ("reduce", "tensor"),
    "all_gather_single": ("all_gather", "output_tensor"),
    "all_gather_into_tensor": ("all_gather", "output_tensor"),
    "all_gather": ("all_gather", "tensor_list"),
    "reduce_scatter_single": ("reduce_scatter", "input"),
    "reduce_scatter_tensor": ("reduce_scatter", "input"),
    "all_to_all_single": ("all_to_all", "input"),
    "gather": ("gather", "tensor"),
    "scatter": ("scatter", "tensor"),
}


def _nbytes(t) -> int:
    if isinstance(t, (list, tuple)):
        return sum(_nbytes(x) for x in t)
    return t.numel() * t.element_size()


_state = threading.local()  # reentrancy: old names call new ones inside c10d; count once


_installed: list = []  # the emulator of the case now running in this process


def _wrap(fn, kind, sized_arg):
    signature = inspect.signature(fn)

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        emu = _installed[-1]
        if getattr(_state, "active", False):
            return fn(*args, **kwargs)
        _state.active = True
        try:
            bound = signature.bind(*args, **kwargs).arguments
            emu.stretch()  # the compute since the last communication point ends here
            emu.issued()
            size, group = _nbytes(bound[sized_arg]), bound.get("group")
            token = emu.arrive(group)
            issued = time.perf_counter()
            work = fn(*args, **kwargs)
            if bound.get("async_op"):
                return _DelayedWork(work, lambda: emu.link_deadline(kind, size, group, issued, token))
            _sleep_until(emu.link_deadline(kind, size, group, issued, token))
            emu.mark()
            return work
        finally:
            _state.active = False

    wrapper.__hetbench_wrapped__ = True
    return wrapper


def install_wrappers(emu) -> None:
    """Wrap the collectives once per process; each later case's emulator takes over the
    wrappers (a process may run several cases: bench.dilation, tests)."""
    _installed[:] = [emu]
    for name, (kind, sized_arg) in _COLLECTIVES.items():
        original = getattr(c10d, name, None)
        if original is None or getattr(original, "__hetbench_wrapped__", False):
            continue
        wrapped = _wrap(original, kind, sized_arg)
        setattr(c10d, name, wrapped)
        if getattr(dist, name, None) is original:
            setattr(dist, name, wrapped)
