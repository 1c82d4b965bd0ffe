"""Models built on the meta device, for counting and capturing: shapes and dtypes, no storage.

On the meta device an initialiser writes nothing, but torch runs the random ones (normal_,
uniform_, ...) through their Python reference kernels, and the first of those imports torch's
compiler: seconds in a fresh process. `build_on_meta` builds a model there with those calls
skipped; every other op runs as it would. It does not initialise weights (nothing to write).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from torch.overrides import TorchFunctionMode

# The tensor methods that fill with random numbers, and torch.nn.init's initialisers (each
# fills its first argument in place and returns it).
_RANDOM_FILLS = frozenset(
    {
        torch.Tensor.normal_,
        torch.Tensor.uniform_,
        torch.Tensor.bernoulli_,
        torch.Tensor.exponential_,
        torch.Tensor.geometric_,
        torch.Tensor.log_normal_,
        torch.Tensor.cauchy_,
        torch.Tensor.random_,
        *(getattr(nn.init, n) for n in dir(nn.init) if n.endswith("_") and not n.startswith("_")),
    }
)


class SkipRandomFills(TorchFunctionMode):
    """A random fill of a meta tensor returns the tensor as it is (there is nothing to fill)."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in _RANDOM_FILLS:
            filled = args[0] if args else kwargs.get("tensor")
            if isinstance(filled, torch.Tensor) and filled.is_meta:
                return filled
        return func(*args, **kwargs)


def build_on_meta(model_cfg: Any) -> nn.Module:
    """`model_cfg.build()` on the meta device, its random initialisers skipped."""
    with torch.device("meta"), SkipRandomFills():
        return model_cfg.build()
