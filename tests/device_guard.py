"""A test helper: every torch.distributed collective checked for the device of its tensors.

On a GPU a rank computes on its device and NCCL refuses a tensor that lives elsewhere; on this
project's CPU hosts every tensor lives on the CPU, so a method that makes a tensor on the CPU
(the default device) while its model lives on a GPU passes every CPU test. `collectives_on`
wraps each collective of torch.distributed: a tensor it receives that is not on the ranks'
device fails the call with one line naming the collective and the devices. With the meta
device as the ranks' device (a model built on meta, batches moved there), every collective
is then skipped after the check, so a method's set-up and step run through on shapes alone,
and any tensor it made without the model's device shows up as a CPU tensor. It checks
devices only; it neither times nor emulates links.
"""

from __future__ import annotations

import contextlib
import functools

import torch
import torch.distributed as dist
import torch.distributed.distributed_c10d as c10d

# The collectives and point-to-point calls the methods and the libraries they use make.
COLLECTIVES = (
    "all_reduce",
    "broadcast",
    "reduce",
    "all_gather",
    "all_gather_into_tensor",
    "all_gather_single",
    "reduce_scatter",
    "reduce_scatter_tensor",
    "reduce_scatter_single",
    "all_to_all",
    "all_to_all_single",
    "gather",
    "scatter",
    "send",
    "recv",
    "isend",
    "irecv",
    "batch_isend_irecv",
)
_ASYNC = ("isend", "irecv")


class DeviceMismatch(AssertionError):
    """A collective received a tensor on another device than the ranks compute on."""


class _Done:
    """A finished work handle (the skipped collectives' answer to async_op=True)."""

    def wait(self, *args, **kwargs) -> bool:
        return True

    def is_completed(self) -> bool:
        return True

    def get_future(self) -> torch.futures.Future:
        future = torch.futures.Future()
        future.set_result(None)
        return future


def _tensors(x):
    if isinstance(x, torch.Tensor):
        yield x
    elif isinstance(x, dist.P2POp):
        yield x.tensor
    elif isinstance(x, (list, tuple)):
        for v in x:
            yield from _tensors(v)
    elif isinstance(x, dict):
        for v in x.values():
            yield from _tensors(v)


@contextlib.contextmanager
def collectives_on(device: str | torch.device):
    """Within the block, every collective checks its tensors are on `device` (the module
    docstring); yields the list of the collectives' names as they are called. On the meta
    device the collectives are skipped after the check (no process group needs to exist)."""
    device = torch.device(device)
    calls: list[str] = []

    def wrap(name: str, original):
        @functools.wraps(original)
        def checked(*args, **kwargs):
            wrong = sorted({str(t.device) for t in _tensors((args, kwargs)) if t.device.type != device.type})
            if wrong:
                raise DeviceMismatch(
                    f"torch.distributed.{name} received a tensor on {', '.join(wrong)}, but the ranks compute on {device}"
                )
            calls.append(name)
            if device.type != "meta":
                return original(*args, **kwargs)
            if name == "batch_isend_irecv":
                return [_Done() for _ in args[0]]
            return _Done() if kwargs.get("async_op") or name in _ASYNC else None

        return checked

    saved = {(mod, n): getattr(mod, n) for n in COLLECTIVES for mod in (dist, c10d) if hasattr(mod, n)}
    wrapped = {n: wrap(n, getattr(c10d, n, None) or getattr(dist, n)) for n in {n for _, n in saved}}
    for mod, name in saved:
        setattr(mod, name, wrapped[name])
    try:
        yield calls
    finally:
        for (mod, name), original in saved.items():
            setattr(mod, name, original)
