"""The memory tools priced alike by every method (methods.common.MemoryTools).

Activation checkpointing adds the checkpointed groups' forward FLOPs to backward and lowers the
activation peak; gradient accumulation keeps the FLOPs and lowers the peak. Each method's
Program says so at its own plan (simulated, on a non-emulated cluster of 8 GPUs)."""

from __future__ import annotations

import pytest

from bench.cost import simulate
from bench.runner.case import new_record, prepare_case
from methods.common import checkpoint_units
from methods.graph import capture_config
from tests.conftest import compose_settings

METHODS = {
    "dp_ev": (),
    "fsdp": ("method.work_probe=false",),
    "deepspeed": ("method.zero_stage=3", "method.engine_probe=false"),
    "hap": ("method.cache_dir=null",),
}


def _plan(tmp_path, method, *tools):
    cfg = compose_settings(
        "model=bert",
        f"method={method}",
        "mode=sim",
        "cluster=paper_hetero",
        "cluster.gpus_per_machine=1",
        "global_batch=16",
        *METHODS[method],
        *tools,
        results_dir=str(tmp_path),
    )
    case = prepare_case(cfg, new_record(cfg))
    return case, simulate(case.plan.program, case.cluster, case.plan.ratios)


@pytest.mark.parametrize("method", sorted(METHODS))
def test_every_method_prices_the_recompute_and_the_smaller_peak(tmp_path, method):
    plain, plain_sim = _plan(tmp_path, method)
    ckpt, ckpt_sim = _plan(tmp_path, method, "method.activation_checkpointing=true")
    graph = capture_config(plain.workload.model_cfg, 16)
    again = sum(graph[n].flops for u in checkpoint_units(graph) for n in u.nodes)  # at the global batch
    added = ckpt.plan.program.total_flops(ckpt.plan.ratios) - plain.plan.program.total_flops(plain.plan.ratios)
    if method == "hap":  # an op the plan replicates is recomputed on every device
        assert added >= again * (1 - 1e-9)
    else:
        assert added == pytest.approx(again)
    assert ckpt.plan.details["memory_tools"]["checkpointed_groups"] == [1, 2]
    assert max(ckpt_sim.peak_mem_gib) < max(plain_sim.peak_mem_gib)
    # FSDP on GPUs computes beside its prefetched collectives: tiny BERT's recompute hides there
    assert ckpt_sim.iter_time_s > plain_sim.iter_time_s or (
        method == "fsdp" and ckpt_sim.iter_time_s == plain_sim.iter_time_s
    )


@pytest.mark.parametrize("method", sorted(METHODS))
def test_every_method_prices_accumulation_at_the_same_flops_and_a_smaller_activation_peak(tmp_path, method):
    plain, plain_sim = _plan(tmp_path, method)
    accum, accum_sim = _plan(tmp_path, method, "method.grad_accumulation=2")
    assert accum.plan.batch_shares == plain.plan.batch_shares
    flops = [c.plan.program.total_flops(c.plan.ratios) for c in (plain, accum)]
    assert flops[1] == pytest.approx(flops[0], rel=1e-9)
    # FSDP's activations hold its gathered units beside the samples' (a constant)
    gathered = plain.plan.program.memory.activations.const / 2**30
    acts = [max(m["activations"] for m in sim.memory_gib) - gathered for sim in (plain_sim, accum_sim)]
    assert acts[1] == pytest.approx(acts[0] / 2, rel=1e-6)
    launches = [sum(st.launches for st in c.plan.program.stages) for c in (plain, accum)]
    assert launches[1] == pytest.approx(2 * launches[0])
