"""Live tensor bytes on a CPU rank, counted op by op.

CUDA's allocator keeps the peak of the bytes its tensors hold (`torch.cuda.max_memory_allocated`),
the quantity the cost model predicts; the CPU allocator keeps none, and a process's RSS is mostly
the interpreter and its libraries (about 0.4 GiB for the tiny models' few MiB of tensors). So a
CPU rank counts for itself: while a `TensorBytes` mode is entered, every operator that runs on
this thread, from Python or from C++ (the autograd engine, DDP's reducer, DeepSpeed's set-up),
passes through it, and each CPU storage its outputs hold is counted once (views share their
base's) until the storage is freed, whether the mode is entered then or not. What runs on other
threads (gloo's own buffers) and what was allocated before the first entry are not counted.
A storage resized in place without an operator (FSDP2 frees a unit's gathered parameters by
resizing their storage to nothing, and allocates them again the same way) is counted at its
new size from then on: `UntypedStorage.resize_` tells every mode that counts it.

Not torch's own tools: the profiler's memory events give the same peak (40.285 MiB on one Adam
step of a 4 MiB-per-layer MLP, both ways) but its first start costs 1.8 s a process here, in
every worker of every case; torch.distributed._tools.MemTracker refuses a module's second
iteration, and a rank enters this count three times (build, set-up, the set-up iterations).
"""

from __future__ import annotations

import threading
import weakref

import torch
from torch.utils._python_dispatch import TorchDispatchMode, is_traceable_wrapper_subclass
from torch.utils._pytree import tree_leaves

_counting: weakref.WeakSet[TensorBytes] = weakref.WeakSet()  # modes whose storages a resize updates


def _track_resizes() -> None:
    """Wrap UntypedStorage.resize_ once: a resized storage that a mode counts is counted anew."""
    original = torch.UntypedStorage.resize_
    if getattr(original, "__hetbench_counted__", False):
        return

    def resize_(storage, size):
        out = original(storage, size)
        for mode in list(_counting):
            mode._resized(storage)
        return out

    resize_.__hetbench_counted__ = True
    torch.UntypedStorage.resize_ = resize_


class EmulatedOutOfMemory(MemoryError):
    """A CPU rank's live tensors passed its emulated device's memory (TensorBytes' limit)."""

    def __init__(self, message: str, peak_bytes: int):
        super().__init__(message)
        self.peak_gib = peak_bytes / 2**30


class TensorBytes(TorchDispatchMode):
    """`live`: bytes of the counted storages alive now; `peak`: the most since `reset_peak`.

    limit_bytes: the emulated device's memory; the op (or resize) whose storage takes `live`
    past it raises EmulatedOutOfMemory, as a GPU's allocator refuses (None: no limit).
    what: how the error names the device (its rank, type and where its memory is set)."""

    def __init__(self, limit_bytes: int | None = None, what: str = "this rank's device"):
        super().__init__()
        self.live = 0
        self.peak = 0
        self.limit_bytes, self.what = limit_bytes, what
        self.peak_total = 0  # the most over the whole count (reset_peak keeps it)
        self._held: dict[int, list] = {}  # storage key -> [finalizer, bytes counted]
        self._lock = threading.Lock()  # a storage may be freed on another thread
        _track_resizes()
        _counting.add(self)

    def _resized(self, storage: torch.UntypedStorage) -> None:
        with self._lock:
            held = self._held.get(storage._cdata)
            if held is not None and held[1] != storage.nbytes():
                self.live += storage.nbytes() - held[1]
                held[1] = storage.nbytes()
                self._new_peak()
        self._check()

    def _new_peak(self) -> None:
        self.peak = max(self.peak, self.live)
        self.peak_total = max(self.peak_total, self.live)

    def _check(self) -> None:
        if self.limit_bytes is not None and self.live > self.limit_bytes:
            raise EmulatedOutOfMemory(
                f"{self.what}: live tensors {self.live / 2**30:.3f} GiB pass its memory "
                f"{self.limit_bytes / 2**30:.3f} GiB (out of memory, as on a GPU): give the device "
                "more memory, or train a smaller batch, a smaller model or a method that shards",
                self.peak_total,
            )

    def reset_peak(self) -> None:
        self.peak = self.live

    def count(self, tensor: torch.Tensor) -> None:
        """Count a tensor made while no mode was entered (once per storage, as an op's output)."""
        if tensor.device.type == "cpu" and not tensor.is_meta and not is_traceable_wrapper_subclass(tensor):
            self._count(tensor.untyped_storage())

    def _freed(self, key: int) -> None:
        with self._lock:
            _, nbytes = self._held.pop(key)
            self.live -= nbytes

    def _count(self, storage: torch.UntypedStorage) -> None:
        key, nbytes = storage._cdata, storage.nbytes()
        with self._lock:
            held = self._held.get(key)
            if held is None:
                self._held[key] = [weakref.finalize(storage, self._freed, key), nbytes]
                self.live += nbytes
            elif held[1] != nbytes:  # resized in place
                self.live += nbytes - held[1]
                held[1] = nbytes
            self._new_peak()
        self._check()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for value in tree_leaves(out):
            # A wrapper subclass (FSDP2's DTensor parameters and gradients) holds no storage of
            # its own: its local tensors are counted where the ops that make them run.
            if (
                isinstance(value, torch.Tensor)
                and value.device.type == "cpu"
                and not value.is_meta
                and not is_traceable_wrapper_subclass(value)
            ):
                self._count(value.untyped_storage())
        return out
