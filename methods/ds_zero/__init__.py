"""The DeepSpeed baseline: the real DeepSpeed engine with ZeRO data parallelism (stages 0-3) and,
for BERT-MoE, DeepSpeed's own MoE layer with one expert-parallel group over all devices.

It does not balance load: DeepSpeed gives every device the same micro-batch, which is what this
baseline measures on mixed GPUs. This module is the Method (its options, plan and setup); its
parts: program.py (the Program the simulator scores), trainer.py (the worker side and deepspeed's
late import) and moe.py (DeepSpeed's MoE layer in place of the model's). deepspeed is imported
only by setup() and by the engine probe (engine_work: the runtime's method_step service, in child
processes), so planning and simulating work without it.
"""

from __future__ import annotations

import copy
import logging
import os
import warnings
from dataclasses import replace
from typing import Any

import torch
from torch import nn

from bench.core.cluster import ClusterSpec
from bench.core.errors import ConfigError
from bench.core.interfaces import Plan, RankContext, Workload
from bench.cost import even_ratios
from bench.runtime.method_step import DEFAULT_REPEATS, added_host_work_flops, time_method_step
from methods.common import MemoryTools, apply_checkpointing, memory_tools_of
from methods.ds_zero.moe import deepspeed_capacity, matching_capacity_factor, swap_moe_layers
from methods.ds_zero.program import FP32_BYTES, ZERO_STAGES, profile_workload, zero_program
from methods.ds_zero.trainer import (
    INSTALL_HINT,
    DeepSpeedTrainer,
    import_deepspeed,
    skip_shm_comm_op,
    use_accelerator,
)

ENGINE_PROBE_VERSION = 2  # a cached probe made another way is measured again

log = logging.getLogger(__name__)


class DeepSpeedZeRO:
    """DeepSpeed's engine with a generated config; the global batch is split evenly.

    Args:
        name: the method's name in records.
        zero_stage: ZeRO stage 0 (plain data parallel), 1 (optimizer state sharded),
            2 (+ gradients), 3 (+ parameters).
        lr: Adam learning rate (torch.optim.Adam, not DeepSpeed's JIT-compiled fused Adam).
        grad_clip: max global gradient norm; 0 disables clipping (DeepSpeed's default is 1).
        reduce_bucket_size: elements per gradient reduction bucket (DeepSpeed's default 5e8).
        allgather_bucket_size: elements per ZeRO-1/2 parameter all-gather (default 5e8).
        param_persistence_threshold: ZeRO-3 keeps parameters with fewer elements than this
            unpartitioned (DeepSpeed's default 1e5).
        moe_capacity_factor: DeepSpeed's capacity factor per routed token; None gives every
            expert exactly the model's slots per sequence (models.bert_moe.moe_capacity) x the
            micro-batch (matching_capacity_factor), so DeepSpeed, dp and hap run the same
            expert work and all-to-all sizes.
        moe_min_capacity: DeepSpeed's minimum slots per expert; 0 (the default) never raises
            the count above the model's slots (DeepSpeed's own default is 8).
        shm_comm_op: build DeepSpeed's shared-memory all-reduce op for CPU ranks. Only
            inference calls it, and building it is a ~40 s JIT compile on first use.
        log_level: DeepSpeed's logger level in the workers.
        engine_probe: on an emulated CPU cluster, price the engine's own work (engine_work:
            timed once per host, workload, devices and config, then cached) as the Program's
            host work; false prices the model's work and collectives only.
        activation_checkpointing, grad_accumulation: the memory tools (methods.common.MemoryTools):
            layer groups recomputed in backward (torch.utils.checkpoint on the modules DeepSpeed
            trains); DeepSpeed's own gradient_accumulation_steps, each rank's share cut into
            that many micro-batches (train_micro_batch_size_per_gpu).
    """

    modes = ("real", "sim")
    # What setup imports in each worker, for the server CPU workers fork from to import once
    # (bench.runtime.launch.method_modules): DeepSpeed, its MoE layer, and the Muon optimizer
    # module that deepspeed.initialize imports to check the optimizer, which compiles a function
    # with torch's compiler at import (seconds of each worker's set-up; docs/runtime.md). The
    # server skips a name that another DeepSpeed version lacks.
    worker_modules = ("deepspeed", "deepspeed.moe.layer", "deepspeed.runtime.zero.muon.muon_optimizer")
    mirror_full_state = False  # tests: write the whole gradients and parameters into a copy of the model

    def __init__(
        self,
        name: str = "deepspeed",
        zero_stage: int = 1,
        lr: float = 5e-4,
        grad_clip: float = 0.0,
        reduce_bucket_size: float = 5e8,
        allgather_bucket_size: float = 5e8,
        param_persistence_threshold: float = 1e5,
        moe_capacity_factor: float | None = None,
        moe_min_capacity: int = 0,
        shm_comm_op: bool = False,
        log_level: str = "warning",
        engine_probe: bool = True,
        activation_checkpointing: bool = False,
        grad_accumulation: int = 1,
    ):
        if isinstance(zero_stage, bool) or zero_stage not in ZERO_STAGES:
            raise ConfigError(
                f"method.zero_stage={zero_stage!r} is invalid; use one of {', '.join(map(str, ZERO_STAGES))}"
            )
        if not lr > 0 or not grad_clip >= 0:
            raise ConfigError(f"method.lr={lr!r} must be > 0 and method.grad_clip={grad_clip!r} >= 0")
        for key, value in (
            ("reduce_bucket_size", reduce_bucket_size),
            ("allgather_bucket_size", allgather_bucket_size),
        ):
            if not value >= 1:
                raise ConfigError(f"method.{key}={value!r} must be >= 1 (elements); DeepSpeed's default is 5.0e8")
        if not param_persistence_threshold >= 0:
            raise ConfigError(
                f"method.param_persistence_threshold={param_persistence_threshold!r} must be >= 0 (elements)"
            )
        if moe_capacity_factor is not None and not moe_capacity_factor > 0:
            raise ConfigError(
                f"method.moe_capacity_factor={moe_capacity_factor!r} must be > 0, or null to match the model's capacity"
            )
        if isinstance(moe_min_capacity, bool) or not isinstance(moe_min_capacity, int) or moe_min_capacity < 0:
            raise ConfigError(f"method.moe_min_capacity={moe_min_capacity!r} must be an integer >= 0")
        for key, value in (("shm_comm_op", shm_comm_op), ("engine_probe", engine_probe)):
            if not isinstance(value, bool):
                raise ConfigError(f"method.{key}={value!r} is invalid; use true or false")
        if logging.getLevelName(str(log_level).upper()) not in range(0, 60):
            raise ConfigError(f"method.log_level={log_level!r} is invalid; use debug, info, warning or error")
        self.name = name
        self.zero_stage = int(zero_stage)
        self.lr = float(lr)
        self.grad_clip = float(grad_clip)
        self.reduce_bucket_size = int(reduce_bucket_size)
        self.allgather_bucket_size = int(allgather_bucket_size)
        self.param_persistence_threshold = int(param_persistence_threshold)
        self.moe_capacity_factor = moe_capacity_factor
        self.moe_min_capacity = moe_min_capacity
        self.shm_comm_op = bool(shm_comm_op)
        self.log_level = str(log_level).upper()
        self.engine_probe = bool(engine_probe)
        self.tools = MemoryTools(activation_checkpointing, grad_accumulation)

    # -- planning (CPU only, no deepspeed) ----------------------------------------------------
    def micro_batch(self, workload: Workload, cluster: ClusterSpec) -> int:
        """Samples a rank computes at a time (DeepSpeed's train_micro_batch_size_per_gpu): its
        share of the global batch, split into method.grad_accumulation micro-batches."""
        share = self.batch_share(workload, cluster)
        self.tools.check_shares([share] * cluster.num_devices)
        return share // self.tools.grad_accumulation

    def batch_share(self, workload: Workload, cluster: ClusterSpec) -> int:
        n, batch = cluster.num_devices, workload.global_batch
        if batch % n:
            lower, upper = (batch // n) * n, -(-batch // n) * n
            hint = f"{lower} or {upper}" if lower else f"{upper}"
            raise ConfigError(
                f"global_batch={batch} is not divisible by the {n} devices of cluster={cluster.name}: "
                f"DeepSpeed gives every device the same micro-batch; set global_batch={hint}"
            )
        return batch // n

    def moe_settings(self, workload: Workload, cluster: ClusterSpec) -> dict | None:
        """DeepSpeed MoE layer arguments for a model with experts, else None."""
        cfg = workload.model_cfg
        num_experts = getattr(cfg, "num_experts", None)
        if not num_experts:
            return None
        if self.zero_stage == 3:
            raise ConfigError(
                f"method.zero_stage=3 cannot train model={workload.name}: DeepSpeed's MoE layer "
                "does not support ZeRO-3; use method.zero_stage=0, 1 or 2"
            )
        n = cluster.num_devices
        if num_experts % n:
            raise ConfigError(
                f"model={workload.name} has {num_experts} experts, not a multiple of the {n} devices "
                f"of cluster={cluster.name}: DeepSpeed's expert parallelism puts the same number of "
                "experts on every device; use experts_per_device x devices experts"
            )
        top_k = int(getattr(cfg, "top_k", 2))
        if top_k not in (1, 2):
            raise ConfigError(
                f"model={workload.name} routes to top_k={top_k} experts; DeepSpeed's MoE gate supports top_k 1 or 2"
            )
        micro = self.micro_batch(workload, cluster)
        factor = self.moe_capacity_factor
        if factor is None:
            factor = matching_capacity_factor(cfg.capacity, cfg.seq_len, micro, int(num_experts), top_k)
        return {
            "num_experts": int(num_experts),
            "ep_size": n,
            "k": top_k,
            "capacity_factor": float(factor),
            "eval_capacity_factor": float(factor),
            "min_capacity": self.moe_min_capacity,
            "d_model": int(cfg.d_model),
            "d_ff": int(cfg.d_ff),
            # What DeepSpeed's gate will compute over one rank's micro-batch (for the record).
            "capacity": deepspeed_capacity(
                micro * cfg.seq_len, int(num_experts), float(factor), top_k, self.moe_min_capacity
            ),
        }

    def ds_config(self, micro_batch: int, num_devices: int, precision: str = "fp32") -> dict:
        """The DeepSpeed config (JSON-ready): fp32 parameters and optimizer, no fused ops, the
        client optimizer is Adam. bf16 is torch's autocast in the engine's own `torch_autocast`
        section, as every method trains it: DeepSpeed's engine runs forward inside its autocast
        helper, which switches an outer autocast of its device type off unless that section is
        enabled (the worker's outer autocast alone leaves a GPU's forward in fp32). No module is
        listed as safe to communicate in bf16: gradients are all-reduced in fp32, as DDP and
        hap do (DeepSpeed's `bf16` section would keep bf16 parameters: another workload). TF32
        (tf32, fp32) is the worker's process-wide switch; DeepSpeed does not touch it."""
        zero: dict[str, Any] = {
            "stage": self.zero_stage,
            "reduce_bucket_size": self.reduce_bucket_size,
            "allgather_bucket_size": self.allgather_bucket_size,
        }
        if self.zero_stage == 3:
            zero["stage3_param_persistence_threshold"] = self.param_persistence_threshold
        return {
            "train_batch_size": micro_batch * num_devices * self.tools.grad_accumulation,
            "train_micro_batch_size_per_gpu": micro_batch,
            "gradient_accumulation_steps": self.tools.grad_accumulation,
            "gradient_clipping": self.grad_clip,
            "fp16": {"enabled": False},
            "bf16": {"enabled": False},
            "zero_optimization": zero,
            # torch.optim.Adam is on ZeRO's list of tested optimizers; other client optimizers
            # would need "zero_allow_untested_optimizer": true.
            "zero_allow_untested_optimizer": False,
            "steps_per_print": 2**31 - 1,
            "wall_clock_breakdown": False,
            **(
                {"torch_autocast": {"enabled": True, "dtype": "bfloat16", "lower_precision_safe_modules": []}}
                if precision == "bf16"
                else {}
            ),
        }

    def plan(self, workload: Workload, cluster: ClusterSpec) -> Plan:
        micro = self.micro_batch(workload, cluster)
        share = micro * self.tools.grad_accumulation
        moe = self.moe_settings(workload, cluster)
        n = cluster.num_devices
        config = self.ds_config(micro, n, workload.precision)
        profile = profile_workload(workload, micro, moe, cluster.device, self.tools.activation_checkpointing)
        program = zero_program(
            profile,
            num_devices=n,
            global_batch=workload.global_batch,
            zero_stage=self.zero_stage,
            reduce_bucket_bytes=self.reduce_bucket_size * FP32_BYTES,
            allgather_bucket_bytes=self.allgather_bucket_size * FP32_BYTES,
            persistence_bytes=self.param_persistence_threshold * FP32_BYTES,
            micro_steps=self.tools.grad_accumulation,
            meta={"method": self.name, "model": workload.name, "zero_stage": self.zero_stage},
        )
        details = {
            "zero_stage": self.zero_stage,
            "micro_batch": micro,
            "batch_shares": [share] * n,
            "optimizer": f"torch.optim.Adam(lr={self.lr:g})",
            "moe": moe,
            "ds_config": config,
            "memory_tools": self.tools.details(profile.checkpoint_units),
        }
        plan = Plan(self.name, [share] * n, details=details, program=program, ratios=even_ratios(n))
        if self.engine_probe and cluster.host_flops and cluster.emulated and cluster.device == "cpu":
            engine = details["engine"] = engine_work(self, plan, workload, cluster)
            if engine is not None:
                plan.program = replace(
                    program,
                    host_work_flops=added_host_work_flops(
                        engine["plain_s"], engine["engine_s"], workload, share, cluster
                    ),
                )
        return plan

    # -- running (one worker rank) ------------------------------------------------------------
    def setup(self, plan: Plan, model: nn.Module, ctx: RankContext) -> DeepSpeedTrainer:
        deepspeed = import_deepspeed()
        use_accelerator(ctx.device.type)
        deepspeed.utils.logger.setLevel(self.log_level)
        # DeepSpeed 0.19.8 still calls torch.distributed's old all-gather name: one warning per
        # rank and case that says nothing about the run.
        warnings.filterwarnings("ignore", message=r".*all_gather_into_tensor. is deprecated", category=FutureWarning)
        # DeepSpeed insists on LOCAL_RANK (torchrun sets it; bench.runtime.launch runs one host, where the
        # local rank is the rank) and picks its GPU by it.
        local_rank = ctx.device.index if ctx.device.type == "cuda" else ctx.rank
        os.environ.setdefault("LOCAL_RANK", str(local_rank))
        if not self.shm_comm_op:
            skip_shm_comm_op(deepspeed)
        full_model = copy.deepcopy(model) if self.mirror_full_state else None
        moe = plan.details.get("moe")
        if moe:
            swap_moe_layers(model, moe, ctx.rank, deepspeed)
        units, micro_steps = memory_tools_of(plan.details)
        apply_checkpointing(model, units)
        param_groups: list[dict] = [{"name": "parameters", "params": list(model.parameters())}]
        if moe:
            from deepspeed.moe.utils import split_params_into_different_moe_groups_for_optimizer

            # ZeRO keeps expert parameters in their own groups, reduced over the expert
            # data-parallel group (one device, as ep_size = devices) instead of all devices.
            param_groups = split_params_into_different_moe_groups_for_optimizer(param_groups)
        optimizer = torch.optim.Adam(param_groups, lr=self.lr)
        engine, *_ = deepspeed.initialize(
            model=model, optimizer=optimizer, config=plan.details["ds_config"], dist_init_required=False
        )
        return DeepSpeedTrainer(engine, ctx, micro_steps, full_model)


def engine_work(
    method: DeepSpeedZeRO,
    plan: Plan,
    workload: Workload,
    cluster: ClusterSpec,
    seed: int = 0,
    repeats: int = DEFAULT_REPEATS,
) -> dict | None:
    """What the engine adds to a training step on an emulated CPU worker, beside the model's own
    work: {"plain_s", "engine_s"}, the median over ranks of the seconds a rank computes in a
    plain step (forward, backward, Adam on the whole model) and in the method's own step
    (setup()'s trainer: engine, hooks, buckets, ZeRO partitions, MoE layers), at the plan's
    micro-batch (bench.runtime.method_step). On CPU ranks the engine adds a sizeable share to the
    tiny models' steps (docs/methods.md, "DeepSpeed").

    Measured once per host, workload, devices and config, then cached. None, with a warning,
    where it cannot be measured (deepspeed missing or failing): the plan then prices the model's
    work only."""
    step = time_method_step(
        method,
        plan,
        workload,
        cluster,
        cache="deepspeed_engine",
        config=[plan.details["ds_config"], plan.details.get("moe"), method.lr, method.shm_comm_op]
        + (
            [plan.details["memory_tools"]["checkpoint_units"]]
            if plan.details["memory_tools"]["checkpoint_units"]
            else []
        ),
        version=ENGINE_PROBE_VERSION,
        what="DeepSpeed's engine work",
        requires={"deepspeed": INSTALL_HINT},
        seed=seed,
        repeats=repeats,
    )
    return None if step is None else {"plain_s": step["plain_s"], "engine_s": step["method_s"]}
