import copy
import re

import pytest

from bench.core.cluster import ClusterSpec
from bench.core.device_types import DEVICE_DIR, device_types
from bench.core.errors import ConfigError
from bench.runner.configs import group_options
from tests.conftest import compose_config

GOOD = {
    "name": "two",
    "machines": [
        {"count": 1, "device": "V100-16", "num_devices": 2},
        {"count": 2, "device": "P100-16", "num_devices": 1, "speed": 0.5},
    ],
    "links": {
        "intra_machine": {"bandwidth_gbps": 100.0, "latency_s": 1e-5},
        "inter_machine": {"bandwidth_gbps": 10.0, "latency_s": 3e-5},
    },
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
    assert spec.num_devices >= 1 and spec.name == name  # h100x1: one real GPU


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


@pytest.mark.parametrize(
    "path,value,needle",
    [
        (("machines", 1, "speed"), 0.0, "cluster.machines[1].speed=0.0 must be a number > 0"),
        (("machines", 0, "effective_flops"), -1e12, "cluster.machines[0].effective_flops=-1000000000000.0"),
        (("machines", 0, "memory_gib"), 0, "cluster.machines[0].memory_gib=0 must be a number > 0"),
        (("machines", 0, "num_devices"), 0, "cluster.machines[0].num_devices=0 must be an integer >= 1"),
        (("machines", 1, "count"), 0, "cluster.machines[1].count=0"),
        (("machines", 0, "device"), "H100", "cluster.machines[0].device='H100' is unknown; known: A100-40"),
        (("links", "inter_machine", "bandwidth_gbps"), -5, "cluster.links.inter_machine.bandwidth_gbps=-5"),
        (("links", "intra_machine", "latency_s"), -1, "cluster.links.intra_machine.latency_s=-1"),
        (("machines",), [], "cluster.machines=[] is empty"),
        (("num_devices",), 5, "cluster.num_devices=5 does not add up: the machine groups hold 4"),
        (("virtual_device",), "node", "cluster.virtual_device='node' is invalid"),
        (("machines", 0, "gpus"), 3, "unknown field(s) ['gpus']"),
    ],
)
def test_invalid_cluster_fields_name_the_field_and_value(path, value, needle):
    with pytest.raises(ConfigError) as err:
        ClusterSpec.from_config(_broken(path, value))
    assert needle in str(err.value)
    assert "\n" not in str(err.value)


def test_slow_emulated_devices_take_longer_for_their_per_step_work_too():
    from bench.core.program import Program
    from bench.cost import simulate

    cfg = compose_config("cluster=local_hetero2")
    spec = ClusterSpec.from_config(dict(cfg.cluster)).with_host_speed(1e10, step_overhead_s=0.002)
    assert [d.step_overhead_s for d in spec.devices] == pytest.approx([0.002, 0.005])
    empty = Program((), 2)
    assert simulate(empty, spec, [[0.5, 0.5]]).iter_time_s == pytest.approx(0.005)
    # A method's own host work (DeepSpeed's engine) is priced like the model's: 2e7 FLOPs at
    # 1e10 FLOP/s x speed 0.4 is 5 ms more on the slow device, counted as compute.
    engine = simulate(Program((), 2, host_work_flops=2e7), spec, [[0.5, 0.5]])
    assert engine.iter_time_s == pytest.approx(0.010) and engine.per_step_s == pytest.approx(0.010)


def test_adams_per_byte_part_follows_the_parameter_bytes_a_device_holds():
    """Of a host's 6 ms per-step part, 4 ms is Adam over the model's 4 MB of parameters (1 ns a
    byte). A device that holds all of them pays the whole 6 ms (over its speed, as before the
    split); one that holds a 0.75 / 0.25 shard of 3 MB of them pays for the bytes it holds."""
    import pulp

    from bench.core.program import Affine, Memory, Program
    from bench.cost import simulate, virtual_devices
    from bench.cost.algebra import LpAlgebra
    from bench.cost.price import per_step_s

    cfg = compose_config("cluster=local_hetero2")
    spec = ClusterSpec.from_config(dict(cfg.cluster)).with_host_speed(1e10, 0.006, 1e-9, 4e6)
    assert [d.step_overhead_s for d in spec.devices] == pytest.approx([0.002, 0.005])
    assert [d.optimizer_s_per_byte for d in spec.devices] == pytest.approx([1e-9, 2.5e-9])
    whole = Program((), 2, memory=Memory(params=Affine(4e6)))
    assert simulate(whole, spec, [[0.5, 0.5]]).per_step_s == pytest.approx(0.006 / 0.4)
    sharded = Program((), 2, memory=Memory(params=Affine(1e6) + Affine.sharded(3e6)))
    # fast: 2 ms + 1 ns x 3.25 MB; slow: 5 ms + 2.5 ns x 1.75 MB = 9.375 ms
    assert simulate(sharded, spec, [[0.75, 0.25]]).per_step_s == pytest.approx(0.009375)
    # The load balancer prices it the same way: the slow device's part falls as its share does.
    prob = pulp.LpProblem("per_step", pulp.LpMinimize)
    r = [[prob.add_variable("r0", 0, 1), prob.add_variable("r1", 0, 1)]]
    t = per_step_s(sharded, spec, virtual_devices(spec, "gpu"), LpAlgebra(prob, r))
    prob += t
    prob += r[0][0] + r[0][1] == 1
    prob.solve(pulp.PULP_CBC_CMD(msg=False))
    at = [[r[0][0].value(), r[0][1].value()]]
    assert pulp.value(t) == pytest.approx(simulate(sharded, spec, at).per_step_s)
    assert pulp.value(t) < 0.009375 and at[0][1] < 0.25
    # A run's yardstick times whole steps: the per-byte part scales with its per-step part.
    slow = spec.at_run_speed(5e9, 0.012)
    assert slow.host_optimizer_s_per_byte == pytest.approx(2e-9) and slow.host_param_bytes == 4e6
    # A measured per-byte cost above the whole per-step part is held to it.
    held = ClusterSpec.from_config(dict(cfg.cluster)).with_host_speed(1e10, 0.002, 1e-9, 4e6)
    assert [d.step_overhead_s for d in held.devices] == pytest.approx([0.0, 0.0])
    assert held.devices[0].optimizer_s_per_byte == pytest.approx(0.5e-9)


# Device types are data: conf/device/*.yaml, or inline in a cluster file.

PACKAGED = ["H100-80", "H200", "A100-80", "A100-40", "V100-16", "V100-32", "P100-16", "L4", "T4", "cpu"]
MY_GPU = {
    "memory_gib": 24,
    "peak_flops": 30.0e12,
    "effective_flops": 7.0e12,
    "sources": {
        "memory_gib": "vendor sheet",
        "peak_flops": "vendor sheet",
        "effective_flops": "assumption: 0.23 x peak",
    },
}


@pytest.mark.parametrize("name", PACKAGED)
def test_every_packaged_device_type_loads_with_a_source_per_number(name):
    t = device_types()[name]
    assert t.name == name and t.memory_gib > 0
    given = {k: getattr(t, k) for k in ("memory_gib", "peak_flops", "effective_flops")}
    for key, value in given.items():
        if value is not None:
            assert isinstance(value, float) and value > 0
            assert t.sources[key].strip(), f"{name}: {key} has no source"
    assert (t.effective_flops is None) == (name == "cpu")  # only the host is measured at run time
    assert t.profile is None or isinstance(t.profile, str)


def test_the_paper_types_keep_the_hap_profiled_rates():
    types = device_types()
    assert [types[n].effective_flops for n in ("V100-16", "P100-16", "A100-40")] == [3.859e12, 2.149e12, 5.712e12]


def test_an_inline_device_type_is_used_and_changes_the_fingerprint():
    cfg = copy.deepcopy(GOOD)
    cfg["device_types"] = {"MyGPU": MY_GPU}
    cfg["machines"][1]["device"] = "MyGPU"
    spec = ClusterSpec.from_config(cfg)
    assert spec.devices[2].type.name == "MyGPU" and spec.devices[2].type.memory_gib == 24
    assert spec.devices[2].effective_flops == pytest.approx(0.5 * 7.0e12)
    other = copy.deepcopy(cfg)
    other["device_types"]["MyGPU"]["effective_flops"] = 8.0e12
    assert len({ClusterSpec.from_config(c).fingerprint() for c in (GOOD, cfg, other)}) == 3


def test_an_inline_type_overrides_a_packaged_one_for_that_cluster_only():
    cfg = copy.deepcopy(GOOD)
    cfg["device_types"] = {"P100-16": {**MY_GPU, "memory_gib": 12}}
    assert ClusterSpec.from_config(cfg).devices[2].type.memory_gib == 12
    assert ClusterSpec.from_config(GOOD).devices[2].type.memory_gib == 16
    assert device_types()["P100-16"].memory_gib == 16


def test_a_machine_group_still_overrides_the_type():
    cfg = _broken(("machines", 0, "effective_flops"), 1e12)
    cfg["machines"][0]["memory_gib"] = 8
    dev = ClusterSpec.from_config(cfg).devices[0]
    assert dev.effective_flops == 1e12 and dev.type.memory_gib == 8


def _with_type(**changes):
    cfg = copy.deepcopy(GOOD)
    fields = {k: v for k, v in {**copy.deepcopy(MY_GPU), **changes}.items() if v is not ...}
    cfg["device_types"] = {"MyGPU": fields}
    cfg["machines"][1]["device"] = "MyGPU"
    return cfg


@pytest.mark.parametrize(
    "changes,needle",
    [
        ({"memory_gib": ...}, "cluster.device_types.MyGPU.memory_gib is missing; add"),
        (
            {"effective_flops": ..., "peak_flops": ...},
            "cluster.device_types.MyGPU.effective_flops is missing; a GPU type needs the sustained FLOP/s",
        ),
        ({"effective_flops": ..., "peak_flops": ...}, "and peak_flops from the datasheet"),
        ({"effective_flops": None}, "cluster.device_types.MyGPU.effective_flops is missing"),
        ({"peak_flops": "fast"}, "cluster.device_types.MyGPU.peak_flops='fast' must be a number > 0"),
        ({"memory_gib": 0}, "cluster.device_types.MyGPU.memory_gib=0 must be a number > 0"),
        ({"effective_flops": -1e12}, "cluster.device_types.MyGPU.effective_flops=-1000000000000.0 must be"),
        ({"tflops": 30}, "cluster.device_types.MyGPU has unknown field(s) ['tflops']; valid:"),
        ({"sources": {"memory_gib": "sheet"}}, "cluster.device_types.MyGPU.sources.peak_flops is missing"),
        ({"sources": {**MY_GPU["sources"], "speed": "x"}}, "cluster.device_types.MyGPU.sources.speed is not"),
        ({"profile": 3}, "cluster.device_types.MyGPU.profile=3 must be a profile file's path"),
        ({"name": "Other"}, "cluster.device_types.MyGPU.name='Other' differs from its key 'MyGPU'"),
    ],
)
def test_bad_inline_device_types_name_the_field_and_value(changes, needle):
    with pytest.raises(ConfigError, match=re.escape(needle)) as err:
        ClusterSpec.from_config(_with_type(**changes))
    assert "\n" not in str(err.value)


def test_an_unknown_device_says_how_to_define_one():
    with pytest.raises(
        ConfigError, match=re.escape("device='B200' is unknown; known: A100-40, A100-80, H100-80")
    ) as err:
        ClusterSpec.from_config(_broken(("machines", 0, "device"), "B200"))
    assert "cluster.device_types" in str(err.value) and "conf/device/B200.yaml" in str(err.value)


def _device_dir(tmp_path, text, stem="MyGPU"):
    (tmp_path / f"{stem}.yaml").write_text(text)
    return tmp_path


def test_the_loader_reads_a_directory_of_its_own(tmp_path):
    d = _device_dir(
        tmp_path,
        "name: MyGPU\nmemory_gib: 24\neffective_flops: 7e12\n"
        "sources: {memory_gib: sheet, effective_flops: assumption}\n",
    )
    assert device_types(d)["MyGPU"].effective_flops == 7e12
    assert set(device_types(DEVICE_DIR)) >= set(PACKAGED)


@pytest.mark.parametrize(
    "text,stem,needle",
    [
        ("name: MyGPU\nmemory_gib: [24\n", "MyGPU", "MyGPU.yaml is not valid yaml ("),
        ("name: Other\nmemory_gib: 24\n", "MyGPU", "MyGPU.yaml: name='Other' differs from the file name"),
        ("- 1\n- 2\n", "MyGPU", "MyGPU.yaml must hold a mapping of fields"),
        ("name: MyGPU\nmemory_gib: big\n", "MyGPU", "MyGPU.yaml: memory_gib='big' must be a number > 0"),
        ("name: MyGPU\nmemory_gib: 24\ncolor: red\n", "MyGPU", "MyGPU.yaml has unknown field(s) ['color']"),
    ],
)
def test_a_bad_device_file_names_its_path(tmp_path, text, stem, needle):
    d = _device_dir(tmp_path, text, stem)
    with pytest.raises(ConfigError, match=re.escape(needle)) as err:
        device_types(d)
    assert str(tmp_path) in str(err.value) and "\n" not in str(err.value)
