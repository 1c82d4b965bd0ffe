"""The comparison table printed after runs: one line per case, speedup against dp_ev."""

from __future__ import annotations

from collections.abc import Iterable

from rich.console import Console
from rich.table import Table

BASELINE = "dp_ev"


def same_case(a: dict, b: dict) -> bool:
    """Rows of the same workload and cluster (what a speedup compares across methods)."""
    keys = ("model", "preset", "cluster", "mode", "global_batch")
    return all(a.get(k) == b.get(k) for k in keys)


def speedup(row: dict, rows: list[dict]) -> float | None:
    """Throughput of `row` / throughput of dp_ev on the same model, cluster, batch and mode
    (an aggregate row carries its own, computed round by round)."""
    per_round = (row.get("aggregate") or {}).get("speedup_vs_dp_ev")
    if per_round:
        return per_round["median"]
    base = [r for r in rows if r.get("method") == BASELINE and r.get("status") == "ok" and same_case(r, row)]
    if row.get("status") != "ok" or not base or not row.get("samples_per_s"):
        return None
    return row["samples_per_s"] / base[-1]["samples_per_s"]


def _fmt(value, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def _efficiency(value: float | None) -> str:
    """Two decimals, or two significant digits below 0.005: a tiny model on a GPU rated at
    tens of TFLOP/s (bert-tiny on two MPS ranks of one GPU) would otherwise read 0.00."""
    return _fmt(value, ".1e" if value is not None and 0 < value < 0.005 else ".2f")


def _interval(summary: dict, scale: float = 1.0, spec: str = ".1f") -> str:
    return f"{summary['median'] * scale:{spec}} [{summary['low'] * scale:{spec}}-{summary['high'] * scale:{spec}}]"


def _status(r: dict) -> str:
    """The row's status, and for an ok row whose emulation missed its targets by more than 5%
    by how much: its compute pacing (dilation) or its links (their real collectives ran past
    the emulated time by that share of the iteration)."""
    emulation = r.get("emulation") or {}
    if r["status"] != "ok":
        return r["status"]
    flags = ["ok"]
    if emulation.get("ok") is False:
        flags.append(f"dilation {emulation['max_error']:+.0%}")
    if emulation.get("links_ok") is False and emulation.get("link_overrun_s") and r.get("iter_time_s_mean"):
        flags.append(f"links +{emulation['link_overrun_s'] / r['iter_time_s_mean']:.0%}")
    return ", ".join(flags)


def build_table(rows: Iterable[dict], title: str = "hetbench") -> Table:
    rows = list(rows)
    repeated = [r for r in rows if r.get("aggregate")]
    if repeated:
        first = repeated[0]["aggregate"]["iter_time_s"]
        title += (
            f"\n{first['n']} interleaved repeats; iter ms and speedup: median "
            f"[{first['coverage']:.0%} interval]; rank: overlapping intervals tie"
        )
    table = Table(title=title)
    columns = [
        "model",
        "cluster",
        "method",
        "origin",
        "status",
        "iter ms",
        "samples/s",
        "tokens/s",
        "speedup vs dp_ev",
        "efficiency",
        "planner ms",
    ]
    if repeated:
        columns.insert(5, "rank")
    for col in columns:
        table.add_column(col, justify="left" if col in ("model", "cluster", "method", "origin", "status") else "right")
    for r in rows:
        mean, std = r.get("iter_time_s_mean"), r.get("iter_time_s_std")
        predicted = r.get("predicted_iter_time_s")
        agg = r.get("aggregate") or {}
        if agg:
            it = _interval(agg["iter_time_s"], 1e3)
        elif mean is not None:
            it = f"{mean * 1e3:.1f} ± {std * 1e3:.1f}"
        elif predicted is not None and r.get("origin") == "simulated":
            it = f"{predicted * 1e3:.1f} (sim)"
        else:
            it = "-"
        up = agg.get("speedup_vs_dp_ev")
        cells = [
            f"{r['model']}-{r['preset']}",
            r["cluster"],
            r["method"],
            r.get("origin", "-"),
            _status(r),
            it,
            _fmt(r.get("samples_per_s"), ".1f"),
            _fmt(r.get("tokens_per_s"), ".0f"),
            _interval(up, spec=".2f") if up else _fmt(speedup(r, rows), ".2f"),
            _efficiency(r.get("efficiency")),
            _fmt(None if r.get("planner_time_s") is None else r["planner_time_s"] * 1e3, ".1f"),
        ]
        if repeated:
            cells.insert(5, _fmt(agg.get("rank"), "d"))
        table.add_row(*cells)
    return table


def print_table(rows: Iterable[dict], title: str = "hetbench") -> None:
    Console(width=200).print(build_table(rows, title))
