"""The paper's evaluation figures, one command each: PNG + PDF with the data as CSV beside them.

    python -m bench.figures main            # or: homogeneous allgather_skew synthesis_time
    python -m bench.figures all             #     ablation sim_accuracy

Simulated figures run the runner's own planning and simulation (bench.run.prepare_case), so a
point is exactly what `python -m bench.run mode=sim ...` would record for that case. Measured
figures (allgather_skew's gloo half, sim_accuracy) come from real runs on this host.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402  (after the backend choice)
import pandas as pd  # noqa: E402

from bench.cluster import ClusterSpec  # noqa: E402
from bench.cost import collective_linear_cost  # noqa: E402
from bench.run import (  # noqa: E402
    CONF_DIR,
    compose_config,
    fill_predicted_metrics,
    methods_supporting,
    new_record,
    prepare_case,
)

FIGURE_DIR = CONF_DIR.parent / "results" / "figures"
MODELS = ("vgg19", "vit", "bert", "bert_moe")
KS = (1, 2, 4, 8)


def _cfg(*overrides: str):
    return compose_config("wandb.mode=disabled", *overrides)


def sim_methods() -> list[str]:
    return methods_supporting("sim")


def simulate_case(*overrides: str) -> dict:
    """One simulated case as the runner would record it (status ok, oom or failed)."""
    cfg = _cfg("mode=sim", *overrides)
    record = new_record(cfg)
    try:
        case = prepare_case(cfg, record)
        fill_predicted_metrics(record, case.workload)
    except Exception as exc:  # a case that cannot be planned is a point too, marked failed
        record.status, record.error = "failed", f"{type(exc).__name__}: {exc}"
    return {"model": record.model, "cluster": record.cluster, "method": record.method,
            "status": record.status, "samples_per_s": record.samples_per_s,
            "predicted_iter_time_s": record.predicted_iter_time_s,
            "planner_time_s": record.planner_time_s, "num_devices": record.num_devices,
            "peak_mem_gib": max(record.peak_mem_gib or [0]) or None, "error": record.error}


def _save(fig, data: pd.DataFrame, name: str, out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    data.to_csv(out / f"{name}.csv", index=False)
    fig.savefig(out / f"{name}.png", dpi=130, bbox_inches="tight")
    fig.savefig(out / f"{name}.pdf", bbox_inches="tight", metadata={"CreationDate": None})
    plt.close(fig)
    print(f"wrote {out / name}.{{png,pdf,csv}}")


def _throughput_grid(cluster: str, name: str, out: Path, models=MODELS, ks=KS,
                     preset: str = "paper") -> None:
    methods = sim_methods()
    rows = []
    for model in models:
        for k in ks:
            for method in methods:
                row = simulate_case(f"preset={preset}", f"cluster={cluster}", f"model={model}",
                                    f"method={method}", f"cluster.gpus_per_machine={k}")
                rows.append({**row, "k": k})
    data = pd.DataFrame(rows)
    fig, axes = plt.subplots(1, len(models), figsize=(4.2 * len(models), 3.6), squeeze=False)
    axes = axes[0]
    width = 0.8 / len(methods)
    for ax, model in zip(axes, models):
        sub = data[data.model == model]
        for i, method in enumerate(methods):
            part = sub[sub.method == method].set_index("k").reindex(ks)
            xs = [j + i * width for j in range(len(ks))]
            ax.bar(xs, part.samples_per_s.fillna(0), width, label=method)
            for x, status in zip(xs, part.status):
                if status != "ok":
                    ax.text(x, 0, "OOM" if status == "oom" else "x", rotation=90, ha="center",
                            va="bottom", fontsize=7)
        ax.set_xticks([j + 0.4 - width / 2 for j in range(len(ks))], [str(k) for k in ks])
        ax.set_title(model)
        ax.set_xlabel("GPUs per machine (k)")
    axes[0].set_ylabel("samples/s (simulated)")
    axes[-1].legend(fontsize=7)
    fig.suptitle(f"{cluster}: throughput per method, {preset} preset, weak scaling")
    _save(fig, data, name, out)


def fig_main(out: Path, **sweep) -> None:
    """Throughput of every method on paper_hetero for k in {1, 2, 4, 8}, OOM marked."""
    _throughput_grid("paper_hetero", "main", out, **sweep)


def fig_homogeneous(out: Path, **sweep) -> None:
    """The same on the homogeneous V100 cluster."""
    _throughput_grid("paper_homo", "homogeneous", out, **sweep)


def fig_allgather_skew(out: Path, ranks: int = 2, megabytes: float = 16.0) -> None:
    """Padded all-gather vs grouped broadcast by the first device's share: measured with gloo on
    this host, and simulated for 8 machines of paper_hetero."""
    from bench.profile import SKEW_SHARES, profile_collectives

    nbytes = int(megabytes * 2**20)
    measured = [r for r in profile_collectives(ranks, [nbytes], repeats=5)
                if r["kind"] == "all_gather" and r["size"] == nbytes]
    rows = [{"origin": f"measured (gloo, {ranks} ranks)", "impl": r["impl"],
             "first_share": r["first_share"] or 1 / ranks,
             "gb_per_s": nbytes / r["seconds"] / 1e9} for r in measured]
    spec = ClusterSpec.from_config(_container(_cfg("cluster=paper_hetero").cluster))
    n = spec.num_machines
    for first in [1 / n] + [s for s in SKEW_SHARES if s]:
        shares = [first] + [(1 - first) / (n - 1)] * (n - 1)
        per_device = [s * nbytes for s in shares]
        for impl in ("padded", "grouped"):
            alpha, beta, agg = collective_linear_cost("all_gather", impl, n, spec.inter_machine)
            seconds = alpha + beta * (max(per_device) if agg == "max" else sum(per_device))
            rows.append({"origin": f"simulated (paper_hetero, {n} machines)", "impl": impl,
                         "first_share": first, "gb_per_s": nbytes / seconds / 1e9})
    data = pd.DataFrame(rows).sort_values(["origin", "impl", "first_share"])
    fig, axes = plt.subplots(1, 2, figsize=(9, 3.4))
    for ax, (origin, sub) in zip(axes, data.groupby("origin")):
        for impl, part in sub.groupby("impl"):
            ax.plot(part.first_share, part.gb_per_s, marker="o", label=impl)
        ax.set_title(origin, fontsize=9)
        ax.set_xlabel("first device's share of the tensor")
        ax.legend()
    axes[0].set_ylabel(f"all-gather of {megabytes:g} MB: GB/s")
    _save(fig, data, "allgather_skew", out)


def fig_synthesis_time(out: Path) -> None:
    """Planner time of hap vs ViT depth (8 machines) and vs devices (BERT, one per GPU)."""
    rows = []
    for layers in (4, 8, 12, 24, 48):
        row = simulate_case("preset=paper", "cluster=paper_hetero", "model=vit", "method=hap",
                            f"+model.spec.num_layers={layers}", "method.cache_dir=null")
        rows.append({**row, "sweep": "vit layers", "x": layers})
    for k in KS:
        row = simulate_case("preset=paper", "cluster=paper_hetero", "model=bert", "method=hap",
                            f"cluster.gpus_per_machine={k}", "cluster.virtual_device=gpu",
                            "method.cache_dir=null")  # time the planning, not a cache hit
        rows.append({**row, "sweep": "bert devices", "x": 8 * k})
    data = pd.DataFrame(rows)
    fig, axes = plt.subplots(1, 2, figsize=(9, 3.4))
    for ax, (sweep, sub) in zip(axes, data.groupby("sweep", sort=False)):
        ax.plot(sub.x, sub.planner_time_s, marker="o")
        ax.set_xlabel(sweep)
        ax.set_ylabel("planner time (s)")
    _save(fig, data, "synthesis_time", out)


ABLATIONS = {
    "hap": [],
    "no SFB": ["method.sfb=false"],
    "no LP": ["method.lp=false"],
    "no collective choice": ["method.collective_choice=false"],
}


def fig_ablation(out: Path) -> None:
    """hap against itself with one part switched off, paper_hetero, k = 8."""
    rows = []
    for model in MODELS:
        for label, extra in ABLATIONS.items():
            row = simulate_case("preset=paper", "cluster=paper_hetero", f"model={model}",
                                "method=hap", *extra)
            rows.append({**row, "variant": label})
    data = pd.DataFrame(rows)
    fig, ax = plt.subplots(figsize=(8, 3.4))
    width = 0.8 / len(ABLATIONS)
    for i, label in enumerate(ABLATIONS):
        part = data[data.variant == label].set_index("model").reindex(MODELS)
        ax.bar([j + i * width for j in range(len(MODELS))], part.samples_per_s.fillna(0), width,
               label=label)
    ax.set_xticks([j + 0.4 - width / 2 for j in range(len(MODELS))], MODELS)
    ax.set_ylabel("samples/s (simulated)")
    ax.legend(fontsize=7)
    _save(fig, data, "ablation", out)


def fig_sim_accuracy(out: Path) -> None:
    """The latest calibration's errors (python -m bench.calibrate) as a box plot per method."""
    runs = sorted((CONF_DIR.parent / "results" / "calibration").glob("*.json"))
    if not runs:
        raise SystemExit("error: no calibration yet; run `python -m bench.calibrate` first")
    data = pd.DataFrame(json.loads(runs[-1].read_text())["cases"])
    fig, ax = plt.subplots(figsize=(6, 3.4))
    methods = sorted(data.method.unique())
    ax.boxplot([data[data.method == m].sim_error * 100 for m in methods], tick_labels=methods)
    ax.set_ylabel("|predicted - measured| / measured (%)")
    ax.set_title(f"simulator error, {len(data)} cases ({runs[-1].stem})", fontsize=9)
    _save(fig, data, "sim_accuracy", out)


def _container(node):
    from omegaconf import OmegaConf

    return OmegaConf.to_container(node, resolve=True)


FIGURES = {
    "main": fig_main,
    "homogeneous": fig_homogeneous,
    "allgather_skew": fig_allgather_skew,
    "synthesis_time": fig_synthesis_time,
    "ablation": fig_ablation,
    "sim_accuracy": fig_sim_accuracy,
}


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("names", nargs="+", help=f"figure names or 'all': {', '.join(FIGURES)}")
    parser.add_argument("--out", type=Path, default=FIGURE_DIR)
    args = parser.parse_args(argv)
    names = list(FIGURES) if args.names == ["all"] else args.names
    unknown = [n for n in names if n not in FIGURES]
    if unknown:
        print(f"error: figure {', '.join(unknown)} is unknown; known: {', '.join(FIGURES)}",
              file=sys.stderr)
        return 2
    for name in names:
        FIGURES[name](args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
