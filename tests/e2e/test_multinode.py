"""One case across several "nodes" of a submitit job (bench.runtime.multinode), run here through
submitit's local executor: two tasks on this host, each a node with its own torchrun of one
worker, joined over gloo, as slurm_multinode runs them on Slurm."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from bench.records.rows import load_records

pytestmark = pytest.mark.e2e
# The slurm extra (pip install ".[slurm]"; scripts/setup.sh installs it) brings the launcher.
pytest.importorskip("hydra_plugins.hydra_submitit_launcher", reason="needs the slurm extra")

ROOT = Path(__file__).resolve().parents[2]
TWO_TASKS = [
    "hydra/launcher=submitit_local",
    "hydra.launcher.tasks_per_node=2",
    "hydra.launcher.timeout_min=5",
    "wandb.mode=disabled",
    "model=bert",
    "preset=tiny",
]


def _sweep(tmp_path: Path, *overrides: str) -> subprocess.CompletedProcess:
    cmd = [
        sys.executable,
        "-m",
        "bench.run",
        "-m",
        *TWO_TASKS,
        f"hydra.sweep.dir={tmp_path / 'sweep'}",
        f"results_dir={tmp_path}",
        *overrides,
    ]
    return subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=180)


def test_one_case_runs_across_two_nodes_each_with_its_torchrun(tmp_path):
    done = _sweep(
        tmp_path,
        "cluster=local_hetero2",
        "method=dp_cp",
        "warmup_iters=1",
        "measured_iters=2",
        "emulation.reference_iters=0",
    )
    assert done.returncode == 0, done.stderr[-3000:]
    (row,) = load_records(tmp_path / "records.jsonl")  # torchrun's rank 0 alone writes it
    assert row["status"] == "ok" and row["num_devices"] == 2 and row["batch_shares"] == [11, 5]
    assert len(row["peak_mem_gib"]) == 2 and len(row["iter_times_s"]) == 2
    # each task started its own torchrun (the runner it started put its Hydra dir here)
    nodes = sorted((tmp_path / "sweep" / "0").glob("node*"))
    assert [p.name for p in nodes] == ["node0", "node1"]
    assert all((p / "torchrun").is_dir() for p in nodes)  # its logs, not a new folder in /tmp


def test_a_job_whose_tasks_do_not_match_the_machines_fails_with_the_setting_to_change(tmp_path):
    done = _sweep(tmp_path, "cluster=local_hetero4")  # 4 machines, 2 tasks
    assert done.returncode == 1
    (line,) = [ln for ln in done.stderr.splitlines() if ln.startswith("error:")]
    assert "2 tasks but cluster=local_hetero4 has 4 machines" in line
    assert "set hydra.launcher.nodes=4 hydra.launcher.tasks_per_node=1" in line
    (row,) = load_records(tmp_path / "records.jsonl")
    assert row["status"] == "failed" and "hydra.launcher.nodes" in row["error"]
