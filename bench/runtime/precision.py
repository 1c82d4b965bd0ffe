"""What precision a training step really ran at: the dtypes its forward's matrix products made.

The case's precision is applied by the worker (TF32 switches, an outer autocast) and, where a
method's engine has its own precision settings, by the method (DeepSpeed's `torch_autocast`
section). Whether the two together put the forward in the asked dtype is seen only by looking
at the kernels' outputs: `ForwardDtypes` counts, per dtype, the outputs of the matrix products
and convolutions a step's forward made (the ops autocast lowers). It watches one unmeasured
step of a run; it does not change what the step computes.
"""

from __future__ import annotations

import collections

import torch
from torch.utils._python_dispatch import TorchDispatchMode

# The aten ops a forward's matrix products and convolutions reach at the Python dispatch key
# (linear and matmul decompose into mm / addmm / bmm; einsum into bmm).
MATMUL_OPS = frozenset({"mm", "addmm", "bmm", "baddbmm", "matmul", "linear", "convolution", "_convolution",
                        "cudnn_convolution", "mkldnn_convolution"})


class ForwardDtypes(TorchDispatchMode):
    """Counts the dtypes of the matrix products' and convolutions' outputs made in forward.

    Forward is where grad mode is on: backward runs with it off (the autograd engine turns it
    off unless asked for a double backward) and so does the optimizer's step.
    """

    def __init__(self):
        super().__init__()
        self.dtypes: collections.Counter[str] = collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if torch.is_grad_enabled() and func.overloadpacket.__name__ in MATMUL_OPS and isinstance(out, torch.Tensor):
            self.dtypes[str(out.dtype).removeprefix("torch.")] += 1
        return out

    def observed(self) -> dict[str, int]:
        """{dtype: outputs} in a stable order (most first)."""
        return dict(self.dtypes.most_common())
