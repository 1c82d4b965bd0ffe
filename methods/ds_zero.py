"""The DeepSpeed baseline: the real DeepSpeed engine with ZeRO data parallelism (stages 0-3) and,
for BERT-MoE, DeepSpeed's own MoE layer with one expert-parallel group over all devices.

It does not balance load: DeepSpeed gives every device the same micro-batch, which is what this
baseline measures on mixed GPUs. deepspeed is imported only by setup() and by the engine probe
(engine_work, in a child process), so planning and simulating work without it.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import logging
import multiprocessing as mp
import multiprocessing.connection as mp_connection
import os
import statistics
import tempfile
import time
import warnings
from dataclasses import dataclass, replace
from typing import Any

import torch
from torch import nn

from bench.core.cluster import ClusterSpec
from bench.core.errors import ConfigError
from bench.core.interfaces import Plan, RankContext, Workload
from bench.core.program import Affine, Collective, Memory, Program, Stage
from bench.cost import even_ratios
from bench.runtime.emulation import EmulationSettings
from bench.runtime.hostcpu import emulated_device
from bench.runtime.hostspeed import host_cache_file, host_key, read_cache, write_cache

ZERO_STAGES = (0, 1, 2, 3)
INSTALL_HINT = "DS_BUILD_OPS=0 pip install deepspeed==0.19.8"
FP32_BYTES = 4
# Adam's two moments; ZeRO 1-3 also keep an fp32 copy of the parameter partition (even in fp32
# training), so their optimizer state is three parameter-sized tensors per partition.
ADAM_STATE_COPIES = 2
ZERO_STATE_COPIES = 3
ENGINE_PROBE_VERSION = 2  # a cached probe made another way is measured again
PROBE_TIMEOUT_S = 300

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
    """

    modes = ("real", "sim")
    # What setup imports in each worker, for the server CPU workers fork from to import once
    # (bench.runtime.launch.method_modules): DeepSpeed, its MoE layer, and the Muon optimizer
    # module that deepspeed.initialize imports to check the optimizer, which compiles a function
    # with torch's compiler at import (seconds of each worker's set-up:
    # results/harness/20261127-preparation-costs.md). The server skips a name that another
    # DeepSpeed version lacks.
    worker_modules = ("deepspeed", "deepspeed.moe.layer", "deepspeed.runtime.zero.muon.muon_optimizer")

    def __init__(self, name: str = "deepspeed", zero_stage: int = 1, lr: float = 5e-4,
                 grad_clip: float = 0.0, reduce_bucket_size: float = 5e8,
                 allgather_bucket_size: float = 5e8, param_persistence_threshold: float = 1e5,
                 moe_capacity_factor: float | None = None, moe_min_capacity: int = 0,
                 shm_comm_op: bool = False, log_level: str = "warning", engine_probe: bool = True):
        if isinstance(zero_stage, bool) or zero_stage not in ZERO_STAGES:
            raise ConfigError(f"method.zero_stage={zero_stage!r} is invalid; use one of "
                              f"{', '.join(map(str, ZERO_STAGES))}")
        if not lr > 0 or not grad_clip >= 0:
            raise ConfigError(f"method.lr={lr!r} must be > 0 and method.grad_clip={grad_clip!r} >= 0")
        for key, value in (("reduce_bucket_size", reduce_bucket_size),
                           ("allgather_bucket_size", allgather_bucket_size)):
            if not value >= 1:
                raise ConfigError(f"method.{key}={value!r} must be >= 1 (elements); DeepSpeed's default is 5.0e8")
        if not param_persistence_threshold >= 0:
            raise ConfigError(f"method.param_persistence_threshold={param_persistence_threshold!r} "
                              "must be >= 0 (elements)")
        if moe_capacity_factor is not None and not moe_capacity_factor > 0:
            raise ConfigError(f"method.moe_capacity_factor={moe_capacity_factor!r} must be > 0, "
                              "or null to match the model's capacity")
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

    # -- planning (CPU only, no deepspeed) ----------------------------------------------------
    def micro_batch(self, workload: Workload, cluster: ClusterSpec) -> int:
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
            raise ConfigError(f"model={workload.name} routes to top_k={top_k} experts; DeepSpeed's "
                              "MoE gate supports top_k 1 or 2")
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
            "capacity": deepspeed_capacity(micro * cfg.seq_len, int(num_experts), float(factor), top_k,
                                           self.moe_min_capacity),
        }

    def ds_config(self, micro_batch: int, num_devices: int) -> dict:
        """The DeepSpeed config (JSON-ready): fp32, no fused ops, the client optimizer is Adam."""
        zero: dict[str, Any] = {
            "stage": self.zero_stage,
            "reduce_bucket_size": self.reduce_bucket_size,
            "allgather_bucket_size": self.allgather_bucket_size,
        }
        if self.zero_stage == 3:
            zero["stage3_param_persistence_threshold"] = self.param_persistence_threshold
        return {
            "train_batch_size": micro_batch * num_devices,
            "train_micro_batch_size_per_gpu": micro_batch,
            "gradient_accumulation_steps": 1,
            "gradient_clipping": self.grad_clip,
            "fp16": {"enabled": False},
            "bf16": {"enabled": False},
            "zero_optimization": zero,
            # torch.optim.Adam is on ZeRO's list of tested optimizers; other client optimizers
            # would need "zero_allow_untested_optimizer": true.
            "zero_allow_untested_optimizer": False,
            "steps_per_print": 2**31 - 1,
            "wall_clock_breakdown": False,
        }

    def plan(self, workload: Workload, cluster: ClusterSpec) -> Plan:
        micro = self.micro_batch(workload, cluster)
        moe = self.moe_settings(workload, cluster)
        n = cluster.num_devices
        config = self.ds_config(micro, n)
        program = zero_program(
            profile_workload(workload, micro, moe),
            num_devices=n,
            global_batch=workload.global_batch,
            zero_stage=self.zero_stage,
            reduce_bucket_bytes=self.reduce_bucket_size * FP32_BYTES,
            allgather_bucket_bytes=self.allgather_bucket_size * FP32_BYTES,
            persistence_bytes=self.param_persistence_threshold * FP32_BYTES,
            meta={"method": self.name, "model": workload.name, "zero_stage": self.zero_stage},
        )
        details = {
            "zero_stage": self.zero_stage,
            "micro_batch": micro,
            "batch_shares": [micro] * n,
            "optimizer": f"torch.optim.Adam(lr={self.lr:g})",
            "moe": moe,
            "ds_config": config,
        }
        plan = Plan(self.name, [micro] * n, details=details, program=program, ratios=even_ratios(n))
        if self.engine_probe and cluster.host_flops and cluster.emulated and cluster.device == "cpu":
            engine = details["engine"] = engine_work(self, plan, workload, cluster)
            if engine is not None:
                plan.program = replace(program, host_work_flops=host_work_flops(engine, workload, micro, cluster))
        return plan

    # -- running (one worker rank) ------------------------------------------------------------
    def setup(self, plan: Plan, model: nn.Module, ctx: RankContext) -> DeepSpeedTrainer:
        deepspeed = import_deepspeed()
        use_accelerator(ctx.device.type)
        deepspeed.utils.logger.setLevel(self.log_level)
        # DeepSpeed 0.19.8 still calls torch.distributed's old all-gather name: one warning per
        # rank and case that says nothing about the run.
        warnings.filterwarnings("ignore", message=r".*all_gather_into_tensor. is deprecated",
                                category=FutureWarning)
        # DeepSpeed insists on LOCAL_RANK (torchrun sets it; bench.runtime.launch runs one host, where the
        # local rank is the rank) and picks its GPU by it.
        local_rank = ctx.device.index if ctx.device.type == "cuda" else ctx.rank
        os.environ.setdefault("LOCAL_RANK", str(local_rank))
        if not self.shm_comm_op:
            skip_shm_comm_op(deepspeed)
        moe = plan.details.get("moe")
        if moe:
            swap_moe_layers(model, moe, ctx.rank, deepspeed)
        param_groups: list[dict] = [{"name": "parameters", "params": list(model.parameters())}]
        if moe:
            from deepspeed.moe.utils import split_params_into_different_moe_groups_for_optimizer

            # ZeRO keeps expert parameters in their own groups, reduced over the expert
            # data-parallel group (one device, as ep_size = devices) instead of all devices.
            param_groups = split_params_into_different_moe_groups_for_optimizer(param_groups)
        optimizer = torch.optim.Adam(param_groups, lr=self.lr)
        engine, *_ = deepspeed.initialize(model=model, optimizer=optimizer,
                                          config=plan.details["ds_config"], dist_init_required=False)
        return DeepSpeedTrainer(engine, ctx)


class DeepSpeedTrainer:
    """One iteration: engine forward, backward (gradient reduction inside), step."""

    def __init__(self, engine, ctx: RankContext):
        self.engine = engine
        self.emulator = ctx.emulator
        # DeepSpeed averages gradients over ranks like DDP: scaling each rank's summed loss by
        # world_size / (global loss terms) gives the gradient of the global mean loss.
        self.loss_scale = ctx.world_size / ctx.workload.targets_per_iter

    def forward_backward(self, batch: tuple[torch.Tensor, ...]) -> torch.Tensor:
        loss_sum = self.engine(*batch)
        self.emulator.stretch()  # forward compute
        self.engine.backward(loss_sum * self.loss_scale)
        self.emulator.stretch()  # backward compute after its last collective (DeepSpeed copies the reduced buckets back)
        return loss_sum.detach()

    def optimizer_step(self) -> None:
        self.engine.step()  # ZeRO 1-3: Adam on this rank's partition, then parameter all-gather
        self.emulator.stretch()  # optimizer compute after the last collective

    def step(self, batch: tuple[torch.Tensor, ...]) -> torch.Tensor:
        loss = self.forward_backward(batch)
        self.optimizer_step()
        return loss


# -- deepspeed, imported late -----------------------------------------------------------------
def use_accelerator(device_type: str) -> None:
    """DeepSpeed's accelerator for this rank's device. Left to itself it picks CUDA whenever it
    sees a GPU and sets the device to the local rank, also for ranks that compute on the CPU.
    The harness hides the GPUs from those before CUDA starts (bench.runtime.worker.CPU_ONLY_ENV); this
    makes the choice explicit where a process saw them already (run_rank called in-process)."""
    from deepspeed.accelerator import get_accelerator, set_accelerator

    if get_accelerator().device_name() == device_type:
        return
    if device_type == "cuda":
        from deepspeed.accelerator.cuda_accelerator import CUDA_Accelerator as Accelerator
    else:
        from deepspeed.accelerator.cpu_accelerator import CPU_Accelerator as Accelerator
    set_accelerator(Accelerator())


def import_deepspeed():
    """import deepspeed, or one line that says what is wrong and how to install it."""
    try:
        import deepspeed
        import deepspeed.moe.layer
    except Exception as exc:  # a broken install fails in many ways (CUDA mismatch, missing ops)
        reason = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
        raise ImportError(
            f"method=deepspeed needs deepspeed, which is missing or broken ({type(exc).__name__}: "
            f"{reason}); install it with: {INSTALL_HINT}"
        ) from None
    return deepspeed


def skip_shm_comm_op(deepspeed) -> None:
    """Keep DeepSpeed from JIT-compiling its shared-memory comm op for CPU ranks.

    deepspeed.comm builds it (~40 s on first use, then cached in ~/.cache/torch_extensions)
    when it creates its torch backend, if the op is marked compatible; only
    inference_all_reduce uses it, and training falls back to torch.distributed without it.
    deepspeed.ops.__compatible_ops__ is one dict probed once per process, so marking the op
    incompatible before deepspeed.initialize is enough. GPU accelerators have no such op.
    """
    from deepspeed.accelerator import get_accelerator

    builder = get_accelerator().create_op_builder("ShareMemCommBuilder")
    if builder is not None:
        deepspeed.ops.__compatible_ops__[builder.NAME] = False


def engine_work(method: DeepSpeedZeRO, plan: Plan, workload: Workload, cluster: ClusterSpec,
                seed: int = 0, repeats: int = EmulationSettings.reference_iters) -> dict | None:
    """What the engine adds to a training step on an emulated CPU worker, beside the model's own
    work: {"plain_s", "engine_s"}, the median over ranks of the seconds a rank computes in a
    plain step (forward, backward, Adam on the whole model) and in the method's own step
    (setup()'s trainer: engine, hooks, buckets, ZeRO partitions, MoE layers), interleaved, at
    the plan's micro-batch, each timed as a run times it (_engine_probe). The ranks are child
    processes, one per device and core, in a gloo world of their own. On CPU ranks the engine
    adds a sizeable share to the tiny models' steps (results/methods/20261126-deepspeed-engine-probe.md;
    docs/methods.md, "DeepSpeed").

    Measured once per host, workload, devices and config, then read from the cache next to the
    host speeds (bench.runtime.hostspeed.host_cache_file). None, with a warning, where it cannot be measured
    (deepspeed missing or failing): the plan then prices the model's work only."""
    n, micro = cluster.num_devices, plan.batch_shares[0]
    path = host_cache_file().with_name("deepspeed_engine.json")
    body = [host_key(workload, micro, seed), n, plan.details["ds_config"], plan.details.get("moe"),
            method.lr, method.shm_comm_op, repeats, ENGINE_PROBE_VERSION]
    key = hashlib.sha256(json.dumps(body, sort_keys=True).encode()).hexdigest()[:16]
    cached = read_cache(path).get(key)
    if cached:
        return {"plain_s": cached["plain_s"], "engine_s": cached["engine_s"]}
    if importlib.util.find_spec("deepspeed") is None:  # no child to start: it could only fail
        log.warning("DeepSpeed's engine work was not measured (deepspeed is not installed: %s); "
                    "its plan prices the model's work and collectives only", INSTALL_HINT)
        return None
    ctx = mp.get_context("spawn")
    with tempfile.TemporaryDirectory(prefix="hetbench-ds-probe-") as folder:
        pipes = [ctx.Pipe(duplex=False) for _ in range(n)]
        procs = [ctx.Process(target=_engine_probe, daemon=True,
                             args=(r, n, f"{folder}/store", method, plan, workload, cluster, seed, repeats, pipes[r][1]))
                 for r in range(n)]
        for p in procs:
            p.start()
        for _, send in pipes:
            send.close()
        answers = _gather({receive: r for r, (receive, _) in enumerate(pipes)}, PROBE_TIMEOUT_S)
        errors = [a["error"] for a in answers.values() if "error" in a]
        if not errors and len(answers) < n:
            errors.append(f"no answer from every rank within {PROBE_TIMEOUT_S} s")
        for p in procs:  # a rank still waiting on a peer that failed is stopped here
            p.join(0 if errors else 10)
            if p.is_alive():
                p.kill()
    if errors:
        log.warning("DeepSpeed's engine work was not measured (%s); its plan prices the model's "
                    "work and collectives only", errors[0])
        return None
    out = {k: statistics.median(a[k] for a in answers.values()) for k in ("plain_s", "engine_s")}
    write_cache(path, key, {**out, "workload": workload.name, "micro_batch": micro, "devices": n})
    return out


def _gather(pending: dict, timeout_s: float) -> dict:
    """Each probe rank's answer by rank, as they come, until all have answered, one has failed
    (its peers may be blocked in a collective) or `timeout_s` has passed."""
    deadline, answers = time.monotonic() + timeout_s, {}
    while pending and not any("error" in a for a in answers.values()):
        ready = mp_connection.wait(list(pending), timeout=max(deadline - time.monotonic(), 0))
        if not ready:
            break
        for conn in ready:
            rank = pending.pop(conn)
            try:
                answers[rank] = conn.recv()
            except EOFError:
                answers[rank] = {"error": f"probe rank {rank} exited without an answer"}
    return answers


def _engine_probe(rank: int, world_size: int, store: str, method: DeepSpeedZeRO, plan: Plan,
                  workload: Workload, cluster: ClusterSpec, seed: int, repeats: int, conn) -> None:
    """One rank of engine_work. The method's steps run under the run's own emulator in its
    reference phase (bench.runtime.emulation: per interval between collectives, the fastest thread CPU
    time; collectives at loopback speed, not counted), the plain steps as the run's yardstick
    times them (bench.runtime.hostspeed.yardstick: the fastest thread CPU time of a whole step)."""
    try:
        import torch.distributed as dist

        from bench.runtime import hostcpu
        from bench.runtime.emulation import ArrivalBoard, Emulator

        hostcpu.pin_to_core(rank)  # as the workers are
        # The emulator's arrival board goes in the probe's folder, removed with it: the probe
        # ends in os._exit, which runs no exit handler.
        os.environ.update(RANK=str(rank), WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank),
                          **{ArrivalBoard.ENV: os.path.join(os.path.dirname(store), "arrivals")})
        dist.init_process_group("gloo", store=dist.FileStore(store, world_size), rank=rank, world_size=world_size)
        warnings.filterwarnings("ignore", category=FutureWarning)
        with emulated_device():
            data = workload.model_cfg.synthetic_batch(plan.batch_shares[rank], torch.Generator().manual_seed(seed))
            model = workload.build(seed)
            optimizer = torch.optim.Adam(model.parameters(), lr=method.lr)
            emulator = Emulator(cluster, rank, enabled=True, settings=EmulationSettings(reference_iters=repeats))
            emulator.install()  # before setup: DeepSpeed keeps references to the collectives
            ctx = RankContext(rank, world_size, torch.device("cpu"), cluster, workload, emulator)
            trainer = method.setup(plan, workload.build(seed), ctx)
            plain = []
            for i in range(EmulationSettings.SKIPPED + repeats):
                start = time.thread_time()
                optimizer.zero_grad(set_to_none=True)
                model(*data).backward()
                optimizer.step()
                plain.append(time.thread_time() - start)
                emulator.begin_iteration(i)
                trainer.step(data)
            emulator.begin_iteration(EmulationSettings.SKIPPED + repeats)  # sets the reference
        conn.send({"plain_s": min(plain[EmulationSettings.SKIPPED:]),
                   "engine_s": emulator.report()["reference_s_per_iter"]})
    except Exception as exc:  # reported to the parent, which plans without it
        conn.send({"error": f"{type(exc).__name__}: {exc}"})
    finally:
        conn.close()
        # Not a normal exit: DeepSpeed's groups keep gloo threads that abort at interpreter
        # teardown ("terminate called without an active exception").
        os._exit(0)


def host_work_flops(engine: dict, workload: Workload, micro_batch: int, cluster: ClusterSpec) -> float:
    """The engine's work as the Program's host work: the share it adds to the probe's plain
    step, times the plain step the cost model prices at this micro-batch (per-sample FLOPs plus
    the per-step part), in FLOPs at the host's rate. So it follows the host's speed (a run's
    own yardstick, bench.runner.case.predict_at_run_speed) and each device's (1/speed as long)."""
    added = max(engine["engine_s"] / engine["plain_s"] - 1.0, 0.0)
    return added * (workload.flops_per_sample * micro_batch + cluster.host_step_overhead_s * cluster.host_flops)


class DeepSpeedMoEBlock(nn.Module):
    """DeepSpeed's MoE layer with our MoE's call signature: (B,S,d) -> (B,S,d).

    DeepSpeed returns (output, l_aux, exp_counts). The auxiliary load-balancing loss is not
    added to the training loss, matching models.bert_moe (which has none).
    """

    def __init__(self, moe: nn.Module):
        super().__init__()
        self.moe = moe

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.moe(x)[0]


def swap_moe_layers(model: nn.Module, moe: dict, rank: int, deepspeed) -> int:
    """Replace every models.bert_moe.MoE by DeepSpeed's MoE with the same experts.

    The gate and this rank's experts (global experts rank * local .. rank * local + local - 1,
    DeepSpeed's expert-parallel layout) start from our layer's weights, so both models start
    from the same parameters. DeepSpeed's routing differs from ours: it normalises the two
    gate weights to sum to one and assigns slots over all of a rank's tokens, not per
    sequence (the same number of slots per expert with the default capacity factor, but a
    busy expert may take more of one sequence's tokens). The second expert is the runner-up,
    not sampled (as in our model).
    """
    # The one model import of this module: the layer type this method rewrites.
    from models.bert_moe import MoE as ZooMoE
    from models.bert_moe import replace_moe_layers

    local = moe["num_experts"] // moe["ep_size"]
    first = rank * local

    def factory(ours: ZooMoE) -> nn.Module:
        if ours.num_experts != moe["num_experts"] or ours.top_k != moe["k"]:
            raise ValueError(f"MoE layer with {ours.num_experts} experts, top-{ours.top_k}; the plan "
                             f"expected {moe['num_experts']} experts, top-{moe['k']}")
        theirs = deepspeed.moe.layer.MoE(
            hidden_size=moe["d_model"], expert=ours.expert(first),  # a template, copied per expert
            num_experts=moe["num_experts"], ep_size=moe["ep_size"], k=moe["k"],
            capacity_factor=moe["capacity_factor"], eval_capacity_factor=moe["eval_capacity_factor"],
            min_capacity=moe["min_capacity"], drop_tokens=True, use_residual=False,
            use_rts=False, top2_2nd_expert_sampling=False,
        ).to(ours.w1.device)
        with torch.no_grad():
            theirs.deepspeed_moe.gate.wg.weight.copy_(ours.gate.weight)
            for j, expert in enumerate(theirs.deepspeed_moe.experts.deepspeed_experts):
                expert.load_state_dict(ours.expert(first + j).state_dict())
        return DeepSpeedMoEBlock(theirs)

    return replace_moe_layers(model, factory)


# -- DeepSpeed's MoE capacity (no deepspeed import) ---------------------------------------------
def deepspeed_capacity(tokens: int, num_experts: int, capacity_factor: float, k: int, min_capacity: int) -> int:
    """Slots per expert DeepSpeed's gate gives one rank's `tokens` tokens (with drop_tokens).

    As deepspeed.moe.sharded_moe._capacity (0.19.8) computes it: top1gating passes
    torch.tensor(capacity_factor), top2gating torch.tensor(capacity_factor * 2) and topkgating
    torch.tensor(capacity_factor * k), i.e. a float32 tensor; the capacity is then
    ceil((tokens / num_experts) * factor) in float32, and at least min_capacity.
    """
    factor = torch.tensor(capacity_factor * k)
    return max(int(torch.ceil((tokens / num_experts) * factor)), int(min_capacity))


def matching_capacity_factor(slots_per_seq: int, seq_len: int, micro_batch: int, num_experts: int, k: int) -> float:
    """DeepSpeed's capacity_factor that gives every expert exactly slots_per_seq x micro_batch
    slots over a rank's micro_batch sequences (min_capacity aside).

    The model gives each expert slots_per_seq slots in every sequence (routing groups are
    sequences); DeepSpeed's capacity is ceil(tokens / E * factor * k) over all of a rank's
    tokens, so factor = slots_per_seq * E / (seq_len * k) gives the same count, unless float32
    rounding puts the product just above the integer (e.g. 7 experts). Then the factor
    aims at the middle of the interval the ceil maps to the count. Checked with
    deepspeed_capacity either way.
    """
    target = slots_per_seq * micro_batch
    tokens = seq_len * micro_batch
    exact = slots_per_seq * num_experts / (seq_len * k)
    middle = (target - 0.5) * num_experts / (tokens * k)
    for factor in (exact, middle):
        if deepspeed_capacity(tokens, num_experts, factor, k, 0) == target:
            return factor
    raise ConfigError(
        f"no DeepSpeed capacity_factor gives {target} slots per expert for {tokens} tokens and "
        f"{num_experts} experts in float32; set method.moe_capacity_factor explicitly"
    )


# -- the Program for the simulator --------------------------------------------------------------
@dataclass(frozen=True)
class OpCost:
    """One parameter-holding op of the traced model, with the parameter-free ops before it."""

    fwd_flops: float  # per sample
    bwd_flops: float  # per sample
    param_bytes: float
    max_param_bytes: float  # the largest single parameter it reads (ZeRO-3 persistence)
    moe_layer: int | None = None  # index of the MoE layer whose experts it belongs to


@dataclass(frozen=True)
class WorkloadProfile:
    ops: tuple[OpCost, ...]
    activation_bytes_per_sample: float
    # Per MoE layer: bytes one device sends in one all-to-all, per sample of its batch.
    moe_all_to_all_bytes_per_sample: tuple[float, ...] = ()


def profile_workload(workload: Workload, batch: int, moe: dict | None) -> WorkloadProfile:
    """Per-op FLOPs and parameter bytes from the fx capture of the single-device model.

    The MoE layers' FLOPs are those of models.bert_moe at its slots per sequence, which are
    DeepSpeed's slots too with the default capacity factor (matching_capacity_factor); its
    per-sequence dense dispatch adds a few % to the experts' FLOPs that DeepSpeed's index-based
    dispatch does not spend. An explicit method.moe_capacity_factor or moe_min_capacity that
    gives DeepSpeed other slots changes the all-to-all bytes here, not the FLOPs.
    """
    from methods.capture import capture_config

    graph = capture_config(workload.model_cfg, batch)
    expert_prefixes: dict[str, int] = {}
    if moe:
        from models.bert_moe import MoE as ZooMoE

        with torch.device("meta"):
            model = workload.model_cfg.build()
        names = [name for name, m in model.named_modules() if isinstance(m, ZooMoE)]
        expert_prefixes = {f"{name}.{p}": i for i, name in enumerate(names) for p in ("w1", "b1", "w2", "b2")}
    ops: list[OpCost] = []
    fwd = bwd = 0.0
    for node in graph.nodes:
        fwd += node.flops / batch
        bwd += node.flops * node.backward_factor / batch
        params = [graph[i] for i in node.inputs if graph[i].is_param]
        if params and node.kind != "output":
            layers = {expert_prefixes.get(str(p.fx_node.target)) for p in params}
            layer = next(iter(layers)) if len(layers) == 1 else None
            nbytes = [float(p.nbytes) for p in params]
            ops.append(OpCost(fwd, bwd, sum(nbytes), max(nbytes), layer))
            fwd = bwd = 0.0
    if ops and (fwd or bwd):
        last = ops[-1]
        ops[-1] = OpCost(last.fwd_flops + fwd, last.bwd_flops + bwd, last.param_bytes,
                         last.max_param_bytes, last.moe_layer)
    a2a: tuple[float, ...] = ()
    if moe:
        # DeepSpeed's dispatch buffer: num_experts x capacity x d_model fp32 on every device, with
        # the capacity its gate computes for the device's batch of tokens.
        capacity = deepspeed_capacity(batch * workload.model_cfg.seq_len, moe["num_experts"],
                                      moe["capacity_factor"], moe["k"], moe["min_capacity"])
        per_sample = moe["num_experts"] * capacity * moe["d_model"] * FP32_BYTES / batch
        a2a = tuple(per_sample for _ in range(len(expert_prefixes) // 4))
    # Every activation kept beside the most activation gradients backward holds at once.
    return WorkloadProfile(tuple(ops), (graph.activation_bytes() + graph.peak_bytes_in_flight()) / batch, a2a)


def zero_program(profile: WorkloadProfile, *, num_devices: int, global_batch: int, zero_stage: int,
                 reduce_bucket_bytes: float, allgather_bucket_bytes: float,
                 persistence_bytes: float, meta: dict | None = None) -> Program:
    """The Program of one DeepSpeed ZeRO iteration (one segment, even ratios; per GPU).

    What each stage communicates (P = dense parameter bytes, n = devices):
      * ZeRO 0-2: forward and backward, then the gradients all-reduced in reduce buckets once
        backward is done (overlap_comm is off by default for stages 0-2; DeepSpeed 0.19's
        ZeRO-1/2 all-reduce whole buckets, use_multi_rank_bucket_allreduce=true, rather than
        reduce-scatter). ZeRO 1/2 then all-gather the updated parameters: each device sends
        its P / n partition, in allgather buckets.
      * ZeRO 3: parameters above the persistence threshold are all-gathered before each op in
        forward and again in backward (shard p / n per device), gradients reduce-scattered
        in reduce buckets; overlap_comm and prefetching are on by default, so these overlap
        the computation (an optimistic bound).
      * MoE layers: two all-to-alls in forward (dispatch, combine) and two in backward, each
        moving a device's dispatch buffer (see profile_workload). Expert parameters are not
        reduced across devices: each device owns num_experts / n experts.
    Memory per device (X = this device's expert bytes = expert bytes / n):
      params P + X (ZeRO-3: sharded P / n plus persistent ones and the largest gathered op),
      grads P + X (ZeRO 2/3: P / n + X), plus for ZeRO 1/2 the reduce bucket DeepSpeed allocates
      at its configured size (5e8 fp32 elements = 2 GB by default) and for ZeRO-3 one bucket of
      at most P; optimizer Adam 2 (P + X)
      (ZeRO 1-3: 3 P / n + 3 X, with DeepSpeed's fp32 partition copy).
    """
    if zero_stage not in ZERO_STAGES:
        raise ValueError(f"zero_stage={zero_stage} must be one of {ZERO_STAGES}")
    n, B = num_devices, global_batch
    ops = profile.ops
    dense = [0.0 if o.moe_layer is not None else o.param_bytes for o in ops]
    dense_bytes = sum(dense)
    expert_bytes = sum(o.param_bytes for o in ops if o.moe_layer is not None) / n
    a2a = profile.moe_all_to_all_bytes_per_sample
    gathered = [0.0] * len(ops)
    if zero_stage == 3:
        gathered = [d if o.max_param_bytes >= persistence_bytes else 0.0 for o, d in zip(ops, dense)]

    def a2a_collective(layer: int, label: str) -> Collective:
        return Collective("all_to_all", Affine.sharded(a2a[layer] * B), label=f"moe {layer} {label}")

    stages: list[Stage] = []
    flops = 0.0
    pending: list[Collective] = []
    overlap3 = zero_stage == 3

    def close(label: str, overlap: bool = False) -> None:
        nonlocal flops, pending
        if flops or pending:
            stages.append(Stage(tuple(pending), Affine.sharded(flops * B), overlap=overlap and bool(pending),
                                label=label))
        flops, pending = 0.0, []

    # Forward.
    prev_layer = None
    for i, o in enumerate(ops):
        if o.moe_layer != prev_layer:
            if prev_layer is not None:
                close(f"forward, moe {prev_layer} experts")
                pending.append(a2a_collective(prev_layer, "combine (forward)"))
            if o.moe_layer is not None:
                close("forward")
                pending.append(a2a_collective(o.moe_layer, "dispatch (forward)"))
            prev_layer = o.moe_layer
        if gathered[i]:
            close("forward", overlap3)
            pending.append(Collective("all_gather", Affine(gathered[i] / n), label=f"param all_gather op {i}"))
        flops += o.fwd_flops
    if prev_layer is not None:
        close(f"forward, moe {prev_layer} experts")
        pending.append(a2a_collective(prev_layer, "combine (forward)"))
    # Backward, in reverse; the gradient buckets fill as ops finish.
    prev_layer = None
    bucket = 0.0
    buckets: list[float] = []
    for i in range(len(ops) - 1, -1, -1):
        o = ops[i]
        if o.moe_layer != prev_layer:
            if prev_layer is not None:
                close(f"backward, moe {prev_layer} experts")
                pending.append(a2a_collective(prev_layer, "dispatch (backward)"))
            if o.moe_layer is not None:
                close("backward")
                pending.append(a2a_collective(o.moe_layer, "combine (backward)"))
            prev_layer = o.moe_layer
        if gathered[i]:
            close("backward", overlap3)
            pending.append(Collective("all_gather", Affine(gathered[i] / n), label=f"param all_gather op {i}"))
        if zero_stage == 3 and bucket >= reduce_bucket_bytes:
            close("backward", True)
            pending.append(Collective("reduce_scatter", Affine(bucket / n), label="grad reduce_scatter bucket"))
            bucket = 0.0
        flops += o.bwd_flops
        bucket += dense[i]
        if zero_stage < 3 and bucket >= reduce_bucket_bytes:
            buckets.append(bucket)
            bucket = 0.0
    if prev_layer is not None:
        close(f"backward, moe {prev_layer} experts")
        pending.append(a2a_collective(prev_layer, "dispatch (backward)"))
    close("backward")
    if zero_stage == 3:
        if bucket:
            stages.append(Stage((Collective("reduce_scatter", Affine(bucket / n), label="grad reduce_scatter bucket"),),
                                label="gradient reduce_scatter"))
    else:
        if bucket:
            buckets.append(bucket)
        reduce = tuple(Collective("all_reduce", Affine(b), label=f"grad bucket {k}") for k, b in enumerate(buckets))
        if reduce:
            stages.append(Stage(reduce, label="gradient all_reduce"))
        if zero_stage in (1, 2) and dense_bytes:
            # DeepSpeed splits the gather into max(1, P // allgather bucket) calls.
            calls = max(1, int(dense_bytes // allgather_bucket_bytes))
            gather = Collective("all_gather", Affine(dense_bytes / n / calls), label="param all_gather")
            stages.append(Stage((gather,) * calls, label="parameter all_gather"))
    bucket_bytes = min(dense_bytes, reduce_bucket_bytes)
    if zero_stage == 0:
        memory = Memory(Affine(dense_bytes + expert_bytes), Affine(dense_bytes + expert_bytes),
                        Affine(ADAM_STATE_COPIES * (dense_bytes + expert_bytes)),
                        Affine.sharded(profile.activation_bytes_per_sample * B))
    else:
        params = dense_bytes + expert_bytes
        if zero_stage == 3:
            persistent = sum(d for d, g in zip(dense, gathered) if not g)
            params = (dense_bytes - persistent) / n + persistent + max(gathered, default=0.0)
        # ZeRO 1/2 stage gradients in a reduce bucket allocated at its full configured size.
        bucket = reduce_bucket_bytes if zero_stage < 3 else bucket_bytes
        grads = (dense_bytes if zero_stage == 1 else dense_bytes / n) + expert_bytes + bucket
        memory = Memory(Affine(params), Affine(grads),
                        Affine(ZERO_STATE_COPIES * (dense_bytes / n + expert_bytes)),
                        Affine.sharded(profile.activation_bytes_per_sample * B))
    return Program(tuple(stages), n, 1, "gpu", memory, dict(meta or {}))
