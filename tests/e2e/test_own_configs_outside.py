"""A folder of one's own configs, outside the repository, as docs/own-configs.md shows it: a cluster
with a device type of its own, the same through hydra.searchpath, an experiment, a model (a
Hugging Face architecture, where the `zoo` extra is installed); and the one-line errors. Run from a directory outside the checkout (here) and on an installed wheel
(tests/e2e/test_install.py runs the same commands there)."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

HAS_ZOO = importlib.util.find_spec("transformers") is not None

pytestmark = pytest.mark.e2e

ROOT = Path(__file__).resolve().parents[2]

LAB_GPU = """\
# A GPU of our lab: one file per device type, named after it.
name: LabGPU
memory_gib: 24
peak_flops: 30.0e12
effective_flops: 7.0e12
sources:
  memory_gib: vendor datasheet
  peak_flops: vendor datasheet, fp32
  effective_flops: "assumption: 0.23 x peak"
"""
LAB = """\
# Our lab: two machines of 4 LabGPUs and one of 4 V100s, 25 Gbit/s between machines.
name: lab
virtual_device: machine
machines:
  - {count: 2, device: LabGPU, num_devices: 4}
  - {count: 1, device: V100-16, num_devices: 4}
links:
  intra_machine: {bandwidth_gbps: 100.0, latency_s: 10.0e-6}
  inter_machine: {bandwidth_gbps: 25.0, latency_s: 30.0e-6}
"""
LAB_METHODS = """\
# @package _global_
# dp_ev and dp_cp on our lab cluster, simulated.
defaults:
  - override /cluster: lab
hydra:
  sweeper:
    params:
      method: dp_ev,dp_cp
mode: sim
"""
LAB_LLAMA = """\
# A small Llama of our lab's shape, from transformers' LlamaConfig with random weights.
defaults:
  - hf
  - _self_
name: lab_llama
arch: llama
config:
  num_hidden_layers: 2
  hidden_size: 64
  num_attention_heads: 4
  intermediate_size: 128
"""


def write_own_configs(where: Path) -> None:
    """mine/ (a cluster, its device type, an experiment) and broken/ (a cluster that does not parse)."""
    files = {
        "mine/device/LabGPU.yaml": LAB_GPU,
        "mine/cluster/lab.yaml": LAB,
        "mine/experiment/lab_methods.yaml": LAB_METHODS,
        "mine/model/lab_llama.yaml": LAB_LLAMA,
        "broken/cluster/lab.yaml": "name: lab\nmachines: [\n",
    }
    for name, text in files.items():
        (where / name).parent.mkdir(parents=True, exist_ok=True)
        (where / name).write_text(text)


# name -> the runner's arguments, run in a directory holding mine/ and broken/
GOOD = {
    "device": ["--config-dir", "mine", "mode=sim", "cluster=paper_hetero", "cluster.machines.0.device=LabGPU"],
    "cluster": ["--config-dir", "mine", "mode=sim", "cluster=lab"],
    "experiment": ["-m", "--config-dir", "mine", "experiment=lab_methods"],
    "searchpath": ["mode=sim", "cluster=lab", "hydra.searchpath=[file://{here}/mine]"],
    **({"model": ["--config-dir", "mine", "mode=sim", "model=lab_llama"]} if HAS_ZOO else {}),
}
BAD = {
    "no_folder": (
        ["--config-dir", "nowhere", "mode=sim"],
        "error: --config-dir=nowhere: no such folder ({here}/nowhere); give a folder of your own configs",
    ),
    "no_parse": (
        ["--config-dir", "broken", "mode=sim", "cluster=lab"],
        "error: {here}/broken/cluster/lab.yaml (line 3) is not valid yaml: ",
    ),
    "unknown": (
        ["--config-dir", "mine", "mode=sim", "cluster=labb"],
        "error: cluster=labb is unknown; known: h100x1, lab, local_2x2,",
    ),
}


def start_all(runner: list[str], here: Path, env: dict, cases: dict[str, list[str]]) -> dict:
    """Every case at once, each with its own results_dir under `here`: name -> process."""
    procs = {}
    for name, args in cases.items():
        args = [a.format(here=here) for a in args] + [f"results_dir=results/{name}", "wandb.mode=disabled"]
        procs[name] = subprocess.Popen(
            [*runner, *args], cwd=here, env=env, text=True, stdout=subprocess.PIPE, stderr=subprocess.PIPE
        )
    return procs


def wait_all(procs: dict) -> dict:
    """name -> (rc, stdout, stderr) of start_all's processes."""
    out = {}
    for name, proc in procs.items():
        stdout, stderr = proc.communicate(timeout=300)
        out[name] = (proc.returncode, stdout, stderr)
    return out


def check_good(here: Path, done: dict) -> None:
    """The rows of the GOOD cases that ran: ok, on the user's cluster, naming the files used."""
    for name, (rc, _, stderr) in done.items():
        assert rc == 0, f"{name}: {stderr[-3000:]}"
    rows = {
        name: [json.loads(line) for line in (here / "results" / name / "records.jsonl").read_text().splitlines()]
        for name in done
    }
    if "device" in rows:
        (row,) = rows["device"]
        assert row["status"] == "ok" and row["cluster"] == "paper_hetero" and row["num_devices"] == 64
        assert row["config"]["config_files"]["device/LabGPU"] == str(here / "mine" / "device" / "LabGPU.yaml")
        assert row["config"]["config_files"]["cluster"] == "conf/cluster/paper_hetero.yaml"
    for name in {"cluster", "searchpath"} & set(rows):
        (row,) = rows[name]
        assert row["status"] == "ok" and row["cluster"] == "lab" and row["num_devices"] == 12
        files = row["config"]["config_files"]
        assert files["cluster"] == str(here / "mine" / "cluster" / "lab.yaml")
        assert files["device/LabGPU"] == str(here / "mine" / "device" / "LabGPU.yaml")
        assert files["device/V100-16"] == "conf/device/V100-16.yaml"  # the packaged one
        assert row["config"]["config_dirs"] == [str(here / "mine")]
    if "model" in rows:
        (row,) = rows["model"]
        assert row["status"] == "ok" and row["model"] == "lab_llama", row.get("error")
        assert row["config"]["config_files"]["model"] == str(here / "mine" / "model" / "lab_llama.yaml")
        assert row["config"]["model"]["config"]["num_hidden_layers"] == 2
    assert [(r["method"], r["status"], r["cluster"]) for r in rows["experiment"]] == [
        ("dp_ev", "ok", "lab"),
        ("dp_cp", "ok", "lab"),
    ]
    files = rows["experiment"][0]["config"]["config_files"]
    assert files["experiment"] == str(here / "mine" / "experiment" / "lab_methods.yaml")
    assert files["device/LabGPU"] == str(here / "mine" / "device" / "LabGPU.yaml")


def check_bad(here: Path, done: dict, cases: dict) -> None:
    for name, (rc, _, stderr) in done.items():
        needle = cases[name][1].format(here=here)
        assert rc != 0 and stderr.strip().count("\n") == 0 and stderr.strip().startswith(needle), (name, stderr)
        assert not (here / "results" / name / "records.jsonl").exists()  # no row: nothing was composed


def test_ones_own_configs_work_from_outside_the_checkout(tmp_path):
    here = tmp_path / "lab"
    here.mkdir()
    write_own_configs(here)
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    bad = {name: BAD[name][0] for name in ("no_folder", "no_parse")}  # "unknown": test_install.py
    done = wait_all(start_all([sys.executable, "-m", "bench.run"], here, env, {**GOOD, **bad}))
    check_good(here, {k: v for k, v in done.items() if k in GOOD})
    check_bad(here, {k: v for k, v in done.items() if k in BAD}, BAD)
