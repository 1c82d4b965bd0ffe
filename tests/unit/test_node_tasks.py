"""bench.runtime.multinode: which devices each task's torchrun starts, and its command line."""

from __future__ import annotations

from pathlib import Path

import pytest
from omegaconf import OmegaConf

from bench.core.cluster import ClusterSpec
from bench.core.errors import ConfigError
from bench.runtime.multinode import NodeTask, current_task, devices_per_node, torchrun_command


def _cluster(config_factory, name: str, *overrides: str) -> ClusterSpec:
    cfg = config_factory(f"cluster={name}", *overrides)
    return ClusterSpec.from_config(OmegaConf.to_container(cfg.cluster, resolve=True))


def _task(rank=0, num_tasks=8, num_nodes=8, local=False) -> NodeTask:
    hosts = tuple(f"gpu{i:02d}" for i in range(num_nodes))
    return NodeTask(rank, num_tasks, num_nodes, hosts, job_id="4242", local=local)


def test_task_i_runs_machine_i_of_a_heterogeneous_cluster(config_factory):
    cluster = _cluster(config_factory, "paper_hetero", "cluster.gpus_per_machine=4")
    assert devices_per_node(_task(), cluster) == [4] * 8
    mixed = _cluster(config_factory, "paper_hetero", "cluster.machines.1.num_devices=2")
    assert devices_per_node(_task(), mixed) == [8, 8] + [2] * 6


def test_tasks_must_match_machines_and_gpu_nodes_take_one_task_each(config_factory):
    cluster = _cluster(config_factory, "paper_hetero")
    with pytest.raises(
        ConfigError,
        match=r"4 tasks but cluster=paper_hetero has 8 machines.*"
        r"set hydra.launcher.nodes=8",
    ):
        devices_per_node(_task(num_tasks=4, num_nodes=4), cluster)
    with pytest.raises(
        ConfigError,
        match=r"hydra.launcher.tasks_per_node=2 .* set "
        r"hydra.launcher.tasks_per_node=1 and hydra.launcher.nodes=8",
    ):
        devices_per_node(_task(num_tasks=8, num_nodes=4), cluster)
    emulated = _cluster(config_factory, "local_hetero2")  # emulated: tasks may share a host
    assert devices_per_node(_task(num_tasks=2, num_nodes=1), emulated) == [1, 1]


def test_every_task_builds_the_same_rendezvous_with_its_own_node_rank():
    first, third = _task(rank=0), _task(rank=2)
    cmd = torchrun_command(third, 8, ["method=hap", "cluster=paper_hetero"], Path("job/node2/torchrun"))
    assert cmd[1:3] == ["-m", "torch.distributed.run"]
    assert {
        "--nnodes=8",
        "--node-rank=2",
        "--nproc-per-node=8",
        "--master-addr=gpu00",
        "--log-dir=job/node2/torchrun",
    } <= set(cmd)
    assert first.master_port == third.master_port and 15000 <= first.master_port < 30000
    assert cmd[-4:] == ["-m", "bench.run", "method=hap", "cluster=paper_hetero"]
    assert _task(local=True).master_addr == "127.0.0.1"


def test_outside_a_submitit_job_there_is_no_task(monkeypatch):
    monkeypatch.delenv("SUBMITIT_EXECUTOR", raising=False)
    assert current_task() is None
