"""The paper's evaluation figures: one function each (FIGURES) that draws a PNG and a PDF and
writes the data it plots as CSV beside them; `python -m bench.figures` is their command.

Simulated points are cases the runner prepares itself (bench.runner.case.prepare_case): a point is
what `python -m bench.run mode=sim ...` records for that case, and an experiment figure's rows are
its experiment's sweep (cp_vs_ev's: conf/experiment/cp_vs_ev.yaml, whose method the runner
instantiates like any other). Measured points are real runs on this host. It draws; the tables of
rows are bench.records'.
"""

from __future__ import annotations

import gzip
import itertools
import json
import tempfile
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt
import pandas as pd
from matplotlib import ticker

from bench.core.cluster import ClusterSpec
from bench.core.paths import PROJECT_DIR
from bench.cost import collective_linear_cost, simulate
from bench.records.drawing import layout, read_rows, report
from bench.records.progress import track
from bench.runner.case import new_record, prepare_case
from bench.runner.configs import compose_settings, experiment_sweep, methods_supporting
from bench.runner.execute import fill_predicted_metrics, run_case
from bench.runner.sweep import sweep_axes

FIGURE_DIR = PROJECT_DIR / "results" / "figures"


KS = (1, 2, 4, 8)


def _cfg(*overrides: str):
    return compose_settings("wandb.mode=disabled", *overrides)


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
    # As write_record does before a row is written: the simulator predicts an iteration time for
    # an OOM case too, and the rates filled from it are no throughput of a case that cannot run.
    record.__post_init__()
    return {
        "model": record.model,
        "cluster": record.cluster,
        "method": record.method,
        "status": record.status,
        "samples_per_s": record.samples_per_s,
        "predicted_iter_time_s": record.predicted_iter_time_s,
        "planner_time_s": record.planner_time_s,
        "num_devices": record.num_devices,
        "peak_mem_gib": max(record.peak_mem_gib or [0]) or None,
        "error": record.error,
        # the iteration simulated; the planner's time measured where it planned
        "origin": f"{record.origin}, planner time measured",
        "hardware": record.hardware,
        "git_sha": (record.git_sha or "")[:10],
        "git_dirty": record.git_dirty,
    }


def _save(fig, data: pd.DataFrame, name: str, out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    data.to_csv(out / f"{name}.csv", index=False)
    fig.savefig(out / f"{name}.png", dpi=130, bbox_inches="tight")
    fig.savefig(out / f"{name}.pdf", bbox_inches="tight", metadata={"CreationDate": None})
    plt.close(fig)
    print(f"wrote {out / name}.{{png,pdf,csv}}")


def sweep_points(experiment: str, *overrides: str) -> list[list[str]]:
    """The cases of an experiment's sweep (its hydra.sweeper.params, expanded as Hydra's basic
    sweeper does); an override of a swept key replaces its values, others go to every case."""
    params = experiment_sweep(experiment)
    fixed = []
    for item in overrides:
        key, _, value = item.partition("=")
        if key in params:
            params[key] = value
        else:
            fixed.append(item)
    return [[f"experiment={experiment}", *point, *fixed] for point in itertools.product(*sweep_axes(params))]


def experiment_figure(experiment: str, out: Path, *overrides: str) -> None:
    """Run an experiment's sweep (as `bench.run -m experiment=...` would) into
    OUT/NAME/records.jsonl.gz, replacing the rows of an earlier figure run, then draw it with
    `bench.report` from those rows alone."""
    points = sweep_points(experiment, *overrides)
    name = compose_settings(*points[0]).report["name"]
    records = out / name
    with tempfile.TemporaryDirectory() as tmp:
        for point in track(points, f"figure {name}"):
            run_case(compose_settings(*point, f"results_dir={tmp}"))
        records.mkdir(parents=True, exist_ok=True)
        # Committed with the figure, so gzipped (the rows carry whole plans); mtime 0: the same
        # rows give the same bytes.
        (records / "records.jsonl.gz").write_bytes(gzip.compress((Path(tmp) / "records.jsonl").read_bytes(), mtime=0))
        (records / "records.jsonl").unlink(missing_ok=True)
    rows = read_rows(records)
    spec = layout(rows)
    report(rows, out, name, spec["x"], spec["metric"], spec.get("title"))


def fig_main(out: Path, *overrides: str) -> None:
    """Throughput of every method on paper_hetero for k in {1, 2, 4, 8}, OOM marked
    (conf/experiment/fig_main.yaml)."""
    experiment_figure("fig_main", out, *overrides)


def fig_homogeneous(out: Path, *overrides: str) -> None:
    """The same on the homogeneous V100 cluster (conf/experiment/fig_homogeneous.yaml)."""
    experiment_figure("fig_homogeneous", out, *overrides)


def fig_allgather_skew(out: Path, ranks: int = 2, megabytes: float = 16.0) -> None:
    """Padded all-gather vs grouped broadcast by the first device's share: measured with gloo on
    this host, and simulated for 8 machines of paper_hetero."""
    from bench.runtime.probes import SKEW_SHARES, profile_collectives

    nbytes = int(megabytes * 2**20)
    measured = [
        r for r in profile_collectives(ranks, [nbytes], repeats=5) if r["kind"] == "all_gather" and r["size"] == nbytes
    ]
    rows = [
        {
            "origin": f"measured (gloo, {ranks} ranks)",
            "impl": r["impl"],
            "first_share": r["first_share"] or 1 / ranks,
            "gb_per_s": nbytes / r["seconds"] / 1e9,
        }
        for r in measured
    ]
    spec = ClusterSpec.from_config(_cfg("cluster=paper_hetero").cluster)
    n = spec.num_machines
    for first in [1 / n] + [s for s in SKEW_SHARES if s]:
        shares = [first] + [(1 - first) / (n - 1)] * (n - 1)
        per_device = [s * nbytes for s in shares]
        for impl in ("padded", "grouped"):
            alpha, beta, agg = collective_linear_cost("all_gather", impl, n, spec.inter_machine)
            seconds = alpha + beta * (max(per_device) if agg == "max" else sum(per_device))
            rows.append(
                {
                    "origin": f"simulated (paper_hetero, {n} machines)",
                    "impl": impl,
                    "first_share": first,
                    "gb_per_s": nbytes / seconds / 1e9,
                }
            )
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


def fig_synthesis_time(out: Path, repeats: int = 3) -> None:
    """Planner time of hap vs ViT depth (8 machines) and vs devices (BERT, one per GPU): every
    point planned `repeats` times, in rounds over the whole sweep (a slow spell of the machine
    then touches every point alike); the median drawn with the range. One row per plan."""
    points = [
        ("vit layers", layers, ("model=vit", f"+model.spec.num_layers={layers}")) for layers in (4, 8, 12, 24, 48)
    ]
    points += [
        ("bert devices", 8 * k, ("model=bert", f"cluster.gpus_per_machine={k}", "cluster.virtual_device=gpu"))
        for k in KS
    ]
    rows = []
    for r in range(repeats):
        for sweep, x, overrides in points:
            row = simulate_case(
                "preset=paper", "cluster=paper_hetero", "method=hap", *overrides, "method.cache_dir=null"
            )  # time the planning, not a cache hit
            rows.append({**row, "sweep": sweep, "x": x, "repeat": r})
    data = pd.DataFrame(rows)
    fig, axes = plt.subplots(1, 2, figsize=(9, 3.4))
    for ax, (sweep, sub) in zip(axes, data.groupby("sweep", sort=False)):
        t = sub.groupby("x").planner_time_s.agg(["median", "min", "max"])
        ax.errorbar(t.index, t["median"], yerr=[t["median"] - t["min"], t["max"] - t["median"]], marker="o", capsize=3)
        ax.set_xlabel(sweep)
        ax.set_ylabel(f"planner time (s): median, range of {repeats}")
        ax.set_ylim(bottom=0)  # from zero: a second's jitter must not read as growth
    _save(fig, data, "synthesis_time", out)


def fig_ablation(out: Path, *overrides: str) -> None:
    """hap against itself with one part switched off, paper_hetero, k = 8, OOM marked
    (conf/experiment/fig_ablation.yaml, the parts in conf/ablation/)."""
    experiment_figure("fig_ablation", out, *overrides)


def fig_sim_accuracy(out: Path) -> None:
    """The simulator's errors (python -m bench.calibrate) as a box plot per method: one panel
    for the newest calibration of each set of clusters, for the two sets calibrated last (the
    GPU-level `local_hetero2/4` and the machine-level `local_2x2/local_3m`: one calibration of
    either would otherwise hide the other's)."""
    runs = {}  # emulated-cluster calibrations (a --device one has rows, not cases)
    for path in (PROJECT_DIR / "results" / "calibration").glob("*.json"):
        body = json.loads(path.read_text())
        if body.get("cases"):
            runs[path] = body
    if not runs:
        raise SystemExit("error: no calibration yet; run `python -m bench.calibrate` first")
    newest: dict[tuple, Path] = {}  # set of clusters -> its newest file
    # By the time each was written (files before that field: by name, and older).
    for path in sorted(runs, key=lambda p: (runs[p].get("written_at", ""), p.name)):
        newest[tuple(sorted({c["cluster"] for c in runs[path]["cases"]}))] = path
    shown = sorted(newest.values(), key=lambda p: (runs[p].get("written_at", ""), p.name))[-2:][::-1]
    fig, axes = plt.subplots(1, len(shown), figsize=(6 * len(shown), 3.4), squeeze=False)
    parts = [pd.DataFrame(runs[p]["cases"]).assign(calibration=p.stem) for p in shown]
    for ax, path, part in zip(axes[0], shown, parts):
        methods = sorted(part.method.unique())
        ax.boxplot([part[part.method == m].sim_error * 100 for m in methods], tick_labels=methods)
        ax.set_ylabel("|predicted - measured| / measured (%)")
        clusters = ", ".join(sorted(part.cluster.unique()))
        ax.set_title(f"{clusters}: {len(part)} cases ({path.stem})", fontsize=9)
    _save(fig, pd.concat(parts, ignore_index=True), "sim_accuracy", out)


# The seed's Fig. 2 setting: a tensor-parallel transformer whose hidden size sets the ratio of
# computation to communication. Simulated: BERT-shaped blocks (head size 64, d_ff = 4 d,
# sequence 128) on `motivation`. Measured: tiny ones (sequence 64, 8 samples, to stay within
# two minutes) on local_hetero2, with head size 4 so that heads split close to the ratios (shards
# are whole heads) and a larger vocabulary, whose logits all-gather gives the ratios something
# to move at small sizes.
CP_VS_EV_SIM = {
    "cluster": "motivation",
    "preset": "paper",
    "num_layers": 4,
    "vocab_size": 1024,
    "global_batch": 32,
    "head_dim": 64,
}


CP_VS_EV_REAL = {
    "cluster": "local_hetero2",
    "preset": "tiny",
    "num_layers": 2,
    "vocab_size": 4096,
    "global_batch": 8,
    "head_dim": 4,
}


def tp_points(setting: dict, d_model: int, mode: str) -> list[list[str]]:
    """The overrides of one hidden size's cases of conf/experiment/cp_vs_ev.yaml, one per ratio
    choice (EV, CP, LP: the experiment's sweep)."""
    return sweep_points(
        "cp_vs_ev",
        f"mode={mode}",
        f"preset={setting['preset']}",
        f"cluster={setting['cluster']}",
        f"global_batch={setting['global_batch']}",
        f"+model.spec.d_model={d_model}",
        f"+model.spec.num_heads={max(1, d_model // setting['head_dim'])}",
        f"+model.spec.d_ff={4 * d_model}",
        f"+model.spec.num_layers={setting['num_layers']}",
        f"+model.spec.vocab_size={setting['vocab_size']}",
    )


def fig_cp_vs_ev(
    out: Path,
    sim_dims=(128, 256, 384, 512, 768, 1024, 2048, 4096, 8192),
    real_dims=(16, 64, 128, 256, 512),
    warmup_iters: int = 2,
    measured_iters: int = 10,
) -> None:
    """The seed's Fig. 2: a tensor-parallel transformer with its hidden size swept, at even (EV),
    compute-proportional (CP) and the LP's (LP) sharding ratios; simulated on `motivation` and
    measured on local_hetero2 (emulated, gloo).

    Every point is a case of conf/experiment/cp_vs_ev.yaml, whose method
    (methods.hap.tensor_parallel.TensorParallel) the runner instantiates, plans and runs like any
    other. Every device sees the whole batch and every weight matrix is sharded
    (methods.hap.theory.tensor_parallel_theory); collectives are padded. EV and CP each run the
    program the search finds best at their ratios; LP alternates synthesis and LP from both.
    The search picks Megatron's layout: column- then row-parallel
    linears, heads split, an all-reduce after each row-parallel linear, and padded all-gathers of
    the embedding output and of the logits. An all-reduce moves the full tensor whatever the
    ratios, so the traffic the ratios change is those all-gathers (their reduce-scatters in
    backward) and the input tokens; the compute is what CP balances. Small hidden sizes:
    communication dominates and EV wins; large ones: CP. Where they cross depends on the depth and
    the vocabulary (4 layers and 1024 words simulated). On these two-speed clusters the LP's
    optimum is always one of the two: each stage costs a max over devices of terms linear in the
    ratios, and between EV and CP the device with the largest shard and the slowest device stay
    the same, so the cost is linear along that segment. LP = the better of EV and CP; the "sweet
    spot" is the switch, not a third ratio.

    Measured points: `warmup_iters` + `measured_iters` iterations each, so expect the noise of
    short runs on a shared machine (10-20% on a 2-core VM). A plan identical to one already run
    (LP with EV's or CP's ratios and program: the same plan hash) reuses its measurement (column
    measured_run_of). predicted_iter_time_s is the simulator's figure for the plan at the host
    speed it was planned with.
    """
    from bench.runner.execute import measure_case

    rows = []
    for origin, setting, dims in (("simulated", CP_VS_EV_SIM, sim_dims), ("measured", CP_VS_EV_REAL, real_dims)):
        mode = "sim" if origin == "simulated" else "real"
        for d in dims:
            runs: dict[str, tuple] = {}  # plan hash -> (ratio choice, mean, std) of each plan run so far
            for point in tp_points(setting, d, mode):
                cfg = _cfg(*point, f"warmup_iters={warmup_iters}", f"measured_iters={measured_iters}")
                record = new_record(cfg)
                case = prepare_case(cfg, record, launching=mode == "real")
                choice, plan, workload = cfg.method["ratios"], case.plan, case.workload
                sim = simulate(plan.program, case.cluster, plan.ratios)
                mean, std, run_of = sim.iter_time_s, None, None
                if mode == "real":
                    if record.plan_hash not in runs:
                        measure_case(cfg, record, case)
                        runs[record.plan_hash] = (choice, record.iter_time_s_mean, record.iter_time_s_std)
                    run_of, mean, std = runs[record.plan_hash]
                rows.append(
                    {
                        "origin": origin,
                        "cluster": case.cluster.name,
                        "d_model": d,
                        "num_heads": workload.model_cfg.num_heads,
                        "num_layers": setting["num_layers"],
                        "global_batch": workload.global_batch,
                        "ratios": choice,
                        "ratio_values": " ".join(f"{r:.4f}" for r in plan.ratios[0]),
                        "iter_time_s": mean,
                        "iter_time_std_s": std,
                        "samples_per_s": workload.global_batch / mean,
                        "predicted_iter_time_s": sim.iter_time_s,
                        "predicted_comm_s": sim.comm_time_s,
                        "predicted_compute_s": sim.compute_time_s,
                        "oom": sim.oom,
                        "measured_run_of": run_of,
                    }
                )
    data = pd.DataFrame(rows)
    fig, axes = plt.subplots(2, 2, figsize=(9, 6), sharex="col")
    for col, origin in enumerate(("simulated", "measured")):
        sub = data[data.origin == origin]
        if sub.empty:
            continue
        ev = sub[sub.ratios == "EV"].set_index("d_model").samples_per_s
        for choice, style in zip(("EV", "CP", "LP"), ("o-", "s--", "^:")):
            part = sub[sub.ratios == choice].set_index("d_model")
            axes[0, col].plot(part.index, part.samples_per_s, style, label=choice)
            axes[1, col].plot(part.index, part.samples_per_s / ev.reindex(part.index), style, label=choice)
            for d, oom in part.oom.items():
                if oom:
                    axes[0, col].annotate("OOM", (d, part.samples_per_s[d]), fontsize=7)
        axes[0, col].set_title(f"{origin}: {sub.cluster.iloc[0]}", fontsize=9)
        axes[0, col].set_xscale("log", base=2)
        axes[0, col].set_yscale("log")
        axes[0, col].yaxis.set_major_locator(ticker.LogLocator(subs=(1, 2, 3, 5)))
        axes[0, col].yaxis.set_major_formatter(ticker.ScalarFormatter())
        axes[0, col].yaxis.set_minor_formatter(ticker.NullFormatter())
        dims = sorted(sub.d_model.unique())
        axes[1, col].set_xticks(dims, [str(d) for d in dims], rotation=45, fontsize=7)
        axes[1, col].xaxis.set_minor_locator(ticker.NullLocator())
        axes[1, col].set_xlabel("hidden size (d_model)")
        axes[1, col].axhline(1.0, color="grey", linewidth=0.5)
        axes[0, col].legend(fontsize=7)
    axes[0, 0].set_ylabel("samples/s")
    axes[1, 0].set_ylabel("throughput / EV's")
    fig.suptitle("tensor-parallel transformer: even (EV), compute-proportional (CP) and LP ratios", fontsize=10)
    _save(fig, data, "cp_vs_ev", out)


FIGURES = {
    "main": fig_main,
    "homogeneous": fig_homogeneous,
    "allgather_skew": fig_allgather_skew,
    "synthesis_time": fig_synthesis_time,
    "ablation": fig_ablation,
    "sim_accuracy": fig_sim_accuracy,
    "cp_vs_ev": fig_cp_vs_ev,
}


EXPERIMENT_FIGURES = ("main", "homogeneous", "ablation")  # drawn by bench.report from an experiment's sweep
