"""Bringing a model: Hugging Face architectures from their configs (models.hf), a user's module
(models.custom), the task adapters' contract (models.tasks), and bad input in one line."""

from __future__ import annotations

import pytest
import torch

from models.custom import CustomModelConfig
from models.tasks import IGNORE_INDEX, Task

IMAGES = [{"shape": [3, 32, 32], "dtype": "float32"}, {"shape": [], "dtype": "int64", "high": 10}]


def _hf():
    pytest.importorskip("transformers", reason="model=hf needs the optional extra .[zoo]")
    from models import hf

    return hf


def test_masked_lm_masks_the_same_number_of_tokens_in_every_sample():
    task = Task("masked_lm", seq_len=20, vocab_size=50)
    inputs, labels = task.synthetic_batch(6, torch.Generator().manual_seed(0))
    masked = labels != IGNORE_INDEX
    assert masked.sum(1).tolist() == [task.targets_per_sample] * 6 == [3] * 6
    assert (inputs[masked] == 49).all() and (inputs[~masked] < 49).all()  # the mask token is the last id


def test_causal_lm_targets_are_the_inputs_shifted_by_one():
    tokens, targets = Task("causal_lm", seq_len=8, vocab_size=30).synthetic_batch(3, torch.Generator().manual_seed(1))
    assert torch.equal(tokens[:, 1:], targets[:, :-1])


@pytest.mark.parametrize(
    "arch,task,targets",
    [
        ("gpt2", "causal_lm", 32),
        ("bert", "masked_lm", 5),
        ("vit", "image_cls", 1),
        ("resnet", "image_cls", 1),
        # an encoder-decoder's language model head (T5 has no other head but a classifier
        # that selects its end-of-sequence tokens by value)
        ("t5", "seq2seq_lm", 32),
        ("imagegpt", "image_cls", 1),  # an image head on pixel token ids
        ("musicgen", "causal_lm", 4 * 32),  # 4 codebooks of 32 tokens
        ("moshi", "causal_lm", 32),  # num_codebooks is its audio's: its causal LM reads text
        ("siglip2", "image_cls", 1),  # images as flattened patches and their grid
    ],
)
def test_an_architecture_serves_its_own_task_with_the_harness_contract(arch, task, targets):
    hf = _hf()
    cfg = hf.HFModelConfig.from_preset("tiny", arch=arch)
    assert cfg.task == task and cfg.targets_per_sample == targets and cfg.name == f"hf-{arch}"
    hc = cfg.hf_config()
    assert getattr(hc, "use_cache", False) is False and all(
        v == 0.0 for k, v in hc.to_dict().items() if "dropout" in k and isinstance(v, float)
    )
    torch.manual_seed(0)
    model = cfg.build()
    assert model.training
    batch = cfg.synthetic_batch(4, torch.Generator().manual_seed(0))
    loss = model(*batch)
    assert loss.shape == () and loss.item() > 0
    # summed, not averaged: two halves add up to the whole (batch norm's statistics differ
    # between halves in training: compared in evaluation, on the running statistics)
    model.eval()
    halves = sum(model(*(t[i : i + 2] for t in batch)) for i in (0, 2))
    assert torch.allclose(halves, model(*batch), rtol=1e-5)


def test_config_fields_override_the_preset_and_the_paper_preset_is_the_architectures_size():
    hf = _hf()
    tiny = hf.HFModelConfig.from_preset("tiny", arch="llama", config={"num_hidden_layers": 3})
    assert tiny.hf_config().num_hidden_layers == 3 and tiny.hf_config().hidden_size == 64
    paper = hf.HFModelConfig.from_preset("paper", arch="gpt2", config={"num_hidden_layers": 1})
    assert paper.hf_config().n_embd == 768 and paper.hf_config().n_layer == 1 and paper.tokens == 128


def test_a_local_config_json_names_its_task_by_its_architectures(tmp_path):
    hf = _hf()
    (tmp_path / "config.json").write_text(
        '{"model_type": "bert", "architectures": ["BertForSequenceClassification"], "num_hidden_layers": 1}'
    )
    cfg = hf.HFModelConfig.from_preset("tiny", arch=str(tmp_path))
    assert cfg.task == "seq_cls" and cfg.hf_config().num_hidden_layers == 2  # the preset's tiny size wins
    assert cfg.targets_per_sample == 1 and cfg.tokens_per_sample == 32


@pytest.mark.parametrize(
    "kwargs,line",
    [
        (
            dict(arch="gtp2"),
            r"model.arch='gtp2' is not a transformers model type or a config.json; did you mean gpt2.*\? "
            r"list the known ones with: python -m models.hf",
        ),
        (
            dict(arch="gpt2", task="image_cls"),
            r"model.task=image_cls cannot be served by model.arch=gpt2: transformers has "
            r"no such head for 'gpt2'; it serves causal_lm, seq_cls",
        ),
        (
            dict(arch="gpt2", config={"num_hiden_layers": 2}),
            r"model.config.num_hiden_layers is not a field of GPT2Config; "
            r"did you mean num_hidden_layers",
        ),
        (dict(arch="/no/such/config.json"), r"model.arch='/no/such/config.json': no such config.json"),
        (dict(arch="gpt2", task="speech"), r"model.task='speech' is unknown; known: auto, causal_lm"),
    ],
)
def test_bad_hf_input_is_one_line_naming_the_field_and_the_fix(kwargs, line):
    hf = _hf()
    with pytest.raises(ValueError, match=line) as err:
        hf.HFModelConfig.from_preset("tiny", **kwargs)
    assert "\n" not in str(err.value)


def test_tiny_shrinks_every_stage_list_with_its_count():
    # convnext's stage count stayed 4 beside 2 stages of sizes: "model.spec: list index out of range"
    hf = _hf()
    cfg = hf.HFModelConfig.from_preset("tiny", arch="convnext")
    assert cfg.hf_config().num_stages == 2 and cfg.hf_config().depths == [1, 1]


def test_tiny_keeps_the_architectures_own_widths_where_the_small_sizes_do_not_build():
    hf = _hf()
    from transformers import AutoConfig

    cfg = hf.HFModelConfig.from_preset("tiny", arch="squeezebert")  # its groups do not divide 64
    own = AutoConfig.for_model("squeezebert")
    assert cfg.hf_config().hidden_size == own.hidden_size and cfg.hf_config().num_hidden_layers == 2
    assert cfg.hf_config().vocab_size == 512
    small = hf.HFModelConfig.from_preset("tiny", arch="llama")  # the zoo's models keep the small sizes
    assert small.hf_config().hidden_size == 64


@pytest.mark.parametrize(
    "kwargs,line",
    [
        (
            dict(arch="convnext", config={"hidden_sizes": [16]}),  # fewer sizes than stages
            r"model.arch=convnext \(preset=tiny, shallow sizes\): transformers could not build "
            r"ConvNextForImageClassification from its config: IndexError at modeling_convnext.py:\d+ "
            r"\(out_chs = config.hidden_sizes\[i\]\): list index out of range; a config field disagrees",
        ),
        (
            dict(arch="gemma4_assistant"),
            r"model.arch=gemma4_assistant: transformers' own default config of gemma4_assistant does not "
            r"validate .*; give the config.json of a real checkpoint",
        ),
    ],
)
def test_a_model_transformers_cannot_build_is_one_line_naming_where(kwargs, line):
    hf = _hf()
    with pytest.raises(ValueError, match=line) as err:
        hf.HFModelConfig.from_preset("tiny", **kwargs)
    assert "\n" not in str(err.value)


def test_the_known_architectures_are_listed_with_their_tasks(capsys):
    hf = _hf()
    hf.main()
    out = capsys.readouterr().out
    assert "gpt2" in out and "causal_lm" in out and "resnet" in out and "image_cls" in out


@pytest.mark.parametrize(
    "kwargs,line",
    [
        (
            dict(factory="no_such_pkg.mod:build", inputs=IMAGES),
            r"model.factory='no_such_pkg.mod:build': cannot import no_such_pkg.mod \(ModuleNotFoundError: No module named "
            r"'no_such_pkg'\); put its package on PYTHONPATH",
        ),
        (dict(factory="tests.zoo_custom:nothing", inputs=IMAGES), r"tests.zoo_custom has no attribute 'nothing'"),
        (
            dict(factory="tests.zoo_custom:not_a_module", inputs=IMAGES),
            r"model.factory='tests.zoo_custom:not_a_module' returned a list, not a torch.nn.Module",
        ),
        (dict(factory="tests.zoo_custom", inputs=IMAGES), r"must be 'module.path:callable'"),
        (dict(factory="tests.zoo_custom:build"), r"model=custom with model.task=loss needs model.inputs"),
        (
            dict(factory="tests.zoo_custom:build", inputs=[{"shape": [3], "dtype": "int64"}]),
            r"model.inputs\[0\].high=None: an integer input needs high",
        ),
        (
            dict(
                factory="tests.zoo_custom:build_branchy",
                inputs=[{"shape": [4]}, {"shape": [], "dtype": "int64", "high": 4}],
            ),
            r"model.factory=tests.zoo_custom:build_branchy: torch.export \(non-strict\) refused GuardOnDataDependentSymNode at "
            r"zoo_custom.py:\d+ \(if h.sum\(\) > 0:\).*; make that forward traceable by torch.export \(torch.where",
        ),
    ],
)
def test_bad_custom_input_is_one_line_naming_the_field_and_the_fix(kwargs, line):
    with pytest.raises(ValueError, match=line) as err:
        CustomModelConfig.from_preset("tiny", **kwargs)
    assert "\n" not in str(err.value)


def test_a_custom_module_with_its_input_spec_or_a_task_adapter_meets_the_contract():
    own = CustomModelConfig.from_preset("tiny", factory="tests.zoo_custom:build", inputs=IMAGES, kwargs={"width": 4})
    images, labels = own.synthetic_batch(5, torch.Generator().manual_seed(0))
    assert images.shape == (5, 3, 32, 32) and labels.dtype == torch.int64 and int(labels.max()) < 10
    assert own.build()(images, labels).shape == ()
    adapted = CustomModelConfig.from_preset(
        "tiny", factory="tests.zoo_custom:build_decoder", task="causal_lm", seq_len=8
    )
    assert adapted.targets_per_sample == 8 == adapted.tokens_per_sample
    assert adapted.build()(*adapted.synthetic_batch(2, torch.Generator().manual_seed(0))).shape == ()


@pytest.mark.parametrize("arch", ["gpt2", "bert", "llama", "vit", "resnet", "swin"])
def test_every_zoo_architecture_is_covered_by_sharding_rules(arch):
    hf = _hf()
    from methods.graph import capture_config
    from methods.hap.theory import derive_theory

    graph = capture_config(hf.HFModelConfig.from_preset("tiny", arch=arch), 4)
    coverage = derive_theory(graph).coverage()
    assert coverage["flops_share"] >= 0.99 and coverage["ops_share"] >= 0.99, coverage


def test_batch_norm_is_planned_as_whole_batch_statistics_or_as_each_shards_own():
    hf = _hf()
    from methods.graph import capture_config
    from methods.hap.theory import derive_theory

    cfg = hf.HFModelConfig.from_preset("tiny", arch="resnet")
    sync = capture_config(cfg, 4)
    assert "batch_norm" not in {n.op for n in sync.ops}  # two sums over the batch, then element-wise
    local = derive_theory(capture_config(cfg, 4, batch_norm="local"))
    norms = [n for n in local.graph.ops if n.op == "batch_norm"]
    assert norms and all(
        any(r.name == "local-statistics" and r.pre[0] == 0 for r in local.rules[n.name]) for n in norms
    )


def test_a_forward_that_checks_a_value_runs_on_meta_without_its_check():
    """XLM and FlauBERT assert `lengths.max().item() <= slen`: export keeps the read and an
    assert on it, which a meta forward cannot evaluate; both are left out of the meta forward
    (its loss and shapes are the same), as the planner's capture leaves them out."""
    from torch import nn

    from models.tasks import TaskLoss

    class Checks(nn.Module):
        def __init__(self):
            super().__init__()
            self.emb = nn.Embedding(10, 4)
            self.fc = nn.Linear(4, 10)

        def forward(self, input_ids):
            lengths = (input_ids != 0).sum(dim=1)
            torch._check(lengths.max().item() <= input_ids.shape[1])  # kept as an assert on the read value
            return self.fc(self.emb(input_ids))

    with torch.device("meta"):
        model = TaskLoss(Checks(), "causal_lm", "input_ids")
    ids = torch.empty(2, 5, dtype=torch.long, device="meta")
    loss = model(ids, torch.empty(2, 5, dtype=torch.long, device="meta"))
    assert loss.shape == () and loss.device.type == "meta"


def test_a_model_built_on_meta_holds_no_tensor_a_legacy_constructor_left_on_the_cpu():
    """XLNet makes its attention weights with torch.FloatTensor(...), which ignores the default
    device: a model built on the meta device holds every tensor there all the same."""
    pytest.importorskip("transformers", reason="model=hf needs the optional extra .[zoo]")
    from models.hf import HFModelConfig

    cfg = HFModelConfig.from_preset("tiny", arch="xlnet")
    with torch.device("meta"):
        model = cfg.build()
    assert {t.device.type for t in [*model.parameters(), *model.buffers()]} == {"meta"}


def test_logits_are_a_classifiers_per_sample_last_state_but_not_a_sequence_of_states():
    """PP-LCNet's image classifier returns its head's scores as `last_hidden_state`, (B, labels);
    a backbone's (B, S, H) states are no logits."""
    from types import SimpleNamespace

    from models.tasks import logits_of

    scores = torch.zeros(2, 5)
    assert logits_of(SimpleNamespace(last_hidden_state=scores)) is scores
    with pytest.raises(TypeError, match="a task adapter needs logits"):
        logits_of(SimpleNamespace(last_hidden_state=torch.zeros(2, 3, 4)))


def test_an_image_becomes_patches_row_by_row_with_its_grid():
    """SigLIP 2 takes (B, patches, p * p * C) and each image's grid: patch (i, j) holds the
    pixels of rows i*p.. and columns j*p.., channels last."""
    from models.tasks import patchify

    images = torch.arange(2 * 3 * 4 * 6, dtype=torch.float32).reshape(2, 3, 4, 6)
    patches, grid = patchify(images, 2)
    assert patches.shape == (2, 6, 12) and grid.tolist() == [[2, 3], [2, 3]]
    assert torch.equal(patches[1, 4].reshape(2, 2, 3), images[1, :, 2:4, 2:4].permute(1, 2, 0))


def test_codebook_tokens_are_predicted_in_every_stream():
    task = Task("causal_lm", seq_len=8, vocab_size=30, codebooks=4)
    tokens, targets = task.synthetic_batch(3, torch.Generator().manual_seed(1))
    assert tokens.shape == targets.shape == (3, 4, 8) and torch.equal(tokens[..., 1:], targets[..., :-1])
    assert task.targets_per_sample == task.tokens_per_sample == 32


def test_layerdrop_is_off_like_dropout():
    """LayerDrop skips a layer where a random draw falls below its rate (M2M-100, NLLB-MoE,
    SeamlessM4T): random like dropout, and a branch on a value export cannot take."""
    hf = _hf()
    cfg = hf.HFModelConfig.from_preset("tiny", arch="m2m_100")
    assert cfg.task == "seq2seq_lm"
    hc = cfg.hf_config()
    assert hc.encoder_layerdrop == hc.decoder_layerdrop == 0.0


def test_tiny_keeps_no_layer_that_reuses_another_layers_cache():
    """Gemma 3n shares the key-value cache of its last 15 of 35 layers: at two layers there is
    none to share (each attention kind keeps a layer that makes its cache)."""
    hf = _hf()
    from transformers import AutoConfig

    base = AutoConfig.for_model("gemma3n_text")
    fields = hf._tiny_fields(base, "shallow", None)
    assert fields["num_kv_shared_layers"] == 0 and fields["num_hidden_layers"] == 2
    assert AutoConfig.for_model("gemma3n_text", **fields).kv_sharing_modes == [None, None]


def test_a_model_that_makes_its_mask_only_outside_tracing_gets_one_of_ones():
    """Switch Transformers makes its encoder's attention mask only where it is not being traced:
    it exports with an attention mask of ones beside its token ids, and the loss is the same."""
    hf = _hf()
    cfg = hf.HFModelConfig.from_preset("tiny", arch="switch_transformers")
    assert cfg._ones_mask
    torch.manual_seed(0)
    model = cfg.build()
    assert model.ones_mask
    batch = cfg.synthetic_batch(2, torch.Generator().manual_seed(0))
    loss = model(*batch)
    model.ones_mask = False  # outside tracing the model makes the same mask itself
    assert torch.allclose(model(*batch), loss)


def test_every_token_id_of_a_config_without_parts_stays_in_its_vocabulary():
    """Nemotron 3.5 Transcribe's word-timestamp head has its CTC blank as its last token: at the
    tiny vocabulary it is kept inside it, as the config checks."""
    hf = _hf()
    from transformers import AutoConfig

    head = AutoConfig.for_model("nemo_speechlm").word_timestamp_config
    assert hf._tokens_in_vocab(head, {"vocab_size": 512}) == {"blank_token_id": head.blank_token_id % 512}


def test_the_attention_a_config_records_is_the_one_its_model_runs():
    """A module asking transformers for an attention it does not find runs the eager one
    silently; the harness's is recorded only where the model really ran it, so a config reads
    the same in a fresh process and after a model of its kind was built (T5 once took the
    harness's attention the second time, and its forward then refused the position bias)."""
    hf = _hf()
    first = hf.HFModelConfig.from_preset("tiny", arch="t5")
    torch.manual_seed(0)
    model = first.build()
    hf._SETTLED.clear()  # settled again, after a model of its kind was built, not read back
    again = hf.HFModelConfig.from_preset("tiny", arch="t5")
    assert again._attention == first._attention != hf.ATTENTION
    batch = again.synthetic_batch(2, torch.Generator().manual_seed(0))
    assert again.build()(*batch).item() > 0 and model(*batch).item() > 0


def test_a_config_composed_again_settles_as_before_without_building_a_trial_model(monkeypatch):
    """The attempt a config settled on is a function of its fields: composed again in the same
    process it is read back (no trial model built and exported); other fields settle afresh."""
    hf = _hf()
    first = hf.HFModelConfig.from_preset("tiny", arch="gpt2")
    trials = []
    monkeypatch.setattr(hf, "check_export", lambda *a, **k: trials.append(a[2]))
    again = hf.HFModelConfig.from_preset("tiny", arch="gpt2")
    settled = hf._SETTLED[first._settle_key()]  # the attempt's fields
    assert trials == [] and {k: again.__dict__[k] for k in settled} == {k: first.__dict__[k] for k in settled}
    other = hf.HFModelConfig.from_preset("tiny", arch="gpt2", seq_len=16)
    assert trials and other.seq_len == 16


class _Branchy(torch.nn.Module):
    """Logits over 16 tokens, with a branch on tensor values: `flag` says which (the global-
    attention flag of a mask of ones, LED's; a token's value; a selection by value)."""

    def __init__(self, flag: str):
        super().__init__()
        self.flag = flag
        self.emb = torch.nn.Embedding(16, 8)
        self.head = torch.nn.Linear(8, 16)

    def forward(self, input_ids):
        h = self.emb(input_ids)
        if self.flag == "ones":
            if (torch.ones_like(input_ids) > 1).any():  # never: the workload's mask is all ones
                h = h * 2
        elif self.flag == "token":
            if input_ids[0, 0] > 7:  # another way on another batch
                h = h * 2
        elif self.flag == "mask":  # the rows a mask selects (BLT's patch starts)
            h = h + h[input_ids > 7].sum(0)
        else:  # as many rows as the batch has tokens above 7 (experts' shares of tokens)
            rows = (input_ids > 7).sum().item()
            above, _ = h.flatten(0, 1).split([rows, input_ids.numel() - rows])
            h = h + above.sum(0)
        return self.head(h)


def _on_sample(flag: str, first_tokens=(0, 0, 0)):
    """A TaskLoss on _Branchy and its real_sample: a twin with values, batches by seed whose
    first token is `first_tokens[seed]`."""
    from models.tasks import TaskLoss

    def draw(seed):
        window = torch.randint(0, 16, (2, 9), generator=torch.Generator().manual_seed(seed))
        window[0, 0] = first_tokens[seed % len(first_tokens)]
        return window[:, :-1].contiguous(), window[:, 1:].contiguous()

    def real_sample(batch_size):
        torch.manual_seed(0)
        return TaskLoss(_Branchy(flag), "causal_lm", "input_ids"), draw

    with torch.device("meta"):
        model = TaskLoss(_Branchy(flag), "causal_lm", "input_ids", real_sample=real_sample)
    batch = tuple(torch.empty((2, 8), dtype=torch.long, device="meta") for _ in range(2))
    return model, batch, real_sample


def test_a_branch_on_a_value_the_workload_keeps_is_captured_on_a_real_sample():
    """Export refuses a branch on a value on meta tensors; on a real sample it takes the
    sample's way, and the captured program computes what the model does on other batches."""
    from methods.export import export_model
    from models.tasks import _export, export

    model, batch, real_sample = _on_sample("ones")
    with pytest.raises(Exception, match="data-dependent"):
        _export(model, batch)
    gm = export_model(model, batch, "branchy")
    assert not any("assert" in str(n.target) for n in gm.graph.nodes)
    twin, draw = real_sample(2)
    program = export(model, batch).module()
    other = draw(5)
    assert torch.allclose(program(*other), twin(*other))
    assert model(*batch).device.type == "meta"  # the loss on meta tensors replays the program there


def test_a_branch_that_changes_with_the_batch_is_refused():
    """A branch on a token's value goes another way on another batch: the capture on a real
    sample says so, naming the batch, instead of fixing one batch's way."""
    from models.tasks import SampleRefused, export

    model, batch, _ = _on_sample("token", first_tokens=(0, 12, 12))
    with pytest.raises(SampleRefused, match="another on batch 1"):
        export(model, batch)


def test_lengths_that_depend_on_values_are_refused_on_a_real_sample_too():
    """Rows selected by value (expert dispatch, entropy patching) have as many rows as the batch
    says: a program fixed to the sample's would not fit another batch."""
    from models.tasks import SampleRefused, export

    for flag in ("select", "mask"):
        model, batch, _ = _on_sample(flag)
        with pytest.raises(SampleRefused, match="value it reads from a tensor|still depends on values"):
            export(model, batch)


def test_index_masks_equal_the_masks_vmap_makes():
    """T5Gemma 2's sliding-window encoder mask, made by broadcasting index tensors (which export
    can replay) instead of vmap: the same mask."""
    _hf()
    from transformers import masking_utils as mu

    from models.tasks import index_masks

    fn = mu.and_masks(mu.sliding_window_bidirectional_overlay(2), mu.bidirectional_mask_function)
    indices = [torch.arange(n) for n in (2, 1, 6, 6)]
    want = mu._vmap_expansion_sdpa(fn)(*indices)
    with index_masks():
        got = mu._vmap_expansion_sdpa(fn)(*indices)
    assert mu._vmap_expansion_sdpa is not None and want.shape == (2, 1, 6, 6)
    assert torch.equal(got.expand_as(want), want) and not want.all()


def test_an_empty_rope_of_a_config_with_layer_kinds_gets_the_default_per_kind():
    """Cohere's Compass text config names its layers' kinds but keeps no rope entry for any,
    and its attention reads rope_parameters[kind]: tiny gives each kind the default rope."""
    hf = _hf()
    from transformers import AutoConfig

    base = AutoConfig.for_model("cohere_compass_text")
    fields = hf._tiny_fields(base, "small", None)
    assert fields["rope_parameters"] == {"full_attention": {"rope_type": "default", "rope_theta": 10000.0}}
    assert hf._default_rope(AutoConfig.for_model("llama")) == {}  # one rope for every layer: kept


def test_default_config_repairs_build_the_models_they_name():
    """lfm2_moe's default has no layer kinds and its layers read theirs: the repair's builds."""
    hf = _hf()
    assert all(reason for _, reason in hf._DEFAULT_CONFIG_REPAIRS.values())
    cfg = hf.HFModelConfig.from_preset("tiny", arch="lfm2_moe")
    assert cfg.hf_config().layer_types == ["conv", "full_attention"]
    assert cfg.build()(*cfg.synthetic_batch(2, torch.Generator().manual_seed(0))).isfinite()
