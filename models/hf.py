"""Hugging Face transformers models built from their configs, with random weights, as zoo models.

What it does: `HFModelConfig` names an architecture (a transformers model type such as gpt2,
bert, llama, vit, resnet, swin, or a local config.json), a task (models.tasks; by default the
one the architecture is made for: decoders predict the next token, encoders with a masked-LM
head fill in masked tokens, vision models classify images) and any config field to override.
`build()` makes the model from that config with transformers' own random initialisation, wraps
it in the task's summed loss and puts it in training mode. Presets: `paper` is the
architecture's own default size (GPT-2 124M, BERT-Base, Llama 7B, ViT-B/16, ResNet-50, Swin-T),
`tiny` a few-layer model for tests and this machine's real runs.

Attention runs as transformers' SDPA kernel without a materialised mask (registered as
`hetbench_sdpa`): the synthetic batches have no padding and no packed sequences, so a causal
model passes SDPA's causal flag and an encoder attends everywhere, as the mask would say. A
materialised (batch, 1, seq, seq) mask would be computed by advanced indexing over the global
batch positions, which no sharding rule can split.

What it doesn't do: no downloads (no pretrained weights, no tokenizer: batches are synthetic
token ids and pixels), no padding masks, no key-value cache, no dropout unless a config field
turns it on (a program split over uneven shards draws other random masks than one device does).

`python -m models.hf` lists the architectures and the tasks each can serve.
"""

from __future__ import annotations

import dataclasses
import difflib
import json
import os
import re
from typing import Any, ClassVar

import torch
from torch import nn

from models.common import ModelConfig
from models.tasks import TASKS, Task, TaskLoss, check_export, plain

# The Auto class of each task and the keyword its models take their inputs by.
_AUTO = {
    "causal_lm": ("AutoModelForCausalLM", "MODEL_FOR_CAUSAL_LM_MAPPING_NAMES", "input_ids"),
    "masked_lm": ("AutoModelForMaskedLM", "MODEL_FOR_MASKED_LM_MAPPING_NAMES", "input_ids"),
    "seq_cls": ("AutoModelForSequenceClassification", "MODEL_FOR_SEQUENCE_CLASSIFICATION_MAPPING_NAMES", "input_ids"),
    "image_cls": ("AutoModelForImageClassification", "MODEL_FOR_IMAGE_CLASSIFICATION_MAPPING_NAMES", "pixel_values"),
}
# Config fields of a random-dropout kind: zero unless the user sets them.
_DROPOUT = re.compile(r"(dropout|drop_path|_pdrop|drop_rate)")

# tiny: a few small layers. Per model type where its fields differ from the common names;
# otherwise the common transformer fields the config has are set.
_TINY_COMMON = {
    "num_hidden_layers": 2,
    "hidden_size": 64,
    "num_attention_heads": 4,
    "intermediate_size": 128,
    "vocab_size": 512,
    "max_position_embeddings": 128,
    "num_key_value_heads": 2,
    "head_dim": 16,
}
_TINY_BY_TYPE = {
    "resnet": {"embedding_size": 16, "hidden_sizes": [16, 32], "depths": [1, 1], "layer_type": "basic"},
    "convnext": {"hidden_sizes": [16, 32], "depths": [1, 1]},
    "swin": {"embed_dim": 16, "depths": [1, 1], "num_heads": [2, 2], "window_size": 4, "patch_size": 2},
    "vit": {"patch_size": 4},
}
# Model types whose sizes are all in their own entry (their configs derive hidden_size).
_TINY_ONLY_OWN = ("resnet", "convnext", "swin")
_TINY_SEQ_LEN, _TINY_IMAGE, _TINY_LABELS = 32, 32, 10
ATTENTION = "hetbench_sdpa"  # module docstring
_PAPER_SEQ_LEN, _PAPER_IMAGE, _PAPER_LABELS = 128, 224, 1000


def _transformers():
    try:
        import transformers
    except ImportError:
        raise ValueError(
            "model=hf needs the transformers package: pip install '.[zoo]' (scripts/setup.sh installs it)"
        ) from None
    from transformers import AttentionInterface

    AttentionInterface.register(ATTENTION, _attention)
    return transformers


def _attention(
    module,
    query,
    key,
    value,
    attention_mask,
    dropout: float = 0.0,
    scaling: float | None = None,
    is_causal: bool | None = None,
    **kwargs,
):
    """SDPA as transformers' own integration runs it, with grouped key/value heads repeated to
    the query's (as transformers does where SDPA cannot group them): the planner splits the
    heads of query, key and value alike, in whole groups (a view's shard unit)."""
    import torch.nn.functional as F
    from transformers.integrations.sdpa_attention import repeat_kv

    if kwargs.get("softcap") is not None or kwargs.get("position_bias") is not None:
        raise ValueError(
            f"{type(module).__name__}: attention with a softcap or position bias is not SDPA's; "
            "set model.config._attn_implementation=eager"
        )
    groups = getattr(module, "num_key_value_groups", 1)
    if groups > 1:
        key, value = repeat_kv(key, groups), repeat_kv(value, groups)
    causal = getattr(module, "is_causal", True) if is_causal is None else is_causal
    causal = bool(query.shape[2] > 1 and attention_mask is None and causal)
    out = F.scaled_dot_product_attention(
        query, key, value, attn_mask=attention_mask, dropout_p=dropout, scale=scaling, is_causal=causal
    )
    return out.transpose(1, 2).contiguous(), None


def model_types() -> list[str]:
    """Every transformers model type (what model.arch may name)."""
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING_NAMES

    return sorted(CONFIG_MAPPING_NAMES)


def tasks_of(model_type: str) -> list[str]:
    """The tasks the adapters can serve for a model type (it has that head in transformers)."""
    from transformers.models.auto import modeling_auto

    return [t for t, (_, mapping, _) in _AUTO.items() if model_type in getattr(modeling_auto, mapping)]


@dataclasses.dataclass
class HFModelConfig(ModelConfig):
    """A transformers architecture as a zoo model.

    Attributes:
        arch: a transformers model type (gpt2, bert, llama, vit, ...) or a path to a
            config.json (or a folder holding one).
        task: auto (the architecture's own), or one of models.tasks.TASKS.
        config: config fields to override (e.g. {"num_hidden_layers": 4}); the preset's sizes
            apply to the fields not named here.
        preset: tiny or paper (module docstring).
        seq_len: tokens per sample (language tasks); null: the preset's.
        image_size: pixels per side (image tasks); null: the preset's (tiny 32, paper the
            config's image size or 224).
        num_labels: classes (classification tasks); null: the preset's (tiny 10, paper 1000).
    """

    arch: str = "gpt2"
    task: str = "auto"
    config: dict = dataclasses.field(default_factory=dict)
    preset: str = "paper"
    seq_len: int | None = None
    image_size: int | None = None
    num_labels: int | None = None

    real_sources: ClassVar[tuple[str, ...]] = ()

    @property
    def name(self) -> str:
        return f"hf-{self.model_type}"

    @classmethod
    def from_preset(cls, preset: str, num_devices: int = 1, **overrides: Any) -> HFModelConfig:
        if preset not in ("tiny", "paper"):
            raise ValueError(f"preset={preset!r} is unknown for model=hf; known: paper, tiny")
        valid = [f.name for f in dataclasses.fields(cls)]
        for key in overrides:
            if key not in valid:
                raise ValueError(
                    f"model.{key} is not a field of model=hf; valid: {', '.join(valid)} "
                    "(config fields go under model.config.<field>)"
                )
        return cls(preset=preset, **overrides)

    def __post_init__(self) -> None:
        _transformers()
        # null: the preset's or the architecture's value (conf/model/hf.yaml lists common fields)
        self.config = {k: v for k, v in plain(self.config or {}).items() if v is not None}
        self._base = self._base_config()  # validates arch
        self.model_type = self._base.model_type
        served = tasks_of(self.model_type)
        if self.task == "auto":
            self.task = self._default_task(served)
        if self.task not in TASKS:
            raise ValueError(f"model.task={self.task!r} is unknown; known: auto, {', '.join(TASKS)}")
        if self.task not in served:
            raise ValueError(
                f"model.task={self.task} cannot be served by model.arch={self.arch}: transformers has no "
                f"such head for {self.model_type!r}; it serves {', '.join(served) or 'none of the tasks'}"
            )
        for key in self.config:
            if not _has_field(self._base, key):
                near = difflib.get_close_matches(key, list(self._base.to_dict()) + list(self._base.attribute_map), 3)
                raise ValueError(
                    f"model.config.{key} is not a field of {type(self._base).__name__}"
                    + (f"; did you mean {', '.join(near)}?" if near else "")
                )
        self._check_positive(
            **{
                k: v
                for k, v in (
                    ("seq_len", self.seq_len),
                    ("image_size", self.image_size),
                    ("num_labels", self.num_labels),
                )
                if v is not None
            }
        )
        self.hf_config()  # the config's own checks (sizes that do not divide) fail here, in one line
        with torch.device("meta"):  # export can capture it (a meta forward exports, shared with the FLOP count)
            check_export(
                self.build(),
                self.synthetic_batch(2, None),
                f"model.arch={self.arch} (task {self.task})",
                "try another task adapter (model.task=...) or bring the model as model=custom with a "
                "forward torch.export can trace",
            )

    # -- the transformers config -----------------------------------------------------------
    def _base_config(self):
        T = _transformers()
        arch = str(self.arch)
        if arch.endswith(".json") or os.sep in arch or os.path.isdir(arch):
            path = os.path.join(arch, "config.json") if os.path.isdir(arch) else arch
            if not os.path.isfile(path):
                raise ValueError(
                    f"model.arch={arch!r}: no such config.json; give a transformers model type or a local config.json"
                )
            with open(path) as f:
                values = json.load(f)
            if "model_type" not in values:
                raise ValueError(f"model.arch={arch!r}: the config has no model_type field")
            self._from_file = values
            return T.AutoConfig.for_model(values["model_type"])
        self._from_file = None
        if arch not in model_types():
            near = difflib.get_close_matches(arch, model_types(), 3)
            hint = f"did you mean {', '.join(near)}? " if near else ""
            raise ValueError(
                f"model.arch={arch!r} is not a transformers model type or a config.json; {hint}"
                "list the known ones with: python -m models.hf"
            )
        return T.AutoConfig.for_model(arch)

    def _default_task(self, served: list[str]) -> str:
        declared = (self._from_file or {}).get("architectures") or []
        for arch in declared:
            for task, suffix in (
                ("causal_lm", "ForCausalLM"),
                ("masked_lm", "ForMaskedLM"),
                ("seq_cls", "ForSequenceClassification"),
                ("image_cls", "ForImageClassification"),
            ):
                if arch.endswith(suffix) and task in served:
                    return task
        for task in ("image_cls", "masked_lm", "causal_lm", "seq_cls"):  # encoders with an MLM head: masked LM
            if task in served:
                return task
        raise ValueError(
            f"model.arch={self.arch}: transformers has none of the heads the task adapters use "
            f"({', '.join(TASKS)}) for {self.model_type!r}; use model=custom with your own head"
        )

    def hf_config(self):
        """The transformers config this model is built from: the architecture's (or the
        file's), the preset's sizes, dropout off, no cache, then the user's fields."""
        T = _transformers()
        values: dict[str, Any] = dict(self._from_file or {})
        values.pop("model_type", None)
        if self.preset == "tiny":
            tiny = dict(_TINY_BY_TYPE.get(self.model_type, {}))
            for key, value in _TINY_COMMON.items():
                if self.model_type not in _TINY_ONLY_OWN and _has_field(self._base, key) and key not in tiny:
                    tiny[key] = value
            if self.task == "image_cls":
                tiny["image_size"] = self.pixels
            values.update({k: v for k, v in tiny.items() if _has_field(self._base, k)})
        elif self.task == "image_cls" and _has_field(self._base, "image_size"):
            values["image_size"] = self.pixels
        for key, value in self._base.to_dict().items():
            if _DROPOUT.search(key) and isinstance(value, float):
                values[key] = 0.0
        if self.task in ("seq_cls", "image_cls"):
            values["num_labels"] = self.labels
        if _has_field(self._base, "use_cache"):
            values["use_cache"] = False
        values.update(self.config)
        vocab = values.get("vocab_size", getattr(self._base, "vocab_size", None))
        for key in ("bos_token_id", "eos_token_id", "pad_token_id", "decoder_start_token_id"):
            token = values.get(key, getattr(self._base, key, None))
            if isinstance(vocab, int) and isinstance(token, int) and token >= vocab:
                values[key] = None  # a special token of the full vocabulary, past a smaller one
        if self.task == "seq_cls" and getattr(self._base, "pad_token_id", None) is None:
            values.setdefault("pad_token_id", 0)  # decoders pool the last token before the first pad
        try:
            return T.AutoConfig.for_model(self.model_type, **values)
        except (ValueError, TypeError, AssertionError) as exc:
            raise ValueError(f"model.config for {self.model_type}: {str(exc).splitlines()[0]}") from None

    # -- sizes -----------------------------------------------------------------------------
    @property
    def pixels(self) -> int:
        if self.image_size is not None:
            return self.image_size
        if self.preset == "tiny":
            return _TINY_IMAGE
        return int(getattr(self._base, "image_size", _PAPER_IMAGE) or _PAPER_IMAGE)

    @property
    def labels(self) -> int:
        if self.num_labels is not None:
            return self.num_labels
        return _TINY_LABELS if self.preset == "tiny" else _PAPER_LABELS

    @property
    def tokens(self) -> int:
        return (
            self.seq_len if self.seq_len is not None else (_TINY_SEQ_LEN if self.preset == "tiny" else _PAPER_SEQ_LEN)
        )

    def task_spec(self) -> Task:
        cfg = self.hf_config()
        if self.task == "image_cls":
            return Task(
                "image_cls",
                num_labels=self.labels,
                image_size=self.pixels,
                channels=int(getattr(cfg, "num_channels", 3)),
            )
        return Task(self.task, seq_len=self.tokens, vocab_size=int(cfg.vocab_size), num_labels=self.labels)

    # -- the harness's contract ------------------------------------------------------------
    def build(self) -> nn.Module:
        T = _transformers()
        auto, _, keyword = _AUTO[self.task]
        config = self.hf_config()
        model_cls = getattr(T, auto)._model_mapping[type(config)]
        extra = {"attn_implementation": ATTENTION} if getattr(model_cls, "_supports_sdpa", False) else {}
        backbone = getattr(T, auto).from_config(config, **extra)
        model = TaskLoss(backbone, self.task, keyword, export_key=repr(self))
        model.train()
        return model

    @property
    def targets_per_sample(self) -> int:
        return self.task_spec().targets_per_sample

    @property
    def tokens_per_sample(self) -> int | None:
        return self.task_spec().tokens_per_sample

    def synthetic_batch(self, batch_size: int, generator: torch.Generator | None) -> tuple[torch.Tensor, ...]:
        return self.task_spec().synthetic_batch(batch_size, generator)

    def __getstate__(self) -> dict:
        # transformers config objects travel to worker processes as the fields they came from
        state = dict(self.__dict__)
        state.pop("_base", None)
        return state

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state)
        self._base = _transformers().AutoConfig.for_model(self.model_type)

    def __repr__(self) -> str:
        return (
            f"HFModelConfig(arch={self.arch!r}, task={self.task!r}, config={self.config!r}, "
            f"preset={self.preset!r}, seq_len={self.tokens}, image_size={self.pixels if self.task == 'image_cls' else None}, "
            f"num_labels={self.labels})"
        )


def _has_field(config, key: str) -> bool:
    return key in config.to_dict() or key in getattr(config, "attribute_map", {}) or hasattr(config, key)


def main() -> None:
    """Print every transformers model type with the tasks the adapters can serve for it."""
    _transformers()
    rows = [(t, tasks_of(t)) for t in model_types()]
    for t, tasks in rows:
        if tasks:
            print(f"{t:32s} {', '.join(tasks)}")
    print(
        f"\n{sum(1 for _, x in rows if x)} of {len(rows)} model types have a head the task adapters use; "
        "use one with model=hf model.arch=<type>"
    )


if __name__ == "__main__":
    main()
