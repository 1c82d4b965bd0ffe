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
import warnings
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
        decoder_mask: with ones_mask, an encoder-decoder's decoder gets one too (FSMT, which
            otherwise asks whether its decoder's input holds a pad token).
        index_masks: transformers' attention masks made by broadcasting index tensors, not by
            vmap (whose internals torch.export keeps: T5Gemma 2's sliding window masks).
        real_sample: `n -> (twin, draw)`: a copy of this model with values on the CPU, and
            `draw(seed)`, a batch of n samples of its workload; set, the model is captured on that sample
            (export_on_sample), for a forward that branches on values its workload keeps
            constant (a mask of ones, a check).
    """

    def __init__(
        self,
        backbone: nn.Module,
        task: str,
        keyword: str | None = None,
        export_key: str | None = None,
        patch_size: int | None = None,
        ones_mask: bool = False,
        decoder_mask: bool = False,
        index_masks: bool = False,
        real_sample=None,
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
        self.decoder_mask = decoder_mask
        self.index_masks = index_masks
        self.real_sample = real_sample

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
        with index_masks() if self.index_masks else contextlib.nullcontext():
            return self._loss(inputs, targets)

    def _loss(self, inputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        mask = {"attention_mask": torch.ones_like(inputs)} if self.ones_mask else {}
        if self.ones_mask and self.decoder_mask and self.task == "seq2seq_lm":
            mask["decoder_attention_mask"] = torch.ones_like(inputs)
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
            if self.real_sample is not None:  # captured on the CPU: replayed here on meta tensors
                module = on_meta(module)
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
    prints the graph so far; the refusal is raised (describe_export_error says it in a line).
    A TaskLoss with a `real_sample` is captured on it (export_on_sample)."""
    if getattr(module, "real_sample", None) is not None:
        return export_on_sample(module, inputs)
    return _export(module, inputs)


def _export(module: nn.Module, inputs: tuple) -> torch.export.ExportedProgram:
    quiet = logging.getLogger("torch.fx.experimental.symbolic_shapes")
    level = quiet.level
    quiet.setLevel(logging.ERROR)
    try:
        with contextlib.redirect_stderr(io.StringIO()):
            return torch.export.export(module, inputs, strict=False)
    finally:
        quiet.setLevel(level)


# Fresh batches a capture on a sample is checked against (each its own seed), and how closely
# the captured program's loss must agree with the model's own forward on each.
_SAMPLE_CHECKS = (1, 2)
_SAMPLE_RTOL = 1e-4


class SampleRefused(ValueError):
    """A capture on a real sample that would not hold for other batches (one line: why)."""


def export_on_sample(module: nn.Module, inputs: tuple) -> torch.export.ExportedProgram:
    """torch.export of `module`'s twin on a real sample of its workload (`module.real_sample`,
    as many samples as `inputs` has), with the real values carried beside the fake ones
    (torch's real-tensor propagation): a branch on a tensor's value (`if mask.any()`, an
    `assert` on activations) takes the way the sample's values say, and export records it as
    a runtime assert of the value. Right only where the branch is the same for every batch of
    the workload, so the capture is refused (SampleRefused) where
    - a length still depends on values (expert dispatch, entropy patching: a program fixed to
      one batch's sizes would not fit another), or a value read from a tensor is computed with;
    - on other batches of the workload, the captured program's asserts fail or its loss differs
      from the model's own forward (the branch changes with the batch's values).
    The program holds the twin's values; the planner reads its graph only."""
    with torch.device("cpu"):  # the sample's values, whatever device a capture runs under
        return _export_on_sample(module, inputs)


def _export_on_sample(module: nn.Module, inputs: tuple) -> torch.export.ExportedProgram:
    twin, draw = module.real_sample(int(inputs[0].shape[0]))
    sample = draw(0)
    from torch._export import config as export_config
    from torch._functorch import config as functorch_config
    from torch._subclasses.fake_tensor import FakeTensor

    # a tensor forward makes from data (torch.tensor(0.95) on the inputs' device) is a constant
    # export keeps fake, with the sample's value beside it: that value is the constant's
    with (
        functorch_config.patch(fake_tensor_propagate_real_tensors=True),
        export_config.patch(error_on_lifted_constant_tensors=False),
        _torch_fixes(),
        warnings.catch_warnings(),
    ):
        warnings.simplefilter("ignore")
        try:
            ep = _export(twin, tuple(sample))
        except Exception as exc:  # a length the data decides that export cannot even bind (x[mask])
            from torch.fx.experimental.symbolic_shapes import PendingUnbackedSymbolNotFound

            if not isinstance(exc, PendingUnbackedSymbolNotFound):
                raise
            raise SampleRefused(
                f"captured on a real sample, a length still depends on values ({describe_export_error(exc)[:160]})"
            ) from None
    for n in ep.graph.nodes:  # later passes over the program (run_decompositions) trace shapes only
        val = n.meta.get("val")
        if isinstance(val, FakeTensor):
            val.fake_mode.propagate_real_tensors = False
            break
    for name, value in list(ep.constants.items()):
        if isinstance(value, FakeTensor):
            if getattr(value, "real_tensor", None) is None:
                raise SampleRefused(f"captured on a real sample, its constant {name} holds no value")
            ep.constants[name] = value.real_tensor
    # A write in place into such a constant that nothing reads (Gemma 3n clips a parameter's
    # `.data` in place, a snapshot of it here) goes: the program does not clip the parameter.
    constants = {s.arg.name for s in ep.graph_signature.input_specs if s.kind.name == "CONSTANT_TENSOR"}
    for n in list(ep.graph.nodes):
        target = n.target
        writes = isinstance(target, torch._ops.OpOverload) and target._schema.is_mutable
        if n.op == "call_function" and writes and not n.users and getattr(n.args[0], "name", None) in constants:
            ep.graph.erase_node(n)
    ep.graph_module.recompile()
    _check_specialised(ep.graph)
    program = ep.module()
    for seed in _SAMPLE_CHECKS:
        other = draw(seed)
        with torch.no_grad():
            try:
                got = program(*other)
            except Exception as exc:  # a recorded assert of a value fails on this batch
                raise SampleRefused(
                    f"captured on a real sample, its branch on a value is another on batch {seed} "
                    f"({describe_export_error(exc)})"
                ) from None
            want = twin(*other)
        if not torch.allclose(got, want, rtol=_SAMPLE_RTOL, atol=0.0):
            raise SampleRefused(
                f"captured on a real sample, its loss on batch {seed} is {got.item():.6g}, the model's own "
                f"{want.item():.6g}: a branch on values changes with the batch"
            )
    return ep


def _check_specialised(graph: torch.fx.Graph) -> None:
    """SampleRefused where a graph captured on a real sample still depends on values past its
    asserts: a length (an unbacked size) or a value read from a tensor that is computed with."""
    from torch.fx.experimental.symbolic_shapes import free_unbacked_symbols

    # what the loss reads: the output's inputs, back to the placeholders (an assert is read by nothing)
    used: set[torch.fx.Node] = set()
    todo = [n for n in graph.nodes if n.op == "output"]
    while todo:
        for a in todo.pop().all_input_nodes:
            if a not in used:
                used.add(a)
                todo.append(a)
    for n in graph.nodes:
        if n not in used or n.op != "call_function":
            continue
        val = n.meta.get("val")
        vals = val if isinstance(val, (tuple, list)) else (val,)
        if any(isinstance(v, torch.Tensor) and free_unbacked_symbols(v.shape) for v in vals):
            raise SampleRefused(
                f"captured on a real sample, the shape of {n.name}{_frame(n)} still depends on values "
                "(a program fixed to one batch's lengths would not fit another)"
            )
        if n.target in (torch.ops.aten.item.default, torch.ops.aten._local_scalar_dense.default):
            raise SampleRefused(
                f"captured on a real sample, forward computes with a value it reads from a tensor ({n.name}{_frame(n)})"
            )


def _frame(n: torch.fx.Node) -> str:
    frame = (n.meta.get("stack_trace") or "").strip().splitlines()
    return f" at {frame[-1].strip()}" if frame else ""


@contextlib.contextmanager
def _torch_fixes():
    """Two places where torch 2.13's export with real values goes wrong, put right while it
    runs: a parameter's real value is left uninitialised (its copy takes plain tensors only: it
    is given the parameter's data), and a tensor constant nothing reads, which a capture with
    real values leaves where forward reads `.data`, fails the export (StopIteration): dropped."""
    from torch._export.passes import lift_constants_pass as passes
    from torch._subclasses import meta_utils

    copy, clone, unused = meta_utils._safe_copy, meta_utils._safe_clone, passes._unused_constant

    def plain(t):
        return t.data if isinstance(t, nn.Parameter) else t

    meta_utils._safe_copy = lambda dst, src: copy(dst, plain(src))
    meta_utils._safe_clone = lambda src: clone(plain(src))
    passes._unused_constant = lambda node: [node] if not node.users else unused(node)
    try:
        yield
    finally:
        meta_utils._safe_copy, meta_utils._safe_clone, passes._unused_constant = copy, clone, unused


def on_meta(module: torch.fx.GraphModule) -> torch.fx.GraphModule:
    """`module` with its tensors and every device argument on the meta device (a program captured
    on a real sample holds the sample's CPU values; the harness replays it on meta tensors)."""
    changed = False
    for n in module.graph.nodes:
        if n.op == "get_attr":
            owner_path, _, leaf = n.target.rpartition(".")
            owner = module.get_submodule(owner_path) if owner_path else module
            value = getattr(owner, leaf, None)
            if isinstance(value, torch.Tensor) and value.device.type != "meta":
                meta = value.detach().to("meta")
                if isinstance(value, nn.Parameter):
                    meta = nn.Parameter(meta, requires_grad=value.requires_grad)
                if leaf in owner._parameters:
                    owner._parameters[leaf] = meta
                elif leaf in owner._buffers:
                    owner._buffers[leaf] = meta
                else:
                    setattr(owner, leaf, meta)
        args, kwargs = _meta_devices(n.args), _meta_devices(n.kwargs)
        if args != n.args or kwargs != n.kwargs:
            n.args, n.kwargs = args, kwargs
            changed = True
    if changed:
        module.recompile()
    return module


def _meta_devices(x):
    """`x` (a node's arguments) with every device argument the meta device."""
    if isinstance(x, torch.device):
        return torch.device("meta")
    if isinstance(x, (tuple, list)):
        return type(x)(_meta_devices(v) for v in x)
    if isinstance(x, dict):
        return {k: _meta_devices(v) for k, v in x.items()}
    return x


@contextlib.contextmanager
def index_masks():
    """transformers' attention masks made by broadcasting index tensors instead of vmap: its
    mask functions (causal, sliding window, padding, and their combinations) take either; vmap's
    batching ops, which torch.export keeps in the graph, do not run again outside it."""
    from transformers import masking_utils

    original = masking_utils._vmap_expansion_sdpa

    def expand(mask_function):
        return lambda *indices: mask_function(*masking_utils._non_vmap_expansion_sdpa(*indices))

    masking_utils._vmap_expansion_sdpa = expand
    try:
        yield
    finally:
        masking_utils._vmap_expansion_sdpa = original


def describe_export_error(exc: BaseException) -> str:
    """The construct export stopped at: the innermost frame outside torch, and the error's first line
    (a capture on a real sample refused: its own line)."""
    if isinstance(exc, SampleRefused):
        return str(exc)
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
