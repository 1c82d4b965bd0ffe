"""What torch and gloo differ in, between versions and devices: bench.runtime.compat.ordered_group
on this torch and as a torch without new_group's sort_ranks (2.11, the GPU host's image) would
make it, in three gloo ranks; a device tensor's point-to-point transfer on gloo through the host
(bench.runtime.p2p)."""

import builtins
import os

import pytest
import torch
import torch.distributed as dist
import torch.distributed.distributed_c10d as c10d

from bench.runtime.compat import ordered_group
from tests.forked_ranks import run_forked

ORDER = [2, 0, 1]


def _group_in_rank(rank, port, torch_kind, out):
    try:
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
        dist.init_process_group("gloo", rank=rank, world_size=3)
        real = dist.new_group
        if torch_kind == "without sort_ranks":  # new_group as torch < 2.12 has it: it always sorts

            def old_new_group(ranks=None, timeout=None, backend=None, pg_options=None):
                return real(ranks, timeout=timeout, backend=backend, pg_options=pg_options)

            dist.new_group = old_new_group
        elif torch_kind == "sorting regardless":  # a torch whose sort the shadowed name misses

            def sorting_new_group(ranks=None, timeout=None, backend=None, pg_options=None):
                return real(builtins.sorted(ranks), timeout=timeout, backend=backend, pg_options=pg_options)

            dist.new_group = sorting_new_group
        try:
            group = ordered_group(ORDER)
        except RuntimeError as e:
            out.put((rank, ("refused", str(e), "sorted" in vars(c10d)), None))
            return
        seen = [torch.zeros(1) for _ in ORDER]
        dist.all_gather(seen, torch.tensor([float(rank)]), group=group)
        out.put((rank, (dist.get_rank(group), [int(t) for t in seen], "sorted" in vars(c10d)), None))
    except BaseException:
        import traceback

        out.put((rank, None, traceback.format_exc()))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


@pytest.mark.parametrize("torch_kind", ["this torch", "without sort_ranks"])
def test_a_groups_ranks_keep_the_order_they_were_given(torch_kind):
    got = run_forked(_group_in_rank, 3, torch_kind)
    for rank, (group_rank, seen, shadow_left) in enumerate(got):
        assert group_rank == ORDER.index(rank) and seen == [float(r) for r in ORDER] and not shadow_left


def test_a_torch_that_sorts_the_group_anyway_stops_the_run_with_the_version_it_needs():
    got = run_forked(_group_in_rank, 3, "sorting regardless")
    for kind, message, shadow_left in got:
        assert kind == "refused" and "[2, 0, 1]" in message and "torch >= 2.12" in message and not shadow_left


def _transfer_through_host(rank, port, out):
    from bench.runtime import p2p

    try:
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
        dist.init_process_group("gloo", rank=rank, world_size=2)
        p2p.TRANSFERRED_AS_IS = ("meta",)  # a CPU tensor stands for a CUDA one: it goes through a copy
        handed = []

        def spy(original):
            def call(tensor, *args, **kwargs):
                handed.append(tensor)
                return original(tensor, *args, **kwargs)

            return call

        isend, irecv = p2p._wrap_send(spy(c10d.isend)), p2p._wrap_recv(spy(c10d.irecv))
        if rank == 0:
            mine = torch.arange(6.0).reshape(2, 3)
            isend(mine, dst=1).wait()
            out.put((rank, handed[0] is not mine, None))
        else:
            into = torch.zeros(2, 3)
            irecv(into, src=0).wait()
            out.put((rank, (handed[0] is not into, into.tolist()), None))
        dist.barrier()
    except BaseException:
        import traceback

        out.put((rank, None, traceback.format_exc()))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def test_gloo_point_to_point_sends_a_device_tensor_through_a_host_copy_and_receives_into_one():
    # On MPS ranks (a GPU's tensors on gloo) a pipeline's sends and receives went to gloo as
    # CUDA memory and the ranks died in native code; bench.runtime.p2p moves them via the host.
    sent_a_copy, (received_a_copy, got) = run_forked(_transfer_through_host, 2)
    assert sent_a_copy and received_a_copy and got == [[0.0, 1.0, 2.0], [3.0, 4.0, 5.0]]
