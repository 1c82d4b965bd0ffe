"""The planner's ablations, its beam against the exact search, and search-vs-simulator agreement.

The library behind `bench.planner_check` (usage there). Plans on paper_hetero with every part
of the planner on and with one switched off at a time (SFB, collective choice, LP, segments):
switching a part off must never make hap faster. Also the beam against the exact search
(times, states expanded, planning seconds) and the agreement of the search's price with the
simulator's.
"""

from __future__ import annotations

import time

from rich.console import Console
from rich.table import Table

from bench.core.cluster import ClusterSpec
from bench.runner.case import build_workload
from bench.runner.configs import compose_settings, instantiate_plugin

MODELS = ("vgg19", "vit", "bert", "bert_moe")


# variant -> method overrides: each switches one part of the planner off.
PARTS_OFF = {
    "no SFB": ["method.sfb=false"],
    "no collective choice": ["method.collective_choice=false"],
    "no LP": ["method.lp=false"],
    "1 segment": ["method.num_segments=1"],
}


TOLERANCE = 1e-9  # relative: a variant is "faster" only beyond float noise


def paper_planning(*overrides: str):
    """(planner, workload, cluster) of hap on paper_hetero at the paper preset, as bench.run
    builds them from conf/method/hap.yaml (plan cache off), before any planning."""
    cfg = compose_settings(
        "mode=sim",
        "preset=paper",
        "cluster=paper_hetero",
        "method=hap",
        "method.cache_dir=null",
        "wandb.mode=disabled",
        *overrides,
    )
    cluster = ClusterSpec.from_config(cfg.cluster)
    return instantiate_plugin(cfg.method, "method"), build_workload(cfg, cluster), cluster


def plan_case(model: str, k: int, *overrides: str) -> dict:
    """Plan one case on paper_hetero (plan cache off); its predicted time and planner stats."""
    planner, workload, cluster = paper_planning(f"cluster.gpus_per_machine={k}", f"model={model}", *overrides)
    start = time.perf_counter()
    plan = planner.plan(workload, cluster)
    d = plan.details
    return {
        "iter_time_s": d["predicted_iter_time_s"],
        "oom": d["oom"],
        "chosen": d["chosen"],
        "planned_s": time.perf_counter() - start,
        "expanded": d["states_expanded"],
        "exact": d["search_exact"],
        "beam_width": planner.beam_width,
        "rounds": d["rounds"],
    }


def search_agreement(rounds: list[dict]) -> dict:
    """Whether the search's price and the simulator rank the candidates a plan considered
    alike: every (program, ratios) the planner scored (a round's synthesized program and its
    data-parallel incumbent, each LP answer; over machines and GPUs, padded only too), each
    with the search's price of it (methods.hap.pricing.CostModel.program_cost) and its
    simulated time. Among those that fit in memory (all, if none fits): the simulated time of
    the candidate the search prices lowest over the best simulated time (`excess`, 0 when the
    two pick programs as fast), and how many rounds the search returned a synthesized program
    that the simulator ranked behind the round's data-parallel incumbent."""
    cands = [r for r in rounds if r.get("search_cost_s") is not None and r.get("iter_time_s") is not None]
    pool = [r for r in cands if not r["oom"]] or cands
    by_search = min(pool, key=lambda r: r["search_cost_s"])
    by_sim = min(pool, key=lambda r: r["iter_time_s"])
    rounds_synth = {}
    for r in cands:
        if r["stage"] in ("synthesis", "data parallel"):
            rounds_synth.setdefault((r["start"], r["round"]), {})[r["stage"]] = r
    pairs = [p for p in rounds_synth.values() if len(p) == 2]
    behind = sum(p["synthesis"]["iter_time_s"] > p["data parallel"]["iter_time_s"] * (1 + TOLERANCE) for p in pairs)
    return {
        "candidates": len(pool),
        "search_pick": by_search,
        "sim_pick": by_sim,
        "excess": by_search["iter_time_s"] / by_sim["iter_time_s"] - 1,
        "synthesis_rounds": len(pairs),
        "synthesis_behind_dp": behind,
    }


def agreement_table(models, ks, overrides, console: Console) -> list[dict]:
    """search_agreement per (model, k) on paper_hetero, printed."""
    table = Table(title="the search's price vs the simulator: which candidate each ranks first (paper_hetero)")
    for col in (
        "model",
        "k",
        "candidates",
        "search's pick: search ms / sim ms",
        "simulator's pick: search ms / sim ms",
        "agree",
        "excess",
        "rounds: synthesis behind DP",
    ):
        table.add_column(col, justify="left" if col == "model" else "right")
    rows = []
    for model in models:
        for k in ks:
            case = plan_case(model, k, *overrides)
            a = search_agreement(case["rounds"])
            rows.append({"model": model, "k": k, **a, "iter_time_s": case["iter_time_s"]})

            def cell(r):
                return f"{r['search_cost_s'] * 1e3:.1f} / {r['iter_time_s'] * 1e3:.1f}"

            agree = a["excess"] <= TOLERANCE
            table.add_row(
                model,
                str(k),
                str(a["candidates"]),
                cell(a["search_pick"]),
                cell(a["sim_pick"]),
                "yes" if agree else "no",
                f"{a['excess']:+.2%}",
                f"{a['synthesis_behind_dp']} of {a['synthesis_rounds']}",
            )
    console.print(table)
    return rows


def monotonicity(models, ks, overrides) -> list[dict]:
    """One row per (model, k): hap's time and each variant's, and which variants beat hap."""
    rows = []
    for model in models:
        for k in ks:
            full = plan_case(model, k, *overrides)
            row = {"model": model, "k": k, "hap": full, "variants": {}, "faster": []}
            for name, extra in PARTS_OFF.items():
                v = plan_case(model, k, *overrides, *extra)
                row["variants"][name] = v
                if _better(v, full):
                    row["faster"].append(name)
            rows.append(row)
    return rows


def _better(a: dict, b: dict) -> bool:
    """a beats b as the planner ranks plans: fitting in memory first, then time."""
    if a["oom"] != b["oom"]:
        return not a["oom"]
    return a["iter_time_s"] < b["iter_time_s"] * (1 - TOLERANCE)


def _ms(r: dict) -> str:
    return f"{r['iter_time_s'] * 1e3:.1f}" + (" OOM" if r["oom"] else "")


def print_monotonicity(rows: list[dict], console: Console) -> None:
    table = Table(title="hap with one part switched off (simulated ms per iteration, paper_hetero)")
    for col in ("model", "k", "hap", *PARTS_OFF, "hap chose", "planner s"):
        table.add_column(col, justify="left" if col in ("model", "hap chose") else "right")
    for row in rows:
        cells = []
        for name, v in row["variants"].items():
            delta = v["iter_time_s"] / row["hap"]["iter_time_s"] - 1
            mark = " FASTER" if name in row["faster"] else ""
            cells.append(f"{_ms(v)} ({delta:+.1%}){mark}")
        table.add_row(
            row["model"], str(row["k"]), _ms(row["hap"]), *cells, row["hap"]["chosen"], f"{row['hap']['planned_s']:.1f}"
        )
    console.print(table)
    bad = [f"{r['model']}/k={r['k']}: {', '.join(r['faster'])}" for r in rows if r["faster"]]
    console.print("every part pays its way" if not bad else f"a part switched off beat hap: {'; '.join(bad)}")


def beam_vs_exact(models, ks, overrides, console: Console) -> list[dict]:
    table = Table()
    for col in (
        "model",
        "k",
        "beam ms",
        "exact ms",
        "difference",
        "beam states",
        "exact states",
        "beam s",
        "exact s",
        "beam bit",
    ):
        table.add_column(col, justify="left" if col == "model" else "right")
    rows = []
    for model in models:
        for k in ks:
            beam = plan_case(model, k, *overrides)
            exact = plan_case(model, k, *overrides, "method.beam_width=null")
            rows.append({"model": model, "k": k, "beam": beam, "exact": exact})
            table.add_row(
                model,
                str(k),
                _ms(beam),
                _ms(exact),
                f"{beam['iter_time_s'] / exact['iter_time_s'] - 1:+.2%}",
                str(beam["expanded"]),
                str(exact["expanded"]),
                f"{beam['planned_s']:.1f}",
                f"{exact['planned_s']:.1f}",
                "no" if beam["exact"] else "yes",
            )
    width = rows[0]["beam"]["beam_width"] if rows else None
    table.title = f"beam (method.beam_width={width}) vs exact A* (beam_width=null)"
    console.print(table)
    return rows
