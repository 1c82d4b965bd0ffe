"""Model FLOPs (torch's FlopCounterMode) and the measured speed of one host worker.

FLOPs count matmuls and convolutions (2 per multiply-add), forward and backward, as torch's
counter defines them; element-wise ops are not counted. That is the convention of "model FLOPs"
in MFU reports and of the ideal time in DESIGN.md.
"""

from __future__ import annotations

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


_host_flops_cache: dict[tuple, float] = {}


def measure_host_flops(workload: Workload, batch_size: int, seed: int, repeats: int = 5) -> float:
    """FLOP/s one worker thread sustains on this workload: the speed of an emulated device of
    speed 1.0. Runs a few forward+backward passes single-threaded, as the workers do, and keeps
    the fastest (the ideal time is a bound). Cached per workload in this process, so every
    method of one comparison is held to the same ideal."""
    key = (workload.name, repr(workload.model_cfg), batch_size, seed)
    if key in _host_flops_cache:
        return _host_flops_cache[key]
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        model = workload.build(seed)
        gen = torch.Generator().manual_seed(seed)
        batch = workload.model_cfg.synthetic_batch(max(batch_size, 1), gen)
        times = []
        for i in range(repeats + 1):
            start = time.perf_counter()
            model(*batch).backward()
            if i:  # the first pass pays for allocation and lazy initialisation
                times.append(time.perf_counter() - start)
            model.zero_grad(set_to_none=True)
    finally:
        torch.set_num_threads(threads)
    flops = workload.flops_per_sample * max(batch_size, 1) / min(times)
    _host_flops_cache[key] = flops
    return flops
