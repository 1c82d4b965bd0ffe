"""Task adapters: any module that maps inputs to logits, made into the harness's contract.

The harness trains modules whose forward takes a batch (batch dim first) and returns the loss
summed over it, and needs synthetic batches, the loss terms and tokens per sample. A task says
how: `TaskLoss` wraps a backbone and computes the summed cross-entropy of its logits; `Task`
draws the batches. Tasks: causal_lm (next-token prediction), seq2seq_lm (the same, by an
encoder-decoder: the encoder reads the window and the decoder predicts its next tokens), masked_lm
(a fixed number of masked tokens per sample, so every sample adds as many loss terms), seq_cls (a
label per sequence) and image_cls (a label per image). It does not build models (models.hf, models.custom).
"""

from __future__ import annotations

import contextlib
import io
import logging
import math
import os
import traceback
from collections import OrderedDict
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

TASKS = ("causal_lm", "masked_lm", "seq_cls", "image_cls", "seq2seq_lm")
# Tasks whose targets are one token per input token.
_PER_TOKEN = ("causal_lm", "masked_lm", "seq2seq_lm")
# The share of a sample's tokens masked_lm masks (BERT's 15%), at least one.
MASK_SHARE = 0.15
IGNORE_INDEX = -100  # cross_entropy's default: the masked LM's unmasked positions


def plain(x):
    """`x` with mappings and sequences made dicts and lists (config nodes arrive as Hydra's
    containers)."""
    from collections.abc import Mapping, Sequence

    if isinstance(x, Mapping):
        return {str(k): plain(v) for k, v in x.items()}
    if isinstance(x, Sequence) and not isinstance(x, (str, bytes)):
        return [plain(v) for v in x]
    return x


def logits_of(out) -> torch.Tensor:
    """A backbone's logits: a tensor, an output object's `.logits`, its `.last_hidden_state`
    where that is one vector per sample (PP-LCNet's classifier returns its head's scores so),
    or a tuple's first item."""
    if isinstance(out, torch.Tensor):
        return out
    logits = getattr(out, "logits", None)
    if isinstance(logits, torch.Tensor):
        return logits
    scores = getattr(out, "last_hidden_state", None)
    if isinstance(scores, torch.Tensor) and scores.dim() == 2:
        return scores
    if isinstance(out, (tuple, list)) and out and isinstance(out[0], torch.Tensor):
        return out[0]
    raise TypeError(
        f"the model returned {type(out).__name__}; a task adapter needs logits (a tensor, an object "
        "with .logits, or a tuple whose first item is the logits)"
    )


def _is_pretrained(module: nn.Module) -> bool:
    """A Hugging Face pretrained model (a sub-model of a composite one has its own initialiser)."""
    return callable(getattr(module, "_init_weights", None)) and hasattr(module, "config")


class TaskLoss(nn.Module):
    """`backbone` with its task's summed cross-entropy: forward(inputs, targets) -> scalar.

    Args:
        backbone: the model; called as backbone(input_ids=...) / backbone(pixel_values=...)
            when `keyword` is set (Hugging Face models), else positionally.
        task: one of TASKS.
        keyword: the backbone's keyword for the inputs, or None.
        export_key: the model config's repr (meta forwards of equal keys share one export).
        patch_size: for a backbone that takes images as flattened patches with their grid's
            `spatial_shapes` (SigLIP 2): the images are cut into patch_size patches here.
        ones_mask: pass an attention mask of ones beside the token ids (a model that makes its
            own only outside tracing: Switch Transformers, LongT5).
    """

    def __init__(
        self,
        backbone: nn.Module,
        task: str,
        keyword: str | None = None,
        export_key: str | None = None,
        patch_size: int | None = None,
        ones_mask: bool = False,
    ):
        super().__init__()
        if task not in TASKS:
            raise ValueError(f"task={task!r} is unknown; known: {', '.join(TASKS)}")
        self.m = backbone
        self.task = task
        self.keyword = keyword
        self.export_key = export_key  # the model config's repr: meta forwards share one export
        self.patch_size = patch_size  # image models that take patches and their grid (SigLIP 2)
        self.ones_mask = ones_mask

    def init_module(self, module: nn.Module) -> None:
        """The backbone's initialiser of `module`'s own parameters: its `init_module`, or a Hugging
        Face model's `_init_weights` (bench.core.weights runs it one parameter at a time), run as
        transformers runs it: on `module`, then on each module that holds it up to the backbone,
        each by the `_init_weights` of the nearest pretrained model at or above it, so that a
        parent's initialiser of its children's weights has the last word (docs/zoo.md, "Initial
        weights")."""
        own = getattr(self.m, "init_module", None)
        if callable(own):
            own(module)
            return
        for owner, init in self._hf_init_chain(module):
            init(owner)

    def _hf_init_chain(self, module: nn.Module) -> list:
        """(module, its initialiser) for `module` and each module above it in the backbone,
        innermost first; [] where the backbone has no `_init_weights`."""
        if not callable(getattr(self.m, "_init_weights", None)):
            return []
        paths = self.__dict__.get("_module_paths")
        entry = paths.get(id(module)) if paths else None
        if entry is None or entry[0] is not module:  # first call, or a copy of the model (weights' shadow)
            paths = {id(m): (m, name) for name, m in self.m.named_modules()}
            self.__dict__["_module_paths"] = paths
            entry = paths.get(id(module))
        if entry is None:  # not the backbone's: its own initialiser alone
            return [(module, self.m._init_weights)]
        parts = entry[1].split(".") if entry[1] else []
        chain = [self.m.get_submodule(".".join(parts[:k])) for k in range(len(parts) + 1)]  # outermost first
        inits, init = [], self.m._init_weights
        for m in chain:
            if m is not self.m and _is_pretrained(m):  # a sub-model: transformers hands it its own
                init = m._init_weights
            inits.append((m, init))
        return inits[::-1]

    def forward(self, inputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        if inputs.device.type == "meta" and not _fake(inputs):
            return self._on_meta(inputs, targets)
        mask = {"attention_mask": torch.ones_like(inputs)} if self.ones_mask else {}
        if self.task == "seq2seq_lm":  # teacher forcing: the decoder reads the window too
            out = (
                self.m(**{self.keyword: inputs, "decoder_input_ids": inputs}, **mask)
                if self.keyword
                else self.m(inputs, inputs)
            )
        elif self.patch_size:
            patches, shapes = patchify(inputs, self.patch_size)
            out = self.m(**{self.keyword: patches, "spatial_shapes": shapes})
        elif self.task == "causal_lm" and inputs.dim() == 3:
            # (B, K, S) token ids over K codebooks: the model takes them as (B * K, S)
            out = self.m(**{self.keyword: inputs.flatten(0, 1)})
        else:
            out = self.m(**{self.keyword: inputs}, **mask) if self.keyword else self.m(inputs)
        logits = logits_of(out)
        if self.task in _PER_TOKEN:
            # (..., V) against (...); masked_lm's unmasked positions are IGNORE_INDEX
            return F.cross_entropy(logits.flatten(0, -2), targets.flatten(), reduction="sum", ignore_index=IGNORE_INDEX)
        return F.cross_entropy(logits, targets, reduction="sum")

    def _on_meta(self, inputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """The loss on meta tensors (shapes only, as the harness counts FLOPs): library code
        that checks values when it is not being traced (transformers' masks ask whether a mask
        is all ones) cannot run there, so forward runs as torch.export captures it."""
        key = None if self.export_key is None else (self.export_key, tuple(inputs.shape), tuple(targets.shape))
        module = _exported.get(key) if key is not None else None
        if module is None:
            module = without_value_checks(export(self, (inputs, targets)).module())
            if key is not None:
                _exported[key] = module
                while len(_exported) > 4:
                    _exported.popitem(last=False)
        # A boolean mask's selection (x[mask]: T5's end-of-sequence tokens, X-MOD's rows of one
        # language) has as many rows as the mask has true values, which meta tensors do not
        # hold: it is counted as if every value were true (an upper bound of its rows).
        with torch.fx.experimental._config.patch(meta_nonzero_assume_all_nonzero=True):
            return module(inputs, targets)


_exported: OrderedDict = OrderedDict()


def patchify(images: torch.Tensor, patch: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(B, C, H, W) images as (B, H/p * W/p, p * p * C) patches in row order, each patch's
    pixels row by row with their channels last (SigLIP 2's image processor), and each image's
    grid (H/p, W/p) as a (B, 2) tensor."""
    b, c, h, w = images.shape
    rows, cols = h // patch, w // patch
    patches = images.reshape(b, c, rows, patch, cols, patch).permute(0, 2, 4, 3, 5, 1)
    # made by ops, not torch.tensor: a tensor forward makes from data is a constant of the
    # captured graph, which a capture on the meta device holds no values of
    grid = torch.cat([images.new_full((b, 1), n, dtype=torch.long) for n in (rows, cols)], dim=1)
    return patches.reshape(b, rows * cols, patch * patch * c), grid


def without_value_checks(module: torch.fx.GraphModule) -> torch.fx.GraphModule:
    """`module` without the checks torch.export keeps of values read from tensors (an assert
    on `lengths.max().item()`, on how many distinct counts `unique_consecutive` finds) and the
    reads that only they use: a check computes nothing the loss needs, and on meta tensors
    there is no value to read (the planner's capture drops them as well)."""
    graph = module.graph
    for node in list(graph.nodes):
        if node.op == "call_function" and node.target is torch.ops.aten._assert_scalar.default:
            graph.erase_node(node)
    graph.eliminate_dead_code()
    module.recompile()
    return module


def export(module: nn.Module, inputs: tuple) -> torch.export.ExportedProgram:
    """torch.export (non-strict) of `module`, quiet: on a refusal export logs the guard and
    prints the graph so far; the refusal is raised (describe_export_error says it in a line)."""
    quiet = logging.getLogger("torch.fx.experimental.symbolic_shapes")
    level = quiet.level
    quiet.setLevel(logging.ERROR)
    try:
        with contextlib.redirect_stderr(io.StringIO()):
            return torch.export.export(module, inputs, strict=False)
    finally:
        quiet.setLevel(level)


def describe_export_error(exc: BaseException) -> str:
    """The construct export stopped at: the innermost frame outside torch, and the error's first line."""
    frames = traceback.extract_tb(exc.__traceback__)
    torch_dir = os.path.dirname(torch.__file__)
    where = next((f for f in reversed(frames) if not f.filename.startswith(torch_dir)), None)
    first = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
    place = f" at {os.path.basename(where.filename)}:{where.lineno} ({(where.line or '').strip()})" if where else ""
    return f"{type(exc).__name__}{place}: {first[:300]}"


def check_export(model: nn.Module, batch: tuple, what: str, fix: str) -> None:
    """ValueError in one line (the model, the construct export refused, the fix) unless
    torch.export can capture `model` on `batch` (meta tensors: nothing is allocated)."""
    try:
        model(*batch) if isinstance(model, TaskLoss) else export(model, tuple(batch))
    except Exception as exc:  # export raises many types; each becomes one line
        raise ValueError(f"{what}: torch.export (non-strict) refused {describe_export_error(exc)}; {fix}") from None


def _fake(t: torch.Tensor) -> bool:
    from torch._subclasses.fake_tensor import is_fake

    return is_fake(t)


@dataclass(frozen=True)
class Task:
    """What a task's batches look like.

    Attributes:
        name: one of TASKS.
        seq_len: tokens per sample (language tasks).
        vocab_size: token ids are below it (language tasks); masked_lm's mask token is the last id.
        num_labels: classes (classification tasks).
        image_size, channels: image tasks' (channels, image_size, image_size) pixels.
        codebooks: token streams per sample of a causal LM over parallel codebooks (MusicGen's
            audio codes): its samples are (codebooks, seq_len) token ids, each stream predicted.
    """

    name: str
    seq_len: int = 0
    vocab_size: int = 0
    num_labels: int = 0
    image_size: int = 0
    channels: int = 3
    codebooks: int = 1

    @property
    def masked_per_sample(self) -> int:
        return max(1, math.floor(MASK_SHARE * self.seq_len + 0.5))

    @property
    def targets_per_sample(self) -> int:
        if self.name in ("causal_lm", "seq2seq_lm"):
            return self.seq_len * self.codebooks
        if self.name == "masked_lm":
            return self.masked_per_sample
        return 1

    @property
    def tokens_per_sample(self) -> int | None:
        return None if self.name == "image_cls" else self.seq_len * self.codebooks

    def synthetic_batch(self, batch_size: int, generator: torch.Generator | None) -> tuple[torch.Tensor, torch.Tensor]:
        """Random (inputs, targets) for `batch_size` samples."""
        g = generator
        if self.name == "image_cls":
            images = torch.randn((batch_size, self.channels, self.image_size, self.image_size), generator=g)
            return images, torch.randint(0, self.num_labels, (batch_size,), generator=g)
        if self.name in ("causal_lm", "seq2seq_lm"):
            # S + 1 tokens per sample: the targets are the inputs shifted by one
            streams = (self.codebooks,) if self.codebooks > 1 else ()
            window = torch.randint(0, self.vocab_size, (batch_size, *streams, self.seq_len + 1), generator=g)
            return window[..., :-1].contiguous(), window[..., 1:].contiguous()
        tokens = torch.randint(0, self.vocab_size - 1, (batch_size, self.seq_len), generator=g)
        if self.name == "seq_cls":
            return tokens, torch.randint(0, self.num_labels, (batch_size,), generator=g)
        # masked_lm: the same number of positions in every sample, so each adds as many terms
        order = torch.rand((batch_size, self.seq_len), generator=g).argsort(dim=1)
        masked = torch.zeros((batch_size, self.seq_len), dtype=torch.bool).scatter(
            1, order[:, : self.masked_per_sample], True
        )
        labels = torch.where(masked, tokens, torch.full_like(tokens, IGNORE_INDEX))
        inputs = torch.where(masked, torch.full_like(tokens, self.vocab_size - 1), tokens)
        return inputs, labels
