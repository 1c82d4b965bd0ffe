"""Emulated heterogeneity on one host: slow devices sleep, links take their declared time.

Compute: a rank of relative speed s stretches each stretch of compute between communication
points by sleeping (1/s - 1) x its duration, so slow ranks do not take cores from fast ones.
Links: every torch.distributed collective takes at least the alpha-beta time of the emulated link
(bench.cost); back-to-back collectives queue on one link clock. Real GPUs run with emulation off.
"""

from __future__ import annotations

import functools
import inspect
import threading
import time

import torch
import torch.distributed as dist
import torch.distributed.distributed_c10d as c10d

from bench.cluster import ClusterSpec
from bench.cost import collective_time_s


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
        self._lock = threading.Lock()
        self.slept_s = 0.0  # total compute-dilation sleep, for reports and tests
        self._overslept = 0.0

    # -- compute ---------------------------------------------------------------------------
    def mark(self) -> None:
        """Start a new compute interval now (after waiting on communication or data)."""
        self._last = time.perf_counter()

    def stretch(self) -> None:
        """End the current compute interval: sleep so it lasts `dilation` times as long.

        time.sleep overshoots (timer slack, scheduling); the overshoot is owed back by the next
        sleep, so the dilation holds over an iteration rather than drifting up.
        """
        now = time.perf_counter()
        if self.enabled and self.dilation != 1.0:
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
    def reserve_link(self, kind: str, nbytes: int, group) -> float:
        """Book the emulated link for one collective; returns the time it may complete at."""
        ranks = dist.get_process_group_ranks(group) if group is not None else range(
            dist.get_world_size()
        )
        ranks = list(ranks)
        duration = collective_time_s(kind, nbytes, len(ranks), self.cluster.link_between(ranks))
        with self._lock:
            start = max(time.perf_counter(), self._link_free_at)
            self._link_free_at = start + duration
            return self._link_free_at

    def install(self) -> None:
        """Wrap torch.distributed's collectives; call before a method sets up (DeepSpeed keeps
        references to them at initialize)."""
        if self.enabled:
            _install_wrappers(self)


def _sleep_until(deadline: float) -> None:
    remaining = deadline - time.perf_counter()
    if remaining > 0:
        time.sleep(remaining)


class _DelayedWork:
    """An async collective handle that completes no earlier than the emulated link allows."""

    def __init__(self, work, deadline: float):
        self._work = work
        self._deadline = deadline

    def wait(self, *args, **kwargs):
        out = self._work.wait(*args, **kwargs)
        _sleep_until(self._deadline)
        return out

    def is_completed(self):
        return self._work.is_completed() and time.perf_counter() >= self._deadline

    def get_future(self):
        deadline = self._deadline

        def delay(fut):
            _sleep_until(deadline)
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
            deadline = emu.reserve_link(kind, _nbytes(bound[sized_arg]), bound.get("group"))
            work = fn(*args, **kwargs)
            if bound.get("async_op"):
                return _DelayedWork(work, deadline)
            _sleep_until(deadline)
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
