"""Emulated heterogeneity on one host: slow devices sleep, links take their declared time.

Compute: a rank of relative speed s stretches each stretch of compute between communication
points by sleeping (1/s - 1) x its duration, so slow ranks do not take cores from fast ones.
Links: every torch.distributed collective takes at least the alpha-beta time of the emulated link
(bench.cost); back-to-back collectives queue on one link clock. Real GPUs run with emulation off.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import threading
import time

import torch
import torch.distributed as dist
import torch.distributed.distributed_c10d as c10d

from bench.cluster import ClusterSpec
from bench.cost import collective_time_s, link_bytes


class Emulator:
    """Per-rank time dilation and link emulation. A disabled one does nothing, cheaply."""

    def __init__(self, cluster: ClusterSpec, rank: int, enabled: bool):
        self.enabled = enabled
        self.cluster = cluster
        self.rank = rank
        speed = cluster.devices[rank].speed if enabled else 1.0
        self.dilation = 1.0 / speed  # wall time per unit of real compute
        self._last = time.perf_counter()
        self._link_free_at = 0.0
        self._loopback = (0.0, float("inf"))  # real collective cost here, measured at install
        self._lock = threading.Lock()
        self.slept_s = 0.0  # total compute-dilation sleep, for reports and tests
        self._overslept = 0.0
        self._paused = False

    # -- compute ---------------------------------------------------------------------------
    @contextlib.contextmanager
    def paused(self):
        """Neither compute nor links are emulated inside (set-up: not measured, not training)."""
        self._paused = True
        try:
            yield
        finally:
            self._paused = False
            self.mark()

    def mark(self) -> None:
        """Start a new compute interval now (after waiting on communication or data)."""
        self._last = time.perf_counter()

    def stretch(self) -> None:
        """End the current compute interval: sleep so it lasts `dilation` times as long.

        time.sleep overshoots (timer slack, scheduling); the overshoot is owed back by the next
        sleep, so the dilation holds over an iteration rather than drifting up.
        """
        now = time.perf_counter()
        if self.enabled and not self._paused and self.dilation != 1.0:
            target = (self.dilation - 1.0) * (now - self._last) - self._overslept
            if target > 0:
                time.sleep(target)
                after = time.perf_counter()
                self.slept_s += after - now
                self._overslept = (after - now) - target
                now = after
            else:
                self._overslept = -target
        self._last = now

    # -- links -----------------------------------------------------------------------------
    def link_deadline(self, kind: str, nbytes: int, group, issued: float) -> float:
        """When the emulated link delivers a collective whose real run just completed.

        Completion is the one moment every rank has arrived, so the emulated time counts from
        there (counting from a rank's own issue time would let an early rank leave before the
        transfer is done). The real loopback collective already took its own time; only the
        rest is owed. Collectives queue on one link clock per rank.
        """
        if not self.enabled or self._paused:
            return time.perf_counter()
        ranks = list(dist.get_process_group_ranks(group) if group is not None
                     else range(dist.get_world_size()))
        link = self.cluster.link_between(ranks)
        emulated = collective_time_s(kind, nbytes, len(ranks), link)
        alpha, bytes_per_s = self._loopback
        # A rank that arrived last saw the real cost exactly (issue to completion); the fitted
        # loopback model covers the others.
        real = min(alpha + link_bytes(kind, nbytes, len(ranks)) / bytes_per_s,
                   time.perf_counter() - issued)
        with self._lock:
            start = max(time.perf_counter(), self._link_free_at)
            self._link_free_at = start + max(0.0, emulated - real)
            return self._link_free_at

    def install(self) -> None:
        """Measure the real loopback collective, then wrap torch.distributed's collectives.

        Every rank calls it at the same point (it runs collectives). Call it before a method
        sets up: DeepSpeed keeps references to the collectives at initialize.
        """
        if self.enabled:
            self._loopback = _measure_loopback()
            _install_wrappers(self)


def _measure_loopback() -> tuple[float, float]:
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
    """An async collective handle that completes no earlier than the emulated link allows."""

    def __init__(self, work, deadline_at_completion):
        self._work = work
        self._deadline_at_completion = deadline_at_completion
        self._deadline = None

    def _delay(self) -> None:
        if self._deadline is None:
            self._deadline = self._deadline_at_completion()
        _sleep_until(self._deadline)

    def wait(self, *args, **kwargs):
        out = self._work.wait(*args, **kwargs)
        self._delay()
        return out

    def is_completed(self):
        return self._work.is_completed() and self._deadline is not None and (
            time.perf_counter() >= self._deadline)

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
}


def _nbytes(t) -> int:
    if isinstance(t, (list, tuple)):
        return sum(_nbytes(x) for x in t)
    return t.numel() * t.element_size()


_state = threading.local()  # reentrancy: old names call new ones inside c10d; count once


def _wrap(fn, kind, sized_arg, emu: Emulator):
    signature = inspect.signature(fn)

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        if getattr(_state, "active", False):
            return fn(*args, **kwargs)
        _state.active = True
        try:
            bound = signature.bind(*args, **kwargs).arguments
            emu.stretch()  # the compute since the last communication point ends here
            issued = time.perf_counter()
            work = fn(*args, **kwargs)
            size, group = _nbytes(bound[sized_arg]), bound.get("group")
            if bound.get("async_op"):
                return _DelayedWork(work, lambda: emu.link_deadline(kind, size, group, issued))
            _sleep_until(emu.link_deadline(kind, size, group, issued))
            emu.mark()
            return work
        finally:
            _state.active = False

    wrapper.__hetbench_wrapped__ = True
    return wrapper


def _install_wrappers(emu: Emulator) -> None:
    for name, (kind, sized_arg) in _COLLECTIVES.items():
        original = getattr(c10d, name, None)
        if original is None or getattr(original, "__hetbench_wrapped__", False):
            continue
        wrapped = _wrap(original, kind, sized_arg, emu)
        setattr(c10d, name, wrapped)
        if getattr(dist, name, None) is original:
            setattr(dist, name, wrapped)
