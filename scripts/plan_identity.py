"""Whether a change to the planner changes its plans: hap's (or auto's) plans of the paper models,
written to a file, and two such files compared.

What it does: `snapshot` plans each case (`method=hap`, preset=paper, mode=sim, the plan cache
off) as `bench.run` prepares it, in one process, and writes per case the plan as the plan cache
stores it (program, ratios, batch shares, every detail but the timing fields) with the
simulator's predicted time and memory of the row. `compare` says, per case, whether two snapshots
are identical, differ only in the pruning counts (`states_pruned`, `states_beam_pruned`) or, for
auto, in the rows of the candidates it did not choose (`details.auto`'s candidates and pruned
lists: how each was priced, floored or pruned), or differ (exit 1). `--method auto` plans with
auto (its hap part's plan cache off); a model `hf-llama` is the zoo table's Llama 7B shape
(`model=hf model.arch=llama`). Run `snapshot` from each code root to compare (a copy of the older
tree, e.g. `git archive`), with `--root` naming it. What it doesn't do: time anything
(scripts/pace.py).

    cd /tmp/old && python /path/to/scripts/plan_identity.py snapshot before.json --root .
    python scripts/plan_identity.py snapshot after.json
    python scripts/plan_identity.py compare before.json after.json
    python scripts/plan_identity.py snapshot auto.json --method auto --models bert,hf-llama --ks 8
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

MODELS = "vgg19,vit,bert,bert_moe"
CLUSTERS = "paper_hetero,paper_homo"
KS = "1,2,4,8"
# Details that time the planner: they differ from run to run.
TIMING = {"capture_time_s", "theory_time_s", "search_time_s", "lp_time_s", "planned_in_s", "cache"}
# Details that count what the search pruned, and how: a change may move a state from one count
# to another without changing what it expands (docs/planner.md, "Search").
PRUNING = {"states_pruned", "states_beam_pruned"}
# auto's details that say how the candidates it did not choose were priced, floored or pruned.
AUTO_ROWS = {"candidates", "pruned", "num_priced", "num_pruned", "planned_in_s", "part_planning"}
MODEL_OVERRIDES = {"hf-llama": ["model=hf", "model.arch=llama"]}  # the zoo table's Llama 7B shape


def snapshot(out: Path, root: Path, models: list[str], clusters: list[str], ks: list[str], method: str = "hap") -> None:
    sys.path.insert(0, str(root))
    from bench.core.plan_cache import plan_to_json
    from bench.runner.case import new_record, prepare_case
    from bench.runner.configs import compose_settings

    cases = {}
    for model in models:
        for cluster in clusters:
            for k in ks:
                cfg = compose_settings(
                    *MODEL_OVERRIDES.get(model, [f"model={model}"]),
                    "preset=paper",
                    f"cluster={cluster}",
                    f"method={method}",
                    f"cluster.gpus_per_machine={k}",
                    "mode=sim",
                    "wandb.mode=disabled",
                    "logger=none",
                    "method.hap.cache_dir=null" if method == "auto" else "method.cache_dir=null",
                )
                record = new_record(cfg)
                try:
                    case = prepare_case(cfg, record)
                except ValueError as exc:  # ConfigError, PlanningError (an oom refusal): its line is the case's
                    cases[f"{model}/{cluster}/k={k}"] = {"refused": f"{type(exc).__name__}: {exc}"}
                    print(f"{model} {cluster} k={k}: {type(exc).__name__}: {exc}", flush=True)
                    continue
                plan = plan_to_json(case.plan)
                plan["details"] = {key: v for key, v in plan["details"].items() if key not in TIMING}
                if "auto" in plan["details"]:
                    chosen = plan["details"]["auto"]["chosen_as"]
                    print(f"{model} {cluster} k={k}: auto chose {chosen}", flush=True)
                plan["predicted_iter_time_s"] = record.predicted_iter_time_s
                plan["predicted_peak_mem_gib"] = record.predicted_peak_mem_gib
                cases[f"{model}/{cluster}/k={k}"] = json.loads(json.dumps(plan, default=str))
                print(f"{model} {cluster} k={k}: {record.predicted_iter_time_s!r} s/iter", flush=True)
    out.write_text(json.dumps(cases, sort_keys=True))


def compare(a: dict, b: dict) -> int:
    """Cases that differ beyond the pruning counts (each case's verdict printed)."""
    bad = 0
    for case in sorted(set(a) | set(b)):
        if case not in a or case not in b:
            print(f"{case}: in one snapshot only")
            bad += 1
            continue
        x, y = a[case], b[case]
        diffs = [k for k in sorted(set(x) | set(y)) if k != "details" and x.get(k) != y.get(k)]
        dx, dy = x.get("details", {}), y.get("details", {})
        diffs += [f"details.{k}" for k in sorted(set(dx) | set(dy)) if k != "auto" and dx.get(k) != dy.get(k)]
        ax, ay = dx.get("auto", {}), dy.get("auto", {})
        diffs += [f"details.auto.{k}" for k in sorted(set(ax) | set(ay)) if ax.get(k) != ay.get(k)]
        soft = PRUNING | {f"auto.{k}" for k in AUTO_ROWS}
        hard = [d for d in diffs if d.removeprefix("details.") not in soft]
        if not diffs:
            verdict = "identical"
        elif not hard:
            verdict = "pruning counts or auto's other rows differ only: " + ", ".join(diffs)
        else:
            verdict = "DIFFER: " + ", ".join(diffs)
        print(f"{case}: {verdict}")
        bad += bool(hard)
    print(f"{len(set(a) & set(b))} cases compared, {bad} differ beyond the pruning counts and auto's other rows")
    return 1 if bad else 0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = ap.add_subparsers(dest="command", required=True)
    snap = sub.add_parser("snapshot", help="plan every case and write the plans")
    snap.add_argument("out", type=Path)
    snap.add_argument("--root", type=Path, default=Path(__file__).resolve().parents[1], help="the code to plan with")
    snap.add_argument("--models", default=MODELS)
    snap.add_argument("--clusters", default=CLUSTERS)
    snap.add_argument("--ks", default=KS, help="GPUs per machine (cluster.gpus_per_machine)")
    snap.add_argument("--method", default="hap", choices=("hap", "auto"))
    comp = sub.add_parser("compare", help="compare two snapshots")
    comp.add_argument("before", type=Path)
    comp.add_argument("after", type=Path)
    args = ap.parse_args(argv)
    if args.command == "snapshot":
        split = lambda s: s.split(",")  # noqa: E731
        snapshot(args.out, args.root.resolve(), split(args.models), split(args.clusters), split(args.ks), args.method)
        return 0
    return compare(json.loads(args.before.read_text()), json.loads(args.after.read_text()))


if __name__ == "__main__":
    sys.exit(main())
