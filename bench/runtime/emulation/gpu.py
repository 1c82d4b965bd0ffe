"""Emulated ranks sharing one GPU under MPS (bench.runtime.mps): each rank's matmul probe, and the
speeds they achieved against their configured ones. No pacing: their kernels run at their share.
"""

from __future__ import annotations

import time

import torch


def achieved_speeds(speeds: list[float], flops: list[float]) -> list[float]:
    """Each rank's achieved speed on the configured scale: its share of the ranks' summed
    measured FLOP/s times the summed configured speeds (equal to `speeds` when the GPU was
    shared exactly in their ratio)."""
    total = sum(flops)
    return [f / total * sum(speeds) for f in flops]


def measure_matmul_flops(device: torch.device, size: int = 4096, reps: int = 20) -> float:
    """FLOP/s of this process on `device`: `reps` fp32 size x size matmuls (at the TF32 setting
    in force), after warm-up, synchronised. Large enough that the SM share, not kernel launches,
    sets the time: 137 GFLOP each, ~3 ms on a whole H100, ~10 ms at a 30% MPS share."""
    gen = torch.Generator(device=device).manual_seed(0)
    a = torch.randn(size, size, device=device, generator=gen)
    b = torch.randn(size, size, device=device, generator=gen)
    for _ in range(3):  # cuBLAS handles and workspaces, clocks up
        a @ b
    _synchronize(device)
    start = time.perf_counter()
    for _ in range(reps):
        a @ b
    _synchronize(device)
    return 2 * size**3 * reps / (time.perf_counter() - start)


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
