"""The runner: one case = (model, preset, cluster, method, mode) from a Hydra config -> one row.

    python -m bench.run model=bert preset=tiny cluster=local_hetero2 method=dp_cp
    python -m bench.run -m method=dp_ev,dp_cp cluster=local_hetero2,local_hetero4

The one @hydra.main of the harness: it reads the config and hands it to bench.runner, which
prepares, runs and records the case. It does not know any concrete method or model: `_target_`
in conf/ wires them.
"""

from __future__ import annotations

import logging
import os
import sys

import hydra
from omegaconf import DictConfig

from bench.core.errors import ConfigError
from bench.core.paths import CONF_SOURCE
from bench.records.table import print_table
from bench.runner.configs import check_group_choices
from bench.runner.execute import failed_cases, run_case
from bench.runner.rounds import run_rounds
from bench.runner.torchrun import run_across_nodes, run_under_torchrun
from bench.runtime.multinode import current_task


@hydra.main(config_path=CONF_SOURCE, config_name="config", version_base="1.3")
def main(cfg: DictConfig) -> None:
    logging.getLogger("torch.distributed").setLevel(logging.WARNING)
    if "TORCHELASTIC_RUN_ID" in os.environ:
        run_under_torchrun(cfg)
        return
    task = current_task()
    if task is not None:  # a task of a multi-node submitit job
        run_across_nodes(cfg, task)
        return
    repeats = cfg.repeats  # an invalid value fails in run_case, as a failed row with the fix
    if isinstance(repeats, int) and not isinstance(repeats, bool) and repeats > 1 and cfg.mode == "real":
        record = run_rounds({cfg.method.name: cfg}, cfg.repeats)[0]
    else:
        record = run_case(cfg)
    print_table([record.__dict__])


def run_cli() -> int:
    """`python -m bench.run` and `hetbench run`: check the group choices, run (Hydra reads
    sys.argv), and return the exit status: 1 when a case of this process did not end ok."""
    try:
        check_group_choices(sys.argv[1:])
    except ConfigError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    main()
    return 1 if failed_cases else 0


if __name__ == "__main__":
    sys.exit(run_cli())
