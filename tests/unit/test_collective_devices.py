"""Methods keep their tensors on the model's device: what would fail on a GPU, caught on a CPU.

A rank's model lives on its GPU while the data arrive from the CPU and a bare torch.zeros(...)
lands on the CPU. Here the model lives on the meta device instead (another device than the CPU,
with shapes only), and every collective checks the device of what it receives
(tests.device_guard). The pipeline's export of a model on the meta device, and the whole set-up
and step of hap and sfb there: tests/e2e/test_methods_on_meta.py.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from torch import nn

from methods.pipeline.trainer import PipelineTrainer
from tests.device_guard import DeviceMismatch, collectives_on

META = torch.device("meta")


def _params_with_grads(device, *shapes) -> list[nn.Parameter]:
    params = []
    for shape in shapes:
        p = nn.Parameter(torch.ones(shape, device=device))
        p.grad = torch.full(shape, 3.0, device=device)
        params.append(p)
    return params


def test_the_guard_refuses_a_cpu_tensor_where_the_ranks_compute_on_another_device():
    original = torch.distributed.all_reduce
    with collectives_on(META) as calls:
        torch.distributed.all_reduce(torch.zeros((), device=META))
        with pytest.raises(DeviceMismatch, match=r"all_reduce received a tensor on cpu, but the ranks compute on meta"):
            torch.distributed.all_reduce(torch.zeros(()))
        work = torch.distributed.all_reduce(torch.zeros(2, device=META), async_op=True)
        work.wait()
    assert calls == ["all_reduce", "all_reduce"]
    assert torch.distributed.all_reduce is original


def test_the_pipeline_clips_with_a_norm_summed_on_the_stages_device():
    stage = SimpleNamespace(pipeline=0, device=META, params=_params_with_grads(META, (2, 3), (4,)), uncounted=set())
    with collectives_on(META) as calls:
        norm = PipelineTrainer.clip_global_norm(stage, 1.0)
    assert calls == ["all_reduce"] and norm.device == META
    assert all(p.grad.device == META for p in stage.params)


def test_the_pipelines_clip_scales_by_the_global_norm_and_leaves_small_gradients_alone():
    stage = SimpleNamespace(
        pipeline=0, device=torch.device("cpu"), params=_params_with_grads("cpu", (2, 3), (4,)), uncounted=set()
    )
    with collectives_on("cpu") as calls, _one_rank():
        norm = PipelineTrainer.clip_global_norm(stage, 1.0)
        assert float(norm) == pytest.approx(3.0 * 10**0.5)
        assert torch.allclose(stage.params[0].grad, torch.full((2, 3), 1.0 / 10**0.5), rtol=1e-6)
        before = [p.grad.clone() for p in stage.params]
        PipelineTrainer.clip_global_norm(stage, 100.0)  # a factor of one: unchanged, bit for bit
    assert calls == ["all_reduce", "all_reduce"]
    assert all(torch.equal(a, p.grad) for a, p in zip(before, stage.params))


def test_hap_clips_with_a_norm_summed_on_the_ranks_device():
    from methods.hap.runtime import HapTrainer

    params = _params_with_grads(META, (2, 3), (4,))
    program = SimpleNamespace(params={"a": params[0], "b": params[1]}, sharded={"a"}, machines=None)
    trainer = SimpleNamespace(program=program, params=params, device=META, rank=0)
    trainer.global_grad_norm = lambda: HapTrainer.global_grad_norm(trainer)
    with collectives_on(META) as calls:
        norm = HapTrainer.clip_global_norm(trainer, 1.0)
    assert calls == ["all_reduce"] and norm.device == META


class _one_rank:
    """A gloo world of this process alone (the CPU collectives run for real)."""

    def __enter__(self):
        import torch.distributed as dist

        self.store = dist.HashStore()
        dist.init_process_group("gloo", store=self.store, rank=0, world_size=1)

    def __exit__(self, *exc):
        import torch.distributed as dist

        dist.destroy_process_group()
