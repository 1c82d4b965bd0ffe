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
import inspect
import json
import os
import re
from typing import Any, ClassVar

import torch
from torch import nn

from models.common import ModelConfig
from models.tasks import TASKS, SampleRefused, Task, TaskLoss, check_export, describe_export_error, plain

# The Auto class of each task and the keyword its models take their inputs by.
_AUTO = {
    "causal_lm": ("AutoModelForCausalLM", "MODEL_FOR_CAUSAL_LM_MAPPING_NAMES", "input_ids"),
    "masked_lm": ("AutoModelForMaskedLM", "MODEL_FOR_MASKED_LM_MAPPING_NAMES", "input_ids"),
    "seq_cls": ("AutoModelForSequenceClassification", "MODEL_FOR_SEQUENCE_CLASSIFICATION_MAPPING_NAMES", "input_ids"),
    "image_cls": ("AutoModelForImageClassification", "MODEL_FOR_IMAGE_CLASSIFICATION_MAPPING_NAMES", "pixel_values"),
    "seq2seq_lm": ("AutoModelForSeq2SeqLM", "MODEL_FOR_SEQ_TO_SEQ_CAUSAL_LM_MAPPING_NAMES", "input_ids"),
}
# Config fields of a random-dropout kind (LayerDrop skips whole layers at random): zero unless
# the user sets them.
_DROPOUT = re.compile(r"(dropout|drop_path|_pdrop|drop_rate|layerdrop)")

# tiny: a few small layers. Per model type where its fields differ from the common names;
# otherwise the common transformer fields the config has are set ("small"). A model that does
# not build or export with those keeps its own widths at two layers ("shallow"): its fields
# agree with each other in ways a fixed list of sizes cannot know (rotary and latent head
# dims, per-stage lists, layer patterns).
TINY_LEVELS = ("small", "shallow")
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
# Parts of a layer, set where the config has them on (not None): a head's rotary part (GPT-J's
# rotary_dim), latent attention's (DeepSeek's MLA: query and key-value ranks, the rotary and
# plain parts of a query-key head, a value head), an expert's width.
_TINY_PARTS = {
    "rotary_dim": 8,
    "qk_rope_head_dim": 8,
    "qk_nope_head_dim": 8,
    "qk_head_dim": 16,
    "v_head_dim": 16,
    "kv_lora_rank": 32,
    "q_lora_rank": 32,
    "moe_intermediate_size": 64,
}
# Layers that reuse an earlier layer's key-value cache (Gemma 3n's and Gemma 4's last layers):
# none at tiny, whose few layers keep one of each attention kind, each making its own cache.
_TINY_NONE = ("num_kv_shared_layers",)
_SWIN = {"embed_dim": 16, "depths": [1, 1], "num_heads": [2, 2], "window_size": 4, "patch_size": 2}
_TINY_BY_TYPE = {
    "resnet": {"embedding_size": 16, "hidden_sizes": [16, 32], "depths": [1, 1], "layer_type": "basic"},
    "convnext": {"hidden_sizes": [16, 32], "depths": [1, 1]},
    "swin": _SWIN,
    "donut-swin": _SWIN,
    "swinv2": _SWIN,
    "maskformer-swin": _SWIN,
    "vit": {"patch_size": 4},
    "reformer": {"axial_pos_shape": [4, 8], "axial_pos_embds_dim": [16, 48]},
}
# At every tiny level: fields whose defaults leave the model unbuildable (None where a number
# is read) or tied to the default depth or sequence length.
_TINY_FIXES = {
    "deepseek_v2": {"num_experts_per_tok": 2},
    "dots1": {"n_routed_experts": 4, "num_experts_per_tok": 2, "n_shared_experts": 1},
    "esm": {"pad_token_id": 1},
    "gpt_neo": {"attention_types": [[["global", "local"], 1]]},
    "reformer": {"axial_pos_shape": [4, 8]},
}
# transformers' default configs that do not build as they are: a field the modelling code reads is
# missing or None in the default (the model builds from a real checkpoint's config.json, which
# has it). Per model type (a sub-config's own type where the field is its: qwen4_exp_text):
# the fields tiny sets, and why. A general rule fills an empty rope_parameters (_default_rope).
_DEFAULT_CONFIG_REPAIRS: dict[str, tuple[dict[str, Any], str]] = {
    "lfm2_moe": (
        {"layer_types": ["conv", "full_attention"]},
        "layer_types is None and its layers read their kind from it: a convolution and an attention layer",
    ),
    "dbrx": (
        {"attn_config": {"rope_theta": 10000.0, "clip_qkv": 8.0}},
        "its attention reads attn_config.rope_theta, which the default lacks, and clamps by clip_qkv, None",
    ),
    "qwen4_exp_text": (
        {
            "indexer_n_heads": 2,
            "indexer_kv_heads": 1,
            "indexer_head_dim": 256,
            "indexer_budget": 8,
            "indexer_compress_ratio": 4,
        },
        "its indexed attention layers always build the token indexer, whose sizes are None by default",
    ),
}
_ROPE_THETA = 10000.0  # transformers' default rotary base
# The most parameters a model captured on a real sample is built with on the CPU (values).
_SAMPLE_PARAMETERS = 200_000_000
# A capture on a real sample refused because the data decides (models.tasks.export_on_sample).
_SAMPLE_REFUSALS = (
    "still depends on values",
    "value it reads from a tensor",
    "another on batch",
    "changes with the batch",
)
# What each try of __post_init__ sets (the tiny level, the attention, the inputs' form).
_TRY_FIELDS = (
    "_tiny_level",
    "_attention",
    "_own_pixels",
    "_ones_mask",
    "_codebooks",
    "_index_masks",
    "_on_sample",
)
# Model types whose sizes are all in their own entry (their configs derive hidden_size).
_TINY_ONLY_OWN = ("resnet", "convnext", "swin", "donut-swin", "swinv2", "maskformer-swin")
_SPECIAL_TOKENS = ("bos_token_id", "eos_token_id", "pad_token_id", "decoder_start_token_id")
# Fields that count layers (tiny: 2 of each) and per-stage block counts (tiny: 1 per stage).
_LAYER_COUNTS = (
    "num_hidden_layers",
    "num_layers",
    "n_layer",
    "n_layers",
    "num_decoder_layers",
    "num_encoder_layers",
    "decoder_layers",
    "encoder_layers",
)
_TINY_LAYERS = 2
_TINY_SEQ_LEN, _TINY_IMAGE, _TINY_LABELS = 32, 32, 10
ATTENTION = "hetbench_sdpa"  # module docstring
_ATTENTION_CALLS = [0]  # calls of _attention in this process (HFModelConfig._check_builds)
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


def _has_attention(model) -> bool:
    """Whether `model` has modules that ask transformers for their attention (an `...Attention`
    module under a config that names one)."""
    return any(
        type(m).__name__.endswith("Attention") and getattr(getattr(m, "config", None), "_attn_implementation", None)
        for m in model.modules()
    )


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

    _ATTENTION_CALLS[0] += 1
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


# Each config's settled attempt (HFModelConfig.__post_init__: a pure function of its fields), by
# _settle_key: the same model composed again in a process builds and exports no trial model.
_SETTLED: dict[str, dict] = {}


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
        key = self._settle_key()
        if key in _SETTLED:  # composed before in this process: the attempt it settled on
            self.__dict__.update(_SETTLED[key])
            return
        # The first (tiny level, attention) the model builds and exports with: a pure function
        # of the fields above, so workers, which get this object, build the same. Attention:
        # ours (module docstring), else transformers' SDPA (a model that reads the mask it
        # makes), else its eager one (softcaps, position biases).
        # Where none does, the last one's error is raised: the architecture's own widths and
        # its reference attention, whose refusal is the model's, not the preset's. Then, with
        # each attention at each level, the inputs another way, where the model has one (their
        # refusal, if these fail too, is not raised): a language model whose forward takes an
        # attention mask gets one of ones (Switch Transformers and LongT5 make theirs only
        # outside tracing); a causal LM whose config has num_codebooks gets (codebooks, seq_len)
        # token ids per sample, which it takes as (batch * codebooks, seq_len) (MusicGen).
        levels = TINY_LEVELS if self.preset == "tiny" else TINY_LEVELS[:1]
        usual = {"_own_pixels": False, "_ones_mask": False, "_codebooks": 1, "_index_masks": False, "_on_sample": False}
        tries = [
            {**usual, "_tiny_level": level, "_attention": attention}
            for level in levels
            for attention in (ATTENTION, "sdpa", "eager")
        ]
        if self.preset == "tiny" and self.task == "image_cls" and self.image_size is None:
            # a vision model that downsamples 32 pixels to nothing: its own image size
            tries += [
                {**usual, "_tiny_level": TINY_LEVELS[-1], "_attention": attention, "_own_pixels": True}
                for attention in (ATTENTION, "eager")
            ]
        main = len(tries)
        others = []
        params = _forward_params(self._model_class())
        if self.task != "image_cls" and "attention_mask" in params:
            others.append({"_ones_mask": True})
        codebooks = _value(_for_model_class(self._base, self._model_class()), "num_codebooks")
        if self.task == "causal_lm" and isinstance(codebooks, int) and codebooks > 1:
            others.append({"_codebooks": codebooks})
        attentions = (ATTENTION, "sdpa", "eager")
        tries += [
            {**usual, "_tiny_level": level, "_attention": attention, **o}
            for o in others
            for level in levels
            for attention in attentions
        ]
        # Then, at every attention: an encoder-decoder whose decoder takes a mask gets ones for
        # both (FSMT asks whether its decoder's input holds a pad token); transformers' masks made
        # without vmap (T5Gemma 2); last, the capture on a real sample of the workload
        # (models.tasks.export_on_sample: a forward that branches on values the workload keeps
        # constant: LED's and Longformer's global attention of a mask of ones).
        mask = {"_ones_mask": "attention_mask" in params}
        later = [{"_index_masks": True}, {"_on_sample": True, **mask}]
        if self.task == "seq2seq_lm" and mask["_ones_mask"] and "decoder_attention_mask" in params:
            later.insert(0, {"_ones_mask": "decoder"})
        tries += [
            {**usual, "_tiny_level": level, "_attention": attention, **o}
            for o in later
            for level in levels
            for attention in attentions
        ]
        error = refused = None
        for i, attempt in enumerate(tries):
            self.__dict__.update(attempt)
            try:
                self._check_builds()
                _SETTLED[key] = attempt
                return
            except ValueError as exc:
                error = exc if i < main else error
                if attempt["_on_sample"] and refused is None and any(w in str(exc) for w in _SAMPLE_REFUSALS):
                    refused = "captured on a real sample" + str(exc).split("captured on a real sample", 1)[1]
                    refused = refused.split("; try another", 1)[0]
        head, sep, rest = str(error).partition(": torch.export (non-strict) refused ")
        if refused and sep:  # why a capture on a real sample does not hold either, first
            raise ValueError(f"{head}: {refused}; on meta tensors torch.export (non-strict) refused {rest}") from None
        raise error

    def _settle_key(self) -> str:
        """What the attempt a config settles on depends on: its fields (and a config.json's
        values), in this process's transformers."""
        fields = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        return json.dumps([fields, getattr(self, "_from_file", None)], sort_keys=True, default=repr)

    def _check_builds(self) -> None:
        """ValueError in one line unless the config is valid and the model builds and exports."""
        self.hf_config()  # the config's own checks (sizes that do not divide) fail here, in one line
        calls = _ATTENTION_CALLS[0]
        with torch.device("meta"):  # export can capture it (a meta forward exports, shared with the FLOP count)
            model = self.build()
            check_export(
                model,
                self.synthetic_batch(2, None),
                f"model.arch={self.arch} (task {self.task})",
                "try another task adapter (model.task=...) or bring the model as model=custom with a "
                "forward torch.export can trace",
            )
        # A module that asks transformers for an attention it does not find takes its eager one
        # silently: ours is taken only where the model really ran it.
        if self._attention == ATTENTION and _ATTENTION_CALLS[0] == calls and _has_attention(model):
            raise ValueError(f"model.arch={self.arch}: its attention did not run the harness's")

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
        try:
            return T.AutoConfig.for_model(arch)
        except Exception as exc:  # a default config that fails its own checks
            raise ValueError(
                f"model.arch={arch}: transformers' own default config of {arch} does not validate "
                f"({describe_export_error(exc)}); give the config.json of a real checkpoint: "
                "model.arch=path/to/config.json"
            ) from None

    def _default_task(self, served: list[str]) -> str:
        declared = (self._from_file or {}).get("architectures") or []
        for arch in declared:
            for task, suffix in (
                ("causal_lm", "ForCausalLM"),
                ("masked_lm", "ForMaskedLM"),
                ("seq_cls", "ForSequenceClassification"),
                ("image_cls", "ForImageClassification"),
                ("seq2seq_lm", "ForConditionalGeneration"),
            ):
                if arch.endswith(suffix) and task in served:
                    return task
        # encoders with an MLM head: masked LM; encoder-decoders: their language model head
        for task in ("image_cls", "masked_lm", "causal_lm", "seq2seq_lm", "seq_cls"):
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
        pixels = self.pixels if self.task == "image_cls" else None
        if self.preset == "tiny":
            values.update(_tiny_fields(self._base, getattr(self, "_tiny_level", TINY_LEVELS[0]), pixels))
        elif pixels is not None and _has_field(self._base, "image_size"):
            values["image_size"] = pixels
        for key, value in self._base.to_dict().items():
            if _DROPOUT.search(key) and isinstance(value, float):
                values[key] = 0.0
        if self.task in ("seq_cls", "image_cls"):
            values["num_labels"] = self.labels
        if _has_field(self._base, "use_cache"):
            values["use_cache"] = False
        values.update(self.config)
        values.update(_tokens_in_vocab(self._base, values))
        if self.task == "seq_cls" and getattr(self._base, "pad_token_id", None) is None:
            values.setdefault("pad_token_id", 0)  # decoders pool the last token before the first pad
        encoder_decoder = self.task == "seq_cls" and getattr(self._base, "is_encoder_decoder", False)
        if encoder_decoder and getattr(self._base, "decoder_start_token_id", None) is None:
            # the decoder starts from the pad token (T5's convention)
            values.setdefault("decoder_start_token_id", values.get("pad_token_id", self._base.pad_token_id) or 0)
        if getattr(self._base, "languages", None) and getattr(self._base, "default_language", "") is None:
            values.setdefault("default_language", self._base.languages[0])  # X-MOD's adapters pick one
        try:
            return T.AutoConfig.for_model(self.model_type, **values)
        except Exception as exc:  # a config's own checks raise many types; each becomes one line
            raise ValueError(
                f"model.config for {self.model_type}{self._preset_words()}: the config refused its fields: "
                f"{describe_export_error(exc)}; set the field it names with model.config.<field>=..."
            ) from None

    def _preset_words(self) -> str:
        if self.preset != "tiny":
            return ""
        return f" (preset=tiny, {getattr(self, '_tiny_level', TINY_LEVELS[0])} sizes)"

    # -- sizes -----------------------------------------------------------------------------
    @property
    def pixels(self) -> int:
        if self.image_size is not None:
            return self.image_size
        if self.preset == "tiny" and not getattr(self, "_own_pixels", False):
            return _TINY_IMAGE
        own = getattr(self._base, "image_size", _PAPER_IMAGE) or _PAPER_IMAGE
        return int(own[0] if isinstance(own, (list, tuple)) else own)

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
        model_cls = self._model_class()
        cfg = _for_model_class(self.hf_config(), model_cls)
        if _input_keyword(model_cls, self.task) == "input_ids" and self.task == "image_cls":
            # an image head on pixel token ids (ImageGPT's colour clusters): a sequence's label
            return Task("seq_cls", seq_len=self.tokens, vocab_size=_vocab_size(cfg), num_labels=self.labels)
        if self.task == "image_cls":
            vision = getattr(cfg, "vision_config", None) or cfg
            return Task(
                "image_cls",
                num_labels=self.labels,
                image_size=self.pixels,
                channels=int(getattr(vision, "num_channels", getattr(cfg, "num_channels", 3))),
            )
        return Task(
            self.task,
            seq_len=self.tokens,
            vocab_size=_vocab_size(cfg),
            num_labels=self.labels,
            codebooks=getattr(self, "_codebooks", 1),
        )

    def _model_class(self):
        """The model class of the task's Auto class for this config: where it maps the config
        to several, the one the config's `architectures` names, else the first."""
        mapped = getattr(_transformers(), _AUTO[self.task][0])._model_mapping[type(self._base)]
        if not isinstance(mapped, (tuple, list)):
            return mapped
        names = {m.__name__: m for m in mapped}
        declared = [a for a in (self._from_file or {}).get("architectures") or [] if a in names]
        return names[declared[0]] if declared else mapped[0]

    # -- the harness's contract ------------------------------------------------------------
    def build(self) -> nn.Module:
        config = self.hf_config()
        model_cls = self._model_class()
        keyword = _input_keyword(model_cls, self.task)
        config = _for_model_class(config, model_cls)
        attention = getattr(self, "_attention", ATTENTION)
        supported = attention != ATTENTION or getattr(model_cls, "_supports_sdpa", False)
        extra = {"attn_implementation": attention} if supported else {}
        try:
            backbone = model_cls._from_config(config, **extra)
        except Exception as exc:  # transformers' models fail to build in many ways; each becomes one line
            raise ValueError(
                f"model.arch={self.arch}{self._preset_words()}: transformers could not build "
                f"{model_cls.__name__} from its config: {describe_export_error(exc)}; a config field "
                "disagrees with another: set it with model.config.<field>=..."
            ) from None
        if torch.get_default_device().type == "meta":
            # built for counting and capturing: a tensor made by a legacy constructor
            # (XLNet's torch.FloatTensor(...) parameters) ignores the default device
            backbone.to("meta")
        patch_size = None
        if self.task == "image_cls" and "spatial_shapes" in _forward_params(model_cls):
            vision = getattr(config, "vision_config", None) or config
            patch_size = int(vision.patch_size)  # it takes flattened patches and their grid
        model = TaskLoss(
            backbone,
            self.task,
            keyword,
            # each try its own export: one whose export passed and whose replay failed is not reused
            export_key=repr(self) + repr({k: v for k, v in sorted(self.__dict__.items()) if k in _TRY_FIELDS}),
            patch_size=patch_size,
            ones_mask=bool(getattr(self, "_ones_mask", False)),
            decoder_mask=getattr(self, "_ones_mask", False) == "decoder",
            index_masks=getattr(self, "_index_masks", False),
            real_sample=self._real_sample if getattr(self, "_on_sample", False) else None,
        )
        model.train()
        return model

    def _real_sample(self, batch_size: int):
        """This model built on the CPU with its random values (torch seeded with 0), and a draw
        of `batch_size` synthetic samples by seed: what a capture on a real sample runs
        (models.tasks.export_on_sample)."""
        with torch.device("meta"):
            count = sum(p.numel() for p in self.build().parameters())
        if count > _SAMPLE_PARAMETERS:
            raise SampleRefused(
                f"captured on a real sample, it would be built on the CPU with {count / 1e6:.0f}M parameters "
                f"(at most {_SAMPLE_PARAMETERS / 1e6:.0f}M)"
            )
        with torch.device("cpu"), torch.random.fork_rng():
            torch.manual_seed(0)
            model = self.build()
        return model, lambda seed: self.synthetic_batch(batch_size, torch.Generator().manual_seed(seed))

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


def _input_keyword(model_cls, task: str) -> str:
    """The keyword `model_cls` takes the task's inputs by: the task's (input_ids, pixel_values),
    or input_ids where its forward has no such parameter and takes token ids (an image head on
    pixel tokens: ImageGPT)."""
    keyword = _AUTO[task][2]
    params = _forward_params(model_cls)
    return "input_ids" if params and keyword not in params and "input_ids" in params else keyword


def _forward_params(model_cls) -> tuple[str, ...]:
    """The names of `model_cls.forward`'s parameters (none where it has no signature to read)."""
    try:
        return tuple(inspect.signature(model_cls.forward).parameters)
    except (TypeError, ValueError):
        return ()


def _has_field(config, key: str) -> bool:
    if key in config.to_dict() or key in getattr(config, "attribute_map", {}):
        return True
    try:
        return hasattr(config, key)
    except Exception:  # a field the config keeps per layer and refuses to read globally
        return True


def _settable(config, key: str) -> bool:
    """A field the config takes: one it stores or maps to a stored one, not a property it
    derives from others (falcon's head_dim, funnel's layer count from its block sizes)."""
    if key in config.to_dict() or key in getattr(config, "attribute_map", {}):
        return True
    return hasattr(config, key) and not isinstance(getattr(type(config), key, None), property)


def _tiny_fields(config, level: str, pixels: int | None) -> dict[str, Any]:
    """The tiny preset's fields of `config` at `level` (TINY_LEVELS), its sub-configs' (text,
    vision, ...) as whole dicts with theirs; `pixels`: the image size of an image task."""
    model_type = getattr(config, "model_type", "")
    out: dict[str, Any] = {}
    if level == "small":
        out = dict(_TINY_BY_TYPE.get(model_type, {}))
        if model_type not in _TINY_ONLY_OWN:
            out.update({k: v for k, v in _TINY_COMMON.items() if k not in out and _has_field(config, k)})
            out.update({k: v for k, v in _TINY_PARTS.items() if k not in out and _value(config, k) is not None})
    else:  # shallow: the architecture's own widths, two layers, a small vocabulary
        out = {k: _TINY_LAYERS for k in _LAYER_COUNTS if isinstance(_value(config, k), int)}
        if isinstance(_value(config, "depths"), list):
            out["depths"] = [1] * len(config.depths)
        if isinstance(_value(config, "vocab_size"), int):
            out["vocab_size"] = _TINY_COMMON["vocab_size"]
    out.update({k: 0 for k in _TINY_NONE if isinstance(_value(config, k), int) and k not in out})
    out.update({k: v for k, v in _TINY_FIXES.get(model_type, {}).items() if k not in out})
    out.update({k: v for k, v in _DEFAULT_CONFIG_REPAIRS.get(model_type, ({}, ""))[0].items() if k not in out})
    out.update(_default_rope(config))
    if isinstance(out.get("depths"), list) and isinstance(_value(config, "num_stages"), int):
        out["num_stages"] = len(out["depths"])  # stage lists and their count agree
    if pixels is not None:
        own = _value(config, "image_size")
        out["image_size"] = [pixels] * len(own) if isinstance(own, (list, tuple)) else pixels
    out = {k: v for k, v in out.items() if _settable(config, k)}
    if level != "small":  # small keeps what the config derives from its layer count itself
        out.update(_per_layer_fields(config, out))
    for name in getattr(config, "sub_configs", None) or {}:
        sub = getattr(config, name, None)
        if sub is None or not hasattr(sub, "to_dict"):
            continue
        fields = _tiny_fields(sub, level, pixels if "vision" in name else None)
        fields.update(_tokens_in_vocab(sub, fields))
        zeroed = {k: 0.0 for k, v in sub.to_dict().items() if _DROPOUT.search(k) and isinstance(v, float)}
        repaired = out.get(name) if isinstance(out.get(name), dict) else {}  # a repair of the parent's type
        if fields or zeroed or repaired:
            out[name] = {**sub.to_dict(), **zeroed, **fields, **repaired}
    return out


def _default_rope(config) -> dict[str, Any]:
    """A rope entry for each kind of layer where the config names kinds (layer_types) and keeps
    its rope parameters per kind, but has none (an empty rope_parameters: Cohere's Compass
    text model reads rope_parameters[kind]): transformers' default rotary embedding."""
    rope, kinds = _value(config, "rope_parameters"), _value(config, "layer_types")
    if rope != {} or not isinstance(kinds, list) or not kinds or not _settable(config, "rope_parameters"):
        return {}
    return {"rope_parameters": {k: {"rope_type": "default", "rope_theta": _ROPE_THETA} for k in dict.fromkeys(kinds)}}


def _per_layer_fields(config, fields: dict[str, Any]) -> dict[str, Any]:
    """Per-layer fields of `config` cut to the layer counts `fields` sets: a list of layer
    indices keeps those below the new count; a list with an entry per layer its first and last
    (a pattern's kinds, e.g. sliding then full attention); a mapping by layer index its layers
    below the new count."""
    out: dict[str, Any] = {}
    for key in _LAYER_COUNTS:
        old, new = _value(config, key), fields.get(key)
        if not isinstance(old, int) or not isinstance(new, int) or new >= old:
            continue
        for name, value in config.to_dict().items():
            if name in fields or name in out or name in ("id2label", "label2id"):
                continue
            if _layer_indices(value, old):
                out[name] = [i for i in value if i < new]
            elif isinstance(value, list) and len(value) == old and old > 1:
                out[name] = [value[0], value[-1]][:new] if new <= 2 else value[:new]
            elif isinstance(value, dict) and value and all(str(k).isdigit() for k in value):
                out[name] = {k: v for k, v in value.items() if int(k) < new}
    return {k: v for k, v in out.items() if _settable(config, k)}


def _layer_indices(value, count: int) -> bool:
    """Whether `value` lists layers by index (distinct, increasing, below `count`)."""
    if not isinstance(value, list) or not value or not all(type(i) is int for i in value):
        return False
    return all(0 <= a < b < count for a, b in zip(value, value[1:])) and value[-1] < count


def _value(config, key: str):
    """config.<key>, or None where the config has none or refuses to give one global value
    (a field it keeps per layer)."""
    try:
        return getattr(config, key, None)
    except Exception:  # transformers' AmbiguousGlobalPerLayerAttributeError and the like
        return None


def _for_model_class(config, model_cls):
    """The config `model_cls` takes: `config`, or its sub-config of that class (a composite
    config whose causal LM is its decoder's: MusicGen)."""
    wanted = getattr(model_cls, "config_class", None)
    if wanted is None or isinstance(config, wanted):
        return config
    for name in getattr(config, "sub_configs", None) or {}:
        sub = getattr(config, name, None)
        if isinstance(sub, wanted):
            return sub
    return config


def _tokens_in_vocab(config, values: dict[str, Any]) -> dict[str, Any]:
    """Special token ids of `config` past the vocabulary `values` gives it (a token of the full
    vocabulary, past a smaller one): None where the config allows it, else the id modulo the
    vocabulary (a field typed `int`). Special: the common ones, and in a config with no parts
    of its own every `*_token_id` (a CTC head's blank token) beside its vocabulary."""
    vocab = values.get("vocab_size", _value(config, "vocab_size"))
    out = {}
    keys = list(_SPECIAL_TOKENS)
    if not getattr(config, "sub_configs", None):
        keys += [k for k in config.to_dict() if k.endswith("_token_id") and k not in keys]
    for key in keys:
        token = values.get(key, _value(config, key))
        if isinstance(vocab, int) and vocab > 0 and isinstance(token, int) and token >= vocab:
            out[key] = token % vocab if _annotation(config, key) is int else None
    return out


def _annotation(config, key: str):
    """The type a config class declares for a field (None where it declares none)."""
    for klass in type(config).__mro__:
        hints = getattr(klass, "__annotations__", {})
        if key in hints:
            return hints[key]
    return None


def _vocab_size(config) -> int:
    """Token ids of a language task are below it: the config's (or its text config's)
    vocabulary; a byte range for models of characters without one (canine)."""
    try:
        text = config.get_text_config()
    except Exception:  # several text configs (an encoder's and a decoder's): the top one's
        text = None
    for cfg in (config, text):
        vocab = _value(cfg, "vocab_size")
        if isinstance(vocab, int) and vocab > 1:
            return vocab
    return 256


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
