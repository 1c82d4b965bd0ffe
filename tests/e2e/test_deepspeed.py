"""The DeepSpeed baseline on 2 emulated devices: ranks stay in sync and the dense model trains
exactly like single-device Adam; the runner records a deepspeed row.

Every case starts fresh worker processes. No case JIT-compiles a DeepSpeed op: the method keeps
DeepSpeed from building its shared-memory comm op (method.shm_comm_op=false), which each
case checks, and uses torch.optim.Adam instead of DeepSpeed's fused CPU Adam.
"""

import importlib.util
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from bench.core.cluster import ClusterSpec
from bench.records.rows import load_records
from bench.runner.case import build_workload, new_record, prepare_case
from bench.runner.configs import compose_settings
from bench.runtime.launch import launch
from methods.ds_zero import DeepSpeedZeRO

pytestmark = pytest.mark.e2e
ROOT = Path(__file__).resolve().parents[2]
STEPS = 2


class RecordingDeepSpeed(DeepSpeedZeRO):
    """The method under test, plus a dump per rank and step: reduced gradients (before the
    step), full parameters (after it), which parameters are experts, and whether DeepSpeed
    built its shared-memory comm op. Collective calls here run on every rank in one order."""

    dump_dir: str = ""

    def setup(self, plan, model, ctx):
        return RecordingTrainer(super().setup(plan, model, ctx), model, ctx.rank, self.dump_dir)


class RecordingTrainer:
    def __init__(self, trainer, model, rank, dump_dir):
        self.trainer, self.model, self.rank, self.dump_dir = trainer, model, rank, Path(dump_dir)
        self.steps = 0

    def step(self, batch):
        import deepspeed
        from deepspeed.moe.utils import is_moe_param
        from deepspeed.utils import safe_get_full_grad

        loss = self.trainer.forward_backward(batch)
        named = list(self.model.named_parameters())
        out = {f"grad/{n}": safe_get_full_grad(p).detach().cpu().numpy().copy() for n, p in named}
        self.trainer.optimizer_step()
        with deepspeed.zero.GatheredParameters([p for _, p in named]):  # ZeRO-3: whole params
            out.update({f"param/{n}": p.detach().cpu().numpy().copy() for n, p in named})
        out["experts"] = np.array([n for n, p in named if is_moe_param(p)] or [""])
        out["shm_comm_op_built"] = np.array(deepspeed.comm.comm.cdb.shm_comm_op is not None)
        np.savez(self.dump_dir / f"rank{self.rank}_step{self.steps}.npz", **out)
        self.steps += 1
        return loss


def _case(cfg_factory, tmp_path, model, stage, global_batch, *extra):
    cfg = cfg_factory(
        f"model={model}",
        "method=deepspeed",
        f"method.zero_stage={stage}",
        f"global_batch={global_batch}",
        "warmup_iters=0",
        f"measured_iters={STEPS}",
        "method.engine_probe=false",
        "emulation.reference_iters=0",  # no pacing reference: the ranks train the steps checked alone
        *extra,
    )  # these check training, not prices
    case = prepare_case(cfg, new_record(cfg))
    method = RecordingDeepSpeed.__new__(RecordingDeepSpeed)
    method.__dict__.update(case.method.__dict__, dump_dir=str(tmp_path))
    case.method = method
    return case


def _load(tmp_path, rank, step):
    with np.load(tmp_path / f"rank{rank}_step{step}.npz") as f:
        return {k: f[k] for k in f.files}


def _reference(case):
    """Single-device Adam on the whole global batch: per step, the summed loss of each rank's
    slice (before the step), the mean-loss gradients and the parameters after the step."""
    workload = case.workload
    model = workload.build(case.seed)
    data = workload.model_cfg.dataset("synthetic", None, "train", case.seed)
    optimizer = torch.optim.Adam(model.parameters(), lr=case.method.lr)
    bounds = np.cumsum([0] + case.plan.batch_shares)
    steps = []
    for it in range(STEPS):
        with torch.no_grad():
            slices = [
                model(*data.batch(it, a, b, workload.global_batch)).item() for a, b in zip(bounds[:-1], bounds[1:])
            ]
        optimizer.zero_grad()
        loss = model(*data.batch(it, 0, workload.global_batch, workload.global_batch))
        (loss / workload.targets_per_iter).backward()
        grads = {n: p.grad.detach().numpy().copy() for n, p in model.named_parameters()}
        optimizer.step()
        params = {n: p.detach().numpy().copy() for n, p in model.named_parameters()}
        steps.append((slices, grads, params))
    return steps


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_zero_stage_trains_tiny_bert_exactly_like_single_device_adam(cfg_factory, tmp_path, stage):
    case = _case(cfg_factory, tmp_path, "bert", stage, global_batch=8)
    assert case.plan.batch_shares == [4, 4] and case.plan.details["zero_stage"] == stage
    _check_like_single_device_adam(case, tmp_path)


# The memory tools (methods.common.MemoryTools) under each ZeRO stage: torch's checkpoints on
# the modules DeepSpeed trains (ZeRO-3 gathers a unit's parameters again for its recompute) and
# DeepSpeed's own gradient_accumulation_steps, on tiny BERT and VGG19 (a checkpointed nn.Sequential).
@pytest.mark.parametrize(
    "stage,model,tools",
    [
        (0, "vgg19", ("method.activation_checkpointing=true",)),
        (1, "bert", ("method.activation_checkpointing=true", "method.grad_accumulation=2")),
        (2, "bert", ("method.grad_accumulation=2",)),
        (3, "bert", ("method.activation_checkpointing=true", "method.grad_accumulation=2")),
    ],
)
def test_zero_stage_with_memory_tools_trains_exactly_like_single_device_adam(
    cfg_factory, tmp_path, stage, model, tools
):
    case = _case(cfg_factory, tmp_path, model, stage, 8, *tools)
    k = 2 if "method.grad_accumulation=2" in tools else 1
    config = case.plan.details["ds_config"]
    assert case.plan.batch_shares == [4, 4] and config["train_micro_batch_size_per_gpu"] == 4 // k
    assert config["gradient_accumulation_steps"] == k and config["train_batch_size"] == 8
    assert bool(case.plan.details["memory_tools"]["checkpointed_groups"]) == (
        "method.activation_checkpointing=true" in tools
    )
    _check_like_single_device_adam(case, tmp_path)


def _check_like_single_device_adam(case, tmp_path):
    results = launch(case, 2, timeout_s=180)
    reference = _reference(case)
    smallest = {}  # per parameter element: the smallest |gradient| so far
    for it, (slices, grads, params) in enumerate(reference):
        # Each rank's loss is that of the single-device model on the rank's slice: at step 1
        # this holds only if every rank applied the same update as single-device Adam.
        assert [r["loss_sums"][it] for r in results] == pytest.approx(slices, rel=1e-5)
        dumps = [_load(tmp_path, rank, it) for rank in (0, 1)]
        assert not any(d["shm_comm_op_built"] for d in dumps), "DeepSpeed JIT-built its shm comm op"
        scale = max(np.abs(g).max() for g in grads.values())
        for name, ref in grads.items():
            # Adam's update hardly depends on the gradient's scale: compare the gradients too.
            got = dumps[0][f"grad/{name}"]
            np.testing.assert_allclose(got, ref, rtol=1e-5, atol=1e-5 * scale, err_msg=name)
            np.testing.assert_array_equal(dumps[1][f"grad/{name}"], got, err_msg=name)
        for name, ref in params.items():
            np.testing.assert_array_equal(
                dumps[1][f"param/{name}"], dumps[0][f"param/{name}"], err_msg=f"ranks differ after step {it}: {name}"
            )
            # Adam moves an element by about lr * g / |g|: where a gradient was float noise
            # (attention's key bias is zero in exact arithmetic; single elements can be tiny
            # too) the sign is noise, the update anything up to +-lr, and the difference stays.
            smallest[name] = np.minimum(smallest.get(name, np.inf), np.abs(grads[name]))
            kept = smallest[name] >= 1e-4 * scale
            np.testing.assert_allclose(
                dumps[0][f"param/{name}"][kept], ref[kept], rtol=1e-5, atol=1e-6, err_msg=f"step {it}: {name}"
            )


@pytest.mark.parametrize("stage", [0, 1, 2])
def test_zero_stage_keeps_bert_moe_ranks_in_sync_with_expert_parallel_deepspeed_moe(cfg_factory, tmp_path, stage):
    case = _case(cfg_factory, tmp_path, "bert_moe", stage, global_batch=8)
    moe = case.plan.details["moe"]
    assert moe["ep_size"] == 2 and moe["num_experts"] == 4 and moe["k"] == 2
    results = launch(case, 2, timeout_s=180)
    first = sum(r["loss_sums"][0] for r in results) / case.workload.targets_per_iter
    vocab = case.workload.model_cfg.vocab_size
    assert abs(first - np.log(vocab)) < 0.5, "an untrained LM's loss is about log(vocab)"
    for it in range(STEPS):
        dumps = [_load(tmp_path, rank, it) for rank in (0, 1)]
        assert not any(d["shm_comm_op_built"] for d in dumps)
        experts = set(dumps[0]["experts"])
        params = [k[len("param/") :] for k in dumps[0] if k.startswith("param/")]
        assert any("deepspeed_moe.experts" in n for n in experts), "MoE layers were not swapped"
        assert not any(n.endswith(("ffn.w1", "ffn.gate.weight")) for n in params)
        for name in params:
            a, b = (d[f"param/{name}"] for d in dumps)
            if name in experts:
                # Expert parallel: each rank owns other experts, trained on tokens of both ranks.
                assert not np.array_equal(a, b), f"{name}: ranks hold the same expert"
                assert np.abs(dumps[0][f"grad/{name}"]).max() > 0, f"{name}: no gradient"
            else:
                np.testing.assert_array_equal(a, b, err_msg=f"ranks differ after step {it}: {name}")
                np.testing.assert_array_equal(
                    dumps[0][f"grad/{name}"], dumps[1][f"grad/{name}"], err_msg=f"gradients differ at step {it}: {name}"
                )


def test_runner_cli_records_an_ok_deepspeed_row(tmp_path):
    cmd = [
        sys.executable,
        "-m",
        "bench.run",
        "method=deepspeed",
        "model=bert",
        "warmup_iters=1",
        "measured_iters=3",
        "emulation.reference_iters=0",
        "wandb.mode=disabled",
        f"results_dir={tmp_path}",
    ]
    out = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    (row,) = load_records(tmp_path / "records.jsonl")
    assert row["status"] == "ok" and row["method"] == "deepspeed" and row["batch_shares"] == [8, 8]
    assert row["plan"]["zero_stage"] == 1 and len(row["iter_times_s"]) == 3
    engine = row["plan"]["engine"]  # the engine's own work, probed in a world of the same 2 ranks
    assert engine["plain_s"] > 0 and engine["engine_s"] > 0, engine
    assert row["versions"].get("deepspeed", "").startswith("0.19") or "deepspeed" not in row["versions"]


def test_an_engine_probe_that_fails_is_a_warning_and_no_price(caplog):
    """A probe rank that raises (here: no steps to time) answers with its error; the parent
    logs one warning and plans without the engine's work."""
    pytest.importorskip("deepspeed")
    from methods.ds_zero import engine_work

    cfg = compose_settings("model=bert", "cluster=local_hetero2", "method=deepspeed")
    cluster = ClusterSpec.from_config(cfg.cluster, cfg.config_roots())
    workload = build_workload(cfg, cluster)
    method = DeepSpeedZeRO(engine_probe=False)
    plan = method.plan(workload, cluster)
    assert engine_work(method, plan, workload, cluster, repeats=0) is None
    assert "engine work was not measured (" in caplog.text


def test_every_module_the_workers_server_preloads_for_deepspeed_exists():
    """The server the workers fork from skips a module it cannot import (bench.runtime.launch): a
    DeepSpeed release that moved one would slow every case's workers again, silently."""
    for name in DeepSpeedZeRO.worker_modules:
        assert importlib.util.find_spec(name) is not None, f"{name} is not in this DeepSpeed"
