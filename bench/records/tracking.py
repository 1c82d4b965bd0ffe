"""Trackers (conf/logger/): mirror written rows to W&B, TensorBoard or CSV files, per case and per sweep.

They only mirror: the JSONL row is written first and is the record of truth. A tracker never
fails a case (`track_case` and `track_sweep` turn its errors into warnings) and imports its
library lazily, so an uninstalled one costs a warning, not a run.
"""

from __future__ import annotations

import csv
import json
import logging
import os
import re
import shutil
import tempfile
from collections.abc import Iterable
from dataclasses import asdict
from datetime import UTC, datetime
from pathlib import Path

from bench.records.rows import RunRecord

log = logging.getLogger(__name__)

WANDB_MODES = ("offline", "online", "disabled")
TENSORBOARDX_PIN = "tensorboardX==2.6.5"  # the `tracking` extra of pyproject.toml

# Per measured iteration: (tracker key, CSV column). W&B and TensorBoard use the key.
STEP_FIELDS = (
    ("train/loss", "loss"),
    ("time/iter_s", "iter_time_s"),
    ("throughput/samples_per_s", "samples_per_s"),
    ("throughput/tokens_per_s", "tokens_per_s"),
    ("mem/peak_gib", "peak_mem_gib"),
)
# One line per row in a sweep's table.
SWEEP_COLUMNS = (
    "model",
    "preset",
    "cluster",
    "method",
    "mode",
    "origin",
    "row_kind",
    "repeat",
    "status",
    "iter_time_s_mean",
    "iter_time_s_std",
    "samples_per_s",
    "tokens_per_s",
    "efficiency",
    "peak_mem_gib",
    "loss_first",
    "loss_last",
    "predicted_iter_time_s",
    "planner_time_s",
    "run_id",
    "error",
)
# Row fields too large or too nested for a run summary.
_NOT_SUMMARY = ("config", "plan", "iter_times_s", "loss_per_iter", "peak_mem_gib_per_iter")
_warned: set[str] = set()


def _warn_once(key: str, message: str, *args) -> None:
    if key not in _warned:
        _warned.add(key)
        log.warning(message, *args)


def step_metrics(record: RunRecord) -> list[dict[str, float]]:
    """The row's per-iteration series as one dict per measured iteration (keys: STEP_FIELDS).

    Throughput per step is the global batch over that step's time; tokens/s only for rows that
    have tokens_per_s (language models). Loss and memory appear where the row carries them.
    """
    times = record.iter_times_s or []
    losses = record.loss_per_iter or []
    mems = record.peak_mem_gib_per_iter or []
    tokens_per_sample = (
        record.tokens_per_s / record.samples_per_s if record.tokens_per_s and record.samples_per_s else None
    )
    steps = []
    for i, t in enumerate(times):
        step = {}
        if i < len(losses):
            step["train/loss"] = losses[i]
        step["time/iter_s"] = t
        if record.global_batch and t > 0:
            step["throughput/samples_per_s"] = record.global_batch / t
            if tokens_per_sample is not None:
                step["throughput/tokens_per_s"] = record.global_batch * tokens_per_sample / t
        if i < len(mems):
            step["mem/peak_gib"] = mems[i]
        steps.append(step)
    return steps


def summary_metrics(record: RunRecord) -> dict:
    """The row without its config, plan and per-iteration lists, and without nulls."""
    return {k: v for k, v in asdict(record).items() if k not in _NOT_SUMMARY and v is not None}


def sweep_table(rows: Iterable[dict]) -> tuple[list[str], list[list]]:
    """Columns and one line per row; per-rank memory as its max, an error as its last line."""
    data = []
    for row in rows:
        line = []
        for col in SWEEP_COLUMNS:
            value = row.get(col)
            if col == "peak_mem_gib" and isinstance(value, list):
                value = max(value) if value else None
            if col == "error" and isinstance(value, str):
                value = value.strip().splitlines()[-1] if value.strip() else None
            line.append(value)
        data.append(line)
    return list(SWEEP_COLUMNS), data


def run_name(record: RunRecord) -> str:
    return f"{record.model}-{record.preset}/{record.cluster}/{record.method}/{record.mode}"


def _slug(text: str) -> str:
    return re.sub(r"[^A-Za-z0-9_.-]+", "_", text).strip("_")


def _stamp() -> str:
    return datetime.now(UTC).strftime("%Y%m%d-%H%M%S-%f")


class Tracker:
    """What every logger offers; each method may do nothing."""

    def log_case(self, record: RunRecord, records_path: Path) -> None:
        """Mirror one written row (`records_path` is the JSONL file that holds it)."""

    def log_rounds(self, aggregate: RunRecord, repeats: list[RunRecord], records_path: Path) -> None:
        """Mirror one case of a comparison: its rounds' rows and their aggregate row (by default,
        each as a case)."""
        for record in (*repeats, aggregate):
            self.log_case(record, records_path)

    def log_sweep(self, rows: list[dict], records_path: Path) -> None:
        """Mirror the rows one sweep wrote, as one table."""

    def log_figure(self, name: str, files: list[Path]) -> None:
        """Keep a figure's files (PNG, PDF, CSVs) as an artifact."""


def track_case(trackers: Iterable[Tracker], record: RunRecord, records_path: Path) -> None:
    """Give the written row to every tracker; a tracker's error is a warning, never a failure."""
    for tracker in trackers:
        try:
            tracker.log_case(record, Path(records_path))
        except Exception as exc:  # the row is already written: a mirror must never cost it
            log.warning(
                "logger %s failed on run %s (%s: %s); the JSONL row is kept",
                type(tracker).__name__,
                record.run_id,
                type(exc).__name__,
                exc,
            )


def track_rounds(
    trackers: Iterable[Tracker], aggregate: RunRecord, repeats: list[RunRecord], records_path: Path
) -> None:
    """Give a comparison's case (its rounds and their aggregate) to every tracker; a tracker's
    error is a warning, never a failure."""
    for tracker in trackers:
        try:
            tracker.log_rounds(aggregate, repeats, Path(records_path))
        except Exception as exc:  # the rows are already written
            log.warning(
                "logger %s failed on the rounds of %s (%s: %s); the JSONL rows are kept",
                type(tracker).__name__,
                run_name(aggregate),
                type(exc).__name__,
                exc,
            )


def track_sweep(trackers: Iterable[Tracker], rows: list[dict], records_path: Path) -> None:
    for tracker in trackers:
        try:
            tracker.log_sweep(rows, Path(records_path))
        except Exception as exc:
            log.warning(
                "logger %s failed on the sweep table (%s: %s); the JSONL rows are kept",
                type(tracker).__name__,
                type(exc).__name__,
                exc,
            )


def track_figure(trackers: Iterable[Tracker], name: str, files: list[Path]) -> None:
    for tracker in trackers:
        try:
            tracker.log_figure(name, [Path(f) for f in files])
        except Exception as exc:  # the figure is already on disk
            log.warning(
                "logger %s failed on figure %s (%s: %s); the files are kept",
                type(tracker).__name__,
                name,
                type(exc).__name__,
                exc,
            )


class WandbLogger(Tracker):
    """One W&B run per case (a comparison's case: its rounds together): per-step metrics, the
    row as summary, and an artifact holding the row, its plan and the records file; one run per
    sweep holding a table of its rows. W&B's own readings of the host (installed packages, git,
    machine, system metrics) are off: the row records versions, commit and hardware, and those
    readings took about a second per run."""

    def __init__(self, mode: str = "offline", project: str = "hetbench", dir: str = "."):
        if mode not in WANDB_MODES:
            raise ValueError(f"wandb.mode={mode!r} is invalid; valid: {', '.join(WANDB_MODES)}")
        self.mode, self.project, self.dir = mode, project, str(dir)

    def _init(self, **kwargs):
        os.environ.setdefault("WANDB_SILENT", "true")
        import wandb

        Path(self.dir).mkdir(parents=True, exist_ok=True)
        settings = wandb.Settings(
            x_save_requirements=False, disable_git=True, x_disable_machine_info=True, x_disable_stats=True
        )
        return wandb, wandb.init(mode=self.mode, project=self.project, dir=self.dir, settings=settings, **kwargs)

    def log_case(self, record: RunRecord, records_path: Path) -> None:
        self._log_run(record, [record], records_path)

    def log_rounds(self, aggregate: RunRecord, repeats: list[RunRecord], records_path: Path) -> None:
        """One W&B run for the case: every round's steps (numbered on, each with its `round`),
        the aggregate row as the summary, every row in the artifact."""
        self._log_run(aggregate, repeats, records_path)

    def _log_run(self, record: RunRecord, stepped: list[RunRecord], records_path: Path) -> None:
        if self.mode == "disabled":
            return
        wandb, run = self._init(
            config=record.config,
            name=run_name(record),
            group=record.case_key or None,
            job_type=record.mode,
            tags=[record.model, record.cluster, record.method, record.status],
        )
        try:
            i = 0
            for row in stepped:
                for step in step_metrics(row):
                    run.log(step if row.repeat is None else {**step, "round": row.repeat}, step=i)
                    i += 1
            run.summary.update(summary_metrics(record))
            artifact = wandb.Artifact(
                f"case-{record.run_id}", type="case", metadata={"case_key": record.case_key, "status": record.status}
            )
            with tempfile.TemporaryDirectory() as tmp:
                row_file = Path(tmp) / "row.json"
                row_file.write_text(json.dumps(asdict(record), default=str, indent=1))
                artifact.add_file(str(row_file), name="row.json")
                if stepped != [record]:
                    rounds_file = Path(tmp) / "rounds.jsonl"
                    rounds_file.write_text("".join(json.dumps(asdict(r), default=str) + "\n" for r in stepped))
                    artifact.add_file(str(rounds_file), name="rounds.jsonl")
                if record.plan is not None:
                    plan_file = Path(tmp) / "plan.json"
                    plan_file.write_text(json.dumps(record.plan, default=str, indent=1))
                    artifact.add_file(str(plan_file), name="plan.json")
                if records_path.exists():
                    artifact.add_file(str(records_path), name="records.jsonl")
                run.log_artifact(artifact)
        finally:
            run.finish()

    def log_sweep(self, rows: list[dict], records_path: Path) -> None:
        if self.mode == "disabled" or not rows:
            return
        wandb, run = self._init(
            name=f"sweep/{len(rows)} rows", job_type="sweep", tags=sorted({r.get("model", "?") for r in rows})
        )
        try:
            columns, data = sweep_table(rows)
            run.log({"sweep/rows": wandb.Table(columns=columns, data=data, allow_mixed_types=True)})
            if records_path.exists():
                artifact = wandb.Artifact(f"records-{_stamp()}", type="records")
                artifact.add_file(str(records_path), name="records.jsonl")
                run.log_artifact(artifact)
        finally:
            run.finish()

    def log_figure(self, name: str, files: list[Path]) -> None:
        if self.mode == "disabled":
            return
        wandb, run = self._init(name=f"figure/{name}", job_type="figure")
        try:
            artifact = wandb.Artifact(f"figure-{_slug(name)}", type="figure")
            for f in files:
                artifact.add_file(str(f), name=f.name)
            run.log_artifact(artifact)
            for f in files:
                if f.suffix == ".png":
                    run.log({f"figure/{name}": wandb.Image(str(f))})
        finally:
            run.finish()


class CsvLogger(Tracker):
    """Plain files under `dir`: steps/<run_id>.csv (one line per measured iteration),
    plans/<run_id>.json, and per sweep sweeps/<stamp>.csv (one line per row)."""

    def __init__(self, dir: str = "results/runs/csv"):
        self.dir = Path(dir)

    def log_case(self, record: RunRecord, records_path: Path) -> None:
        steps = step_metrics(record)
        if steps:
            path = self.dir / "steps" / f"{record.run_id}.csv"
            path.parent.mkdir(parents=True, exist_ok=True)
            fields = [(key, col) for key, col in STEP_FIELDS if any(key in s for s in steps)]
            with path.open("w", newline="") as f:
                writer = csv.writer(f)
                writer.writerow(["step", *(col for _, col in fields)])
                for i, step in enumerate(steps):
                    writer.writerow([i, *(step.get(key, "") for key, _ in fields)])
        if record.plan is not None:
            path = self.dir / "plans" / f"{record.run_id}.json"
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(json.dumps(record.plan, default=str, indent=1) + "\n")

    def log_sweep(self, rows: list[dict], records_path: Path) -> None:
        if not rows:
            return
        path = self.dir / "sweeps" / f"{_stamp()}.csv"
        path.parent.mkdir(parents=True, exist_ok=True)
        columns, data = sweep_table(rows)
        with path.open("w", newline="") as f:
            writer = csv.writer(f)
            writer.writerow(columns)
            writer.writerows([["" if v is None else v for v in line] for line in data])

    def log_figure(self, name: str, files: list[Path]) -> None:
        folder = self.dir / "figures" / name
        folder.mkdir(parents=True, exist_ok=True)
        for f in files:
            shutil.copyfile(f, folder / f.name)


class TensorBoardLogger(Tracker):
    """Event files under `dir` (tensorboardX): per case one run directory with per-step
    scalars and the row and plan as text; per sweep a text table of its rows.

    Without tensorboardX installed it warns once and writes nothing.
    """

    def __init__(self, dir: str = "results/runs/tensorboard"):
        self.dir = Path(dir)
        try:
            from tensorboardX import SummaryWriter
        except ImportError:
            _warn_once(
                "tensorboardX",
                "logger=tensorboard needs tensorboardX, which is not installed: "
                "pip install '%s' (scripts/setup.sh installs it); no TensorBoard files written",
                TENSORBOARDX_PIN,
            )
            SummaryWriter = None
        self._writer_cls = SummaryWriter

    def log_case(self, record: RunRecord, records_path: Path) -> None:
        if self._writer_cls is None:
            return
        logdir = self.dir / f"{_slug(run_name(record))}_{record.run_id}"
        writer = self._writer_cls(logdir=str(logdir))
        try:
            for i, step in enumerate(step_metrics(record)):
                for key, value in step.items():
                    writer.add_scalar(key, value, i)
            summary = summary_metrics(record)
            writer.add_text("row", "\n".join(f"- **{k}**: `{json.dumps(v, default=str)}`" for k, v in summary.items()))
            if record.plan is not None:
                writer.add_text("plan", "```\n" + json.dumps(record.plan, default=str, indent=1) + "\n```")
            writer.add_text("records", f"`{records_path}`")
        finally:
            writer.close()

    def log_sweep(self, rows: list[dict], records_path: Path) -> None:
        if self._writer_cls is None or not rows:
            return
        columns, data = sweep_table(rows)
        lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
        lines += ["| " + " | ".join(_cell(v) for v in line) + " |" for line in data]
        writer = self._writer_cls(logdir=str(self.dir / f"sweep-{_stamp()}"))
        try:
            writer.add_text("sweep/rows", "\n".join(lines))
            writer.add_text("sweep/records", f"`{records_path}`")
        finally:
            writer.close()

    def log_figure(self, name: str, files: list[Path]) -> None:
        if self._writer_cls is None:
            return
        writer = self._writer_cls(logdir=str(self.dir / f"figure-{_slug(name)}"))
        try:
            for f in files:
                if f.suffix == ".png":
                    import matplotlib.image

                    writer.add_image(f"figure/{name}", matplotlib.image.imread(str(f))[..., :3], dataformats="HWC")
                elif f.suffix == ".csv":
                    writer.add_text(f"figure/{f.stem}", "```\n" + f.read_text() + "```")
        finally:
            writer.close()


def _cell(value) -> str:
    if value is None:
        return ""
    if isinstance(value, float):
        return f"{value:.6g}"
    return str(value).replace("|", "/")
