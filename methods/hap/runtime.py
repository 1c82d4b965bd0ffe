"""Training with a synthesized program: each rank runs its generated code and Adam on its shards.

`setup_trainer(planner, plan, model, ctx)` is what a HAP-style method's `setup` returns. The plan
is made once before the workers start and read here as it is: ranks never re-plan. It does not
plan (methods.hap.planner) and does not time iterations (bench.runtime.worker does).
"""

from __future__ import annotations

import copy
import dataclasses
import itertools
import math
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch import nn

from bench.core.cluster import ClusterSpec
from bench.core.interfaces import Plan, RankContext, Workload
from bench.core.program import bucket_runs
from bench.core.shares import round_shares
from bench.cost import virtual_devices
from methods.common import memory_tools_of, micro_batches, scale_to_norm, unit_nodes
from methods.graph import Graph, capture_config
from methods.hap.balance import batch_shares as vdev_shares
from methods.hap.codegen import (
    CodegenOptions,
    PlanMismatchError,
    RankProgram,
    check_plan,
)
from methods.hap.hierarchy import Machines, unsplittable_share

DEFAULT_LR = 5e-4  # Adam, as in the HAP paper


class GradBuckets:
    """All-reduce of replicated parameters' gradients in buckets, launched during backward.

    Buckets are filled in reverse order of first use (roughly the order backward produces the
    gradients) up to `cap_bytes` each, and launched strictly in bucket order as soon as all
    their gradients are accumulated, so every rank issues the same collectives in the same
    order (as DDP does). Each bucket is one flat buffer and its parameters' `.grad` are views
    of it (DDP's gradient_as_bucket_view), so backward accumulates straight into what is
    all-reduced and nothing is copied; `finish()` waits for the sums, and a parameter that got
    no gradient this step is left with `.grad` None. cap_bytes None: one bucket; 0: one per
    parameter. `group`: the process group the sums run over (default: all ranks).

    With `machines` (a machine-level plan), every parameter's gradient is all-reduced inside its
    machine (data parallel there); those in `across` (replicated over machines) then also among
    the machines' leaders, and each leader broadcasts the sum back into its machine. A bucket
    holds parameters of one kind. The leaders' step of a bucket starts as soon as its
    machine's all-reduce has completed (checked whenever a gradient arrives), in bucket order.
    """

    def __init__(
        self,
        params: list[nn.Parameter],
        cap_bytes: float | None,
        overlap: bool = True,
        machines: Machines | None = None,
        across: set[int] | None = None,
        group=None,
    ):
        self.machines = machines
        self.group = group  # the ranks the gradients are summed over (default: all)
        across = across or set()
        ordered = list(reversed(params))
        # per gradient: (also summed among the machines, dtype, device)
        kinds = [(id(p) in across, p.dtype, p.device) for p in ordered]
        runs = bucket_runs([(p.numel() * p.element_size(), k) for p, k in zip(ordered, kinds)], cap_bytes)
        self.buckets: list[list[nn.Parameter]] = [[ordered[i] for i in run] for run in runs]
        self.across = [kinds[run[0]][0] for run in runs]
        self.flats = [
            torch.zeros(sum(p.numel() for p in b), dtype=b[0].dtype, device=b[0].device) for b in self.buckets
        ]
        self._views = [
            [f[o - p.numel() : o].view_as(p) for p, o in zip(b, itertools.accumulate(p.numel() for p in b))]
            for b, f in zip(self.buckets, self.flats)
        ]
        self._bucket_of = {id(p): i for i, b in enumerate(self.buckets) for p in b}
        self._pending: list[int] = []
        self._started = False
        self._got: set[int] = set()  # parameters whose gradient backward produced this step
        self._works: list = []
        self._next = 0
        self.overlap = overlap
        for p in params:
            p.register_post_accumulate_grad_hook(self._ready)

    def start(self, launch: bool = True) -> None:
        """Before backward: zero the buckets and point every `.grad` into its bucket. Without
        `launch`, backward accumulates into them and nothing is all-reduced until arm()
        (gradient accumulation: the micro-steps before the last)."""
        for flat, bucket, views in zip(self.flats, self.buckets, self._views):
            flat.zero_()
            for p, view in zip(bucket, views):
                p.grad = view
        self._started = True
        self._pending = [len(b) for b in self.buckets] if launch else []
        self._got = set()
        self._works = [None] * len(self.buckets)
        self._next = 0
        self._stage = [0] * len(self.buckets)  # machine-level: steps launched per bucket
        self._recv: list = [None] * len(self.buckets)

    def arm(self) -> None:
        """Before the backward whose gradients complete the buckets (the last micro-step's):
        each bucket is launched once that backward has added all of its gradients."""
        self._pending = [len(b) for b in self.buckets]

    def _ready(self, p: nn.Parameter) -> None:
        if not self._started:
            return  # a backward outside step() (no bucket bookkeeping started)
        self._got.add(id(p))
        if not self.overlap or not self._pending:
            return
        self._pending[self._bucket_of[id(p)]] -= 1
        while self._next < len(self.buckets) and self._pending[self._next] == 0:
            self._launch(self._next)
            self._next += 1
        if self.machines is not None:
            self._advance(wait=False)

    def _launch(self, i: int) -> None:
        flat = self.flats[i]
        m = self.machines
        if m is None:
            self._works[i] = (flat, [dist.all_reduce(flat, group=self.group, async_op=True)])
            return
        works = [dist.all_reduce(flat, group=m.intra, async_op=True)] if m.size > 1 else []
        self._works[i] = (flat, works)
        self._stage[i] = 1
        if self.across[i] and m.count > 1 and m.size > 1 and not m.is_leader:
            # Post the receive of the leader's broadcast now (its own group and buffer).
            self._recv[i] = torch.empty_like(flat)
            works.append(dist.broadcast(self._recv[i], group=m.intra_sync, group_src=0, async_op=True))

    def _advance(self, wait: bool) -> None:
        """A leader's next steps of buckets summed among machines, in bucket order: the leaders'
        all-reduce once the machine's sum is there, then the broadcast into the machine. Without
        `wait`, stops at the first step whose input is not ready yet."""
        m = self.machines
        if not m.is_leader or m.count == 1:
            return
        for i in range(len(self.buckets)):
            if not self.across[i] or self._stage[i] >= 3:
                continue
            if self._stage[i] == 0:
                return  # not launched yet: later buckets wait for it
            flat, works = self._works[i]
            if not _done(works[-1] if works else None, wait):
                return
            if self._stage[i] == 1:
                works.append(dist.all_reduce(flat, group=m.leaders_sync, async_op=True))
                self._stage[i] = 2
                if not _done(works[-1], wait):
                    return
            if m.size > 1:
                works.append(dist.broadcast(flat, group=m.intra_sync, group_src=0, async_op=True))
            self._stage[i] = 3

    def finish(self) -> None:
        while self._next < len(self.buckets):  # parameters without a gradient this step
            self._launch(self._next)
            self._next += 1
        if self.machines is not None:
            self._advance(wait=True)
        for i, (bucket, (flat, works)) in enumerate(zip(self.buckets, self._works)):
            for work in works:
                work.wait()
            if self._recv[i] is not None:
                flat.copy_(self._recv[i])
            for p in bucket:
                if id(p) not in self._got:
                    p.grad = None  # no gradient this step: Adam leaves it alone, as without buckets
        self._pending = []
        self._started = False


def _done(work, wait: bool) -> bool:
    """Whether an async collective's result is there (waiting for it with `wait`); on an
    emulated link, once the link has delivered it (bench.runtime.emulation), as on a real one."""
    if work is None:
        return True
    if wait:
        work.wait()
        return True
    return work.is_completed()


class HapTrainer:
    """One rank's trainer: forward/backward through the rank's program, Adam on its shards.

    Args:
        program: this rank's RankProgram.
        ctx: the worker's RankContext (rank, workload, emulator).
        lr: Adam learning rate.
        grad_clip: max global gradient norm (over all ranks' shards, replicated parameters
            counted once); 0 disables clipping.
        mirror_full_state: after every step, write the reassembled full gradients and
            parameters into `model` (the harness's full model), so rank 0's model holds the
            state single-device training would have. Costs two all-gathers per sharded
            parameter per step: for tests.
        model: the full model passed to setup (needed by mirror_full_state).
        bucket_cap_mb: gradient all-reduce bucket of replicated parameters (MiB); 0 = one
            all-reduce per parameter; None = one bucket.
        grad_overlap: launch each bucket as soon as backward has produced it (else after).
        micro_steps: gradient accumulation: the rank's batch is cut into this many micro-batches,
            each run forward and backward through the program (planned for one), the buckets
            all-reduced in the last backward only.
    """

    def __init__(
        self,
        program: RankProgram,
        ctx: RankContext,
        lr: float = DEFAULT_LR,
        grad_clip: float = 0.0,
        mirror_full_state: bool = False,
        model: nn.Module | None = None,
        bucket_cap_mb: float | None = 25.0,
        grad_overlap: bool = True,
        micro_steps: int = 1,
    ):
        if not lr > 0 or grad_clip < 0:
            raise ValueError(f"lr={lr!r} must be > 0 and grad_clip={grad_clip!r} >= 0")
        self.program = program
        self.rank = ctx.rank
        self.device = ctx.device
        self.emulator = ctx.emulator
        self.loss_scale = 1.0 / ctx.workload.targets_per_iter  # gradients of the mean loss
        self.params = [program.params[n] for n in sorted(program.params)]
        self.optimizer = torch.optim.Adam(self.params, lr=lr)
        cap = None if bucket_cap_mb is None else bucket_cap_mb * 2**20
        if ctx.world_size == 1:
            # Nothing to sum over: gradients as autograd makes them, as the plain model's step
            # (bucket views cost a zeroing and an accumulating add per gradient, and the
            # all-reduce of one rank a copy; with them and the loss read below, hap ran behind
            # the plain model on one GPU; docs/hap-runtime.md, "Runtime").
            self.grad_sync = None
        elif program.machines is None:
            params = [program.params[n] for n in program.grad_sync]
            group = getattr(program, "group", None)  # a program-like object without one: all ranks
            self.grad_sync = GradBuckets(params, cap, grad_overlap, group=group)
        else:  # every gradient is summed inside the machine; grad_sync's also among machines
            self.grad_sync = GradBuckets(
                [program.params[n] for n in program.param_order],
                cap,
                grad_overlap,
                program.machines,
                {id(program.params[n]) for n in program.grad_sync},
            )
        self.grad_clip = grad_clip
        self.mirror_full_state = mirror_full_state
        # Kept only to mirror into: the full model's copy of each sharded parameter is not the
        # rank's, and held it would double what the cost model counts for it (measured on tiny
        # VGG19's classifier; docs/cost-model.md, "Memory").
        self.model = model if mirror_full_state else None
        self.micro_steps = micro_steps
        self.steps_done = 0

    def step(self, batch: tuple[torch.Tensor, ...]) -> torch.Tensor:
        self.optimizer.zero_grad(set_to_none=True)
        parts = micro_batches(batch, self.micro_steps)
        losses = []
        for i, part in enumerate(parts):
            loss = self.program(*part)
            self.emulator.stretch()  # forward compute since the last collective
            if self.grad_sync is not None:
                if i == 0:
                    self.grad_sync.start(launch=len(parts) == 1)
                elif i == len(parts) - 1:
                    self.grad_sync.arm()
            (loss * self.loss_scale).backward()
            self.emulator.stretch()  # backward compute since the last collective
            losses.append(loss.detach())
        loss_sum = losses[0] if len(losses) == 1 else torch.stack(losses).sum()
        if self.grad_sync is not None:
            self.grad_sync.finish()
            self.emulator.mark()
        if loss_sum.device.type == "cpu":
            # Before the update, so no rank's shards are corrupted; the launcher stops the rest.
            # Only where reading the loss is free: on a GPU it would wait for backward before
            # the optimizer's kernels are queued (the worker checks every loss after the step).
            value = float(loss_sum.detach())
            if not math.isfinite(value):
                raise FloatingPointError(f"loss is {value} at step {self.steps_done} on rank {self.rank}")
        if self.grad_clip:
            self.clip_global_norm(self.grad_clip)
        self.optimizer.step()
        self.emulator.stretch()  # optimizer compute
        self.steps_done += 1
        if self.mirror_full_state:
            self.write_full_state(self.model)
        return loss_sum.detach()

    def global_grad_norm(self) -> torch.Tensor:
        """L2 norm of the whole model's gradient: shards summed over ranks, replicated
        (Identity) parameters counted once (their full gradient is on every rank)."""
        sq = torch.zeros((), dtype=torch.float64, device=self.device)  # NCCL reduces device tensors
        leader = self.program.machines is None or self.program.machines.is_leader
        for name, p in self.program.params.items():
            if p.grad is None:
                continue
            if (name in self.program.sharded and leader) or self.rank == 0:
                sq += p.grad.detach().double().pow(2).sum()
        dist.all_reduce(sq)
        return sq.sqrt()

    def clip_global_norm(self, max_norm: float) -> torch.Tensor:
        """Scale every shard's gradient by the same factor (the authors clipped per shard,
        which lets replicated parameters drift apart across ranks). The factor stays a tensor
        on the rank's device, as torch.nn.utils.clip_grad_norm_ keeps it: no read on the host,
        and a factor of 1 leaves the gradients as they are."""
        norm = self.global_grad_norm()
        scale_to_norm((p.grad for p in self.params), norm, max_norm)
        return norm

    def full_state(self) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
        """(gradients, parameters) of the whole model reassembled from every rank's shards.
        Collective: every rank must call it."""
        grads = self.program.full_tensors(lambda p: p.grad)
        params = self.program.full_tensors(lambda p: p)
        return grads, params

    def write_full_state(self, model: nn.Module) -> None:
        grads, params = self.full_state()
        with torch.no_grad():
            for name, value in params.items():
                p = model.get_parameter(name)
                if p is not self.program.params[name]:
                    p.copy_(value)
                    p.grad = grads[name].clone() if name in grads else None


def plan_machines(plan: Plan, cluster: ClusterSpec) -> list[list[int]] | None:
    """The ranks of each machine when `plan` is machine-level (one ratio per machine) and some
    machine has several GPUs: the program then runs data parallel inside the machines
    (methods.hap.hierarchy). None when every virtual device is one rank.

    Raises:
        PlanMismatchError: the plan was made for other machines (one line: field and fix).
    """
    granularity = (plan.details or {}).get("granularity", "gpu")
    if plan.ratios is None or granularity != "machine":
        return None
    vdevs = virtual_devices(cluster, "machine")
    if len(vdevs) != len(plan.ratios[0]):
        raise PlanMismatchError(
            f"the plan has {len(plan.ratios[0])} machines, cluster {cluster.name!r} {len(vdevs)}; "
            "re-plan for this cluster (method.cache_dir=null or a fresh plan)"
        )
    made_for = (plan.details or {}).get("machine_gpus")
    if made_for is not None and list(made_for) != [v.num_gpus for v in vdevs]:
        raise PlanMismatchError(
            f"plan details.machine_gpus={list(made_for)} (GPUs per machine) differ from cluster {cluster.name!r}'s "
            f"{[v.num_gpus for v in vdevs]}; re-plan for this cluster (method.cache_dir=null or a fresh plan)"
        )
    if all(v.num_gpus == 1 for v in vdevs):
        return None
    return [list(v.ranks) for v in vdevs]


def micro_step(plan: Plan, workload: Workload) -> tuple[Plan, Workload]:
    """The plan and workload of one micro-step: with gradient accumulation (plan.details
    memory_tools) the program is planned for global_batch / k samples, each rank's micro-batch
    its share / k; without, the plan and workload themselves."""
    _, k = memory_tools_of(plan.details)
    if k == 1:
        return plan, workload
    shares = (plan.details or {})["memory_tools"]["micro_batch_shares"]
    return dataclasses.replace(plan, batch_shares=list(shares)), dataclasses.replace(
        workload, global_batch=workload.global_batch // k
    )


def plan_graph(
    plan: Plan,
    workload: Workload,
    world_size: int,
    model: nn.Module | None = None,
    machines: list[list[int]] | None = None,
) -> Graph:
    """The reference graph of `workload`, after checking that `plan` fits it and `world_size`
    ranks (in `machines`, for a machine-level plan: plan_machines; PlanMismatchError
    otherwise), with the plan's activation checkpoints (Graph.recompute). Before starting
    workers, also check_machine_plan. With gradient accumulation, `plan` and `workload` are
    one micro-step's (micro_step).

    `model`: the built model, for capture_config to trace where no graph is kept.
    """
    batch_norm = (plan.details or {}).get("batch_norm", "sync")
    graph = capture_config(workload.model_cfg, workload.global_batch, batch_norm=batch_norm, model=model)
    check_plan(
        plan.details or {},
        plan.ratios,
        plan.batch_shares,
        graph,
        world_size,
        world_size if machines is None else len(machines),
    )
    units, _ = memory_tools_of(plan.details)
    return graph.with_recompute([u.nodes for u in unit_nodes(graph, units)])


def check_machine_plan(plan: Plan, graph: Graph, machines: list[list[int]]) -> None:
    """Raise PlanMismatchError unless every GPU of a machine-level plan gets its machine's
    batch share in whole samples, split as codegen splits it, and every tensor's batch dim
    divides into whole samples inside each machine (compiles every rank's program on the meta
    device; each worker later compiles only its own)."""
    per_machine = vdev_shares(graph.batch_size, plan.ratios[0])
    unsplit = unsplittable_share(graph.batch_size, per_machine, [len(r) for r in machines])
    if unsplit:
        raise PlanMismatchError(f"{unsplit}; raise the global batch or plan per GPU (method.levels=both)")
    for m, (ranks, share) in enumerate(zip(machines, per_machine)):
        want = round_shares(share, [1.0] * len(ranks))
        got = [plan.batch_shares[r] for r in ranks]
        if got != want:
            raise PlanMismatchError(
                f"plan batch_shares {got} for machine {m}'s ranks {ranks}: its share of {share} samples splits over "
                f"its {len(ranks)} GPUs as {want}; re-plan (the planner splits a machine's share evenly)"
            )
    meta = copy.deepcopy(graph.gm).to("meta")
    for m, ranks in enumerate(machines):
        for local, rank in enumerate(ranks):
            where = Machines(machines, m, local)
            RankProgram(
                graph,
                plan.details,
                plan.ratios,
                plan.batch_shares,
                meta,
                rank,
                sum(map(len, machines)),
                CodegenOptions(),
                where,
            )


def setup_trainer(planner, plan: Plan, model: nn.Module, ctx: RankContext) -> HapTrainer:
    """The trainer of `plan` on this rank. Reads from `planner` (any object): lr (default 5e-4),
    grad_clip (0), interpret (False), and the test/ablation overrides force_impl, force_sfb,
    mirror_full_state.

    Raises:
        methods.hap.codegen.PlanMismatchError: the plan was made for another model, batch or world size.
    """
    machine_ranks = plan_machines(plan, ctx.cluster)
    _, micro_steps = memory_tools_of(plan.details)
    plan, workload = micro_step(plan, ctx.workload)
    graph = plan_graph(plan, workload, ctx.world_size, model, machine_ranks)
    machines = None if machine_ranks is None else Machines.build(machine_ranks, ctx.rank)
    options = CodegenOptions(
        force_impl=getattr(planner, "force_impl", None),
        force_sfb=bool(getattr(planner, "force_sfb", False)),
        bucket_grads=bool(getattr(planner, "bucket_grads", True)),
        compile=not getattr(planner, "interpret", False),
    )
    program = RankProgram(
        graph,
        plan.details,
        plan.ratios,
        plan.batch_shares,
        model,
        ctx.rank,
        ctx.world_size,
        options,
        machines,
        graph.recompute,
    )
    # The plan's gradient bucketing (what the simulator costed) wins over the method's options.
    sync = (plan.details or {}).get("grad_sync") or {}
    overlap = bool(sync.get("overlap", getattr(planner, "grad_overlap", True)))
    if "bucket_cap_bytes" in sync:
        cap_mb = None if sync["bucket_cap_bytes"] is None else sync["bucket_cap_bytes"] / 2**20
    else:
        cap_mb = float(getattr(planner, "bucket_cap_mb", 25.0))
    return HapTrainer(
        program,
        ctx,
        lr=float(getattr(planner, "lr", DEFAULT_LR)),
        grad_clip=float(getattr(planner, "grad_clip", 0.0)),
        mirror_full_state=bool(getattr(planner, "mirror_full_state", False)),
        model=model,
        bucket_cap_mb=cap_mb,
        grad_overlap=overlap,
        micro_steps=micro_steps,
    )


@dataclass
class FixedPlanMethod:
    """A Method that runs a plan made elsewhere (tests, ablations with forced ratios): plan()
    returns it, setup() builds the HAP trainer. Picklable, so it travels to workers.

    Attributes mirror HapPlanner's runtime options; `plan_` is the Plan to run.
    """

    plan_: Plan
    name: str = "hap"
    lr: float = DEFAULT_LR
    grad_clip: float = 0.0
    force_impl: str | None = None
    force_sfb: bool = False
    bucket_grads: bool = True
    bucket_cap_mb: float = 25.0
    grad_overlap: bool = True
    mirror_full_state: bool = False
    interpret: bool = False
    modes: tuple = field(default=("real",))

    def plan(self, workload: Workload, cluster: ClusterSpec) -> Plan:
        # A mismatch fails here, before any worker starts.
        machines = plan_machines(self.plan_, cluster)
        plan, workload = micro_step(self.plan_, workload)
        graph = plan_graph(plan, workload, cluster.num_devices, machines=machines)
        if machines is not None:
            check_machine_plan(plan, graph, machines)
        return self.plan_

    def setup(self, plan: Plan, model: nn.Module, ctx: RankContext) -> HapTrainer:
        return setup_trainer(self, plan, model, ctx)
