"""One case across several nodes of a Slurm (or submitit local) job: one task per node, each
starting torchrun for its node's devices.

    python -m bench.run -m hydra/launcher=slurm_multinode hydra.launcher.nodes=8 ...

submitit runs the runner once per task. Task i runs the cluster's machine i: it starts
`torchrun --nnodes=<tasks> --node-rank=i --nproc-per-node=<machine i's devices>` with the first
host as rendezvous (static: node ranks are the task ranks, so global ranks follow the cluster's
device order) and waits. The torchrun path of bench.run then does the rest: rank 0 prepares the
case, broadcasts it and writes the row. This module knows nothing of Hydra configs.
"""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

from bench.core.cluster import ClusterSpec
from bench.core.errors import ConfigError

RUN_ID_ENV = "HETBENCH_RUN_ID"  # the row's run_id, chosen by task 0 and written by torchrun's rank 0
_PORTS = (15000, 30000)  # rendezvous ports derive from the job id: every task picks the same one


@dataclass(frozen=True)
class NodeTask:
    """This process's place in a multi-task submitit job."""

    rank: int  # the task's global rank (Slurm: SLURM_PROCID)
    num_tasks: int
    num_nodes: int
    hostnames: tuple[str, ...]  # the job's hosts, in Slurm's order
    job_id: str
    local: bool  # submitit's local executor: every task on this host

    @property
    def master_addr(self) -> str:
        return "127.0.0.1" if self.local else self.hostnames[0]

    @property
    def master_port(self) -> int:
        low, high = _PORTS
        return low + int(hashlib.sha256(self.job_id.encode()).hexdigest(), 16) % (high - low)


def current_task() -> NodeTask | None:
    """The task of a submitit job with several tasks that this process runs as, else None
    (no submitit job, or a job of one task: the case runs as usual)."""
    if not os.environ.get("SUBMITIT_EXECUTOR"):
        return None
    import submitit

    env = submitit.JobEnvironment()
    if env.num_tasks < 2:
        return None
    return NodeTask(
        rank=env.global_rank,
        num_tasks=env.num_tasks,
        num_nodes=env.num_nodes,
        hostnames=tuple(env.hostnames),
        job_id=str(env.job_id),
        local=env.cluster == "local",
    )


def devices_per_node(task: NodeTask, cluster: ClusterSpec) -> list[int]:
    """The devices each task's torchrun starts: machine i's on task i. ConfigError with the
    launcher setting to change when the job does not have one task per machine."""
    machines = [g.num_devices for g in cluster.machines for _ in range(g.count)]
    if task.num_tasks != len(machines):
        raise ConfigError(
            f"hydra.launcher.nodes x tasks_per_node gives {task.num_tasks} tasks but "
            f"cluster={cluster.name} has {len(machines)} machines; a task runs one machine: set "
            f"hydra.launcher.nodes={len(machines)} hydra.launcher.tasks_per_node=1"
        )
    if task.num_tasks != task.num_nodes and not (cluster.emulated or task.local):
        raise ConfigError(
            f"hydra.launcher.tasks_per_node={task.num_tasks // task.num_nodes} puts several "
            f"torchruns on one node of cluster={cluster.name}, which would share its GPUs; set "
            f"hydra.launcher.tasks_per_node=1 and hydra.launcher.nodes={task.num_tasks}"
        )
    return machines


def torchrun_command(task: NodeTask, nproc: int, overrides: list[str], log_dir: Path) -> list[str]:
    """This task's torchrun, running `python -m bench.run <overrides>` on `nproc` workers and
    keeping what it logs per attempt and rank under `log_dir` (by default, a new folder in /tmp
    on every run)."""
    return [
        sys.executable,
        "-m",
        "torch.distributed.run",
        f"--nnodes={task.num_tasks}",
        f"--node-rank={task.rank}",
        f"--nproc-per-node={nproc}",
        f"--master-addr={task.master_addr}",
        f"--master-port={task.master_port}",
        f"--log-dir={log_dir}",
        "-m",
        "bench.run",
        *overrides,
    ]


def run_torchrun(command: list[str], run_id: str, timeout_s: float) -> int | None:
    """Run `command` and return its exit status; None if it ran past `timeout_s` and was
    stopped (SIGTERM: torchrun stops its workers; SIGKILL if it has not within 30 s)."""
    proc = subprocess.Popen(command, env={**os.environ, RUN_ID_ENV: run_id}, cwd=Path.cwd())
    try:
        return proc.wait(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        return None
    finally:  # also when this task is interrupted: no torchrun outlives it
        if proc.poll() is None:
            proc.terminate()
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
