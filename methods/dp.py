"""Data-parallel baselines on PyTorch DDP: dp_ev (even batch split) and dp_cp (split by FLOP/s).

Uneven shares are exact: each rank's summed loss is scaled by world_size / (global targets), so
DDP's average over ranks equals the gradient of the mean loss over the whole global batch.
"""

from __future__ import annotations

import contextlib
import inspect

import torch
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.nn.parallel import DistributedDataParallel as DDP

from bench.core.cluster import ClusterSpec
from bench.core.errors import ConfigError
from bench.core.interfaces import Plan, RankContext, Workload
from bench.core.shares import round_shares
from methods.common import (
    MemoryTools,
    apply_checkpointing,
    check_training_options,
    memory_tools_of,
    micro_batches,
    refuse_global_batch_norm,
)
from methods.dp_program import data_parallel_program
from methods.graph import capture_priced

# DDP's flag for syncing buffers before each forward, by the name this torch knows.
_BUFFER_FLAG = (
    "forward_sync_buffers" if "forward_sync_buffers" in inspect.signature(DDP).parameters else "broadcast_buffers"
)

SPLITS = ("even", "compute")


class DataParallel:
    """PyTorch DDP with a configurable batch split.

    Args:
        name: the method's name in records (dp_ev, dp_cp).
        split: "even" (equal shares) or "compute" (shares proportional to effective FLOP/s).
        bucket_cap_mb: DDP gradient bucket size (MiB).
        lr: Adam learning rate (the paper: 5e-4).
        grad_clip: max global gradient norm; 0 disables clipping.
        activation_checkpointing, grad_accumulation: the memory tools (methods.common.MemoryTools):
            layer groups recomputed in backward; micro-steps per iteration, DDP's no_sync for
            all but the last, so gradients are all-reduced once.
    """

    def __init__(
        self,
        name: str,
        split: str = "even",
        bucket_cap_mb: float = 25.0,
        lr: float = 5e-4,
        grad_clip: float = 0.0,
        activation_checkpointing: bool = False,
        grad_accumulation: int = 1,
    ):
        if split not in SPLITS:
            raise ConfigError(f"method.split={split!r} is invalid; use one of {', '.join(SPLITS)}")
        check_training_options(lr, grad_clip, bucket_cap_mb)
        self.tools = MemoryTools(activation_checkpointing, grad_accumulation)
        self.name = name
        self.modes = ("real", "sim")
        self.split = split
        self.bucket_cap_mb = bucket_cap_mb
        self.lr = lr
        self.grad_clip = grad_clip

    def plan(self, workload: Workload, cluster: ClusterSpec) -> Plan:
        if self.split == "even":
            weights = [1.0] * cluster.num_devices
        else:
            weights = [d.effective_flops for d in cluster.devices]
        # Every rank gets at least one sample: DDP ranks must all run the same graph.
        shares = round_shares(workload.global_batch, weights, min_share=1)
        self.tools.check_shares(shares)
        # The simulator's view: every GPU is a rank, DDP's bucketed all-reduce overlaps backward.
        # DDP's ranks normalise their own samples (batch norm with local statistics)
        graph = capture_priced(workload.model_cfg, workload.global_batch, workload.precision, cluster.device, "local")
        refuse_global_batch_norm(workload, graph, self.name, "each rank's share")
        units = self.tools.units(graph)
        graph = graph.with_recompute([u.nodes for u in units])
        program = data_parallel_program(
            cluster.num_devices,
            workload.global_batch,
            graph.layer_profile(),
            graph.activation_bytes() / workload.global_batch,
            bucket_cap_bytes=self.bucket_cap_mb * 2**20,
            granularity="gpu",
            bucket_copies=cluster.num_devices > 1,  # one rank trains the plain model, no DDP
            backward_memory=graph.backward_memory(),
            largest_param_bytes=graph.largest_param_bytes(),
            micro_steps=self.tools.grad_accumulation,
            cast_bytes=sum(graph.param_casts.values()),
            meta={"method": self.name, "model": workload.name},
        )
        ratios = [[s / workload.global_batch for s in shares]]
        details = {
            "split": self.split,
            "batch_shares": shares,
            "bucket_cap_mb": self.bucket_cap_mb,
            "memory_tools": self.tools.details(units),
        }
        return Plan(self.name, shares, details, program, ratios)

    def setup(self, plan: Plan, model: nn.Module, ctx: RankContext) -> DDPTrainer:
        return DDPTrainer(self, plan, model, ctx)


class DDPTrainer:
    def __init__(self, method: DataParallel, plan: Plan, model: nn.Module, ctx: RankContext):
        units, self.micro_steps = memory_tools_of(plan.details)
        apply_checkpointing(model, units)
        device_ids = [ctx.device.index] if ctx.device.type == "cuda" else None
        # One rank has nothing to synchronise: the plain model, so its whole step is compute.
        self.distributed = ctx.world_size > 1
        # DDP broadcasts the buffers from rank 0 before every forward by default: a collective
        # the emulator cannot see, where a fast rank waits for a slow one inside its forward.
        # Only buffers that training changes (batch norm's running statistics) need it; the
        # zoo's are constants (attention masks).
        # (torch 2.13 renamed the flag forward_sync_buffers and warns on the old name; buffers are
        # still synchronised once at construction, which changes nothing: every rank builds the
        # model from one seed.)
        running_stats = any(isinstance(m, nn.modules.batchnorm._NormBase) for m in model.modules())
        self.ddp = (
            DDP(model, device_ids=device_ids, bucket_cap_mb=method.bucket_cap_mb, **{_BUFFER_FLAG: running_stats})
            if self.distributed
            else model
        )
        if ctx.emulator.enabled and self.distributed:
            # Python-level all-reduce, so the emulator sees each bucket (the built-in reducer
            # calls C++ collectives directly); same arithmetic as DDP's default.
            self.ddp.register_comm_hook(None, default_hooks.allreduce_hook)
        self.model = model
        self.emulator = ctx.emulator
        self.optimizer = torch.optim.Adam(model.parameters(), lr=method.lr)
        self.grad_clip = method.grad_clip
        self.loss_scale = ctx.world_size / ctx.workload.targets_per_iter

    def step(self, batch: tuple[torch.Tensor, ...]) -> torch.Tensor:
        self.optimizer.zero_grad(set_to_none=True)
        micro = micro_batches(batch, self.micro_steps)
        losses = []
        for i, part in enumerate(micro):
            # Every micro-step but the last accumulates into .grad without DDP's all-reduce.
            last = i == len(micro) - 1
            with contextlib.nullcontext() if last or not self.distributed else self.ddp.no_sync():
                loss = self.ddp(*part)
                self.emulator.stretch()  # forward compute
                (loss * self.loss_scale).backward()
            losses.append(loss.detach())
            if self.distributed and last:
                self.emulator.mark()  # backward ended waiting for the last all-reduce: not compute
            else:
                self.emulator.stretch()  # backward compute
        if self.grad_clip:
            # Gradients are identical on every rank after DDP, so the local norm is global.
            torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.grad_clip)
        self.optimizer.step()
        self.emulator.stretch()  # optimizer compute
        return losses[0] if len(losses) == 1 else torch.stack(losses).sum()
