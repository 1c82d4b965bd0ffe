"""Hydra --multirun sweeps: their size and axes, the methods they name, and the table at their end.

SweepSummary is a Hydra callback: Hydra hands it the sweep's config as composed (a DictConfig),
of which it reads Hydra's own node (the sweep's parameters and overrides), the results folder and
the loggers.
"""

from __future__ import annotations

import math
import sys
import time
from datetime import UTC, datetime

from hydra.experimental.callback import Callback
from omegaconf import DictConfig, OmegaConf

from bench.records.progress import interactive
from bench.records.rows import (
    load_records,
)
from bench.records.table import print_table
from bench.records.tracking import track_sweep
from bench.runner.configs import method_target, results_file
from bench.runner.execute import expect_methods, make_trackers
from bench.runner.outcome import Outcome, add_outcome


class SweepSummary(Callback):
    """Hydra callback: progress of a --multirun sweep (cases done, ETA; on a terminal only),
    then one table of every row the sweep recorded, and the outcome of the rows that jobs run
    in other processes recorded (bench.runner.outcome)."""

    def __init__(self) -> None:
        self._here: set[str] = set()  # output dirs of the jobs run in this process

    def on_multirun_start(self, config: DictConfig, **kwargs) -> None:
        self._started = datetime.now(UTC).isoformat()
        self._t0, self._done, self._total = time.monotonic(), 0, sweep_size(config)
        # The basic launcher runs the jobs in this process: the workers' server that the first
        # job starts preloads the methods of the later ones too (expect_cases).
        expect_methods(swept_method_targets(config))

    def on_job_end(self, config: DictConfig, job_return, **kwargs) -> None:
        # This job ran here: its errors were shown as it ran, and its outcome came back to the command.
        self._here.add(str(OmegaConf.select(config, "hydra.runtime.output_dir", default="")))
        if not hasattr(self, "_t0") or not interactive():
            return
        self._done += 1
        elapsed = time.monotonic() - self._t0
        eta = elapsed / self._done * (self._total - self._done) if self._total else None
        print(
            f"sweep: {self._done}/{self._total or '?'} cases, {elapsed:.0f} s"
            + (f", eta {eta:.0f} s" if eta is not None else ""),
            file=sys.stderr,
            flush=True,
        )

    def on_multirun_end(self, config: DictConfig, **kwargs) -> None:
        # Only what the table needs: the sweep's config also holds Hydra's node, which does not
        # resolve outside a job.
        outputs = {
            "results_dir": config.results_dir,
            "logger": OmegaConf.to_container(config.logger, resolve=True) if config.get("logger") else None,
        }
        path = results_file(outputs)
        rows = [r for r in load_records(path) if r.get("timestamp", "") >= self._started]
        # Launchers that run jobs in other processes (submitit) report their failures here only:
        # their outcome, and one line each for errors this process has not shown.
        elsewhere = [r for r in rows if r.get("output_dir") is None or str(r["output_dir"]) not in self._here]
        for r in elsewhere:
            if r.get("status") != "ok" and r.get("error"):
                case = f"{r['model']}/{r['cluster']}/{r['method']}"
                print(f"error: {case}: {r['error'].strip().splitlines()[-1]}", file=sys.stderr)
        add_outcome(Outcome.of(elsewhere))
        if rows:
            print_table(rows, title=f"hetbench sweep: {len(rows)} cases")
            track_sweep(make_trackers(outputs), rows, path)


def sweep_axes(params: dict[str, str]) -> list[list[str]]:
    """Each key's `key=value` choices, as Hydra's basic sweeper expands `key=a,b` (or range(),
    choice(), ...); a key with one value has one choice. A sweep is their product."""
    from hydra.core.override_parser.overrides_parser import OverridesParser

    parser = OverridesParser.create()
    axes = []
    for key, values in params.items():
        override = parser.parse_override(f"{key}={values}")
        choices = (
            override.sweep_string_iterator() if override.is_sweep_override() else [override.get_value_element_as_str()]
        )
        axes.append([f"{key}={v}" for v in choices])
    return axes


def sweep_params(config: DictConfig) -> dict[str, str]:
    """A --multirun sweep's `key: values` (command line and the experiment's
    hydra.sweeper.params; the command line wins for a key)."""
    params = {str(k): str(v) for k, v in (config.hydra.sweeper.get("params") or {}).items()}
    for item in config.hydra.overrides.task:
        key, _, value = str(item).partition("=")
        params[key] = value
    return params


def sweep_size(config: DictConfig) -> int | None:
    """How many cases a --multirun sweep has: the product of its swept values."""
    try:
        return math.prod(len(axis) for axis in sweep_axes(sweep_params(config)))
    except Exception:  # progress is a courtesy: a sweep syntax it cannot count shows no total
        return None


def swept_method_targets(config: DictConfig) -> list[str]:
    """The `_target_` of each method a --multirun sweep names (method/<name>.yaml in the config
    folders, the user's first); none where the sweep's syntax or a method's file cannot be read
    (its job then says why)."""
    try:
        axis = next((a for a in sweep_axes(sweep_params(config)) if a[0].startswith("method=")), [])
    except Exception:
        return []
    targets = [method_target(choice.partition("=")[2]) for choice in axis]
    return [t for t in targets if t is not None]
