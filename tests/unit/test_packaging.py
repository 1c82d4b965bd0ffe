"""pyproject.toml ships every module and every config folder (a plain `pip install .` has only
what it lists), and the runner finds its configs in this checkout."""

from __future__ import annotations

import tomllib
from pathlib import Path

from bench.core import paths

ROOT = Path(__file__).resolve().parents[2]


def _setuptools() -> dict:
    return tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]


def test_every_code_package_and_config_folder_is_packaged():
    listed = set(_setuptools()["packages"])
    code = {
        ".".join(p.parent.relative_to(ROOT).parts)
        for top in ("bench", "methods", "models")
        for p in (ROOT / top).rglob("__init__.py")
    }
    configs = {
        ".".join(("bench", *d.relative_to(ROOT).parts))
        for d in [ROOT / "conf", *(ROOT / "conf").rglob("*")]
        if d.is_dir() and d.name != "__pycache__"
    }
    assert code | configs == listed, "add the missing ones to [tool.setuptools] packages"


def test_conf_ships_as_the_package_bench_conf():
    tool = _setuptools()
    assert tool["package-dir"] == {"bench.conf": "conf"}
    assert "*.yaml" in tool["package-data"]["*"]
    assert (ROOT / "conf" / "__init__.py").is_file()  # Hydra's pkg:// source needs one


def test_a_checkout_reads_its_own_conf_folder():
    assert paths.IN_CHECKOUT
    assert paths.CONF_DIR == ROOT / "conf" and str(ROOT / "conf") == paths.CONF_SOURCE
    assert paths.PROJECT_DIR == ROOT
    assert paths.show_path(ROOT / "conf" / "device" / "T4.yaml") == "conf/device/T4.yaml"
