"""Emulation fidelity: a slow device takes 1/speed as long; a link takes its alpha-beta time."""

import os
import time

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from bench import hostcpu
from bench.cluster import ClusterSpec
from bench.cost import collective_time_s
from bench.emulation import DILATION_TOLERANCE, EmulationSettings, Emulator
from bench.run import run_case

pytestmark = pytest.mark.e2e


def test_each_rank_reports_its_achieved_dilation(cfg_factory):
    """The row's per-rank numbers: paced against the reference, nothing left unreferenced."""
    cfg = cfg_factory("model=bert", "cluster=local_hetero2", "warmup_iters=2", "measured_iters=10")
    record = run_case(cfg)
    assert record.status == "ok", record.error
    ranks = record.emulation["ranks"]
    assert [r["speed"] for r in ranks] == [1.0, 0.4]
    assert record.emulation["headroom"] == EmulationSettings.auto_headroom(2)
    for r in ranks:
        assert r["unreferenced_intervals"] == 0
        assert r["achieved_dilation"] == pytest.approx(1 / r["speed"], rel=0.5)
    assert record.emulation["ok"] == (abs(record.emulation["max_error"]) <= 0.05)


def test_a_slow_device_takes_one_over_its_speed_through_the_worker():
    """End to end: tiny BERT trained by the real worker path (one spawned process) at speeds
    0.25, 0.4 and 0.5, each between two speed-1 runs, all paced against one reference
    (bench.dilation). Iteration time x speed over speed 1's must be 1. Band: 30 values on a quiet
    2-core VM fell within 0.997-1.000 (README, "How emulation works"); the band is the 5% a row
    is flagged at (DILATION_TOLERANCE), not the measured spread, so that a loaded CI machine
    (where the speed-1 rank may miss its target) does not fail it; 0.94-1.11 is what per-case
    references gave before."""
    from bench.dilation import SPEEDS, measure

    achieved = measure(SPEEDS)
    assert set(achieved) == set(SPEEDS)
    for speed, value in achieved.items():
        assert value == pytest.approx(1.0, abs=DILATION_TOLERANCE), (speed, achieved)


SLOW_LINK = {
    "name": "slow_link", "emulated": True,
    "machines": [{"count": 2, "device": "cpu", "num_devices": 1}],
    "links": {"intra_machine": {"bandwidth_gbps": 1.0, "latency_s": 0.0},
              "inter_machine": {"bandwidth_gbps": 0.08, "latency_s": 0.002}},  # 10 MB/s
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
    from bench.launch import _free_port

    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    mp.start_processes(_link_worker, args=(_free_port(), out), nprocs=2, start_method="spawn")
    reports = {r: (times, issued, done) for r, times, issued, done in
               (out.get(timeout=10) for _ in range(2))}
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


def test_a_calibration_case_predicts_the_run_as_the_host_realises_it(cfg_factory):
    """emulation.predict_contention: one probe process per rank steps the plain model at its
    rank's share, alone and in lockstep; the prediction slows each rank by its together time
    over the host model's price, the planned time stays the configured cluster's, and the
    emulated ranks still run at their configured speeds."""
    cfg = cfg_factory("model=bert", "cluster=local_hetero2", "method=dp_cp", "warmup_iters=2",
                      "measured_iters=4", "emulation.predict_contention=true")
    record = run_case(cfg)
    assert record.status == "ok", record.error
    probe = record.host_contention
    assert [r["samples"] for r in probe] == record.batch_shares
    for r in probe:
        assert r["alone_s"] > 0 and r["together_s"] > 0
        assert r["factor"] == pytest.approx(r["together_s"] / r["host_model_s"])
    assert record.planned_iter_time_s is not None
    assert record.predicted_iter_time_s != record.planned_iter_time_s
    assert [r["speed"] for r in record.emulation["ranks"]] == [1.0, 0.4]


@pytest.mark.parametrize("method", ["dp_ev", "hap", "deepspeed"])
def test_ranks_beyond_the_cores_measure_their_references_in_turns(cfg_factory, monkeypatch, method):
    """4 ranks on 2 cores' worth of compute slots: every rank measured its reference in turns,
    and none waited out bench.emulation.SLOT_WAIT_S for one. A method that blocks where the
    emulator cannot see while it holds a turn (DDP's wait for its last bucket, without the
    hook that gives the turn back) makes the others miss theirs."""
    monkeypatch.setattr(hostcpu, "host_cores", lambda: 2)
    cfg = cfg_factory("model=bert", "cluster=local_hetero4", f"method={method}", "warmup_iters=1",
                      "measured_iters=2")
    record = run_case(cfg)
    assert record.status == "ok", record.error
    for r in record.emulation["ranks"]:
        assert r["compute_slots"] and r["slot_missed_intervals"] == 0, r
