"""The runner's configs: composing them as the CLI does, the options of each group, instantiating plugins.

Everything here reads Hydra configs; nothing runs a case.
"""

from __future__ import annotations

from pathlib import Path

from hydra import compose, initialize_config_dir, initialize_config_module
from hydra.errors import InstantiationException
from hydra.utils import instantiate
from omegaconf import DictConfig

from bench.core.errors import ConfigError
from bench.core.paths import CONF_DIR, CONF_PACKAGE, IN_CHECKOUT

GROUPS = ("model", "preset", "cluster", "method", "logger", "experiment", "ablation")


def group_options(group: str) -> list[str]:
    """The options of a config group: the yaml files in its conf/ folder (CONF_DIR: the
    checkout's conf/ or the installed package bench.conf)."""
    return sorted(p.stem for p in (CONF_DIR / group).glob("*.yaml"))


def compose_config(*overrides: str) -> DictConfig:
    """The runner's config for these overrides, composed as the CLI would (for the commands
    that run cases without being Hydra apps themselves)."""
    with initialize_configs():
        return compose("config", overrides=list(overrides))


def initialize_configs():
    """Hydra's initialize context for the runner's configs, in a checkout or installed."""
    if IN_CHECKOUT:
        return initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3")
    return initialize_config_module(config_module=CONF_PACKAGE, version_base="1.3")


def method_modes(name: str) -> tuple[str, ...]:
    """The modes the method of conf/method/<name>.yaml supports (it is instantiated to ask)."""
    return tuple(getattr(instantiate(compose_config(f"method={name}").method), "modes", ("real",)))


def methods_supporting(mode: str) -> list[str]:
    """The conf/method options whose method supports `mode`, in name order."""
    return [m for m in group_options("method") if mode in method_modes(m)]


def print_help_if_asked(argv: list[str], doc: str) -> bool:
    """-h/--help for the commands that take the runner's overrides (Hydra would try to parse
    it as an override and fail): the command's docstring and where the options are listed."""
    if not {"-h", "--help"} & set(argv):
        return False
    print(doc.strip())
    print("\nOverrides are the runner's (`python -m bench.run --help` lists every config group "
          "and key; the README's option table explains them).")
    return True


def check_group_choices(overrides: list[str]) -> None:
    """One clear line for an unknown model/preset/cluster/method/logger, before Hydra composes."""
    for item in overrides:
        key, sep, value = item.lstrip("+~").partition("=")
        if not sep or key not in GROUPS or value in ("", "null") or "(" in value:
            continue  # sweeper functions such as glob(...) are Hydra's to expand
        known = group_options(key)
        # A list (logger=[wandb,csv]) selects several options; a,b sweeps over them.
        names = [v.strip() for v in value.strip().removeprefix("[").removesuffix("]").split(",")]
        unknown = [v for v in names if v and v not in known]
        if unknown:
            raise ConfigError(f"{key}={','.join(unknown)} is unknown; known: {', '.join(known)}")


def results_file(cfg: DictConfig) -> Path:
    return Path(cfg.results_dir) / "records.jsonl"


def instantiate_plugin(node, where: str, **kwargs):
    """hydra.utils.instantiate, with a plugin's ValueError surfaced as a one-line ConfigError."""
    try:
        return instantiate(node, **kwargs)
    except InstantiationException as exc:
        cause = exc.__cause__ or exc
        if isinstance(cause, ValueError):
            raise ConfigError(str(cause)) from None
        raise ConfigError(f"{where}: {cause}") from exc
