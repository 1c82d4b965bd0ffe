"""Throughput regression check against committed baselines (results/baselines/regression.json).

Figures: simulated iteration time of every sim-capable method on every model at paper scale
(deterministic: tight tolerance), the planner's search effort (deterministic) and its wall time
over a pure-Python yardstick timed in the same process right after it, for as long
(planner_time_rel, loose: how fast the machine runs Python cancels; a figure past its tolerance is
planned twice more and regresses only if all three are past, planner_retries), and each
real-capable method's measured iteration time on an emulated cluster divided by the cluster's
compute in the same run, pooled (iter_over_compute: every rank's full-pace reference, timed by
its own worker, summed over the summed speeds; bench.runtime.emulation.pooled_compute_s). What is
left is what the harness adds to compute: links, waits on peers, pacing, the worker loop. A
slowdown of the worker loop, the emulator or the data path raises every method's figure, so it is
caught even when it hits every method alike; how fast the host happened to run the workers
cancels.

A measured figure regresses only when every one of its rounds is past the tolerance (a sign test:
p = 1/32 were its true median at the threshold), not when its median is: on an unsteady host
single rounds swing far enough to fail a median, while a real slowdown moves every round (the
test test_every_round_past_holds_on_an_unsteady_day_and_catches_a_slowdown_on_a_steady_one). Why
these normalisers and this rule: docs/regression.md, "The figures".

It does not decide what is fast; it says what changed since the baseline and by how much.
"""

from __future__ import annotations

import contextlib
import heapq
import io
import json
import statistics
import sys
import tempfile
import time
from collections.abc import Container
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path

from rich.console import Console
from rich.table import Table

from bench.core.paths import PROJECT_DIR
from bench.records.rows import fingerprint
from bench.runner.case import new_record, prepare_case
from bench.runner.configs import compose_settings, methods_supporting
from bench.runner.execute import CaseRunner, expect_cases
from bench.runtime.emulation import pooled_compute_s

BASELINE_FILE = PROJECT_DIR / "results" / "baselines" / "regression.json"


MODELS = ("vgg19", "vit", "bert", "bert_moe")


SIM_CASE = ("preset=paper", "cluster=paper_hetero", "mode=sim")


REAL_CASE = ("model=bert", "preset=tiny", "cluster=local_hetero2", "mode=real", "measured_iters=20")


# Interleaved rounds of the measured case; a measured figure regresses when every round is past
# its tolerance. 4, not 3: one slow worker process could move three rounds' figure past 10%
# (docs/regression.md, "The figures", where the rounds behind 4 against 5 are).
REAL_ROUNDS = 4


# Per kind of figure: (better direction, relative tolerance before a change counts as a regression)
TOLERANCE = {
    "sim_iter_time_s": ("lower", 0.01),  # deterministic: any real change shows
    "states_expanded": ("lower", 0.10),  # deterministic, but search tweaks move it a little
    "planner_time_rel": ("lower", 2.00),  # wall clock over a yardstick, on a shared machine: gross slowdowns
    "iter_over_compute": ("lower", 0.10),  # measured, normalised: every round of REAL_ROUNDS past it
}


@dataclass
class Change:
    figure: str
    baseline: float | None
    new: float | None
    regressed: bool
    past: tuple[int, int] | None = None  # a measured figure's rounds past the tolerance, of all its rounds

    @property
    def change(self) -> float | None:
        if self.baseline in (None, 0) or self.new is None:
            return None
        return self.new / self.baseline - 1


def _compose(*overrides: str):
    cfg = compose_settings("wandb.mode=disabled", *overrides)
    if "cache_dir" in cfg.method:  # plan every time: a cache hit would hide the planner's time
        cfg = compose_settings("wandb.mode=disabled", *overrides, "method.cache_dir=null")
    return cfg


def python_yardstick_s(at_least_s: float = 0.0, repeats: int = 5) -> float:
    """Seconds this process takes for a fixed piece of pure-Python work of the search's kind
    (small tuples hashed into a dict, floats compared, a heap pushed), the mean over `repeats`
    runs or as many as fill `at_least_s`, whichever is more: the unit of planner_time_rel.

    A mean over a window as long as the planning, not the fastest of a few: a VM's speed at
    Python can move 2x within a second, and a planner that takes seconds averages over those
    moves where a short yardstick does not; the figure spreads about half as much
    (docs/regression.md, "The figures")."""
    runs = []
    start = time.perf_counter()
    while len(runs) < repeats or time.perf_counter() - start < at_least_s:
        begin = time.perf_counter()
        seen: dict = {}
        heap: list = []
        top = 0.0
        for i in range(30_000):
            key = (i % 997, i & 15)
            cost = seen.get(key, 0.0) + (i % 7) * 0.5
            if cost > top:
                top = cost
                heapq.heappush(heap, (cost, i))
            seen[key] = cost
        runs.append(time.perf_counter() - begin)
    return statistics.fmean(runs)


def sim_figures(
    models=MODELS, methods: list[str] | None = None, timed: Container[str] | None = None
) -> dict[str, float]:
    """Deterministic figures: predicted iteration time and planner effort per case, and the
    planner's time less the model's capture in units of this process's Python speed, timed right
    after it planned for as long as it planned (for the planner figures in `timed`, by default
    every one: a check times those its baseline has)."""
    out = {}
    for model in models:
        for method in methods_supporting("sim") if methods is None else methods:
            cfg = _compose(*SIM_CASE, f"model={model}", f"method={method}")
            record = new_record(cfg)
            try:
                prepare_case(cfg, record)
            except Exception as exc:  # an unplannable case is a figure too: it has no value
                print(f"note: {model}/{method}: {type(exc).__name__}: {exc}", file=sys.stderr)
                continue
            key = f"{model}/paper_hetero/{method}"
            out[f"sim_iter_time_s:{key}"] = record.predicted_iter_time_s
            if record.plan and "states_expanded" in record.plan:
                out[f"states_expanded:{key}"] = float(record.plan["states_expanded"])
                # The planner without the model's capture (a load when the graph cache kept it,
                # torch.export's when it did not): what the planner's own code costs.
                planning = record.planner_time_s - (record.capture_time_s or 0.0)
                if timed is None or f"planner_time_rel:{key}" in timed:
                    out[f"planner_time_rel:{key}"] = planning / python_yardstick_s(planning)
    return out


def planner_retries(baseline: dict[str, float], figures: dict[str, float], retries: int = 2) -> dict[str, list[float]]:
    """For each planner_time_rel figure past its tolerance, the case planned `retries` more
    times: its rounds, the first value and the retries' (compare then wants every one past, as
    for a measured figure). One plan's time and its yardstick's each fill a window as short as
    the plan (0.1 s for VGG19's sfb), and a host can take a window that short from the process
    (docs/regression.md, "The figures"). A planner that got slower is slower
    every time; such a moment is not."""
    _, tol = TOLERANCE["planner_time_rel"]
    rounds = {}
    for figure, value in figures.items():
        kind, _, case = figure.partition(":")
        if kind != "planner_time_rel" or figure not in baseline or value <= baseline[figure] * (1 + tol):
            continue
        model, _, method = case.split("/")
        again = [sim_figures([model], [method]).get(figure) for _ in range(retries)]
        rounds[figure] = [value] + [v for v in again if v is not None]
    return rounds


def sim_sessions(sessions: int, models=MODELS, methods: list[str] | None = None) -> dict[str, float]:
    """sim_figures `sessions` times over, each figure's median: the deterministic figures come
    out the same every time, planner_time_rel does not (it spreads by tens of percent:
    docs/regression.md, "The figures"), and a baseline is what every later
    check is judged against."""
    runs = [sim_figures(models, methods) for _ in range(sessions)]
    keys = set.intersection(*(set(r) for r in runs))
    return {k: statistics.median(r[k] for r in runs) for k in sorted(keys)}


def baseline_sim_methods(baseline: dict) -> list[str]:
    """The sim-capable methods the baseline has a simulated figure of: the ones a check plans
    (a method without one has nothing to be compared with until a rebaseline adds it)."""
    have = {k.rpartition("/")[2] for k in baseline["figures"] if k.startswith("sim_iter_time_s:")}
    return [m for m in methods_supporting("sim") if m in have]


def baseline_real_methods(baseline: dict) -> list[str]:
    """The real-capable methods the baseline has a measured figure of: the ones a check measures
    (a method without one has nothing to be compared with until a rebaseline adds it)."""
    have = {k.rpartition("/")[2] for k in baseline["figures"] if k.startswith("iter_over_compute:")}
    return [m for m in methods_supporting("real") if m in have]


def measured_rounds(
    slowdown: float = 0.0, methods: list[str] | None = None, baseline: dict[str, float] | None = None
) -> dict[str, list[float]]:
    """Each real-capable method's measured iteration time over the cluster's pooled compute in
    the same run, one value per round of up to REAL_ROUNDS interleaved rounds (iter_over_compute);
    a method that failed in a round it ran has no figure.

    With `baseline` (its figures), the rounds stop once every method has had a round within
    the tolerance of its baseline figure (or failed): a figure regresses only when every round
    is past (compare), so no verdict can change. Until then every method runs each round, so a
    figure past its tolerance is judged over rounds as spread out as before (a slow stretch of
    the host then has to last through all of them). Without, every method runs every round (a
    rebaseline's sessions).

    `slowdown` stretches every iteration of every method by that fraction (test.slowdown):
    what a deliberately slower worker loop looks like to this check.
    """
    methods = methods_supporting("real") if methods is None else methods
    figure = {m: f"iter_over_compute:bert-tiny/local_hetero2/{m}" for m in methods}
    ratios: dict[str, list[float | None]] = {m: [] for m in methods}  # None: a failed round
    running = list(methods)
    with tempfile.TemporaryDirectory() as tmp:
        configs = {
            m: _compose(*REAL_CASE, f"method={m}", f"results_dir={tmp}", f"test.slowdown={slowdown}") for m in methods
        }
        expect_cases(configs.values())
        with contextlib.ExitStack() as stack:  # each method's workers kept for its rounds
            runners = {m: stack.enter_context(CaseRunner(configs[m])) for m in methods}
            for _ in range(REAL_ROUNDS):
                for m in running:
                    record = runners[m].run()
                    compute = pooled_compute_s(record.emulation)
                    ratios[m].append(record.iter_time_s_mean / compute if record.status == "ok" and compute else None)
                running = [m for m in running if None not in ratios[m]]
                if baseline and all(_settled(figure[m], ratios[m], baseline) for m in running):
                    break
    return {figure[m]: r for m, r in ratios.items() if None not in r}


def _settled(figure: str, values: list[float], baseline: dict[str, float]) -> bool:
    """Whether a measured figure's verdict can no longer change: a round of it is within its
    baseline's tolerance (compare then cannot find every round past)."""
    return figure in baseline and any(_within(figure, v, baseline[figure]) for v in values)


def _within(figure: str, value: float, old: float) -> bool:
    """Whether a figure's value is within its kind's tolerance of its baseline value `old`."""
    better, tol = TOLERANCE[figure.split(":", 1)[0]]
    return value <= old * (1 + tol) if better == "lower" else value >= old * (1 - tol)


def medians(rounds: dict[str, list[float]]) -> dict[str, float]:
    """Each measured figure's value: the median of its rounds."""
    return {k: statistics.median(r) for k, r in rounds.items()}


def measured_figures(slowdown: float = 0.0, methods: list[str] | None = None) -> dict[str, float]:
    """The measured figures, each the median of its rounds (measured_rounds)."""
    return medians(measured_rounds(slowdown, methods))


def _selected(figure: str, chosen: dict[str, list[str]]) -> bool:
    """Whether a figure (kind:model[-preset]/cluster/method) is among the chosen models and methods."""
    model, _, method = figure.split(":", 1)[1].split("/")
    return method in chosen.get("method", [method]) and model.split("-")[0] in chosen.get(
        "model", [model.split("-")[0]]
    )


def compare(
    baseline: dict[str, float], new: dict[str, float], rounds: dict[str, list[float]] | None = None
) -> list[Change]:
    """Each figure's change against the baseline. A figure with `rounds` (measured) regressed when
    every round is past its tolerance; any other when its value is."""
    rounds = rounds or {}
    changes = []
    for figure in sorted(set(baseline) | set(new)):
        old, cur = baseline.get(figure), new.get(figure)
        if old is None or cur is None:
            # A figure that disappeared (a case stopped planning) is a regression; a new one is not.
            changes.append(Change(figure, old, cur, regressed=cur is None))
            continue
        values = rounds.get(figure, [cur])
        past = sum(not _within(figure, v, old) for v in values)
        changes.append(
            Change(
                figure, old, cur, regressed=past == len(values), past=(past, len(values)) if figure in rounds else None
            )
        )
    return changes


def report_table(changes: list[Change], baseline_commit: str | None) -> Table:
    table = Table(title=f"regression check against baseline {str(baseline_commit)[:10]}")
    for col in ("figure", "baseline", "new", "change", "rounds past", "baseline commit", "verdict"):
        table.add_column(col, justify="left" if col in ("figure", "verdict") else "right")
    for c in changes:
        table.add_row(
            c.figure,
            "-" if c.baseline is None else f"{c.baseline:.6g}",
            "-" if c.new is None else f"{c.new:.6g}",
            "-" if c.change is None else f"{c.change:+.1%}",
            "-" if c.past is None else f"{c.past[0]}/{c.past[1]}",
            str(baseline_commit)[:10],
            "REGRESSION" if c.regressed else "ok",
        )
    return table


def render(table: Table) -> str:
    buffer = io.StringIO()
    Console(file=buffer, width=160).print(table)
    return buffer.getvalue()


def load_baseline(path: Path | None = None) -> dict:
    path = path or BASELINE_FILE
    if not path.exists():
        raise SystemExit(
            f"error: no baseline at {path}; create one with `python -m bench.regress --rebaseline` and commit it"
        )
    return json.loads(path.read_text())


def measured_sessions(sessions: int, slowdown: float = 0.0) -> tuple[dict[str, float], list[dict[str, float]]]:
    """The measured figures `sessions` times over (each a full measured_figures, its own
    interleaved rounds), and per figure the median over the sessions: a baseline from one
    session carries that session's state of the host (the same code's figures move between
    sessions an hour apart: docs/regression.md, "Rebaselining"), and every
    later check is judged against it."""
    runs = [measured_figures(slowdown) for _ in range(sessions)]
    keys = set.intersection(*(set(r) for r in runs)) if runs else set()
    return {k: statistics.median(r[k] for r in runs) for k in sorted(keys)}, runs


def kept_measured(base: dict) -> tuple[dict[str, float], list | None, dict]:
    """A baseline's measured figures, their sessions and where they were measured (its commit
    and date, or those it kept them from): what `--rebaseline --no-measured` carries over."""
    figures = {k: v for k, v in base["figures"].items() if k.startswith("iter_over_compute:")}
    origin = base.get("measured_from") or {"git_sha": base.get("git_sha"), "created": base.get("created")}
    return figures, base.get("measured_sessions"), origin


def add_to_baseline(
    base: dict,
    figures: dict[str, float],
    methods: list[str],
    sessions: list | None,
    note: str | None,
    path: Path | None = None,
) -> None:
    """Write `base` with the figures of `methods` added or replaced by `figures` (a new method
    joins the check without measuring the others again): the rest of the baseline, its
    fingerprint included, is kept, and an `added` entry says which methods came when, from which
    commit and why (with their measured sessions)."""
    path = path or BASELINE_FILE
    kept = {k: v for k, v in base["figures"].items() if not _selected(k, {"method": methods})}
    entry = {"methods": methods, "created": datetime.now(UTC).isoformat(), **fingerprint()}
    if sessions is not None:
        entry["measured_sessions"] = sessions
    if note:
        entry["note"] = note
    body = {**base, "figures": {**kept, **figures}, "added": [*base.get("added", []), entry]}
    path.write_text(json.dumps(body, indent=1, sort_keys=True) + "\n")
    print(f"wrote {len(figures)} figures of {', '.join(methods)} to {path} ({len(kept)} kept)")


def write_baseline(
    figures: dict[str, float],
    path: Path | None = None,
    sessions: list | None = None,
    note: str | None = None,
    measured_from: dict | None = None,
) -> None:
    path = path or BASELINE_FILE
    path.parent.mkdir(parents=True, exist_ok=True)
    body = {"created": datetime.now(UTC).isoformat(), **fingerprint(), "tolerance": TOLERANCE, "figures": figures}
    if sessions is not None:  # the measured figures of each session (figures holds their median)
        body["measured_sessions"] = sessions
    if measured_from is not None:  # measured figures kept from an earlier baseline: its commit and date
        body["measured_from"] = measured_from
    if note:
        body["note"] = note
    path.write_text(json.dumps(body, indent=1, sort_keys=True) + "\n")
    print(f"wrote {len(figures)} figures to {path}")
