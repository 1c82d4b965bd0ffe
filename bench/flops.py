"""Model FLOPs (torch's FlopCounterMode) and the measured speed of one host worker.

FLOPs count matmuls and convolutions (2 per multiply-add), forward and backward, as torch's
counter defines them; element-wise ops are not counted. That is the convention of "model FLOPs"
in MFU reports and of the ideal time in DESIGN.md.
"""

from __future__ import annotations

import statistics
import time

import torch
from torch.utils.flop_counter import FlopCounterMode

from bench.interfaces import Workload


def train_flops_per_sample(model_cfg, samples: int = 2) -> float:
    """Forward + backward FLOPs per sample, counted on the meta device (nothing is allocated)."""
    with torch.device("meta"):
        model = model_cfg.build()
        batch = model_cfg.synthetic_batch(samples, None)
    with FlopCounterMode(display=False) as counter:
        model(*batch).backward()
    return counter.get_total_flops() / samples


_host_speed_cache: dict[tuple, tuple[float, float]] = {}


def measure_host_speed(workload: Workload, batch_size: int, seed: int,
                       repeats: int = 21) -> tuple[float, float]:
    """How fast one worker thread trains this workload: the emulated device of speed 1.0.

    Times whole training steps (forward, backward, Adam) single-threaded, as the workers run
    them, at `batch_size` and twice that, and splits a step into a part per sample and a part
    per step (optimizer, per-op dispatch: the same whatever a rank's share).

    Returns:
        (FLOP/s of the per-sample part, seconds of the per-step part). Cached per workload in
        this process, so every method of one comparison is held to the same numbers.
    """
    b = max(batch_size, 1)
    key = (workload.name, repr(workload.model_cfg), b, seed)
    if key not in _host_speed_cache:
        threads = torch.get_num_threads()
        torch.set_num_threads(1)
        try:
            t1, t2 = (_median_step_time(workload, n, seed, repeats) for n in (b, 2 * b))
        finally:
            torch.set_num_threads(threads)
        per_sample = max(t2 - t1, 0.5 * t1) / b  # noise must not make the fixed part negative
        fixed = max(t1 - per_sample * b, 0.0)
        _host_speed_cache[key] = (workload.flops_per_sample / per_sample, fixed)
    return _host_speed_cache[key]


def reference_step_s(workload: Workload, batch_size: int, seed: int, repeats: int = 21) -> float:
    """Median time of one plain training step (forward, backward, Adam) on one thread, measured
    now: a yardstick that no part of the harness (workers, emulator, methods) touches."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return _median_step_time(workload, max(batch_size, 1), seed, repeats)
    finally:
        torch.set_num_threads(threads)


def _median_step_time(workload: Workload, batch_size: int, seed: int, repeats: int) -> float:
    model = workload.build(seed)
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-6)
    batch = workload.model_cfg.synthetic_batch(batch_size, torch.Generator().manual_seed(seed))
    times = []
    for i in range(repeats + 2):
        start = time.perf_counter()
        optimizer.zero_grad(set_to_none=True)
        model(*batch).backward()
        optimizer.step()
        if i >= 2:  # the first steps pay for allocation and lazy initialisation
            times.append(time.perf_counter() - start)
    return statistics.median(times)
