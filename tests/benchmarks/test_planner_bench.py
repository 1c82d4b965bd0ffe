"""Planner time (methods.hap.planner) at paper size on paper_hetero: a report, not a timed test.

    pytest tests/benchmarks/test_planner_bench.py --benchmark-only        # pytest-benchmark
    python tests/benchmarks/test_planner_bench.py [case ...]              # a plain table

Cases: BERT / ViT / VGG19 / BERT-MoE (paper preset: 64 samples per GPU, 32 for BERT-MoE) on the 8 machines of
paper_hetero (8 GPUs each, one virtual device per machine), ViT at 12 / 24 / 48 layers
(planner time should grow no worse than linearly), and BERT over 64 virtual devices (one per
GPU). The plan cache is off, so every round plans from scratch.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

# name -> Hydra overrides (as for bench.run); issue 12's goals in the comments.
CASES: dict[str, list[str]] = {
    "bert_8m": ["model=bert"],  # <= 3 s
    "vit12_8m": ["model=vit"],
    "vit24_8m": ["model=vit", "+model.spec.num_layers=24"],
    "vit48_8m": ["model=vit", "+model.spec.num_layers=48"],  # <= 4x vit12_8m
    "vgg19_8m": ["model=vgg19"],
    "bert_moe_8m": ["model=bert_moe"],  # <= 5 s
    "bert_64gpu": ["model=bert", "cluster.virtual_device=gpu"],  # <= 30 s
    # paper_hetero scaled to 32 and 128 machines (256 and 1,024 GPUs): <= 10 s, no worse than linear
    "bert_32m": ["model=bert", "cluster.machines.0.count=8", "cluster.machines.1.count=24"],
    "bert_128m": ["model=bert", "cluster.machines.0.count=32", "cluster.machines.1.count=96"],
}


def prepare(case: str):
    """(planner, workload, cluster) of one case, everything but the planning itself: the
    planner is conf/method/hap.yaml's as bench.run builds it (segments, beam and all)."""
    from bench.studies.planner_quality import paper_planning

    return paper_planning(*CASES[case])


@pytest.mark.parametrize("case", list(CASES))
def test_planner_time(benchmark, case):
    planner, workload, cluster = prepare(case)
    plan = benchmark.pedantic(planner.plan, args=(workload, cluster), rounds=1, iterations=1)
    d = plan.details
    benchmark.extra_info.update(
        {
            "predicted_iter_time_s": d["predicted_iter_time_s"],
            "states_expanded": d["states_expanded"],
            "search_exact": d["search_exact"],
            "capture_time_s": d["capture_time_s"],
            "search_time_s": d["search_time_s"],
        }
    )
    assert plan.program is not None


def main(cases: list[str]) -> None:
    from bench.cost import virtual_devices

    print(
        f"{'case':<13} {'devices':>7} {'plan_s':>7} {'capture_s':>9} {'search_s':>8} {'lp_s':>6} "
        f"{'expanded':>9} {'exact':>5} {'pred_iter_s':>11} {'oom':>4}  chosen"
    )
    for case in cases:
        planner, workload, cluster = prepare(case)
        t0 = time.perf_counter()
        plan = planner.plan(workload, cluster)
        elapsed = time.perf_counter() - t0
        d = plan.details
        devices = len(virtual_devices(cluster, cluster.virtual_device))
        print(
            f"{case:<13} {devices:>7} {elapsed:>7.2f} {d['capture_time_s']:>9.2f} {d['search_time_s']:>8.2f} "
            f"{d['lp_time_s']:>6.2f} {d['states_expanded']:>9} {d['search_exact']!s:>5} "
            f"{d['predicted_iter_time_s']:>11.4f} {d['oom']!s:>4}  {d['chosen']}",
            flush=True,
        )


if __name__ == "__main__":
    unknown = [c for c in sys.argv[1:] if c not in CASES]
    if unknown:
        sys.exit(f"unknown case(s) {unknown}; known: {', '.join(CASES)}")
    main(sys.argv[1:] or list(CASES))
