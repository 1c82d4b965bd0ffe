"""GradBuckets on one rank (the all-reduce is the identity there): gradients land in the flat
buckets as views, equal plain autograd's, and a parameter backward did not reach keeps None; its
buckets follow bench.core.program.bucket_runs, as the simulated program's do."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from bench.core.program import bucket_runs
from bench.runtime.launch import _free_port
from methods.graph import capture_config
from methods.hap.codegen import CodegenOptions, RankProgram
from methods.hap.hierarchy import Machines
from methods.hap.planner import HapPlanner
from methods.hap.runtime import GradBuckets
from tests.unit.test_hap_planner import bert_workload, cluster


@pytest.fixture
def one_rank():
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{_free_port()}", rank=0, world_size=1)
    yield
    dist.destroy_process_group()


@pytest.mark.parametrize("overlap", [True, False])
@pytest.mark.parametrize("cap_bytes", [None, 0, 40])
def test_gradients_accumulate_in_the_buckets_and_unused_ones_stay_none(one_rank, overlap, cap_bytes):
    g = torch.Generator().manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(*shape, generator=g)) for shape in ((3, 4), (5,), (2, 2), (4,))]
    a, b, unused, d = params
    x = torch.randn(4, generator=g)

    def loss():
        return (a @ x).sum() * b[:3].sum() + (d * d).sum() + (a * a).sum()  # a used twice

    loss().backward()
    want = [p.grad.clone() for p in (a, b, d)]
    for p in params:
        p.grad = None
    buckets = GradBuckets(params, cap_bytes, overlap)
    for _ in range(2):  # a second step starts from zeroed buckets, not from the first's sums
        for p in params:
            p.grad = None  # what the trainer's zero_grad(set_to_none=True) leaves
        buckets.start()
        loss().backward()
        buckets.finish()
        for p, ref in zip((a, b, d), want):
            torch.testing.assert_close(p.grad, ref, rtol=0, atol=0)
            flat = buckets.flats[buckets._bucket_of[id(p)]]
            assert flat.data_ptr() <= p.grad.data_ptr() < flat.data_ptr() + flat.numel() * flat.element_size()
        assert unused.grad is None


def test_buckets_hold_one_kind_and_close_once_they_reach_the_cap():
    grads = [(30, "a"), (20, "a"), (60, "a"), (10, "b"), (10, "b"), (5, "a")]
    assert bucket_runs(grads, 40) == [[0, 1], [2], [3, 4], [5]]
    assert bucket_runs(grads, 64) == [[0, 1, 2], [3, 4], [5]]  # 50 bytes: open for the 60
    assert bucket_runs(grads, None) == [[0, 1, 2], [3, 4], [5]]  # no cap: kinds alone split
    assert bucket_runs(grads, 0) == [[i] for i in range(6)]
    assert bucket_runs([], 64) == []


def test_buckets_of_one_kind_are_those_torch_ddp_assigns():
    assign = getattr(dist, "_compute_bucket_assignment_by_size", None)
    if assign is None:
        pytest.skip("this torch does not expose DDP's bucket assignment")
    gen = torch.Generator().manual_seed(0)
    for cap in (1000, 4096, 2**16):
        sizes = torch.randint(1, 3000, (40,), generator=gen).tolist()  # floats: 4 bytes each
        ddp, _ = assign([torch.empty(n) for n in sizes], [cap])
        assert bucket_runs([(4 * n, "fp32") for n in sizes], cap) == [list(b) for b in ddp]


@pytest.mark.parametrize("virtual,gpus", [("gpu", 1), ("machine", 2)])
def test_the_simulator_prices_the_buckets_the_runtime_fills(virtual, gpus):
    """A planned tiny BERT, its gradients in 64 KiB buckets: the all-reduces of the program the
    planner priced are those of the trainer's GradBuckets on the rank (the bytes summed among
    the devices, and over machines of 2 GPUs the bytes summed inside a machine)."""
    cl = cluster(fast=1, slow=1, k=gpus, virtual=virtual)
    wl = bert_workload(num_devices=cl.num_devices)
    plan = HapPlanner(max_rounds=1, bucket_cap_mb=1 / 16, levels="cluster").plan(wl, cl)
    assert plan.details["granularity"] == virtual
    stages = [st for st in plan.program.stages if st.label.startswith("all_reduce grad bucket")]
    graph = capture_config(wl.model_cfg, wl.global_batch)
    machines = Machines([[0, 1], [2, 3]], 0, 0) if gpus > 1 else None  # the fast machine's leader
    program = RankProgram(
        graph,
        plan.details,
        plan.ratios,
        plan.batch_shares,
        wl.build(0).to("meta"),
        0,
        cl.num_devices,
        CodegenOptions(),
        machines,
    )
    if machines is None:
        buckets = GradBuckets([program.params[n] for n in program.grad_sync], 2**16)
    else:
        buckets = GradBuckets(
            [program.params[n] for n in program.param_order],
            2**16,
            machines=machines,
            across={id(program.params[n]) for n in program.grad_sync},
        )
    sizes = [sum(p.numel() * p.element_size() for p in b) for b in buckets.buckets]
    across = [sum(c.nbytes.const for c in st.collectives) for st in stages]
    assert len(stages) == len(buckets.buckets) > 2
    summed = buckets.across if machines is not None else [True] * len(sizes)  # over GPUs: every bucket
    assert across == [s if a else 0 for s, a in zip(sizes, summed)]
    if machines is not None:  # inside the fast machine: its share of every gradient
        inside = [st.grad_bytes.at(plan.ratios, 0) for st in stages]
        assert inside == pytest.approx(sizes)
        assert not any(st.grad_bytes.at(plan.ratios, 0) for st in plan.program.stages if st not in stages)
