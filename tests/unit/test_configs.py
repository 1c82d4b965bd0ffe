"""Every conf option composes and instantiates; bad input gives one line and no ok row."""

import dataclasses

import pytest
from hydra.utils import instantiate
from omegaconf import OmegaConf

from bench.core.cluster import ClusterSpec
from bench.core.errors import ConfigError
from bench.cost.flops import train_flops_per_sample
from bench.records.rows import load_records
from bench.runner.case import build_workload
from bench.runner.configs import group_options
from bench.runner.execute import run_case, run_config
from bench.runner.settings import as_settings
from tests.conftest import compose_config

# What a model option needs on the command line besides its defaults (model=custom names its
# module), and overrides that keep a zoo model's paper size quick to count.
NEEDS = {
    "custom": [
        "model.factory=tests.zoo_custom:build",
        "model.inputs=[{shape:[3,32,32],dtype:float32},{shape:[],dtype:int64,high:10}]",
    ]
}
QUICK_PAPER = {"hf": ["model.config.num_hidden_layers=1"]}


def _model(model: str) -> list[str]:
    return [f"model={model}", *NEEDS.get(model, [])]


@pytest.mark.parametrize("method", group_options("method"))
def test_every_method_instantiates_with_a_plan(method):
    cfg = compose_config(f"method={method}")
    obj = instantiate(cfg.method)
    assert obj.name == method
    assert callable(obj.plan) and callable(obj.setup)


@pytest.mark.parametrize("preset", group_options("preset"))
@pytest.mark.parametrize("model", group_options("model"))
def test_every_model_and_preset_instantiates(model, preset):
    cfg = compose_config(*_model(model), f"preset={preset}", *(QUICK_PAPER.get(model, []) if preset == "paper" else []))
    spec = instantiate(cfg.model.spec, num_devices=4)
    assert spec.name == cfg.model.name and spec.targets_per_sample >= 1
    assert cfg.preset.measured_iters >= 1


@pytest.mark.parametrize("model", group_options("model"))
def test_paper_preset_trains_64_samples_per_gpu_32_for_bert_moe(model):
    cfg = compose_config(*_model(model), "preset=paper", "cluster=paper_hetero", *QUICK_PAPER.get(model, []))
    cluster = ClusterSpec.from_config(OmegaConf.to_container(cfg.cluster, resolve=True))
    per_gpu = 32 if model == "bert_moe" else 64  # HAP Sec. 7.1
    assert build_workload(as_settings(cfg), cluster).global_batch == per_gpu * cluster.num_devices
    cfg = compose_config(*_model(model), "preset=paper", "preset.batch_per_device=16")
    assert cfg.preset.batch_per_device == 16  # the command line still overrides it
    assert compose_config(*_model(model)).preset.batch_per_device == 8  # tiny is unchanged


@pytest.mark.parametrize("model", group_options("model"))
def test_tiny_workloads_count_their_flops(model):
    cfg = compose_config(*_model(model))
    cluster = ClusterSpec.from_config(OmegaConf.to_container(cfg.cluster, resolve=True))
    workload = build_workload(as_settings(cfg), cluster)
    assert workload.global_batch == cfg.preset.batch_per_device * 2
    assert workload.flops_per_sample > 0
    # counted once per process for equal configs; any field that differs is counted anew
    model_cfg = workload.model_cfg
    assert train_flops_per_sample(dataclasses.replace(model_cfg)) == workload.flops_per_sample
    if model == "hf":
        wider = dataclasses.replace(model_cfg, config={"vocab_size": 2048})
    elif model == "custom":
        wider = dataclasses.replace(model_cfg, kwargs={"width": 32})
    else:
        field = "vocab_size" if hasattr(model_cfg, "vocab_size") else "num_classes"
        wider = dataclasses.replace(model_cfg, **{field: getattr(model_cfg, field) * 4})
    assert train_flops_per_sample(wider) > workload.flops_per_sample


@pytest.mark.parametrize(
    "overrides,needle",
    [
        (["measured_iters=0"], "measured_iters=0 must be an integer >= 1"),
        (["warmup_iters=-1"], "warmup_iters=-1 must be an integer >= 0"),
        (["global_batch=1"], "global_batch=1 is smaller than the 2 devices"),
        (["cluster.machines.1.speed=0"], "cluster.machines[1].speed=0 must be a number > 0"),
        (["cluster.links.inter_machine.bandwidth_gbps=0"], "bandwidth_gbps=0 must be a number > 0"),
        (["+cluster.num_devices=3"], "cluster.num_devices=3 does not add up"),
        (["mode=fast"], "mode='fast' is invalid; valid: real, sim"),
        (["wandb.mode=maybe"], "wandb.mode='maybe' is invalid"),
        (["data.source=imagenet"], "data.source='imagenet' is invalid"),
        (["data.source=cifar10"], "data.source"),
        (["+model.spec.num_layerz=3"], "num_layerz"),
        (["method.split=random"], "method.split='random' is invalid"),
        (["method.grad_accumulation=0"], "method.grad_accumulation=0 is invalid; use an integer >= 1"),
        (
            ["method=fsdp", "method.activation_checkpointing=maybe"],
            "method.activation_checkpointing='maybe' is invalid",
        ),
        (
            ["method=dp_cp", "global_batch=7", "method.grad_accumulation=2"],
            "method.grad_accumulation=2 cannot cut the ranks' batch shares (5, 2 samples) into 2 micro-batches of "
            "whole samples each; use method.grad_accumulation=1",
        ),
        (
            ["method=deepspeed", "mode=sim", "global_batch=12", "method.grad_accumulation=4"],
            "method.grad_accumulation=4 cannot cut the ranks' batch shares (6 samples) into 4 micro-batches of "
            "whole samples each; use method.grad_accumulation=1, 2, 3 or 6",
        ),
        (
            ["method=hap", "mode=sim", "global_batch=15", "method.grad_accumulation=2"],
            "method.grad_accumulation=2 does not divide global_batch=15 into micro-batches of whole samples; "
            "use method.grad_accumulation=1, 3, 5 or 15",
        ),
        (
            ["method=hap", "method.interpret=true", "method.activation_checkpointing=true"],
            "method.activation_checkpointing=true needs the recorded program",
        ),
        (["repeats=0"], "repeats=0 must be an integer >= 1; e.g. repeats=5"),
        (["repeats=-2"], "repeats=-2 must be an integer >= 1"),
        (["repeats=2.5"], "repeats=2.5 must be an integer >= 1"),
        (["emulation.headroom=1.5"], "emulation.headroom=1.5 must be auto or a number in (0, 1]"),
        (["emulation.reference_iters=-1"], "emulation.reference_iters=-1 must be an integer >= 0"),
        (["emulation.round_reference_iters=0"], "emulation.round_reference_iters=0 must be an integer >= 1"),
        (["emulation.pin_cores=sometimes"], "emulation.pin_cores='sometimes' must be true or false"),
        (["emulation.pause_discount=1"], "emulation.pause_discount=1 must be true or false"),
        (["emulation.realtime_comm=yes"], "emulation.realtime_comm='yes' must be true or false"),
        (["emulation.gloo_workers_first=2"], "emulation.gloo_workers_first=2 must be true or false"),
        (
            ["method=hap", "mode=sim", "method.segmentation=random"],
            "method.segmentation='random' is unknown; valid: layers, flops, metis",
        ),
        (
            ["method=hap", "mode=sim", "method.num_segments=5"],  # tiny BERT: embedding, 2 blocks, head
            "method.num_segments=5 is more than the 4 layer groups of this model (method.segmentation=layers); "
            "use method.num_segments<=4 or method.segmentation=flops",
        ),
    ],
)
def test_bad_input_is_one_line_and_records_no_ok_row(config_factory, capsys, overrides, needle):
    cfg = config_factory(*overrides)
    record = run_config(cfg)
    err = capsys.readouterr().err.strip()
    assert record.status == "failed" and needle in record.error
    assert err.startswith("error: ") and "\n" not in err and needle in err
    rows = load_records(f"{cfg.results_dir}/records.jsonl")
    assert [r["status"] for r in rows] == ["failed"]
    assert rows[0]["samples_per_s"] is None


@pytest.mark.parametrize("experiment", group_options("experiment"))
def test_every_experiment_composes(experiment):
    cfg = compose_config(f"experiment={experiment}")
    assert cfg.measured_iters >= 1 and cfg.mode in ("real", "sim")


def test_a_planner_that_finds_nothing_feasible_records_infeasible(cfg_factory, capsys):
    cfg = cfg_factory("method._target_=tests.conftest.InfeasibleMethod", "mode=sim")
    record = run_case(cfg)
    assert record.status == "infeasible" and "memory_gib=4 is too small" in record.error
    assert record.samples_per_s is None
    assert "recorded as infeasible" in capsys.readouterr().err


@pytest.mark.parametrize("value", ["0", "-1", "1.5", "many"])
def test_compare_refuses_bad_repeats_before_any_run(tmp_path, capsys, value):
    from bench import compare

    code = compare.main([f"repeats={value}", f"results_dir={tmp_path}", "wandb.mode=disabled"])
    err = capsys.readouterr().err.strip()
    assert code == 2 and err.startswith("error: ") and "repeats=" in err and "\n" not in err
    assert not (tmp_path / "records.jsonl").exists()


def test_real_time_gloo_threads_need_a_core_per_rank(cfg_factory, monkeypatch):
    from bench.runner import settings

    cfg = cfg_factory("cluster=local_hetero4", "emulation.realtime_comm=true")
    monkeypatch.setattr(settings, "host_cores", lambda: 2)
    with pytest.raises(
        ConfigError,
        match=r"emulation.realtime_comm=true needs a core per rank: 4 ranks "
        r"on 2 cores; use emulation.realtime_comm=false",
    ):
        settings.emulation_settings(cfg, 4)
    monkeypatch.setattr(settings, "host_cores", lambda: 4)
    assert settings.emulation_settings(cfg, 4).realtime_comm is True
    assert settings.emulation_settings(cfg_factory("cluster=local_hetero4"), 4).realtime_comm is False
    assert settings.emulation_settings(cfg_factory("cluster=local_hetero4"), 4).gloo_workers_first is True


@pytest.mark.parametrize(
    "overrides,line",
    [
        (["measured_iter=3"], "measured_iter is not an option (options: mode, precision, seed,"),
        (
            ["data=5"],
            "data=5: Invalid type assigned: int is not a subclass of DataSettings. value: 5; give data "
            "the shape it has in the config",
        ),
        (
            ["method=nosuch"],
            "method=nosuch is unknown; known: auto, deepspeed, dp_cp, dp_ev, fsdp, fsdp_cp, hap, pipeline, sfb",
        ),
        (["+preset.extra=1"], None),  # a key of one's own, with +: composes
    ],
)
def test_a_key_no_schema_has_or_a_node_of_the_wrong_shape_is_one_line_at_compose(overrides, line):
    from bench.runner.configs import compose_settings

    if line is None:
        compose_settings(*overrides)
        return
    with pytest.raises(ConfigError) as err:
        compose_settings(*overrides)
    assert str(err.value).startswith(line) and "\n" not in str(err.value)


@pytest.mark.parametrize(
    "overrides,needle",
    [
        (["warmup_iters=${preset.nope}"], "warmup_iters: Interpolation key 'preset.nope' not found; fix the value"),
        (["preset.batch_per_device=x"], "preset.batch_per_device='x' must be an integer >= 1"),
        (["timeout_s=0"], "timeout_s=0 must be a number > 0 (seconds)"),
        (["resume=maybe"], "resume='maybe' must be true or false"),
        (["~preset.batch_per_device"], "preset.batch_per_device is missing; set it (an integer >= 1)"),
    ],
)
def test_settings_read_at_the_edge_refuse_a_value_in_one_line(overrides, needle):
    from bench.runner.settings import Settings

    with pytest.raises(ConfigError) as err:
        Settings.from_config(compose_config(*overrides))
    assert str(err.value).startswith(needle) and "\n" not in str(err.value)
