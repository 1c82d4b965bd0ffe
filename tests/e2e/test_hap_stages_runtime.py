"""hap's program of a pipeline stage runs (methods/auto/hap_stages.py `stage_program`): tiny
BERT cut at a layer-group border into two stages, each planned by hap over a group of 2 ranks
as the prototype plans it, each rank running its programs of both stages on gloo (rank r of
stage 0 hands its shards of the border tensors to rank r of stage 1, as a rank-aligned pipeline
does; no schedule). Stage 0's outputs, reassembled, are one device's activations at the border;
stage 1's loss parts sum to one device's loss; with the border's gradient fed back into stage
0's backward, every parameter's gradient (shards reassembled, replicated ones summed) is one
device's."""

from __future__ import annotations

import functools
import os
import traceback

import numpy as np
import pytest
import torch
import torch.distributed as dist
from torch import fx

from bench.core.shares import offsets
from methods.auto.hap_stages import plan_stage, stage_details, stage_graph, stage_program, stage_theory
from methods.common import group_table
from methods.graph import capture_config
from methods.hap.balance import batch_shares
from methods.hap.codegen import CodegenOptions, _on_device
from methods.hap.planner import HapPlanner, step_fields
from methods.hap.pricing import CostModel
from methods.hap.search import synthesize
from tests.e2e.test_hap_equivalence import make_cluster, make_workload
from tests.forked_ranks import run_forked

pytestmark = pytest.mark.e2e

BATCH = 8
WORLD = 2


@functools.cache
def _model():
    workload = make_workload("bert", WORLD, BATCH)
    graph = capture_config(workload.model_cfg, BATCH)
    return workload, graph, group_table(graph)


def _case(cut: int, row: tuple[float, ...] | None):
    """(workload, graph, the two stages, each one's plan details, the ranks' batch shares):
    stage 0 the layer groups before `cut`, stage 1 the rest. `row`: None, each stage planned
    by the prototype's planner (plan_stage: hap's levels, starts and its data-parallel
    incumbent over the group); else synthesized by hap's search at this fixed ratio row."""
    workload, graph, table = _model()
    group = make_cluster(WORLD)
    planner = HapPlanner(lp=False, num_segments=1, cache_dir=None)
    stages, details = [], []
    for first, end in ((0, cut), (cut, table.num_groups)):
        stage = stage_graph(graph, table, first, end)
        if row is None:
            cand, _ = plan_stage(planner, stage, workload, group)
            details.append(stage_details(cand, stage))
        else:
            theory = stage_theory(stage)
            res = synthesize(theory, CostModel(theory, group, "gpu", [list(row)]))
            details.append({**step_fields(res, stage.graph), "ratios": [list(row)], "granularity": "gpu"})
        stages.append(stage)
    rows = [d["ratios"] for d in details]
    assert rows[0] == rows[1] and len(rows[0]) == 1, rows  # one batch row, the same at both stages
    return workload, graph, stages, details, batch_shares(BATCH, rows[0][0])


def _reference(workload, graph, stages):
    """One device: the loss, the border activations and their gradient, every parameter's
    gradient (the captured graph run with the model's parameters, which is the model's forward)."""
    model = workload.build(0)
    batch = workload.model_cfg.dataset("synthetic", None, "train", 0).batch(0, 0, BATCH, BATCH)
    border = stages[0].crossing_out
    cpu = torch.device("cpu")

    class Run(fx.Interpreter):
        values: dict = {}

        def fetch_attr(self, target):
            for get in (model.get_parameter, model.get_buffer):
                try:
                    return get(target)
                except AttributeError:
                    pass
            return super().fetch_attr(target).to(cpu)

        def call_function(self, target, args, kwargs):
            return super().call_function(target, _on_device(args, cpu), _on_device(kwargs, cpu))

        def run_node(self, n):
            out = super().run_node(n)
            if n.name in border:
                out.retain_grad()
                self.values[n.name] = out
            return out

    run = Run(graph.gm)
    loss = run.run(*batch)
    torch.testing.assert_close(loss, model(*batch))  # the graph is the model
    (loss / workload.targets_per_iter).backward()
    grads = {n: p.grad.detach().clone() for n, p in model.named_parameters()}
    acts = {t: (v.detach().clone(), v.grad.detach().clone()) for t, v in run.values.items()}
    return batch, loss.item(), acts, grads


def _rank(rank: int, port: int, case, options, batch, out) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=WORLD)
    try:
        workload, graph, stages, details, shares = case
        start, stop = offsets(shares)[rank]
        mine = dict(zip([n.name for n in graph.nodes if n.kind == "placeholder"], (t[start:stop] for t in batch)))
        model = workload.build(0)
        programs = [stage_program(s, d, shares, model, rank, WORLD, o) for s, d, o in zip(stages, details, options)]
        calls = []
        for _ in range(2):  # the first call interprets the plan, the second runs the recorded module
            for p in programs:
                for q in p.params.values():
                    q.grad = None
            first, last = programs
            sent = first(*(mine[n] for n in stages[0].inputs))
            assert isinstance(sent, tuple) and len(sent) == len(stages[0].crossing_out)
            received = {t: x.detach().requires_grad_() for t, x in zip(stages[0].crossing_out, sent)}
            loss = last(*(received.get(n, mine.get(n)) for n in stages[1].inputs))
            (loss / workload.targets_per_iter).backward()
            back = [received[t].grad for t in stages[0].crossing_out]
            torch.autograd.backward(sent, back)
            grads = {}
            for p in programs:
                for name in p.grad_sync:  # replicated: each rank's part of the sum
                    dist.all_reduce(p.params[name].grad)
                grads.update(p.full_tensors(lambda q: q.grad))
            calls.append(
                {
                    # numpy: a tensor would cross the queue as shared memory the rank frees on exit
                    "sent": [x.detach().numpy() for x in sent],
                    "back": [g.numpy() for g in back],
                    "loss": loss.item(),
                    "grads": {k: v.numpy() for k, v in grads.items()} if rank == 0 else None,
                    "recorded": [p.module is not None for p in programs],
                    "sharded": sorted(set().union(*(p.sharded for p in programs))),
                    "summary": [p.summary() for p in programs],
                }
            )
        out.put((rank, calls, None))
    except BaseException:
        out.put((rank, None, traceback.format_exc()))
    finally:
        dist.destroy_process_group()


def _launch(case, options, batch) -> list[list[dict]]:
    return run_forked(_rank, WORLD, case, options, batch)  # the ranks take the plans and the graph as they are here


# Cut after the first block, each stage planned as the prototype plans it (an even row over two
# alike ranks): stage 0 shards the embedding's hidden dim and all-to-alls back to a batch split
# inside the stage; stage 1 runs data parallel. Cut after the embedding, at an uneven row (3 and
# 5 samples), synthesized at that row: stage 0's all-to-all is its boundary step's, and stage 1
# runs its linears as SFB (grouped gathers of inputs and output gradients).
CASES = [
    pytest.param(2, None, (None, None), id="cut2-planned"),
    pytest.param(1, (0.375, 0.625), (None, CodegenOptions(force_sfb=True, force_impl="grouped")), id="cut1-uneven-sfb"),
]


@pytest.mark.parametrize("cut,row,options", CASES)
def test_two_hap_stages_of_bert_run_like_one_device(cut, row, options):
    case = _case(cut, row)
    workload, graph, stages, details, shares = case
    assert stages[0].crossing_out == stages[1].crossing_in and not stages[0].crossing_in
    assert sum(shares) == BATCH and all(shares)
    # hap's programs do more than data parallelism somewhere (a sharded parameter, a collective)
    kinds = {c["kind"] for d in details for s in d["steps"] for c in s["comms"]}
    assert kinds, "both stages planned as plain data parallelism: the test exercises no collective"
    batch, loss, acts, grads = _reference(workload, graph, stages)
    ranks = _launch(case, options, batch)
    scale = max(g.abs().max().item() for g in grads.values())
    for call in range(2):
        parts = [r[call] for r in ranks]
        assert all(p["recorded"] == [True, True] for p in parts)
        for i, t in enumerate(stages[0].crossing_out):
            ref, ref_grad = acts[t]
            got = np.concatenate([p["sent"][i] for p in parts])  # Gather(0) at the row: rank 0's samples first
            assert [p["sent"][i].shape[0] for p in parts] == shares
            np.testing.assert_allclose(got, ref.numpy(), rtol=1e-5, atol=1e-6, err_msg=t)
            back = np.concatenate([p["back"][i] for p in parts])
            atol = 1e-5 * np.abs(back).max()
            np.testing.assert_allclose(back, ref_grad.numpy(), rtol=1e-5, atol=atol, err_msg=f"{t}'s gradient")
        np.testing.assert_allclose(sum(p["loss"] for p in parts), loss, rtol=1e-5)
        got = parts[0]["grads"]
        assert set(got) == set(grads)
        for name, ref in grads.items():
            np.testing.assert_allclose(got[name], ref.numpy(), rtol=1e-5, atol=1e-5 * scale, err_msg=name)
    assert ranks[0][0]["sharded"], "no parameter sharded: the test reassembles no shard"
    ran = ranks[0][0]["summary"]
    assert "all_to_all" in ran[0]["collectives"]  # stage 0 back to a batch split
    if options[1] is not None and options[1].force_sfb:
        assert ran[1]["sfb"] and ran[1]["sfb_impl"] == "grouped"
