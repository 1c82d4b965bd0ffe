"""A prototype study: pipelines whose stages run hap's synthesized programs over their group of
devices, against today's pipelines (data parallel inside a stage) of the same shape.

    python scripts/hap_in_stages.py bert_moe --stages 8,4 --micro-batches 16,32,64,128,256

For each stage count S (stage_level=machine, alike=stage: a stage's group is 8/S... machines of
one kind) and each number of micro-batches m (a group's micro-batch is global batch / m, split
evenly over its ranks): every layer group is planned alone by hap over a group of each device
kind (methods.auto.hap_stages), each start and end batch-split; a dynamic program cuts the
groups into stages by those prices (the slowest stage's forward and backward, each stage's
state and the micro-batches 1F1B keeps in flight within the memory), over every order of the
slots' kinds; the best cuts' stages are then planned whole by hap and the pipeline priced by
the pipeline's replay of torch's 1F1B. Beside it, today's pipeline planner at the same S and m
(1F1B, machine slots, alike=stage). Everything is simulated; nothing runs.
"""

from __future__ import annotations

import argparse
import functools
import itertools
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.core.cluster import ClusterSpec
from bench.core.errors import PlanningError
from bench.cost import simulate
from bench.cost.pipeline import in_flight
from bench.runner.case import check_workload, workload_from
from bench.runner.configs import compose_settings
from methods.auto.hap_stages import (
    StagePrice,
    group_cluster,
    lockstep_program,
    plan_stage,
    price_pipeline,
    price_stage,
    rank_aligned_buffers,
    rank_aligned_sends,
    search_stage,
    stage_graph,
)
from methods.common import group_table
from methods.graph import capture_config
from methods.hap.planner import HapPlanner
from methods.pipeline import PipelineParallel
from methods.pipeline.planning import _hardware, layouts

MEMORY_GIB = 16.0  # paper_hetero's V100-16 and P100-16
# Each layer group is planned for a device of MEMORY_GIB / f (hap keeps the fastest program that
# fits): the leaner programs a stage of many groups needs, which one group alone never asks for.
BUDGETS = (1, 2, 4, 8)


def case(model: str, k: int, extra: list[str]):
    cfg = compose_settings(
        f"model={model}",
        "preset=paper",
        "cluster=paper_hetero",
        "method=hap",
        f"cluster.gpus_per_machine={k}",
        "mode=sim",
        "logger=none",
        *extra,
    )
    cluster = ClusterSpec.from_config(cfg.cluster, cfg.config_roots())
    model_cfg, batch, data = check_workload(cfg, cluster)
    return workload_from(cfg, model_cfg, batch, data), cluster


def summed(prices: list[StagePrice]) -> StagePrice:
    """Layer groups' programs run one after another: each starts and ends batch-split, so their
    concatenation is a program of the stage, in hap's space, which its search of the whole stage
    can miss (its beam, and its score of one stage alone: choose_per_stage)."""
    return StagePrice(
        sum(p.forward_s for p in prices),
        sum(p.backward_s for p in prices),
        sum(p.grad_sync_s for p in prices),
        sum(p.optimizer_s for p in prices),
        sum(p.state_gib for p in prices) + max(p.peak_gib - p.state_gib - p.activations_gib for p in prices),
        sum(p.activations_gib for p in prices),
        sum(p.state_gib for p in prices),
        chosen="summed",
    )


def choose_per_stage(whole: list[StagePrice], parts: list[StagePrice], price) -> tuple[list[StagePrice], object]:
    """Per stage, its whole program or its layer groups' in a row, whichever makes the pipeline
    faster by its replay (`price`), one stage at a time until nothing changes (from three starts:
    the faster per micro-batch, all groups, all whole; the best kept): a stage's own
    score (its micro-batches' forward and backward, then its gradient sync) does not see the
    slack its position leaves after its last backward, which hides part of its sync."""
    starts = [
        [min(w, p, key=lambda x: x.forward_s + x.backward_s) for w, p in zip(whole, parts)],
        list(parts),
        list(whole),
    ]
    found = [_descend(start, whole, parts, price) for start in starts]
    return min(found, key=lambda f: (f[1].oom, f[1].iter_time_s))


def _descend(chosen: list[StagePrice], whole: list[StagePrice], parts: list[StagePrice], price):
    best = price(chosen)
    changed = True
    while changed:
        changed = False
        for k in range(len(chosen)):
            for alt in (whole[k], parts[k]):
                if alt is chosen[k]:
                    continue
                trial = [*chosen[:k], alt, *chosen[k + 1 :]]
                got = price(trial)
                if (got.oom, got.iter_time_s) < (best.oom, best.iter_time_s):
                    chosen, best, changed = trial, got, True
    return chosen, best


def best_cuts(
    S: int, G: int, order: tuple, price, flights: list[int], buffers
) -> tuple[float, list[int], list[int]] | None:
    """Cuts of G groups into S stages (stage k on slot kind order[k]) of least slowest stage
    (forward + backward a micro-batch), each stage's state and the micro-batches its schedule
    keeps in flight (`flights`) within the memory, each stage's groups all planned at one
    budget level. price(kind, first, end, level) -> StagePrice; buffers(k, first, end) -> GiB of
    stage k's receive buffers over the step. Returns (slowest stage, cuts,
    each stage's level)."""
    inf = float("inf")
    best = [[inf] * (G + 1) for _ in range(S + 1)]
    cut = [[0] * (G + 1) for _ in range(S + 1)]
    level = [[0] * (G + 1) for _ in range(S + 1)]
    best[0][0] = 0.0
    for k in range(1, S + 1):
        flight = flights[k - 1]
        for j in range(k, G - (S - k) + 1):
            for i in range(k - 1, j):
                if best[k - 1][i] == inf:
                    continue
                for lv in range(len(BUDGETS)):
                    p = price(order[k - 1], i, j, lv)
                    if p.peak_gib + (flight - 1) * p.activations_gib + buffers(k - 1, i, j) > MEMORY_GIB:
                        continue
                    c = max(best[k - 1][i], p.forward_s + p.backward_s)
                    if c < best[k][j]:
                        best[k][j], cut[k][j], level[k][j] = c, i, lv
    if best[S][G] == inf:
        return None
    cuts, levels, j = [G], [], G
    for k in range(S, 0, -1):
        levels.append(level[k][j])
        j = cut[k][j]
        cuts.append(j)
    return best[S][G], cuts[::-1], levels[::-1]


def study(model: str, stage_counts: list[int], ms: list[int], k: int, schedule: str, extra: list[str]) -> None:
    workload, cluster = case(model, k, extra)
    B = workload.global_batch
    print(f"{model} paper preset, paper_hetero k={k}: {cluster.num_devices} devices, global batch {B} (simulated)")
    hp = HapPlanner(lp=False, num_segments=1)
    for S in stage_counts:
        graph0 = capture_config(workload.model_cfg, B)
        G = group_table(graph0).num_groups
        found, refused = layouts(cluster, "machine", S, G, "stage")
        if not found:
            print(f"S={S}: {refused}")
            continue
        layout = found[0]
        kinds = sorted({_hardware(cluster, s) for s in layout.slots})
        if any(len({_hardware(cluster, (r,)) for r in s}) > 1 for s in layout.slots):
            print(f"S={S}: a slot mixes device kinds; the prototype plans groups of one kind")
            continue
        rep = {kd: next(s for s in layout.slots if _hardware(cluster, s) == kd) for kd in kinds}
        slot_kind = [_hardware(cluster, s) for s in layout.slots]
        orders = sorted(set(itertools.permutations(slot_kind)))
        size = len(layout.slots[0])
        for m in ms:
            mb = B // m
            if B % m or mb % size or m < S:
                continue
            t0 = time.perf_counter()
            graph = capture_config(workload.model_cfg, mb)
            table = group_table(graph)
            budgets = {
                (kd, lv): group_cluster(cluster, rep[kd], memory_gib=MEMORY_GIB / f)
                for kd in kinds
                for lv, f in enumerate(BUDGETS)
            }
            sig_of = [
                (
                    tuple(sorted(g.forward_flops.items())),
                    g.param_bytes,
                    g.out_bytes,
                    g.saved_bytes,
                    i == 0,
                    i == G - 1,
                )
                for i, g in enumerate(table.groups)
            ]
            alone: dict = {}
            for (kd, lv), grp in budgets.items():
                for i in range(G):
                    key = (kd, sig_of[i], lv)
                    if key not in alone:
                        st = stage_graph(graph, table, i, i + 1)
                        cand, one = plan_stage(hp, st, workload, grp, m)
                        alone[key] = price_stage(cand, one, budgets[(kd, 0)])
            memo: dict = {}

            def price(kd, first, end, lv, memo=memo, alone=alone, sig_of=sig_of):
                if (kd, first, end, lv) not in memo:
                    memo[(kd, first, end, lv)] = summed([alone[(kd, sig_of[i], lv)] for i in range(first, end)])
                return memo[(kd, first, end, lv)]

            flights = [in_flight(a) for a in lockstep_program(schedule, S, m, mb).actions]
            share = -(-mb // size)

            def buffers(k, first, end, table=table, share=share, m=m, S=S):
                received = table.groups[first - 1].out_bytes if k else 0.0
                sent = table.groups[end - 1].out_bytes if k + 1 < S else 0.0
                return m * share * (received + sent) / 2**30

            choice = None
            for order in orders:
                got = best_cuts(S, G, order, price, flights, buffers)
                if got and (choice is None or got[0] < choice[0]):
                    choice = (got[0], got[1], order, got[2])
            t_groups = time.perf_counter() - t0
            hap_line = "no cuts fit"
            if choice is not None:
                _, cuts, order, levels = choice
                pools = {kd: [s for s in layout.slots if _hardware(cluster, s) == kd] for kd in kinds}
                slots = [pools[kd].pop(0) for kd in order]
                parts = [price(order[s], cuts[s], cuts[s + 1], levels[s]) for s in range(S)]
                whole = []
                for s in range(S):
                    # planned for what its device has left beside the schedule's other micro-batches
                    room = MEMORY_GIB - (flights[s] - 1) * parts[s].activations_gib - buffers(s, cuts[s], cuts[s + 1])
                    st = stage_graph(graph, table, cuts[s], cuts[s + 1])
                    cand, one = search_stage(hp, st, workload, group_cluster(cluster, slots[s], memory_gib=room), m)
                    whole.append(price_stage(cand, one, group_cluster(cluster, slots[s])))
                sends = rank_aligned_sends(table, cuts, slots, mb, cluster)
                held = rank_aligned_buffers(table, cuts, slots, mb)
                p_whole = price_pipeline(schedule, m, mb, whole, sends, MEMORY_GIB, cluster, held)
                p_sum = price_pipeline(schedule, m, mb, parts, sends, MEMORY_GIB, cluster, held)
                chosen, p_best = choose_per_stage(
                    whole,
                    parts,
                    functools.partial(
                        price_pipeline,
                        schedule,
                        m,
                        mb,
                        sends=sends,
                        memory_gib=MEMORY_GIB,
                        cluster=cluster,
                        buffer_bytes=held,
                    ),
                )
                names = ["V100" if "V100" in kd[0][0] else "P100" for kd in order]
                hap_line = (
                    f"hap stages {p_best.iter_time_s:.3f} s (whole stages {p_whole.iter_time_s:.3f}, groups summed "
                    f"{p_sum.iter_time_s:.3f}), peak {max(p_best.peaks_gib):.1f} GiB{' OOM' if p_best.oom else ''}; "
                    f"cuts {cuts}, budgets 1/{[BUDGETS[lv] for lv in levels]}, "
                    f"order {'/'.join(names)}; stages: "
                    + "; ".join(
                        f"{w.chosen[:5]} f{w.forward_s * 1e3:.1f} b{w.backward_s * 1e3:.1f} "
                        f"sync{w.grad_sync_s * 1e3:.0f}ms {w.state_gib:.1f}GiB"
                        for w in chosen
                    )
                )
            t_hap = time.perf_counter() - t0
            try:
                dp = PipelineParallel(
                    schedule=schedule,
                    stage_level="machine",
                    num_stages=S,
                    alike="stage",
                    num_micro_batches=m,
                    work_probe=False,
                ).plan(workload, cluster)
                r = simulate(dp.program, cluster, None)
                cuts_dp = [st["groups"][0] for st in dp.details["stages"]] + [G]
                dp_line = f"dp stages {r.iter_time_s:.3f} s, peak {max(r.peak_mem_gib):.1f} GiB, cuts {cuts_dp}"
            except PlanningError as exc:
                dp_line = f"dp stages: {str(exc)[:90]}"
            print(f"{schedule} S={S} m={m} (group micro-batch {mb}, {mb // size}/rank): {hap_line}", flush=True)
            print(f"    {dp_line}; planned hap stages in {t_hap:.0f} s ({t_groups:.0f} s the groups)", flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("model")
    ap.add_argument("--stages", default="8,4")
    ap.add_argument("--micro-batches", default="16,32,64,128,256")
    ap.add_argument("--k", type=int, default=8)
    ap.add_argument("--schedule", default="1f1b", choices=("1f1b", "gpipe"))
    ap.add_argument("overrides", nargs="*", help="bench.run overrides (model.arch=llama ...)")
    a = ap.parse_intermixed_args()
    study(
        a.model,
        [int(x) for x in a.stages.split(",")],
        [int(x) for x in a.micro_batches.split(",")],
        a.k,
        a.schedule,
        a.overrides,
    )


if __name__ == "__main__":
    main()
