"""Folders of the user's own configs (--config-dir, hydra.searchpath): every group is searched in
them first, a file of theirs wins over a packaged one, the row names the file used, and bad input
is one line. (tests/e2e/test_own_configs_outside.py runs the same from outside the repository.)"""

from __future__ import annotations

import textwrap

import pytest

from bench.core.cluster import ClusterSpec, device_type_files
from bench.core.errors import ConfigError
from bench.core.paths import CONF_DIR, user_config_dirs
from bench.runner import configs
from bench.runner.configs import (
    check_group_choices,
    compose_settings,
    group_options,
    take_config_dirs,
    use_config_dirs,
)
from bench.runner.sweep import swept_method_targets

LAB_GPU = """\
name: LabGPU
memory_gib: 24
peak_flops: 30.0e12
effective_flops: 7.0e12
sources: {memory_gib: sheet, peak_flops: sheet, effective_flops: "assumption: 0.23 x peak"}
"""
LAB = """\
name: lab
virtual_device: machine
machines:
  - {count: 2, device: LabGPU, num_devices: 4}
  - {count: 1, device: V100-16, num_devices: 4}
links:
  intra_machine: {bandwidth_gbps: 100.0, latency_s: 10.0e-6}
  inter_machine: {bandwidth_gbps: 25.0, latency_s: 30.0e-6}
"""


@pytest.fixture
def mine(tmp_path):
    """A folder of one's own configs: a cluster with a device type of its own, a copy of a
    packaged cluster with another speed, a method file; searched for the test only."""
    root = tmp_path / "mine"
    for group in ("cluster", "device", "method", "experiment"):
        (root / group).mkdir(parents=True)
    (root / "device" / "LabGPU.yaml").write_text(LAB_GPU)
    (root / "cluster" / "lab.yaml").write_text(LAB)
    packaged = (CONF_DIR / "cluster" / "local_hetero2.yaml").read_text()
    (root / "cluster" / "local_hetero2.yaml").write_text(packaged.replace("speed: 0.4", "speed: 0.25"))
    (root / "method" / "my_dp.yaml").write_text("_target_: methods.dp.DataParallel\nname: my_dp\nsplit: even\n")
    (root / "model").mkdir()
    (root / "model" / "bert_wide.yaml").write_text(
        "name: bert_wide\nspec:\n  _target_: models.bert.BertConfig.from_preset\n  preset: ${preset.name}\n"
        "  d_model: 256\n"
    )
    yield root
    use_config_dirs([])


def test_every_listing_sees_the_users_folder_first(mine):
    take_config_dirs(["--config-dir", str(mine)])
    assert user_config_dirs() == (mine.resolve(),)
    assert "lab" in group_options("cluster") and "paper_hetero" in group_options("cluster")
    assert "my_dp" in group_options("method") and "dp_ev" in group_options("method")
    check_group_choices(["cluster=lab", "method=my_dp,dp_ev"])
    with pytest.raises(ConfigError) as err:
        check_group_choices(["cluster=labb"])
    assert str(err.value).startswith("cluster=labb is unknown; known: h100x1, lab, local_2x2")
    assert f"searched {mine.resolve()} and hetbench's own" in str(err.value)
    config = {"hydra": {"sweeper": {"params": {}}, "overrides": {"task": ["method=my_dp,dp_ev"]}}}
    from omegaconf import OmegaConf

    assert swept_method_targets(OmegaConf.create(config)) == ["methods.dp.DataParallel"] * 2


def test_a_users_file_wins_over_the_packaged_one_and_the_row_names_it(mine):
    take_config_dirs([f"hydra.searchpath=[file://{mine}]"])
    settings = compose_settings("cluster=local_hetero2", "method=my_dp")
    assert settings.cluster["machines"][1]["speed"] == 0.25
    assert settings.config_files["cluster"] == str(mine / "cluster" / "local_hetero2.yaml")
    assert settings.config_files["method"] == str(mine / "method" / "my_dp.yaml")
    assert settings.config_files["model"] == "conf/model/bert.yaml"
    assert settings.config_dirs == [str(mine.resolve())]
    wide = compose_settings("model=bert_wide")  # a model config of one's own
    assert wide.model["spec"]["d_model"] == 256 and wide.config_files["model"] == str(mine / "model" / "bert_wide.yaml")
    use_config_dirs([])
    assert compose_settings("cluster=local_hetero2").cluster["machines"][1]["speed"] == 0.4


def test_a_device_type_of_ones_own_is_found_and_counts_in_the_fingerprint(mine, tmp_path):
    import yaml

    lab = yaml.safe_load(LAB)
    own = ClusterSpec.from_config(lab, (mine, CONF_DIR))
    assert own.devices[0].type.name == "LabGPU" and own.devices[0].effective_flops == 7.0e12
    assert dict(own.type_files) == {
        "LabGPU": str(mine / "device" / "LabGPU.yaml"),
        "V100-16": str(CONF_DIR / "device" / "V100-16.yaml"),
    }
    with pytest.raises(ConfigError, match="device='LabGPU' is unknown; known: A100-40"):
        ClusterSpec.from_config(lab)  # a folder is searched only where given
    # A V100-16 of one's own, with other numbers: it wins, and the cluster hashes differently
    other = tmp_path / "other"
    (other / "device").mkdir(parents=True)
    (other / "device" / "V100-16.yaml").write_text(LAB_GPU.replace("LabGPU", "V100-16"))
    paper = compose_settings("cluster=paper_hetero").cluster
    packaged, theirs = ClusterSpec.from_config(paper), ClusterSpec.from_config(paper, (other, CONF_DIR))
    assert device_type_files((other, CONF_DIR))["V100-16"][1] == other / "device" / "V100-16.yaml"
    assert theirs.devices[0].type.effective_flops == 7.0e12 and packaged.devices[0].type.effective_flops == 3.859e12
    assert theirs.fingerprint() != packaged.fingerprint()
    assert ClusterSpec.from_config(paper, (mine, CONF_DIR)).fingerprint() == packaged.fingerprint()


@pytest.mark.parametrize(
    "argv,needle",
    [
        (
            ["--config-dir", "{tmp}/nowhere"],
            "--config-dir={tmp}/nowhere: no such folder ({tmp}/nowhere); give a folder",
        ),
        (["--config-dir"], "--config-dir needs a folder"),
        (["hydra.searchpath=[file://{tmp}/nowhere]"], "hydra.searchpath entry file://{tmp}/nowhere: no such folder"),
        (["hydra.searchpath=[pkg://no_such_pkg.conf]"], "no installed package 'no_such_pkg.conf'"),
    ],
)
def test_a_config_folder_that_is_not_there_is_one_line(tmp_path, argv, needle):
    with pytest.raises(ConfigError) as err:
        take_config_dirs([a.format(tmp=tmp_path) for a in argv])
    assert needle.format(tmp=tmp_path) in str(err.value) and "\n" not in str(err.value)


def test_a_users_file_that_does_not_parse_is_one_line_naming_it(mine):
    (mine / "cluster" / "broken.yaml").write_text("name: broken\nmachines: [\n")
    take_config_dirs(["--config-dir", str(mine)])
    with pytest.raises(ConfigError) as err:
        compose_settings("cluster=broken")
    assert str(err.value).startswith(f"{mine / 'cluster' / 'broken.yaml'} (line 3) is not valid yaml: ")
    assert str(err.value).endswith("; fix the file") and "\n" not in str(err.value)


def test_an_option_no_schema_has_is_one_line_naming_the_file_or_the_override(mine):
    (mine / "experiment" / "typo.yaml").write_text(
        textwrap.dedent("""\
        # @package _global_
        measured_iter: 3
        """)
    )
    take_config_dirs(["--config-dir", str(mine)])
    with pytest.raises(ConfigError) as err:
        compose_settings("experiment=typo")
    assert str(err.value).startswith(
        f"{mine / 'experiment' / 'typo.yaml'}: measured_iter is not an option (options: mode, precision, seed,"
    )
    with pytest.raises(ConfigError) as err:
        compose_settings("measured_iter=3")
    assert str(err.value).startswith("measured_iter is not an option (options: mode,")
    assert str(err.value).endswith("add a key of your own with +measured_iter=3")
    assert compose_settings("+round=1").config["round"] == 1  # a key of one's own, as documented


def test_the_schema_hydra_composes_against_is_the_settings_schema():
    from hydra.core.config_store import ConfigStore

    from bench.core.schema import fields_of
    from bench.runner.settings import Settings

    node = ConfigStore.instance().load(f"{configs.SCHEMA}.yaml").node
    assert list(node) == fields_of(Settings)
    assert (CONF_DIR / "config.yaml").read_text().count(f"- {configs.SCHEMA}") == 1
