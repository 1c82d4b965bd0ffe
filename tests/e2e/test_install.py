"""A plain (non-editable) install runs from any directory with the configs it ships, and with a
folder of the user's own configs beside them.

The wheel is built from a copy of the sources, installed with --target, and the copy is deleted:
the installed package is then the only place configs can come from. `python -S` skips
site-packages' .pth files (the development venv's editable install of some checkout), and the
venv's site-packages comes back on PYTHONPATH after the target, for the dependencies only.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest

from tests.e2e.test_own_configs_outside import GOOD, check_good, start_all, wait_all, write_own_configs

pytestmark = pytest.mark.e2e

ROOT = Path(__file__).resolve().parents[2]
SOURCES = ("pyproject.toml", "README.md", "bench", "methods", "models", "conf")


def _build_and_install(tmp_path: Path) -> Path:
    src, wheels, target = tmp_path / "src", tmp_path / "wheels", tmp_path / "site"
    src.mkdir()
    for name in SOURCES:
        if (ROOT / name).is_dir():
            shutil.copytree(ROOT / name, src / name, ignore=shutil.ignore_patterns("__pycache__"))
        else:
            shutil.copy2(ROOT / name, src / name)
    pip = [sys.executable, "-m", "pip", "--disable-pip-version-check", "--no-input"]
    build = [*pip, "wheel", "--no-deps", "--no-build-isolation", "-w", str(wheels), str(src)]
    done = subprocess.run(build, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    (wheel,) = wheels.glob("hetbench-*.whl")
    install = [*pip, "install", "--no-deps", "--no-compile", "--target", str(target), str(wheel)]
    done = subprocess.run(install, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    shutil.rmtree(src)
    return target


def test_an_installed_wheel_runs_anywhere_on_its_packaged_configs(tmp_path):
    target = _build_and_install(tmp_path)
    assert (target / "bench" / "conf" / "config.yaml").is_file()
    assert (target / "bench" / "conf" / "hydra" / "launcher" / "slurm_multinode.yaml").is_file()
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(target), sysconfig.get_paths()["purelib"]])}
    python = [sys.executable, "-S"]

    probe = (
        "import bench, bench.core.paths as p; from bench.runner.configs import compose_config, group_options;"
        "cfg = compose_config('cluster=local_hetero4', 'method=hap');"
        "print(bench.__file__, p.CONF_SOURCE, p.CONF_DIR, p.PROJECT_DIR, cfg.cluster.name,"
        " cfg.method.name, ','.join(group_options('method')))"
    )
    run = [
        "-m",
        "bench.cli",
        "run",
        "mode=sim",
        "model=bert",
        "cluster=local_hetero2",
        "method=dp_ev",
        "wandb.mode=disabled",
    ]
    # A folder of one's own configs beside the installed package (docs/own-configs.md): a device
    # type, a cluster, an experiment; run with the three below, none writes what another reads.
    here = elsewhere / "lab"
    here.mkdir()
    write_own_configs(here)
    own = start_all(
        [*python, "-m", "bench.cli", "run"],
        here,
        env,
        {name: GOOD[name] for name in ("device", "cluster", "experiment", "model") if name in GOOD},
    )
    procs = [
        subprocess.Popen(
            [*python, *args], cwd=elsewhere, env=env, text=True, stdout=subprocess.PIPE, stderr=subprocess.PIPE
        )
        for args in (["-c", probe], run, ["-m", "bench.cli", "run", "--config-dir", "lab/mine", "cluster=nowhere"])
    ]
    (probed, ran, bad) = [(proc.communicate(timeout=300), proc.returncode) for proc in procs]

    assert probed[1] == 0, probed[0][1][-3000:]
    module, source, conf_dir, project, cluster, method, methods = probed[0][0].split()
    assert Path(module).is_relative_to(target) and source == "pkg://bench.conf"
    assert Path(conf_dir) == target / "bench" / "conf" and Path(project) == elsewhere
    assert (cluster, method) == ("local_hetero4", "hap") and "dp_ev" in methods.split(",")

    assert ran[1] == 0, ran[0][1][-3000:]
    # results_dir is relative to the working directory; the unknown cluster records nothing
    (row,) = [json.loads(line) for line in (elsewhere / "results" / "runs" / "records.jsonl").read_text().splitlines()]
    assert row["status"] == "ok" and row["mode"] == "sim" and row["num_devices"] == 2

    assert bad[1] != 0  # one line, the user's cluster among the known names
    assert bad[0][1].strip().splitlines() == [
        f"error: cluster=nowhere is unknown; known: h100x1, lab, {bad[0][1].split(', lab, ', 1)[1].strip()}"
    ]

    check_good(here, wait_all(own))
