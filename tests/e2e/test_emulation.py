"""Emulation fidelity: a slow device takes 1/speed as long; a link takes its alpha-beta time."""

import os
import statistics
import time

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from bench.cluster import ClusterSpec
from bench.cost import collective_time_s
from bench.emulation import Emulator
from bench.launch import launch
from bench.run import new_record, prepare_case

pytestmark = pytest.mark.e2e


def _iteration_time(cfg_factory, speed):
    cfg = cfg_factory("model=bert", "cluster=local_homo2", "~cluster.machines",
                      f"+cluster.machines=[{{count: 1, device: cpu, num_devices: 1, speed: {speed}}}]",
                      "warmup_iters=3", "measured_iters=25")
    case = prepare_case(cfg, new_record(cfg))
    return statistics.median(launch(case, 1, timeout_s=120)[0]["iter_times_s"][3:])


def test_a_device_at_half_speed_takes_twice_as_long(cfg_factory):
    ratios = []
    for _ in range(3):  # interleaved, so drifting host load hits both speeds alike
        fast = _iteration_time(cfg_factory, 1.0)
        slow = _iteration_time(cfg_factory, 0.5)
        ratios.append(slow / fast)
    ratio = statistics.median(ratios)
    print(f"measured dilation at speed 0.5: {ratio:.3f} (runs: {[round(r, 3) for r in ratios]})")
    assert 1.9 <= ratio <= 2.1


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
    for t in times[:3]:
        assert expected_reduce <= t < expected_reduce + 0.05
    assert expected_gather <= times[3] < expected_gather + 0.05
    late_issue = reports[1][1]
    for rank in (0, 1):
        done = reports[rank][2]
        assert late_issue + expected_reduce <= done < late_issue + expected_reduce + 0.05, rank
