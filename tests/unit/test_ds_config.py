"""The DeepSpeed method without DeepSpeed: generated config, one-line refusals, the import
error, and the Program the simulator scores."""

import builtins
import sys

import pytest
from hydra.utils import instantiate
from omegaconf import OmegaConf

from bench.core.cluster import ClusterSpec
from bench.core.errors import ConfigError
from bench.core.interfaces import Workload
from bench.core.program import Program
from bench.cost import simulate
from methods.ds_zero import DeepSpeedZeRO, import_deepspeed, profile_workload, zero_program
from models.bert import BertConfig
from models.bert_moe import BertMoEConfig
from tests.conftest import compose_config


def _cluster(name="local_homo2"):
    cfg = compose_config(f"cluster={name}")
    return ClusterSpec.from_config(OmegaConf.to_container(cfg.cluster, resolve=True))


def _workload(model_cfg, global_batch=16):
    return Workload(
        name=model_cfg.name, preset="tiny", model_cfg=model_cfg, global_batch=global_batch, flops_per_sample=1.0
    )


TINY_BERT = BertConfig.from_preset("tiny")
TINY_MOE = BertMoEConfig.from_preset("tiny", num_devices=2)


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_generated_config_is_fp32_adam_without_clipping_and_an_even_micro_batch(stage):
    method = DeepSpeedZeRO(zero_stage=stage)
    plan = method.plan(_workload(TINY_BERT), _cluster())
    config = plan.details["ds_config"]
    assert plan.details["zero_stage"] == stage and config["zero_optimization"]["stage"] == stage
    assert plan.batch_shares == [8, 8] and plan.ratios == [[0.5, 0.5]]
    assert config["train_micro_batch_size_per_gpu"] == 8 and config["train_batch_size"] == 16
    assert config["gradient_accumulation_steps"] == 1 and config["gradient_clipping"] == 0.0
    assert not config["fp16"]["enabled"] and not config["bf16"]["enabled"]
    assert "optimizer" not in config, "the client torch.optim.Adam is the optimizer, not DeepSpeed's"
    assert ("stage3_param_persistence_threshold" in config["zero_optimization"]) == (stage == 3)
    assert DeepSpeedZeRO(zero_stage=stage, grad_clip=1.0).ds_config(8, 2)["gradient_clipping"] == 1.0


@pytest.mark.parametrize("precision", ["fp32", "tf32", "bf16"])
def test_bf16_is_the_engines_own_autocast_with_gradients_communicated_in_fp32(precision):
    workload = _workload(TINY_BERT)
    workload.precision = precision
    config = DeepSpeedZeRO().plan(workload, _cluster()).details["ds_config"]
    assert not config["fp16"]["enabled"] and not config["bf16"]["enabled"]  # parameters stay fp32
    if precision == "bf16":
        # without this section DeepSpeed's engine switches an outer CUDA autocast off in forward
        assert config["torch_autocast"] == {"enabled": True, "dtype": "bfloat16", "lower_precision_safe_modules": []}
    else:
        assert "torch_autocast" not in config


def test_the_conf_option_instantiates_stage_one_with_the_papers_adam():
    method = instantiate(compose_config("method=deepspeed").method)
    assert isinstance(method, DeepSpeedZeRO) and method.name == "deepspeed"
    assert method.zero_stage == 1 and method.lr == 5e-4 and method.grad_clip == 0.0
    assert method.modes == ("real", "sim") and not method.shm_comm_op


@pytest.mark.parametrize(
    "kwargs,needle",
    [
        ({"zero_stage": 4}, "method.zero_stage=4 is invalid; use one of 0, 1, 2, 3"),
        ({"zero_stage": True}, "method.zero_stage=True is invalid"),
        ({"lr": 0.0}, "method.lr=0.0 must be > 0"),
        ({"reduce_bucket_size": 0}, "method.reduce_bucket_size=0 must be >= 1"),
        ({"moe_capacity_factor": -1.0}, "method.moe_capacity_factor=-1.0 must be > 0"),
        ({"log_level": "loud"}, "method.log_level='loud' is invalid"),
        ({"engine_probe": "no"}, "method.engine_probe='no' is invalid; use true or false"),
        ({"shm_comm_op": 1}, "method.shm_comm_op=1 is invalid; use true or false"),
    ],
)
def test_bad_options_fail_in_one_line_at_construction(kwargs, needle):
    with pytest.raises(ConfigError) as err:
        DeepSpeedZeRO(**kwargs)
    assert needle in str(err.value) and "\n" not in str(err.value)


def test_moe_with_zero3_is_refused_in_one_line_before_any_worker():
    with pytest.raises(ConfigError) as err:
        DeepSpeedZeRO(zero_stage=3).plan(_workload(TINY_MOE), _cluster())
    msg = str(err.value)
    assert "\n" not in msg
    assert msg == (
        "method.zero_stage=3 cannot train model=bert_moe: DeepSpeed's MoE layer does not "
        "support ZeRO-3; use method.zero_stage=0, 1 or 2"
    )


def test_global_batch_not_divisible_by_devices_is_refused_with_the_fix():
    with pytest.raises(ConfigError) as err:
        DeepSpeedZeRO().plan(_workload(TINY_BERT, global_batch=7), _cluster())
    assert str(err.value) == (
        "global_batch=7 is not divisible by the 2 devices of cluster=local_homo2: DeepSpeed gives "
        "every device the same micro-batch; set global_batch=6 or 8"
    )


def test_moe_settings_match_the_models_experts_and_slots():
    moe = DeepSpeedZeRO(zero_stage=2).plan(_workload(TINY_MOE), _cluster()).details["moe"]
    assert moe["num_experts"] == 4 and moe["ep_size"] == 2 and moe["k"] == 2
    # Ours counts both routes in capacity_factor 2.5; DeepSpeed's top-2 gate doubles its own.
    assert moe["capacity_factor"] == pytest.approx(1.25)


@pytest.mark.parametrize("broken", ["missing", "raises"])
def test_a_missing_or_broken_deepspeed_is_one_line_naming_it_and_the_install(monkeypatch, broken):
    for name in [m for m in sys.modules if m == "deepspeed" or m.startswith("deepspeed.")]:
        monkeypatch.delitem(sys.modules, name)
    if broken == "missing":
        monkeypatch.setitem(sys.modules, "deepspeed", None)  # import deepspeed -> ImportError
    else:
        real_import = builtins.__import__

        def fake_import(name, *args, **kwargs):
            if name == "deepspeed" or name.startswith("deepspeed."):
                raise RuntimeError("CUDA version mismatch\nsecond line")
            return real_import(name, *args, **kwargs)

        monkeypatch.setattr(builtins, "__import__", fake_import)
    for call in (import_deepspeed, lambda: DeepSpeedZeRO().setup(None, None, None)):
        with pytest.raises(ImportError) as err:
            call()
        msg = str(err.value)
        assert "\n" not in msg and "method=deepspeed needs deepspeed" in msg
        assert msg.endswith("install it with: DS_BUILD_OPS=0 pip install deepspeed==0.19.8")


def test_deepspeed_is_imported_inside_functions_only():
    import ast
    from pathlib import Path

    import methods.ds_zero as package

    files = sorted(Path(package.__file__).parent.glob("*.py"))
    assert len(files) >= 4  # the method and its parts: program, trainer, moe
    for path in files:
        tree = ast.parse(path.read_text())
        top = [n for n in tree.body if isinstance(n, (ast.Import, ast.ImportFrom))]
        names = [a.name for n in top for a in n.names] + [n.module or "" for n in top if isinstance(n, ast.ImportFrom)]
        assert not [n for n in names if n.split(".")[0] == "deepspeed"], path


def _paper(model_cls, stage):
    cluster = _cluster("paper_hetero")
    cfg = (
        model_cls.from_preset("paper", num_devices=cluster.num_devices)
        if model_cls is BertMoEConfig
        else model_cls.from_preset("paper")
    )
    plan = DeepSpeedZeRO(zero_stage=stage).plan(_workload(cfg, 32 * cluster.num_devices), cluster)
    plan.details["workload"] = _workload(cfg, 32 * cluster.num_devices)
    return plan, cluster


def plan_workload(plan, cluster):
    return plan.details["workload"]


def _kinds(program: Program):
    return [c.kind for st in program.stages for c in st.collectives]


def test_zero_program_shards_memory_and_adds_the_stage_collectives_on_the_paper_cluster():
    plan, cluster = _paper(BertConfig, 1)
    profile = profile_workload(plan_workload(plan, cluster), 32, None, cluster.device)
    method = DeepSpeedZeRO()
    programs = {
        stage: zero_program(
            profile,
            num_devices=64,
            global_batch=32 * 64,
            zero_stage=stage,
            reduce_bucket_bytes=method.reduce_bucket_size * 4,
            allgather_bucket_bytes=method.allgather_bucket_size * 4,
            persistence_bytes=method.param_persistence_threshold * 4,
        )
        for stage in (0, 1, 2, 3)
    }
    assert programs[1] == plan.program
    results = {stage: simulate(p, cluster, plan.ratios) for stage, p in programs.items()}
    mem = {stage: r.memory_gib[0] for stage, r in results.items()}
    assert mem[1]["optimizer"] == pytest.approx(mem[0]["optimizer"] * 1.5 / 64)  # 3 copies / n vs 2
    assert mem[2]["grads"] < mem[1]["grads"] and mem[3]["params"] < mem[1]["params"] / 4
    assert set(_kinds(programs[0])) == {"all_reduce"}
    assert sorted(set(_kinds(programs[1]))) == sorted(set(_kinds(programs[2]))) == ["all_gather", "all_reduce"]
    assert _kinds(programs[3]).count("all_gather") > 40 and "reduce_scatter" in _kinds(programs[3])
    for r in results.values():
        assert 0.5 < r.iter_time_s < 10 and not r.oom


def test_moe_program_has_four_all_to_alls_per_moe_layer_and_owns_its_experts_only():
    plan, cluster = _paper(BertMoEConfig, 1)
    kinds = _kinds(plan.program)
    assert kinds.count("all_to_all") == 4 * 6  # 6 MoE layers of 12 blocks
    result = simulate(plan.program, cluster, plan.ratios)
    # All 128 x 6 experts replicated would be ~14 GiB of parameters alone; each GPU owns 2 x 6.
    assert result.memory_gib[0]["params"] < 1.0 and not result.oom


def test_an_emulated_cpu_cluster_prices_the_engines_own_work_as_measured(monkeypatch):
    """The engine probe's share over the plain step becomes the Program's host work, in FLOPs at
    the host's rate; without a host speed (a simulated cluster), switched off, or with a probe
    that could not measure, the Program is the model's work and collectives only."""
    from methods import ds_zero

    probes = []

    def probe(method, plan, workload, cluster):
        probes.append((plan.batch_shares, cluster.num_devices))
        return {"plain_s": 0.010, "engine_s": 0.013}

    monkeypatch.setattr(ds_zero, "engine_work", probe)
    workload = _workload(TINY_BERT)  # 16 samples, 1 FLOP each: 8 per device
    host = _cluster().with_host_speed(1e9, step_overhead_s=0.002)
    plan = DeepSpeedZeRO().plan(workload, host)
    assert probes == [([8, 8], 2)] and plan.details["engine"] == {"plain_s": 0.010, "engine_s": 0.013}
    assert plan.program.host_work_flops == pytest.approx(0.3 * (8 * 1.0 + 0.002 * 1e9))
    bare = DeepSpeedZeRO(engine_probe=False).plan(workload, host).program
    assert bare.host_work_flops == 0 and bare.stages == plan.program.stages
    assert simulate(plan.program, host, plan.ratios).iter_time_s == pytest.approx(
        simulate(bare, host, plan.ratios).iter_time_s + 0.3 * (8e-9 + 0.002)
    )
    assert DeepSpeedZeRO().plan(workload, _cluster()).program.host_work_flops == 0  # no host speed
    assert len(probes) == 1
    monkeypatch.setattr(ds_zero, "engine_work", lambda *a: None)
    unmeasured = DeepSpeedZeRO().plan(workload, host)
    assert unmeasured.program.host_work_flops == 0 and unmeasured.details["engine"] is None


def test_without_deepspeed_the_engine_probe_starts_nothing_and_says_so(monkeypatch, tmp_path, caplog):
    import importlib.util

    from bench.runtime import method_step
    from methods import ds_zero

    monkeypatch.setenv("HETBENCH_CACHE_DIR", str(tmp_path))  # nothing cached
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "deepspeed" else real(name, *a))
    monkeypatch.setattr(method_step, "forking_context", lambda *a: pytest.fail("a probe process was started"))
    host = _cluster().with_host_speed(1e9, step_overhead_s=0.002)
    method = DeepSpeedZeRO(engine_probe=False)
    plan = method.plan(_workload(TINY_BERT), host)
    assert ds_zero.engine_work(method, plan, _workload(TINY_BERT), host) is None
    assert "deepspeed is not installed: DS_BUILD_OPS=0 pip install deepspeed==0.19.8" in caplog.text


def test_a_failed_probe_rank_ends_the_wait_for_its_peers():
    """A rank that failed answers at once; its peers, blocked in a collective, never will: the
    parent stops waiting at the first error, and a rank gone without an answer is an error."""
    import multiprocessing as mp

    from bench.runtime.method_step import gather_answers

    (quiet, _keep), (failing, send) = mp.Pipe(duplex=False), mp.Pipe(duplex=False)
    send.send({"error": "RuntimeError: boom"})
    assert gather_answers({quiet: 0, failing: 1}, timeout_s=60) == {1: {"error": "RuntimeError: boom"}}
    gone, closed = mp.Pipe(duplex=False)
    closed.close()
    assert gather_answers({gone: 3}, timeout_s=60) == {3: {"error": "probe rank 3 exited without an answer"}}
    assert gather_answers({quiet: 0}, timeout_s=0.05) == {}  # nothing within the time: no answer
