"""A method's set-up and step with the model on another device than the CPU: what a GPU would refuse.

Each rank builds its model on the meta device (shapes, no values) and gets its batch there, as a
GPU rank gets it on its GPU; every torch.distributed collective checks that its tensors are on
the meta device and is then skipped (tests.device_guard). A tensor a method makes without the
model's device lands on the CPU and fails the check, or mixes devices in an op, which fails
too. Two ranks in a gloo world of their own (processes forked from the workers' server): the process group gives
ranks, sizes and subgroups; no tensor goes through it.

Which parts run: hap and sfb set up and step (the planner's plans, and a plan with an empty
shard, whose ops make zeros of their own), with gradient clipping; the pipeline sets up (it
exports its model on the model's device and cuts its stage): torch's schedule reads a value on
the host in its first step, which the meta device has not. DDP, FSDP2 and DeepSpeed place
their tensors by their own device arguments (DDP's device_ids, FSDP2's mesh, DeepSpeed's
accelerator); the GPU tests run them on a GPU (tests/gpu).
"""

from __future__ import annotations

import tempfile
import traceback

import pytest
import torch

from bench.core.meta import build_on_meta
from bench.core.shares import offsets
from bench.runner.case import new_record, prepare_case
from bench.runtime.launch import forking_context
from methods.hap.runtime import FixedPlanMethod
from methods.pipeline.cut import model_graph
from models.bert import BertConfig
from tests.e2e.test_hap_equivalence import make_cluster, make_workload, plan_at_ratios

pytestmark = pytest.mark.e2e

META = torch.device("meta")


def _rank(rank: int, world: int, store: str, case, steps: bool, answers) -> None:
    """One rank: the model built on meta, the method's set-up (and a step) under the guard."""
    try:
        import torch.distributed as dist

        from bench.core.interfaces import RankContext
        from bench.runtime.emulation import Emulator
        from tests.device_guard import collectives_on

        dist.init_process_group("gloo", store=dist.FileStore(store, world), rank=rank, world_size=world)
        workload = case.workload
        model = build_on_meta(workload.model_cfg)  # parameters and buffers: shapes, no values
        ctx = RankContext(rank, world, META, case.cluster, workload, Emulator(case.cluster, rank, enabled=False))
        start, stop = (case.plan.data_slices or offsets(case.plan.batch_shares))[rank]
        data = workload.model_cfg.dataset("synthetic", None, "train", case.seed)
        with collectives_on(META) as calls:
            trainer = case.method.setup(case.plan, model, ctx)
            if steps:
                loss = trainer.step(tuple(t.to(META) for t in data.batch(0, start, stop, workload.global_batch)))
                assert loss.device == META, loss.device
                assert all(p.device == META for p in trainer.params)
        answers.put((rank, "ok", calls))
    except BaseException:
        answers.put((rank, "error", traceback.format_exc()[-3000:]))


def _run_on_meta(case, steps: bool = True) -> list[list[str]]:
    """Every rank's collectives (names, in call order); fails with a rank's traceback."""
    world = case.cluster.num_devices
    ctx = forking_context()
    answers = ctx.Queue()
    with tempfile.TemporaryDirectory(prefix="hetbench-meta-") as folder:
        procs = [
            ctx.Process(target=_rank, args=(r, world, f"{folder}/store", case, steps, answers), daemon=True)
            for r in range(world)
        ]
        for p in procs:
            p.start()
        got = {}
        try:
            for _ in range(world):
                rank, status, body = answers.get(timeout=240)
                assert status == "ok", f"rank {rank}:\n{body}"
                got[rank] = body
        finally:
            for p in procs:
                p.join(5)
                if p.is_alive():
                    p.kill()
    return [got[r] for r in range(world)]


def test_the_pipeline_exports_a_model_that_lives_on_another_device_than_the_sample_batch():
    # The sample is drawn on the CPU; a stage's model lives on its GPU (here: meta).
    cfg = BertConfig.from_preset("tiny")
    with torch.device("meta"):
        model = cfg.build()
    gm = model_graph(model, cfg, 2)
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    assert placeholders and all(n.meta["val"].device == META for n in placeholders)
    assert all(p.device == META for p in gm.parameters())


@pytest.mark.parametrize("method", ["hap", "sfb"])
def test_hap_and_sfb_set_up_and_step_with_every_tensor_on_the_models_device(cfg_factory, method):
    cfg = cfg_factory(
        "model=bert", f"method={method}", "method.grad_clip=0.05", "global_batch=8", "mode=sim", "cluster=local_hetero2"
    )
    case = prepare_case(cfg, new_record(cfg))
    calls = _run_on_meta(case)
    for rank_calls in calls:
        assert rank_calls.count("all_reduce") >= 2, rank_calls  # gradient buckets and the clip's norm


def test_a_hap_program_with_an_empty_shard_steps_on_the_models_device():
    workload = make_workload("bert", 2, 7)
    cluster = make_cluster(2)
    plan = plan_at_ratios(workload, cluster, [1.0, 0.0])
    method = FixedPlanMethod(plan, grad_clip=0.05, force_impl="grouped")
    from bench.runtime.worker import Case

    case = Case(workload, cluster, method, method.plan(workload, cluster), seed=0, warmup_iters=0, measured_iters=1)
    assert 0 in case.plan.batch_shares
    calls = _run_on_meta(case)
    assert all("all_reduce" in c for c in calls)


def test_the_pipeline_sets_up_its_stage_on_the_models_device(cfg_factory):
    cfg = cfg_factory(
        "model=bert",
        "method=pipeline",
        "method.profile=false",
        "method.grad_clip=1.0",
        "global_batch=8",
        "mode=sim",
        "cluster=local_hetero2",
    )
    case = prepare_case(cfg, new_record(cfg))
    assert case.plan.details["num_stages"] == 2
    _run_on_meta(case, steps=False)
