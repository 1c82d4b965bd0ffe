"""The calibration's cases and summaries: measured against predicted iteration times.

The library behind `bench.calibrate` (its docstring has the usage): the emulated cases (each
real case also records the simulator's prediction for its plan), the one-device step sweep
against a device type's compute profile, the re-pricing of recorded steps, and the summaries:
each case's error, MAPE overall and per method, and per (model, cluster) Kendall's tau over
the pairs the measured intervals separate and over all pairs.
"""

from __future__ import annotations

import itertools
import statistics
from pathlib import Path

from rich.console import Console
from rich.table import Table

from bench.core.cluster import ClusterSpec
from bench.core.device_types import device_types
from bench.core.errors import ConfigError
from bench.cost import host_time, simulate, virtual_devices
from bench.records.stats import Summary
from bench.runner.case import build_workload
from bench.runner.configs import compose_settings, instantiate_plugin
from bench.runtime.emulation import emulated_compute_s
from bench.runtime.hostspeed import device_step, host_probe

MODELS = ("vgg19", "vit", "bert", "bert_moe")


CLUSTERS = ("local_hetero2", "local_hetero4", "local_homo2")


def kendall_tau(a: list[float], b: list[float], separated=None) -> float | None:
    """Kendall's tau-a of two orderings of the same items (1: same order, -1: reversed), over
    all pairs or those `separated(i, j)` says the measurement tells apart. A tie in `b` on such
    a pair counts as no agreement: tau 1 needs every separated pair ordered the same way."""
    pairs = [(i, j) for i, j in itertools.combinations(range(len(a)), 2) if separated is None or separated(i, j)]
    if not pairs:
        return None
    score = sum((a[i] - a[j]) * (b[i] - b[j]) > 0 for i, j in pairs) - sum(
        (a[i] - a[j]) * (b[i] - b[j]) < 0 for i, j in pairs
    )
    return score / len(pairs)


def _repeats_interval(row: dict) -> Summary | None:
    """The interval of a case's median over its repeats (an aggregate row of bench.compare's
    rounds); None for one run: iterations of one run do not show how runs differ (their
    intervals separated hap from sfb running the same program)."""
    agg = (row.get("aggregate") or {}).get("iter_time_s")
    return Summary(**agg) if agg else None


def memory_error(row: dict) -> float | None:
    """The mean over a row's ranks of |predicted - measured| / measured peak tensor memory: each
    CPU rank's peak of live tensor bytes (`tensor_peak_gib`) against the simulator's peak for its
    device (`predicted_peak_mem_gib`). None where the row has no such measurement, or where its
    devices are not one rank each (a machine planned as one device)."""
    measured, predicted = row.get("tensor_peak_gib"), row.get("predicted_peak_mem_gib")
    if not measured or not predicted or len(measured) != len(predicted) or not all(measured):
        return None
    return statistics.fmean(abs(p - m) / m for p, m in zip(predicted, measured))


def recorded_rows(paths: list[Path], models=None, clusters=None, methods=None) -> list[dict]:
    """The rows earlier real runs recorded (records.jsonl files, or folders holding one): per
    (model, cluster, method) the last `aggregate` row (repeated cases: bench.compare's or
    calibrate's rounds), else the last `case` row; optionally only the given models, clusters
    and methods. A calibration split over several runs is summarised from them."""
    from bench.records.rows import load_records

    last: dict[tuple, dict] = {}
    for path in paths:
        path = path / "records.jsonl" if path.is_dir() else path
        for r in load_records(path):
            if r.get("mode") != "real" or r.get("row_kind", "case") == "repeat":
                continue
            if (
                (models and r["model"] not in models)
                or (clusters and r["cluster"] not in clusters)
                or (methods and r["method"] not in methods)
            ):
                continue
            key = (r["model"], r["cluster"], r["method"])
            if key not in last or r.get("row_kind") == "aggregate" or last[key].get("row_kind") != "aggregate":
                last[key] = r
    return list(last.values())


def summarize(rows: list[dict]) -> dict:
    """Per-case errors, MAPE overall and per method, tau per (model, cluster)."""
    cases = [r for r in rows if r.get("status") == "ok" and r.get("predicted_iter_time_s")]
    for r in cases:
        r["sim_error"] = abs(r["predicted_iter_time_s"] - r["iter_time_s_mean"]) / r["iter_time_s_mean"]
        # Where the error is: compute (the slowest rank's, measured by its own worker) and the
        # rest of the iteration (communication not hidden behind compute, waits).
        # (an aggregate row of repeats carries the median of its runs' figure)
        r["compute_s"] = emulated_compute_s(r.get("emulation")) or (r.get("emulation") or {}).get("compute_s")
        # Part of the rest: how far the real collectives ran past the emulated links (bench.run)
        r["link_overrun_s"] = (r.get("emulation") or {}).get("link_overrun_s")
        r["memory_error"] = memory_error(r)
    planned = [
        abs(r["planned_iter_time_s"] - r["iter_time_s_mean"]) / r["iter_time_s_mean"]
        for r in cases
        if r.get("planned_iter_time_s")
    ]
    # The same predictions with their compute part swapped for the compute measured in the run:
    # what is left is the error of the rest (links, overlap, waits, the worker loop), whatever
    # the host's speed did between the ranks' yardstick and their reference. A diagnostic, not a
    # prediction: it reads the measured compute.
    outside = [
        abs(r["predicted_iter_time_s"] - r["predicted_compute_s"] + r["compute_s"] - r["iter_time_s_mean"])
        / r["iter_time_s_mean"]
        for r in cases
        if r.get("compute_s") and r.get("predicted_compute_s")
    ]
    by_method, by_model, by_cluster = (_mean_error_by(cases, key) for key in ("method", "model", "cluster"))
    with_memory = [r for r in cases if r["memory_error"] is not None]
    memory_by_method = {
        m: statistics.fmean(r["memory_error"] for r in with_memory if r["method"] == m)
        for m in sorted({r["method"] for r in with_memory})
    }
    taus, taus_all, separated_pairs = {}, {}, {}
    for model, cluster in sorted({(r["model"], r["cluster"]) for r in cases}):
        group = [r for r in cases if (r["model"], r["cluster"]) == (model, cluster)]
        measured = [r["iter_time_s_mean"] for r in group]
        predicted = [r["predicted_iter_time_s"] for r in group]
        spans = [_repeats_interval(r) for r in group]

        def separated(i, j, spans=spans):  # the intervals of the repeats' medians do not overlap
            return spans[i] is not None and spans[j] is not None and not spans[i].overlaps(spans[j])

        key = f"{model}/{cluster}"
        taus[key] = kendall_tau(measured, predicted, separated)
        taus_all[key] = kendall_tau(measured, predicted)
        separated_pairs[key] = sum(separated(i, j) for i, j in itertools.combinations(range(len(group)), 2))
    return {
        "cases": [
            {
                k: r.get(k)
                for k in (
                    "model",
                    "cluster",
                    "method",
                    "iter_time_s_mean",
                    "predicted_iter_time_s",
                    "sim_error",
                    "compute_s",
                    "predicted_compute_s",
                    "planned_iter_time_s",
                    "link_overrun_s",
                    "run_host_flops_per_s",
                    "tensor_peak_gib",
                    "predicted_peak_mem_gib",
                    "memory_error",
                    "aggregate",
                )
            }
            for r in cases
        ],
        "mape": statistics.fmean(r["sim_error"] for r in cases) if cases else None,
        # The same cases priced at the parent's probe of the host (what the planner saw).
        "mape_planned": statistics.fmean(planned) if planned else None,
        "mape_outside_compute": statistics.fmean(outside) if outside else None,
        "mape_by_method": by_method,
        "mape_by_model": by_model,
        "mape_by_cluster": by_cluster,
        # Each rank's peak of live tensor bytes against its device's predicted peak (CPU ranks)
        "memory_mape": statistics.fmean(r["memory_error"] for r in with_memory) if with_memory else None,
        "memory_mape_by_method": memory_by_method,
        # Over the pairs of methods whose measured intervals separate them, and over all pairs.
        "kendall_tau": taus,
        "kendall_tau_all": taus_all,
        "separated_pairs": separated_pairs,
        "failed": [
            f"{r['model']}/{r['cluster']}/{r['method']}: {r.get('error')}" for r in rows if r.get("status") != "ok"
        ],
    }


def merged_rows(summaries: list[dict]) -> list[dict]:
    """The cases of several calibration summaries (runs of one calibration split to keep each
    short) as rows summarize reads again: a case's measured compute and link overrun as its
    row's emulation reported them. A case in two files is an error (it would count twice)."""
    rows, seen = [], set()
    for summary in summaries:
        for c in summary["cases"]:
            key = (c["model"], c["cluster"], c["method"])
            if key in seen:
                raise ValueError(f"case {'/'.join(key)} is in more than one file")
            seen.add(key)
            rows.append(
                {
                    **c,
                    "status": "ok",
                    "emulation": {"compute_s": c.get("compute_s"), "link_overrun_s": c.get("link_overrun_s")},
                }
            )
    return rows


def _mean_error_by(cases: list[dict], key: str) -> dict[str, float]:
    """The mean of the cases' sim_error per value of `key` (method, model or cluster)."""
    return {v: statistics.fmean(r["sim_error"] for r in cases if r[key] == v) for v in sorted({r[key] for r in cases})}


def print_summary(summary: dict) -> None:
    console = Console(width=170)
    table = Table(title="simulator vs measurement (emulated clusters)")
    for col in (
        "model",
        "cluster",
        "method",
        "measured ms",
        "predicted ms",
        "error",
        "compute ms meas/pred",
        "rest ms meas/pred",
        "peak MiB meas/pred",
        "mem error",
    ):
        table.add_column(col, justify="left" if col in ("model", "cluster", "method") else "right")

    def pair(meas, pred) -> str:
        return "-" if meas is None or pred is None else f"{meas * 1e3:.1f} / {pred * 1e3:.1f}"

    for c in summary["cases"]:
        comp, pcomp = c.get("compute_s"), c.get("predicted_compute_s")
        rest = None if comp is None else c["iter_time_s_mean"] - comp
        prest = None if pcomp is None else c["predicted_iter_time_s"] - pcomp
        measured = f"{c['iter_time_s_mean'] * 1e3:.1f}"
        span = (c.get("aggregate") or {}).get("iter_time_s")
        if span:  # the median of the repeats and its interval
            measured += f" [{span['low'] * 1e3:.1f}-{span['high'] * 1e3:.1f}]"
        mem, pmem = c.get("tensor_peak_gib"), c.get("predicted_peak_mem_gib")
        peaks = "-" if c.get("memory_error") is None else f"{max(mem) * 1024:.1f} / {max(pmem) * 1024:.1f}"
        table.add_row(
            c["model"],
            c["cluster"],
            c["method"],
            measured,
            f"{c['predicted_iter_time_s'] * 1e3:.1f}",
            f"{c['sim_error']:.0%}",
            pair(comp, pcomp),
            pair(rest, prest),
            peaks,
            "-" if c.get("memory_error") is None else f"{c['memory_error']:.0%}",
        )
    console.print(table)
    taus = Table(title="ordering of methods: Kendall tau (measured vs predicted)")
    taus.add_column("model/cluster")
    taus.add_column("tau, separated pairs", justify="right")
    taus.add_column("separated pairs", justify="right")
    taus.add_column("tau, all pairs", justify="right")
    for key, tau in summary["kendall_tau"].items():
        every = summary.get("kendall_tau_all", {}).get(key)
        taus.add_row(
            key,
            "-" if tau is None else f"{tau:+.2f}",
            str(summary.get("separated_pairs", {}).get(key, "-")),
            "-" if every is None else f"{every:+.2f}",
        )
    console.print(taus)
    if summary["mape"] is not None:
        console.print(
            f"MAPE {summary['mape']:.1%} over {len(summary['cases'])} cases; priced at the host speed "
            "each run's ranks measured (bench.runtime.hostspeed.yardstick)"
        )
        for key in ("method", "model", "cluster"):
            per = summary.get(f"mape_by_{key}") or {}
            counts = {v: sum(c[key] == v for c in summary["cases"]) for v in per}
            console.print(f"  MAPE by {key}: " + ", ".join(f"{v} {e:.1%} ({counts[v]})" for v, e in per.items()))
    if summary.get("memory_mape") is not None:
        per = ", ".join(f"{m} {e:.0%}" for m, e in summary["memory_mape_by_method"].items())
        cases = sum(c.get("memory_error") is not None for c in summary["cases"])
        console.print(
            f"peak tensor memory: MAPE {summary['memory_mape']:.1%} over {cases} cases ({per}); each "
            "CPU rank's live tensor bytes against its device's predicted peak"
        )
    if summary.get("mape_planned") is not None:
        console.print(
            f"MAPE {summary['mape_planned']:.1%} priced at the parent's probe of the host (what the "
            "planner planned with)"
        )
    if summary.get("mape_outside_compute") is not None:
        console.print(
            f"MAPE {summary['mape_outside_compute']:.1%} with each prediction's compute part taken as "
            "measured in its run (the error of the rest alone; a diagnostic, not a prediction)"
        )
    for line in summary["failed"]:
        console.print(f"failed: {line}")


def single_device_cluster(device_type: str, profile: str) -> ClusterSpec:
    """One GPU of `device_type` (its packaged numbers) with the compute profile `profile`."""
    if device_type not in device_types():
        raise ConfigError(
            f"--device-type={device_type!r} is unknown; known: {', '.join(sorted(device_types()))} "
            "(conf/device/<name>.yaml)"
        )
    base = device_types()[device_type]
    link = {"bandwidth_gbps": 1.0, "latency_s": 0.0}
    numbers = {
        k: v
        for k, v in (
            ("memory_gib", base.memory_gib),
            ("peak_flops", base.peak_flops),
            ("effective_flops", base.effective_flops),
        )
        if v is not None
    }
    inline = {**numbers, "profile": profile, "sources": {k: base.sources.get(k, "packaged type") for k in numbers}}
    return ClusterSpec.from_config(
        {
            "name": f"one {device_type}",
            "virtual_device": "gpu",
            "device_types": {device_type: inline},
            "machines": [{"count": 1, "device": device_type, "num_devices": 1}],
            "links": {"intra_machine": link, "inter_machine": link},
        }
    )


def single_device_rows(
    models,
    batches,
    device: str,
    cluster: ClusterSpec,
    preset: str = "paper",
    repeats: int = 10,
    on_row=None,
    precision: str = "fp32",
) -> list[dict]:
    """Per (model, batch): the measured step on `device` at `precision` and the simulator's
    prediction of plain training on `cluster` (one device: dp_ev's program), time and peak
    memory; on_row(rows so far) after each."""
    rows = []
    for model in models:
        for batch in batches:
            cfg, workload = _step(model, batch, preset, cluster, precision)
            probe = host_probe(device)
            seconds, peak = device_step(workload, batch, cfg.seed, device, repeats)
            rows.append(_predicted(cfg, workload, cluster, seconds, None if peak is None else peak / 2**30, probe))
            r = rows[-1]  # as it goes: a run cut short keeps what it measured in its log
            print(
                f"{model} batch {batch}: {r['measured_s'] * 1e3:.2f} ms (predicted {r['predicted_s'] * 1e3:.2f}, "
                f"host {r['predicted_host_s'] * 1e3:.2f}); peak {r['measured_peak_gib'] or 0:.3f} GiB "
                f"(predicted {r['predicted_peak_gib']:.3f}); host probe {probe * 1e6:.2f} us/op",
                flush=True,
            )
            if on_row is not None:
                on_row(rows)
    return rows


def repriced_rows(rows: list[dict], cluster: ClusterSpec, preset: str = "paper", precision: str = "fp32") -> list[dict]:
    """An earlier run's measured steps against today's cost model (same profile and plans)."""
    return [
        _predicted(
            *_step(r["model"], r["batch"], preset, cluster, precision),
            cluster,
            r["measured_s"],
            r["measured_peak_gib"],
            r.get("host_probe_s"),
        )
        for r in rows
    ]


def _step(model: str, batch: int, preset: str, cluster: ClusterSpec, precision: str = "fp32"):
    """The config and workload of one plain training step of `model` at `batch` samples."""
    cfg = compose_settings(
        "mode=sim",
        f"preset={preset}",
        f"model={model}",
        "method=dp_ev",
        f"global_batch={batch}",
        f"precision={precision}",
        "wandb.mode=disabled",
    )
    return cfg, build_workload(cfg, cluster)


def _predicted(
    cfg, workload, cluster: ClusterSpec, seconds: float, peak_gib: float | None, host_probe_s: float | None = None
) -> dict:
    """The step's prediction from the profile as measured, and, where both the profile and the
    row probed the host (bench.runtime.hostspeed.host_probe), also with the host's dispatch costs at the
    row's probe (`predicted_at_probe_s`): what the model says if the host, not the device, moved."""
    model, batch = cfg.model["name"], workload.global_batch
    plan = instantiate_plugin(cfg.method, "method").plan(workload, cluster)
    sim = simulate(plan.program, cluster, plan.ratios)
    host = host_time(plan.program, virtual_devices(cluster, "gpu"))
    probed = cluster if host_probe_s is None else cluster.with_host_probe(host_probe_s)
    at_probe = None if probed is cluster else simulate(plan.program, probed, plan.ratios).iter_time_s
    return {
        "model": model,
        "batch": batch,
        "measured_s": seconds,
        "predicted_s": sim.iter_time_s,
        "predicted_host_s": host,
        "time_error": abs(sim.iter_time_s - seconds) / seconds,
        "measured_peak_gib": peak_gib,
        "predicted_peak_gib": sim.peak_mem_gib[0],
        "memory_error": None if peak_gib is None else abs(sim.peak_mem_gib[0] - peak_gib) / peak_gib,
        "host_probe_s": host_probe_s,
        "predicted_at_probe_s": at_probe,
        "time_error_at_probe": None if at_probe is None else abs(at_probe - seconds) / seconds,
    }


def print_single_device(rows: list[dict], title: str) -> dict:
    console = Console(width=160)
    table = Table(title=title)
    probed = all(r.get("time_error_at_probe") is not None for r in rows)
    for col in (
        "model",
        "batch",
        "measured ms",
        "predicted ms",
        "host ms",
        "error",
        *(("at probe ms", "error ") if probed else ()),
        "peak GiB",
        "predicted GiB",
        "error  ",
    ):
        table.add_column(col, justify="left" if col == "model" else "right")
    for r in rows:
        mem, host = r["measured_peak_gib"], r.get("predicted_host_s")
        at_probe = (f"{r['predicted_at_probe_s'] * 1e3:.1f}", f"{r['time_error_at_probe']:.0%}") if probed else ()
        table.add_row(
            r["model"],
            str(r["batch"]),
            f"{r['measured_s'] * 1e3:.1f}",
            f"{r['predicted_s'] * 1e3:.1f}",
            "-" if not host else f"{host * 1e3:.1f}",
            f"{r['time_error']:.0%}",
            *at_probe,
            "-" if mem is None else f"{mem:.2f}",
            f"{r['predicted_peak_gib']:.2f}",
            "-" if r["memory_error"] is None else f"{r['memory_error']:.0%}",
        )
    console.print(table)
    summary = {"time_mape": statistics.fmean(r["time_error"] for r in rows)}
    mem = [r["memory_error"] for r in rows if r["memory_error"] is not None]
    summary["memory_mape"] = statistics.fmean(mem) if mem else None
    summary["time_mape_at_probe"] = statistics.fmean(r["time_error_at_probe"] for r in rows) if probed else None
    console.print(
        f"step time MAPE {summary['time_mape']:.1%} over {len(rows)} cases"
        + (
            ""
            if not probed
            else f" ({summary['time_mape_at_probe']:.1%} with the host's dispatch costs at each step's probe)"
        )
        + ("" if not mem else f"; peak memory MAPE {summary['memory_mape']:.1%}")
    )
    return summary
