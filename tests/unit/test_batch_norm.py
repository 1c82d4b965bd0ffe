"""Batch norm is the workload's (`batch_norm`): each device's statistics or the whole batch's,
trained alike by every method or refused in one line by a method that cannot."""

import pytest

from bench.records.rows import case_key, load_records
from bench.runner.execute import run_config

BN_MODEL = (
    "model=custom",
    "model.factory=tests.zoo_custom:build_bn",
    "model.inputs=[{shape:[3,8,8],dtype:float32},{shape:[],dtype:int64,high:10}]",
)


@pytest.mark.parametrize(
    "method,how", [("dp_ev", "each rank's share"), ("fsdp_cp", "each rank's share"), ("pipeline", "each micro-batch")]
)
def test_a_method_that_normalises_shares_refuses_global_batch_norm_in_one_line(config_factory, capsys, method, how):
    cfg = config_factory(*BN_MODEL, f"method={method}", "mode=sim", "batch_norm=global")
    record = run_config(cfg)
    err = capsys.readouterr().err.strip()
    needle = f"batch_norm=global: method {method} normalises {how}"
    assert record.status == "failed" and needle in record.error and "use batch_norm=local" in record.error
    assert err.startswith("error: ") and "\n" not in err
    assert [r["status"] for r in load_records(f"{cfg.results_dir}/records.jsonl")] == ["failed"]


def test_global_batch_norm_is_no_concern_of_a_model_without_one(config_factory):
    record = run_config(config_factory("model=bert", "method=dp_ev", "mode=sim", "batch_norm=global"))
    assert record.status == "ok"


@pytest.mark.parametrize("choice,capture", [("local", "local"), ("global", "sync")])
def test_hap_plans_batch_norm_as_the_workload_asks_and_the_row_records_it(config_factory, choice, capture):
    cfg = config_factory(*BN_MODEL, "method=hap", "mode=sim", f"batch_norm={choice}", "method.num_segments=1")
    record = run_config(cfg)
    assert record.status == "ok", record.error
    assert record.plan["batch_norm"] == capture and record.config["batch_norm"] == choice
    # the plan cache tells the two apart
    assert record.plan["cache"]["status"] == "miss"


def test_the_default_leaves_case_keys_as_they_were():
    base = {"model": {"name": "bert"}, "seed": 0}
    assert case_key({**base, "batch_norm": "local"}) == case_key(base) != case_key({**base, "batch_norm": "global"})


def test_a_batch_norm_that_is_neither_is_one_line(config_factory, capsys):
    record = run_config(config_factory("mode=sim", "batch_norm=whole"))
    err = capsys.readouterr().err.strip()
    assert record.status == "failed" and "batch_norm='whole'" in err and "local, global" in err and "\n" not in err
