"""How an emulated cluster's ranks slow each other down on this host (the prediction's input).

An emulated rank's compute is paced against its own full-pace reference: the CPU time of its
intervals in the first iterations, while every rank runs at once (bench.emulation). That CPU
time is longer than the parent's single-process probe (bench.flops.measure_host_speed) says, for
two reasons measured on the 2-core dev VM (tiny BERT, one thread per process):

- other processes on the cores: a step of 8 samples took 6.6 ms alone, 7.5 with two processes
  stepping together, 7.8-8.4 with four;
- idle gaps: a rank with less work waits for its peers at every collective, and the burst of
  compute after a wait runs slower (caches refilled): with shares 11 and 5 in lockstep, the
  5-sample rank took 5.7-6.0 ms per step against 4.75 alone, the 11-sample rank 9.3-9.7 vs 9.0.

`measure_contention` reproduces both for a plan: one process per rank, each stepping the
workload's plain model at its rank's batch share, first alone (one rank at a time, back to
back) and then all together in lockstep (a barrier per step, as a collective per step makes
them). Each rank's factor (`contention_factors`) is its together time over the host model's
price of the same step (the parent's probe); its alone time, measured in the same process, says
how much of the factor is contention and how much the host model's own error at that share.
bench.run applies the factors to the simulated cluster (ClusterSpec.host_contention) for the
prediction recorded with a real emulated case; the planner plans for the configured cluster,
as it would on real GPUs.
"""

from __future__ import annotations

import queue as queue_module
import time

import torch
import torch.multiprocessing as mp

from bench.cluster import ClusterSpec
from bench.hostcpu import configure_process
from bench.interfaces import Workload

WARMUP_STEPS = 3
ALONE_STEPS = 12
TOGETHER_STEPS = 12  # as many as the emulator's reference iterations (emulation.reference_iters)
_cache: dict[tuple, list[dict]] = {}


def _probe_rank(rank: int, workload: Workload, shares: list[int], seed: int, barrier, queue) -> None:
    configure_process()  # as an emulated worker computes
    model = workload.build(seed)
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-6)
    samples = max(shares[rank], 1)
    batch = workload.model_cfg.synthetic_batch(samples, torch.Generator().manual_seed(seed))

    def step() -> float:
        start = time.thread_time()
        optimizer.zero_grad(set_to_none=True)
        model(*batch).backward()
        optimizer.step()
        return time.thread_time() - start

    alone = []
    for turn in range(len(shares)):
        barrier.wait()
        if turn == rank:
            for i in range(WARMUP_STEPS + ALONE_STEPS):
                t = step()
                if i >= WARMUP_STEPS:
                    alone.append(t)
    together = []
    for i in range(WARMUP_STEPS + TOGETHER_STEPS):
        barrier.wait()
        t = step()
        if i >= WARMUP_STEPS:
            together.append(t)
    # The fastest step, as the emulator's reference keeps the fastest of its iterations: with
    # more ranks than cores the median put the prediction 20-50% above the measured runs.
    queue.put((rank, min(alone), min(together)))


def measure_contention(workload: Workload, shares: list[int], seed: int, timeout_s: float = 300.0) -> list[dict]:
    """Per rank: {samples, alone_s, together_s}, the fastest of 12 plain training steps at its
    batch share (a rank with none is stepped with one sample), alone and with every rank
    stepping in lockstep (see the module docstring). Kept per process and shares: the cases of a sweep with the same
    shares (dp_ev and DeepSpeed; hap and its ablations) share one measurement."""
    shares = [int(s) for s in shares]
    key = (workload.name, repr(workload.model_cfg), tuple(shares), seed)
    if key in _cache:
        return _cache[key]
    ctx = mp.get_context("spawn")
    barrier, queue = ctx.Barrier(len(shares)), ctx.Queue()
    procs = [ctx.Process(target=_probe_rank, args=(r, workload, shares, seed, barrier, queue), daemon=True)
             for r in range(len(shares))]
    for p in procs:
        p.start()
    got: dict[int, tuple[float, float]] = {}
    deadline = time.monotonic() + timeout_s
    try:
        while len(got) < len(procs):
            try:
                r, alone, together = queue.get(timeout=1.0)
                got[r] = (alone, together)
            except queue_module.Empty:
                dead = [i for i, p in enumerate(procs) if p.exitcode not in (None, 0)]
                if dead or time.monotonic() > deadline:
                    why = f"probe rank {dead[0]} exited with {procs[dead[0]].exitcode}" if dead else "timed out"
                    raise RuntimeError(f"host contention probe failed: {why}") from None
    finally:
        for p in procs:
            p.join(timeout=5)
            if p.is_alive():
                p.kill()
    _cache[key] = [{"samples": shares[r], "alone_s": got[r][0], "together_s": got[r][1]}
                   for r in range(len(shares))]
    return _cache[key]


def contention_factors(ranks: list[dict], cluster: ClusterSpec, workload: Workload) -> list[float]:
    """Per rank, its measured together time over what the cluster's host model (the parent's
    probe: bench.flops.measure_host_speed) prices the same plain step at: the simulator, given
    a cluster slowed by these factors (ClusterSpec.with_host_contention), prices each rank's
    plain step at exactly what the probe measured with every rank running. So the factor takes
    in both the contention and the host model's own error at that share (its fixed and
    per-sample parts are split from two batch sizes); `alone_s` over the same price tells them
    apart."""
    out = []
    for r in ranks:
        samples = max(r["samples"], 1)
        model_s = cluster.host_step_overhead_s + workload.flops_per_sample * samples / cluster.host_flops
        r["host_model_s"] = model_s
        r["factor"] = r["together_s"] / model_s
        out.append(r["factor"])
    return out
