"""Per stage of auto's pipeline of hap stages, the two programs it prices: hap's search of the
whole stage and the stage's layer groups planned alone in a row (methods.auto.hap_stages
`stage_options`), each with its parts a micro-batch (forward, backward, gradient sync, peak,
state a GPU) and its price as the stage runs it (m x (forward + backward) + sync); then, for
one stage, what hap's search charges each program as one step runs it against the simulator
at 1 and m micro-batches (why the search of the whole stage does not return the row).
Simulated; nothing runs.

    python scripts/hap_stage_options.py bert_moe --k 8 --stage 2
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from hydra.utils import instantiate

from bench.core.cluster import ClusterSpec
from bench.cost import simulate
from bench.runner.case import check_workload, workload_from
from bench.runner.configs import compose_settings
from methods.auto.hap_stages import group_cluster, price_stage, stage_options, stage_theory
from methods.auto.stage_plan import HapStages
from methods.hap.lowering import build_program
from methods.hap.planner import _score


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("model")
    ap.add_argument("--k", type=int, default=8)
    ap.add_argument("--stage", type=int, default=None, help="the stage whose search prices are printed")
    a = ap.parse_args()
    cfg = compose_settings(
        f"model={a.model}",
        "preset=paper",
        "cluster=paper_hetero",
        "method=auto",
        f"cluster.gpus_per_machine={a.k}",
        "mode=sim",
        "logger=none",
    )
    cluster = ClusterSpec.from_config(cfg.cluster, cfg.config_roots())
    model_cfg, batch, data = check_workload(cfg, cluster)
    wl = workload_from(cfg, model_cfg, batch, data)
    auto = instantiate(cfg.method)
    part = HapStages(auto.hap, auto.pipeline, len({d.machine for d in cluster.devices}), lr=auto.lr)
    plan = part.finish(part.plan(wl, cluster), cluster)
    sim = simulate(plan.program, cluster, None)
    d = plan.details["hap_stages"]
    print(
        f"{a.model} paper_hetero k={a.k}: {sim.iter_time_s:.4f} s, {d['schedule']}, m={d['num_micro_batches']}, "
        f"cuts {d['cuts']}, peak {max(sim.peak_mem_gib):.2f} GiB; kept per stage: "
        f"{[st['chosen'] for st in plan.details['stages']]}"
    )
    _, _, planner, stages, _, _, groups, cuts, _, _, m, _, tail, *_ = part._made
    for s, st in enumerate(stages):
        group = group_cluster(cluster, groups[s])
        for cand, one in stage_options(planner, st, wl, group, m):
            p = price_stage(cand, one, group, tail if s + 1 == len(stages) else None)
            print(
                f"  stage {s} groups [{cuts[s]}, {cuts[s + 1]}) {cand.kind}: f {p.forward_s * 1e3:.2f} ms, "
                f"b {p.backward_s * 1e3:.2f} ms, sync {p.grad_sync_s * 1e3:.1f} ms, peak {p.peak_gib:.2f} GiB, "
                f"state {p.state_gib:.2f} GiB; m x (f + b) + sync {m * (p.forward_s + p.backward_s) + p.grad_sync_s:.3f} s"
            )
    if a.stage is None:
        return
    st, group = stages[a.stage], group_cluster(cluster, groups[a.stage])
    options = stage_options(planner, st, wl, group, m)
    gran, rows = options[0][0].program.granularity, options[0][0].ratios
    theory = stage_theory(st, planner.sfb, planner.collective_choice, planner.fuse_routing)
    pl = dataclasses.replace(planner, grad_accumulation=m)
    stats = {"expanded": 0, "pruned": 0, "beam_pruned": 0}
    cost = pl._cost_model(theory, group, gran, rows)
    programs = [
        ("data-parallel incumbent", pl._data_parallel(theory, group, gran, rows, stats)),
        ("the search's program (beam)", pl._synthesize(theory, cost)),
        ("the search's program (exact, no beam)", dataclasses.replace(pl, beam_width=None)._synthesize(theory, cost)),
        *((cand.kind, cand.result) for cand, _ in options),
    ]
    print(f"stage {a.stage}: the search's price of a step, and the simulator's at 1 and {m} micro-batches")
    for name, res in programs:
        at = []
        for k in (1, m):
            q = dataclasses.replace(planner, grad_accumulation=k)
            program = build_program(res.steps, cost, {}, q.grad_overlap, q.bucket_cap_mb * 2**20, k)
            at.append(_score(name, program, group, rows, st.graph.batch_size, res).iter_time_s)
        searched = pl._search_cost(theory, group, gran, rows, res)
        print(f"  {name}: search {searched * 1e3:.2f} ms; simulated {at[0] * 1e3:.2f} ms at 1, {at[1]:.4f} s at {m}")


if __name__ == "__main__":
    main()
