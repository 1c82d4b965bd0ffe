"""CI's throughput regression check: today's figures against results/baselines/regression.json.

Fails with the table (figure, baseline, new, change, rounds past, baseline commit) when a figure
got worse than its tolerance. Re-baselining is deliberate: `python -m bench.regress --rebaseline`,
then commit.
"""

import json
import random
import statistics
import sys
from types import SimpleNamespace

import pytest

from bench import regress as regress_cmd
from bench.runtime.emulation import pooled_compute_s
from bench.studies import regression as regress

pytestmark = pytest.mark.e2e


def _report(changes, commit) -> str:
    return regress.render(regress.report_table(changes, commit))


def _kind(figures: dict[str, float], measured: bool) -> dict[str, float]:
    return {k: v for k, v in figures.items() if k.startswith("iter_over_compute:") == measured}


def test_no_simulated_regression_against_the_committed_baseline():
    """The deterministic figures and the planner's time in yardsticks of this process's own
    speed (which cancel a host shared with other tests, docs/regression.md)."""
    base = regress.load_baseline()
    expected = _kind(base["figures"], measured=False)
    figures = regress.sim_figures(methods=regress.baseline_sim_methods(base), timed=expected)
    rounds = regress.planner_retries(expected, figures)
    changes = regress.compare(expected, figures, rounds)
    bad = [c for c in changes if c.regressed]
    assert not bad, "simulated regression:\n" + _report(changes, base.get("git_sha"))


# Every real-capable method in interleaved rounds, alone on the host (docs/regression.md).
@pytest.mark.timeout(600)
@pytest.mark.alone
def test_no_measured_throughput_regression_against_the_committed_baseline():
    base = regress.load_baseline()
    rounds = regress.measured_rounds(methods=regress.baseline_real_methods(base), baseline=base["figures"])
    changes = regress.compare(_kind(base["figures"], measured=True), regress.medians(rounds), rounds)
    bad = [c for c in changes if c.regressed]
    assert not bad, "throughput regression:\n" + _report(changes, base.get("git_sha"))


def test_the_check_flags_a_worse_plan_and_a_lost_case():
    base = {"sim_iter_time_s:a": 1.0, "sim_iter_time_s:b": 1.0, "iter_over_compute:c": 3.0, "iter_over_compute:d": 3.0}
    new = {"sim_iter_time_s:a": 1.02, "iter_over_compute:c": 3.2, "iter_over_compute:d": 3.6}
    verdict = {c.figure: c.regressed for c in regress.compare(base, new)}
    assert verdict == {
        "sim_iter_time_s:a": True,
        "sim_iter_time_s:b": True,
        "iter_over_compute:c": False,
        "iter_over_compute:d": True,
    }
    assert "REGRESSION" in _report(regress.compare(base, new), "abc")


def test_a_planner_figure_past_its_tolerance_is_planned_again_and_regresses_only_if_it_stays(monkeypatch):
    base = {
        "planner_time_rel:vgg19/paper_hetero/sfb": 16.0,
        "planner_time_rel:vit/paper_hetero/hap": 50.0,
        "planner_time_rel:bert/paper_hetero/hap": 50.0,
    }
    new = {
        "planner_time_rel:vgg19/paper_hetero/sfb": 70.0,  # a moment: the retries read as usual
        "planner_time_rel:vit/paper_hetero/hap": 160.0,  # slower every time
        "planner_time_rel:bert/paper_hetero/hap": 60.0,
    }  # within tolerance: not planned again
    again = {"vgg19": 17.0, "vit": 170.0}
    planned = []

    def sim_figures(models, methods):
        planned.append((models[0], methods[0]))
        return {f"planner_time_rel:{models[0]}/paper_hetero/{methods[0]}": again[models[0]]}

    monkeypatch.setattr(regress, "sim_figures", sim_figures)
    rounds = regress.planner_retries(base, new)
    assert sorted(planned) == [("vgg19", "sfb")] * 2 + [("vit", "hap")] * 2
    assert rounds == {
        "planner_time_rel:vgg19/paper_hetero/sfb": [70.0, 17.0, 17.0],
        "planner_time_rel:vit/paper_hetero/hap": [160.0, 170.0, 170.0],
    }
    verdict = {c.figure.split("/")[0]: (c.regressed, c.past) for c in regress.compare(base, new, rounds)}
    assert verdict == {
        "planner_time_rel:vgg19": (False, (1, 3)),
        "planner_time_rel:vit": (True, (3, 3)),
        "planner_time_rel:bert": (False, None),
    }


def test_a_measured_figure_regresses_when_every_round_is_past_its_tolerance():
    """A sign test, not the median: on an unsteady host single rounds of the same code spread
    far enough to fail a median of five, while a slower worker loop lifts every round
    (docs/regression.md, "The figures")."""
    base = {"iter_over_compute:noisy": 1.5, "iter_over_compute:slower": 1.5, "iter_over_compute:faster": 1.5}
    rounds = {
        "iter_over_compute:noisy": [1.29, 1.78, 1.36, 1.75, 1.72],  # median +14.7%, 3 of 5 past
        "iter_over_compute:slower": [1.70, 1.68, 1.72, 1.66, 1.69],  # every round +10.7% or more
        "iter_over_compute:faster": [1.2, 1.3, 1.3, 1.2, 1.3],
    }
    changes = {c.figure: c for c in regress.compare(base, regress.medians(rounds), rounds)}
    assert changes["iter_over_compute:noisy"].change > regress.TOLERANCE["iter_over_compute"][1]
    assert [(c.past, c.regressed) for c in changes.values()] == [((0, 5), False), ((3, 5), False), ((5, 5), True)]
    table = _report(list(changes.values()), "abc")
    assert "3/5" in table and "5/5" in table and table.count("REGRESSION") == 1


def _body(name: str) -> dict:
    return json.loads((regress.BASELINE_FILE.parent / name).read_text())


def _rounds(name: str) -> dict[str, list[float]]:
    """Each method's rounds of iter_over_compute in a committed file of measured rounds, by figure."""
    body = _body(name)
    out: dict[str, list[float]] = {}
    for row in (r for session in body["sessions"] for r in session):
        # one file keeps each rank's reference per interval, the other summed
        pooled = pooled_compute_s(
            {
                "ranks": [
                    {
                        "reference_s_per_iter": sum(r["reference_s"])
                        if isinstance(r["reference_s"], list)
                        else r["reference_s"],
                        "speed": r["speed"],
                    }
                    for r in row["ranks"]
                ]
            }
        )
        out.setdefault(f"iter_over_compute:bert-tiny/local_hetero2/{row['method']}", []).append(row["iter_s"] / pooled)
    return out


def _failure_rate(
    rounds: dict[str, list[float]], slowdown: float, rule, base: dict | None = None, draws: int = 4000
) -> float:
    """How often a check of REAL_ROUNDS rounds drawn from these (stretched by `slowdown`) fails,
    against `base` (by default each figure's median of them)."""
    rng = random.Random(0)
    base = base or regress.medians(rounds)
    fails = 0
    for _ in range(draws):
        drawn = {m: [x * (1 + slowdown) for x in rng.choices(v, k=regress.REAL_ROUNDS)] for m, v in rounds.items()}
        fails += any(c.regressed for c in rule(base, drawn))
    return fails / draws


def _every_round(base, drawn):
    return regress.compare(base, regress.medians(drawn), drawn)


def _median(base, drawn):
    return regress.compare(base, regress.medians(drawn))


def test_every_round_past_holds_on_an_unsteady_day_and_catches_a_slowdown_on_a_steady_one():
    """The committed rounds behind the rule: the day CI failed sfb's median (16 rounds a method,
    the workers 2-2.7x slower and uneven), against that day's baseline; and steady sessions."""
    unsteady = _rounds("20261126-unsteady-rounds.json")
    baseline = _body("20261126-unsteady-rounds.json")["baseline"]
    assert _failure_rate(unsteady, 0.0, _median, baseline) > 0.05
    assert _failure_rate(unsteady, 0.0, _every_round, baseline) < 0.01
    steady = _rounds("20261126-normaliser-rounds.json")
    assert _failure_rate(steady, 0.0, _every_round) == 0
    assert _failure_rate(steady, 0.20, _every_round) == 1


def test_the_rounds_stop_once_every_verdict_is_settled_and_stay_interleaved_until_then(monkeypatch):
    """Against a baseline, the check stops after the first round in which every method has had
    a round within tolerance (no verdict can change then); until then every method runs each
    round, so a figure past its tolerance is judged over interleaved rounds as before. A method
    that fails stops with no figure. The verdicts equal those of every round run."""
    runs: list[str] = []
    values: dict[str, list] = {}

    class Runner:
        def __init__(self, cfg):
            self.method, self.done = cfg, 0

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            return False

        def run(self):
            runs.append(self.method)
            value = values[self.method][self.done]
            self.done += 1
            return SimpleNamespace(status="failed" if value is None else "ok", iter_time_s_mean=value, emulation=1.0)

    monkeypatch.setattr(regress, "_compose", lambda *overrides: overrides[-3].partition("=")[2])
    monkeypatch.setattr(regress, "expect_cases", lambda configs: None)
    monkeypatch.setattr(regress, "CaseRunner", Runner)
    monkeypatch.setattr(regress, "pooled_compute_s", lambda emulation: emulation)
    key = "iter_over_compute:bert-tiny/local_hetero2/{}".format

    def verdicts(base, rounds):
        return {c.figure: c.regressed for c in regress.compare(base, regress.medians(rounds), rounds)}

    # every method within 10% in round 1: one round each
    values.update(a=[1.05, 1.3, 1.3, 1.3], b=[0.9, 1.3, 1.3, 1.3])
    base = {key(m): 1.0 for m in values}
    early = regress.measured_rounds(methods=list(values), baseline=base)
    assert early == {key("a"): [1.05], key("b"): [0.9]} and runs == ["a", "b"]
    # one past in every round, one within only in round 3, one failing in round 2: every round
    # interleaved, as without a baseline
    values.clear()
    values.update(ok=[1.05, 1.3, 1.3, 1.3], late=[1.2, 1.2, 1.05, 1.3], slow=[1.2] * 4, dies=[1.2, None, 1.0, 1.0])
    base = {key(m): 1.0 for m in values}
    runs.clear()
    every = regress.measured_rounds(methods=list(values))
    assert every == {key(m): v for m, v in values.items() if m != "dies"}
    assert runs[:8] == ["ok", "late", "slow", "dies"] * 2 and len(runs) == 14
    runs.clear()
    judged = regress.measured_rounds(methods=list(values), baseline=base)
    assert judged == every and len(runs) == 14
    assert (
        verdicts(base, judged)
        == verdicts(base, every)
        == {key("ok"): False, key("late"): False, key("slow"): True, key("dies"): True}
    )
    # the slow one within in round 2: the rounds stop after round 3, the late one's first within
    values["slow"] = [1.2, 1.0, 1.2, 1.2]
    runs.clear()
    judged = regress.measured_rounds(methods=list(values), baseline=base)
    assert judged[key("slow")] == [1.2, 1.0, 1.2] and key("dies") not in judged
    assert runs == ["ok", "late", "slow", "dies", "ok", "late", "slow", "dies", "ok", "late", "slow"]


def test_a_rebaseline_over_sessions_keeps_each_figure_median_and_every_session(monkeypatch, tmp_path):
    values = iter(
        [
            {"iter_over_compute:a": 1.2, "iter_over_compute:b": 2.0},
            {"iter_over_compute:a": 1.4, "iter_over_compute:b": 2.2},
            {"iter_over_compute:a": 1.3},
        ]
    )  # a figure one session lost is not kept
    monkeypatch.setattr(regress, "measured_figures", lambda slowdown=0.0: next(values))
    figures, sessions = regress.measured_sessions(3)
    assert figures == {"iter_over_compute:a": 1.3} and len(sessions) == 3
    regress.write_baseline(figures, tmp_path / "b.json", sessions=sessions, note="why")
    body = regress.load_baseline(tmp_path / "b.json")
    assert body["figures"] == figures and body["measured_sessions"] == sessions and body["note"] == "why"


def _slow_python(frame, event, arg):  # a line tracer: every line of Python costs 5-6x more
    sum(range(10))
    return _slow_python


@pytest.mark.alone
def test_the_planner_figure_cancels_how_fast_this_host_runs_python(monkeypatch):
    """On a host slower at Python the planner's seconds grow past their tolerance; its time over
    the yardstick timed beside it, for as long, does not.

    Three plain and three slowed plans, interleaved, judged by their medians, as a baseline is
    made: the plain plan takes 0.1 s, so its yardstick's window is as short, and a host that
    takes the core from this process for a moment reads one pair many times off
    (docs/regression.md, "The figures")."""
    key = "planner_time_rel:vgg19/paper_hetero/sfb"
    sticks, windows = [], []
    slowed = False

    def traced(run):  # the plan and its yardstick on the slowed host (the config's composition not)
        def call(*args, **kwargs):
            if not slowed:
                return run(*args, **kwargs)
            sys.settrace(_slow_python)
            try:
                return run(*args, **kwargs)
            finally:
                sys.settrace(None)

        return call

    yardstick, prepare = traced(regress.python_yardstick_s), traced(regress.prepare_case)

    def timed(at_least_s):
        windows.append(at_least_s)
        sticks.append(yardstick(at_least_s))
        return sticks[-1]

    monkeypatch.setattr(regress, "python_yardstick_s", timed)
    monkeypatch.setattr(regress, "prepare_case", prepare)
    plain, slow = [], []
    for _ in range(3):
        for flag, out in ((False, plain), (True, slow)):
            slowed = flag
            out.append(regress.sim_figures(["vgg19"], ["sfb"]))
    _, tol = regress.TOLERANCE["planner_time_rel"]
    figures = [f[key] for pair in zip(plain, slow) for f in pair]  # in the order they were timed
    assert windows == pytest.approx([f * s for f, s in zip(figures, sticks)])  # timed for as long as it planned
    seconds = [statistics.median(windows[0::2]), statistics.median(windows[1::2])]
    assert seconds[1] > seconds[0] * (1 + tol)  # in seconds it would be a regression
    rel = [statistics.median(f[key] for f in plain), statistics.median(f[key] for f in slow)]
    assert rel[1] < rel[0] * (1 + tol)  # in yardsticks it is not
    expanded = key.replace("planner_time_rel", "states_expanded")
    assert {f[expanded] for f in plain + slow} == {plain[0][expanded]}


def test_a_rebaseline_of_the_sim_figures_keeps_the_measured_ones_and_where_they_were_measured(monkeypatch, tmp_path):
    monkeypatch.setattr(regress, "BASELINE_FILE", tmp_path / "regression.json")
    regress.write_baseline(
        {"sim_iter_time_s:a": 1.0, "iter_over_compute:b": 1.3}, sessions=[{"iter_over_compute:b": 1.3}], note="measured"
    )
    first = regress.load_baseline()
    monkeypatch.setattr(
        regress, "sim_figures", lambda models, methods: {"sim_iter_time_s:a": 0.9, "planner_time_rel:a": 12.0}
    )
    monkeypatch.setattr(regress, "measured_figures", lambda *a, **k: pytest.fail("nothing is measured"))
    for note in ("sim only", "again"):
        assert regress_cmd.main(["--rebaseline", "--no-measured", "--note", note]) == 0
        body = regress.load_baseline()
        assert body["figures"] == {"sim_iter_time_s:a": 0.9, "planner_time_rel:a": 12.0, "iter_over_compute:b": 1.3}
        assert body["measured_sessions"] == first["measured_sessions"] and body["note"] == note
        # where the measured figures come from: the first baseline's commit, not the rebaseline's
        assert body["measured_from"] == {"git_sha": first["git_sha"], "created": first["created"]}


def test_a_rebaseline_over_sessions_keeps_the_planner_figure_median_of_as_many_plans(monkeypatch, tmp_path):
    """The planner's figure moves from plan to plan (11-22% here); a baseline of one plan carried
    that plan's luck into every check (one failed ViT's sfb at 3.3x it)."""
    monkeypatch.setattr(regress, "BASELINE_FILE", tmp_path / "regression.json")
    regress.write_baseline({"iter_over_compute:b": 1.3})
    plans = iter([{"sim_iter_time_s:a": 0.9, "planner_time_rel:a": rel} for rel in (12.0, 30.0, 14.0)])
    monkeypatch.setattr(regress, "sim_figures", lambda models, methods: next(plans))
    assert regress_cmd.main(["--rebaseline", "--no-measured", "--sessions", "3"]) == 0
    assert regress.load_baseline()["figures"] == {
        "sim_iter_time_s:a": 0.9,
        "planner_time_rel:a": 14.0,
        "iter_over_compute:b": 1.3,
    }
    assert next(plans, None) is None  # planned three times
    # A check plans once; more sessions than one is a rebaseline's option only.
    assert regress_cmd.main(["--sessions", "3"]) == 2


def test_a_check_exits_1_on_a_figure_past_its_tolerance_and_0_within(monkeypatch, tmp_path, capsys):
    monkeypatch.setattr(regress, "BASELINE_FILE", tmp_path / "regression.json")
    regress.write_baseline({"sim_iter_time_s:bert-paper/paper_hetero/hap": 1.0})
    monkeypatch.setattr(regress, "measured_rounds", lambda *a, **k: pytest.fail("nothing is measured"))
    for value, code in ((1.0, 0), (1.5, 1)):
        monkeypatch.setattr(
            regress, "sim_figures", lambda models, methods, v=value: {"sim_iter_time_s:bert-paper/paper_hetero/hap": v}
        )
        assert regress_cmd.main(["--no-measured"]) == code
    assert "1 figures, 1 regressions" in capsys.readouterr().out


def test_a_bad_subset_is_one_line_and_exit_2_before_any_figure(monkeypatch, capsys):
    monkeypatch.setattr(regress, "sim_figures", lambda *a, **k: pytest.fail("nothing is planned"))
    assert regress_cmd.main(["cluster=local_hetero2"]) == 2
    assert regress_cmd.main(["--rebaseline", "model=bert"]) == 2
    assert regress_cmd.main(["method=nosuch"]) == 2
    assert len(capsys.readouterr().err.strip().splitlines()) == 3
