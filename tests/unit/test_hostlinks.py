"""The host transport's floor: one entry per kind the emulator paces, measured once per host."""

import pytest

from bench.runtime import hostlinks
from bench.runtime.emulation.link_clock import _COLLECTIVES


def test_the_probe_times_every_kind_the_emulator_paces():
    assert set(hostlinks._calls(0, 2)) == set(hostlinks._KINDS)
    assert {kind for kind, _ in _COLLECTIVES.values()} <= set(hostlinks._KINDS)


def test_the_floor_is_measured_once_per_host_number_of_ranks_and_priorities(monkeypatch, tmp_path):
    monkeypatch.setenv("HETBENCH_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(hostlinks, "_floors", {})
    measured = []

    def fake(num_ranks, context=None, realtime=False, workers_first=True):
        measured.append((num_ranks, realtime) if workers_first else (num_ranks, realtime, "as gloo leaves them"))
        return {
            kind: 1e-4 * num_ranks * (3 if realtime else 1) * (1 if workers_first else 5) for kind in hostlinks._KINDS
        }

    monkeypatch.setattr(hostlinks, "measure_floor", fake)
    assert hostlinks.host_floor(2) == {kind: pytest.approx(2e-4) for kind in hostlinks._KINDS}
    assert hostlinks.host_floor(2) and measured == [(2, False)]  # this process keeps it
    monkeypatch.setattr(hostlinks, "_floors", {})  # a new process reads the host cache
    assert hostlinks.host_floor(2)["gather"] == pytest.approx(2e-4) and measured == [(2, False)]
    assert hostlinks.host_floor(4)["gather"] == pytest.approx(4e-4) and measured == [(2, False), (4, False)]
    # gloo's threads at real-time priority (emulation.realtime_comm=true): a floor of its own
    assert hostlinks.host_floor(2, realtime=True)["gather"] == pytest.approx(6e-4)
    monkeypatch.setattr(hostlinks, "_floors", {})
    assert hostlinks.host_floor(2, realtime=True)["gather"] == pytest.approx(6e-4)
    assert hostlinks.host_floor(2)["gather"] == pytest.approx(2e-4)
    assert measured == [(2, False), (4, False), (2, True)]
    # gloo's workers left at normal priority (emulation.gloo_workers_first=false): another
    assert hostlinks.host_floor(2, workers_first=False)["gather"] == pytest.approx(1e-3)
    monkeypatch.setattr(hostlinks, "_floors", {})
    assert hostlinks.host_floor(2, workers_first=False)["gather"] == pytest.approx(1e-3)
    assert measured == [(2, False), (4, False), (2, True), (2, False, "as gloo leaves them")]


def test_one_rank_has_no_floor():
    assert hostlinks.measure_floor(1) == {}


def test_a_failed_probe_is_a_warning_and_no_floor(monkeypatch, tmp_path, caplog):
    monkeypatch.setenv("HETBENCH_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(hostlinks, "_floors", {})

    def dies(num_ranks, context=None, realtime=False, workers_first=True):
        raise RuntimeError("a transport probe process exited with [-9, None]")

    monkeypatch.setattr(hostlinks, "measure_floor", dies)
    assert hostlinks.host_floor(2) == {}
    assert "priced without it" in caplog.text and not (tmp_path / "host_speed.json").exists()
