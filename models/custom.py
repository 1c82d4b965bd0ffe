"""A user's own module as a zoo model: `model=custom model.factory=pkg.mod:fn`.

What it does: imports `fn` from `pkg.mod` (on PYTHONPATH), calls it with `model.kwargs` to get
an nn.Module, and gives the harness its contract in one of two ways:
  * `model.task=loss` (default): the module's forward takes the batch and returns the loss
    summed over it; `model.inputs` says what one sample of each input looks like (shape past
    the batch dim, dtype, and for integer inputs the exclusive upper bound of the values), and
    `model.targets_per_sample` how many loss terms a sample adds;
  * a task adapter (`causal_lm`, `masked_lm`, `seq_cls`, `image_cls`, models.tasks): the module
    maps the inputs to logits and the adapter adds the summed cross-entropy; the sizes come
    from `model.seq_len`, `model.vocab_size`, `model.num_labels`, `model.image_size`.
The factory is checked when the config is made: it must import, be callable, and return a
module (called once on the meta device, so nothing is allocated).

What it doesn't do: no real data (synthetic batches), no presets (the factory decides sizes).
"""

from __future__ import annotations

import dataclasses
import importlib
from collections.abc import Callable
from typing import Any, ClassVar

import torch
from torch import nn

from models.common import ModelConfig
from models.tasks import TASKS, Task, TaskLoss, check_export, plain

_DTYPES = {
    "float32": torch.float32,
    "float64": torch.float64,
    "bfloat16": torch.bfloat16,
    "int64": torch.int64,
    "int32": torch.int32,
    "bool": torch.bool,
}


def load_factory(spec: str) -> Callable[..., Any]:
    """The callable `module:attr` names; ValueError (one line, the fix) when it does not import."""
    module_name, sep, attr = str(spec).partition(":")
    if not sep or not module_name or not attr:
        raise ValueError(f"model.factory={spec!r} must be 'module.path:callable' (e.g. mypkg.models:build)")
    try:
        module = importlib.import_module(module_name)
    except Exception as exc:  # ImportError, or an error inside the user's module
        raise ValueError(
            f"model.factory={spec!r}: cannot import {module_name} ({type(exc).__name__}: "
            f"{str(exc).splitlines()[0] if str(exc) else ''}); put its package on PYTHONPATH"
        ) from None
    obj = module
    for part in attr.split("."):
        if not hasattr(obj, part):
            raise ValueError(f"model.factory={spec!r}: {module_name} has no attribute {attr!r}")
        obj = getattr(obj, part)
    if not callable(obj):
        raise ValueError(f"model.factory={spec!r}: {attr} is a {type(obj).__name__}, not a callable")
    return obj


@dataclasses.dataclass
class CustomModelConfig(ModelConfig):
    """A module from the user's code (module docstring).

    Attributes:
        factory: 'module.path:callable' returning an nn.Module.
        kwargs: keyword arguments of the factory.
        task: loss (forward returns the summed loss) or one of models.tasks.TASKS.
        inputs: task=loss: one entry per forward input, {shape: [...], dtype: float32 | int64 |
            ..., high: N (integer inputs: values in [0, N))}; shape excludes the batch dim.
        targets_per_sample: task=loss: loss terms one sample adds to the summed loss.
        tokens_per_sample: task=loss: tokens per sample for tokens/s (null: not a language model).
        seq_len, vocab_size, num_labels, image_size, channels: a task adapter's sizes.
    """

    factory: str = ""
    kwargs: dict = dataclasses.field(default_factory=dict)
    task: str = "loss"
    inputs: list = dataclasses.field(default_factory=list)
    targets_per_sample_: int = 1
    tokens_per_sample_: int | None = None
    seq_len: int = 32
    vocab_size: int = 512
    num_labels: int = 10
    image_size: int = 32
    channels: int = 3

    real_sources: ClassVar[tuple[str, ...]] = ()

    name: ClassVar[str] = "custom"

    @classmethod
    def from_preset(cls, preset: str, num_devices: int = 1, **overrides: Any) -> CustomModelConfig:
        """The preset does not size a custom model (the factory does); fields come from model.*."""
        renamed = {"targets_per_sample": "targets_per_sample_", "tokens_per_sample": "tokens_per_sample_"}
        values = {renamed.get(k, k): v for k, v in overrides.items()}
        valid = [f.name for f in dataclasses.fields(cls)]
        for key in values:
            if key not in valid:
                raise ValueError(
                    f"model.{key} is not a field of model=custom; valid: {', '.join(f.rstrip('_') for f in valid)}"
                )
        return cls(**values)

    def __post_init__(self) -> None:
        if not self.factory:
            raise ValueError(
                "model.factory is required for model=custom: 'module.path:callable' returning an "
                "nn.Module, e.g. model.factory=mypkg.models:build"
            )
        load_factory(self.factory)
        self.kwargs = plain(self.kwargs or {})
        self.inputs = plain(self.inputs or [])
        if self.task not in ("loss",) + TASKS:
            raise ValueError(f"model.task={self.task!r} is unknown for model=custom; known: loss, {', '.join(TASKS)}")
        if self.task == "loss":
            if not self.inputs:
                raise ValueError(
                    "model=custom with model.task=loss needs model.inputs: one {shape, dtype[, high]} "
                    "per forward input, e.g. model.inputs='[{shape:[3,32,32],dtype:float32},"
                    "{shape:[],dtype:int64,high:10}]'; or name a task adapter (model.task=image_cls)"
                )
            for i, spec in enumerate(self.inputs):
                self._check_input(i, spec)
        self._check_positive(
            targets_per_sample=self.targets_per_sample_,
            seq_len=self.seq_len,
            vocab_size=self.vocab_size,
            num_labels=self.num_labels,
            image_size=self.image_size,
        )
        with torch.device("meta"):
            check_export(
                self.build(),
                self.synthetic_batch(2, None),
                f"model.factory={self.factory}",
                "make that forward traceable by torch.export (torch.where or torch.cond instead of a "
                "Python branch on a tensor's value)",
            )

    def _check_input(self, i: int, spec: dict) -> None:
        where = f"model.inputs[{i}]"
        if not isinstance(spec.get("shape"), (list, tuple)) or not all(
            isinstance(n, int) and n > 0 for n in spec["shape"]
        ):
            raise ValueError(
                f"{where}.shape={spec.get('shape')!r} must be a list of positive ints (past the batch dim)"
            )
        if spec.get("dtype", "float32") not in _DTYPES:
            raise ValueError(f"{where}.dtype={spec.get('dtype')!r} is unknown; known: {', '.join(_DTYPES)}")
        if not _DTYPES[spec.get("dtype", "float32")].is_floating_point and not (
            isinstance(spec.get("high"), int) and spec["high"] > 0
        ):
            raise ValueError(
                f"{where}.high={spec.get('high')!r}: an integer input needs high, an int > 0 (values "
                "are drawn in [0, high))"
            )

    def task_spec(self) -> Task:
        if self.task == "image_cls":
            return Task("image_cls", num_labels=self.num_labels, image_size=self.image_size, channels=self.channels)
        return Task(self.task, seq_len=self.seq_len, vocab_size=self.vocab_size, num_labels=self.num_labels)

    def build(self) -> nn.Module:
        module = load_factory(self.factory)(**self.kwargs)
        if not isinstance(module, nn.Module):
            raise ValueError(
                f"model.factory={self.factory!r} returned a {type(module).__name__}, not a torch.nn.Module"
            )
        if self.task != "loss":
            module = TaskLoss(module, self.task, export_key=repr(self))
        module.train()
        return module

    @property
    def targets_per_sample(self) -> int:
        return self.targets_per_sample_ if self.task == "loss" else self.task_spec().targets_per_sample

    @property
    def tokens_per_sample(self) -> int | None:
        return self.tokens_per_sample_ if self.task == "loss" else self.task_spec().tokens_per_sample

    def synthetic_batch(self, batch_size: int, generator: torch.Generator | None) -> tuple[torch.Tensor, ...]:
        if self.task != "loss":
            return self.task_spec().synthetic_batch(batch_size, generator)
        out = []
        for spec in self.inputs:
            dtype = _DTYPES[spec.get("dtype", "float32")]
            shape = (batch_size, *spec["shape"])
            if dtype.is_floating_point:
                out.append(torch.randn(shape, generator=generator).to(dtype))
            else:
                out.append(torch.randint(0, int(spec["high"]), shape, generator=generator).to(dtype))
        return tuple(out)
