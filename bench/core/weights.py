"""Canonical initial weights: a model built with its parameters on the meta device, and any subset
of them materialised alone, each with the value the whole model's materialisation gives it.

A parameter's initial value is a pure function of (seed, its fully-qualified name, the model's
initialiser of the module that owns it): torch's generator is seeded from (seed, name), and the
initialiser runs on that one module with a fresh tensor in place of that parameter (on a
meta copy of the model, so that an initialiser which also writes a child's tensors writes
nothing real). The initialiser is the model's `init_module(module)` where the model's root has
one (the zoo's models; models.tasks.TaskLoss runs a Hugging Face model's `_init_weights` on that
module and the modules above it, as transformers does), then torch's `reset_parameters` for what
that left unset. So the single-device model (bench.core.interfaces.Workload.build), a pipeline
stage and an FSDP shard start from the same values, whichever subset a rank holds
(docs/emulation.md, "What a rank holds").

Buffers (masks, position ids, rotary frequencies, normalisation statistics) keep the values the
model's constructor computes: `build_meta` puts only parameters on meta and leaves buffers on
the CPU (every rank holds them; they are small). It does not place or shard anything.
"""

from __future__ import annotations

import contextlib
import copy
import hashlib
import logging
from collections.abc import Iterator
from typing import Any

import torch
from torch import nn

from bench.core.meta import SkipRandomFills

log = logging.getLogger(__name__)


@contextlib.contextmanager
def _parameters_on_meta() -> Iterator[None]:
    """Every parameter a module registers goes to the meta device at once (its constructor's
    storage, never written, is dropped there); buffers stay where they are made."""
    original = nn.Module.register_parameter

    def register_parameter(module, name, param):
        if param is not None and not param.is_meta:
            param = type(param)(param.to("meta"), requires_grad=param.requires_grad)
        original(module, name, param)

    nn.Module.register_parameter = register_parameter
    try:
        yield
    finally:
        nn.Module.register_parameter = original


def build_meta(model_cfg: Any, seed: int) -> nn.Module:
    """`model_cfg.build()` with every parameter on the meta device and the buffers the
    constructor computes on the CPU; torch seeded with `seed` first, and left so (the random
    initialisers, skipped on meta, draw nothing)."""
    torch.manual_seed(seed)
    with _parameters_on_meta(), SkipRandomFills():
        model = model_cfg.build()
    for name, p in model.named_parameters():
        assert p.is_meta, f"parameter {name} was not registered through register_parameter"
    return model


def _param_seed(seed: int, name: str) -> int:
    digest = hashlib.sha256(f"{seed}/{name}".encode()).digest()
    return int.from_bytes(digest[:8], "little") & ((1 << 63) - 1)


def _default_init(module: nn.Module) -> None:
    reset = getattr(module, "reset_parameters", None)
    if callable(reset):
        reset()


class Weights:
    """The canonical initial values of one model's parameters at one seed.

    Args:
        model: the model as build_meta made it (parameters on meta); kept only as names.
        seed: the case's seed.
        model_cfg: the config it was built from, for parameters no initialiser sets (below).

    A parameter that neither the model's initialiser nor torch's default sets (a user's module
    that fills a raw nn.Parameter in its constructor) takes the value the constructor gives it:
    the whole model built once on the CPU with torch seeded by `seed`, on every rank that needs
    such a parameter (a warning says so: those ranks hold the whole model for a moment).
    """

    def __init__(self, model: nn.Module, seed: int, model_cfg: Any = None):
        self.seed, self.model_cfg = seed, model_cfg
        self._built: nn.Module | None = None
        self.shadow = copy.deepcopy(model)  # parameters on meta: costs the buffers alone
        root_init = getattr(self.shadow, "init_module", None)
        self._init = root_init if callable(root_init) else _default_init
        # A parameter reached by several names (tied weights) takes the first one's value.
        self.names = {id(p): n for n, p in model.named_parameters()}

    def name_of(self, param: torch.Tensor) -> str:
        """The canonical name of one of the model's parameters."""
        return self.names[id(param)]

    def value(self, name: str) -> torch.Tensor:
        """The initial value of parameter `name` (a canonical name), on the CPU."""
        path, _, attr = name.rpartition(".")
        module = self.shadow.get_submodule(path)
        saved = dict(module._parameters)
        # Only this parameter is real: the initialiser's fills of its siblings (still on meta)
        # are skipped, so each parameter costs its own initialisation alone.
        fresh = {attr: nn.Parameter(_unset(saved[attr]), requires_grad=saved[attr].requires_grad)}
        try:
            module._parameters.update(fresh)
            with torch.random.fork_rng(devices=[]), torch.no_grad(), SkipRandomFills():
                torch.manual_seed(_param_seed(self.seed, name))
                self._init(module)
                state = _state(module._parameters[attr])
                if state == "unset":  # the model's initialiser leaves it to torch's default
                    torch.manual_seed(_param_seed(self.seed, name))
                    _default_init(module)
                    state = _state(module._parameters[attr])
            out = module._parameters[attr].detach()
        finally:
            module._parameters.update(saved)
        if state == "unset":
            out = self._constructed(name)
        elif state == "partial":
            raise ValueError(
                f"parameter {name} of {type(self.shadow).__name__} is partly set by its initialiser "
                "(NaN left): give the model an init_module(module) that sets all of it"
            )
        return out

    def _constructed(self, name: str) -> torch.Tensor:
        """Parameter `name` as the model's constructor sets it (class docstring)."""
        if self.model_cfg is None:
            raise ValueError(
                f"parameter {name} of {type(self.shadow).__name__} is set by no initialiser: give the "
                "model an init_module(module) that sets it (or its module a reset_parameters())"
            )
        if self._built is None:
            log.warning(
                "parameter %s of %s is set by no initialiser (init_module, reset_parameters): its "
                "value is the constructor's, from the whole model built once on the CPU",
                name,
                type(self.shadow).__name__,
            )
            with torch.random.fork_rng(devices=[]):
                torch.manual_seed(self.seed)
                self._built = self.model_cfg.build()
        return self._built.get_parameter(name).detach().clone()

    def materialize(self, module: nn.Module, device: torch.device | str = "cpu") -> nn.Module:
        """Every parameter of `module` still on meta gets its initial value on `device`, in place
        (the same Parameter objects, so ties and references to them hold); parameters already
        materialised are kept. `module` is the model, a part whose parameters are the model's
        own objects (a pipeline stage), or a copy of the model (parameters found by name)."""
        for name, p in module.named_parameters():
            if p.is_meta:
                _fill(p, self.value(self.names.get(id(p), name)).to(device))
        for m in module.modules():  # buffers the constructor made (on the CPU) follow to the device
            for k, b in m._buffers.items():
                if b is not None and b.device != torch.device(device):
                    m._buffers[k] = b.to(device)
        return module


def _fill(p: nn.Parameter, value: torch.Tensor) -> None:
    """`p` (a meta Parameter) becomes `value`, the same Python object (a meta tensor's data
    cannot be set to another device's: the two are swapped whole)."""
    torch.utils.swap_tensors(p, nn.Parameter(value, requires_grad=p.requires_grad))


def _unset(p: torch.Tensor) -> torch.Tensor:
    """A fresh CPU tensor shaped as `p`, marked unset (NaN; integer parameters: no mark)."""
    if p.dtype.is_floating_point or p.dtype.is_complex:
        return torch.full(p.shape, float("nan"), dtype=p.dtype)
    return torch.zeros(p.shape, dtype=p.dtype)


def _state(t: torch.Tensor) -> str:
    """set, unset (NaN throughout, as _unset made it) or partial (NaN left in places)."""
    if not (t.dtype.is_floating_point or t.dtype.is_complex) or t.is_meta or t.numel() == 0:
        return "set"
    if not bool(t.sum().isnan()):  # a NaN anywhere makes the sum NaN: one fast pass
        return "set"
    return "unset" if bool(t.isnan().all()) else "partial"


def build_model(model_cfg: Any, seed: int, device: torch.device | str = "cpu") -> nn.Module:
    """The whole model with its canonical initial values (the single-device model)."""
    model = build_meta(model_cfg, seed)
    return Weights(model, seed, model_cfg).materialize(model, device)
