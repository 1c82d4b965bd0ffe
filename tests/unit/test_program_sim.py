"""bench.core.program + bench.cost: the Program format and the cost/memory model."""

from __future__ import annotations

import math

import pytest

from bench.core.cluster import ClusterSpec
from bench.core.program import Affine, Collective, Memory, Program, Stage
from bench.cost import (
    compute_proportional_ratios,
    even_ratios,
    simulate,
    virtual_devices,
)
from methods.dp_program import data_parallel_program

GIB = 2**30


def make_cluster(fast=1, slow=1, per_machine=1, inter_gbps=8.0, latency=1e-4, virtual="gpu"):
    machines = []
    if fast:
        machines.append({"count": fast, "device": "V100-16", "num_devices": per_machine})
    if slow:
        machines.append({"count": slow, "device": "P100-16", "num_devices": per_machine})
    return ClusterSpec.from_config(
        {
            "name": "test",
            "machines": machines,
            "links": {
                "intra_machine": {"bandwidth_gbps": 800.0, "latency_s": 1e-5},
                "inter_machine": {"bandwidth_gbps": inter_gbps, "latency_s": latency},
            },
            "virtual_device": virtual,
        }
    )


def test_affine_evaluates_constant_plus_own_ratio_per_segment():
    a = Affine(5.0, ((0, 10.0), (1, 100.0)))
    ratios = [[0.25, 0.75], [0.5, 0.5]]
    assert a.values(ratios) == [5 + 2.5 + 50, 5 + 7.5 + 50]
    assert (a + Affine.sharded(4.0, 0)).at(ratios, 0) == pytest.approx(5 + 2.5 + 50 + 1)
    assert a.scale(2).at(ratios, 1) == pytest.approx(2 * a.at(ratios, 1))


def test_program_round_trips_through_json():
    prog = Program(
        (
            Stage((), Affine.sharded(1e9), label="fwd"),
            Stage(
                (Collective("all_gather", Affine.sharded(4e6), "grouped", (0, 1), "x"),),
                Affine(3.0, ((0, 2e9),)),
                overlap=True,
                grad_bytes=Affine(8.0),
            ),
        ),
        num_devices=2,
        memory=Memory(params=Affine(1.0), activations=Affine.sharded(2.0)),
        meta={"method": "test"},
        host_work_flops=3e7,
    )
    again = Program.from_json(prog.dumps())
    assert again == prog
    assert again.meta == {"method": "test"} and again.host_work_flops == 3e7
    assert "host_work_flops" not in Program((), 1).to_json()  # rows without it read as before


def test_program_rejects_segment_and_device_out_of_range():
    with pytest.raises(ValueError, match="segment 1"):
        Program((Stage((), Affine.sharded(1.0, segment=1)),), num_devices=2)
    with pytest.raises(ValueError, match="devices"):
        Program((Stage((Collective("all_reduce", Affine(1.0), devices=(0, 5)),)),), num_devices=2)


def test_padded_all_gather_costs_n_times_largest_shard_and_grouped_sums_shards():
    cluster = make_cluster(fast=2, slow=2)  # 4 GPUs on 4 machines: inter link everywhere
    link = cluster.inter_machine
    total = 64e6
    ratios = [[0.7, 0.1, 0.1, 0.1]]
    shard = Affine.sharded(total)
    padded = Program((Stage((Collective("all_gather", shard, "padded"),)),), 4)
    grouped = Program((Stage((Collective("all_gather", shard, "grouped"),)),), 4)
    t_pad = simulate(padded, cluster, ratios).iter_time_s
    t_grp = simulate(grouped, cluster, ratios).iter_time_s
    assert t_pad == pytest.approx(link.latency_s + (4 - 1) / 4 * 4 * 0.7 * total / link.bytes_per_s)
    assert t_grp == pytest.approx(4 * link.latency_s + total / link.bytes_per_s)
    assert t_grp < t_pad  # skewed shards: grouped broadcast wins
    even = even_ratios(4)
    assert simulate(padded, cluster, even).iter_time_s < simulate(grouped, cluster, even).iter_time_s


def test_stage_time_is_comm_plus_slowest_compute_and_stages_add():
    cluster = make_cluster(fast=1, slow=1)
    vd = virtual_devices(cluster, "gpu")
    f = 1e12
    prog = Program(
        (
            Stage((), Affine.sharded(f)),
            Stage((Collective("all_reduce", Affine(1e6)),), Affine(f)),
        ),
        2,
    )
    res = simulate(prog, cluster, [[0.5, 0.5]])
    link = cluster.inter_machine
    ar = link.latency_s + 2 * 0.5 * 1e6 / link.bytes_per_s
    slow = min(v.flops for v in vd)
    assert res.stage_times[0] == (0.0, pytest.approx(0.5 * f / slow))
    assert res.stage_times[1] == (pytest.approx(ar), pytest.approx(f / slow))
    assert res.iter_time_s == pytest.approx(0.5 * f / slow + ar + f / slow)


def test_dp_compute_proportional_beats_even_split_when_compute_bound():
    cluster = make_cluster(fast=1, slow=1, inter_gbps=1000.0)
    prog = data_parallel_program(2, 64, [(1e9, 4e6)] * 10, 1e6)
    t_cp = simulate(prog, cluster, compute_proportional_ratios(cluster, "gpu")).iter_time_s
    t_ev = simulate(prog, cluster, even_ratios(2)).iter_time_s
    flops = 3 * 10 * 1e9 * 64
    ideal = flops / cluster.total_effective_flops()
    assert t_cp < t_ev
    assert t_cp == pytest.approx(ideal, rel=0.05)


def test_dp_overlap_hides_bucket_all_reduce_behind_backward():
    cluster = make_cluster(fast=1, slow=1, inter_gbps=10.0)
    layers = [(2e9, 8e6)] * 12
    with_overlap = data_parallel_program(2, 32, layers, 1e6, bucket_cap_bytes=16e6, overlap=True)
    without = data_parallel_program(2, 32, layers, 1e6, bucket_cap_bytes=16e6, overlap=False)
    ratios = compute_proportional_ratios(cluster, "gpu")
    a = simulate(with_overlap, cluster, ratios)
    b = simulate(without, cluster, ratios)
    assert len(with_overlap.stages) == 12 // 2 + 1  # one bucket per two layers, plus the tail
    assert b.iter_time_s == pytest.approx(b.comm_time_s + b.compute_time_s)
    assert max(a.comm_time_s, a.compute_time_s) <= a.iter_time_s < b.iter_time_s


def test_dp_program_total_bytes_and_flops_add_up():
    layers = [(1e9, 3e6), (2e9, 5e6), (4e9, 7e6)]
    prog = data_parallel_program(4, 16, layers, 0.0, bucket_cap_bytes=6e6)
    ratios = even_ratios(4)
    assert prog.total_flops(ratios) == pytest.approx(3 * 7e9 * 16)
    reduced = sum(c.nbytes.const for st in prog.stages for c in st.collectives)
    assert reduced == pytest.approx(15e6)


def test_memory_flags_oom_on_the_gpu_that_does_not_fit():
    cluster = make_cluster(fast=1, slow=1)
    params = 3 * GIB  # x4 with grads and Adam = 12 GiB: fits 16 GiB without activations
    prog = data_parallel_program(2, 100, [(1e9, params)], activation_bytes_per_sample=0.05 * GIB)
    ok = simulate(prog, cluster, [[0.5, 0.5]])
    # Backward holds 12 + 2.5 GiB; Adam's step 12 + 3 (the square roots of the second moments).
    assert not ok.oom and ok.peak_mem_gib[0] == pytest.approx(12 + 3)
    assert ok.memory_gib[0] == pytest.approx(
        {"params": 3, "grads": 3, "optimizer": 6, "activations": 2.5, "buckets": 0}
    )
    skewed = simulate(prog, cluster, [[0.1, 0.9]])
    assert skewed.oom and skewed.oom_devices == [1]
    assert skewed.memory_gib[1]["activations"] == pytest.approx(4.5)


def test_machine_devices_add_intra_machine_gradient_all_reduce_and_split_activations():
    cluster = make_cluster(fast=1, slow=1, per_machine=4, virtual="machine")
    vd = virtual_devices(cluster, "machine")
    assert [v.num_gpus for v in vd] == [4, 4]
    assert vd[0].flops == pytest.approx(4 * cluster.devices[0].effective_flops)
    grad = 100e6
    prog = Program(
        (Stage((), Affine.sharded(1e12), grad_bytes=Affine(grad)),),
        2,
        granularity="machine",
        memory=Memory(activations=Affine.sharded(8 * GIB)),
    )
    ratios = [[0.5, 0.5]]
    res = simulate(prog, cluster, ratios)
    intra = cluster.intra_machine
    expected = 0.5e12 / vd[1].flops + intra.latency_s + 2 * 3 / 4 * grad / intra.bytes_per_s
    assert res.iter_time_s == pytest.approx(expected)
    assert res.memory_gib[0]["activations"] == pytest.approx(1.0)  # 4 GiB share over 4 GPUs


def test_a_machine_is_priced_at_its_busiest_gpu_when_its_share_splits_unevenly():
    """A machine splits its samples over its GPUs in whole samples: 11 of 32 over 2 GPUs run
    as 6 and 5, so its compute and its GPUs' activations are those of 6 samples a GPU."""
    cluster = make_cluster(fast=2, slow=0, per_machine=2, virtual="machine")
    vd = virtual_devices(cluster, "machine")
    per_sample = 1e10
    prog = Program(
        (Stage((), Affine.sharded(32 * per_sample)),),
        2,
        granularity="machine",
        memory=Memory(activations=Affine.sharded(32 * GIB)),
        batch=32,
    )

    def run(*shares):
        return simulate(prog, cluster, [[n / 32 for n in shares]])

    assert run(22, 10).iter_time_s == pytest.approx(11 * per_sample / (vd[0].flops / 2))
    assert run(21, 11).iter_time_s == pytest.approx(run(22, 10).iter_time_s)  # 11 + 10 and 6 + 5
    assert run(20, 12).iter_time_s == pytest.approx(10 * per_sample / (vd[0].flops / 2))
    assert run(21, 11).memory_gib[1]["activations"] == pytest.approx(6.0)  # 6 samples of 1 GiB
    even = simulate(Program(prog.stages, 2, granularity="machine", memory=prog.memory), cluster, [[21 / 32, 11 / 32]])
    assert even.iter_time_s == pytest.approx(10.5 * per_sample / (vd[0].flops / 2))  # batch unknown: n / g
    # A share of no whole samples (the LP's continuous answer) keeps the even split, as the LP prices it.
    assert run(21.3, 10.7).iter_time_s == pytest.approx(21.3 / 2 * per_sample / (vd[0].flops / 2))
    assert Program.from_json(prog.to_json()).batch == 32


def test_simulate_rejects_program_for_another_cluster_size():
    cluster = make_cluster(fast=1, slow=1)
    prog = Program((Stage((), Affine.sharded(1.0)),), 3)
    with pytest.raises(ValueError, match="3 gpu devices"):
        simulate(prog, cluster, even_ratios(3))
    prog2 = Program((Stage((), Affine.sharded(1.0)),), 2)
    with pytest.raises(ValueError, match="sum to 1"):
        simulate(prog2, cluster, [[0.5, 0.6]])
    assert math.isfinite(simulate(prog2, cluster, [[1.0, 0.0]]).iter_time_s)


def test_all_to_all_across_machines_shares_each_machines_link():
    # 2 machines x 2 GPUs: each GPU sends half its buffer off the machine, and both GPUs of a
    # machine send through the same link: 2 x 1/2 of a shard, not the ring's 3/4.
    cl = make_cluster(fast=1, slow=1, per_machine=2, inter_gbps=8.0, latency=0.0)
    shard = 1e9 / 4
    a2a = Program((Stage((Collective("all_to_all", Affine.sharded(1e9)),)),), 4)
    t = simulate(a2a, cl, even_ratios(4)).iter_time_s
    assert t == pytest.approx(2 * (2 / 4) * shard / 1e9)  # 8 Gbit/s = 1e9 B/s
    # A ring passes each machine's link once: unchanged.
    ag = Program((Stage((Collective("all_gather", Affine.sharded(1e9), "padded"),)),), 4)
    assert simulate(ag, cl, even_ratios(4)).iter_time_s == pytest.approx(4 * shard * 3 / 4 / 1e9)
    # Machines as devices: one member (the leader) per link, the plain (n-1)/n; plus each
    # machine's leader gathering its other GPU's half of the 0.5 GB buffer and scattering it
    # back (intra link: 800 Gbit/s = 1e11 B/s, 10 us).
    m = make_cluster(fast=1, slow=1, per_machine=2, inter_gbps=8.0, latency=0.0, virtual="machine")
    a2a_m = Program((Stage((Collective("all_to_all", Affine.sharded(1e9)),)),), 2, granularity="machine")
    inside = 2 * (1e-5 + 0.5 * 0.5e9 / 1e11)
    assert simulate(a2a_m, m, even_ratios(2)).iter_time_s == pytest.approx(0.5 * 1e9 / 2 / 1e9 + inside)


@pytest.mark.parametrize(
    "src,dst",
    [
        ([500, 250, 250], [250, 250, 500]),
        ([1000, 0, 0], [0, 0, 1000]),
        ([300, 0, 700], [0, 650, 350]),
        ([400, 600], [400, 600]),
    ],
)
def test_reshard_fractions_are_what_changes_owner(src, dst):
    from bench.core.program import reshard_fractions

    def owned(lengths, i):
        start = sum(lengths[:i])
        return set(range(start, start + lengths[i]))

    total = sum(src)
    exact = [
        max(len(owned(src, i) - owned(dst, i)), len(owned(dst, i) - owned(src, i))) / total for i in range(len(src))
    ]
    got = reshard_fractions([x / total for x in src], [x / total for x in dst])
    assert got == pytest.approx(exact, abs=1e-12)
    # The LP's linear bound (how far each device's two interval ends move) is never below it.
    prefix = lambda r, i: sum(r[: i + 1]) / total if 0 <= i < len(r) - 1 else 0.0  # noqa: E731
    bound = [
        abs(prefix(src, i - 1) - prefix(dst, i - 1)) + abs(prefix(src, i) - prefix(dst, i)) for i in range(len(src))
    ]
    assert all(b >= e - 1e-12 for b, e in zip(bound, exact))


def test_reshard_costs_what_changes_owner_and_nothing_between_equal_rows():
    cl = make_cluster(fast=1, slow=2, inter_gbps=8.0, latency=1e-4)
    nbytes = 1e8
    pending = Stage((Collective("all_reduce", Affine(4e8)),), overlap=True)
    border = Stage((Collective("reshard", Affine(nbytes), rows=(0, 1)),), Affine.sharded(1e12, 1))
    prog = Program((Stage((), Affine.sharded(1e12, 0)), pending, border), 3, num_segments=2)
    moved = [[0.5, 0.25, 0.25], [0.25, 0.25, 0.5]]  # device 1 gives and takes a quarter
    link = cl.inter_machine
    res = simulate(prog, cl, moved)
    assert res.stage_times[2][0] == pytest.approx(link.latency_s + 0.25 * nbytes / link.bytes_per_s)
    # Equal rows: no call, so the border does not wait for the pending all-reduce either.
    same = [[0.5, 0.25, 0.25]] * 2
    res = simulate(prog, cl, same)
    assert res.stage_times[2][0] == 0.0
    compute = sum(max(1e12 * r / d.effective_flops for r, d in zip(same[0], cl.devices)) for _ in range(2))
    ar = res.stage_times[1][0]
    assert res.iter_time_s == pytest.approx(max(compute, compute / 2 + ar), rel=1e-9)
    with pytest.raises(ValueError, match="rows"):
        Collective("reshard", Affine(nbytes))
    with pytest.raises(ValueError, match="rows"):
        Program((Stage((Collective("reshard", Affine(nbytes), rows=(0, 2)),)),), 3, num_segments=2)
    assert Program.from_json(prog.to_json()) == prog


def test_collective_among_machines_is_priced_in_three_steps():
    # Machines of 1 and 3 GPUs (intra: 800 Gbit/s = 1e11 B/s, 10 us; inter: 8 Gbit/s = 1e9 B/s,
    # 100 us). A padded all-gather of a 1 GB tensor at ratios 0.25 / 0.75: the leaders
    # all-gather 2 x the largest shard (0.75 GB); inside the 3-GPU machine the leader first
    # gathers 2/3 of its 0.75 GB shard, then scatters 2/3 of the gathered 1.5 GB back. The
    # 1-GPU machine has no step inside.
    cl = ClusterSpec.from_config(
        {
            "name": "m13",
            "virtual_device": "machine",
            "machines": [
                {"count": 1, "device": "V100-16", "num_devices": 1},
                {"count": 1, "device": "V100-16", "num_devices": 3},
            ],
            "links": {
                "intra_machine": {"bandwidth_gbps": 800.0, "latency_s": 1e-5},
                "inter_machine": {"bandwidth_gbps": 8.0, "latency_s": 1e-4},
            },
        }
    )
    ratios = [[0.25, 0.75]]
    ag = Program((Stage((Collective("all_gather", Affine.sharded(1e9), "padded"),)),), 2, granularity="machine")
    among = 1e-4 + 2 * 0.75e9 * (1 / 2) / 1e9
    inside = (1e-5 + 2 / 3 * 0.75e9 / 1e11) + (1e-5 + 2 / 3 * 1.5e9 / 1e11)
    assert simulate(ag, cl, ratios).iter_time_s == pytest.approx(among + inside)
    # A gradient all-reduce starts from the machine's sum: leaders all-reduce, then broadcast.
    grad = Program((Stage((Collective("all_reduce", Affine(1e8), grad=True),)),), 2, granularity="machine")
    assert simulate(grad, cl, ratios).iter_time_s == pytest.approx((1e-4 + 2 * 0.5 * 1e8 / 1e9) + (1e-5 + 1e8 / 1e11))
    # The same at GPU granularity is one flat ring over the 4 GPUs (no step inside).
    ag_gpu = Program((Stage((Collective("all_gather", Affine.sharded(1e9), "padded"),)),), 4)
    assert simulate(ag_gpu, cl, even_ratios(4)).iter_time_s == pytest.approx(1e-4 + 4 * 0.25e9 * 3 / 4 / 1e9)


def test_gradient_all_reduce_inside_machines_overlaps_later_backward():
    # 2 machines x 4 GPUs. Stage 1 makes 100 MB of gradients, stage 2 computes for longer than
    # their all-reduce inside the machine takes: only stage 2's own sync shows at the end.
    cluster = make_cluster(fast=1, slow=1, per_machine=4, virtual="machine")
    vd = virtual_devices(cluster, "machine")
    intra = cluster.intra_machine
    sync = intra.latency_s + 2 * 3 / 4 * 100e6 / intra.bytes_per_s  # 1.5e-3 s at 800 Gbit/s
    slow_flops = vd[1].flops
    stages = (
        Stage((), Affine.sharded(2e12), grad_bytes=Affine(100e6)),
        Stage((), Affine.sharded(2e12), grad_bytes=Affine(10e6)),
    )
    prog = Program(stages, 2, granularity="machine")
    compute = 2 * 1e12 / slow_flops
    assert compute / 2 > sync  # stage 2 hides stage 1's sync
    last = intra.latency_s + 2 * 3 / 4 * 10e6 / intra.bytes_per_s
    assert simulate(prog, cluster, [[0.5, 0.5]]).iter_time_s == pytest.approx(compute + last)
    # The LP prices the same (balance_ratios' objective at the ratios it picks).
    from methods.hap.balance import balance_ratios

    ratios, objective = balance_ratios(prog, cluster)
    assert objective == pytest.approx(simulate(prog, cluster, ratios).iter_time_s, rel=1e-6)


def test_adams_step_is_the_peak_where_activations_are_small_and_the_lp_keeps_it_in_memory():
    # torch's multi-tensor Adam takes every second moment's square root at once: one more
    # buffer per parameter. On an H200 the paper models at 1-4 samples peaked that much above
    # parameters + gradients + moments + activations.
    from methods.hap.balance import InfeasibleError, balance_ratios

    cluster = make_cluster(fast=1, slow=1)  # 16 GiB each
    prog = data_parallel_program(2, 100, [(1e9, 3.5 * GIB)], activation_bytes_per_sample=1e-3 * GIB)
    res = simulate(prog, cluster, [[0.5, 0.5]])
    assert sum(res.memory_gib[0].values()) == pytest.approx(14.05)  # backward: fits
    assert res.peak_mem_gib[0] == pytest.approx(5 * 3.5) and res.oom  # Adam's step: does not
    with pytest.raises(InfeasibleError, match="memory"):
        balance_ratios(prog, cluster, memory_limit=True)


def _peak(points, ratios, device):
    return max(g.at(ratios, device) + a.at(ratios, device) for g, a in points)


def test_backward_sweep_keeps_every_point_where_the_peak_can_fall():
    # Six equal layers, then a head whose gradient is large and whose activations are small:
    # gradients appear from the last layer back while activations are freed. Each layer's
    # tensors live in one of two segments, sharded by that segment's ratios.
    import random

    from bench.core.program import backward_sweep

    grads, acts = [], []
    for layer in range(6):
        seg = layer % 2
        grads += [(3 * layer, Affine(4e6)), (3 * layer + 1, Affine.sharded(2e6, seg))]
        acts += [(3 * layer, Affine.sharded(9e6, seg)), (3 * layer + 2, Affine.sharded(1e6, 1 - seg))]
    grads.append((20, Affine(30e6)))
    acts.append((20, Affine.sharded(0.5e6, 0)))
    # Activation gradients: each layer's output's, from its last use to where it was made,
    # and one at the head only.
    flight = [(3 * layer + 2, 3 * layer + 4, Affine.sharded(3e6, layer % 2)) for layer in range(6)]
    flight.append((20, 20, Affine.sharded(2e6, 1)))
    kept = backward_sweep(grads, acts, in_flight=flight)
    # Every point, by brute force: at position k, the gradients made at k or later, the
    # activations freed at k or before, and the activation gradients live at k.
    positions = sorted({p for p, _ in grads + acts} | {p for a, b, _ in flight for p in (a, b)}, reverse=True)
    everything = [
        (
            sum((b for p, b in grads if p >= k), Affine()),
            sum((b for p, b in acts if p <= k), Affine()) + sum((x for a, b, x in flight if a <= k <= b), Affine()),
        )
        for k in positions
    ]
    assert len(kept) < len(everything) / 2
    assert all(any(_same(point, p) for p in everything) for point in kept)
    rng = random.Random(0)
    for _ in range(200):
        ratios = [[x, 1 - x] for x in (rng.random(), rng.random())]
        for d in range(2):
            assert _peak(kept, ratios, d) == pytest.approx(_peak(everything, ratios, d), rel=1e-12)
    # The first point is backward's start: every activation and the head's activation
    # gradient, only the head's gradient.
    g0, a0 = kept[0]
    ones = [[1.0], [1.0]]
    assert g0 == Affine(30e6) and a0.at(ones, 0) == pytest.approx(sum(b.at(ones, 0) for _, b in acts) + 2e6)


def _same(p, q) -> bool:
    """Two points equal up to rounding (a gradient subtracted on leaving is not exact)."""
    rng = [[0.3, 0.7], [0.6, 0.4]]
    return all(x.at(rng, d) == pytest.approx(y.at(rng, d), rel=1e-12, abs=1e-3) for x, y in zip(p, q) for d in range(2))


def test_ddp_peaks_before_its_gradients_exist_where_activations_dominate():
    # DDP sets gradients to None each step: backward starts with every activation and no
    # gradient; the gradients exist at its end, when the activations are gone.
    layers = [(1e9, 0.5 * GIB)] * 4
    acts_per_sample = 0.1 * GIB  # 5 GiB a device
    backward = ([(i, 0.5 * GIB) for i in range(4)], [(i, acts_per_sample * 100 / 4) for i in range(4)])
    swept = data_parallel_program(2, 100, layers, acts_per_sample, backward_memory=backward, bucket_copies=True)
    together = data_parallel_program(2, 100, layers, acts_per_sample, bucket_copies=True)
    cluster = make_cluster(fast=1, slow=1)
    ratios = [[0.5, 0.5]]
    held = 2 + 4 + 2  # parameters, Adam's moments, DDP's buckets (GiB)
    assert simulate(together, cluster, ratios).peak_mem_gib[0] == pytest.approx(held + 2 + 5)
    # The last layer's gradient is made while every activation is still kept.
    assert simulate(swept, cluster, ratios).peak_mem_gib[0] == pytest.approx(held + 0.5 + 5)
    assert len(swept.memory.backward) == 2  # the first and the last layer's
    assert Program.from_json(swept.to_json()).memory == swept.memory
    # hap's runtime: the gradients are views of buckets made before backward.
    before = data_parallel_program(
        2, 100, layers, acts_per_sample, backward_memory=backward, grads_before_backward=True
    )
    assert simulate(before, cluster, ratios).peak_mem_gib[0] == pytest.approx(2 + 4 + 2 + 5)


def test_gradient_accumulation_repeats_the_work_at_a_micro_batch_and_syncs_gradients_once():
    """k micro-steps (bench.core.program.micro_step_stages): the same FLOPs, every kernel launched
    k times, the gradients all-reduced once (DDP's no_sync), activations of one micro-batch and
    every gradient beside them from the second micro-step on."""
    layers = [(1e9, 3e6, "matmul", 2), (2e9, 5e6, "matmul", 3), (4e9, 7e6, "other", 1)]
    memory = ([(0, 3e6), (1, 5e6), (2, 7e6)], [(0, 8e6), (1, 8e6), (2, 8e6)])
    one = data_parallel_program(2, 16, layers, 1.5e6, bucket_cap_bytes=6e6, backward_memory=memory)
    four = data_parallel_program(2, 16, layers, 1.5e6, bucket_cap_bytes=6e6, backward_memory=memory, micro_steps=4)
    ratios = even_ratios(2)
    assert four.total_flops(ratios) == pytest.approx(one.total_flops(ratios))
    assert sum(st.launches for st in four.stages) == pytest.approx(4 * sum(st.launches for st in one.stages))
    synced = [c for st in four.stages for c in st.collectives]
    assert synced == [c for st in one.stages for c in st.collectives] and all(c.grad for c in synced)
    assert all(st.label.startswith("micro-step 3: ") for st in four.stages if st.collectives)
    assert four.batch == 4 and four.memory.activations.at(ratios, 0) == pytest.approx(1.5e6 * 16 / 2 / 4)
    (held, acts), *_ = four.memory.backward_points()
    assert held.const == pytest.approx(15e6 * 4) and acts.at(ratios, 0) == pytest.approx(24e6 / 2 / 4)
    cluster = make_cluster(fast=1, slow=1, inter_gbps=1.0)
    slow_link = [simulate(p, cluster, ratios).iter_time_s for p in (one, four)]
    assert slow_link[1] == pytest.approx(slow_link[0], rel=0.2)  # one sync: not 4 x the network
    with pytest.raises(ValueError, match="micro_steps must divide global_batch"):
        data_parallel_program(2, 15, layers, 1.5e6, micro_steps=4)


def test_engines_that_reduce_every_micro_step_repeat_their_collectives():
    stages = [
        Stage((Collective("all_gather", Affine(1e6)),), Affine.sharded(1e9), label="fwd"),
        Stage((Collective("all_reduce", Affine(2e6), grad=True),), Affine.sharded(2e9), overlap=True, label="bwd"),
        Stage((Collective("all_reduce", Affine(3e6), grad=True),), overlap=True, label="tail"),
    ]
    from bench.core.program import micro_step_stages, without_grad_sync

    quiet = without_grad_sync(stages)
    assert [st.label for st in quiet] == ["fwd", "bwd"] and quiet[1].collectives == () and not quiet[1].overlap
    every = micro_step_stages(stages, 3, sync_each=True)
    assert len(every) == 9 and sum(len(st.collectives) for st in every) == 9
    once = micro_step_stages(stages, 3)
    assert len(once) == 2 + 2 + 3 and sum(len(st.collectives) for st in once) == 2 + 1 + 2
    assert micro_step_stages(stages, 1) == tuple(stages)


def test_an_emulated_workers_per_step_part_is_paid_once_per_micro_step():
    """Its per-step part is mostly the dispatch of every op of forward and backward, which each
    micro-step repeats (bench.cost.price.per_step_s); the program round-trips its micro-steps."""
    cluster = ClusterSpec.from_config(
        {
            "name": "cpu2",
            "machines": [{"count": 2, "device": "cpu", "num_devices": 1}],
            "links": {lv: {"bandwidth_gbps": 8.0, "latency_s": 1e-4} for lv in ("intra_machine", "inter_machine")},
        }
    ).with_host_speed(1e10, 0.002)
    layers = [(1e6, 3e6)] * 4
    one, three = (data_parallel_program(2, 12, layers, 1e3, micro_steps=k) for k in (1, 3))
    ratios = even_ratios(2)
    assert simulate(three, cluster, ratios).per_step_s == pytest.approx(3 * simulate(one, cluster, ratios).per_step_s)
    assert Program.from_json(three.dumps()) == three and three.micro_steps == 3


def test_unlabelled_micro_steps_share_one_micro_steps_stages_and_price_the_same():
    """micro_step_stages(labelled=False), for a program that is only priced: the micro-steps
    before the last are the same stage objects (without their gradient syncs), and the
    simulator prices the program exactly as the labelled one."""
    from bench.core.program import micro_step_stages

    stages = [
        Stage((Collective("all_gather", Affine(1e6)),), Affine.sharded(1e9), label="fwd", launches=2),
        Stage((Collective("all_reduce", Affine(2e6), grad=True),), Affine.sharded(2e9), overlap=True, label="bwd"),
        Stage((Collective("all_reduce", Affine(3e6), grad=True),), overlap=True, label="tail"),
    ]
    labelled = micro_step_stages(stages, 5)
    bare = micro_step_stages(stages, 5, labelled=False)
    assert [st.label for st in labelled[:2]] == ["micro-step 0: fwd", "micro-step 0: bwd"]
    assert len(bare) == len(labelled) and bare[0] is bare[2] and bare[1] is bare[3] and bare[-3:] == tuple(stages)
    strip = lambda sts: [(st.collectives, st.flops, st.overlap, st.grad_bytes, st.op_class, st.launches) for st in sts]  # noqa: E731
    assert strip(bare) == strip(labelled)
    cluster = make_cluster(fast=1, slow=1, inter_gbps=1.0)
    memory = Memory(params=Affine(1e6), activations=Affine.sharded(4e6))
    ratios = compute_proportional_ratios(cluster, "gpu", 1)
    a, b = (simulate(Program(s, 2, memory=memory, micro_steps=5), cluster, ratios) for s in (labelled, bare))
    assert (a.iter_time_s, a.peak_mem_gib) == (b.iter_time_s, b.peak_mem_gib)
