"""The planner's graph module of a model kept on disk: a sweep, a second plan and a case's workers
pay its capture (torch.export, seconds) once.

What it does: writes the fx module methods.graph makes (its nodes with their targets and
arguments, each node's shape, stride and dtype and its module path, the module's parameters
as meta tensors, its buffers as captured and its constants with their values) to a file under the user's
cache folder (bench.core.paths.user_cache_dir), keyed by everything the capture reads: the
model config and its class, the batch, how batch norm is captured, and the versions of torch,
transformers and of the code that builds and captures models; and reads it back as an
fx.GraphModule whose nodes carry meta tensors where the capture left fake ones. A file that
does not load (cut short by a killed process, corrupt, of another format) is a miss: the model
is captured afresh and the file rewritten; files are written whole and renamed into place.
What it does not do: decide anything about the graph (methods.graph reads it).
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import importlib.util
import json
import logging
import operator
import os
import tempfile
from pathlib import Path
from typing import Any

import torch
from torch import fx, nn

from bench.core.paths import user_cache_dir

log = logging.getLogger(__name__)

CACHE_FORMAT = 1  # bump when what a file holds changes shape
_ROOT = Path(__file__).resolve().parents[1]
# The code a graph comes from: the models' (their configs build them) and the capture's.
_CODE = ("models/*.py", "methods/export.py", "methods/graph.py", "methods/graph_cache.py")
_PY_TARGETS = {"operator.getitem": operator.getitem}


class Uncacheable(ValueError):
    """A graph holds something this format does not store (it is then captured every time)."""


def cache_folder() -> Path:
    return user_cache_dir() / "graphs"


def enabled() -> bool:
    """HETBENCH_GRAPH_CACHE=0 turns the cache off (every capture runs torch.export)."""
    return os.environ.get("HETBENCH_GRAPH_CACHE", "1") != "0"


def graph_key(model_cfg: Any, batch_size: int, batch_norm: str) -> str:
    """sha256 (first 24 hex digits) of what a capture of `model_cfg` at `batch_size` reads."""
    body = {
        "format": CACHE_FORMAT,
        "config": [type(model_cfg).__module__, type(model_cfg).__qualname__, repr(model_cfg)],
        "batch_size": int(batch_size),
        "batch_norm": batch_norm,
        "libraries": _library_versions(),
        "code": _code_version(model_cfg),
    }
    return hashlib.sha256(json.dumps(body, sort_keys=True).encode()).hexdigest()[:24]


def load_module(key: str) -> fx.GraphModule | None:
    """The cached module of `key`, or None (no file, or one that does not load: logged)."""
    path = cache_folder() / f"{key}.pt"
    if not path.is_file():
        return None
    try:
        data = torch.load(path, weights_only=True)
        if data.get("format") != CACHE_FORMAT or data.get("key") != key:
            raise ValueError(f"format {data.get('format')!r}, key {data.get('key')!r}")
        return _decode_module(data)
    except Exception as exc:  # any damage is a miss: the caller captures afresh and rewrites it
        log.warning("graph cache %s is unreadable (%s: %s); capturing again", path, type(exc).__name__, exc)
        return None


def save_module(key: str, gm: fx.GraphModule) -> Path | None:
    """Write `gm` whole to a temporary file and rename it into place; None (logged) where the
    graph holds something the format does not store or the folder is not writable."""
    try:
        data = {"format": CACHE_FORMAT, "key": key, **_encode_module(gm)}
    except Uncacheable as exc:
        log.info("graph not cached: %s", exc)
        return None
    folder = cache_folder()
    try:
        folder.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=folder, prefix=f".{key}.", suffix=".tmp")
        try:
            with os.fdopen(fd, "wb") as f:
                torch.save(data, f)
            os.replace(tmp, folder / f"{key}.pt")
        finally:
            if os.path.exists(tmp):
                os.unlink(tmp)
    except OSError as exc:
        log.warning("graph cache folder %s is not writable (%s); the graph is not kept", folder, exc)
        return None
    return folder / f"{key}.pt"


def with_tensors(gm: fx.GraphModule, model: nn.Module, device: torch.device | None = None) -> fx.GraphModule:
    """A copy of `gm`'s graph over `model`'s own parameters and buffers (the get_attr targets are
    their module paths); gm's constants (tensors forward makes from data) copied to `device`
    (default: the model's), and the ops that make tensors from nothing (arange, ones) or move
    them to a device (a rotary embedding's `to(inv_freq, device)`) retargeted to it. `device`
    names it for a model whose parameters are still on meta."""
    named: dict[str, torch.Tensor] = dict(model.named_parameters(remove_duplicate=False))
    named.update(model.named_buffers(remove_duplicate=False))
    if device is None:
        device = next(iter(named.values())).device if named else torch.device("cpu")
    graph = fx.Graph()
    graph.output(graph.graph_copy(gm.graph, {}))
    graph._codegen = gm.graph._codegen
    attrs = {}
    for n in graph.nodes:
        if n.op == "get_attr":
            attrs[n.target] = named[n.target] if n.target in named else _attr(gm, n.target).to(device)
        elif n.op == "call_function":
            # made from nothing (arange, ones) or moved (`to(x, device, dtype)`): on the model's
            # device, not the capture's (meta), whether the device is a keyword or positional
            if isinstance(n.kwargs.get("device"), torch.device):
                n.update_kwarg("device", device)
            if any(isinstance(a, torch.device) for a in n.args):
                n.args = tuple(device if isinstance(a, torch.device) else a for a in n.args)
    out = fx.GraphModule(attrs, graph)
    out.meta.update(gm.meta)
    return out


# -- versions ------------------------------------------------------------------------------------


def _library_versions() -> dict[str, str]:
    out = {"torch": torch.__version__}
    try:  # from its metadata: importing transformers takes seconds
        out["transformers"] = importlib.metadata.version("transformers")
    except importlib.metadata.PackageNotFoundError:
        pass
    return out


def _code_version(model_cfg: Any) -> str:
    """A hash of the capture's and the models' code, and of the module that defines the config's
    class or a custom model's factory when it lies outside the project."""
    h = hashlib.sha256()
    files = {p for pattern in _CODE for p in _ROOT.glob(pattern)}
    for module in (type(model_cfg).__module__, str(getattr(model_cfg, "factory", "")).partition(":")[0]):
        spec = importlib.util.find_spec(module) if module else None
        if spec is not None and spec.origin and spec.origin.endswith(".py"):
            files.add(Path(spec.origin))
    for path in sorted(files):
        h.update(path.as_posix().encode())
        h.update(path.read_bytes())
    return h.hexdigest()[:16]


# -- encoding --------------------------------------------------------------------------------------
# Containers are tagged lists ([tag, ...]); ints, floats, bools, strings and None stand for themselves.


def _encode_module(gm: fx.GraphModule) -> dict:
    params = {name: [p.detach().to("meta"), p.requires_grad] for name, p in gm.named_parameters(remove_duplicate=False)}
    tensors = {}  # buffers (meta, as captured) and constants (with their values)
    nodes = []
    for n in gm.graph.nodes:
        if n.op == "get_attr" and n.target not in params:
            value = _attr(gm, n.target)
            if not isinstance(value, torch.Tensor):
                raise Uncacheable(f"attribute {n.target!r} is a {type(value).__name__}")
            tensors[n.target] = value.detach() if value.is_meta else value.detach().cpu().clone()
        stack = n.meta.get("nn_module_stack")
        nodes.append(
            [
                n.name,
                n.op,
                _encode_target(n),
                _encode(n.args),
                _encode(n.kwargs),
                _encode_value(n.meta.get("val")),
                None if stack is None else [[k, list(v)] for k, v in stack.items()],
            ]
        )
    meta = json.dumps(gm.meta, default=str)
    return {"nodes": nodes, "params": params, "tensors": tensors, "meta": meta}


def _decode_module(data: dict) -> fx.GraphModule:
    graph = fx.Graph()
    env: dict[str, fx.Node] = {}
    for name, op, target, args, kwargs, val, stack in data["nodes"]:
        node = graph.create_node(op, _decode_target(op, target), _decode(args, env), _decode(kwargs, env), name=name)
        if node.name != name:
            raise ValueError(f"node {name!r} came back as {node.name!r}")
        env[name] = node
        if val is not None:
            node.meta["val"] = _decode_value(val)
        if stack is not None:
            node.meta["nn_module_stack"] = {k: tuple(v) for k, v in stack}
    attrs: dict[str, Any] = {}
    for name, (tensor, grad) in data["params"].items():
        attrs[name] = nn.Parameter(tensor, requires_grad=grad)
    attrs.update(data["tensors"])
    used = {n.target for n in graph.nodes if n.op == "get_attr"}
    gm = fx.GraphModule({k: v for k, v in attrs.items() if k in used}, graph)
    gm.meta.update(json.loads(data["meta"]))
    return gm


def _attr(gm: fx.GraphModule, target: str) -> Any:
    obj: Any = gm
    for part in target.split("."):
        obj = getattr(obj, part)
    return obj


def _encode_target(n: fx.Node) -> Any:
    target = n.target
    if n.op != "call_function":
        return target
    if isinstance(target, torch._ops.OpOverload):
        return ["op", target._schema.name, target._overloadname]
    for name, fn in _PY_TARGETS.items():
        if target is fn:
            return ["py", name]
    raise Uncacheable(f"node {n.name!r} calls {target!r}")


def _decode_target(op: str, target: Any) -> Any:
    if op != "call_function":
        return target
    if target[0] == "py":
        return _PY_TARGETS[target[1]]
    namespace, _, name = target[1].partition("::")
    return getattr(getattr(getattr(torch.ops, namespace), name), target[2])


def _encode(a: Any) -> Any:
    if a is None or isinstance(a, (bool, int, float, str)):
        return a
    if isinstance(a, fx.Node):
        return ["node", a.name]
    if isinstance(a, tuple):
        return ["tuple", [_encode(x) for x in a]]
    if isinstance(a, list):  # fx's immutable_list too: create_node makes it again
        return ["list", [_encode(x) for x in a]]
    if isinstance(a, dict):
        return ["dict", [[k, _encode(v)] for k, v in a.items()]]
    if isinstance(a, torch.dtype):
        return ["dtype", str(a).removeprefix("torch.")]
    if isinstance(a, torch.device):
        return ["device", str(a)]
    if isinstance(a, torch.layout):
        return ["layout", str(a).removeprefix("torch.")]
    if isinstance(a, torch.memory_format):
        return ["memory_format", str(a).removeprefix("torch.")]
    if isinstance(a, slice):
        return ["slice", [_encode(a.start), _encode(a.stop), _encode(a.step)]]
    raise Uncacheable(f"an argument of type {type(a).__name__}")


def _decode(a: Any, env: dict[str, fx.Node]) -> Any:
    if not isinstance(a, list):
        return a
    tag, body = a
    if tag == "node":
        return env[body]
    if tag == "tuple":
        return tuple(_decode(x, env) for x in body)
    if tag == "list":
        return [_decode(x, env) for x in body]
    if tag == "dict":
        return {k: _decode(v, env) for k, v in body}
    if tag == "slice":
        return slice(*(_decode(x, env) for x in body))
    if tag == "device":
        return torch.device(body)
    return getattr(torch, body)  # dtype, layout, memory_format


def _encode_value(v: Any) -> Any:
    """A node's value as shapes: a tensor, a tuple or list of them, or a plain scalar."""
    if isinstance(v, torch.Tensor):
        return ["tensor", [list(v.shape), list(v.stride()), str(v.dtype).removeprefix("torch.")]]
    if isinstance(v, (tuple, list)):
        return ["tuple" if isinstance(v, tuple) else "list", [_encode_value(x) for x in v]]
    if v is None or isinstance(v, (bool, int, float)):
        return v
    raise Uncacheable(f"a node value of type {type(v).__name__}")


def _decode_value(v: Any) -> Any:
    if not isinstance(v, list):
        return v
    tag, body = v
    if tag == "tensor":
        shape, stride, dtype = body
        return torch.empty_strided(shape, stride, dtype=getattr(torch, dtype), device="meta")
    items = [_decode_value(x) for x in body]
    return tuple(items) if tag == "tuple" else items
