"""methods.hap.collectives on 2 and 3 gloo processes with uneven and empty shards: forward and
backward of every collective equal a single-process float64 reference."""

from __future__ import annotations

import os
import traceback

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

from bench.runtime.launch import forking_context
from methods.hap import collectives as C
from tests.forked_ranks import free_port

LENGTHS = {2: [3, 2], 3: [3, 0, 2]}


def _shard(t: torch.Tensor, dim: int, lengths, rank: int) -> torch.Tensor:
    return t.narrow(dim, sum(lengths[:rank]), lengths[rank])


def _close(a, b, what):
    assert a.shape == b.shape, f"{what}: shape {tuple(a.shape)} != {tuple(b.shape)}"
    assert torch.allclose(a, b, rtol=1e-12, atol=1e-12), f"{what}: max err {(a - b).abs().max().item()}"


class _TransposedCopies(TorchFunctionMode):
    """Records every call that copies a transposed tensor: of the source's dims longer than 1,
    the last has a stride above 1 and an earlier one has stride 1 (a strided slice, or a
    broadcast with stride 0, is no transpose). A function mode, not a dispatch mode: it sees
    the collectives' own torch calls and leaves c10d's ops alone."""

    SOURCES = {
        torch.Tensor.contiguous: lambda a: a[:1],
        torch.Tensor.clone: lambda a: a[:1],
        torch.Tensor.reshape: lambda a: a[:1],
        torch.Tensor.copy_: lambda a: a[1:2],
        torch.cat: lambda a: a[0],
    }

    def __init__(self):
        super().__init__()
        self.found: list[tuple] = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        for t in self.SOURCES.get(func, lambda a: ())(args):
            dims = [st for size, st in zip(t.shape, t.stride()) if size > 1]
            if dims and dims[-1] > 1 and 1 in dims[:-1]:
                self.found.append((func.__name__, tuple(t.shape), t.stride()))
        return func(*args, **(kwargs or {}))


def _checks(rank: int, n: int) -> None:
    lengths = LENGTHS[n]
    total = sum(lengths)
    gen = torch.Generator().manual_seed(7)
    f64 = dict(dtype=torch.float64)

    def rand(*shape):
        return torch.randn(*shape, generator=gen, **f64)

    # The same random full tensors on every rank; per-rank pieces are taken from them.
    for dim in (0, 1, 2):  # leading, middle and last: each is gathered without moving dims
        shape = [4, 3, 2]
        shape[dim] = total
        for impl in C.IMPLS:
            # all_gather: out Identity; grads g_r on each rank (partial), dx = slice of sum g.
            full = rand(*shape)
            grads = [rand(*shape) for _ in range(n)]
            x = _shard(full, dim, lengths, rank).clone().requires_grad_()
            y = C.all_gather(x, dim, lengths, impl)
            _close(y, full, f"all_gather {impl} dim {dim} forward")
            y.backward(grads[rank])
            _close(x.grad, _shard(sum(grads), dim, lengths, rank), f"all_gather {impl} backward")

            # reduce_scatter: partials p_r, out slice of sum; grad shards g_r -> dx = cat(g).
            partials = [rand(*shape) for _ in range(n)]
            gfull = rand(*shape)
            x = partials[rank].clone().requires_grad_()
            y = C.reduce_scatter(x, dim, lengths, impl)
            _close(y, _shard(sum(partials), dim, lengths, rank), f"reduce_scatter {impl} dim {dim} forward")
            y.backward(_shard(gfull, dim, lengths, rank))
            _close(x.grad, gfull, f"reduce_scatter {impl} backward")

    # all_reduce never touches its input; backward sums the gradients.
    partials = [rand(3, 2) for _ in range(n)]
    grads = [rand(3, 2) for _ in range(n)]
    x = partials[rank].clone().requires_grad_()
    before = x.detach().clone()
    y = C.all_reduce(x)
    _close(x.detach(), before, "all_reduce input untouched")
    _close(y, sum(partials), "all_reduce forward")
    y.backward(grads[rank])
    _close(x.grad, sum(grads), "all_reduce backward")

    # replicate: identity forward, all-reduce backward.
    w = rand(2, 3)
    x = w.clone().requires_grad_()
    y = C.replicate(x)
    _close(y, w, "replicate forward")
    (y * grads[rank].t()).sum().backward()
    _close(x.grad, sum(grads).t(), "replicate backward")

    # all_to_all between two dims with different uneven splits of each.
    other = [1, 3] if n == 2 else [2, 2, 0]
    full = rand(total, 4, sum(other))
    gfull = rand(total, 4, sum(other))
    for (sd, sl), (dd, dl) in [((0, lengths), (2, other)), ((2, other), (0, lengths))]:
        x = _shard(full, sd, sl, rank).clone().requires_grad_()
        y = C.all_to_all(x, sd, sl, dd, dl)
        _close(y, _shard(full, dd, dl, rank), f"all_to_all {sd}->{dd} forward")
        y.backward(_shard(gfull, dd, dl, rank))
        _close(x.grad, _shard(gfull, sd, sl, rank), f"all_to_all {sd}->{dd} backward")

    # Along the last dim, shards are padded, stacked and cut where they lie: no copy reads a
    # tensor across its innermost dim (an element-by-element transpose, on a CPU worker 20x the
    # time of a plain copy of the same bytes: the logits of methods.hap.tensor_parallel).
    for impl in C.IMPLS:
        shape = [2, 3, total]
        full, g = rand(*shape), rand(*shape)
        x = _shard(full, 2, lengths, rank).clone().requires_grad_()
        p = full.clone().requires_grad_()
        with _TransposedCopies() as seen:
            C.all_gather(x, 2, lengths, impl).backward(g)
            C.reduce_scatter(p, 2, lengths, impl).backward(_shard(g, 2, lengths, rank))
            C.reshard(x.detach(), 2, lengths, lengths[::-1])
        assert not seen.found, f"{impl}: copies across the innermost dim: {seen.found}"

    # reshard: the same dim split by two rows (a segment border), both ways, and to itself.
    moved = {2: [([3, 2], [1, 4]), ([3, 2], [5, 0])], 3: [([3, 0, 2], [0, 4, 1]), ([3, 0, 2], [1, 1, 3])]}[n]
    for dim in (0, 1, 2):
        shape = [4, 3, 2]
        shape[dim] = total
        full, gfull = rand(*shape), rand(*shape)
        for src, dst in moved + [(d, s) for s, d in moved] + [(lengths, lengths)]:
            x = _shard(full, dim, src, rank).clone().requires_grad_()
            y = C.reshard(x, dim, src, dst)
            _close(y, _shard(full, dim, dst, rank), f"reshard {src}->{dst} dim {dim} forward")
            y.backward(_shard(gfull, dim, dst, rank))
            _close(x.grad, _shard(gfull, dim, src, rank), f"reshard {src}->{dst} dim {dim} backward")

    # SFB linear: x sharded along a batch-like dim, weight replicated; the weight gradient
    # comes out whole on every rank, equal to the single-device gradient.
    for dim in (0, 1):
        shape = [total, 4, 5] if dim == 0 else [2, total, 5]
        X, W, b = rand(*shape), rand(6, 5), rand(6)
        G = rand(*shape[:-1], 6)
        Xr, Wr, br = (t.clone().requires_grad_() for t in (X, W, b))
        (F.linear(Xr, Wr, br) * G).sum().backward()
        for impl in C.IMPLS:
            x = _shard(X, dim, lengths, rank).clone().requires_grad_()
            w, bb = W.clone().requires_grad_(), b.clone().requires_grad_()
            y = C.sfb_linear(x, w, bb, dim, lengths, impl)
            _close(y, _shard(F.linear(X, W, b), dim, lengths, rank), f"sfb {impl} forward")
            (y * _shard(G, dim, lengths, rank)).sum().backward()
            _close(x.grad, _shard(Xr.grad, dim, lengths, rank), f"sfb {impl} dx")
            _close(w.grad, Wr.grad, f"sfb {impl} dW")
            _close(bb.grad, br.grad, f"sfb {impl} db")

    # keep_first and shard need no communication.
    x = rand(3).requires_grad_()
    y = C.keep_first(x)
    _close(y, x.detach() if rank == 0 else torch.zeros(3, **f64), "keep_first")
    y.sum().backward()
    _close(x.grad, torch.full((3,), 1.0 if rank == 0 else 0.0, **f64), "keep_first backward")


def _entry(rank: int, n: int, port: int, errors) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=n)
    try:
        _checks(rank, n)
    except BaseException:
        errors.put((rank, traceback.format_exc()))
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("n", [2, 3])
def test_collectives_forward_and_backward_match_single_process_with_uneven_and_empty_shards(n):
    errors = forking_context().Queue()
    mp.start_processes(_entry, args=(n, free_port(), errors), nprocs=n, join=True, start_method="forkserver")
    found = []
    while not errors.empty():
        found.append(errors.get())
    assert not found, "\n".join(f"rank {r}:\n{tb}" for r, tb in found)


def test_collective_names_of_older_torch_are_used_where_the_new_ones_are_missing(monkeypatch):
    # torch 2.11 (the GPU host's) has no all_gather_single: bench.profile died on it there.
    import torch.distributed as dist

    from bench.runtime import compat

    for name in ("all_gather_single", "reduce_scatter_single"):
        monkeypatch.delattr(dist, name, raising=False)
    assert compat.all_gather_single() is dist.all_gather_into_tensor
    assert compat.reduce_scatter_single() is dist.reduce_scatter_tensor
