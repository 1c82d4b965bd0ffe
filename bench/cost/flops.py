"""Model FLOPs (torch's FlopCounterMode), and FLOPs per element of the ops it does not count.

FLOPs count matmuls and convolutions (2 per multiply-add), forward and backward, as torch's
counter defines them; element-wise ops are not counted. That is the convention of "model FLOPs"
in MFU reports and of the rows' ideal time (docs/records.md, "Metrics"). How fast a host computes them is
bench.runtime.hostspeed's business.
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import importlib.util
import json
import os
import tempfile
from pathlib import Path

import torch
from torch.utils.flop_counter import FlopCounterMode

from bench.core.meta import build_on_meta
from bench.core.paths import user_cache_dir

# FLOPs per element of element-wise and normalising ops, as the planner's graph counts them
# (methods.graph; docs/cost-model.md "FLOPs and activations"), backward factor 1.
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
    once per process for equal model configs and kept on disk across processes (_flops_file):
    counting runs the model's meta kernels, and the first of those imports torch's compiler,
    seconds of a fresh process that a comparison or a plan would otherwise pay for a number
    it has counted before (docs/records.md, "Metrics")."""
    key = (type(model_cfg), repr(model_cfg), samples)
    if key not in _counted:
        path = _flops_file(model_cfg, samples)
        flops = _load(path)
        if flops is None:
            model = build_on_meta(model_cfg)
            with torch.device("meta"):
                batch = model_cfg.synthetic_batch(samples, None)
            with FlopCounterMode(display=False) as counter:
                loss = model(*batch)
                if not loss.requires_grad:
                    raise ValueError(
                        f"model {getattr(model_cfg, 'name', type(model_cfg).__name__)}: its loss as torch.export "
                        "captures it has no gradient: forward runs part of the model under torch.no_grad() "
                        "and trains it by a custom autograd.Function's backward (reversible "
                        "layers), which export does not keep; bring the model as model=custom without it"
                    )
                # a write through a boolean mask (T5Gemma 2's end-of-image embeddings) is counted
                # backward as forward counts it on meta tensors: as if every value were true
                with torch.fx.experimental._config.patch(meta_nonzero_assume_all_nonzero=True):
                    loss.backward()
            flops = counter.get_total_flops() / samples
            _store(path, flops)
        _counted[key] = flops
    return _counted[key]


def _flops_file(model_cfg, samples: int) -> Path | None:
    """Where a count is kept: a hash of the config, the sample count, torch's and transformers'
    versions, this module and the code that builds the model (every module of the config's
    package, and a custom model's factory module); None when HETBENCH_FLOPS_CACHE=0."""
    if os.environ.get("HETBENCH_FLOPS_CACHE", "1") == "0":
        return None
    h = hashlib.sha256(f"{type(model_cfg).__module__}.{type(model_cfg).__qualname__}|{model_cfg!r}|{samples}".encode())
    for dist in ("torch", "transformers"):
        try:
            h.update(f"|{dist}={importlib.metadata.version(dist)}".encode())
        except importlib.metadata.PackageNotFoundError:
            pass
    files = {Path(__file__)}
    for module in (type(model_cfg).__module__, str(getattr(model_cfg, "factory", "")).partition(":")[0]):
        spec = importlib.util.find_spec(module) if module else None
        if spec is not None and spec.origin and spec.origin.endswith(".py"):
            files.update(Path(spec.origin).parent.glob("*.py") if module == type(model_cfg).__module__ else ())
            files.add(Path(spec.origin))
    for path in sorted(files):
        h.update(path.as_posix().encode())
        h.update(path.read_bytes())
    return user_cache_dir() / "flops" / f"{h.hexdigest()[:24]}.json"


def _load(path: Path | None) -> float | None:
    """A kept count, or None where there is none or it cannot be read (rebuilt, never trusted)."""
    if path is None:
        return None
    try:
        flops = json.loads(path.read_text())["flops_per_sample"]
    except (OSError, ValueError, KeyError, TypeError):
        return None
    return float(flops) if isinstance(flops, (int, float)) and flops >= 0 else None


def _store(path: Path | None, flops: float) -> None:
    """Written whole or not at all (a temporary file renamed over it); a cache that cannot be
    written is no error."""
    if path is None:
        return
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile("w", dir=path.parent, suffix=".tmp", delete=False) as f:
            json.dump({"flops_per_sample": flops}, f)
        os.replace(f.name, path)
    except OSError:
        pass
