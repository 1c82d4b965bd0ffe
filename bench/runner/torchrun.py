"""One case under torchrun (one process per device, possibly across hosts) and across the nodes of a
Slurm or submitit job.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

from bench.core.cluster import ClusterSpec
from bench.core.errors import ConfigError
from bench.records.rows import (
    load_records,
)
from bench.records.table import print_table
from bench.runner.case import new_record, prepare_case
from bench.runner.configs import results_file
from bench.runner.execute import fill_metrics, run_case, write_record
from bench.runner.outcome import Outcome
from bench.runner.settings import Settings
from bench.runtime.multinode import (
    RUN_ID_ENV,
    NodeTask,
    devices_per_node,
    run_torchrun,
    torchrun_command,
)
from bench.runtime.worker import (
    CPU_ONLY_ENV,
    backend_for,
    init_process_group,
    pick_device,
    run_rank,
)


def run_under_torchrun(cfg: Settings) -> Outcome:
    """torchrun started this process: rank 0 prepares the case once and broadcasts it; every
    rank trains; rank 0 writes the row. torchrun itself stops all ranks if one fails. Returns
    the case's outcome (every rank's, where the case was refused; rank 0's, where it ran)."""
    import torch.distributed as dist

    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    try:  # where the ranks compute: a cluster on cpu runs on gloo and hides the GPUs
        cluster = ClusterSpec.from_config(cfg.cluster, cfg.config_roots())
    except ConfigError:
        cluster = None  # rank 0's prepare_case reports it below, on a process group of GPUs
    if cluster is not None and cluster.device == "cpu":
        # Before anything asks CUDA for its devices (the row's fingerprint does): from then on
        # the process keeps the devices it saw.
        os.environ.update(CPU_ONLY_ENV)
    device = pick_device(local_rank, cluster)
    init_process_group(rank, world, device, None if cluster is None else backend_for(cluster, device))
    record = new_record(cfg)
    record.run_id = os.environ.get(RUN_ID_ENV) or record.run_id  # a multi-node job's, if any
    box: list = [None, None]
    if rank == 0:
        try:
            box[0] = prepare_case(cfg, record, world_size=world)
        except ConfigError as exc:
            box[1] = str(exc)
    dist.broadcast_object_list(box, src=0)
    case, error = box
    if error is not None:
        if rank == 0:
            record.error = error
            print(f"error: {error}", file=sys.stderr)
            write_record(cfg, record)
        dist.destroy_process_group()
        return Outcome(failed=(record.method,))
    results = run_rank(case, rank, world, local_rank, gather=True)
    if rank != 0:
        return Outcome()
    fill_metrics(record, results, case.workload, cfg.measured_iters)
    write_record(cfg, record)
    print_table([record.__dict__])
    return Outcome.of([record])


def run_across_nodes(cfg: Settings, task: NodeTask) -> Outcome:
    """One task of a multi-node job (bench.runtime.multinode): start this node's torchrun on the same
    overrides and wait. Task 0 makes sure the case gets its row: torchrun's rank 0 writes it,
    and task 0 writes a failed (or timeout) row if torchrun ended before that. Returns task 0's
    outcome (the other tasks answer for nothing: task 0 does for the case)."""
    from hydra.core.hydra_config import HydraConfig

    record = new_record(cfg)
    if cfg.mode == "sim":  # nothing to run on the other nodes
        return Outcome.of([run_case(cfg)], record.timestamp) if task.rank == 0 else Outcome()
    try:
        if cfg.repeats != 1:
            raise ConfigError(
                f"repeats={cfg.repeats!r}: a multi-node job runs one case once; set "
                "repeats=1 (and sweep, e.g. -m +round=1,2,3, to repeat it)"
            )
        cluster = ClusterSpec.from_config(cfg.cluster, cfg.config_roots())
        nproc = devices_per_node(task, cluster)[task.rank]
    except ConfigError as exc:  # every task sees it; task 0 reports and records it
        if task.rank != 0:
            return Outcome()
        record.error = str(exc)
        print(f"error: {exc}", file=sys.stderr)
        write_record(cfg, record)
        return Outcome.of([record])
    hydra_cfg = HydraConfig.get()
    run_dir = Path(hydra_cfg.runtime.output_dir) / f"node{task.rank}"
    overrides = [*hydra_cfg.overrides.task, f"hydra.run.dir={run_dir}"]
    if cfg.config_dirs:  # the user's config folders, for the nodes' runners too
        overrides.append(f"hydra.searchpath=[{','.join(f'file://{d}' for d in cfg.config_dirs)}]")
    code = run_torchrun(torchrun_command(task, nproc, overrides, run_dir / "torchrun"), record.run_id, cfg.timeout_s)
    if task.rank != 0:
        return Outcome()
    if any(row.get("run_id") == record.run_id for row in load_records(results_file(cfg))):
        return Outcome() if code == 0 else Outcome(failed=(f"{record.model}/{record.cluster}/{record.method}",))
    if code is None:
        record.status, record.error = "timeout", f"case did not finish within timeout_s={cfg.timeout_s:g}"
    else:
        record.error = (
            f"torchrun on node 0 exited with code {code} before rank 0 recorded the "
            f"case; its output is in the job's log ({run_dir} and the submitit folder)"
        )
    print(f"error: {record.error}", file=sys.stderr)
    write_record(cfg, record)
    return Outcome.of([record])
