"""Model FLOPs (torch's FlopCounterMode), and FLOPs per element of the ops it does not count.

FLOPs count matmuls and convolutions (2 per multiply-add), forward and backward, as torch's
counter defines them; element-wise ops are not counted. That is the convention of "model FLOPs"
in MFU reports and of the rows' ideal time (docs/records.md, "Metrics"). How fast a host computes them is
bench.runtime.hostspeed's business.
"""

from __future__ import annotations

import torch
from torch.utils.flop_counter import FlopCounterMode

from bench.core.meta import build_on_meta

# FLOPs per element of element-wise and normalising ops, as the planner's graph counts them
# (methods.capture; docs/cost-model.md "FLOPs and activations"), backward factor 1.
# bench.profile times the "other" op class with the same counts, so its rates price the
# planner's FLOPs.
ELEMENTWISE_FLOPS = {
    "add": 1,
    "sub": 1,
    "mul": 1,
    "truediv": 1,
    "neg": 1,
    "relu": 1,
    "dropout": 2,
    "gelu": 8,
    "tanh": 4,
    "sigmoid": 4,
    "exp": 1,
    "softmax": 5,
    "log_softmax": 5,
    "layer_norm": 8,
    "lt": 1,
    "gt": 1,
    "le": 1,
    "ge": 1,
    "eq": 1,
    "cumsum": 1,
    "one_hot": 1,
    "sum": 1,
    "mean": 1,
    "max_pool2d": 1,
    "adaptive_avg_pool2d": 1,
    "avg_pool2d": 1,
    "cat": 0,
    "topk": 2,
    "embedding": 0,
    "cross_entropy": 6,
    "nll_loss": 1,
}


# Counted FLOPs by (config type, its repr: every field, samples), for the life of the process.
_counted: dict[tuple[type, str, int], float] = {}


def train_flops_per_sample(model_cfg, samples: int = 2) -> float:
    """Forward + backward FLOPs per sample, counted on the meta device (nothing is allocated),
    once per process for equal model configs: a paper-size model takes most of a second to
    count, and a comparison, a calibration or the regression check prepares the same model once
    for each method (and round) (docs/cost-model.md, "Capture, FLOPs and activations")."""
    key = (type(model_cfg), repr(model_cfg), samples)
    if key not in _counted:
        model = build_on_meta(model_cfg)
        with torch.device("meta"):
            batch = model_cfg.synthetic_batch(samples, None)
        with FlopCounterMode(display=False) as counter:
            model(*batch).backward()
        _counted[key] = counter.get_total_flops() / samples
    return _counted[key]
