"""The host speed is measured once per host and workload, cached on disk and re-validated."""

import pytest
import torch

from bench.runtime import hostspeed as flops


class _Workload:
    name, model_cfg, flops_per_sample, precision = "toy", "ToyConfig()", 1e9, "fp32"

    def build(self, seed):
        return torch.nn.Linear(4, 4)  # 20 parameters: 80 bytes


class _Ones:
    def synthetic_batch(self, n, generator):
        return (torch.ones(n),)


class _Built:
    """A workload that builds `model()` (seeded) and feeds it `n` ones for a batch of n."""

    model_cfg = _Ones()

    def __init__(self, model, precision: str = "fp32"):
        self.model, self.precision = model, precision

    def build(self, seed):
        torch.manual_seed(seed)
        return self.model()


@pytest.fixture
def timings(monkeypatch, tmp_path):
    """reference_steps_s answers from a table the test sets: {batch: seconds} of whole steps,
    0.8 of that without the optimizer, and counts calls."""
    monkeypatch.setenv("HETBENCH_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(flops, "_host_speed_cache", {})
    table, calls = {4: 0.010, 8: 0.018}, []

    def fake(workload, batches, seed, repeats=21, optimizer=True):
        calls.append((tuple(batches), repeats, optimizer))
        return [table[b] * (1.0 if optimizer else 0.8) for b in batches]

    monkeypatch.setattr(flops, "reference_steps_s", fake)
    monkeypatch.setattr(flops, "optimizer_s_per_byte", lambda nbytes: 1e-9)
    return table, calls


def test_a_new_process_reuses_the_cached_speed_after_a_quick_check(timings, monkeypatch):
    table, calls = timings
    first = flops.measure_host_speed(_Workload(), 4, 0)
    assert first == pytest.approx((1e9 / 0.002, 0.002, 1e-9, 80))  # 2 ms per sample, 2 ms per step
    # both sizes in one probe (they take turns), then forward and backward alone for later checks
    assert calls == [((4, 8), 21, True), ((4,), 7, False)]
    monkeypatch.setattr(flops, "_host_speed_cache", {})  # a new process
    table[4] = 0.0105  # 5% off: within the tolerance
    calls.clear()
    assert flops.measure_host_speed(_Workload(), 4, 0) == first
    assert calls == [((4,), 7, False)]  # the quick check only, without an optimizer (no compiler import)


def test_a_host_that_changed_is_measured_again(timings, monkeypatch):
    table, _calls = timings
    flops.measure_host_speed(_Workload(), 4, 0)
    monkeypatch.setattr(flops, "_host_speed_cache", {})
    table.update({4: 0.020, 8: 0.036})  # twice as slow now
    again = flops.measure_host_speed(_Workload(), 4, 0)
    assert again == pytest.approx((1e9 / 0.004, 0.004, 1e-9, 80))
    assert flops.read_cache(flops.host_cache_file())  # and the cache holds the new numbers
    monkeypatch.setattr(flops, "_host_speed_cache", {})
    assert flops.measure_host_speed(_Workload(), 4, 0) == pytest.approx(again)


def test_an_entry_without_a_forward_backward_time_is_measured_again(timings, monkeypatch):
    _table, calls = timings
    flops.measure_host_speed(_Workload(), 4, 0)
    path = flops.host_cache_file()
    body = flops.read_cache(path)
    (key,) = body
    del body[key]["t1_fb"]  # an entry that a quick check cannot compare with
    flops.write_cache(path, key, body[key])
    monkeypatch.setattr(flops, "_host_speed_cache", {})
    calls.clear()
    flops.measure_host_speed(_Workload(), 4, 0)
    assert calls == [((4, 8), 21, True), ((4,), 7, False)]


def test_a_corrupt_cache_is_only_a_lost_shortcut(timings, monkeypatch):
    flops.host_cache_file().parent.mkdir(parents=True, exist_ok=True)
    flops.host_cache_file().write_text("{not json")
    assert flops.measure_host_speed(_Workload(), 4, 0) == pytest.approx((1e9 / 0.002, 0.002, 1e-9, 80))
    assert len(flops.read_cache(flops.host_cache_file())) == 1


@pytest.mark.parametrize(
    "shares, batches",
    [
        ([8, 8], (8, 16)),  # an even split: the share and twice it
        ([11, 5], (5, 11)),  # uneven: exact at both shares
        ([12, 11, 6, 3], (3, 12)),
        ([9, 7], (7, 14)),  # close shares: at least twice the smallest, for a slope above the noise
        ([4, 0], (1, 4)),  # a device with no sample: the model still needs one
    ],
)
def test_the_yardstick_times_the_plans_smallest_share_and_spans_its_largest(shares, batches):
    assert flops.yardstick_batches(shares) == batches


def test_a_step_splits_into_a_per_sample_and_a_per_step_part_through_any_two_batches():
    # 2 ms per sample, 3 ms per step, timed at 5 and 11 samples
    assert flops.split_step(_Workload(), (5, 11), (0.013, 0.025)) == pytest.approx((1e9 / 0.002, 0.003))
    # a step mostly per-step part (tiny VGG19 here: 8.3 of 12.3 ms at 8 samples) is split as timed
    assert flops.split_step(_Workload(), (8, 16), (0.0123, 0.0163)) == pytest.approx((1e9 / 0.0005, 0.0083))
    # noise that makes the larger batch look cheaper: a tenth of the step is still per sample
    rate, fixed = flops.split_step(_Workload(), (5, 11), (0.013, 0.012))
    assert (rate, fixed) == pytest.approx((1e9 / (0.1 * 0.013 / 5), 0.9 * 0.013))
    # a step that grows faster than its samples (tiny BERT's at 128 and 256): no per-step part,
    # each sample at the smaller batch's rate, exact there (the affine line through both priced
    # 128 samples 31% dear)
    rate, fixed = flops.split_step(_Workload(), (128, 256), (0.1033, 0.2384))
    assert (rate, fixed) == pytest.approx((1e9 / (0.1033 / 128), 0.0)) and fixed >= 0.0
    assert 128 * 1e9 / rate + fixed == pytest.approx(0.1033)


def test_the_pause_penalty_compares_steps_after_the_pause_with_steps_right_after_them(monkeypatch):
    """Each cold step (after sleeping the pause) is followed at once by a warm one, so a drift of
    the host hits both kinds alike; the fastest of each kind are compared, and the caller's
    random state is left alone."""

    class Clock:
        cpu, cold, sleeps = 0.0, False, []

        def thread_time(self):
            return self.cpu

        def sleep(self, seconds):
            self.sleeps.append(seconds)
            self.cold = True

    clock = Clock()
    drift = iter([1.0, 1.0, 1.0, 1.0, 1.3, 1.3, 1.0, 1.0] + [1.0] * 100)  # one slow pair

    class Model(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.w = torch.nn.Parameter(torch.ones(1))

        def forward(self, x):
            clock.cpu += (0.006 if clock.cold else 0.005) * next(drift)
            clock.cold = False
            return (self.w * x).sum()

    monkeypatch.setattr(flops, "time", clock)
    torch.manual_seed(7)
    before = torch.get_rng_state()
    probe = flops.pause_penalty(_Built(Model), 4, 0, pause_s=0.003, repeats=3)
    # It runs between training iterations: the random state training draws from is as it was.
    assert torch.equal(torch.get_rng_state(), before)
    assert clock.sleeps == [0.003] * 3
    assert probe["warm_s"] == pytest.approx(0.005) and probe["cold_s"] == pytest.approx(0.006)
    assert probe["penalty"] == pytest.approx(1.2)


@pytest.mark.parametrize(
    "measure, repeats, slow",
    [
        (lambda w, r: flops.yardstick(w, (5, 11), 0, r)["seconds"], 9, 13),  # the fastest step of each size
        (lambda w, r: flops.reference_steps_s(w, (5, 11), 0, r), 21, 17),  # the parent's probe: the median
    ],
)
def test_the_batch_sizes_take_turns_so_a_slow_stretch_hits_both(monkeypatch, measure, repeats, slow):
    """The host runs 1.8x slow for the first `slow` steps timed: past what the estimate of the
    first size can absorb, were the sizes timed one after the other. Taking turns, both sizes
    keep enough steps at the host's own speed."""
    calls = []

    def step(model, optimizer, batch, clock):
        calls.append(len(batch[0]))
        seconds = 0.003 + 0.002 * len(batch[0])  # 3 ms per step, 2 ms per sample
        return seconds * (1.8 if len(calls) <= slow else 1.0)

    monkeypatch.setattr(flops, "_timed_step", step)
    assert measure(_Built(lambda: torch.nn.Linear(1, 1)), repeats) == [pytest.approx(0.013), pytest.approx(0.025)]
    assert calls == [5, 11] * (repeats + 2)


@pytest.mark.parametrize("precision, autocast", [("fp32", False), ("bf16", True)])
def test_the_yardstick_and_the_pause_penalty_step_at_the_workloads_precision(monkeypatch, precision, autocast):
    """A bf16 rank trains under autocast, so the plain steps that price it do too (fp32 steps
    priced bf16 CPU ranks 10-43% slow)."""
    seen = []

    def step(model, optimizer, batch, clock):
        seen.append((torch.is_autocast_enabled("cpu"), torch.get_autocast_dtype("cpu")))
        return 0.01

    monkeypatch.setattr(flops, "_timed_step", step)
    workload = _Built(lambda: torch.nn.Linear(1, 1), precision)
    flops.yardstick(workload, (2, 4), 0, 3)
    flops.pause_penalty(workload, 2, 0, 0.0, 2)
    assert seen and all(on == autocast for on, _ in seen)
    assert not autocast or all(dtype == torch.bfloat16 for _, dtype in seen)
    assert not torch.is_autocast_enabled("cpu")


def test_adams_cost_per_byte_is_measured_between_two_sizes():
    """One Adam step over 2 MB of fp32 parameters, less one over 1 MB, per byte: memory-bound
    work on a CPU thread lies between 0.01 and 100 ns a byte (docs/cost-model.md, "Device types,
    host speed and profiles")."""
    assert 1e-11 < flops.optimizer_s_per_byte(2 << 20, repeats=5) < 1e-7
