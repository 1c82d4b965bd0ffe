"""bench.runtime.tensor_memory: a CPU rank's live tensor bytes, counted op by op."""

from __future__ import annotations

import threading

import pytest
import torch

from bench.runtime.tensor_memory import EmulatedOutOfMemory, TensorBytes

MIB = 2**20


def _two_steps(tensors: TensorBytes, model: torch.nn.Module, opt: torch.optim.Optimizer) -> int:
    """Two training steps counted by `tensors`, its peak reset for the second; the bytes live
    as the second's Adam step begins (parameters, gradients, moments)."""
    x = torch.randn(8, 1024)
    resident = 0
    for step in range(2):
        with tensors:
            if step == 1:
                tensors.reset_peak()
            model(x).sum().backward()
            resident = tensors.live
            opt.step()
            opt.zero_grad(set_to_none=True)
    return resident


def test_an_adam_step_peaks_at_five_times_the_parameters_and_keeps_three():
    """Parameters, gradients, two moments and the square roots torch's multi-tensor Adam takes of
    every second moment at once: the cost model's optimizer_step (bench.core.program.Memory)."""
    tensors = TensorBytes()
    with tensors:
        model = torch.nn.Linear(1024, 1024, bias=False)  # 4 MiB of parameters
        opt = torch.optim.Adam(model.parameters(), foreach=True)
    _two_steps(tensors, model, opt)
    step_count = 4  # Adam's step, a one-element fp32 tensor
    assert tensors.peak == 5 * 4 * MIB + step_count
    assert tensors.live == 3 * 4 * MIB + step_count  # parameters, moments; the gradient set to None


def test_adam_on_cpu_steps_one_parameter_at_a_time_with_two_temporaries_of_its_size():
    """torch's default Adam on CPU tensors is the per-tensor one: the square root of a second
    moment, then its quotient, for one parameter at a time (Memory.optimizer_step(foreach=False))."""
    from bench.core.program import Affine, Memory

    tensors = TensorBytes()
    with tensors:
        model = torch.nn.Sequential(torch.nn.Linear(1024, 1024, bias=False), torch.nn.Linear(1024, 256, bias=False))
        opt = torch.optim.Adam(model.parameters())  # 4 + 1 MiB of parameters
    resident = _two_steps(tensors, model, opt)
    params = 5 * MIB
    memory = Memory(Affine(params), Affine(params), Affine(2 * params), largest_param=Affine(4 * MIB))
    step_count = 2 * 4  # one one-element fp32 tensor per parameter
    assert tensors.peak - resident == 2 * 4 * MIB
    assert tensors.peak == memory.optimizer_step(foreach=False).const + step_count
    assert memory.optimizer_step(foreach=True).const == 5 * params  # the multi-tensor one's


def test_views_share_their_base_and_what_was_made_before_is_not_counted():
    before = torch.zeros(MIB // 4)
    tensors = TensorBytes()
    with tensors:
        base = torch.empty(MIB // 4)  # 1 MiB
        halves = base.view(2, -1)
        before + 1  # a new 1 MiB result, freed at once
    assert tensors.live == MIB and tensors.peak == 2 * MIB
    del base, halves
    assert tensors.live == 0  # freed with the mode left: still uncounted


def test_a_storage_resized_in_place_and_one_freed_on_another_thread_are_counted_right():
    tensors = TensorBytes()
    with tensors:
        t = torch.empty(256)
        t.resize_(MIB // 4)
        t.add_(0)  # seen again: counted at its new size
    assert tensors.live == MIB
    box = [t]
    del t
    worker = threading.Thread(target=box.clear)
    worker.start()
    worker.join()
    assert tensors.live == 0 and tensors.peak == MIB


def test_live_tensors_past_the_limit_raise_out_of_memory_in_forward_and_in_backward():
    """The emulated device's memory: the op whose output takes the live bytes past the limit
    raises a MemoryError carrying the peak, whether it runs in forward or in autograd's backward."""
    model = torch.nn.Linear(1024, 1024, bias=False)  # 4 MiB, made before the count
    x = torch.randn(64, 1024, requires_grad=True)
    tensors = TensorBytes(limit_bytes=5 * MIB, what="rank 3 (a test)")
    tensors.count(model.weight)
    with tensors:
        loss = model(x).sum()  # 4 MiB + 0.25 MiB of output
        with pytest.raises(MemoryError, match=r"rank 3 \(a test\): live tensors .* pass its memory 0.005 GiB") as exc:
            loss.backward()  # the weight's 4 MiB gradient
    assert isinstance(exc.value, EmulatedOutOfMemory)
    assert exc.value.peak_gib * 2**30 > 5 * MIB
    with TensorBytes(limit_bytes=MIB) as small, pytest.raises(EmulatedOutOfMemory):
        torch.zeros(2 * MIB // 4)
    assert small.peak == 2 * MIB


def test_a_ranks_device_memory_is_its_machine_groups_or_its_device_types_named_by_the_setting():
    from bench.core.cluster import ClusterSpec
    from bench.runtime.pacing import device_memory

    cluster = ClusterSpec.from_config(
        {
            "name": "three",
            "emulated": True,
            "machines": [
                {"count": 2, "device": "cpu", "num_devices": 1, "speed": 1.0},
                {"count": 1, "device": "cpu", "num_devices": 1, "speed": 0.5, "memory_gib": 0.5},
            ],
            "links": {
                "intra_machine": {"bandwidth_gbps": 1.0, "latency_s": 0.0},
                "inter_machine": {"bandwidth_gbps": 1.0, "latency_s": 0.0},
            },
        }
    )
    assert device_memory(cluster, 2) == (2**29, "rank 2 (cluster.machines[1].memory_gib=0.5)")
    limit, what = device_memory(cluster, 1)
    assert limit == int(cluster.devices[1].type.memory_gib * 2**30) and what.startswith(
        "rank 1 (device cpu's memory_gib="
    )
