"""The host transport's floor: one entry per kind the emulator paces, measured once per host."""

import pytest

from bench import hostlinks
from bench.emulation import _COLLECTIVES


def test_the_probe_times_every_kind_the_emulator_paces():
    assert set(hostlinks._calls(0, 2)) == set(hostlinks._KINDS)
    assert {kind for kind, _ in _COLLECTIVES.values()} <= set(hostlinks._KINDS)


def test_the_floor_is_measured_once_per_host_and_number_of_ranks(monkeypatch, tmp_path):
    monkeypatch.setenv("HETBENCH_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(hostlinks, "_floors", {})
    measured = []

    def fake(num_ranks, context=None):
        measured.append(num_ranks)
        return {kind: 1e-4 * num_ranks for kind in hostlinks._KINDS}

    monkeypatch.setattr(hostlinks, "measure_floor", fake)
    assert hostlinks.host_floor(2) == {kind: pytest.approx(2e-4) for kind in hostlinks._KINDS}
    assert hostlinks.host_floor(2) and measured == [2]  # this process keeps it
    monkeypatch.setattr(hostlinks, "_floors", {})  # a new process reads the host cache
    assert hostlinks.host_floor(2)["gather"] == pytest.approx(2e-4) and measured == [2]
    assert hostlinks.host_floor(4)["gather"] == pytest.approx(4e-4) and measured == [2, 4]


def test_one_rank_has_no_floor():
    assert hostlinks.measure_floor(1) == {}


def test_a_failed_probe_is_a_warning_and_no_floor(monkeypatch, tmp_path, caplog):
    monkeypatch.setenv("HETBENCH_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(hostlinks, "_floors", {})

    def dies(num_ranks, context=None):
        raise RuntimeError("a transport probe process exited with [-9, None]")

    monkeypatch.setattr(hostlinks, "measure_floor", dies)
    assert hostlinks.host_floor(2) == {}
    assert "priced without it" in caplog.text and not (tmp_path / "host_speed.json").exists()
