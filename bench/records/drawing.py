"""Figures and tables from recorded rows: the library behind `hetbench report`.

One panel per model, one group of bars per value of a config key, one bar per method, with
the interval where a row aggregates repeats; a case that did not end ok is a gap with its
status at the base, never a bar. The CSVs (one line per case, with its commit and origin, and
the speedups) depend on the rows alone, so the same rows give the same bytes. Usage:
`bench/report.py`.
"""

from __future__ import annotations

import csv
import io
import sys
from pathlib import Path

from rich.console import Console
from rich.table import Table

from bench.records.rows import load_records
from bench.records.table import BASELINE, same_case

METRICS = {  # name -> axis label
    "samples_per_s": "samples/s",
    "tokens_per_s": "tokens/s",
    "iter_time_s_mean": "s / iteration",
    "planner_time_s": "planner time (s)",
}


MODEL_ORDER = ("vgg19", "vit", "bert", "bert_moe")


_CSV_FIELDS = (
    "model",
    "x",
    "method",
    "status",
    "origin",
    "metric",
    "value",
    "low",
    "high",
    "coverage",
    "repeats",
    "speedup_vs_dp_ev",
    "global_batch",
    "hardware",
    "git_sha",
    "git_dirty",
    "error",
)


class ReportError(ValueError):
    """Bad input for report: one line naming the path or option and the fix."""


# -- reading ----------------------------------------------------------------------------------
def read_rows(path: str | Path) -> list[dict]:
    """Rows from a records file, a results_dir (its records.jsonl) or a Hydra sweep directory
    (the records.jsonl of each of its job directories)."""
    path = Path(path)
    if not path.exists():
        raise ReportError(f"{path} does not exist; pass a records.jsonl, a results_dir or a Hydra sweep directory")
    if path.is_dir():
        own = [f for f in (path / "records.jsonl", path / "records.jsonl.gz") if f.is_file()]
        files = own[:1] or sorted(path.glob("*/records.jsonl"), key=lambda p: (len(p.parent.name), p.parent.name))
        if not files:
            raise ReportError(
                f"{path} holds no rows (no records.jsonl in it or in its job "
                "directories); run a case or sweep with results_dir there first"
            )
        rows = [r for f in files for r in _load(f)]
        if not rows:
            raise ReportError(f"{path} holds no rows: its records.jsonl files are empty")
        return rows
    return _load(path)


def _load(path: Path) -> list[dict]:
    skipped: list[int] = []
    rows = load_records(path, skipped)
    if not rows and skipped:
        raise ReportError(
            f"{path} is not a records file: no line of it is a JSON row; pass a records.jsonl written by hetbench"
        )
    if not rows:
        raise ReportError(f"{path} holds no rows (empty); run a case or sweep that writes there first")
    if skipped:
        print(
            f"warning: {path}: {len(skipped)} line(s) are not JSON rows (e.g. line "
            f"{skipped[0]}: a write cut short); skipped",
            file=sys.stderr,
        )
    return rows


def final_rows(rows: list[dict]) -> list[dict]:
    """One row per case: its last aggregate if it was repeated, else its last case row (a
    re-run replaces an earlier answer; lone repeat rows are not an answer)."""
    last: dict[str, dict] = {}
    for r in rows:
        kind = r.get("row_kind", "case")
        if kind == "repeat":
            continue
        key = r.get("case_key") or str(id(r))
        prev = last.get(key)
        if prev is None or kind == "aggregate" or prev.get("row_kind", "case") != "aggregate":
            last[key] = r
    return list(last.values())


def config_value(row: dict, dotted: str):
    """A row's value of a dotted config key (top-level row fields first: model, cluster, ...)."""
    if dotted in row and "." not in dotted:
        return row[dotted]
    node = row.get("config") or {}
    for part in dotted.split("."):
        if not isinstance(node, dict) or part not in node:
            return None
        node = node[part]
    return node


# -- numbers ----------------------------------------------------------------------------------
def _interval(row: dict, metric: str) -> tuple[float | None, float | None, float | None]:
    """(low, high, coverage) of the metric from an aggregate's interval of the iteration time."""
    agg = (row.get("aggregate") or {}).get("iter_time_s")
    if not agg or row.get("status") != "ok" or row.get(metric) is None or metric == "planner_time_s":
        return None, None, None
    if metric == "iter_time_s_mean":
        return agg["low"], agg["high"], agg["coverage"]
    per_iter = row.get(metric) * row["iter_time_s_mean"]  # samples (or tokens) per iteration
    return per_iter / agg["high"], per_iter / agg["low"], agg["coverage"]


def _last_line(text: str | None) -> str | None:
    """The line of an error that says what went wrong (a traceback's last), at most 200 chars."""
    lines = (text or "").strip().splitlines()
    return lines[-1][:200] if lines else None


def _sort_key(value) -> tuple:
    return (0, value, "") if isinstance(value, (int, float)) else (1, 0, str(value))


def table_rows(rows: list[dict], x: str, metric: str) -> list[dict]:
    """One dict per case (the CSV's lines), sorted by model, x and method."""
    out = []
    for r in final_rows(rows):
        ok = r.get("status") == "ok"
        low, high, coverage = _interval(r, metric)
        out.append(
            {
                "model": r.get("model"),
                "x": config_value(r, x),
                "method": r.get("method"),
                "status": r.get("status"),
                "origin": r.get("origin"),
                "metric": metric,
                "value": r.get(metric) if ok or metric == "planner_time_s" else None,
                "low": low,
                "high": high,
                "coverage": coverage,
                "repeats": (r.get("aggregate") or {}).get("iter_time_s", {}).get("n"),
                "speedup_vs_dp_ev": None,
                "global_batch": r.get("global_batch"),
                "hardware": r.get("hardware"),
                "git_sha": (r.get("git_sha") or "")[:10],
                "git_dirty": r.get("git_dirty"),
                "error": None if ok else _last_line(r.get("error")),
                "_row": r,
            }
        )
    for line in out:
        r = line["_row"]
        base = [b["_row"] for b in out if b["method"] == BASELINE and b["x"] == line["x"] and same_case(b["_row"], r)]
        per_round = (r.get("aggregate") or {}).get("speedup_vs_dp_ev")
        if r.get("status") != "ok":
            continue
        if per_round:
            line["speedup_vs_dp_ev"] = per_round["median"]
        elif base and base[0].get("status") == "ok" and base[0].get("samples_per_s") and r.get("samples_per_s"):
            line["speedup_vs_dp_ev"] = r["samples_per_s"] / base[0]["samples_per_s"]
    order = {m: i for i, m in enumerate(MODEL_ORDER)}
    out.sort(key=lambda d: (order.get(d["model"], len(order)), str(d["model"]), _sort_key(d["x"]), str(d["method"])))
    return out


def _cell(value) -> str:
    if value is None:
        return ""
    if isinstance(value, float):
        return repr(value)
    return str(value)


def to_csv(lines: list[dict], fields=_CSV_FIELDS) -> str:
    buf = io.StringIO()
    writer = csv.writer(buf, lineterminator="\n")
    writer.writerow(fields)
    for line in lines:
        writer.writerow([_cell(line[f]) for f in fields])
    return buf.getvalue()


def speedup_csv(lines: list[dict]) -> str:
    methods = sorted({d["method"] for d in lines})
    buf = io.StringIO()
    writer = csv.writer(buf, lineterminator="\n")
    writer.writerow(["model", "x", *methods])
    for (model, x), cells in _by_case(lines).items():
        writer.writerow([model, _cell(x), *(_speedup_cell(cells.get(m)) for m in methods)])
    return buf.getvalue()


def _by_case(lines: list[dict]) -> dict:
    cases: dict = {}
    for d in lines:
        cases.setdefault((d["model"], d["x"]), {})[d["method"]] = d
    return cases


def _speedup_cell(d: dict | None) -> str:
    if d is None:
        return ""
    if d["status"] != "ok":
        return d["status"]
    s = d["speedup_vs_dp_ev"]
    if s is None:
        return "?"
    agg = (d["_row"].get("aggregate") or {}).get("speedup_vs_dp_ev")
    return f"{s:.2f} [{agg['low']:.2f}-{agg['high']:.2f}]" if agg else f"{s:.2f}"


def speedup_table(lines: list[dict], x: str, title: str) -> Table:
    methods = sorted({d["method"] for d in lines})
    table = Table(title=f"{title}: speedup vs {BASELINE} (throughput ratio; median \\[interval] where repeated)")
    for col in ("model", x, *methods):
        table.add_column(col, justify="left" if col in ("model", x) else "right")
    for (model, xv), cells in _by_case(lines).items():
        table.add_row(str(model), str(xv), *(_speedup_cell(cells.get(m)) for m in methods))
    return table


# -- drawing ----------------------------------------------------------------------------------
def draw_bars(
    ax, xs: list[float], lines: list[dict | None], width: float, label: str, color: str | None = None
) -> None:
    """One bar per case at `xs`, with its interval where it has one. A case that is not ok
    (OOM, failed, ...) gets no bar, since even one of height 0 would read as a measured zero,
    but a gap with its status written at the base; a missing case gets nothing. `color`: the
    method's, the same in every panel."""
    drawn = [(x, d) for x, d in zip(xs, lines) if d is not None and d["value"] is not None]
    if drawn:
        heights = [d["value"] for _, d in drawn]
        err = [
            [max(0.0, d["value"] - d["low"]) if d["low"] is not None else 0.0 for _, d in drawn],
            [max(0.0, d["high"] - d["value"]) if d["high"] is not None else 0.0 for _, d in drawn],
        ]
        has_err = any(d["low"] is not None for _, d in drawn)
        ax.bar(
            [x for x, _ in drawn],
            heights,
            width,
            label=label,
            color=color,
            yerr=err if has_err else None,
            capsize=2 if has_err else 0,
        )
    else:
        ax.bar([], [], width, label=label, color=color)
    for x, d in zip(xs, lines):
        if d is not None and d["value"] is None:
            ax.text(
                x, 0, "OOM" if d["status"] == "oom" else d["status"], rotation=90, ha="center", va="bottom", fontsize=7
            )


def draw(lines: list[dict], x: str, metric: str, title: str):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.patches
    import matplotlib.pyplot as plt

    models = list(dict.fromkeys(d["model"] for d in lines))
    methods = sorted({d["method"] for d in lines})
    fig, axes = plt.subplots(1, len(models), figsize=(4.2 * len(models), 3.6), squeeze=False)
    width = 0.8 / max(1, len(methods))
    cycle = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    colors = {m: cycle[i % len(cycle)] for i, m in enumerate(methods)}
    for ax, model in zip(axes[0], models):
        sub = [d for d in lines if d["model"] == model]
        xvals = sorted({d["x"] for d in sub}, key=_sort_key)
        for i, method in enumerate(methods):
            cells = {d["x"]: d for d in sub if d["method"] == method}
            draw_bars(
                ax,
                [j + i * width for j in range(len(xvals))],
                [cells.get(v) for v in xvals],
                width,
                method,
                colors[method],
            )
        labels = [str(v) for v in xvals]
        # Level labels overlap past about 28 characters per 4.2-inch panel (the ablation's
        # "no SFB", "no collective choice", ...): slant them.
        slant = sum(map(len, labels)) > 28
        ax.set_xticks(
            [j + 0.4 - width / 2 for j in range(len(xvals))],
            labels,
            rotation=25 if slant else 0,
            ha="right" if slant else "center",
        )
        ax.set_title(str(model))
        ax.set_xlabel(x)
    origins = sorted({str(d["origin"]) for d in lines})
    axes[0][0].set_ylabel(f"{METRICS[metric]} ({', '.join(origins)})")
    # one handle per method in its colour: a panel where a method has no bar (all OOM) has no
    # patch of its to take the colour from
    handles = [matplotlib.patches.Patch(facecolor=colors[m], label=m) for m in methods]
    axes[0][-1].legend(handles=handles, fontsize=7)
    fig.suptitle(title, y=1.03)
    return fig


def report(
    rows: list[dict],
    out: Path,
    name: str,
    x: str = "cluster",
    metric: str = "samples_per_s",
    title: str | None = None,
    figure: bool = True,
    console: Console | None = None,
) -> list[dict]:
    """Write NAME.csv, NAME_speedup.csv (and NAME.png/.pdf) under `out`; print the speedup
    table. Returns the CSV's lines."""
    if metric not in METRICS:
        raise ReportError(f"--metric {metric} is unknown; use one of: {', '.join(METRICS)}")
    lines = table_rows(rows, x, metric)
    if all(d["x"] is None for d in lines):
        raise ReportError(
            f"--x {x}: no row has this config key; use a key of the rows' config, "
            "e.g. --x cluster or --x cluster.gpus_per_machine"
        )
    title = title or f"{name}: {METRICS[metric]} per method"
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{name}.csv").write_text(to_csv(lines))
    (out / f"{name}_speedup.csv").write_text(speedup_csv(lines))
    if figure:
        import matplotlib.pyplot as plt

        fig = draw(lines, x, metric, title)
        fig.savefig(out / f"{name}.png", dpi=130, bbox_inches="tight")
        fig.savefig(out / f"{name}.pdf", bbox_inches="tight", metadata={"CreationDate": None})
        plt.close(fig)
    (console or Console()).print(speedup_table(lines, x, title))
    print(f"wrote {out / name}.{{csv,png,pdf}} and {name}_speedup.csv ({len(lines)} cases)")
    return lines


def layout(rows: list[dict]) -> dict:
    """The `report` node of the rows' experiment config (name, x, metric, title), if any."""
    for r in rows:
        node = (r.get("config") or {}).get("report")
        if node:
            return dict(node)
    return {}
