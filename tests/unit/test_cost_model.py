"""bench.cost: one price for the search, the LP and the simulator, on the plans the planner makes;
and at paper scale, no part of hap switched off makes it faster."""

from __future__ import annotations

import functools
import json

import pytest

from bench.core.program import Affine, Collective, Program, Stage
from bench.cost import compute_proportional_ratios, even_ratios, memory_proportional_ratios, simulate, virtual_devices
from bench.studies.planner_quality import PARTS_OFF, plan_case
from methods.dp_program import data_parallel_program
from methods.graph import capture_config
from methods.hap.balance import balance_ratios
from methods.hap.planner import HapPlanner
from tests.unit.test_hap_planner import bert_workload, cluster


@pytest.fixture(scope="module")
def planned():
    """(plan, cluster) of hap on a 1 fast + 2 slow machine cluster, 2 GPUs each, 4 segments:
    overlapped gradient buckets, machine-level devices and reshards all appear."""
    cl = cluster(fast=1, slow=2, k=2, inter_gbps=5.0)
    plan = HapPlanner(cache_dir=None, num_segments=4, levels="cluster").plan(bert_workload(batch=24, num_devices=6), cl)
    assert plan.program.num_segments == 4
    return plan, cl


def test_lp_with_tied_rows_prices_exactly_what_the_simulator_does(planned):
    plan, cl = planned
    ratios, objective = balance_ratios(plan.program, cl, tied_rows=True)
    assert objective == pytest.approx(simulate(plan.program, cl, ratios).iter_time_s, rel=1e-6)
    # ... and it is the optimum over ratios: no start the planner knows does better.
    segments = plan.program.num_segments
    for start in (compute_proportional_ratios(cl, "machine", segments), even_ratios(3, segments)):
        assert objective <= simulate(plan.program, cl, start).iter_time_s * (1 + 1e-6)


def test_lp_with_free_rows_never_prices_below_the_simulator(planned):
    plan, cl = planned
    ratios, objective = balance_ratios(plan.program, cl, tied_rows=False)
    assert objective >= simulate(plan.program, cl, ratios).iter_time_s * (1 - 1e-6)


def test_lp_prices_data_parallel_overlap_like_the_simulator():
    """DDP's program overlaps bucketed all-reduces with backward: the LP's objective is the
    simulator's overlapped time, not the sum of the stages."""
    cl = cluster(fast=1, slow=2, inter_gbps=2.0, virtual="gpu")
    wl = bert_workload(batch=24)
    graph = capture_config(wl.model_cfg, wl.global_batch)
    prog = data_parallel_program(3, 24, graph.layer_profile(), graph.activation_bytes() / 24, bucket_cap_bytes=2**16)
    ratios, objective = balance_ratios(prog, cl)
    sim = simulate(prog, cl, ratios)
    assert objective == pytest.approx(sim.iter_time_s, rel=1e-6)
    assert sim.iter_time_s < sim.comm_time_s + sim.compute_time_s  # something did overlap


def test_planner_starts_from_several_ratio_vectors_and_keeps_the_best():
    # compute-bound: the LP stays near cp (with 2 GPUs per machine the LP from cp lands on the
    # even start's ratios, so that start is skipped as already searched)
    cl = cluster(fast=1, slow=2, k=1, inter_gbps=100.0)
    plan = HapPlanner(cache_dir=None).plan(bert_workload(batch=24, num_devices=3), cl)
    starts = {r["start"] for r in plan.details["rounds"]}
    assert {"compute-proportional", "even"} <= starts
    best = min(r["iter_time_s"] for r in plan.details["rounds"])
    assert plan.details["predicted_iter_time_s"] == pytest.approx(best)


def _timeline_s(program, cl, ratios) -> float:
    """A program's time as the search composes it: every stage's map on the lanes, then the
    host, optimizer and per-step terms (bench.cost.price.program_maps, step_terms)."""
    from bench.cost.algebra import FloatAlgebra
    from bench.cost.lanes import ZERO_LANES, apply
    from bench.cost.price import busiest_gpu_ratios, program_maps, step_terms

    vdevs = virtual_devices(cl, program.granularity)
    alg = FloatAlgebra(ratios, busiest_gpu_ratios(ratios, vdevs, program.batch))
    lanes = ZERO_LANES
    for m in program_maps(program, cl, vdevs, alg):
        lanes = apply(m, lanes)
    return step_terms(program, cl, vdevs, alg, max(lanes))


def test_the_stage_maps_time_a_program_as_the_simulator_does(planned, tmp_path):
    """The search prices with max-plus maps of the stages (bench.cost.lanes.stage_map); composed
    over a whole program they give iteration_time's time: buckets beside backward, the lane
    inside machines, reshards, a profiled GPU's queueing and optimizer step."""
    plan, cl = planned
    assert _timeline_s(plan.program, cl, plan.ratios) == pytest.approx(
        simulate(plan.program, cl, plan.ratios).iter_time_s, rel=1e-12
    )
    wl = bert_workload(batch=24)
    graph = capture_config(wl.model_cfg, wl.global_batch)
    ddp = data_parallel_program(3, 24, graph.layer_profile(), graph.activation_bytes() / 24, bucket_cap_bytes=2**16)
    gpus = cluster(fast=1, slow=2, inter_gbps=2.0, virtual="gpu")
    profiled = _cluster_with_profile(
        _profile_file(
            tmp_path,
            compute={
                "matmul": {"fixed_s": 1e-6, "flops_per_s": 1e12, "dispatch_s": 2e-5},
                "other": {"fixed_s": 1e-6, "flops_per_s": 1e11, "dispatch_s": 1e-5},
            },
            optimizer={"fixed_s": 1e-5, "bytes_per_s": 1e12, "dispatch_s": 3e-5},
        ),
        gpus=3,
    )
    for cl in (gpus, profiled):
        for ratios in ([[1 / 3] * 3], [[0.5, 0.25, 0.25]]):
            sim = simulate(ddp, cl, ratios)
            # something did overlap; on the profiled GPUs the host's queueing is the longer
            assert sim.iter_time_s < sim.comm_time_s + sim.compute_time_s or cl is profiled
            assert _timeline_s(ddp, cl, ratios) == pytest.approx(sim.iter_time_s, rel=1e-12)


@pytest.mark.parametrize("granularity", ["gpu", "machine"])
def test_the_search_prices_a_program_as_the_simulator_times_it_with_a_bucket_per_gradient(granularity):
    """With one bucket per gradient (method.bucket_cap_mb=0), or without overlap, the search's
    price of a complete program is its simulated time: overlap of the syncs with backward, the lane inside
    machines, the busiest GPU of a machine, the optimizer step and the per-step terms alike.
    With larger buckets a gradient is charged its share of its bucket's all-reduce, launched
    with its own gradient: close, not exact (bench.planner_check --agreement)."""
    from bench.core.cluster import ClusterSpec
    from methods.hap.lowering import build_program
    from methods.hap.pricing import CostModel
    from methods.hap.search import synthesize
    from methods.hap.theory import derive_theory

    # emulated CPU workers: a per-step part and Adam's cost per byte held, a transport floor
    links = {
        "intra_machine": {"bandwidth_gbps": 66.0, "latency_s": 1e-5},
        "inter_machine": {"bandwidth_gbps": 1.0, "latency_s": 3e-5},
    }
    cl = (
        ClusterSpec.from_config(
            {
                "name": "cpus",
                "emulated": True,
                "virtual_device": granularity,
                "links": links,
                "machines": [
                    {"count": 1, "device": "cpu", "num_devices": 2, "speed": 1.0},
                    {"count": 2, "device": "cpu", "num_devices": 2, "speed": 0.5},
                ],
            }
        )
        .with_host_speed(2e11, 3e-3, 1e-10, 4e7)
        .with_link_floor({"all_reduce": 2e-5, "all_gather": 1e-5})
    )
    wl = bert_workload(batch=24, num_devices=6)
    theory = derive_theory(capture_config(wl.model_cfg, wl.global_batch))
    uneven = [5, 10, 9] if granularity == "machine" else [2, 3, 4, 5, 6, 4]  # of 24 samples
    for ratios in (even_ratios(len(uneven), 2), [[k / 24 for k in uneven]] * 2):
        # one bucket per gradient, 64 KiB buckets, and every sync in its op's backward (no overlap)
        for cap, overlap, exact in ((0.0, True, True), (2**16, True, False), (0.0, False, True)):
            cost = CostModel(theory, cl, granularity, ratios, "flops", grad_bucket_bytes=cap, grad_overlap=overlap)
            best = synthesize(theory, cost, beam_width=40)
            assert best.cost_s == pytest.approx(cost.program_cost(best.steps, best.final_comms), rel=1e-12)
            program = build_program(best.steps, cost, grad_overlap=overlap, bucket_cap_bytes=cap)
            result = simulate(program, cl, ratios)
            sim = result.iter_time_s
            assert result.per_step_s > 0
            if exact:
                assert best.cost_s == pytest.approx(sim, rel=1e-9)
            else:
                assert best.cost_s == pytest.approx(sim, rel=0.05)


def test_memory_proportional_ratios_follow_each_machines_memory():
    cl = cluster(fast=1, slow=1, k=2)
    vd = virtual_devices(cl, "machine")
    assert memory_proportional_ratios(cl, "machine")[0] == pytest.approx([0.5, 0.5])
    assert sum(v.num_gpus for v in vd) == 4


# The paper-scale cases (paper preset: 64 samples per GPU, 32 for BERT-MoE, on paper_hetero):
# every model at k = 1 and 8, as `python -m bench.planner_check` plans them (docs/planner.md,
# "Plans, the cache and the tools"), and VGG19 at 32 per GPU. Each case is planned
# once per session (paper_plan) and shared by the tests below; they are simulation only.
PAPER_MODELS = ("vgg19", "vit", "bert", "bert_moe")
MONOTONE_CASES = [(m, k, ()) for m in PAPER_MODELS for k in (1, 8)] + [("vgg19", 8, ("global_batch=2048",))]


@functools.cache
def paper_plan(model: str, k: int, *overrides: str) -> dict:
    return plan_case(model, k, *overrides)


@pytest.mark.parametrize("model,k,overrides", MONOTONE_CASES, ids=lambda v: str(v))
def test_switching_a_part_off_never_makes_hap_faster(model, k, overrides):
    full = paper_plan(model, k, *overrides)
    for name, extra in PARTS_OFF.items():
        part_off = paper_plan(model, k, *overrides, *extra)
        assert (full["oom"], full["iter_time_s"] * (1 - 1e-9)) <= (part_off["oom"], part_off["iter_time_s"]), name


@functools.cache
def baseline_time(model: str, k: int, method: str) -> tuple[bool, float]:
    """(OOM, simulated seconds) of a baseline's plan at paper scale, as bench.run mode=sim prices it."""
    from bench.runner.case import new_record, prepare_case
    from tests.conftest import compose_settings

    no_cache = ["method.cache_dir=null"] if method == "sfb" else []  # the planners' plan cache: not written
    cfg = compose_settings(
        "mode=sim",
        "preset=paper",
        "cluster=paper_hetero",
        f"cluster.gpus_per_machine={k}",
        f"model={model}",
        f"method={method}",
        *no_cache,
    )
    record = new_record(cfg)
    prepare_case(cfg, record)
    return record.predicted_oom, record.predicted_iter_time_s


@pytest.mark.parametrize("model,k", [(m, k) for m in PAPER_MODELS for k in (1, 8)])
def test_hap_is_at_least_as_fast_as_every_baseline_at_paper_scale(model, k):
    """hap against DDP at even and compute-proportional shares, DeepSpeed's ZeRO-1 program and
    sfb, each as its own method plans it, all priced by the same simulator: fitting first, then
    time (DDP does not fit BERT-MoE at paper scale)."""
    hap = paper_plan(model, k)
    for method in ("dp_ev", "dp_cp", "deepspeed", "sfb"):
        oom, seconds = baseline_time(model, k, method)
        assert (hap["oom"], hap["iter_time_s"]) <= (oom, seconds * (1 + 1e-9)), method


# -- collectives from a measured profile ------------------------------------------------------
def _profiled_cluster(tmp_path, fits: dict | str):
    from bench.core.cluster import ClusterSpec

    path = tmp_path / "profile.json"
    path.write_text(fits if isinstance(fits, str) else json.dumps({"ranks": 2, "fits": fits}))
    link = {"bandwidth_gbps": 8.0, "latency_s": 1e-5, "profile": str(path)}
    return ClusterSpec.from_config(
        {
            "name": "p",
            "virtual_device": "gpu",
            "machines": [{"count": 1, "device": "V100-16", "num_devices": 2}],
            "links": {"intra_machine": link, "inter_machine": link},
        }
    )


def test_a_profiled_kind_is_priced_by_its_fit_and_the_others_by_the_link(tmp_path):
    from bench.cost import collective_time_s

    cl = _profiled_cluster(
        tmp_path,
        {
            "all_gather/padded": {"latency_s": 1e-3, "bytes_per_s": 1e8},
            "broadcast/ring": {"latency_s": 2e-4, "bytes_per_s": 5e8},
        },
    )
    link = cl.intra_machine
    # all_gather of 2e8 bytes over 2 ranks: half crosses each link.
    assert collective_time_s("all_gather", 2e8, 2, link) == pytest.approx(1e-3 + 1e8 / 1e8)
    assert collective_time_s("all_reduce", 1e9, 2, link) == pytest.approx(1e-5 + 1e9 / 1e9)  # 8 Gbit/s
    assert collective_time_s("reduce", 5e8, 2, link) == pytest.approx(2e-4 + 1.0)  # the broadcast's fit
    # The simulator prices the same call through the same function.
    prog = Program((Stage((Collective("all_gather", Affine.sharded(2e8), "padded"),), Affine()),), 2)
    assert simulate(prog, cl, [[0.5, 0.5]]).iter_time_s == pytest.approx(1e-3 + 1e8 / 1e8)


def test_an_emulated_collective_takes_at_least_the_hosts_own_transport():
    """The host's transport floor (bench.runtime.hostlinks) bounds each call from below: a small call is
    priced at the floor, a large one at its link; grouped calls pay it once per call, and a
    reshard that moves nothing makes no call. The LP prices it as the simulator does."""
    cl = cluster(fast=1, slow=1, inter_gbps=8.0, virtual="gpu")  # 1e9 bytes/s, 30 us
    floored = cl.with_link_floor({"all_reduce": 5e-4, "all_gather": 4e-4, "broadcast": 2e-4, "all_to_all": 3e-4})

    def price(c: Collective, ratios=((0.5, 0.5),), spec=floored) -> float:
        return simulate(
            Program((Stage((c,), Affine()),), 2, c.rows[1] + 1 if c.rows else 1), spec, [list(r) for r in ratios]
        ).iter_time_s

    small, large = Collective("all_reduce", Affine(1e3)), Collective("all_reduce", Affine(1e6))
    assert price(small, spec=cl) == pytest.approx(3e-5 + 1e3 / 1e9)
    assert price(small) == pytest.approx(5e-4)
    assert price(large) == pytest.approx(price(large, spec=cl)) == pytest.approx(3e-5 + 1e6 / 1e9)
    # grouped all-gather: one broadcast per member, each 30 us + its bytes: 2 x 200 us floor
    grouped = Collective("all_gather", Affine.sharded(2e4), "grouped")
    assert price(grouped) == pytest.approx(4e-4)
    assert price(Collective("reshard", Affine(1e3), rows=(0, 1)), ((0.5, 0.5), (0.5, 0.5))) == 0.0
    assert price(Collective("reshard", Affine(1e3), rows=(0, 1)), ((0.5, 0.5), (0.6, 0.4))) == pytest.approx(3e-4)
    assert floored.fingerprint() == cl.fingerprint()  # a measurement of the host, not the cluster
    # The load balancer: a padded all-gather of small shards sits on the floor (an LP term).
    prog = Program((Stage((Collective("all_gather", Affine.sharded(2e5), "padded"), small), Affine.sharded(1e9)),), 2)
    ratios, objective = balance_ratios(prog, floored)
    assert objective == pytest.approx(simulate(prog, floored, ratios).iter_time_s, rel=1e-6)
    assert simulate(prog, floored, ratios).comm_time_s == pytest.approx(4e-4 + 5e-4)


@pytest.mark.parametrize(
    "content,message",
    [
        (None, "cannot be read"),
        ("{not json", "is not JSON"),
        (json.dumps({"compute": {}}), "has no 'fits' mapping"),
        (json.dumps({"fits": {"all_reduce/ring": {"latency_s": 1e-5, "bytes_per_s": 0}}}), "bytes_per_s > 0"),
        (json.dumps({"fits": {"other/ring": {}}}), "holds none of the fits"),
    ],
)
def test_a_bad_link_profile_is_one_line_naming_the_field_and_the_fix(tmp_path, content, message):
    from bench.core.cluster import ClusterSpec
    from bench.core.errors import ConfigError

    path = tmp_path / "p.json"
    if content is not None:
        path.write_text(content)
    link = {"bandwidth_gbps": 8.0, "latency_s": 1e-5, "profile": str(path)}
    cfg = {
        "name": "p",
        "machines": [{"count": 1, "device": "V100-16", "num_devices": 2}],
        "links": {"intra_machine": link, "inter_machine": {"bandwidth_gbps": 8.0, "latency_s": 1e-5}},
    }
    with pytest.raises(ConfigError, match=message) as info:
        ClusterSpec.from_config(cfg)
    text = str(info.value)
    assert "cluster.links.intra_machine.profile=" in text and "bench.profile" in text and "\n" not in text


# -- compute from a measured profile -----------------------------------------------------------
def _profile_file(tmp_path, device_type="MyGPU", **over) -> str:
    prof = {
        "device_type": device_type,
        "compute": {"matmul": {"fixed_s": 1e-5, "flops_per_s": 1e12}, "other": {"fixed_s": 2e-5, "flops_per_s": 1e11}},
        "optimizer": {"fixed_s": 1e-4, "bytes_per_s": 1e9},
        **over,
    }
    path = tmp_path / f"{device_type}.json"
    path.write_text(json.dumps(prof))
    return str(path)


def _cluster_with_profile(profile: str, gpus: int = 2):
    from bench.core.cluster import ClusterSpec

    link = {"bandwidth_gbps": 100.0, "latency_s": 1e-5}
    return ClusterSpec.from_config(
        {
            "name": "prof",
            "virtual_device": "gpu",
            "device_types": {
                "MyGPU": {
                    "memory_gib": 24,
                    "effective_flops": 5e11,
                    "profile": profile,
                    "sources": {"memory_gib": "test", "effective_flops": "test"},
                }
            },
            "machines": [{"count": 1, "device": "MyGPU", "num_devices": gpus}],
            "links": {"intra_machine": link, "inter_machine": link},
        }
    )


def test_a_profiled_device_pays_a_fixed_cost_per_kernel_its_class_rate_and_the_optimizer(tmp_path):
    from bench.core.program import Memory

    cl = _cluster_with_profile(_profile_file(tmp_path))
    prog = Program(
        (
            Stage((), Affine.sharded(2e12), op_class="matmul", launches=3),
            Stage((), Affine.sharded(2e11), op_class="conv", launches=1),
        ),
        2,
        memory=Memory(params=Affine.sharded(4e9)),
    )
    ratios = [[0.5, 0.5]]
    matmul = 3 * 1e-5 + 1e12 / 1e12
    conv = 1 * 2e-5 + 1e11 / 1e11  # no conv class measured: priced as "other"
    optimizer = 1e-4 + 2e9 / 1e9
    assert simulate(prog, cl, ratios).iter_time_s == pytest.approx(matmul + conv + optimizer)
    # The LP prices the same: its optimum is the even split, at exactly that time.
    lp_ratios, objective = balance_ratios(prog, cl)
    assert lp_ratios[0] == pytest.approx([0.5, 0.5], abs=1e-6)
    assert objective == pytest.approx(matmul + conv + optimizer, rel=1e-6)


def test_the_libraries_workspace_a_profile_measured_is_in_every_peak_and_the_lps_rows(tmp_path):
    from bench.core.program import Memory

    GIB = 2**30
    workspace = 2 * GIB
    prog = Program(
        (Stage((), Affine.sharded(2e12), op_class="matmul"),),
        2,
        memory=Memory(params=Affine(4 * GIB), activations=Affine.sharded(36 * GIB)),
    )
    plain = _cluster_with_profile(_profile_file(tmp_path))
    cl = _cluster_with_profile(_profile_file(tmp_path, workspace_bytes=workspace))
    assert cl.devices[0].type.compute.workspace_bytes == workspace
    assert simulate(prog, cl, [[0.5, 0.5]]).peak_mem_gib == pytest.approx([24.0, 24.0])  # 22 + 2: just fits
    assert simulate(prog, plain, [[0.5, 0.5]]).peak_mem_gib == pytest.approx([22.0, 22.0])
    assert not simulate(prog, cl, [[0.5, 0.5]]).oom and simulate(prog, cl, [[0.52, 0.48]]).oom
    ratios, _ = balance_ratios(prog, cl, memory_limit=True)  # the only split that fits
    assert ratios[0] == pytest.approx([0.5, 0.5], abs=1e-6)


def test_a_gpu_step_takes_at_least_its_hosts_time_to_queue_the_kernels(tmp_path):
    """With dispatch costs measured, forward and backward end no sooner than the host has
    queued their kernels (small shares are launch-bound, large ones pay the device's time
    alone), and the optimizer step, whose kernels wait for backward's, comes after."""
    from bench.core.program import Memory
    from bench.cost import host_time, virtual_devices

    compute = {
        "matmul": {"fixed_s": 1e-6, "flops_per_s": 1e12, "dispatch_s": 2e-5},
        "other": {"fixed_s": 1e-6, "flops_per_s": 1e11, "dispatch_s": 1e-5},
    }
    cl = _cluster_with_profile(
        _profile_file(tmp_path, compute=compute, optimizer={"fixed_s": 1e-5, "bytes_per_s": 1e12, "dispatch_s": 3e-5})
    )

    def program(flops):
        return Program(
            (
                Stage((), Affine.sharded(flops), op_class="matmul", launches=100),
                Stage((), Affine.sharded(flops / 10), op_class="other", launches=50),
            ),
            2,
            memory=Memory(params=Affine.sharded(1e6)),
        )

    host, host_optimizer = 100 * 2e-5 + 50 * 1e-5, 3e-5
    optimizer = 1e-5 + 5e5 / 1e12  # the device's part of Adam: shorter than its queueing
    for flops in (2e6, 2e11):  # 1 us of device work per device, or 0.2 s
        prog = program(flops)
        assert host_time(prog, virtual_devices(cl, "gpu")) == pytest.approx(host + host_optimizer)
        device = 150 * 1e-6 + 2 * (flops / 2) / 1e12
        # forward and backward: the longer of the two lanes; then the optimizer step after them
        expected = max(host, device) + max(optimizer, host_optimizer)
        assert simulate(prog, cl, [[0.5, 0.5]]).iter_time_s == pytest.approx(expected)
        assert balance_ratios(prog, cl)[1] == pytest.approx(expected, rel=1e-6)  # the LP agrees


def test_a_host_that_probes_slower_than_the_profiles_queues_kernels_that_much_slower(tmp_path):
    """bench.calibrate prices each step also at the host's probe just before it: the dispatch
    costs scale by the probe over the profile's own, the device's times do not."""
    from bench.cost import host_time, virtual_devices

    compute = {"other": {"fixed_s": 1e-6, "flops_per_s": 1e11, "dispatch_s": 1e-5}}
    optimizer = {"fixed_s": 1e-5, "bytes_per_s": 1e12, "dispatch_s": 3e-5}
    prog = Program((Stage((), Affine.sharded(2e6), op_class="other", launches=100),), 1)
    cl = _cluster_with_profile(_profile_file(tmp_path, compute=compute, optimizer=optimizer, host_probe_s=2e-6), 1)
    slower = cl.with_host_probe(3e-6)
    assert host_time(prog, virtual_devices(slower, "gpu")) == pytest.approx(1.5 * (100 * 1e-5 + 3e-5))
    assert slower.devices[0].type.compute.rate("other") == cl.devices[0].type.compute.rate("other")
    assert simulate(prog, slower, [[1.0]]).iter_time_s > simulate(prog, cl, [[1.0]]).iter_time_s
    unprobed = _cluster_with_profile(_profile_file(tmp_path, compute=compute, optimizer=optimizer), 1)
    assert unprobed.with_host_probe(3e-6) is unprobed  # a profile without a probe: nothing to scale by


@pytest.mark.parametrize(
    "change,message",
    [
        ({"device_type": "OtherGPU"}, "was measured on device type 'OtherGPU', not 'MyGPU'"),
        ({"compute": {"other": {"fixed_s": 0, "flops_per_s": 1e12, "dispatch_s": "x"}}}, "dispatch_s must be a number"),
        ({"compute": {"matmul": {"fixed_s": 0, "flops_per_s": 1e12}}}, "has no compute.other"),
        ({"compute": {"other": {"fixed_s": -1, "flops_per_s": 1e12}}}, "needs fixed_s >= 0"),
        ({"host_probe_s": 0}, "host_probe_s must be a number > 0"),
        ({"workspace_bytes": -1}, "workspace_bytes must be a number >= 0"),
    ],
)
def test_a_bad_compute_profile_is_one_line_naming_the_field_and_the_fix(tmp_path, change, message):
    from bench.core.errors import ConfigError

    change = dict(change)
    path = _profile_file(tmp_path, change.pop("device_type", "MyGPU"), **change)
    with pytest.raises(ConfigError, match=message) as info:
        _cluster_with_profile(path)
    text = str(info.value)
    assert "cluster.device_types.MyGPU.profile=" in text and "bench.profile" in text and "\n" not in text


@pytest.mark.alone  # a view's dispatch time, bounded
def test_the_cpu_profiler_fits_every_class_and_the_optimizer():
    from bench.runtime.probes import profile_device

    prof = profile_device("cpu", "cpu", repeats=3)
    assert set(prof["compute"]) == {"matmul", "conv", "other"}
    for c in prof["compute"].values():
        assert c["fixed_s"] >= 0 and c["flops_per_s"] > 1e7
    assert prof["optimizer"]["bytes_per_s"] > 1e6
    # A view call and its backward node: a few us on a CPU, no kernel (docs/cost-model.md,
    # "Device types, host speed and profiles"); an upper bound 30x that still tells a
    # chain of views from one that copies (a kernel per link).
    assert 0 < prof["views"]["dispatch_s"] < 1e-4
    assert [n for n, _, _ in prof["views"]["points"]] == [64, 256]


def test_single_device_calibration_predicts_steps_from_a_profile(tmp_path):
    """The GPU calibration's code path, on the CPU: a profile made by op microbenchmarks,
    then measured vs predicted training steps of a tiny model at two batch sizes."""
    from bench.runtime.probes import profile_device
    from bench.studies.calibration import single_device_cluster, single_device_rows

    path = tmp_path / "T4.json"
    path.write_text(json.dumps(profile_device("cpu", "T4", repeats=3)))  # a CPU posing as a T4
    cluster = single_device_cluster("T4", str(path))
    assert cluster.devices[0].type.compute is not None
    rows = single_device_rows(["bert"], [1, 4], "cpu", cluster, preset="tiny", repeats=3)
    assert [r["batch"] for r in rows] == [1, 4]
    for r in rows:
        assert r["measured_s"] > 0 and r["predicted_s"] > 0 and r["predicted_peak_gib"] > 0
        assert r["measured_peak_gib"] is None  # no allocator statistics on the CPU
        assert 0 < r["host_probe_s"] < r["measured_s"]  # the host's speed beside the step
    # --reprice: the same measured steps against today's cost model, from the file alone.
    from bench.calibrate import main
    from bench.studies.calibration import repriced_rows

    again = repriced_rows(rows, cluster, preset="tiny")
    assert [(a["measured_s"], a["predicted_s"]) for a in again] == [(r["measured_s"], r["predicted_s"]) for r in rows]
    earlier = tmp_path / "earlier.json"
    earlier.write_text(json.dumps({"device_type": "T4", "profile": str(path), "rows": rows}))
    assert main(["--reprice", str(earlier), "--preset", "tiny"]) == 0
    earlier.write_text(json.dumps({"rows": rows}))
    assert main(["--reprice", str(earlier)]) == 2  # not a --device file: one line, no table


def test_a_device_calibration_writes_its_rows_after_every_step(tmp_path, monkeypatch):
    """A run cut short (a GPU lease ending) leaves a file with the steps it measured."""
    from bench import calibrate

    # a T4 profile's shape, its host probed; the steps run on this CPU
    profile = _profile_file(
        tmp_path, "T4", host_probe_s=1e-6, compute={"other": {"fixed_s": 2e-5, "flops_per_s": 1e11, "dispatch_s": 1e-5}}
    )
    out = tmp_path / "steps.json"
    args = [
        "--device",
        "cpu",
        "--device-type",
        "T4",
        "--profile",
        profile,
        "--models",
        "bert",
        "--batches",
        "1,2",
        "--preset",
        "tiny",
        "--out",
        str(out),
    ]
    assert calibrate.main(args) == 0
    done = json.loads(out.read_text())
    assert "partial" not in done and [r["batch"] for r in done["rows"]] == [1, 2] and done["time_mape"] > 0
    for r in done["rows"]:  # also priced at the host's probe before each step (dispatch costs scaled)
        assert r["host_probe_s"] > 0 and r["predicted_at_probe_s"] > 0
        assert r["time_error_at_probe"] == pytest.approx(abs(r["predicted_at_probe_s"] / r["measured_s"] - 1))
    assert done["time_mape_at_probe"] == pytest.approx(sum(r["time_error_at_probe"] for r in done["rows"]) / 2)

    def cut(*_):
        raise KeyboardInterrupt  # the lease ends after the last step, before the summary

    monkeypatch.setattr(calibrate, "print_single_device", cut)
    with pytest.raises(KeyboardInterrupt):
        calibrate.main(args)
    kept = json.loads(out.read_text())
    assert kept["partial"] is True and [r["batch"] for r in kept["rows"]] == [1, 2]
    assert kept["device_type"] == "T4" and kept["profile"] == profile


@pytest.mark.gpu
def test_gpu_profile_and_step_calibration_run_on_cuda(tmp_path):
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    from bench.runtime.probes import profile_device
    from bench.studies.calibration import single_device_cluster, single_device_rows

    path = tmp_path / "H100-80.json"
    prof = profile_device("cuda", "H100-80", repeats=5)
    for entry in [*prof["compute"].values(), prof["optimizer"]]:  # the device's and the host's times
        assert entry["fixed_s"] >= 0 and entry["dispatch_s"] > 0
    assert 0 < prof["host_probe_s"] < prof["compute"]["other"]["dispatch_s"] * 10
    assert prof["views"]["dispatch_s"] > 0  # the host's, while the GPU sleeps
    path.write_text(json.dumps(prof))
    rows = single_device_rows(
        ["bert"], [1, 8], "cuda", single_device_cluster("H100-80", str(path)), preset="tiny", repeats=5
    )
    assert all(r["measured_peak_gib"] > 0 for r in rows)
