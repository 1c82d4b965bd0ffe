"""One rank of a real run: join the process group, set the method up, time the iterations.

The same function runs under bench.launch (spawned workers on one host, gloo) and under
torchrun (one process per GPU or per host, env:// rendezvous, NCCL on GPUs).
"""

from __future__ import annotations

import math
import os
import resource
import time
from dataclasses import dataclass
from typing import Any, Callable

import torch
import torch.distributed as dist

from bench.cluster import ClusterSpec
from bench.emulation import EmulationSettings, Emulator
from bench.interfaces import Plan, RankContext, Workload
from bench.shares import offsets


@dataclass
class Case:
    """Everything a rank needs; picklable, so it travels to spawned workers."""

    workload: Workload
    cluster: ClusterSpec
    method: Any  # a bench.interfaces.Method
    plan: Plan
    seed: int
    warmup_iters: int
    measured_iters: int
    return_state: bool = False  # tests: send back rank 0's gradients and parameters
    fail_rank: int | None = None  # tests: this rank raises at its first iteration
    emulation: EmulationSettings | None = None  # emulated clusters: how they are paced (None: defaults)
    slowdown: float = 0.0  # tests and the regression demo: stretch each iteration by this fraction


def pick_device(local_rank: int) -> torch.device:
    if torch.cuda.is_available():
        return torch.device("cuda", local_rank % torch.cuda.device_count())
    return torch.device("cpu")


def init_process_group(rank: int, world_size: int, device: torch.device) -> None:
    """env:// rendezvous (MASTER_ADDR/PORT set by bench.launch or torchrun)."""
    backend = "nccl" if device.type == "cuda" else "gloo"
    if device.type == "cuda":
        torch.cuda.set_device(device)
    dist.init_process_group(backend, rank=rank, world_size=world_size)


def peak_mem_gib(device: torch.device) -> float:
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**30
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # Linux: KiB


def _busy(seconds: float) -> None:
    """Spin for `seconds` (a deliberate, uniform slowdown of the loop: regression demos)."""
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        pass


def run_rank(case: Case, rank: int, world_size: int, local_rank: int,
             progress: Callable[[int], None] | None = None, gather: bool = False):
    """Train `case` on this rank; returns plain numbers (safe to send between processes).

    With gather=True (torchrun), rank 0 returns every rank's result and the others None.
    """
    device = pick_device(local_rank)
    emulated = case.cluster.emulated and device.type == "cpu"
    if device.type == "cpu":
        torch.set_num_threads(1)  # one core per emulated device; slow ranks sleep, not spin
    torch.set_flush_denormal(True)  # denormal softmax gradients slow CPUs down several-fold
    if not dist.is_initialized():
        init_process_group(rank, world_size, device)
    try:
        emulator = Emulator(case.cluster, rank, enabled=emulated, settings=case.emulation)
        emulator.install()
        workload = case.workload
        model = workload.build(case.seed).to(device)
        ctx = RankContext(rank, world_size, device, case.cluster, workload, emulator)
        with emulator.paused():  # set-up is not part of an iteration: not emulated
            trainer = case.method.setup(case.plan, model, ctx)
        data = workload.model_cfg.dataset(
            workload.data["source"], workload.data.get("path"), workload.data.get("split", "train"),
            case.seed,
        )
        start, stop = offsets(case.plan.batch_shares)[rank]
        iter_times, losses, mems = [], [], []
        # Emulated ranks first run full-pace iterations that set their pacing reference (not
        # when a test checks exactness step by step: it needs exactly its own steps).
        refs = emulator.settings.reference_iters
        pre = emulator.settings.SKIPPED + refs if emulated and refs and not case.return_state else 0
        for it in range(pre + case.warmup_iters + case.measured_iters):
            if it == pre + case.warmup_iters:
                emulator.reset_stats()
            if case.fail_rank == rank:
                raise RuntimeError(f"deliberate failure of rank {rank} (fail_rank, a test option)")
            batch = tuple(t.to(device) for t in data.batch(it, start, stop, workload.global_batch))
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            emulator.begin_iteration(it)
            t0 = time.perf_counter()
            loss = trainer.step(batch)
            if case.slowdown:
                _busy(case.slowdown * (time.perf_counter() - t0))
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            if it >= pre:  # emulated time: wall time x headroom (1 when not emulated)
                iter_times.append((time.perf_counter() - t0) * emulator.headroom)
                mems.append(peak_mem_gib(device))  # after the clock: not part of the iteration
            value = float(loss)
            if not math.isfinite(value):
                raise FloatingPointError(f"loss is {value} at step {it} on rank {rank}")
            losses.append(value)
            if progress is not None and it >= pre:
                progress(it + 1 - pre)
        result = {
            "rank": rank,
            "iter_times_s": iter_times,
            "loss_sums": losses,
            "peak_mem_gib": peak_mem_gib(device),
            "peak_mem_gib_per_iter": mems,
            "emulation": emulator.report() if emulated else None,
            "host": os.uname().nodename,
        }
        if case.return_state and rank == 0:
            result["grads"] = {n: p.grad.detach().cpu().numpy() for n, p in model.named_parameters()
                               if p.grad is not None}
            result["params"] = {n: p.detach().cpu().numpy() for n, p in model.named_parameters()}
        if gather:
            everyone = [None] * world_size if rank == 0 else None
            dist.gather_object(result, everyone, dst=0)
            return everyone
        return result
    finally:
        dist.destroy_process_group()
