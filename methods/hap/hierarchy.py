"""Machine-level plans as the cost model prices them: data parallel inside every machine, each
collective of the program in three steps (HAP Sec. 3; bench.cost.price.hierarchical_steps).

A machine-level plan shards tensors over machines. Inside a machine every GPU holds the
machine's shard of each parameter and its own part of the machine's samples: a tensor's local
block is the machine's shard cut once more along the tensor's batch dim (its *intra layout*,
chosen by methods.hap.codegen), evenly over the machine's GPUs in whole samples. A collective
of the program then runs as:

1. to the leader (the machine's first rank): the parts of the machine's tensor are gathered
   along the batch dim (a partial sum is reduced; a replicated tensor is already there);
2. among the leaders: the program's collective on machine-level shards (methods.hap.collectives
   with the leaders' process group);
3. back: the leader scatters the parts of the result (or broadcasts a replicated one).

All three are one autograd function, so every rank's backward graph has the same nodes in the
same order whatever its role, and backward runs the dual steps. Gradients are synchronised
inside the machine (all-reduce, during backward, as DDP) and, for parameters replicated over
machines, among the leaders and broadcast back (methods.hap.runtime.GradBuckets).
This module builds the process groups and runs the steps; it does not decide layouts.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist

from bench.core.shares import offsets, round_shares
from methods.hap import collectives as C
from methods.hap.theory import IDENTITY, REDUCE, Layout


@dataclass
class Machines:
    """This rank's place among machine-level virtual devices, and the hierarchy's groups.

    Attributes:
        ranks: the global ranks of every machine, machine by machine (the first is its leader).
        index: this rank's machine; local: its position inside the machine.
        intra: the process group of this rank's machine; leaders: the leaders' group (None off
            the leaders). The program's collectives use these, in program order.
        intra_sync, leaders_sync: the same members, for gradient synchronisation, whose steps
            start when earlier ones complete (a timing no other rank shares): their own groups
            keep each group's order the same on every member.
    """

    ranks: list[list[int]]
    index: int
    local: int
    intra: object = None
    intra_sync: object = None
    leaders: object = None
    leaders_sync: object = None

    @classmethod
    def build(cls, ranks: Sequence[Sequence[int]], rank: int) -> Machines:
        """Every rank calls this with the same `ranks` (it creates process groups collectively)."""
        ranks = [list(map(int, r)) for r in ranks]
        leaders = [r[0] for r in ranks]
        if leaders != sorted(leaders) or any(r != list(range(r[0], r[0] + len(r))) for r in ranks):
            raise ValueError(f"machine ranks {ranks}: each machine must hold consecutive ranks, in machine order")
        index = next(i for i, r in enumerate(ranks) if rank in r)
        out = cls(ranks, index, ranks[index].index(rank))
        for i, members in enumerate(ranks):  # every rank takes part in every new_group call
            intra, intra_sync = dist.new_group(members), dist.new_group(members)
            if i == index:
                out.intra, out.intra_sync = intra, intra_sync
        group, sync = dist.new_group(leaders), dist.new_group(leaders)
        if out.is_leader:
            out.leaders, out.leaders_sync = group, sync
        return out

    @property
    def count(self) -> int:
        return len(self.ranks)

    @property
    def size(self) -> int:
        """GPUs in this rank's machine."""
        return len(self.ranks[self.index])

    @property
    def is_leader(self) -> bool:
        return self.local == 0


def unsplittable_share(global_batch: int, machine_shares: Sequence[int], gpus: Sequence[int]) -> str | None:
    """Why machines with these batch shares and GPU counts cannot run data parallel inside (a
    machine with fewer samples than GPUs, but some), or None."""
    for m, (share, n) in enumerate(zip(machine_shares, gpus)):
        if 0 < share < n:
            return (
                f"global_batch={global_batch}: machine {m} gets {share} sample(s) for its {n} GPUs, "
                "which data parallelism inside it cannot split"
            )
    return None


def intra_lengths(length: int, per_sample: int, gpus: int, what: str = "") -> list[int]:
    """Each GPU's part of a machine's `length` along a batch dim with `per_sample` rows per
    sample: whole samples, split evenly (as the planner splits a machine's batch share)."""
    n, rest = divmod(int(length), int(per_sample))
    if rest:
        raise ValueError(
            f"{what}: a machine's {length} rows along the batch dim are not whole samples of "
            f"{per_sample} rows; this plan cannot run data parallel inside a machine"
        )
    return [per_sample * k for k in round_shares(n, [1.0] * gpus)]


@dataclass(frozen=True)
class MachineOp:
    """A collective of the program among the machines' leaders, forward and dual.

    kind: all_gather | reduce_scatter | all_reduce | all_to_all | reshard | slice; `dims` and
    `lengths` are the kind's split dims and machine-level shard lengths (src, dst where two).
    """

    kind: str
    dims: tuple[int, ...] = ()
    lengths: tuple[tuple[int, ...], ...] = ()
    impl: str = "padded"

    def run(self, x: torch.Tensor, machines: Machines, backward: bool = False) -> torch.Tensor:
        group, k = machines.leaders, self.kind
        lens = [list(row) for row in self.lengths]
        if k == "all_reduce":
            return C._all_reduce_impl(x, group)
        if k in ("all_gather", "reduce_scatter"):
            gather = (k == "all_gather") != backward
            fn = C._gather_impl if gather else C._scatter_impl
            return fn(x.contiguous(), self.dims[0], lens[0], self.impl, group)
        if k == "all_to_all":
            src, dst = (0, 1) if not backward else (1, 0)
            return C._all_to_all_impl(x.contiguous(), self.dims[src], lens[src], self.dims[dst], lens[dst], group)
        if k == "reshard":
            src, dst = (lens[0], lens[1]) if not backward else (lens[1], lens[0])
            return C._reshard_impl(x.contiguous(), self.dims[0], src, dst, group)
        if k == "slice":  # Identity -> Gather(dim): this machine's slice; dual: zeros elsewhere
            dim, (start, stop) = self.dims[0], offsets(lens[0])[machines.index]
            if not backward:
                return x.narrow(dim, start, stop - start).contiguous()
            shape = list(x.shape)
            shape[dim] = sum(lens[0])
            out = x.new_zeros(shape)
            out.narrow(dim, start, stop - start).copy_(x)
            return out
        raise ValueError(f"machine-level collective {k!r} is not supported")


def _dual(layout: Layout) -> Layout:
    """The intra layout of a tensor's gradient: a replicated tensor's gradient is partial."""
    return REDUCE if layout == IDENTITY else IDENTITY if layout == REDUCE else layout


def to_leader(x: torch.Tensor, m: Machines, layout: Layout, lengths: Sequence[int]) -> torch.Tensor | None:
    """The machine's tensor on its leader (None elsewhere): the GPUs' parts along the batch dim
    concatenated, a partial sum reduced, or a replicated tensor as the leader holds it."""
    if m.size == 1:
        return x
    if layout == IDENTITY:
        return x if m.is_leader else None
    if layout == REDUCE:
        buf = x.contiguous().clone()
        dist.reduce(buf, group=m.intra, group_dst=0)
        return buf if m.is_leader else None
    dim, width = int(layout), max(lengths)
    if width == 0:
        return x.clone() if m.is_leader else None
    part = C._padded(x, dim, width)
    bufs = [torch.empty_like(part) for _ in lengths] if m.is_leader else None
    dist.gather(part, bufs, group=m.intra, group_dst=0)
    if not m.is_leader:
        return None
    return C._unstacked(bufs, dim, lengths)


def from_leader(
    y: torch.Tensor | None,
    m: Machines,
    layout: Layout,
    lengths: Sequence[int],
    shape: Sequence[int],
    like: torch.Tensor,
) -> torch.Tensor:
    """Each GPU's part of the leader's machine tensor `y` (of machine-level `shape`): its part
    along the batch dim, the whole (broadcast), or for a partial sum the leader's y and zeros."""
    if m.size == 1:
        return y
    if layout == REDUCE:
        return y if m.is_leader else like.new_zeros(tuple(shape))
    if layout == IDENTITY:
        buf = y.contiguous() if m.is_leader else like.new_empty(tuple(shape))
        dist.broadcast(buf, group=m.intra, group_src=0)
        return buf
    dim, width = int(layout), max(lengths)
    part_shape = list(shape)
    part_shape[dim] = lengths[m.local]
    if width == 0:
        return like.new_zeros(part_shape)
    recv_shape = list(shape)
    recv_shape[dim] = width
    recv = like.new_empty(recv_shape)
    pieces = None
    if m.is_leader:
        pieces = [C._padded(p, dim, width) for p in torch.split(y, list(lengths), dim=dim)]
    dist.scatter(recv, pieces, group=m.intra, group_src=0)
    return recv.narrow(dim, 0, lengths[m.local]).contiguous()


class _Hierarchical(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, m, op, layout, in_lengths, out_lengths, in_shape, out_shape):
        ctx.args = (m, op, layout, in_lengths, out_lengths, in_shape)
        whole = to_leader(x, m, layout, in_lengths)
        y = op.run(whole, m) if m.is_leader else None
        return from_leader(y, m, layout, out_lengths, out_shape, x)

    @staticmethod
    def backward(ctx, grad):
        m, op, layout, in_lengths, out_lengths, in_shape = ctx.args
        whole = to_leader(grad, m, _dual(layout), out_lengths)
        gx = op.run(whole, m, backward=True) if m.is_leader else None
        return (from_leader(gx, m, _dual(layout), in_lengths, in_shape, grad),) + (None,) * 7


def hierarchical(
    x: torch.Tensor,
    m: Machines,
    op: MachineOp,
    layout: Layout,
    in_lengths: Sequence[int],
    out_lengths: Sequence[int],
    in_shape: Sequence[int],
    out_shape: Sequence[int],
) -> torch.Tensor:
    """`op` among the machines on a tensor laid out `layout` inside each machine (a batch dim,
    IDENTITY or REDUCE), in three steps. in_lengths / out_lengths: the GPUs' parts along the
    batch dim of the machine's input / output; in_shape / out_shape: the machine-level shapes."""
    return _Hierarchical.apply(
        x, m, op, layout, tuple(in_lengths), tuple(out_lengths), tuple(in_shape), tuple(out_shape)
    )


def sfb_factor(
    m: Machines,
    dim: int,
    machine_lengths: Sequence[int],
    layout: Layout,
    lengths: Sequence[int],
    impl: str,
    full_shape: Sequence[int],
) -> Callable[[torch.Tensor], torch.Tensor]:
    """For SFB among machines: a function that takes a factor (sharded over machines along
    `dim`, laid out `layout` inside them) in three steps: to the leader, all-gathered among the
    leaders, and back as this GPU's even part along `dim` of the whole factor. Each GPU then
    computes its part of the weight gradient from its parts of the input and output gradient
    (cut alike), and the machine's gradient sync sums the parts."""
    parts = round_shares(int(full_shape[dim]), [1.0] * m.size)

    def factor(t: torch.Tensor) -> torch.Tensor:
        whole = to_leader(t.contiguous(), m, layout, lengths)
        if m.is_leader:
            whole = C._gather_impl(whole, dim, list(machine_lengths), impl, m.leaders)
        return from_leader(whole, m, dim, parts, full_shape, t)

    return factor
