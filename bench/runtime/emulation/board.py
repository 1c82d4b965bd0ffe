"""The arrival board: when each rank of this host issued each collective, in a file in shared
memory that every rank maps, so that an emulated link's time counts from the last member's arrival.
It times nothing itself (link_clock.LinkClock reads it).
"""

from __future__ import annotations

import atexit
import os
import tempfile
import time
import zlib
from pathlib import Path

import numpy as np
import torch.distributed.distributed_c10d as c10d


class ArrivalBoard:
    """When each rank of this host issued its k-th collective on each process group, in a file
    in shared memory every rank of the run maps (perf_counter is one clock for all processes
    of a host). Ranks call collectives on a group in the same order, so (group, k) is the same
    collective on every member. A cell holds (k, issue time); a member whose cell holds another
    k (a rank on another host, or one SLOTS collectives ahead) makes the arrival unknown."""

    GROUPS, SLOTS = 64, 256
    ENV = "HETBENCH_ARRIVAL_BOARD"  # bench.runtime.launch names its workers' board here

    def __init__(self, table: np.ndarray, path: Path | None = None):
        self._table = table
        self._path = path
        self._count: dict[str, int] = {}

    def unlink(self) -> None:
        """Remove the board's file once every rank has mapped it (the mappings stay valid)."""
        if self._path is not None:
            self._path.unlink(missing_ok=True)

    @staticmethod
    def path(launcher_pid: int, port: int | str) -> Path:
        """The board of the ranks that process `launcher_pid` started with rendezvous `port`."""
        shm = Path("/dev/shm")
        folder = shm if shm.is_dir() and os.access(shm, os.W_OK) else Path(tempfile.gettempdir())
        return folder / f"hetbench-arrivals-{launcher_pid}-{port}"

    @classmethod
    def open(cls, world_size: int) -> ArrivalBoard:
        """The run's board, created by whichever rank comes first. Unlinked once every rank
        has mapped it (Emulator.install); before that, at a rank's exit and by the launcher once
        its workers are gone (bench.runtime.launch: a killed or forked worker runs no exit handler). A
        process that runs several cases keeps its board and its counts (bench.dilation, tests).
        bench.runtime.launch names the board (its forked workers' parent is a server, not the
        launcher); elsewhere the ranks' parent and MASTER_PORT do (torchrun)."""
        path = Path(os.environ.get(cls.ENV) or cls.path(os.getppid(), os.environ.get("MASTER_PORT", "0")))
        shape = (world_size, cls.GROUPS, cls.SLOTS, 2)
        if (path, shape) in _boards:
            return _boards[path, shape]
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
        try:
            size = int(np.prod(shape)) * 8
            if os.fstat(fd).st_size < size:
                os.ftruncate(fd, size)  # zeros: no collective is numbered 0
        finally:
            os.close(fd)
        board = _boards[path, shape] = cls(np.memmap(path, dtype=np.float64, mode="r+", shape=shape), path)
        atexit.register(path.unlink, missing_ok=True)
        return board

    @classmethod
    def _row(cls, name: str) -> int:
        # torch numbers process groups in creation order, the same on every rank
        return int(name) % cls.GROUPS if name.isdigit() else zlib.crc32(name.encode()) % cls.GROUPS

    def arrive(self, group, rank: int) -> tuple[int, int] | None:
        name = getattr(group if group is not None else c10d._get_default_group(), "group_name", None)
        if not name:
            return None
        k = self._count[name] = self._count.get(name, 0) + 1
        row = self._row(name)
        cell = self._table[rank, row, k % self.SLOTS]
        cell[1] = time.perf_counter()
        cell[0] = k  # last: a reader that sees k sees its time
        return row, k

    def last_arrival(self, token: tuple[int, int], ranks: list[int]) -> float | None:
        row, k = token
        latest = 0.0
        for r in ranks:
            cell = self._table[r, row, k % self.SLOTS]
            if cell[0] != k:
                return None
            t = float(cell[1])
            if cell[0] != k:  # overwritten while read
                return None
            latest = max(latest, t)
        return latest


_boards: dict[tuple[Path, tuple[int, ...]], ArrivalBoard] = {}
