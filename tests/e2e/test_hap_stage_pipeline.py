"""A pipeline of hap stages trains like one device (methods/auto/hap_stages_runtime.py): tiny BERT
cut into 2 stages, each planned by hap over a group of 2 ranks, 4 gloo processes (rank r of stage
s is global rank 2s + r; pipeline r is ranks {r, 2 + r}), torch's schedule (1F1B, GPipe) over 2
micro-batches, 3 Adam steps, at the prototype's even row and at an uneven one. The losses, the last step's gradients (shards gathered, replicated ones summed over
the stage) and the parameters after 3 steps equal single-device training's
(tests/e2e/test_hap_equivalence.py's check_equivalence)."""

from __future__ import annotations

import functools
import os
import traceback

import pytest
import torch
import torch.distributed as dist

from bench.core.shares import offsets
from methods.auto.hap_stages import plan_stage, stage_details, stage_graph, stage_theory
from methods.auto.hap_stages_runtime import HapStageRank
from methods.common import group_table
from methods.graph import capture_config
from methods.hap.balance import batch_shares
from methods.hap.planner import HapPlanner, step_fields
from methods.hap.pricing import CostModel
from methods.hap.search import synthesize
from tests.e2e.test_hap_equivalence import STEPS, check_equivalence, make_cluster, make_workload
from tests.forked_ranks import run_forked

pytestmark = pytest.mark.e2e

BATCH = 8  # the global batch
M = 2  # micro-batches
R = 2  # ranks per stage
S = 2  # stages
LR = 5e-4


@functools.cache
def _case(cut: int, row: tuple[float, ...] | None = None):
    """(workload, the graph at the micro-batch, its layer groups, the two stages, their plans,
    a micro-batch's shares): stage 0 the layer groups before `cut`, stage 1 the rest without the
    loss's tail. `row` None: each planned as the prototype plans it (plan_stage over a group of 2
    alike ranks); else synthesized by hap's search at this fixed ratio row."""
    workload = make_workload("bert", R, BATCH)
    graph = capture_config(workload.model_cfg, BATCH // M)
    table = group_table(graph)
    planner = HapPlanner(lp=False, num_segments=1, cache_dir=None)
    stages = [stage_graph(graph, table, 0, cut), stage_graph(graph, table, cut, table.num_groups, loss=False)]
    if row is None:
        details = [stage_details(plan_stage(planner, s, workload, make_cluster(R), M)[0], s) for s in stages]
    else:
        details = []
        for s in stages:
            theory = stage_theory(s)
            res = synthesize(theory, CostModel(theory, make_cluster(R), "gpu", [list(row)]))
            details.append({**step_fields(res, s.graph), "ratios": [list(row)], "granularity": "gpu"})
    rows = [d["ratios"] for d in details]
    assert rows[0] == rows[1] and len(rows[0]) == 1, rows
    return workload, graph, table, stages, details, batch_shares(BATCH // M, rows[0][0])


def _pipeline_batch(batch, shares, r: int):
    """Pipeline r's samples: its share of each micro-batch, one micro-batch after another."""
    start, stop = offsets(shares)[r]
    mb = BATCH // M
    return tuple(torch.cat([t[j * mb + start : j * mb + stop] for j in range(M)]) for t in batch)


def _rank(rank: int, port: int, cut: int, row, schedule: str, out) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=S * R)
    try:
        workload, graph, table, stages, details, shares = _case(cut, row)
        s, r = divmod(rank, R)
        stage_groups = [dist.new_group([k * R + i for i in range(R)]) for k in range(S)]
        pipelines = [dist.new_group([k * R + i for k in range(S)]) for i in range(R)]
        trainer = HapStageRank(
            graph,
            table,
            stages,
            details,
            shares,
            workload.build(0),
            s,
            r,
            stage_groups[s],
            pipelines[r],
            M,
            schedule,
            LR,
            1.0 / workload.targets_per_iter,
        )
        data = workload.model_cfg.dataset("synthetic", None, "train", 0)
        losses = []
        for it in range(STEPS):
            *inputs, targets = _pipeline_batch(data.batch(it, 0, BATCH, BATCH), shares, r)
            losses.append(trainer.step(inputs, targets))
        grads, params = trainer.full_state()
        result = {
            "loss_sums": losses,
            "grads": {k: v.numpy() for k, v in grads.items()} if r == 0 else {},
            "params": {k: v.numpy() for k, v in params.items()} if r == 0 else {},
            "summary": trainer.program.summary(),
            "recorded": trainer.program.module is not None,
        }
        out.put((rank, result, None))
    except BaseException:
        out.put((rank, None, traceback.format_exc()))
    finally:
        dist.destroy_process_group()


def _launch(cut: int, row, schedule: str) -> list[dict]:
    _case(cut, row)  # planned here, before the fork: every rank takes the same plans
    return run_forked(_rank, S * R, cut, row, schedule)


# Cut after block 0 (stage 0: the embedding and block 0; stage 1: block 1 and the head), planned
# as the prototype plans it (the row (0.5, 0.5), 2 + 2 samples a micro-batch) under both
# schedules; and at the uneven row (0.25, 0.75) (1 + 3 samples), synthesized at that row.
CASES = [
    pytest.param(2, None, "1F1B", id="planned-1f1b"),
    pytest.param(2, None, "GPipe", id="planned-gpipe"),
    pytest.param(2, (0.25, 0.75), "1F1B", id="uneven-1f1b"),
]


@pytest.mark.parametrize("cut,row,schedule", CASES)
def test_a_pipeline_of_hap_stages_trains_like_one_device(cut, row, schedule):
    workload, _, _, stages, _, shares = _case(cut, row)
    assert stages[0].crossing_out == stages[1].crossing_in and stages[1].ends_at_loss
    assert all(shares) and sum(shares) == BATCH // M
    results = _launch(cut, row, schedule)
    assert all(res["recorded"] for res in results)  # the second micro-batch on ran the recorded program
    # stage 0's program shards a parameter and runs a collective inside the stage (forward and
    # backward over the stage's group); stage 1's replicated gradients are summed after the schedule
    ran = [results[0]["summary"], results[R]["summary"]]
    assert ran[0]["sharded_params"] and ran[0]["collectives"], ran[0]
    assert ran[1]["replicated_params"], ran[1]
    # every rank's state: stage 0's from global rank 0, stage 1's from global rank R
    merged = {
        "loss_sums": [sum(res["loss_sums"][i] for res in results) for i in range(STEPS)],
        "grads": {**results[0]["grads"], **results[R]["grads"]},
        "params": {**results[0]["params"], **results[R]["params"]},
    }
    assert not set(results[0]["grads"]) & set(results[R]["grads"])
    check_equivalence(workload, [merged], lr=LR)
