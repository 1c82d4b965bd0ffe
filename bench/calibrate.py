"""How far to trust the simulator: measured vs predicted iteration time on emulated clusters.

    python -m bench.calibrate                                    # 4 tiny models x methods x 3 clusters
    python -m bench.calibrate --models bert --clusters local_hetero2 -- measured_iters=10

Every real case also records the simulator's prediction for the same plan, so one real run per
case gives both numbers. Reports each case's error, the MAPE (overall and per method) and, per
(model, cluster), Kendall's tau between the measured and the predicted ordering of the methods.
"""

from __future__ import annotations

import argparse
import itertools
import json
import statistics
import sys
from datetime import datetime, timezone
from pathlib import Path

from rich.console import Console
from rich.table import Table

from bench.run import CONF_DIR, compose_config, methods_supporting, run_case

MODELS = ("vgg19", "vit", "bert", "bert_moe")
CLUSTERS = ("local_hetero2", "local_hetero4", "local_homo2")


def kendall_tau(a: list[float], b: list[float]) -> float | None:
    """Kendall's tau-a of two orderings of the same items (1: same order, -1: reversed)."""
    pairs = list(itertools.combinations(range(len(a)), 2))
    if not pairs:
        return None
    score = sum((a[i] - a[j]) * (b[i] - b[j]) > 0 for i, j in pairs) - sum(
        (a[i] - a[j]) * (b[i] - b[j]) < 0 for i, j in pairs)
    return score / len(pairs)


def summarize(rows: list[dict]) -> dict:
    """Per-case errors, MAPE overall and per method, tau per (model, cluster)."""
    cases = [r for r in rows if r.get("status") == "ok" and r.get("predicted_iter_time_s")]
    for r in cases:
        r["sim_error"] = abs(r["predicted_iter_time_s"] - r["iter_time_s_mean"]) / r["iter_time_s_mean"]
    methods = sorted({r["method"] for r in cases})
    by_method = {m: statistics.fmean(r["sim_error"] for r in cases if r["method"] == m) for m in methods}
    taus = {}
    for model, cluster in sorted({(r["model"], r["cluster"]) for r in cases}):
        group = [r for r in cases if (r["model"], r["cluster"]) == (model, cluster)]
        taus[f"{model}/{cluster}"] = kendall_tau([r["iter_time_s_mean"] for r in group],
                                                 [r["predicted_iter_time_s"] for r in group])
    return {
        "cases": [{k: r[k] for k in ("model", "cluster", "method", "iter_time_s_mean",
                                     "predicted_iter_time_s", "sim_error")} for r in cases],
        "mape": statistics.fmean(r["sim_error"] for r in cases) if cases else None,
        "mape_by_method": by_method,
        "kendall_tau": taus,
        "failed": [f"{r['model']}/{r['cluster']}/{r['method']}: {r.get('error')}"
                   for r in rows if r.get("status") != "ok"],
    }


def print_summary(summary: dict) -> None:
    console = Console(width=140)
    table = Table(title="simulator vs measurement (emulated clusters)")
    for col in ("model", "cluster", "method", "measured ms", "predicted ms", "error"):
        table.add_column(col, justify="left" if col in ("model", "cluster", "method") else "right")
    for c in summary["cases"]:
        table.add_row(c["model"], c["cluster"], c["method"], f"{c['iter_time_s_mean'] * 1e3:.1f}",
                      f"{c['predicted_iter_time_s'] * 1e3:.1f}", f"{c['sim_error']:.0%}")
    console.print(table)
    taus = Table(title="ordering of methods: Kendall tau (measured vs predicted)")
    taus.add_column("model/cluster")
    taus.add_column("tau", justify="right")
    for key, tau in summary["kendall_tau"].items():
        taus.add_row(key, "-" if tau is None else f"{tau:+.2f}")
    console.print(taus)
    if summary["mape"] is not None:
        per = ", ".join(f"{m} {e:.0%}" for m, e in summary["mape_by_method"].items())
        console.print(f"MAPE {summary['mape']:.1%} over {len(summary['cases'])} cases ({per})")
    for line in summary["failed"]:
        console.print(f"failed: {line}")


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default=",".join(MODELS))
    parser.add_argument("--clusters", default=",".join(CLUSTERS))
    parser.add_argument("--methods", default=None, help="default: every method that runs for real")
    parser.add_argument("--out", type=Path, default=None, help="summary JSON (default results/calibration/)")
    parser.add_argument("overrides", nargs="*", help="runner overrides, e.g. measured_iters=10")
    args = parser.parse_args(argv)
    methods = args.methods.split(",") if args.methods else methods_supporting("real")
    configs = [compose_config("wandb.mode=disabled", *args.overrides, f"model={m}", f"cluster={c}",
                              f"method={meth}")
               for m in args.models.split(",") for c in args.clusters.split(",") for meth in methods]
    rows = [vars(run_case(c)) for c in configs]
    summary = summarize(rows)
    print_summary(summary)
    out = args.out or (CONF_DIR.parent / "results" / "calibration" /
                       f"{datetime.now(timezone.utc):%Y%m%d-%H%M%S}.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(summary, indent=1) + "\n")
    print(f"wrote {out}")
    return 0 if not summary["failed"] else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
