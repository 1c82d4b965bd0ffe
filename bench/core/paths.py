"""Where hetbench reads its configs and where its tools write by default.

Two layouts hold the same files:

- a source checkout (or an editable install of one): the configs are <repo>/conf, and the
  tools write under <repo>/results;
- an installed distribution (`pip install .`): pyproject.toml ships conf/ as the package
  `bench.conf`, Hydra reads it through its `pkg://bench.conf` search path, and the tools
  write under the working directory (results/...), as `results_dir` does in both layouts.

In either layout a user may add folders of their own configs (`--config-dir`, `hydra.searchpath`):
config_roots() lists them before the project's, so that a file of theirs wins over a packaged
one of the same name (bench.runner.configs sets them from the command line).
"""

from __future__ import annotations

import os
from importlib import resources
from pathlib import Path

CONF_PACKAGE = "bench.conf"
_SOURCE_ROOT = Path(__file__).resolve().parents[2]


def _is_checkout(root: Path) -> bool:
    return (root / "pyproject.toml").is_file() and (root / "conf" / "config.yaml").is_file()


def _installed_conf_dir() -> Path:
    try:
        folder = Path(str(resources.files(CONF_PACKAGE)))
    except ModuleNotFoundError:
        folder = None
    if folder is None or not (folder / "config.yaml").is_file():
        raise ImportError(
            f"hetbench's configs are missing: no conf/ beside {_SOURCE_ROOT / 'bench'} and no "
            f"package {CONF_PACKAGE} with config.yaml; reinstall with `pip install <hetbench checkout>`"
        )
    return folder


# A checkout wins over the package: an editable install maps `bench.conf` by name onto the
# checkout it was made from, which is not necessarily the checkout this code runs from.
IN_CHECKOUT = _is_checkout(_SOURCE_ROOT)
CONF_DIR: Path = _SOURCE_ROOT / "conf" if IN_CHECKOUT else _installed_conf_dir()
# Hydra's search path for the primary config: the folder itself, or the installed package.
CONF_SOURCE: str = str(CONF_DIR) if IN_CHECKOUT else f"pkg://{CONF_PACKAGE}"
# Relative output and input paths (figures, calibration, baselines, profiles named in configs).
PROJECT_DIR: Path = _SOURCE_ROOT if IN_CHECKOUT else Path.cwd()


_user_dirs: tuple[Path, ...] = ()


def set_user_config_dirs(dirs) -> None:
    """The folders of the user's own configs for this process, first wins (absolute paths)."""
    global _user_dirs
    _user_dirs = tuple(Path(d).resolve() for d in dirs)


def user_config_dirs() -> tuple[Path, ...]:
    return _user_dirs


def config_roots() -> tuple[Path, ...]:
    """Every folder configs come from, in the order a name is looked up: the user's, then CONF_DIR."""
    return (*_user_dirs, CONF_DIR)


def project_path(path: str | Path) -> Path:
    """`path` as given when absolute, else relative to PROJECT_DIR."""
    path = Path(path)
    return path if path.is_absolute() else PROJECT_DIR / path


def show_path(path: Path) -> str:
    """`path` relative to the project or to the configs' parent where it lies inside one of
    them ("conf/device/T4.yaml" in both layouts), else in full."""
    resolved = Path(path).resolve()
    for base in (PROJECT_DIR, CONF_DIR.parent):
        try:
            return str(resolved.relative_to(base.resolve()))
        except ValueError:
            continue
    return str(path)


def shown_config_path(path: Path) -> str:
    """A config file as a row records it: conf/<group>/<name>.yaml for the project's, the full
    path for a file of the user's own."""
    return show_path(path) if Path(path).resolve().is_relative_to(CONF_DIR.resolve()) else str(path)


def user_cache_dir() -> Path:
    """The per-user folder of hetbench's caches (host speeds, method probes, captured graphs):
    HETBENCH_CACHE_DIR, else ~/.cache/hetbench. Tests point it at a temporary folder."""
    folder = os.environ.get("HETBENCH_CACHE_DIR")
    return Path(folder) if folder else Path.home() / ".cache" / "hetbench"
