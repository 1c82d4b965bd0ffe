"""Collectives of synthesized programs as autograd functions, for uneven and empty shards.

Every function takes the shard lengths of all ranks along the split dim (they sum to the full
length; zeros allowed) and runs the backward dual in backward: all-gather <-> reduce-scatter,
all-reduce and all-to-all are self-dual, a reshard's dual is the reverse reshard, replicate is identity forward / all-reduce backward.
gloo has no list-form all-gather of unequal tensors, which is why two all-gather (and two
reduce-scatter) implementations exist: `padded` pads every shard to the largest and runs one
collective; `grouped` runs one broadcast (or reduce) per rank with the exact shard.
Every function takes a `group`: the process group the shard lengths' ranks are (default: the
default group, all ranks; a pipeline stage's program runs over its stage's group).
torch.distributed is looked up at call time (`dist.<name>`), so wrappers installed on its
functions (bench.runtime.emulation) see every call. This module does not choose what to communicate.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist
import torch.nn.functional as F

from bench.runtime.compat import all_gather_single, reduce_scatter_single

IMPLS = ("padded", "grouped")


def _check(lengths: Sequence[int], impl: str | None = None, group=None) -> list[int]:
    lengths = [int(x) for x in lengths]
    world = dist.get_world_size(group)
    if len(lengths) != world or any(x < 0 for x in lengths):
        raise ValueError(f"shard lengths {lengths} must be {world} non-negative integers (one per rank)")
    if impl is not None and impl not in IMPLS:
        raise ValueError(f"collective impl={impl!r} is unknown; known: {', '.join(IMPLS)}")
    return lengths


def _padded(t: torch.Tensor, dim: int, width: int) -> torch.Tensor:
    """t padded with zeros along `dim` to `width`, contiguous, in t's own dim order (zeros, not
    garbage: the pad is sent). Never moved to a leading dim first: for an inner dim that is an
    element-by-element transpose, where a copy in place of dims keeps whole rows together
    (several times faster on a CPU worker; docs/hap-runtime.md, "Collectives")."""
    if t.shape[dim] == width:
        return t.contiguous()
    shape = list(t.shape)
    shape[dim] = width
    out = t.new_zeros(shape)
    out.narrow(dim, 0, t.shape[dim]).copy_(t)
    return out


def _stacked(pieces: Sequence[torch.Tensor], dim: int, width: int) -> torch.Tensor:
    """[len(pieces), *piece shape with `width` along dim]: each piece padded with zeros, one copy."""
    shape = list(pieces[0].shape)
    shape[dim] = width
    padded = any(p.shape[dim] != width for p in pieces)
    out = pieces[0].new_zeros([len(pieces)] + shape) if padded else pieces[0].new_empty([len(pieces)] + shape)
    for slot, p in zip(out, pieces):
        slot.narrow(dim, 0, p.shape[dim]).copy_(p)
    return out


def _unstacked(stack: torch.Tensor, dim: int, lengths: Sequence[int]) -> torch.Tensor:
    """The concatenation along `dim` of stack[i]'s first lengths[i] along dim (one copy)."""
    return torch.cat([slot.narrow(dim, 0, n) for slot, n in zip(stack, lengths)], dim=dim)


def _gather_impl(x: torch.Tensor, dim: int, lengths: list[int], impl: str, group=None) -> torch.Tensor:
    """The concatenation along `dim` of every rank's shard `x` (no autograd); `group`: the
    process group the ranks of `lengths` are (default: all ranks)."""
    rank = dist.get_rank(group)
    assert x.shape[dim] == lengths[rank], f"shard of length {x.shape[dim]} along dim {dim}, plan says {lengths[rank]}"
    if impl == "padded":
        width = max(lengths)
        if width == 0:
            return x.clone()
        part = _padded(x, dim, width)
        out = part.new_empty((len(lengths),) + tuple(part.shape))
        all_gather_single()(out.flatten(0, 1), part, group=group)  # gloo: shards one after another
        return _unstacked(out, dim, lengths)
    parts = []
    for src, n in enumerate(lengths):
        shape = list(x.shape)
        shape[dim] = n
        if n == 0:
            parts.append(x.new_empty(shape))
            continue
        buf = x.clone(memory_format=torch.contiguous_format) if src == rank else x.new_empty(shape)
        dist.broadcast(buf, group=group, group_src=src)
        parts.append(buf)
    return torch.cat(parts, dim=dim)


def _scatter_impl(x: torch.Tensor, dim: int, lengths: list[int], impl: str, group=None) -> torch.Tensor:
    """This rank's slice along `dim` of the sum over ranks of `x` (no autograd)."""
    rank = dist.get_rank(group)
    assert x.shape[dim] == sum(lengths), f"length {x.shape[dim]} along dim {dim}, shards sum to {sum(lengths)}"
    pieces = torch.split(x, lengths, dim=dim)
    if impl == "padded":
        width = max(lengths)
        if width == 0:
            return x.clone()
        send = _stacked(pieces, dim, width)
        out = send.new_empty(tuple(send.shape[1:]))
        reduce_scatter_single()(out, send.flatten(0, 1), group=group)
        return out.narrow(dim, 0, lengths[rank]).contiguous()
    mine = pieces[rank].new_empty(pieces[rank].shape)
    for dst, piece in enumerate(pieces):
        if lengths[dst] == 0:
            continue
        buf = piece.clone(memory_format=torch.contiguous_format)  # reduce overwrites its buffer (also off the root)
        dist.reduce(buf, group=group, group_dst=dst)
        if dst == rank:
            mine = buf
    return mine


def _all_reduce_impl(x: torch.Tensor, group=None) -> torch.Tensor:
    out = x.contiguous().clone()  # never the caller's tensor: all_reduce works in place
    dist.all_reduce(out, group=group)
    return out


def _all_to_all_impl(
    x: torch.Tensor, src_dim: int, src_lengths: list[int], dst_dim: int, dst_lengths: list[int], group=None
) -> torch.Tensor:
    """From shards along src_dim to shards along dst_dim, one all_to_all_single of flat pieces."""
    rank = dist.get_rank(group)
    assert x.shape[src_dim] == src_lengths[rank] and x.shape[dst_dim] == sum(dst_lengths)
    send = [p.contiguous().reshape(-1) for p in torch.split(x, dst_lengths, dim=dst_dim)]
    shapes = []
    for n in src_lengths:
        shape = list(x.shape)
        shape[src_dim] = n
        shape[dst_dim] = dst_lengths[rank]
        shapes.append(shape)
    recv_sizes = [int(torch.Size(s).numel()) for s in shapes]
    out = x.new_empty(sum(recv_sizes))
    dist.all_to_all_single(
        out, torch.cat(send) if send else x.new_empty(0), recv_sizes, [p.numel() for p in send], group=group
    )
    parts = [flat.view(shape) for flat, shape in zip(torch.split(out, recv_sizes), shapes)]
    return torch.cat(parts, dim=src_dim)


def _reshard_impl(
    x: torch.Tensor, dim: int, src_lengths: list[int], dst_lengths: list[int], group=None
) -> torch.Tensor:
    """This rank's shard along `dim` under `dst_lengths`, from shards laid out by `src_lengths`:
    each rank keeps the overlap of its old and new interval and swaps the rest in one
    all_to_all_single. Equal layouts return x unchanged (no call)."""
    if src_lengths == dst_lengths:
        return x
    rank = dist.get_rank(group)
    assert x.shape[dim] == src_lengths[rank]
    src_off = [sum(src_lengths[:i]) for i in range(len(src_lengths) + 1)]
    dst_off = [sum(dst_lengths[:i]) for i in range(len(dst_lengths) + 1)]

    def overlap(a: int, b: int) -> tuple[int, int]:  # of rank a's old and rank b's new interval
        lo, hi = max(src_off[a], dst_off[b]), min(src_off[a + 1], dst_off[b + 1])
        return lo, max(lo, hi)

    send = []
    for j in range(len(dst_lengths)):
        lo, hi = overlap(rank, j)
        send.append(x.narrow(dim, lo - src_off[rank] if hi > lo else 0, hi - lo).reshape(-1))
    shapes = []
    for i in range(len(src_lengths)):
        lo, hi = overlap(i, rank)
        shapes.append(x.shape[:dim] + (hi - lo,) + x.shape[dim + 1 :])
    recv_sizes = [int(s.numel()) for s in shapes]
    out = x.new_empty(sum(recv_sizes))
    dist.all_to_all_single(out, torch.cat(send), recv_sizes, [p.numel() for p in send], group=group)
    return torch.cat([flat.view(s) for flat, s in zip(torch.split(out, recv_sizes), shapes)], dim=dim)


class _AllGather(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, dim, lengths, impl, group):
        ctx.args = (dim, lengths, impl, group)
        return _gather_impl(x, dim, lengths, impl, group)

    @staticmethod
    def backward(ctx, grad):
        dim, lengths, impl, group = ctx.args
        return _scatter_impl(grad, dim, lengths, impl, group), None, None, None, None


class _ReduceScatter(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, dim, lengths, impl, group):
        ctx.args = (dim, lengths, impl, group)
        return _scatter_impl(x, dim, lengths, impl, group)

    @staticmethod
    def backward(ctx, grad):
        dim, lengths, impl, group = ctx.args
        return _gather_impl(grad, dim, lengths, impl, group), None, None, None, None


class _AllReduce(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return _all_reduce_impl(x, group)

    @staticmethod
    def backward(ctx, grad):
        return _all_reduce_impl(grad, ctx.group), None


class _Replicate(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, keep, group):
        ctx.keep, ctx.group = keep, group
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        total = _all_reduce_impl(grad, ctx.group)
        return (total if ctx.keep else total * 0), None, None


class _AllToAll(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, src_dim, src_lengths, dst_dim, dst_lengths, group):
        ctx.args = (src_dim, src_lengths, dst_dim, dst_lengths, group)
        return _all_to_all_impl(x, src_dim, src_lengths, dst_dim, dst_lengths, group)

    @staticmethod
    def backward(ctx, grad):
        src_dim, src_lengths, dst_dim, dst_lengths, group = ctx.args
        return _all_to_all_impl(grad, dst_dim, dst_lengths, src_dim, src_lengths, group), None, None, None, None, None


class _Reshard(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, dim, src_lengths, dst_lengths, group):
        ctx.args = (dim, src_lengths, dst_lengths, group)
        return _reshard_impl(x, dim, src_lengths, dst_lengths, group)

    @staticmethod
    def backward(ctx, grad):
        dim, src_lengths, dst_lengths, group = ctx.args
        return _reshard_impl(grad.contiguous(), dim, dst_lengths, src_lengths, group), None, None, None, None


class _SfbLinear(torch.autograd.Function):
    """y = x W^T + b on a batch shard x; backward all-gathers x and dy (the sufficient factors)
    and computes the full dW and db on every rank, instead of all-reducing them."""

    @staticmethod
    def forward(ctx, x, weight, bias, dim, lengths, impl, gathers, group):
        ctx.save_for_backward(x, weight)
        ctx.args = (dim, lengths, impl, bias is not None, gathers, group)
        return F.linear(x, weight, bias)

    @staticmethod
    def backward(ctx, grad):
        x, weight = ctx.saved_tensors
        dim, lengths, impl, has_bias, gathers, group = ctx.args
        grad = grad.contiguous()
        dx = grad.matmul(weight) if ctx.needs_input_grad[0] else None
        if gathers is None:
            full_x = _gather_impl(x.contiguous(), dim, lengths, impl, group)
            full_dy = _gather_impl(grad, dim, lengths, impl, group)
        else:
            full_x, full_dy = gathers[0](x), gathers[1](grad)
        full_x, full_dy = full_x.reshape(-1, x.shape[-1]), full_dy.reshape(-1, grad.shape[-1])
        dw = full_dy.t().matmul(full_x)
        db = full_dy.sum(0) if has_bias else None
        return dx, dw, db, None, None, None, None, None


# Plain functions (not Function.apply) so generated code and tracebacks name them.


def all_gather(x: torch.Tensor, dim: int, lengths: Sequence[int], impl: str = "padded", group=None) -> torch.Tensor:
    """Gather(dim) -> Identity. Backward: reduce-scatter of the gradient (same impl)."""
    return _AllGather.apply(x, dim % max(x.dim(), 1), _check(lengths, impl, group), impl, group)


def reduce_scatter(x: torch.Tensor, dim: int, lengths: Sequence[int], impl: str = "padded", group=None) -> torch.Tensor:
    """Reduce -> Gather(dim): this rank's slice of the sum. Backward: all-gather (same impl)."""
    return _ReduceScatter.apply(x, dim % max(x.dim(), 1), _check(lengths, impl, group), impl, group)


def all_reduce(x: torch.Tensor, group=None) -> torch.Tensor:
    """Reduce -> Identity, on a copy (the input is never modified). Backward: all-reduce."""
    return _AllReduce.apply(x, group)


def replicate(x: torch.Tensor, keep: bool = True, group=None) -> torch.Tensor:
    """Identity forward; backward all-reduces the gradient (a replicated parameter's use).
    keep=False: this rank's gradient is zero after the all-reduce (a machine's GPUs other than
    its leader, whose gradients are then summed inside the machine)."""
    return _Replicate.apply(x, keep, group)


def all_to_all(
    x: torch.Tensor,
    src_dim: int,
    src_lengths: Sequence[int],
    dst_dim: int,
    dst_lengths: Sequence[int],
    group=None,
) -> torch.Tensor:
    """Gather(src_dim) -> Gather(dst_dim) with uneven shards. Backward: the reverse all-to-all."""
    nd = max(x.dim(), 1)
    if src_dim % nd == dst_dim % nd:
        raise ValueError(f"all_to_all from dim {src_dim} to the same dim: nothing to exchange")
    src, dst = _check(src_lengths, group=group), _check(dst_lengths, group=group)
    return _AllToAll.apply(x, src_dim % nd, src, dst_dim % nd, dst, group)


def reshard(
    x: torch.Tensor, dim: int, src_lengths: Sequence[int], dst_lengths: Sequence[int], group=None
) -> torch.Tensor:
    """Gather(dim) shards laid out by `src_lengths` -> the same tensor's shards by `dst_lengths`
    (a segment border, methods.hap.search). Backward: the reverse reshard."""
    src, dst = _check(src_lengths, group=group), _check(dst_lengths, group=group)
    if sum(src) != sum(dst):
        raise ValueError(f"reshard between layouts of different lengths: {src} and {dst}")
    return _Reshard.apply(x, dim % max(x.dim(), 1), src, dst, group)


def sfb_linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    dim: int,
    lengths: Sequence[int],
    impl: str = "padded",
    gathers=None,
    group=None,
) -> torch.Tensor:
    """linear(x, weight, bias) on x sharded along `dim` (not the last) with the full weight;
    the weight and bias gradients come out complete on every rank (no all-reduce needed).
    `gathers`: (for x, for dy) functions returning the whole factor, or this rank's part of it
    (cut alike for both: the weight gradient is then this rank's part of the sum, as
    methods.hap.hierarchy.sfb_factor does among machines)."""
    if dim % x.dim() == x.dim() - 1:
        raise ValueError("sfb_linear: x must be sharded along a batch-like dim, not the features")
    if gathers is None:
        lengths = _check(lengths, impl, group)
    return _SfbLinear.apply(x, weight, bias, dim % x.dim(), list(lengths), impl, gathers, group)


def keep_first(x: torch.Tensor, group=None) -> torch.Tensor:
    """Identity -> Reduce without communication: rank 0 (of `group`) keeps x, the others hold zeros."""
    return x if dist.get_rank(group) == 0 else x * 0


def shard(x: torch.Tensor, dim: int, lengths: Sequence[int], rank: int | None = None, group=None) -> torch.Tensor:
    """Identity -> Gather(dim) without communication: this rank's slice (backward pads zeros);
    `rank` defaults to this process's rank in `group`."""
    rank = dist.get_rank(group) if rank is None else rank
    start = sum(lengths[:rank])
    return x.narrow(dim, start, lengths[rank])
