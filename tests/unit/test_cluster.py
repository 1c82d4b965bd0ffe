import copy

import pytest

from bench.cluster import ClusterSpec, ConfigError
from bench.run import group_options
from tests.conftest import compose_config

GOOD = {
    "name": "two",
    "machines": [{"count": 1, "device": "V100-16", "num_devices": 2},
                 {"count": 2, "device": "P100-16", "num_devices": 1, "speed": 0.5}],
    "links": {"intra_machine": {"bandwidth_gbps": 100.0, "latency_s": 1e-5},
              "inter_machine": {"bandwidth_gbps": 10.0, "latency_s": 3e-5}},
}


def test_devices_machines_and_flops_follow_the_groups():
    spec = ClusterSpec.from_config(GOOD)
    assert spec.num_devices == 4 and spec.num_machines == 3
    assert [d.machine for d in spec.devices] == [0, 0, 1, 2]
    assert spec.devices[2].effective_flops == pytest.approx(0.5 * 2.149e12)
    assert spec.total_effective_flops() == pytest.approx(2 * 3.859e12 + 2.149e12)


def test_link_between_picks_the_slowest_level():
    spec = ClusterSpec.from_config(GOOD)
    assert spec.link_between([0, 1]).bandwidth_gbps == 100.0
    assert spec.link_between([1, 2]).bandwidth_gbps == 10.0


def test_emulated_cpu_devices_take_the_measured_host_speed():
    cfg = compose_config("cluster=local_hetero2")
    spec = ClusterSpec.from_config(dict(cfg.cluster)).with_host_speed(1e10)
    assert [d.effective_flops for d in spec.devices] == pytest.approx([1e10, 0.4e10])


@pytest.mark.parametrize("name", group_options("cluster"))
def test_every_cluster_preset_validates(name):
    from omegaconf import OmegaConf

    cfg = compose_config(f"cluster={name}")
    spec = ClusterSpec.from_config(OmegaConf.to_container(cfg.cluster, resolve=True))
    assert spec.num_devices >= 2 and spec.name == name


def test_paper_hetero_has_k_gpus_per_machine():
    from omegaconf import OmegaConf

    cfg = compose_config("cluster=paper_hetero", "cluster.gpus_per_machine=4")
    spec = ClusterSpec.from_config(OmegaConf.to_container(cfg.cluster, resolve=True))
    assert spec.num_devices == 32 and spec.num_machines == 8
    assert sum(d.type.name == "V100-16" for d in spec.devices) == 8


def _broken(path, value):
    cfg = copy.deepcopy(GOOD)
    node = cfg
    for key in path[:-1]:
        node = node[key]
    node[path[-1]] = value
    return cfg


@pytest.mark.parametrize("path,value,needle", [
    (("machines", 1, "speed"), 0.0, "cluster.machines[1].speed=0.0 must be a number > 0"),
    (("machines", 0, "effective_flops"), -1e12, "cluster.machines[0].effective_flops=-1000000000000.0"),
    (("machines", 0, "memory_gib"), 0, "cluster.machines[0].memory_gib=0 must be a number > 0"),
    (("machines", 0, "num_devices"), 0, "cluster.machines[0].num_devices=0 must be an integer >= 1"),
    (("machines", 1, "count"), 0, "cluster.machines[1].count=0"),
    (("machines", 0, "device"), "H100", "cluster.machines[0].device='H100' is unknown; known: V100-16"),
    (("links", "inter_machine", "bandwidth_gbps"), -5, "cluster.links.inter_machine.bandwidth_gbps=-5"),
    (("links", "intra_machine", "latency_s"), -1, "cluster.links.intra_machine.latency_s=-1"),
    (("machines",), [], "cluster.machines=[] is empty"),
    (("num_devices",), 5, "cluster.num_devices=5 does not add up: the machine groups hold 4"),
    (("virtual_device",), "node", "cluster.virtual_device='node' is invalid"),
    (("machines", 0, "gpus"), 3, "unknown field(s) ['gpus']"),
])
def test_invalid_cluster_fields_name_the_field_and_value(path, value, needle):
    with pytest.raises(ConfigError) as err:
        ClusterSpec.from_config(_broken(path, value))
    assert needle in str(err.value)
    assert "\n" not in str(err.value)


def test_slow_emulated_devices_take_longer_for_their_per_step_work_too():
    from bench.program import Program
    from bench.simulate import simulate

    cfg = compose_config("cluster=local_hetero2")
    spec = ClusterSpec.from_config(dict(cfg.cluster)).with_host_speed(1e10, step_overhead_s=0.002)
    assert [d.step_overhead_s for d in spec.devices] == pytest.approx([0.002, 0.005])
    empty = Program((), 2)
    assert simulate(empty, spec, [[0.5, 0.5]]).iter_time_s == pytest.approx(0.005)
