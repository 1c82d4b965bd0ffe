"""Emulation fidelity: a slow device takes 1/speed as long; a link takes its alpha-beta time."""

import os
import time

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from bench.core.cluster import ClusterSpec
from bench.cost import collective_time_s
from bench.runner.execute import run_case
from bench.runtime.emulation import DILATION_TOLERANCE, EmulationSettings, Emulator

pytestmark = [pytest.mark.e2e, pytest.mark.alone]  # each test times what the host does


def test_each_rank_reports_its_achieved_dilation(cfg_factory):
    """The row's per-rank numbers: paced against the reference, nothing left unreferenced."""
    cfg = cfg_factory("model=bert", "cluster=local_hetero2", "warmup_iters=2", "measured_iters=10")
    record = run_case(cfg)
    assert record.status == "ok", record.error
    ranks = record.emulation["ranks"]
    assert [r["speed"] for r in ranks] == [1.0, 0.4]
    assert record.emulation["headroom"] == EmulationSettings.auto_headroom(2)
    cores = sorted(os.sched_getaffinity(0))  # each rank bound to its own (bench.runtime.hostcpu.pin_to_core)
    assert [r["core"] for r in ranks] == [cores[0], cores[1 % len(cores)]]
    assert record.emulation["realtime_comm"] is False  # gloo's threads at normal priority
    assert [r["realtime_comm_threads"] for r in ranks] == [None, None]
    # gloo's process-group workers at nice -10 (bench.runtime.hostcpu.gloo_workers_first): both of each
    # rank's, or None where the host refuses a negative nice
    assert record.emulation["gloo_workers_first"] is True
    counts = [r["gloo_workers_first_threads"] for r in ranks]
    assert counts == [None, None] or all(n >= 2 for n in counts), counts
    for r in ranks:
        assert r["unreferenced_intervals"] == 0
        assert r["achieved_dilation"] == pytest.approx(1 / r["speed"], rel=0.5)
        assert r["link_emulated_s"] > 0 and r["link_overrun_s"] >= 0  # the gradient all-reduces
    assert record.emulation["ok"] == (abs(record.emulation["max_error"]) <= 0.05)


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs a core per rank")
def test_real_time_gloo_threads_are_set_on_every_rank_and_recorded(cfg_factory):
    """emulation.realtime_comm=true (bench.runtime.hostcpu.realtime_comm_threads): each rank's gloo
    threads, its transport's event loop and its process group's worker(s), at SCHED_FIFO; None
    only where the host refuses it."""
    cfg = cfg_factory(
        "model=bert", "cluster=local_hetero2", "warmup_iters=1", "measured_iters=2", "emulation.realtime_comm=true"
    )
    record = run_case(cfg)
    assert record.status == "ok", record.error
    assert record.emulation["realtime_comm"] is True
    counts = [r["realtime_comm_threads"] for r in record.emulation["ranks"]]
    assert counts == [None, None] or all(n >= 2 for n in counts), counts


def test_a_slow_device_takes_one_over_its_speed_through_the_worker():
    """End to end: tiny BERT trained by the real worker path (one spawned process) at speeds
    0.25, 0.4 and 0.5, each between two speed-1 runs, all paced against one reference
    (bench.dilation). Iteration time x speed over speed 1's must be 1. The band is the 5% a row
    is flagged at (DILATION_TOLERANCE), not the measured spread (a quiet host keeps well inside
    it), so that a loaded CI machine, where the speed-1 rank may miss its target, does not fail
    it.

    At headroom 0.4, not the runner's 0.6: a speed-1 run then has 2.5x slack for a slowed-down
    host, not 1.67x, and a VM core can run well below speed for a tenth of a second. The pacing
    under test is the same at any headroom; rows whose ranks miss their target say so
    (EmulationSettings, the row's emulation.ok). Each run's median over 10 measured iterations,
    not bench.dilation's 20: as tight, in two thirds of the time (docs/emulation.md, "How far to
    trust it")."""
    from bench.studies.pacing_fidelity import SPEEDS, measure

    achieved = measure(SPEEDS, ("emulation.headroom=0.4", "measured_iters=10"))
    assert set(achieved) == set(SPEEDS)
    for speed, value in achieved.items():
        assert value == pytest.approx(1.0, abs=DILATION_TOLERANCE), (speed, achieved)


SLOW_LINK = {
    "name": "slow_link",
    "emulated": True,
    "machines": [{"count": 2, "device": "cpu", "num_devices": 1}],
    "links": {
        "intra_machine": {"bandwidth_gbps": 1.0, "latency_s": 0.0},
        "inter_machine": {"bandwidth_gbps": 0.08, "latency_s": 0.002},
    },  # 10 MB/s
}


def _link_worker(rank, port, out):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=2)
    x = torch.ones(250_000)  # 1 MB
    buf = torch.ones(2 * 250_000)
    dist.all_reduce(x)  # gloo sets each collective up on its first call: not what is measured
    dist.all_gather_into_tensor(buf, x)
    Emulator(ClusterSpec.from_config(SLOW_LINK), rank, enabled=True).install()
    times = []
    for async_op in (False, True, False):
        start = time.perf_counter()
        work = dist.all_reduce(x, async_op=async_op)
        if async_op:
            work.wait()
        times.append(time.perf_counter() - start)
    start = time.perf_counter()
    dist.all_gather_into_tensor(buf, x)  # the old name calls the new one: count it once
    times.append(time.perf_counter() - start)
    # Rank 1 arrives 0.3 s late: both ranks must leave together, a full transfer after it.
    if rank == 1:
        time.sleep(0.3)
    issued = time.time()
    dist.all_reduce(x)
    out.put((rank, times, issued, time.time()))
    dist.destroy_process_group()


def test_collectives_take_the_emulated_link_time():
    from bench.runtime.launch import _free_port

    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    mp.start_processes(_link_worker, args=(_free_port(), out), nprocs=2, start_method="spawn")
    reports = {r: (times, issued, done) for r, times, issued, done in (out.get(timeout=10) for _ in range(2))}
    times = reports[0][0]
    link = ClusterSpec.from_config(SLOW_LINK).inter_machine
    expected_reduce = collective_time_s("all_reduce", 1e6, 2, link)  # 0.102 s
    expected_gather = collective_time_s("all_gather", 2e6, 2, link)  # 0.102 s
    # Slack: below, the loopback's own cost is estimated (a fraction of a millisecond off);
    # above, a real gloo call on a shared 2-core machine can take tens of milliseconds more.
    low, high = 0.002, 0.08
    for t in times[:3]:
        assert expected_reduce - low <= t < expected_reduce + high
    assert expected_gather - low <= times[3] < expected_gather + high
    late_issue = reports[1][1]
    for rank in (0, 1):
        done = reports[rank][2] - late_issue
        assert expected_reduce - low <= done < expected_reduce + high, rank


def test_an_emulated_run_is_predicted_at_the_host_speed_its_ranks_measured(cfg_factory):
    """Every rank times plain steps of the model (bench.runtime.hostspeed.yardstick) before its reference
    iterations; the row's prediction is the simulator's at the median of their host speeds,
    the planner's (at the parent's probe) stays as planned_iter_time_s."""
    from bench.cost import simulate
    from bench.runner.case import new_record, prepare_case
    from bench.runtime.hostlinks import _KINDS
    from bench.runtime.hostspeed import split_step, yardstick_batches

    cfg = cfg_factory("model=bert", "cluster=local_hetero2", "method=dp_cp", "warmup_iters=2", "measured_iters=4")
    record = run_case(cfg)
    assert record.status == "ok", record.error
    ranks = record.emulation["ranks"]
    batches = list(yardstick_batches(record.batch_shares))
    assert batches[0] == min(record.batch_shares) < max(record.batch_shares) <= batches[1]
    for r in ranks:
        assert r["yardstick"]["batch"] == batches
        assert 0 < r["yardstick"]["seconds"][0] < r["yardstick"]["seconds"][1]
    case = prepare_case(cfg, new_record(cfg))  # the same plan, priced again at the run's speed
    models = sorted(split_step(case.workload, batches, r["yardstick"]["seconds"]) for r in ranks)
    assert record.run_host_flops_per_s == pytest.approx((models[0][0] + models[1][0]) / 2)
    run = case.cluster.at_run_speed(record.run_host_flops_per_s, record.run_host_step_overhead_s)
    assert record.predicted_iter_time_s == pytest.approx(simulate(case.plan.program, run, case.plan.ratios).iter_time_s)
    assert record.planned_iter_time_s == pytest.approx(
        simulate(case.plan.program, case.cluster, case.plan.ratios).iter_time_s
    )
    assert [r["speed"] for r in ranks] == [1.0, 0.4]
    # and with the host transport's floor under the emulated links, measured by real gloo calls
    assert set(record.host_link_floor_s) == set(_KINDS) and all(0 < s < 0.1 for s in record.host_link_floor_s.values())
    assert dict(case.cluster.link_floor) == pytest.approx(record.host_link_floor_s)
