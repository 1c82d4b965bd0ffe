"""Dataclass schemas for the user's configs, and the one place where a config becomes a typed object.

`parse(cls, data, at)` reads a plain mapping (a resolved config node, a cluster or device file)
into an instance of the dataclass `cls`: every key must be a field, every value of the field's
annotated type (int, float, bool, str, `X | None`, a unions of those, a nested schema, a list or
a str-keyed dict of them, Any), then each schema's own `check(at)` judges ranges and
combinations. A refusal is one ConfigError line naming the key, the value and the fix, phrased
from the field's metadata (`option(...)`): the rule, an example, the valid choices.

`loose(cls)` is the same schema with every value untyped, for Hydra's ConfigStore: composition
then refuses a key that no schema has (a typo in an experiment file), and values are judged once,
by `parse` at the edge, where a refused value still fails its case with a row. (OmegaConf's own
typed nodes would also take `1` or `yes` for true and `3` for the string '3', and name a list
element's field without its index.) A schema with `OPEN = True` takes keys of the user's own
beside its fields (a preset file may carry values its model config interpolates).

It knows no particular schema; it does not compose configs (bench.runner.configs does).
"""

from __future__ import annotations

import dataclasses
import functools
import types
import typing
from collections.abc import Callable, Mapping
from typing import Any

from omegaconf import MISSING, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from bench.core.errors import ConfigError

_TYPE_WORDS = {int: "an integer", float: "a number", bool: "true or false", str: "a string"}


def option(
    default: Any = MISSING,
    *,
    rule: str | None = None,
    example: str | None = None,
    choices: tuple[str, ...] | None = None,
    note: str = "",
    missing: str | None = None,
    factory: Callable[[], Any] | None = None,
) -> Any:
    """A schema field with what its messages say: `rule` ("an integer >= 1"; with `choices`, what
    to use instead), `example` (the value after `e.g. key=`), `choices` (the valid strings),
    `note` (after the choices), and `missing` (the fix when a required field is absent).
    MISSING: the field is required."""
    meta = {"rule": rule, "example": example, "choices": choices, "note": note, "missing": missing}
    meta = {k: v for k, v in meta.items() if v}
    if factory is not None:
        return dataclasses.field(default_factory=factory, metadata=meta)
    return dataclasses.field(default=default, metadata=meta)


def internal(factory: Callable[[], Any] = dict) -> Any:
    """A field filled by code, not read from the config (parse and loose skip it)."""
    return dataclasses.field(default_factory=factory, repr=False, compare=False, metadata={"internal": True})


def refusal(key: str, value: Any, cls: type, name: str) -> ConfigError:
    """The one-line refusal of `value` for field `name` of schema `cls`, shown as `key`."""
    return _refuse(key, value, _meta(cls, name), _hints(cls)[name])


def refuse(obj: Any, at: str, name: str) -> ConfigError:
    """The refusal of the current value of `obj.name` (for a schema's `check`)."""
    return refusal(f"{at}{name}", getattr(obj, name), type(obj), name)


def require(ok: bool, obj: Any, at: str, name: str) -> None:
    """Raise the field's refusal unless `ok`."""
    if not ok:
        raise refuse(obj, at, name)


def check_choice(obj: Any, at: str, name: str) -> None:
    """The field's value must be one of its `choices`."""
    require(getattr(obj, name) in _meta(type(obj), name)["choices"], obj, at, name)


def plain(data: Any) -> Any:
    """`data` with every OmegaConf container in it resolved to plain dicts and lists; a failed
    interpolation is one ConfigError line."""
    if OmegaConf.is_config(data):
        try:
            return OmegaConf.to_container(data, resolve=True)
        except OmegaConfBaseException as exc:
            key = getattr(exc, "full_key", None)
            first = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
            raise ConfigError(f"{key or 'config'}: {first}; fix the value or the interpolation it names") from None
    if isinstance(data, Mapping):
        return {k: plain(v) for k, v in data.items()}
    if isinstance(data, (list, tuple)):
        return [plain(v) for v in data]
    return data


def parse(cls: type, data: Any, at: str = "", name: str | None = None) -> Any:
    """`data` (a mapping; OmegaConf containers are resolved first) as an instance of the
    schema `cls`, checked. `at` goes before each key in messages ("cluster." or a file's
    "path: "); `name` names the whole object where a message is about it (default: `at`)."""
    obj = _build(cls, plain(data), at, name)
    _check_all(obj, at)
    return obj


def fields_of(cls: type) -> list[str]:
    """The names a config may give `cls` (its fields less the internal ones)."""
    return [f.name for f in dataclasses.fields(cls) if not f.metadata.get("internal")]


@functools.cache
def loose(cls: type) -> type:
    """`cls` with every leaf value typed Any and the same defaults; nested schemas loosened too
    (see the module docstring)."""
    hints = _hints(cls)
    specs = []
    for f in dataclasses.fields(cls):
        if f.metadata.get("internal"):
            continue
        kind = _strip_none(hints[f.name])
        if dataclasses.is_dataclass(kind) and not getattr(kind, "OPEN", False):
            sub = loose(kind)
            default = (
                dataclasses.field(default_factory=sub)
                if f.default_factory is not dataclasses.MISSING
                else dataclasses.field(default=MISSING)
            )
            specs.append((f.name, sub, default))
            continue
        if f.default_factory is not dataclasses.MISSING:
            default = dataclasses.field(default_factory=f.default_factory)
        else:
            default = dataclasses.field(default=f.default)
        specs.append((f.name, Any, default))
    return dataclasses.make_dataclass(f"{cls.__name__}Schema", specs)


def _check_all(obj: Any, at: str) -> None:
    """Each nested schema's check before its parent's (a parent may rely on its parts)."""
    for f in dataclasses.fields(obj):
        if f.metadata.get("internal"):
            continue
        value = getattr(obj, f.name)
        if dataclasses.is_dataclass(value):
            _check_all(value, f"{at}{f.name}.")
        elif isinstance(value, list):
            for i, item in enumerate(value):
                if dataclasses.is_dataclass(item):
                    _check_all(item, f"{at}{f.name}[{i}].")
        elif isinstance(value, dict):
            for key, item in value.items():
                if dataclasses.is_dataclass(item):
                    _check_all(item, f"{at}{f.name}.{key}.")
    check = getattr(obj, "check", None)
    if check is not None:
        check(at)


def _build(cls: type, data: Any, at: str, name: str | None) -> Any:
    whole = name or at.rstrip(".: ") or "config"
    if not isinstance(data, Mapping):
        raise ConfigError(f"{whole}={data!r} must be a mapping of fields ({', '.join(sorted(fields_of(cls)))})")
    known = fields_of(cls)
    unknown = [] if getattr(cls, "OPEN", False) else sorted(str(k) for k in data if k not in known)
    if unknown:
        raise ConfigError(f"{whole} has unknown field(s) {unknown}; valid: {', '.join(sorted(known))}")
    hints = _hints(cls)
    values = {}
    for f in dataclasses.fields(cls):
        if f.metadata.get("internal"):
            continue
        key = f"{at}{f.name}"
        required = f.default is MISSING and f.default_factory is dataclasses.MISSING
        if f.name not in data or (data[f.name] is None and required and not _optional(hints[f.name])):
            if required:
                fix = f.metadata.get("missing") or f"set it ({_describe(f.metadata, hints[f.name])})"
                raise ConfigError(f"{key} is missing; {fix}")
            continue
        values[f.name] = _convert(data[f.name], hints[f.name], key, f.metadata)
    return cls(**values)


def _convert(value: Any, kind: Any, key: str, meta: Mapping) -> Any:
    """`value` as type `kind`, or the field's refusal."""
    if kind is Any:
        return value
    if value is None and _optional(kind):
        return None
    kind = _strip_none(kind)
    origin = typing.get_origin(kind)
    if dataclasses.is_dataclass(kind):
        return _build(kind, value, f"{key}.", key)
    if origin is list:
        if not isinstance(value, list):
            raise _refuse(key, value, meta, kind)
        (item,) = typing.get_args(kind)
        return [
            _convert(v, item, f"{key}[{i}]", {})
            if not dataclasses.is_dataclass(item)
            else _build(item, v, f"{key}[{i}].", f"{key}[{i}]")
            for i, v in enumerate(value)
        ]
    if origin is dict:
        if not isinstance(value, Mapping):
            raise _refuse(key, value, meta, kind)
        _, item = typing.get_args(kind)
        return {
            str(k): _convert(v, item, f"{key}.{k}", {})
            if not dataclasses.is_dataclass(item)
            else _build(item, v, f"{key}.{k}.", f"{key}.{k}")
            for k, v in value.items()
        }
    for member in _members(kind):
        ok, converted = _scalar(value, member)
        if ok:
            return converted
    raise _refuse(key, value, meta, kind)


def _scalar(value: Any, kind: Any) -> tuple[bool, Any]:
    if kind is bool:
        return isinstance(value, bool), value
    if isinstance(value, bool):
        return False, value
    if kind is int:
        return isinstance(value, int), value
    if kind is float:  # an int stays as written (messages show it so); float() where it is used
        return isinstance(value, (int, float)), value
    if kind is str:
        return isinstance(value, str), value
    if kind in (dict, list):
        return isinstance(value, kind), value
    return False, value


def _refuse(key: str, value: Any, meta: Mapping, kind: Any) -> ConfigError:
    choices = meta.get("choices")
    if choices:  # the rule, where given, says what to use instead
        fix = meta.get("rule") or f"valid: {', '.join(choices)}{meta.get('note', '')}"
        return ConfigError(f"{key}={value!r} is invalid; {fix}")
    text = f"{key}={value!r} must be {_describe(meta, kind)}"
    if meta.get("example"):
        text += f"; e.g. {key}={meta['example']}"
    return ConfigError(text)


def _describe(meta: Mapping, kind: Any) -> str:
    if meta.get("rule"):
        return meta["rule"]
    if meta.get("choices"):
        return f"one of {', '.join(meta['choices'])}"
    words = [_TYPE_WORDS.get(m, getattr(m, "__name__", str(m))) for m in _members(_strip_none(kind))]
    return " or ".join(words) + (" or null" if _optional(kind) else "")


@functools.cache
def _hints(cls: type) -> dict[str, Any]:
    return typing.get_type_hints(cls)


def _meta(cls: type, name: str) -> Mapping:
    return next(f.metadata for f in dataclasses.fields(cls) if f.name == name)


def _members(kind: Any) -> tuple:
    if typing.get_origin(kind) in (typing.Union, types.UnionType):
        return tuple(m for m in typing.get_args(kind) if m is not type(None))
    return (typing.get_origin(kind) or kind,)


def _optional(kind: Any) -> bool:
    return typing.get_origin(kind) in (typing.Union, types.UnionType) and type(None) in typing.get_args(kind)


def _strip_none(kind: Any) -> Any:
    if not _optional(kind):
        return kind
    rest = tuple(m for m in typing.get_args(kind) if m is not type(None))
    return rest[0] if len(rest) == 1 else typing.Union[rest]  # noqa: UP007 (a runtime union of several)
