"""One rank of a real run: join the process group, set the method up, time the iterations.

The same function runs under bench.runtime.launch (spawned workers on one host, gloo) and under
torchrun (one process per GPU or per host, env:// rendezvous, NCCL on GPUs). It applies the
case's precision around every method's step and reports an out-of-memory rank distinctly; what
an emulated rank does around its steps (pacing, untimed iterations, test hooks) is
bench.runtime.pacing's. It does not start processes or MPS (bench.runtime.launch does).
"""

from __future__ import annotations

import contextlib
import gc
import math
import os
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from bench.core.cluster import ClusterSpec
from bench.core.interfaces import Plan, RankContext, Workload
from bench.core.shares import offsets
from bench.core.weights import Weights, build_meta
from bench.runtime import hostcpu
from bench.runtime.emulation import EmulationSettings
from bench.runtime.pacing import Pacing, RankHooks, peak_mem_gib
from bench.runtime.precision import ForwardDtypes, precision_in_force, set_precision, step_context


@dataclass
class Case:
    """Everything a rank needs; picklable, so it travels to spawned workers."""

    workload: Workload
    cluster: ClusterSpec
    method: Any  # a bench.core.interfaces.Method
    plan: Plan
    seed: int
    warmup_iters: int
    measured_iters: int
    emulation: EmulationSettings | None = None  # emulated clusters: how they are paced (None: defaults)
    precision: str = "fp32"  # one of bench.runtime.precision.PRECISIONS
    hooks: RankHooks = field(default_factory=RankHooks)  # tests' asks (bench.runtime.pacing.RankHooks)


class RankOutOfMemory(RuntimeError):
    """A rank ran out of device (or host) memory; carries its peak memory so far."""

    def __init__(self, rank: int, peak_mem_gib: float, detail: str):
        super().__init__(f"rank {rank} ran out of memory (peak {peak_mem_gib:.2f} GiB):\n{detail}")
        self.rank, self.peak_mem_gib, self.detail = rank, peak_mem_gib, detail


def is_out_of_memory(exc: BaseException) -> bool:
    """CUDA's OutOfMemoryError, Python's MemoryError, or torch's CPU allocator refusing (a
    RuntimeError that names it: the CPU allocator has no exception type of its own)."""
    if isinstance(exc, (torch.cuda.OutOfMemoryError, MemoryError)):
        return True
    return isinstance(exc, RuntimeError) and "can't allocate memory" in str(exc)


def pick_device(local_rank: int, cluster: ClusterSpec | None = None) -> torch.device:
    """cpu for a cluster that computes on cpu (emulated by default); an emulated cuda cluster
    puts every rank on GPU 0 (MPS shares it); otherwise one GPU per local rank when there are GPUs."""
    if cluster is not None and cluster.device == "cpu":
        return torch.device("cpu")
    if cluster is not None and cluster.emulated:
        return torch.device("cuda", 0)
    if torch.cuda.is_available():
        return torch.device("cuda", local_rank % torch.cuda.device_count())
    return torch.device("cpu")


def init_process_group(rank: int, world_size: int, device: torch.device, backend: str | None = None) -> None:
    """env:// rendezvous (MASTER_ADDR/PORT set by bench.runtime.launch or torchrun). Default backend:
    NCCL on a GPU, gloo on the CPU."""
    backend = backend or ("nccl" if device.type == "cuda" else "gloo")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    dist.init_process_group(backend, rank=rank, world_size=world_size)


# What a rank of a cluster that computes on the CPU sets before anything touches CUDA: it sees no
# GPU, so no library picks one behind the harness's back (on a GPU host DeepSpeed's engine took
# CUDA and set the device to the local rank: "invalid device ordinal" for rank 1 of 2).
CPU_ONLY_ENV = {"CUDA_VISIBLE_DEVICES": ""}


def backend_for(cluster: ClusterSpec, device: torch.device) -> str:
    """gloo for emulated clusters: NCCL refuses two ranks of one communicator on one GPU, and
    gloo takes CUDA tensors (it copies them through host memory itself)."""
    return "gloo" if cluster.emulated or device.type == "cpu" else "nccl"


def rank_hardware(device: torch.device) -> dict:
    """What this rank ran on: the GPU (name, memory, driver, CUDA, NCCL) or the CPU (model,
    cores). Driver only through nvidia-ml-py (pynvml) when it is installed; else null."""
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        nccl = torch.cuda.nccl.version() if hasattr(torch.cuda, "nccl") else None
        return {
            "device": "cuda",
            "name": props.name,
            "memory_gib": props.total_memory / 2**30,
            "capability": f"{props.major}.{props.minor}",
            "multiprocessors": props.multi_processor_count,
            "driver": _nvidia_driver(),
            "cuda": torch.version.cuda,
            "nccl": ".".join(map(str, nccl)) if isinstance(nccl, tuple) else nccl,
            "mps_active_thread_percentage": _env_number("CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"),
        }
    return {
        "device": "cpu",
        "name": hostcpu.cpu_model(),
        "cores": os.cpu_count(),
        "cores_usable": hostcpu.host_cores(),
        "threads": torch.get_num_threads(),
    }


def _nvidia_driver() -> str | None:
    try:
        import pynvml
    except ImportError:
        return None
    try:
        pynvml.nvmlInit()
        try:
            version = pynvml.nvmlSystemGetDriverVersion()
        finally:
            pynvml.nvmlShutdown()
    except pynvml.NVMLError:
        return None
    return version.decode() if isinstance(version, bytes) else version


def _env_number(name: str) -> float | None:
    value = os.environ.get(name)
    return None if value is None else float(value)


# Process groups a launched worker keeps after destroying them (run_rank(keep_group=True)).
_RETIRED_GROUPS: list = []


def run_rank(
    case: Case,
    rank: int,
    world_size: int,
    local_rank: int,
    progress: Callable[[int], None] | None = None,
    gather: bool = False,
    keep_group: bool = False,
):
    """Train `case` on this rank for one round; returns plain numbers (safe to send between
    processes). With gather=True (torchrun), rank 0 returns every rank's result and the others
    None. keep_group: see rank_session."""
    with rank_session(case, rank, world_size, local_rank, keep_group) as training:
        result = training.run_round(progress)
        if gather:  # while the process group is there
            everyone = [None] * world_size if rank == 0 else None
            dist.gather_object(result, everyone, dst=0)
            return everyone
    return result


@contextlib.contextmanager
def rank_session(case: Case, rank: int, world_size: int, local_rank: int, keep_group: bool = False):
    """This rank of `case` for as many rounds as its caller runs (TrainingRank.run_round): the
    process joins the case's group and sets the method up once; the group goes when it ends.

    keep_group: hold a reference to the destroyed process group until the process ends, for a
    worker that ends without running destructors (bench.runtime.launch's forked ones, by os._exit). A gloo work
    that completes after destroy_process_group can otherwise drop the group's last reference
    on one of the group's own threads, whose destructor then joins that thread: "terminate
    called after throwing an instance of 'std::system_error' / Resource deadlock avoided",
    rank 0 of a dp_cp case aborted while sending its result (once in about 700 launches).
    """
    device = pick_device(local_rank, case.cluster)
    emulated = case.cluster.emulated
    # On a GPU, compute runs at the rank's MPS share (real kernels, bench.runtime.launch): only links
    # are emulated. On the CPU, slow ranks sleep their compute out.
    pace_compute = emulated and device.type == "cpu"
    # One core per CPU device (slow ranks sleep, not spin), denormals flushed, a steady malloc.
    hostcpu.configure_process(one_thread=device.type == "cpu")
    # Bound before the process group starts, so that gloo's threads share the rank's core.
    pin = pace_compute and (case.emulation or EmulationSettings()).pin_cores
    core = hostcpu.pin_to_core(local_rank) if pin else None
    set_precision(case.precision)
    if not dist.is_initialized():
        init_process_group(rank, world_size, device, backend_for(case.cluster, device))
    try:
        with _out_of_memory_as(rank, device):
            yield TrainingRank(case, rank, world_size, device, emulated, pace_compute, core)
    finally:
        if keep_group:
            _RETIRED_GROUPS.append(dist.group.WORLD)
        dist.destroy_process_group()
        # Free the process group now, while Python runs: objects in reference cycles (DDP's
        # module) keep it alive until a collection, and at interpreter exit gloo's threads,
        # still freeing a finished gather's tensors, cannot take the GIL and abort the process
        # ("terminate called without an active exception", seen in some torchrun runs).
        gc.collect()


@contextlib.contextmanager
def _out_of_memory_as(rank: int, device: torch.device):
    """A rank's out-of-memory error, wherever in set-up or a round, as RankOutOfMemory."""
    try:
        yield
    except Exception as exc:
        if not is_out_of_memory(exc):
            raise
        # An emulated device's limit carries the tensors' peak; elsewhere the allocator's (CUDA)
        # or the process's (CPU) peak.
        peak = getattr(exc, "peak_gib", None)
        raise RankOutOfMemory(rank, peak_mem_gib(device) if peak is None else peak, traceback.format_exc()) from None


class TrainingRank:
    """One rank of a case, built and set up once, then trained round after round.

    The first round runs the untimed iterations (lazy set-up, the pacing reference: bench.runtime.pacing)
    before its warm-up and measured ones; a later round sets the reference again
    (emulation.reference_each_round; or keeps the first round's) and runs the warm-up and
    measured iterations, on the same batches as the first. A round's result is what one run of
    the case reports (its `timings` say where its wall time went: set-up, which only the first
    round pays, untimed iterations and the timed ones).
    """

    def __init__(
        self,
        case: Case,
        rank: int,
        world_size: int,
        device: torch.device,
        emulated: bool,
        pace_compute: bool,
        core: int | None = None,
    ):
        start = time.perf_counter()
        self.case, self.rank, self.world_size, self.device = case, rank, world_size, device
        self.pacing = pacing = Pacing(case, rank, device, emulated, pace_compute, core)
        workload = case.workload
        # Parameters on meta, the constructor's buffers on the CPU (bench.core.weights): counted
        # from here, the storages a parameter's constructor made and dropped at once not counted.
        model = build_meta(workload.model_cfg, case.seed)
        pacing.count(model.buffers())
        with pacing.counting_tensors():
            weights = Weights(model, case.seed, workload.model_cfg)
            if not getattr(case.method, "materializes", False):  # the method replicates the model
                weights.materialize(model, device)
            ctx = RankContext(rank, world_size, device, case.cluster, workload, pacing.emulator, weights)
            with pacing.emulator.paused():  # set-up is not part of an iteration: not emulated
                self.trainer = case.method.setup(case.plan, model, ctx)
        # What the trainer does not hold (hap's unsharded copies) is freed. A method that
        # materialises its part keeps the full model its state is mirrored into (tests) itself.
        mirror = getattr(self.trainer, "full_model", None)
        self.model = (model if mirror is None else mirror) if case.hooks.return_state else None
        del model, weights, ctx
        self.data = workload.model_cfg.dataset(
            workload.data["source"],
            workload.data.get("path"),
            workload.data.get("split", "train"),
            case.seed,
        )
        self.slice = (case.plan.data_slices or offsets(case.plan.batch_shares))[rank]
        self.rounds = 0
        self.setup_s = time.perf_counter() - start

    def run_round(self, progress: Callable[[int], None] | None = None) -> dict:
        """One round: the rank's result (iteration times, losses, memory, emulation report)."""
        case, pacing, device, workload = self.case, self.pacing, self.device, self.case.workload
        start = time.perf_counter()
        first = self.rounds == 0
        if first:
            pacing.measure_host()
        else:
            pacing.begin_round()
        iter_times, losses, mems = [], [], []
        precision = None
        # The first iteration, where it is not measured, shows the dtypes the forward really made.
        watch = ForwardDtypes() if first and pacing.untimed + case.warmup_iters > 0 else None
        timed_from = None
        for it in range(0 if first else pacing.round_start, pacing.total_iters):
            # Every round trains the same batches: iteration `it` of the first round's numbering.
            batch = tuple(t.to(device) for t in self.data.batch(it, *self.slice, workload.global_batch))
            if it == pacing.untimed:
                timed_from = time.perf_counter()
            with (
                pacing.step(it) as step,
                step_context(case.precision, device),
                watch if watch is not None and it == 0 else contextlib.nullcontext(),
            ):
                precision = precision or precision_in_force(case.precision, device)
                loss = self.trainer.step(batch)
            if step.seconds is not None:  # a timed iteration (warm-up or measured)
                iter_times.append(step.seconds)
                mems.append(peak_mem_gib(device))  # after the clock: not part of the iteration
            value = float(loss)
            if not math.isfinite(value):
                raise FloatingPointError(f"loss is {value} at step {it} on rank {self.rank}")
            losses.append(value)
            if progress is not None and step.seconds is not None:
                progress(it + 1 - pacing.untimed)
        end = time.perf_counter()
        timed_from = end if timed_from is None else timed_from
        result = {
            "rank": self.rank,
            "pid": os.getpid(),
            "round": self.rounds,
            "iter_times_s": iter_times,
            "loss_sums": losses,
            "peak_mem_gib": pacing.peak_mem_gib(),
            "tensor_peak_gib": pacing.tensor_peak_gib,
            "peak_mem_gib_per_iter": mems,
            "emulation": pacing.report(),
            "host": os.uname().nodename,
            "hardware": rank_hardware(device),
            "precision": {
                **(precision or {}),
                "forward_matmul_dtypes": None if watch is None else watch.observed(),
            },
            "timings": {
                "setup_s": self.setup_s if first else 0.0,
                "untimed_s": timed_from - start if first or pacing.rereferences else 0.0,
                "iterations_s": end - timed_from,
            },
        }
        if case.hooks.return_state and self.rank == 0:
            model = self.model
            result["grads"] = {
                n: p.grad.detach().cpu().numpy() for n, p in model.named_parameters() if p.grad is not None
            }
            result["params"] = {n: p.detach().cpu().numpy() for n, p in model.named_parameters()}
        self.rounds += 1
        return result
