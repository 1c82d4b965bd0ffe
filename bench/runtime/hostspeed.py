"""The measured speed of one host worker: the emulated device of speed 1.0, and its caches.

It times plain training steps of a workload on this host (and Adam's per-byte cost), splits a
step into a per-sample and a per-step part, and caches the result per host and workload. It
counts no FLOPs itself (bench.cost.flops does).
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import logging
import os
import platform
import statistics
import time
from collections.abc import Sequence
from pathlib import Path
from typing import NamedTuple

import torch

from bench.core.interfaces import Workload
from bench.core.paths import user_cache_dir
from bench.runtime.hostcpu import cpu_model, emulated_device
from bench.runtime.precision import applied

log = logging.getLogger(__name__)


class HostSpeed(NamedTuple):
    """One host worker thread training a workload: the emulated device of speed 1.0."""

    flops_per_s: float  # the per-sample part of a plain step, as FLOP/s
    step_overhead_s: float  # the per-step part (optimizer, per-op dispatch) of the whole model
    # Of the per-step part, Adam's cost per parameter byte a rank updates, and the model's
    # parameter bytes the per-step part was measured with (bench.core.cluster.ClusterSpec).
    optimizer_s_per_byte: float = 0.0
    param_bytes: float = 0.0


_host_speed_cache: dict[tuple, HostSpeed] = {}
REVALIDATE_TOLERANCE = 0.10  # a cached host speed is kept while a quick check is this close
# How the probe computes; a speed cached by an earlier way of probing is measured again
# (2: bench.runtime.hostcpu's steady allocator and flushed denormals, as the workers compute;
# 3: split_step's floor on the per-sample part lowered to MIN_PER_SAMPLE_SHARE;
# 4: the two batch sizes take turns, reference_steps_s;
# 5: Adam's cost per parameter byte, optimizer_s_per_byte;
# 6: a step growing faster than its samples priced at the smaller batch's rate, split_step).
PROBE_VERSION = 6
ADAM_PROBE_MAX_BYTES = 64 << 20  # optimizer_s_per_byte times Adam over at most this many bytes
MIN_PER_SAMPLE_SHARE = 0.1  # the least part of a step split_step attributes to its samples


def host_cache_file() -> Path:
    """Per-user cache of measured host speeds (HETBENCH_CACHE_DIR overrides the folder; the
    DeepSpeed engine probe keeps its own file beside it)."""
    return user_cache_dir() / "host_speed.json"


def host_identity() -> list:
    """This host as the caches key it: name, architecture, processor, cores, torch."""
    return [platform.node(), platform.machine(), cpu_model(), os.cpu_count(), torch.__version__]


def digest(body: list) -> str:
    """A short stable key for a JSON-able list (a host cache's entry)."""
    return hashlib.sha256(json.dumps(body, default=str).encode()).hexdigest()[:16]


def host_key(workload: Workload, batch_size: int, seed: int) -> str:
    """This host (host_identity) and this workload at its precision: what a speed belongs to."""
    return digest(
        [*host_identity(), workload.name, repr(workload.model_cfg), batch_size, seed, workload.precision, PROBE_VERSION]
    )


def measure_host_speed(
    workload: Workload, batch_size: int, seed: int, repeats: int = 21, use_disk_cache: bool = True
) -> HostSpeed:
    """How fast one worker thread trains this workload: the emulated device of speed 1.0.

    Times whole training steps (forward, backward, Adam) single-threaded, as the workers run
    them, at `batch_size` and twice that, and splits a step into a part per sample and a part
    per step (optimizer, per-op dispatch: the same whatever a rank's share). Of the per-step
    part, Adam's cost per parameter byte is timed on its own (optimizer_s_per_byte): a rank
    that holds a shard of a parameter updates that shard only.

    Measured once per host and workload: kept in this process and in `host_cache_file()`, and
    re-validated on each new process by a quick timing at `batch_size` of forward and backward
    alone (re-measured if it moved more than 10%): constructing an optimizer imports torch's
    compiler, seconds of a process that has no other use for it. So efficiencies and the plans that depend on the host speed stay comparable
    across the cases of a sweep and across sweeps.
    """
    b = max(batch_size, 1)
    key = (workload.name, repr(workload.model_cfg), b, seed, workload.precision)
    if key in _host_speed_cache:
        return _host_speed_cache[key]
    path, disk_key = host_cache_file(), host_key(workload, b, seed)
    cached = read_cache(path).get(disk_key) if use_disk_cache else None
    if (
        cached
        and cached.get("t1_fb")
        and abs(reference_step_s(workload, b, seed, repeats=7, optimizer=False) / cached["t1_fb"] - 1)
        <= REVALIDATE_TOLERANCE
    ):
        _host_speed_cache[key] = HostSpeed(
            cached["flops_per_s"], cached["step_overhead_s"], cached["optimizer_s_per_byte"], cached["param_bytes"]
        )
        return _host_speed_cache[key]
    t1, t2 = reference_steps_s(workload, (b, 2 * b), seed, repeats)
    t1_fb = reference_step_s(workload, b, seed, repeats=7, optimizer=False)  # what a later process re-times
    param_bytes = float(sum(p.numel() * p.element_size() for p in workload.build(seed).parameters()))
    speed = HostSpeed(*split_step(workload, (b, 2 * b), (t1, t2)), optimizer_s_per_byte(param_bytes), param_bytes)
    _host_speed_cache[key] = speed
    if use_disk_cache:
        entry = {"t1": t1, "t1_fb": t1_fb, **speed._asdict(), "workload": workload.name, "batch_size": b}
        write_cache(path, disk_key, entry)
    return speed


def optimizer_s_per_byte(param_bytes: float, repeats: int = 21) -> float:
    """Seconds per parameter byte of one Adam step on one worker thread (as the workers compute,
    bench.runtime.hostcpu): the step over one fp32 parameter of `param_bytes`, less the step over half
    of it, the two taking turns (median of each), over the bytes between them. Adam reads four
    tensors per parameter (it, its gradient, two moments) and writes three: memory-bound, so linear
    in the bytes past a fixed cost per tensor, which stays with the per-step part (a shard is
    still one tensor). For tiny VGG19 it is most of the Adam step and a third of the per-step
    part (docs/cost-model.md, "Device types, host speed and profiles"). Past ADAM_PROBE_MAX_BYTES (far
    beyond any cache) it is timed at that size."""
    elements = max(int(min(param_bytes, ADAM_PROBE_MAX_BYTES)) // 4, 2)
    sizes = (elements, elements // 2)
    steps, times = [], [[], []]
    for n in sizes:
        p = torch.nn.Parameter(torch.zeros(n))
        p.grad = torch.ones_like(p)
        steps.append(torch.optim.Adam([p], lr=1e-6).step)
    with emulated_device():
        for i in range(repeats + 2):
            for step, timed in zip(steps, times):
                start = time.perf_counter()
                step()
                if i >= 2:  # the first steps allocate the moments
                    timed.append(time.perf_counter() - start)
    full, half = (statistics.median(t) for t in times)
    return max(full - half, 0.0) / ((sizes[0] - sizes[1]) * 4)


def split_step(workload: Workload, batches: Sequence[int], seconds: Sequence[float]) -> tuple[float, float]:
    """(FLOP/s of the per-sample part, seconds of the per-step part) of plain steps that took
    seconds[0] at batches[0] samples and seconds[1] at batches[1] (more)."""
    (b1, b2), (t1, t2) = batches, seconds
    # Noise must not make the per-sample part vanish or go negative. The floor is low: most of
    # a tiny model's step can be per-step part, and a floor of half the step priced tiny
    # VGG19's samples 30% dear (docs/cost-model.md, "Device types, host speed and profiles").
    # A step that grows faster than its samples (a large batch past the caches) would leave a
    # per-step part below zero: its samples are then priced at the smaller batch's own rate,
    # exact there (yardstick_batches: the smallest share), under the larger batch's time.
    per_sample = max(min((t2 - t1) / (b2 - b1), t1 / b1), MIN_PER_SAMPLE_SHARE * t1 / b1)
    return workload.flops_per_sample / per_sample, max(t1 - per_sample * b1, 0.0)


def yardstick_batches(shares: Sequence[int]) -> tuple[int, int]:
    """The two batch sizes a run's yardstick times: its smallest share, and its largest or twice
    the smallest, whichever is more. The affine step model is then exact at the smallest share
    and interpolates between: a step is not affine in the batch at a few samples, and the slow
    device of an uneven split sits there: a few-sample step lies well above the line through
    larger ones (docs/emulation.md, "What a row's prediction means: the yardstick")."""
    low = max(min(shares), 1)
    return low, max(max(shares), 2 * low)


def yardstick(workload: Workload, batches: Sequence[int], seed: int, repeats: int = 9) -> dict:
    """The host's speed as an emulated worker sees it, measured in that worker: the fastest of
    `repeats` plain training steps (forward, backward, Adam; thread CPU time, as the worker's
    pacing reference is timed) at each of `batches` samples (yardstick_batches), in this process.

    Every rank of an emulated run takes it at once, just before its reference iterations, so
    it meets the host as the run does: a VM's speed drifts between runs, and four ranks on two
    cores slow each other; a probe in the parent, minutes earlier, sees neither. The runner
    prices the run's prediction with it (bench.runner.case.predict_at_run_speed); it is a plain
    model's step, never the method's own program.

    The batch sizes take turns, one step each, so that a slow stretch of the host (a core can
    run well below speed for a tenth of a second) hits them alike: timed one size after the
    other, the ratio of the two sizes' steps spread far wider
    (docs/emulation.md, "What a row's prediction means: the yardstick")."""
    times = _turns(workload, batches, seed, repeats, time.thread_time)
    return {"batch": list(batches), "seconds": [min(timed) for timed in times]}


def _turns(
    workload: Workload, batches: Sequence[int], seed: int, repeats: int, clock, optimizer: bool = True
) -> list[list[float]]:
    """Seconds by `clock` of `repeats` plain training steps (forward, backward, Adam; without
    `optimizer` forward and backward alone) at each of `batches` samples, one model, the sizes
    taking turns one step each, so that a slow stretch of the host hits every size alike; the
    first two rounds (they allocate) are dropped. At the workload's precision, as a worker's
    steps run (bf16: under autocast, bench.runtime.precision.applied)."""
    model = workload.build(seed)
    adam = torch.optim.Adam(model.parameters(), lr=1e-6) if optimizer else None
    inputs = [workload.model_cfg.synthetic_batch(n, torch.Generator().manual_seed(seed)) for n in batches]
    times: list[list[float]] = [[] for _ in batches]
    with emulated_device(), applied(workload.precision, "cpu"):
        for i in range(repeats + 2):
            for batch, timed in zip(inputs, times):
                seconds = _timed_step(model, adam, batch, clock)
                if i >= 2:
                    timed.append(seconds)
    return times


def _timed_step(model: torch.nn.Module, optimizer: torch.optim.Optimizer | None, batch: tuple, clock) -> float:
    """One plain training step (forward, backward, Adam if there is an optimizer), in seconds of `clock`."""
    start = clock()
    if optimizer is None:
        model.zero_grad(set_to_none=True)
    else:
        optimizer.zero_grad(set_to_none=True)
    model(*batch).backward()
    if optimizer is not None:
        optimizer.step()
    return clock() - start


@torch.random.fork_rng(devices=[])
def pause_penalty(workload: Workload, batch: int, seed: int, pause_s: float, repeats: int = 9) -> dict:
    """How much slower this host computes right after a pause of `pause_s`, measured when called: plain
    training steps at `batch` samples in pairs, one after sleeping `pause_s` and one right after
    it, back to back (so that a drift of the host hits both alike); the fastest of each kind,
    in thread CPU time as the emulator's reference is timed. A small-share rank's full-pace
    reference waits on its peers every iteration and comes out cold
    (bench.runtime.emulation.Emulator.discount_reference). It runs between training iterations, so the
    random state it seeds and draws from (model initialisation, dropout) is restored after."""
    model = workload.build(seed)
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-6)
    inputs = workload.model_cfg.synthetic_batch(max(batch, 1), torch.Generator().manual_seed(seed))

    cold, warm = [], []
    with emulated_device(), applied(workload.precision, "cpu"):
        for _ in range(2):  # the first steps allocate
            _timed_step(model, optimizer, inputs, time.thread_time)
        for _ in range(repeats):
            time.sleep(pause_s)
            cold.append(_timed_step(model, optimizer, inputs, time.thread_time))
            warm.append(_timed_step(model, optimizer, inputs, time.thread_time))
    return {"pause_s": pause_s, "warm_s": min(warm), "cold_s": min(cold), "penalty": min(cold) / min(warm)}


def read_cache(path: Path) -> dict:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return {}


def write_cache(path: Path, key: str, entry: dict) -> None:
    """Merge one entry under a lock; a cache that cannot be written is only a lost shortcut."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        with open(path, "a+") as fh:
            fcntl.flock(fh, fcntl.LOCK_EX)
            fh.seek(0)
            try:
                body = json.loads(fh.read() or "{}")
            except ValueError:
                body = {}
            body[key] = entry
            fh.seek(0)
            fh.truncate()
            fh.write(json.dumps(body, indent=1, sort_keys=True))
    except OSError as exc:
        log.warning("host speed cache %s not written: %s", path, exc)


def reference_step_s(
    workload: Workload, batch_size: int, seed: int, repeats: int = 21, optimizer: bool = True
) -> float:
    """Median time of one plain training step (forward, backward, Adam; without `optimizer`
    forward and backward alone) on one thread, measured when called: a yardstick that no part of
    the harness (workers, emulator, methods) touches. It computes as a worker does
    (bench.runtime.hostcpu: one thread, denormals flushed, a steady malloc)."""
    return reference_steps_s(workload, (max(batch_size, 1),), seed, repeats, optimizer)[0]


def reference_steps_s(
    workload: Workload, batches: Sequence[int], seed: int, repeats: int = 21, optimizer: bool = True
) -> list[float]:
    """reference_step_s at each of `batches` samples, the sizes taking turns (_turns). Timed
    one size after the other, a slow stretch of the host could fall on one size alone and skew
    the per-sample split, which is cached for every later run on the host
    (docs/emulation.md, "What a row's prediction means: the yardstick")."""
    return [
        statistics.median(timed) for timed in _turns(workload, batches, seed, repeats, time.perf_counter, optimizer)
    ]


def host_probe(device: str = "cpu", ops: int = 200, repeats: int = 7) -> float:
    """How fast this host dispatches when called: seconds per tiny op (an in-place add on a
    one-element tensor), the median of `repeats` runs of `ops`. On a GPU the ops are only
    queued, their kernels far shorter than their launches, so it times the host alone. The
    GPU calibration records it beside each step and the profile beside its dispatch costs,
    since the same host-bound step can take half as long again on one machine as on another of
    the same type (docs/gpu.md, "What to expect")."""
    x = torch.zeros(1, device=device)
    sync = torch.cuda.synchronize if x.is_cuda else (lambda: None)
    times = []
    for i in range(repeats + 1):
        t0 = time.perf_counter()
        for _ in range(ops):
            x.add_(1)
        if i:  # the first run warms up
            times.append((time.perf_counter() - t0) / ops)
        sync()
    return statistics.median(times)


def device_step(
    workload: Workload, batch_size: int, seed: int, device: str = "cpu", repeats: int = 21
) -> tuple[float, float | None]:
    """(median seconds, peak bytes allocated or None on the CPU) of one plain training step
    (forward, backward, Adam) of the workload's model on `device` at the workload's precision
    (bench.runtime.precision.applied); CUDA steps are timed with events after synchronising,
    the first two steps (allocation, lazy set-up) are dropped."""
    with applied(workload.precision, device):
        return _device_step(workload, batch_size, seed, device, repeats)


def _device_step(workload: Workload, batch_size: int, seed: int, device: str, repeats: int):
    model = workload.build(seed).to(device)
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-6)
    batch = [t.to(device) for t in workload.model_cfg.synthetic_batch(batch_size, torch.Generator().manual_seed(seed))]
    cuda = device != "cpu"
    if cuda:
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
    times = []
    for i in range(repeats + 2):
        if cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
        else:
            t0 = time.perf_counter()
        optimizer.zero_grad(set_to_none=True)
        model(*batch).backward()
        optimizer.step()
        if cuda:
            end.record()
            torch.cuda.synchronize(device)
            elapsed = start.elapsed_time(end) / 1e3
        else:
            elapsed = time.perf_counter() - t0
        if i >= 2:  # the first steps pay for allocation and lazy initialisation
            times.append(elapsed)
    peak = float(torch.cuda.max_memory_allocated(device)) if cuda else None
    return statistics.median(times), peak
