"""The precisions a case trains at, how they are applied, and what a step really ran at.

fp32, tf32 and bf16 are set the same way wherever a step runs: the worker's training steps,
bench.profile's op microbenchmarks and the single-device calibration's steps (`applied`). A
method whose engine has precision settings of its own sets them to the case's (DeepSpeed's
`torch_autocast` section). Whether it all put the forward in the asked dtype is seen only in
the kernels' outputs: `ForwardDtypes` counts, per dtype, the outputs of the matrix products
and convolutions a step's forward made (the ops autocast lowers). It watches; it changes
nothing a step computes. Where a profile's precision is checked against a case's: the runner.
"""

from __future__ import annotations

import collections
import contextlib

import torch
from torch.utils._python_dispatch import TorchDispatchMode

# fp32: true fp32 everywhere (the paper's setting; TF32 off for matmuls and cuDNN);
# tf32: fp32 tensors, TF32 tensor-core matmuls and convolutions; bf16: torch.autocast to bfloat16.
PRECISIONS = ("fp32", "tf32", "bf16")


def set_precision(precision: str) -> None:
    """The TF32 switches for `precision` (they only act on CUDA; set everywhere, so the row's
    flags say what a GPU would have done). bf16's autocast is entered per step (step_context)."""
    tf32 = precision == "tf32"
    torch.backends.cuda.matmul.allow_tf32 = tf32
    torch.backends.cudnn.allow_tf32 = tf32


def step_context(precision: str, device: torch.device):
    """What each training step runs inside: autocast to bfloat16 on the rank's device type for
    bf16. Around the whole step (forward, backward, optimizer), because the methods' steps are
    opaque to the worker; backward ops then run in the dtypes autocast chose in forward and the
    optimizer's fp32 parameter math is on no autocast list, so it stays fp32."""
    if precision == "bf16":
        return torch.autocast(device.type, dtype=torch.bfloat16)
    return contextlib.nullcontext()


def precision_in_force(precision: str, device: torch.device) -> dict:
    """The precision settings as torch reports them (call inside step_context)."""
    autocast = torch.is_autocast_enabled(device.type)
    return {
        "precision": precision,
        "autocast_dtype": str(torch.get_autocast_dtype(device.type)).removeprefix("torch.") if autocast else None,
        "matmul_allow_tf32": bool(torch.backends.cuda.matmul.allow_tf32),
        "cudnn_allow_tf32": bool(torch.backends.cudnn.allow_tf32),
    }


@contextlib.contextmanager
def applied(precision: str, device: torch.device | str):
    """`precision` in force inside (the TF32 switches and the step's autocast), the TF32
    switches as they were after: for measurements made in a process that does more than one
    thing (bench.profile, the single-device calibration, tests). Yields precision_in_force."""
    if precision not in PRECISIONS:
        raise ValueError(f"precision={precision!r} is invalid; valid: {', '.join(PRECISIONS)}")
    device = torch.device(device)
    before = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    set_precision(precision)
    try:
        with step_context(precision, device):
            yield precision_in_force(precision, device)
    finally:
        torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = before


# The aten ops a forward's matrix products and convolutions reach at the Python dispatch key
# (linear and matmul decompose into mm / addmm / bmm; einsum into bmm).
MATMUL_OPS = frozenset(
    {
        "mm",
        "addmm",
        "bmm",
        "baddbmm",
        "matmul",
        "linear",
        "convolution",
        "_convolution",
        "cudnn_convolution",
        "mkldnn_convolution",
    }
)


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
