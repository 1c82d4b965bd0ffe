"""Training with a synthesized program: each rank runs its generated code and Adam on its shards.

`setup_trainer(planner, plan, model, ctx)` is what a HAP-style method's `setup` returns. The plan
is made once before the workers start and read here as it is: ranks never re-plan. It does not
plan (methods.hap.planner) and does not time iterations (bench.worker does).
"""

from __future__ import annotations

import copy
import math
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch import nn

from bench.cluster import ClusterSpec
from bench.interfaces import Plan, RankContext, Workload
from bench.cost import virtual_devices
from methods.capture import Graph, capture, capture_config
from methods.hap.codegen import (
    CodegenOptions,
    PlanMismatchError,
    RankProgram,
    check_plan,
)

DEFAULT_LR = 5e-4  # Adam, as in the HAP paper


class GradBuckets:
    """All-reduce of replicated parameters' gradients in buckets, launched during backward.

    Buckets are filled in reverse order of first use (roughly the order backward produces the
    gradients) up to `cap_bytes` each, and launched strictly in bucket order as soon as all
    their gradients are accumulated, so every rank issues the same collectives in the same
    order (as DDP does). `finish()` waits for them and writes the sums back into `.grad`.
    cap_bytes None: one bucket; 0: one per parameter.
    """

    def __init__(self, params: list[nn.Parameter], cap_bytes: float | None, overlap: bool = True):
        self.buckets: list[list[nn.Parameter]] = []
        size = 0.0
        for p in reversed(params):
            nbytes = p.numel() * p.element_size()
            if not self.buckets or (cap_bytes is not None and (cap_bytes <= 0 or size + nbytes > cap_bytes)):
                self.buckets.append([])
                size = 0.0
            self.buckets[-1].append(p)
            size += nbytes
        self._bucket_of = {id(p): i for i, b in enumerate(self.buckets) for p in b}
        self._pending: list[int] = []
        self._works: list = []
        self._next = 0
        self.overlap = overlap
        if overlap:
            for p in params:
                p.register_post_accumulate_grad_hook(self._ready)

    def start(self) -> None:
        self._pending = [len(b) for b in self.buckets]
        self._works = [None] * len(self.buckets)
        self._next = 0

    def _ready(self, p: nn.Parameter) -> None:
        if not self._pending:
            return  # a backward outside step() (no bucket bookkeeping started)
        self._pending[self._bucket_of[id(p)]] -= 1
        while self._next < len(self.buckets) and self._pending[self._next] == 0:
            self._launch(self._next)
            self._next += 1

    def _launch(self, i: int) -> None:
        grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in self.buckets[i]]
        flat = torch.cat([g.reshape(-1) for g in grads])
        self._works[i] = (flat, dist.all_reduce(flat, async_op=True))

    def finish(self) -> None:
        while self._next < len(self.buckets):  # parameters without a gradient this step
            self._launch(self._next)
            self._next += 1
        for bucket, (flat, work) in zip(self.buckets, self._works):
            work.wait()
            offset = 0
            for p in bucket:
                n = p.numel()
                if p.grad is not None:
                    p.grad.copy_(flat[offset:offset + n].view_as(p))
                offset += n
        self._pending = []


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
    """

    def __init__(self, program: RankProgram, ctx: RankContext, lr: float = DEFAULT_LR, grad_clip: float = 0.0,
                 mirror_full_state: bool = False, model: nn.Module | None = None, bucket_cap_mb: float | None = 25.0,
                 grad_overlap: bool = True):
        if not lr > 0 or grad_clip < 0:
            raise ValueError(f"lr={lr!r} must be > 0 and grad_clip={grad_clip!r} >= 0")
        self.program = program
        self.rank = ctx.rank
        self.emulator = ctx.emulator
        self.loss_scale = 1.0 / ctx.workload.targets_per_iter  # gradients of the mean loss
        self.params = [program.params[n] for n in sorted(program.params)]
        self.optimizer = torch.optim.Adam(self.params, lr=lr)
        cap = None if bucket_cap_mb is None else bucket_cap_mb * 2**20
        self.grad_sync = GradBuckets([program.params[n] for n in program.grad_sync], cap, grad_overlap)
        self.grad_clip = grad_clip
        self.mirror_full_state = mirror_full_state
        self.model = model
        self.steps_done = 0

    def step(self, batch: tuple[torch.Tensor, ...]) -> torch.Tensor:
        self.optimizer.zero_grad(set_to_none=True)
        loss_sum = self.program(*batch)
        self.emulator.stretch()  # forward compute since the last collective
        self.grad_sync.start()
        (loss_sum * self.loss_scale).backward()
        self.emulator.stretch()  # backward compute since the last collective
        self.grad_sync.finish()
        self.emulator.mark()
        value = float(loss_sum.detach())
        if not math.isfinite(value):
            # Before the update, so no rank's shards are corrupted; the launcher stops the rest.
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
        device = self.params[0].device if self.params else torch.device("cpu")
        sq = torch.zeros((), dtype=torch.float64, device=device)  # NCCL reduces device tensors
        for name, p in self.program.params.items():
            if p.grad is None:
                continue
            if name in self.program.sharded or self.rank == 0:
                sq += p.grad.detach().double().pow(2).sum()
        dist.all_reduce(sq)
        return sq.sqrt()

    def clip_global_norm(self, max_norm: float) -> torch.Tensor:
        """Scale every shard's gradient by the same factor (the authors clipped per shard,
        which lets replicated parameters drift apart across ranks)."""
        norm = self.global_grad_norm()
        coef = min(1.0, max_norm / (float(norm) + 1e-6))
        if coef < 1.0:
            for p in self.params:
                if p.grad is not None:
                    p.grad.mul_(coef)
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


def rank_ratios(plan: Plan, cluster: ClusterSpec) -> list[list[float]]:
    """The plan's ratios per physical rank. A machine-level plan (one virtual device per
    machine) runs with each machine's ratio split evenly over its GPUs: the synthesized program
    is valid at any ratios, so this is the same program at a finer split (its non-batch shards
    are split inside a machine too, where the planner modelled data parallelism)."""
    ratios = plan.ratios
    granularity = (plan.details or {}).get("granularity", "gpu")
    if ratios is None or granularity != "machine" or len(ratios[0]) == cluster.num_devices:
        return ratios
    vdevs = virtual_devices(cluster, "machine")
    if len(vdevs) != len(ratios[0]):
        raise PlanMismatchError(f"the plan has {len(ratios[0])} machines, cluster {cluster.name!r} {len(vdevs)}")
    made_for = (plan.details or {}).get("machine_gpus")
    if made_for is not None and list(made_for) != [v.num_gpus for v in vdevs]:
        raise PlanMismatchError(
            f"plan details.machine_gpus={list(made_for)} (GPUs per machine) differ from cluster {cluster.name!r}'s "
            f"{[v.num_gpus for v in vdevs]}; re-plan for this cluster (method.cache_dir=null or a fresh plan)")
    out = []
    for row in ratios:
        per_rank = [0.0] * cluster.num_devices
        for v, r in zip(vdevs, row):
            for rank in v.ranks:
                per_rank[rank] = r / len(v.ranks)
        out.append(per_rank)
    return out


def plan_graph(plan: Plan, workload: Workload, world_size: int, model: nn.Module | None = None,
               ratios: list[list[float]] | None = None) -> Graph:
    """The reference graph of `workload`, after checking that `plan` fits it and `world_size`
    ranks (PlanMismatchError otherwise). Call it before starting workers to fail early.

    With `model` (the built model), its structure is traced through a meta-device twin that
    shares nothing with it: about 1.5 s faster in a fresh process than building the model on
    the meta device, whose initialisers pull in torch's reference kernels.
    """
    if model is None:
        graph = capture_config(workload.model_cfg, workload.global_batch)
    else:
        memo = {id(p): nn.Parameter(torch.empty_like(p, device="meta"), requires_grad=p.requires_grad)
                for p in model.parameters()}
        memo.update({id(b): torch.empty_like(b, device="meta") for b in model.buffers()})
        twin = copy.deepcopy(model, memo)
        batch = workload.model_cfg.synthetic_batch(workload.global_batch, torch.Generator().manual_seed(0))
        graph = capture(twin, [t.to("meta") for t in batch], workload.global_batch)
    check_plan(plan.details or {}, ratios or plan.ratios, plan.batch_shares, graph, world_size)
    return graph


def setup_trainer(planner, plan: Plan, model: nn.Module, ctx: RankContext) -> HapTrainer:
    """The trainer of `plan` on this rank. Reads from `planner` (any object): lr (default 5e-4),
    grad_clip (0), and the test/ablation overrides force_impl, force_sfb, mirror_full_state.

    Raises:
        methods.hap.codegen.PlanMismatchError: the plan was made for another model, batch or world size.
    """
    ratios = rank_ratios(plan, ctx.cluster)
    graph = plan_graph(plan, ctx.workload, ctx.world_size, model, ratios)
    options = CodegenOptions(force_impl=getattr(planner, "force_impl", None),
                             force_sfb=bool(getattr(planner, "force_sfb", False)),
                             bucket_grads=bool(getattr(planner, "bucket_grads", True)))
    program = RankProgram(graph, plan.details, ratios, plan.batch_shares, model, ctx.rank, ctx.world_size, options)
    # The plan's gradient bucketing (what the simulator costed) wins over the method's options.
    sync = (plan.details or {}).get("grad_sync") or {}
    overlap = bool(sync.get("overlap", getattr(planner, "grad_overlap", True)))
    if "bucket_cap_bytes" in sync:
        cap_mb = None if sync["bucket_cap_bytes"] is None else sync["bucket_cap_bytes"] / 2**20
    else:
        cap_mb = float(getattr(planner, "bucket_cap_mb", 25.0))
    return HapTrainer(program, ctx, lr=float(getattr(planner, "lr", DEFAULT_LR)),
                      grad_clip=float(getattr(planner, "grad_clip", 0.0)),
                      mirror_full_state=bool(getattr(planner, "mirror_full_state", False)), model=model,
                      bucket_cap_mb=cap_mb, grad_overlap=overlap)


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
    modes: tuple = field(default=("real",))

    def plan(self, workload: Workload, cluster: ClusterSpec) -> Plan:
        # A mismatch fails here, before any worker starts.
        plan_graph(self.plan_, workload, cluster.num_devices, ratios=rank_ratios(self.plan_, cluster))
        return self.plan_

    def setup(self, plan: Plan, model: nn.Module, ctx: RankContext) -> HapTrainer:
        return setup_trainer(self, plan, model, ctx)
