"""A model whose fp32 weights and Adam state are twice one emulated device's memory, on
local_hetero4: pipeline and fsdp train it (each rank materialises only its stages or shards,
bench.core.weights; its live tensors stay under its device's memory, which the rank enforces)
and equal the single device step by step, while dp_ev, which replicates it, is an oom row.
The tiny-scale version of the goal of issue 68 (docs/emulation.md, "What a rank holds")."""

import pytest
import torch

from bench.core.weights import build_meta
from bench.runner import case as runner_case
from bench.runner import execute as runner
from bench.runtime.launch import launch
from models.bert import BertConfig

pytestmark = pytest.mark.e2e

SIZE = {"num_layers": 16, "d_model": 128, "d_ff": 512, "seq_len": 16}
# Two lazy set-up iterations (counted and limited), one reference, one measured: four steps.
STEPS = [
    "warmup_iters=0",
    "measured_iters=1",
    "emulation.reference_iters=1",
    "emulation.pause_discount=false",
    "global_batch=8",
]


def _params() -> int:
    return sum(p.numel() for p in build_meta(BertConfig.from_preset("tiny", **SIZE), 0).parameters())


def _memory_gib() -> float:
    """Half of the weights and Adam's two moments, fp32 (12 bytes a parameter), rounded down."""
    return int(12 * _params() / 2 / 2**30 * 1e4) / 1e4


def _overrides(method: str) -> list[str]:
    gib = _memory_gib()
    return [
        "model=bert",
        *(f"+model.spec.{k}={v}" for k, v in SIZE.items()),
        "cluster=local_hetero4",
        *(f"+cluster.machines.{i}.memory_gib={gib}" for i in range(3)),
        f"method={method}",
        *STEPS,
    ]


def _single_device_losses(case, steps: int) -> list[float]:
    workload = case.workload
    model = workload.build(case.seed)
    data = workload.model_cfg.dataset("synthetic", None, "train", case.seed)
    optimizer = torch.optim.Adam(model.parameters(), lr=case.method.lr)
    losses = []
    for it in range(steps):
        loss = model(*data.batch(it, 0, workload.global_batch, workload.global_batch))
        (loss / workload.targets_per_iter).backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(loss.item())
    return losses


@pytest.mark.parametrize(
    "method,extra", [("fsdp", ["method.work_probe=false"]), ("pipeline", ["method.profile=false"])]
)
def test_a_model_twice_a_devices_memory_trains_sharded_under_it_and_equals_the_single_device(
    cfg_factory, method, extra
):
    gib = _memory_gib()
    assert 12 * _params() / 2**30 >= 2 * gib
    cfg = cfg_factory(*_overrides(method), *extra)
    case = runner_case.prepare_case(cfg, runner_case.new_record(cfg), launching=True)
    ranks = launch(case, 4, timeout_s=600)
    peaks = [r["tensor_peak_gib"] for r in ranks]
    print(f"{method}: device memory {gib} GiB, tensor peak per rank {[f'{p:.4f}' for p in peaks]} GiB")
    assert all(p is not None and 0 < p <= gib for p in peaks), peaks
    steps = len(ranks[0]["loss_sums"])
    assert steps >= 3
    got = [sum(r["loss_sums"][it] for r in ranks) for it in range(steps)]
    assert got == pytest.approx(_single_device_losses(case, steps), rel=1e-5)


def test_the_same_model_replicated_by_dp_ev_is_an_oom_row_naming_the_device_memory(cfg_factory, capsys):
    row = runner.run_case(cfg_factory(*_overrides("dp_ev")))
    assert row.status == "oom" and row.samples_per_s is None, row.error
    assert f"memory_gib={_memory_gib()}): live tensors" in row.error
    assert row.peak_mem_gib[row.oom_rank] > _memory_gib()
    assert "case recorded as oom" in capsys.readouterr().err
