"""GradBuckets on one rank (the all-reduce is the identity there): gradients land in the flat
buckets as views, equal plain autograd's, and a parameter backward did not reach keeps None."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from bench.launch import _free_port
from methods.hap.runtime import GradBuckets


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
