"""The runner's configs as Hydra sees them: the schema, the config folders, composing, group options.

- The schema: Settings (bench.runner.settings), registered in Hydra's ConfigStore as
  `hetbench_schema` (loosened: names checked while composing, values at the edge) and named
  first in conf/config.yaml's defaults.
- The folders: the project's conf/ (or the installed `pkg://bench.conf`) and the user's own,
  given with `--config-dir DIR` or `hydra.searchpath=[file://DIR]`. The user's come first, in
  Hydra's search path (UserConfigsFirst) and in every listing here, so a file of theirs wins over
  a packaged one of the same name; every group (cluster, device, model, method, experiment,
  logger, preset, ablation) is searched in all of them.
- Composing as the CLI does, for the commands that run cases without being Hydra apps; the file
  each chosen option came from goes into the config (`config_files`, `config_dirs`), so the row
  says which file was used.
- Hydra's own errors, multi-line, as one line naming the path or name and the fix.

This is the one module below bench/run.py that handles DictConfig; nothing here runs a case.
"""

from __future__ import annotations

import importlib.resources
import re
import sys
from collections.abc import Mapping
from pathlib import Path

import yaml
from hydra import compose, initialize_config_dir, initialize_config_module
from hydra.core.config_store import ConfigStore
from hydra.core.plugins import Plugins
from hydra.errors import HydraException, InstantiationException
from hydra.plugins.search_path_plugin import SearchPathPlugin
from hydra.utils import instantiate
from omegaconf import DictConfig, OmegaConf, open_dict
from omegaconf.errors import OmegaConfBaseException

from bench.core.errors import ConfigError
from bench.core.paths import (
    CONF_DIR,
    CONF_PACKAGE,
    IN_CHECKOUT,
    config_roots,
    set_user_config_dirs,
    shown_config_path,
)
from bench.core.paths import user_config_dirs as user_dirs
from bench.core.schema import fields_of, loose
from bench.runner.settings import Settings, as_settings, recorded_config

# The option groups of conf/ that a command line picks from (device types are looked up by the
# cluster; see bench.core.cluster.device_type_files).
GROUPS = ("model", "preset", "cluster", "method", "logger", "experiment", "ablation")
SCHEMA = "hetbench_schema"
# What composing a config raises for bad input (hydra_error_line makes each one line).
CONFIG_ERRORS = (HydraException, OmegaConfBaseException, yaml.YAMLError)
# Hydra's providers of its own config sources; every other one is a folder of the user's.
_OWN_PROVIDERS = ("hydra", "main", "schema")

ConfigStore.instance().store(name=SCHEMA, node=loose(Settings))


class UserConfigsFirst(SearchPathPlugin):
    """Puts the user's config folders at the front of Hydra's search path (Hydra itself adds
    --config-dir and hydra.searchpath after the project's configs, which would then win)."""

    def manipulate_search_path(self, search_path) -> None:
        for folder in reversed(user_dirs()):
            search_path.prepend(provider="hetbench-user", path=f"file://{folder}")


def use_config_dirs(dirs) -> None:
    """Search these folders of the user's configs first, for this process (Hydra and listings)."""
    set_user_config_dirs(dirs)
    if dirs:
        Plugins.instance().register(UserConfigsFirst)


def take_config_dirs(argv: list[str], keep: bool = False) -> list[str]:
    """Use the config folders an argv names (`--config-dir DIR`, `-cd DIR`, `--config-dir=DIR`,
    `hydra.searchpath=[file://DIR,pkg://module,...]`), each checked to exist; returns argv
    without them, or, with `keep`, all of it with --config-dir first (bench.run: Hydra parses it
    again itself, and its parser takes no option after the overrides)."""
    dirs: list[Path] = []
    rest: list[str] = []
    items = iter(argv)
    for item in items:
        if item in ("--config-dir", "-cd"):
            given = next(items, None)
            if given is None:
                raise ConfigError(f"{item} needs a folder: {item} DIR (a folder of your own configs)")
            dirs.append(_folder(given, f"{item}={given}"))
            if keep:
                rest[:0] = [item, given]
        elif item.startswith("--config-dir="):
            given = item.partition("=")[2]
            dirs.append(_folder(given, item))
            if keep:
                rest.insert(0, item)
        elif item.lstrip("+").startswith("hydra.searchpath="):
            value = item.partition("=")[2].strip()
            entries = [e.strip() for e in value.removeprefix("[").removesuffix("]").split(",") if e.strip()]
            dirs += [_search_entry(e) for e in entries]
            if keep:
                rest.append(item)
        else:
            rest.append(item)
    use_config_dirs(dirs)
    return rest


def command_argv(argv: list[str] | None) -> list[str] | None:
    """A command's argv (default sys.argv[1:]) with its config folders taken (take_config_dirs);
    None, after one error line, where a folder is refused (the command then exits 2)."""
    try:
        return take_config_dirs(sys.argv[1:] if argv is None else list(argv))
    except ConfigError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return None


def _search_entry(entry: str) -> Path:
    """A hydra.searchpath entry as a folder: file://DIR, pkg://module (installed), or a bare path."""
    where = f"hydra.searchpath entry {entry}"
    if entry.startswith("pkg://"):
        module = entry.removeprefix("pkg://")
        try:
            return _folder(str(importlib.resources.files(module)), where)
        except (ModuleNotFoundError, TypeError):
            raise ConfigError(
                f"{where}: no installed package {module!r}; install it, or give file://DIR for a folder"
            ) from None
    return _folder(entry.removeprefix("file://"), where)


def _folder(path: str, where: str) -> Path:
    folder = Path(path).expanduser().resolve()
    if not folder.is_dir():
        raise ConfigError(
            f"{where}: no such folder ({folder}); give a folder of your own configs, with "
            "one subfolder per group (cluster/, device/, model/, method/, experiment/, ...)"
        )
    return folder


def group_options(group: str) -> list[str]:
    """The options of a config group: its yaml files in every config folder (the user's and the
    project's conf/ or installed bench.conf), by name."""
    return sorted({p.stem for root in config_roots() for p in (root / group).glob("*.yaml")})


def config_file(group: str, name: str) -> Path | None:
    """The file option `name` of `group` comes from: the first config folder that has it."""
    return next((p for root in config_roots() if (p := root / group / f"{name}.yaml").is_file()), None)


def initialize_configs():
    """Hydra's initialize context for the runner's configs, in a checkout or installed."""
    if IN_CHECKOUT:
        return initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3")
    return initialize_config_module(config_module=CONF_PACKAGE, version_base="1.3")


def compose_config(*overrides: str) -> DictConfig:
    """The runner's config for these overrides, composed as the CLI would (for the commands
    that run cases without being Hydra apps themselves), with the files it came from."""
    try:
        with initialize_configs():
            cfg = compose("config", overrides=list(overrides), return_hydra_config=True)
    except CONFIG_ERRORS as exc:
        raise ConfigError(hydra_error_line(exc)) from None
    runtime = cfg.hydra.runtime
    record_sources(cfg, runtime.choices, runtime.config_sources)
    with open_dict(cfg):
        del cfg["hydra"]
    return cfg


def experiment_sweep(experiment: str) -> dict[str, str]:
    """An experiment's sweep: its hydra.sweeper.params, `key: values` as written."""
    try:
        with initialize_configs():
            cfg = compose("config", overrides=[f"experiment={experiment}"], return_hydra_config=True)
    except CONFIG_ERRORS as exc:
        raise ConfigError(hydra_error_line(exc)) from None
    return {str(k): str(v) for k, v in (cfg.hydra.sweeper.params or {}).items()}


def compose_settings(*overrides: str) -> Settings:
    """compose_config, read into checked Settings."""
    return as_settings(compose_config(*overrides))


def record_sources(cfg: DictConfig, choices: Mapping, sources) -> None:
    """Put into `cfg` which file each chosen group option came from (`config_files`) and the
    user's folders Hydra searched (`config_dirs`); left unset where the project's alone were."""
    own = [Path(s["path"]) for s in sources if s["provider"] not in _OWN_PROVIDERS and s["schema"] == "file"]
    dirs = list(dict.fromkeys(str(d) for d in own))
    picked = {group: choices.get(group) for group in GROUPS if group != "logger"}
    picked |= {f"logger/{name}": name for name in (cfg.get("logger") or {})}
    files = {}
    for key, name in picked.items():
        path = config_file(key.partition("/")[0], name) if name else None
        if path is not None:
            files[key] = shown_config_path(path)
    with open_dict(cfg):
        cfg.config_files = files
        cfg.config_dirs = dirs or None


def hydra_error_line(exc: BaseException) -> str:
    """Hydra's (or OmegaConf's) error as one line: its message without the detail lines
    (full_key, object_type), a file it names shown as a path, and the fix where it is known."""
    if isinstance(exc, yaml.YAMLError):  # a config file that does not parse
        mark = getattr(exc, "problem_mark", None)
        where = f"{mark.name} (line {mark.line + 1})" if mark is not None else "a config file"
        problem = getattr(exc, "problem", None) or str(exc).splitlines()[0]
        return f"{where} is not valid yaml: {problem}; fix the file"
    text = str(exc).strip() or str(exc.__cause__ or "").strip() or type(exc).__name__
    lines = [
        ln.strip()
        for ln in text.splitlines()
        if ln.strip() and not ln.strip().startswith(("full_key:", "object_type=", "reference_type="))
    ]
    first = lines[0]
    # (config_dirs and config_files are hetbench's to fill: not offered)
    options = f"options: {', '.join(f for f in fields_of(Settings) if not f.startswith('config_'))}"
    if first.startswith("Could not override '"):  # a command-line key that no config has
        key = first.split("'")[1]
        add = next((ln.split("use ", 1)[1] for ln in lines if ln.startswith("To append")), f"+{key}=...")
        known = f" ({options})" if "." not in key else ""
        return f"{key} is not an option{known}; check the name, or add a key of your own with {add}"
    if first.startswith("In '") and any("not in 'SettingsSchema'" in ln for ln in lines):  # a file's key
        key = next(ln for ln in lines if "not in 'SettingsSchema'" in ln).split("'")[1]
        where = _shown_config(first.split("'")[1])
        return f"{where}: {key} is not an option ({options}); fix or remove it"
    missing = re.search(r"Could not find '([\w/]+)/([^']+)'", first)
    if missing:  # an option named where check_group_choices does not look (an experiment's sweep)
        group, name = missing.groups()
        try:
            check_group_choices([f"{group}={name}"])
        except ConfigError as unknown:
            return str(unknown)
    if first.startswith("Error merging override ") and exc.__cause__ is not None:  # a value of the wrong shape
        override = first.removeprefix("Error merging override ")
        reason = str(exc.__cause__).strip().splitlines()[0].replace("Schema", "")
        return f"{override}: {reason}; give {override.partition('=')[0]} the shape it has in the config"
    if first.startswith("In '"):  # a file Hydra could not read
        where = _shown_config(first.split("'")[1])
        rest = first.split(":", 1)[1].strip() if ":" in first else ""
        return "; ".join([f"{where}: {rest}" if rest else where, *lines[1:]]) + "; fix the file"
    return "; ".join(lines)


def _shown_config(config_path: str) -> str:
    """A Hydra config path ('cluster/lab') as the file it came from, where there is one."""
    group, _, name = config_path.rpartition("/")
    path = config_file(group, name) if group else None
    return str(path) if path is not None else config_path


def hydra_job() -> tuple[str | None, str | None]:
    """(sweep id, output directory) of the Hydra job this process runs, if any: a --multirun
    sweep is identified by its sweep directory; a single run has no sweep."""
    from hydra.core.hydra_config import HydraConfig
    from hydra.types import RunMode

    if not HydraConfig.initialized():
        return None, None
    hc = HydraConfig.get()
    # A config composed for a tool (compose_config) has a Hydra node but no job: no output dir.
    output_dir = OmegaConf.select(hc, "runtime.output_dir", default=None, throw_on_missing=False)
    if output_dir is None:
        return None, None
    return (hc.sweep.dir if hc.mode == RunMode.MULTIRUN else None), output_dir


def method_modes(name: str) -> tuple[str, ...]:
    """The modes the method of conf/method/<name>.yaml supports (it is instantiated to ask)."""
    return plugin_modes(compose_config(f"method={name}").method)


def plugin_modes(method_cfg) -> tuple[str, ...]:
    """The modes a composed method config's method supports (it is instantiated to ask)."""
    return tuple(getattr(instantiate(method_cfg), "modes", ("real",)))


def methods_supporting(mode: str) -> list[str]:
    """The method options (in every config folder) whose method supports `mode`, by name."""
    return [m for m in group_options("method") if mode in method_modes(m)]


def method_target(name: str) -> str | None:
    """The `_target_` of method option `name` (the user's file where they have one), or None
    where its file is missing or unreadable."""
    path = config_file("method", name)
    try:
        return None if path is None else str(OmegaConf.load(path)["_target_"])
    except Exception:  # a method file that cannot be read: its case says why
        return None


def print_help_if_asked(argv: list[str], doc: str) -> bool:
    """-h/--help for the commands that take the runner's overrides (Hydra would try to parse
    it as an override and fail): the command's docstring and where the options are listed."""
    if not {"-h", "--help"} & set(argv):
        return False
    print(doc.strip())
    print(
        "\nOverrides are the runner's (`python -m bench.run --help` lists every config group "
        "and key; the README's option table explains them). `--config-dir DIR` adds a folder "
        "of your own configs (docs/own-configs.md)."
    )
    return True


def check_group_choices(overrides: list[str]) -> None:
    """One clear line for an unknown option of a group, before Hydra composes; the known names
    are those of every config folder, the user's included."""
    for item in overrides:
        key, sep, value = item.lstrip("+~").partition("=")
        if not sep or key not in GROUPS or value in ("", "null") or "(" in value:
            continue  # sweeper functions such as glob(...) are Hydra's to expand
        known = group_options(key)
        # A list (logger=[wandb,csv]) selects several options; a,b sweeps over them.
        names = [v.strip() for v in value.strip().removeprefix("[").removesuffix("]").split(",")]
        unknown = [v for v in names if v and v not in known]
        if unknown:
            own = f" (searched {', '.join(map(str, user_dirs()))} and hetbench's own)" if user_dirs() else ""
            raise ConfigError(f"{key}={','.join(unknown)} is unknown; known: {', '.join(known)}{own}")


def results_file(cfg: Settings) -> Path:
    """The records file of `cfg`'s results_dir (read as composed: a refused config has one too)."""
    return Path(str(recorded_config(cfg).get("results_dir") or "results/runs")) / "records.jsonl"


def instantiate_plugin(node, where: str, **kwargs):
    """hydra.utils.instantiate, with a plugin's ValueError surfaced as a one-line ConfigError."""
    try:
        return instantiate(node, **kwargs)
    except InstantiationException as exc:
        cause = exc.__cause__ or exc
        if isinstance(cause, ValueError):
            raise ConfigError(str(cause)) from None
        raise ConfigError(f"{where}: {cause}") from exc
