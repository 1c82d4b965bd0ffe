"""Emulated point-to-point transfers: what a pipeline's activations take on the declared links.

bench.runtime.emulation paces compute between communication points and makes collectives last their
emulated link time; this does the same for torch.distributed's `isend` and `irecv` (what
`batch_isend_irecv` and torch.distributed.pipelining call). A send ends the sender's compute
interval and occupies its link, queued on the same per-link clock as its collectives, for
the alpha-beta time of the link the two ranks span (bench.cost.pipeline.transfer_s prices the
same time), counted from when the sender posted it or the link freed; its wait returns no
sooner. A receive ends the receiver's interval; its wait returns no sooner than the transfer
the sender started arrived. The sender notes when its k-th transfer to each peer started on a
board in shared memory, which the receiver reads for its k-th transfer from that peer (the
ranks of one host share one clock, as for collectives). Without the board's entry (a peer on
another host) a receive's time counts from its completion.

Nothing here runs while the emulator is paused or disabled, and links are paced only where
the emulator paces its collectives (not while it measures its reference iterations). One thing
runs paused or not: on gloo a tensor on a GPU (ranks sharing one under MPS) is sent from a host copy and
received into a host buffer copied to it on wait, since gloo's point-to-point calls hand the
transport the tensor's memory as it is.
It queues on the emulator's link clock and adds to its counters (Emulator.reserve_link,
Emulator.p2p_delivered), as the emulator's own collective wrappers do.
"""

from __future__ import annotations

import functools
import os
import threading
import time
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
import torch.distributed.distributed_c10d as c10d

from bench.cost.links import collective_time_s

SLOTS = 256
TRANSFERRED_AS_IS = ("cpu", "meta")  # devices whose tensors gloo's isend and irecv take as they are
_state = threading.local()
_current: list = []  # [emulator, board] of the case running in this process


class P2PBoard:
    """When the k-th transfer from each rank to each other started: (k, perf_counter) cells in
    a file in shared memory that every rank of the run maps."""

    def __init__(self, table: np.ndarray, path: Path):
        self.table, self.path = table, path
        self.sent: dict[int, int] = {}
        self.received: dict[int, int] = {}

    @classmethod
    def open(cls, world_size: int) -> P2PBoard:
        from bench.runtime.emulation import ArrivalBoard

        base = os.environ.get(ArrivalBoard.ENV) or str(
            ArrivalBoard.path(os.getppid(), os.environ.get("MASTER_PORT", "0"))
        )
        path = Path(base + "-p2p")
        shape = (world_size, world_size, SLOTS, 2)
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
        try:
            size = int(np.prod(shape)) * 8
            if os.fstat(fd).st_size < size:
                os.ftruncate(fd, size)
        finally:
            os.close(fd)
        return cls(np.memmap(path, dtype=np.float64, mode="r+", shape=shape), path)

    def post(self, src: int, dst: int, start: float) -> None:
        k = self.sent[dst] = self.sent.get(dst, 0) + 1
        cell = self.table[src, dst, k % SLOTS]
        cell[1] = start
        cell[0] = k  # last: a reader that sees k sees its time

    def next_from(self, src: int) -> int:
        k = self.received[src] = self.received.get(src, 0) + 1
        return k

    def start_of(self, src: int, dst: int, k: int) -> float | None:
        cell = self.table[src, dst, k % SLOTS]
        if cell[0] != k:
            return None
        t = float(cell[1])
        return t if cell[0] == k else None


def install_p2p(emulator) -> None:
    """Emulate this process's point-to-point transfers with `emulator` (every rank of the case
    calls it at the same point: it maps the board, then waits for its peers)."""
    if not emulator.enabled or dist.get_world_size() < 2:
        return
    board = P2PBoard.open(dist.get_world_size())
    dist.barrier()  # every rank has mapped the board: its file can go
    board.path.unlink(missing_ok=True)
    _current[:] = [emulator, board]
    for name, wrap in (("isend", _wrap_send), ("irecv", _wrap_recv)):
        original = getattr(c10d, name)
        if getattr(original, "__hetbench_p2p__", False):
            continue
        wrapped = wrap(original)
        wrapped.__hetbench_p2p__ = True
        setattr(c10d, name, wrapped)
        if getattr(dist, name, None) is original:
            setattr(dist, name, wrapped)


def _active():
    if not _current or getattr(_state, "active", False):
        return None
    emu = _current[0]
    return None if emu._paused or not emu.enabled else emu


def _global(group, rank, group_rank) -> int:
    return rank if rank is not None else dist.get_global_rank(group, group_rank)


def _emulated_s(emu, nbytes: int, src: int, dst: int) -> float:
    """Wall seconds of the emulated link between two ranks for `nbytes` (0 while the emulator
    measures its reference: links run at loopback speed then)."""
    if not emu._links_emulated:
        return 0.0
    link = emu.cluster.link_between([src, dst])
    return collective_time_s("broadcast", nbytes, 2, link) * emu.wall_per_emulated_s


def _wrap_send(original):
    @functools.wraps(original)
    def isend(tensor, dst=None, group=None, tag=0, group_dst=None):
        emu = _active()
        if emu is None:
            return _posted(original, tensor, group, False, dst=dst, tag=tag, group_dst=group_dst)
        _state.active = True
        try:
            emu.stretch()  # the compute since the last communication point ends here
            emu.issued()
            peer = _global(group, dst, group_dst)
            board = _current[1]
            emulated = _emulated_s(emu, tensor.numel() * tensor.element_size(), emu.rank, peer)
            link = emu.cluster.link_between([emu.rank, peer])
            start = emu.reserve_link(link, emulated) if emulated else time.perf_counter()
            deadline = start + emulated
            board.post(emu.rank, peer, start)
            work = _posted(original, tensor, group, False, dst=dst, tag=tag, group_dst=group_dst)
            emu.mark()
            return _P2PWork(work, lambda done, waited_from: deadline, emu)
        finally:
            _state.active = False

    return isend


def _wrap_recv(original):
    @functools.wraps(original)
    def irecv(tensor, src=None, group=None, tag=0, group_src=None):
        emu = _active()
        if emu is None:
            return _posted(original, tensor, group, True, src=src, tag=tag, group_src=group_src)
        _state.active = True
        try:
            emu.stretch()
            peer = _global(group, src, group_src)
            board = _current[1]
            k = board.next_from(peer)
            nbytes = tensor.numel() * tensor.element_size()
            work = _posted(original, tensor, group, True, src=src, tag=tag, group_src=group_src)
            emu.mark()

            def deadline(done: float, waited_from: float) -> float:
                emulated = _emulated_s(emu, nbytes, peer, emu.rank)
                start = board.start_of(peer, emu.rank, k)
                if not emulated:
                    return done
                if start is None:  # no entry: count from the completion
                    return done + emulated
                arrival = start + emulated
                # past the link's delivery, and past the rank's own arrival at the wait
                emu.p2p_delivered(emulated, max(0.0, done - max(arrival, waited_from)))
                return arrival

            return _P2PWork(work, deadline, emu)
        finally:
            _state.active = False

    return irecv


def _posted(original, tensor, group, receive: bool, **peer):
    """`original` (gloo's isend or irecv, or another backend's) posted for `tensor`. gloo's
    point-to-point calls hand the tensor's memory to the transport as it is (its collectives
    copy a CUDA tensor through the host themselves), so a rank on a GPU under MPS sends a host
    copy and receives into a host buffer that is copied to its device on wait; a tensor on the
    CPU (or meta), or on another backend, is posted itself."""
    if tensor.device.type in TRANSFERRED_AS_IS or dist.get_backend(group) != dist.Backend.GLOO:
        return original(tensor, group=group, **peer)
    if not receive:
        host = tensor.detach().to("cpu")
        return _Staged(original(host, group=group, **peer), host)
    host = torch.empty(tensor.shape, dtype=tensor.dtype)
    return _Staged(original(host, group=group, **peer), host, lambda: tensor.copy_(host))


class _Staged:
    """A posted transfer that keeps its host copy alive, and copies a received host buffer into
    the device tensor once the transfer is through."""

    def __init__(self, work, host, arrived=None):
        self._work, self._host, self._arrived = work, host, arrived

    def wait(self, *args, **kwargs):
        out = self._work.wait(*args, **kwargs)
        if self._arrived is not None:
            self._arrived()
            self._arrived = None
        return out

    def is_completed(self):
        return self._work.is_completed()

    def __getattr__(self, name):
        return getattr(self._work, name)


class _P2PWork:
    """A posted transfer whose wait returns no sooner than its emulated link delivers it. The
    wait is communication: the compute before it ends there, a new interval starts after."""

    def __init__(self, work, deadline, emu):
        self._work, self._deadline, self._emu = work, deadline, emu

    def wait(self, *args, **kwargs):
        emu = self._emu
        own = emu._last_cpu[0] == threading.get_ident() and not emu._paused
        if own:
            emu.stretch()
        waited_from = time.perf_counter()
        out = self._work.wait(*args, **kwargs)
        done = time.perf_counter()
        until = self._deadline(done, waited_from)
        remaining = until - time.perf_counter()
        if remaining > 0:
            time.sleep(remaining)
        if own:
            emu.absorb_debt(waited_from, until)
            emu.mark()
        return out

    def is_completed(self):
        return self._work.is_completed()

    def __getattr__(self, name):
        return getattr(self._work, name)
