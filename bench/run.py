"""The runner: one case = (model, preset, cluster, method, mode) from a Hydra config -> one row.

    python -m bench.run model=bert preset=tiny cluster=local_hetero2 method=dp_cp
    python -m bench.run -m method=dp_ev,dp_cp cluster=local_hetero2,local_hetero4
    python -m bench.run --config-dir mine cluster=lab     # a folder of your own configs

The one @hydra.main of the harness: it reads the config into typed Settings (bench.runner.settings)
and hands them to bench.runner, which prepares, runs and records the case. It does not know any
concrete method or model: `_target_` in conf/ wires them.
"""

from __future__ import annotations

import logging
import os
import sys
from contextlib import contextmanager
from datetime import UTC, datetime

import hydra
from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig

from bench.core.errors import ConfigError
from bench.core.paths import CONF_SOURCE
from bench.records.table import print_table
from bench.runner.configs import (
    CONFIG_ERRORS,
    check_group_choices,
    hydra_error_line,
    record_sources,
    take_config_dirs,
)
from bench.runner.execute import record_refused, run_case
from bench.runner.outcome import Outcome, collecting
from bench.runner.rounds import run_rounds
from bench.runner.settings import as_settings
from bench.runner.torchrun import run_across_nodes, run_under_torchrun
from bench.runtime.multinode import current_task


def main(cfg: DictConfig) -> Outcome:
    """The task function: one job of Hydra's (a case, or a case's rounds) to its rows, and what
    they came to. A failed case is a row and one line, never an exception: Hydra's basic sweeper
    would stop the sweep at one."""
    logging.getLogger("torch.distributed").setLevel(logging.WARNING)
    runtime = HydraConfig.get().runtime
    record_sources(cfg, runtime.choices, runtime.config_sources)
    torchrun = "TORCHELASTIC_RUN_ID" in os.environ
    since = datetime.now(UTC).isoformat()
    try:
        settings = as_settings(cfg)
    except ConfigError as refused:  # the case fails with its row and one line (rank 0's alone under torchrun)
        if torchrun and os.environ.get("RANK", "0") != "0":
            return Outcome()
        try:
            return Outcome.of([record_refused(cfg, refused)])
        except ConfigError as exc:  # a config that does not even resolve: one line, no row
            print(f"error: {exc}", file=sys.stderr)
            return Outcome(failed=("config",))
    if torchrun:
        return run_under_torchrun(settings)
    task = current_task()
    if task is not None:  # a task of a multi-node submitit job
        return run_across_nodes(settings, task)
    if settings.repeats > 1 and settings.mode == "real":
        record = run_rounds({settings.method_name: settings}, settings.repeats)[0]
    else:
        record = run_case(settings)
    print_table([record.__dict__])
    return Outcome.of([record], since)


@contextmanager
def _hydra_errors_raised():
    """Hydra prints its own errors over several lines and exits; with HYDRA_FULL_ERROR it raises
    them instead, for run_cli to print as one line."""
    before = os.environ.get("HYDRA_FULL_ERROR")
    os.environ["HYDRA_FULL_ERROR"] = "1"
    try:
        yield
    finally:
        if before is None:
            del os.environ["HYDRA_FULL_ERROR"]
        else:
            os.environ["HYDRA_FULL_ERROR"] = before


def run_cli() -> int:
    """`python -m bench.run` and `hetbench run`: check the config folders and group choices,
    run (Hydra reads sys.argv), and return the exit status: 2 for a config refused before any
    case (one line), 1 when a case of this process did not end ok."""
    try:
        sys.argv[1:] = take_config_dirs(sys.argv[1:], keep=True)
        check_group_choices(sys.argv[1:])
    except ConfigError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    # The jobs Hydra runs here return their outcomes through this task function; a sweep's
    # callback adds those of jobs run elsewhere (bench.runner.outcome).
    with collecting() as outcomes:
        app = hydra.main(config_path=CONF_SOURCE, config_name="config", version_base="1.3")(
            lambda cfg: outcomes.add(main(cfg))
        )
        try:
            with _hydra_errors_raised():
                app()
        except (*CONFIG_ERRORS, ConfigError) as exc:
            print(f"error: {hydra_error_line(exc)}", file=sys.stderr)
            return 2
    return outcomes.total.exit_status


if __name__ == "__main__":
    sys.exit(run_cli())
