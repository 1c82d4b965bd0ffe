"""A runtime service for methods: how much longer a method's own training step runs than a plain
one on this host's emulated CPU ranks, measured once per host, workload, devices and config.

A method whose trainer does work beside the model's (an engine's hooks, gradient buckets, optimizer
partitions, swapped layers) prices that work in its Program from this measurement
(added_host_work_flops). The ranks are child processes, one per device, forked from the workers'
server (bench.runtime.launch) and each pinned to a core as the workers are, in a gloo world of
their own. Each rank interleaves a plain step (forward, backward, Adam on the whole model, timed
as the run's yardstick times it: the thread's CPU time of a whole step) with the method's step
(its setup()'s trainer, timed by the run's own emulator in its reference phase: per interval
between collectives, the fastest thread CPU time, collectives at loopback speed); or, where the
method's step holds part of the model (`interleave=False`: a pipeline's stages, which a whole
model's step between two of theirs would evict from the caches their run keeps them in), first
the plain steps, then the method's, as a run times its yardstick and then its reference. It knows no method: it calls the Method protocol's setup() and the trainer's
step(). It neither plans nor prices a Program.

host_measurement is the same service for a measurement a method makes in its own process (the
pipeline's layer-group profile): run as one emulated CPU device computes, cached per host.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import logging
import multiprocessing.connection as mp_connection
import os
import statistics
import tempfile
import time
import warnings
from collections.abc import Callable

import torch

from bench.core.cluster import ClusterSpec
from bench.core.interfaces import Plan, RankContext, Workload
from bench.runtime.emulation import ArrivalBoard, EmulationSettings, Emulator
from bench.runtime.hostcpu import emulated_device, pin_to_core
from bench.runtime.hostspeed import digest, host_cache_file, host_identity, host_key, read_cache, write_cache
from bench.runtime.launch import forking_context

DEFAULT_REPEATS = EmulationSettings.reference_iters  # the steps each rank times of either kind
TIMEOUT_S = 300

log = logging.getLogger(__name__)


def time_method_step(
    method,
    plan: Plan,
    workload: Workload,
    cluster: ClusterSpec,
    *,
    cache: str,
    config: list,
    version: int,
    what: str,
    requires: dict[str, str] | None = None,
    seed: int = 0,
    repeats: int = DEFAULT_REPEATS,
    timeout_s: float = TIMEOUT_S,
    interleave: bool = True,
) -> dict | None:
    """{"plain_s", "method_s"}: the median over ranks of the seconds a rank computes in a plain
    step and in `method`'s own step, at `plan`'s batch shares (see the module docstring), and
    {"plain_s_ranks", "method_s_ranks"}: each rank's. A rank's method step trains its
    `plan.data_slices` samples where the plan has them (a pipeline's batch), else its share.

    Args:
        method: a bench.core.interfaces.Method, picklable (it travels to the ranks).
        cache: the cache file's name, beside the host speeds (bench.runtime.hostspeed.host_cache_file).
        config: what else decides the method's step (JSON-able), in the cache key beside this
            host, the workload at the first rank's share, the devices and `repeats`.
        version: the caller's probe version, in the key: a change of what is timed measures again.
        what: the work measured, for the warning when it cannot be ("DeepSpeed's engine work").
        requires: modules the method's step imports, each with its install hint: where one is
            missing no rank is started (it could only fail).
        interleave: a plain step between two of the method's (the module docstring); False:
            every plain step first, then every step of the method's.

    Returns:
        The cached or measured figures; None, with one warning naming `what`, where they cannot be
        measured (a module missing, a rank failing or silent past `timeout_s`).
    """
    n, batch = cluster.num_devices, plan.batch_shares[0]
    path = host_cache_file().with_name(f"{cache}.json")
    body = [host_key(workload, batch, seed), n, *config, repeats, version] + ([] if interleave else ["in turn"])
    key = hashlib.sha256(json.dumps(body, sort_keys=True).encode()).hexdigest()[:16]
    cached = read_cache(path).get(key)
    if cached and "method_s_ranks" in cached:
        return {k: cached[k] for k in ("plain_s", "method_s", "plain_s_ranks", "method_s_ranks")}
    errors = [
        f"{m} is not installed: {hint}" for m, hint in (requires or {}).items() if importlib.util.find_spec(m) is None
    ]
    out = None
    if not errors:  # no rank to start where a module is missing: it could only fail
        out, errors = _run_ranks(method, plan, workload, cluster, seed, repeats, timeout_s, interleave)
    if errors:
        log.warning("%s was not measured (%s); its plan prices the model's work and collectives only", what, errors[0])
        return None
    write_cache(path, key, {**out, "workload": workload.name, "batch": batch, "devices": n})
    return out


def _run_ranks(
    method,
    plan: Plan,
    workload: Workload,
    cluster: ClusterSpec,
    seed: int,
    repeats: int,
    timeout_s: float,
    interleave: bool = True,
) -> tuple[dict | None, list[str]]:
    """One probe rank per device (_rank): (the medians of their answers, None where any failed;
    the errors)."""
    n = cluster.num_devices
    ctx = forking_context()
    with tempfile.TemporaryDirectory(prefix="hetbench-step-probe-") as folder:
        pipes = [ctx.Pipe(duplex=False) for _ in range(n)]
        procs = [
            ctx.Process(
                target=_rank,
                daemon=True,
                args=(r, n, f"{folder}/store", method, plan, workload, cluster, seed, repeats, pipes[r][1], interleave),
            )
            for r in range(n)
        ]
        for p in procs:
            p.start()
        for _, send in pipes:
            send.close()
        answers = gather_answers({receive: r for r, (receive, _) in enumerate(pipes)}, timeout_s)
        errors = [a["error"] for a in answers.values() if "error" in a]
        if not errors and len(answers) < n:
            errors.append(f"no answer from every rank within {timeout_s:g} s")
        for p in procs:  # a rank still waiting on a peer that failed is stopped here
            p.join(0 if errors else 10)
            if p.is_alive():
                p.kill()
    if errors:
        return None, errors
    out = {k: statistics.median(a[k] for a in answers.values()) for k in ("plain_s", "method_s")}
    return {**out, **{f"{k}_ranks": [answers[r][k] for r in range(n)] for k in ("plain_s", "method_s")}}, []


def gather_answers(pending: dict, timeout_s: float) -> dict:
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


def _rank(
    rank: int,
    world_size: int,
    store: str,
    method,
    plan: Plan,
    workload: Workload,
    cluster: ClusterSpec,
    seed: int,
    repeats: int,
    conn,
    interleave: bool = True,
) -> None:
    """One probe rank: plain steps and the method's steps, interleaved or in turn (the module
    docstring)."""
    try:
        import torch.distributed as dist

        pin_to_core(rank)  # as the workers are
        # The emulator's arrival board goes in the probe's folder, removed with it: the probe
        # ends in os._exit, which runs no exit handler.
        os.environ.update(
            RANK=str(rank),
            WORLD_SIZE=str(world_size),
            LOCAL_RANK=str(rank),
            **{ArrivalBoard.ENV: os.path.join(os.path.dirname(store), "arrivals")},
        )
        dist.init_process_group("gloo", store=dist.FileStore(store, world_size), rank=rank, world_size=world_size)
        warnings.filterwarnings("ignore", category=FutureWarning)
        with emulated_device():
            data = workload.model_cfg.synthetic_batch(plan.batch_shares[rank], torch.Generator().manual_seed(seed))
            own = data
            if plan.data_slices:  # the method trains its own samples (a pipeline's batch)
                start, stop = plan.data_slices[rank]
                own = workload.model_cfg.synthetic_batch(stop - start, torch.Generator().manual_seed(seed))
            model = workload.build(seed)
            optimizer = torch.optim.Adam(model.parameters(), lr=method.lr)
            emulator = Emulator(cluster, rank, enabled=True, settings=EmulationSettings(reference_iters=repeats))
            emulator.install()  # before setup: a method may keep references to the collectives
            ctx = RankContext(rank, world_size, torch.device("cpu"), cluster, workload, emulator)
            trainer = method.setup(plan, workload.build(seed), ctx)
            plain = []

            def plain_step() -> None:
                start = time.thread_time()
                optimizer.zero_grad(set_to_none=True)
                model(*data).backward()
                optimizer.step()
                plain.append(time.thread_time() - start)

            steps = EmulationSettings.SKIPPED + repeats
            if not interleave:
                for _ in range(steps):
                    plain_step()
            for i in range(steps):
                if interleave:
                    plain_step()
                emulator.begin_iteration(i)
                trainer.step(own)
            emulator.begin_iteration(steps)  # sets the reference
        conn.send(
            {"plain_s": min(plain[EmulationSettings.SKIPPED :]), "method_s": emulator.report()["reference_s_per_iter"]}
        )
    except Exception as exc:  # reported to the parent, which plans without it
        conn.send({"error": f"{type(exc).__name__}: {exc}"})
    finally:
        conn.close()
        # Not a normal exit: a method's process groups (DeepSpeed's) keep gloo threads that
        # abort at interpreter teardown ("terminate called without an active exception").
        os._exit(0)


def added_host_work_flops(
    plain_s: float, method_s: float, workload: Workload, batch: int, cluster: ClusterSpec
) -> float:
    """The method's own work as a Program's host work: the share its step adds to the plain step
    (time_method_step), times the plain step the cost model prices at `batch` samples (per-sample
    FLOPs plus the per-step part), in FLOPs at the host's rate. So it follows the host's speed (a
    run's own yardstick, bench.runner.case.predict_at_run_speed) and each device's (1/speed as long)."""
    added = max(method_s / plain_s - 1.0, 0.0)
    return added * (workload.flops_per_sample * batch + cluster.host_step_overhead_s * cluster.host_flops)


def host_measurement(cache: str, key: list, measure: Callable[[], dict]) -> dict:
    """`measure()`'s figures, measured in this process as one emulated CPU device computes
    (bench.runtime.hostcpu.emulated_device: its threads and denormal flushing), once per host
    (host_identity) and `key` (JSON-able: what else decides them), then read from the cache file
    `cache` beside the host speeds."""
    path = host_cache_file().with_name(f"{cache}.json")
    entry = digest([*host_identity(), *key])
    cached = read_cache(path).get(entry)
    if cached:
        return cached
    with emulated_device():
        out = measure()
    write_cache(path, entry, out)
    return out
