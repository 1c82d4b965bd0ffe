import pytest

from bench.cost import link_bytes
from bench.cost.profiles import fit_alpha_beta


def test_the_fit_recovers_latency_and_bandwidth():
    alpha, bandwidth = 1e-3, 2e9
    rows = [
        {
            "kind": "all_reduce",
            "impl": "ring",
            "bytes": b,
            "first_share": None,
            "seconds": alpha + link_bytes("all_reduce", b, 4) / bandwidth,
        }
        for b in (4e3, 1e6, 16e6, 64e6)
    ]
    rows.append(dict(rows[0], first_share=0.9, seconds=99.0))  # skewed rows are not fitted
    fit = fit_alpha_beta(rows, 4)["all_reduce/ring"]
    assert fit["latency_s"] == pytest.approx(alpha, rel=1e-6)
    assert fit["bytes_per_s"] == pytest.approx(bandwidth, rel=1e-6)


def test_a_flat_fit_falls_back_to_the_largest_size():
    rows = [
        {"kind": "broadcast", "impl": "ring", "bytes": b, "first_share": None, "seconds": t}
        for b, t in ((1e3, 2e-3), (4e3, 1e-3))
    ]
    fit = fit_alpha_beta(rows, 2)["broadcast/ring"]
    assert fit["bandwidth_from"] == "largest size" and fit["bytes_per_s"] == pytest.approx(4e6)


def test_kendall_tau_counts_agreeing_pairs():
    from bench.studies.calibration import kendall_tau

    assert kendall_tau([1, 2, 3], [10, 20, 30]) == 1
    assert kendall_tau([1, 2, 3], [30, 20, 10]) == -1
    assert kendall_tau([1, 2, 3], [10, 30, 20]) == pytest.approx(1 / 3)
    assert kendall_tau([1], [1]) is None
    # Only the pairs the measurement separates; a predicted tie there is no agreement.
    assert kendall_tau([1, 2, 3], [10, 30, 20], separated=lambda i, j: j == i + 1 and i == 0) == 1
    assert kendall_tau([1, 2, 3], [10, 10, 20], separated=lambda i, j: True) == pytest.approx(2 / 3)
    assert kendall_tau([1, 2], [10, 20], separated=lambda i, j: False) is None


def test_calibration_summary_has_errors_mape_and_tau():
    from bench.studies.calibration import summarize

    rows = [
        dict(model="bert", cluster="c", method=m, status="ok", iter_time_s_mean=t, predicted_iter_time_s=p)
        for m, t, p in (("a", 1.0, 1.1), ("b", 2.0, 1.8))
    ]
    rows.append(dict(model="bert", cluster="c", method="x", status="failed", error="boom"))
    s = summarize(rows)
    assert s["mape"] == pytest.approx(0.1) and s["kendall_tau_all"] == {"bert/c": 1.0}
    assert s["kendall_tau"] == {"bert/c": None}  # no per-iteration times: nothing separated
    assert s["failed"] == ["bert/c/x: boom"]


def test_calibration_summary_gives_the_mape_per_method_model_and_cluster(capsys):
    from bench.studies.calibration import print_summary, summarize

    errors = {("bert", "c2", "a"): 0.10, ("bert", "c2", "b"): 0.20, ("vit", "c2", "a"): 0.30, ("vit", "c4", "a"): 0.40}
    rows = [
        dict(model=m, cluster=c, method=x, status="ok", iter_time_s_mean=1.0, predicted_iter_time_s=1.0 + e)
        for (m, c, x), e in errors.items()
    ]
    s = summarize(rows)
    assert s["mape_by_method"] == pytest.approx({"a": 0.8 / 3, "b": 0.2})
    assert s["mape_by_model"] == pytest.approx({"bert": 0.15, "vit": 0.35})
    assert s["mape_by_cluster"] == pytest.approx({"c2": 0.2, "c4": 0.4})
    assert set(s["kendall_tau_all"]) == {"bert/c2", "vit/c2", "vit/c4"}
    print_summary(s)
    out = capsys.readouterr().out
    assert "MAPE by method: a 26.7% (3), b 20.0% (1)" in out
    assert "MAPE by model: bert 15.0% (2), vit 35.0% (2)" in out
    assert "MAPE by cluster: c2 20.0% (3), c4 40.0% (1)" in out


def test_calibration_summary_prices_the_rest_alone_with_the_compute_measured():
    from bench.studies.calibration import summarize

    def row(method, measured, predicted, predicted_compute, slow_rank_reference):
        ranks = [
            {"reference_s_per_iter": 0.010, "speed": 1.0},
            {"reference_s_per_iter": slow_rank_reference, "speed": 0.5},
        ]
        return dict(
            model="bert",
            cluster="c",
            method=method,
            status="ok",
            iter_time_s_mean=measured,
            predicted_iter_time_s=predicted,
            predicted_compute_s=predicted_compute,
            emulation={"ranks": ranks},
        )

    # a: compute measured 20% over its price (the host slowed down), the rest priced exactly;
    # b: compute as priced, the rest 10 ms short of the 100 ms measured
    s = summarize([row("a", 0.110, 0.100, 0.050, 0.030), row("b", 0.100, 0.090, 0.060, 0.030)])
    assert [c["compute_s"] for c in s["cases"]] == pytest.approx([0.060, 0.060])
    assert [c["link_overrun_s"] for c in s["cases"]] == [None, None]  # the rows recorded none
    overran = row("a", 0.110, 0.100, 0.050, 0.030)
    overran["emulation"]["link_overrun_s"] = 0.004
    assert summarize([overran])["cases"][0]["link_overrun_s"] == 0.004
    assert s["mape"] == pytest.approx((0.01 / 0.11 + 0.1) / 2)
    assert s["mape_outside_compute"] == pytest.approx((0.0 + 0.1) / 2)
    assert summarize([{**row("a", 0.1, 0.1, 0.05, 0.03), "emulation": None}])["mape_outside_compute"] is None


def test_calibration_tau_counts_only_pairs_the_repeats_separate():
    from bench.records.stats import summarize as interval
    from bench.studies.calibration import summarize

    def row(method, times, predicted):
        return dict(
            model="bert",
            cluster="c",
            method=method,
            status="ok",
            predicted_iter_time_s=predicted,
            iter_time_s_mean=interval(times).median,
            aggregate={"iter_time_s": interval(times).as_dict()},
        )

    rows = [
        row("a", [1.0, 1.1, 1.2], 2.0),  # overlaps b: mispredicted, but not counted
        row("b", [1.1, 1.2, 1.3], 1.5),
        row("c", [3.0, 3.1, 3.2], 3.0),
    ]
    s = summarize(rows)
    assert s["separated_pairs"] == {"bert/c": 2}
    assert s["kendall_tau"] == {"bert/c": 1.0}
    assert s["kendall_tau_all"]["bert/c"] == pytest.approx(1 / 3)
    # One run per case (no aggregate): nothing is separated.
    assert summarize([{**r, "aggregate": None} for r in rows])["kendall_tau"] == {"bert/c": None}


def test_the_compute_fit_keeps_the_fixed_cost_when_the_largest_point_is_off():
    # t = 20 us + FLOPs / 50 TFLOP/s over sizes four orders apart, the largest point 5% slow:
    # least squares of the absolute error gave 13 us; of the relative error it keeps ~20 us.
    from bench.cost.profiles import _fit_affine

    points = [(x, 20e-6 + x / 50e12) for x in (5e7, 4e8, 3.2e9, 2.6e10, 2e11)]
    assert _fit_affine(points) == pytest.approx((20e-6, 50e12), rel=1e-6)
    slow = points[:-1] + [(points[-1][0], points[-1][1] * 1.05)]
    fixed, rate = _fit_affine(slow)
    assert fixed == pytest.approx(20e-6, rel=0.02) and rate == pytest.approx(50e12, rel=0.03)


def test_a_gpu_profile_entry_takes_the_smallest_host_time_and_refits_from_its_points(tmp_path):
    # The host queues a call in ~1 ms at any size; at the two largest sizes it also waited for
    # the device (a full launch queue, or an allocation that synchronises), as the conv chain
    # did on an H200.
    import json

    from bench.core.device_types import load_compute_profile
    from bench.cost.profiles import fit_entry, refit
    from bench.profile import main

    points = [
        (x, 20e-6 + x / 50e12, h)
        for x, h in ((5e7, 1.1e-3), (4e8, 1.0e-3), (3.2e9, 1.2e-3), (2.6e10, 4.0e-3), (2e11, 16.8e-3))
    ]
    entry = fit_entry(points, "flops_per_s", 20, host=True)
    assert entry["dispatch_s"] == pytest.approx(1.0e-3 / 20)
    assert entry["fixed_s"] == pytest.approx(1e-6, rel=1e-6) and entry["flops_per_s"] == pytest.approx(50e12)
    assert "dispatch_s" not in fit_entry(points, "flops_per_s", 20, host=False)  # a CPU: the host computes
    measured = {
        "device_type": "G",
        "device": "Some GPU",
        "compute": {
            "other": {"fixed_s": 0.0, "flops_per_s": 1.0, "dispatch_s": 9.0, "kernels_per_call": 20, "points": points}
        },
        "optimizer": {
            "fixed_s": 0.0,
            "bytes_per_s": 1.0,
            "dispatch_s": 9.0,
            "points": [(1e6, 1e-4, 2e-4), (1e8, 1e-3, 3e-4)],
        },
        "views": {"dispatch_s": 9.0, "points": [(64, 1e-5, 2e-4), (256, 1e-5, 6e-4)]},
    }
    again = refit(measured)
    assert again["views"]["dispatch_s"] == pytest.approx(4e-4 / 192)  # the slope between the chains
    assert "views" not in refit({k: v for k, v in measured.items() if k != "views"})  # an older profile
    assert again["compute"]["other"]["dispatch_s"] == pytest.approx(1.0e-3 / 20)
    assert again["optimizer"]["dispatch_s"] == pytest.approx(2e-4) and again["compute"]["other"]["points"] == points
    src, dst = tmp_path / "G.json", tmp_path / "G-refit.json"
    src.write_text(json.dumps(measured))
    assert main(["--refit", str(src), "--compute-out", str(dst)]) == 0
    prof = load_compute_profile(str(dst), "cluster.device_types.G.profile", "G")
    assert prof.dispatch_s("other") == pytest.approx(5e-5) and prof.optimizer_dispatch_s == pytest.approx(2e-4)
    src.write_text("{}")
    assert main(["--refit", str(src), "--compute-out", str(dst)]) == 2  # one line, exit 2


def test_a_profiled_cluster_file_reads_back_its_numbers_whatever_their_digits(tmp_path):
    """`1e+11` and `5e-05` are strings to YAML 1.1: a rate or latency that rounded to one
    digit made `bench.profile --cluster-out` write a file that failed to load."""
    import json

    import yaml

    from bench.core.cluster import ClusterSpec
    from bench.profile import cluster_yaml

    fits = {"all_reduce/ring": {"bytes_per_s": 1.25e8, "latency_s": 5e-5}}
    (tmp_path / "p.json").write_text(json.dumps({"fits": fits}))
    text = cluster_yaml("probe", 2, {"linear": {"flops_per_s": 1e11}}, fits, tmp_path / "p.json")
    spec = ClusterSpec.from_config(yaml.safe_load(text))
    assert spec.devices[0].effective_flops == 1e11
    assert spec.inter_machine.latency_s == 5e-5 and spec.inter_machine.bandwidth_gbps == 1.0


def test_calibration_runs_split_in_parts_merge_into_one_summary(tmp_path, capsys):
    import json

    from bench.calibrate import main
    from bench.studies.calibration import summarize

    def row(model, cluster, method, measured, predicted):
        return dict(
            model=model,
            cluster=cluster,
            method=method,
            status="ok",
            iter_time_s_mean=measured,
            predicted_iter_time_s=predicted,
            predicted_compute_s=predicted / 2,
            emulation={"compute_s": measured / 2, "link_overrun_s": 0.001},
        )

    parts = [[row("bert", "c2", "a", 1.0, 1.1), row("bert", "c2", "b", 2.0, 1.9)], [row("vit", "c4", "a", 1.0, 1.3)]]
    whole = summarize([r for part in parts for r in part])
    paths = []
    for i, part in enumerate(parts):
        paths.append(tmp_path / f"part{i}.json")
        paths[-1].write_text(json.dumps(summarize(part)))
    assert main(["--merge", *map(str, paths), "--out", str(tmp_path / "all.json")]) == 0
    merged = json.loads((tmp_path / "all.json").read_text())
    for key in (
        "mape",
        "mape_by_method",
        "mape_by_model",
        "mape_by_cluster",
        "mape_outside_compute",
        "kendall_tau_all",
    ):
        assert merged[key] == pytest.approx(whole[key]), key
    assert "MAPE by cluster: c2 7.5% (2), c4 30.0% (1)" in capsys.readouterr().out
    assert main(["--merge", str(paths[0]), str(paths[0])]) == 2  # a case twice: one line, no summary
    assert capsys.readouterr().err.count("\n") == 1
