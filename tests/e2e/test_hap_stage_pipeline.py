"""A pipeline of hap stages trains like one device (methods/auto/hap_stages_runtime.py's
`HapStagesTrainer`, built from a plan in auto's format for hap stages): tiny BERT cut into 2 or
3 stages, each planned by hap over a group of 2 ranks, one gloo process a rank, torch's schedule
(1F1B, GPipe), each rank trained on the samples its plan's `data_slices` give it (what the runner
loads: the 2-stage case runs through the runner's workers), 3 Adam steps. The losses, the last step's
gradients and the parameters after 3 steps (every stage's, written into rank 0's model) equal
single-device training's (tests/e2e/test_hap_equivalence.py's check_equivalence), with clipping
by the global norm in the 3-stage case (at a norm that clips every step)."""

from __future__ import annotations

import dataclasses
import functools
import json
import os
import traceback

import pytest
import torch
import torch.distributed as dist

from bench.core.interfaces import Plan, RankContext
from bench.core.weights import Weights, build_meta
from bench.runtime.emulation import Emulator
from bench.runtime.launch import launch
from bench.runtime.pacing import RankHooks
from bench.runtime.worker import Case
from methods.auto.hap_stages import chain_steps, plan_stage, rank_batches, stage_details, stage_graph, stage_theory
from methods.auto.hap_stages_runtime import HapStagesTrainer
from methods.common import group_table
from methods.graph import capture_config
from methods.hap.balance import batch_shares
from methods.hap.planner import HapPlanner, step_fields
from methods.hap.pricing import CostModel
from methods.hap.search import synthesize
from tests.e2e.test_hap_equivalence import STEPS, check_equivalence, make_cluster, make_workload
from tests.forked_ranks import run_forked

pytestmark = pytest.mark.e2e

R = 2  # ranks per stage
LR = 5e-4


@functools.cache
def _plan(
    model: str, cuts: tuple[int, ...], row, batch: int, m: int, schedule: str, groups, chain: bool = False
) -> tuple:
    """(workload, plan) of the tiny `model` cut at `cuts`, in the plan format auto's hap stages use
    (details["hap_stages"], data_slices from rank_batches), round-tripped through JSON as a
    record keeps it. `row` None: each stage planned as the prototype plans it (plan_stage over
    a group of R alike ranks: an even row); else synthesized by hap's search at this row, and
    with `chain` each layer group synthesized alone and a stage's groups run in a row
    (chain_steps, as plan_chain joins them)."""
    workload = make_workload(model, R, batch)
    mb = batch // m
    graph = capture_config(workload.model_cfg, mb)
    table = group_table(graph)
    S = len(cuts) - 1
    stages = [stage_graph(graph, table, cuts[s], cuts[s + 1], loss=s + 1 < S) for s in range(S)]
    planner = HapPlanner(lp=False, num_segments=1, cache_dir=None)
    details = []
    for st in stages:
        if row is None:
            details.append(stage_details(plan_stage(planner, st, workload, make_cluster(R), m)[0], st))
        else:
            parts = [st]
            if chain:
                parts = [stage_graph(graph, table, i, i + 1, loss=not st.ends_at_loss) for i in range(st.first, st.end)]
            found = []
            for part in parts:
                theory = stage_theory(part)
                found.append(synthesize(theory, CostModel(theory, make_cluster(R), "gpu", [list(row)])))
            res = chain_steps(st, found) if chain else found[0]
            assert res is not None
            details.append({**step_fields(res, st.graph), "ratios": [list(row)], "granularity": "gpu"})
    rows = {json.dumps(d["ratios"]) for d in details}
    assert len(rows) == 1, rows
    hap_stages = {
        "cuts": list(cuts),
        "groups": [list(g) for g in groups],
        "batch_shares": batch_shares(mb, details[0]["ratios"][0]),
        "micro_batch": mb,
        "num_micro_batches": m,
        "schedule": schedule,
        "stages": details,
    }
    hap_stages = json.loads(json.dumps(hap_stages))
    shares, slices = rank_batches(hap_stages)
    return workload, Plan("auto", shares, {"hap_stages": hap_stages}, data_slices=slices)


def _rank(rank: int, port: int, key: tuple, grad_clip: float, on_meta: bool, out) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    workload, plan = _plan(*key)
    world = len(plan.data_slices)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        cluster = make_cluster(world)
        emulator = Emulator(cluster, rank, enabled=False)
        if on_meta:  # as the runner hands a method that materialises what it holds
            model = build_meta(workload.model_cfg, 0)
            ctx = RankContext(
                rank, world, torch.device("cpu"), cluster, workload, emulator, Weights(model, 0, workload.model_cfg)
            )
        else:
            model = workload.build(0)
            ctx = RankContext(rank, world, torch.device("cpu"), cluster, workload, emulator)
        trainer = HapStagesTrainer(plan, model, ctx, LR, grad_clip, mirror_full_state=True)
        data = workload.model_cfg.dataset("synthetic", None, "train", 0)
        losses, norms = [], []
        for it in range(STEPS):  # the batch the runner hands the rank (bench.runtime.worker)
            batch = data.batch(it, *plan.data_slices[rank], workload.global_batch)
            losses.append(float(trainer.step(batch)))
            norms.append(None if trainer.grad_norm is None else float(trainer.grad_norm))
        model = trainer.full_model
        result = {
            "loss_sums": losses,
            "norms": norms,
            "grads": {n: p.grad.numpy() for n, p in model.named_parameters() if p.grad is not None}
            if rank == 0
            else {},
            "params": {n: p.detach().numpy() for n, p in model.named_parameters()} if rank == 0 else {},
            "stage": trainer.stage_index,
            "summary": trainer.program.summary(),
            "recorded": trainer.program.module is not None,
        }
        out.put((rank, result, None))
    except BaseException:
        out.put((rank, None, traceback.format_exc()))
    finally:
        dist.destroy_process_group()


# 3 stages x 2 ranks synthesized at the uneven row (0.25, 0.75) (1 + 3 samples a micro-batch of
# 4): tiny BERT under 1F1B (the embedding; block 0; block 1 and the head), global batch 12 in 3
# micro-batches, clipped at 0.3 (one device's norm is 0.61-0.63: every step clips), the groups'
# ranks in no order (rank i of stage s is groups[s][i]), the model handed over on meta (the
# trainer materialises it from ctx.weights); tiny VGG19 under GPipe (conv stages 0-1; 2-3; 4
# and the classifier), global batch 8 in 2, whose middle and last stages shard parameters and
# run collectives. `sharding`: the
# stages whose programs shard a parameter and run a collective inside the stage (forward and
# backward over the stage's group). (2 stages run through the runner, below.)
CASES = [
    pytest.param(
        ("bert", (0, 1, 2, 4), (0.25, 0.75), 12, 3, "1F1B", ((1, 0), (5, 3), (2, 4))),
        0.3,
        True,
        [0],
        id="bert-3-stages-clipped-meta",
    ),
    pytest.param(
        ("vgg19", (0, 2, 4, 6), (0.25, 0.75), 8, 2, "GPipe", ((0, 1), (2, 3), (4, 5))),
        0.0,
        False,
        [1, 2],
        id="vgg19-3-stages",
    ),
    pytest.param(
        ("bert_moe", (0, 3, 4), (0.5, 0.5), 8, 2, "GPipe", ((0, 1), (2, 3)), True),
        0.0,
        False,
        [0],
        id="bert_moe-layer-groups-in-a-row",
    ),
]


@pytest.mark.parametrize("key,grad_clip,on_meta,sharding", CASES)
def test_a_pipeline_of_hap_stages_trains_like_one_device(key, grad_clip, on_meta, sharding):
    workload, plan = _plan(*key)  # planned here, before the fork: every rank takes the same plan
    hs = plan.details["hap_stages"]
    S, world = len(hs["groups"]), len(plan.data_slices)
    results = run_forked(_rank, world, key, grad_clip, on_meta)
    assert all(res["recorded"] for res in results)  # the second micro-batch on ran the recorded program
    assert [res["stage"] for res in results] == [
        next(s for s, g in enumerate(hs["groups"]) if r in g) for r in range(world)
    ]
    ran = [results[hs["groups"][s][0]]["summary"] for s in range(S)]
    assert [s for s in range(S) if ran[s]["sharded_params"] and ran[s]["collectives"]] == sharding, ran
    assert ran[-1]["replicated_params"], ran[-1]  # summed over the stage after the schedule
    if key[0] == "bert_moe":  # the first stage's MoE block (its own program) splits the experts
        sources = {tuple(x) for step in hs["stages"][0]["steps"] for x in step["sources"]}
        assert ("blocks_1_ffn_w1", 0) in sources and ("blocks_0_attn_query_weight", "I") in sources, sorted(sources)
    if grad_clip:  # one norm on every rank, above the clip: every step clipped
        norms = {tuple(res["norms"]) for res in results}
        assert len(norms) == 1 and min(next(iter(norms))) > grad_clip, norms
    check_equivalence(workload, results, lr=LR, grad_clip=grad_clip)


@dataclasses.dataclass
class StagesMethod:
    """A Method that runs a plan of hap stages made elsewhere (picklable: it travels to the
    runner's workers), its trainer writing every stage's state into rank 0's model."""

    plan_: Plan
    grad_clip: float = 0.0
    name: str = "auto"
    modes: tuple = ("real",)

    def plan(self, workload, cluster) -> Plan:
        return self.plan_

    def setup(self, plan: Plan, model, ctx: RankContext) -> HapStagesTrainer:
        return HapStagesTrainer(plan, model, ctx, LR, self.grad_clip, mirror_full_state=True)


def test_the_runner_trains_a_plan_of_hap_stages_like_one_device():
    """The runner's workers (bench.runtime.launch) run the trainer behind a Method's setup, each
    loading its plan.data_slices of every global batch, and read rank 0's model back: 2 stages
    planned as the prototype plans them (cut after block 0; the row (0.5, 0.5), 2 + 2 samples of
    each of 2 micro-batches of 4), GPipe, 4 ranks."""
    workload, plan = _plan("bert", (0, 2, 4), None, 8, 2, "GPipe", ((0, 1), (2, 3)))
    assert plan.details["hap_stages"]["batch_shares"] == [2, 2]
    case = Case(
        workload,
        make_cluster(4),
        StagesMethod(plan),
        plan,
        seed=0,
        warmup_iters=0,
        measured_iters=STEPS,
        hooks=RankHooks(return_state=True),
    )
    check_equivalence(workload, launch(case, 4, timeout_s=120), lr=LR)
