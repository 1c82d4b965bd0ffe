"""The least time this host's own transport takes for one collective between CPU workers.

An emulated cluster's links are paced on top of real gloo calls between worker processes
(bench.runtime.emulation): a collective ends no sooner than its emulated time from the last member's
arrival, and no sooner than the real call. A small gloo call between two workers can take
several times the latency a local cluster declares, so a program of many small collectives runs
past its emulated links (docs/emulation.md, "Emulated links"). The cost model prices
an emulated collective as the longer of its link's time and this floor
(bench.cost.price.flat_price).

The floor is measured per collective kind with the calls the runtime makes, one element per
rank, the workers bound to cores as emulated ranks are and gloo's threads at the priorities the
runs give them (real-time with `emulation.realtime_comm`, the process group's workers at nice -10
with `emulation.gloo_workers_first`); the ranks take turns to come last
while the others wait idle in the call, as in a run, and the last one's time counts (median over
its calls). Once per host, number of ranks and priorities, kept in the host cache beside the host
speed (bench.runtime.hostspeed.host_cache_file).
"""

from __future__ import annotations

import logging
import multiprocessing as mp
import os
import queue
import statistics
import time

import torch
import torch.distributed as dist

from bench.runtime.compat import all_gather_single, reduce_scatter_single
from bench.runtime.hostcpu import comm_priorities, pin_to_core
from bench.runtime.hostspeed import digest, host_cache_file, host_identity, read_cache, write_cache
from bench.runtime.launch import _free_port

FLOOR_VERSION = 1
WARMUP = 5  # calls per kind first, untimed
CALLS = 12  # timed calls per kind; each rank in turn comes last
# How long the last rank keeps the others waiting: the longer they sleep, the slower they wake,
# and 2 ms comes closest to the waits of a run (docs/emulation.md, "Emulated links").
LATE_S = 0.002
_KINDS = ("all_reduce", "all_gather", "reduce_scatter", "all_to_all", "broadcast", "reduce", "gather", "scatter", "p2p")
_floors: dict[tuple[int, bool, bool], dict[str, float]] = {}  # by ranks, `realtime`, `workers_first`
log = logging.getLogger(__name__)


def _calls(rank: int, n: int) -> dict:
    """One call per collective kind, as the runtime makes it (bench.runtime.emulation.link_clock._COLLECTIVES),
    and a point-to-point transfer as a pipeline makes them (bench.runtime.p2p): each rank sends to
    the next and receives from the one before, then waits on both."""
    one, many = torch.zeros(1), torch.zeros(n)
    parts = [torch.zeros(1) for _ in range(n)] if rank == 0 else None
    inbox = torch.zeros(1)

    def p2p() -> None:
        for work in (dist.isend(one, (rank + 1) % n), dist.irecv(inbox, (rank - 1) % n)):
            work.wait()

    return {
        "all_reduce": lambda: dist.all_reduce(one),
        "all_gather": lambda: all_gather_single()(many, one),
        "reduce_scatter": lambda: reduce_scatter_single()(one, many),
        "all_to_all": lambda: dist.all_to_all_single(torch.empty(n), many),
        "broadcast": lambda: dist.broadcast(one, src=0),
        "reduce": lambda: dist.reduce(one, dst=0),
        "gather": lambda: dist.gather(one, parts, dst=0),
        "scatter": lambda: dist.scatter(one, parts, src=0),
        "p2p": p2p,
    }


def _probe(rank: int, n: int, port: int, results, realtime: bool, workers_first: bool) -> None:
    pin_to_core(rank)
    torch.set_num_threads(1)
    # its own store, rank 0 serving it: a rendezvous by URL or env under torchrun would look for
    # the agent's store (TORCHELASTIC_USE_AGENT_STORE, inherited) and wait for it forever
    store = dist.TCPStore("127.0.0.1", port, n, is_master=rank == 0)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=n)
    try:
        calls = _calls(rank, n)
        for call in calls.values():  # warm-up: the first calls of a new process are slow
            for _ in range(WARMUP):
                call()
        comm_priorities(realtime, workers_first)  # after the warm-up: every gloo thread has its name
        times = {}
        for kind, call in calls.items():
            timed = []
            for i in range(CALLS):
                late = i % n == rank  # the others wait idle in the call, as ranks do in a run
                if late:
                    time.sleep(LATE_S)
                start = time.perf_counter()
                call()
                if late:
                    timed.append(time.perf_counter() - start)
            times[kind] = timed
        results.put((rank, times))
        dist.barrier()  # nobody leaves while a peer still sends
    finally:
        dist.destroy_process_group()


def measure_floor(num_ranks: int, context=None, realtime: bool = False, workers_first: bool = True) -> dict[str, float]:
    """Seconds of one small collective of each kind among `num_ranks` CPU worker processes on
    this host, from the last rank's arrival (module docstring); {} for one rank. `context`: the
    multiprocessing context to start them with (the launcher's forkserver when it runs; spawn
    otherwise); `realtime`: gloo's threads at real-time priority, as `emulation.realtime_comm`
    puts a run's; `workers_first`: gloo's workers at nice -10, as `emulation.gloo_workers_first`
    does. RuntimeError when a probe process dies."""
    if num_ranks <= 1:
        return {}
    ctx = context or mp.get_context("spawn")
    results, port = ctx.Queue(), _free_port()
    procs = [
        ctx.Process(target=_probe, args=(r, num_ranks, port, results, realtime, workers_first), daemon=True)
        for r in range(num_ranks)
    ]
    for p in procs:
        p.start()
    per_rank: dict[int, dict] = {}
    try:
        while len(per_rank) < num_ranks:
            try:
                rank, times = results.get(timeout=1.0)
                per_rank[rank] = times
            except queue.Empty:
                if any(p.exitcode not in (None, 0) for p in procs):
                    raise RuntimeError(f"a transport probe process exited with {[p.exitcode for p in procs]}") from None
    finally:
        for p in procs:
            p.join(timeout=10)
            if p.is_alive():
                p.kill()
    return {kind: statistics.median(t for times in per_rank.values() for t in times[kind]) for kind in _KINDS}


def _key(num_ranks: int, realtime: bool, workers_first: bool) -> str:
    what = [*host_identity(), len(os.sched_getaffinity(0)), num_ranks, FLOOR_VERSION]
    what += ["realtime"] if realtime else []
    what += ["workers_first"] if workers_first else []
    return "links:" + digest(what)


def host_floor(num_ranks: int, context=None, realtime: bool = False, workers_first: bool = True) -> dict[str, float]:
    """measure_floor, once per host, number of ranks and priorities of gloo's threads: kept in
    this process and in the host cache, so that the plans priced with it stay the same from run
    to run (delete the cache file, bench.runtime.hostspeed.host_cache_file, to measure it again). {} for
    one rank; a probe that fails is a warning and no floor (nothing cached)."""
    if num_ranks <= 1:
        return {}
    which = (num_ranks, realtime, workers_first)
    if which not in _floors:
        path, key = host_cache_file(), _key(*which)
        cached = read_cache(path).get(key)
        if not isinstance(cached, dict) or set(cached) != set(_KINDS):
            try:
                cached = measure_floor(num_ranks, context, realtime, workers_first)
            except (RuntimeError, OSError) as exc:
                log.warning(
                    "the host transport's floor was not measured (%s); emulated links are priced without it", exc
                )
                return {}
            write_cache(path, key, cached)
        _floors[which] = cached
    return _floors[which]
