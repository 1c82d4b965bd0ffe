"""The host speed is measured once per host and workload, cached on disk and re-validated."""

import pytest

from bench import flops


class _Workload:
    name, model_cfg, flops_per_sample = "toy", "ToyConfig()", 1e9


@pytest.fixture
def timings(monkeypatch, tmp_path):
    """reference_step_s answers from a table the test sets: {batch: seconds}, and counts calls."""
    monkeypatch.setenv("HETBENCH_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(flops, "_host_speed_cache", {})
    table, calls = {4: 0.010, 8: 0.018}, []

    def fake(workload, batch, seed, repeats=21):
        calls.append((batch, repeats))
        return table[batch]

    monkeypatch.setattr(flops, "reference_step_s", fake)
    return table, calls


def test_a_new_process_reuses_the_cached_speed_after_a_quick_check(timings, monkeypatch):
    table, calls = timings
    first = flops.measure_host_speed(_Workload(), 4, 0)
    assert first == pytest.approx((1e9 / 0.002, 0.002))  # 2 ms per sample, 2 ms per step
    monkeypatch.setattr(flops, "_host_speed_cache", {})  # a new process
    table[4] = 0.0105  # 5% off: within the tolerance
    calls.clear()
    assert flops.measure_host_speed(_Workload(), 4, 0) == first
    assert calls == [(4, 7)]  # the quick check only


def test_a_host_that_changed_is_measured_again(timings, monkeypatch):
    table, calls = timings
    flops.measure_host_speed(_Workload(), 4, 0)
    monkeypatch.setattr(flops, "_host_speed_cache", {})
    table.update({4: 0.020, 8: 0.036})  # twice as slow now
    again = flops.measure_host_speed(_Workload(), 4, 0)
    assert again == pytest.approx((1e9 / 0.004, 0.004))
    assert flops._read_cache(flops.host_cache_file())  # and the cache holds the new numbers
    monkeypatch.setattr(flops, "_host_speed_cache", {})
    assert flops.measure_host_speed(_Workload(), 4, 0) == pytest.approx(again)


def test_a_corrupt_cache_is_only_a_lost_shortcut(timings, monkeypatch):
    flops.host_cache_file().parent.mkdir(parents=True, exist_ok=True)
    flops.host_cache_file().write_text("{not json")
    assert flops.measure_host_speed(_Workload(), 4, 0) == pytest.approx((1e9 / 0.002, 0.002))
    assert len(flops._read_cache(flops.host_cache_file())) == 1
