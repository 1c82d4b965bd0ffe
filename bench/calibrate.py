"""How far to trust the simulator: measured vs predicted iteration time on emulated clusters.

    python -m bench.calibrate                                    # 4 tiny models x methods x 3 clusters
    python -m bench.calibrate model=bert cluster=local_hetero2 method=dp_ev,hap measured_iters=10
    python -m bench.calibrate cluster=local_hetero2,local_hetero4 repeats=3   # medians and intervals
    python -m bench.calibrate --device cuda --device-type H100-80 --profile results/profiles/H100-80.json
    python -m bench.calibrate --reprice results/calibration/FILE.json              # no GPU needed
    python -m bench.calibrate --rows results/runs method=pipeline,fsdp   # summarise rows recorded
                                                                          # by earlier runs

With --device, one device instead: each paper model's training step (forward, backward, Adam)
at batch 1 to 128, measured on that device and predicted by the simulator from the device
type's compute profile (made by `bench.profile --compute-out` from op microbenchmarks, not
fitted to these steps), time and peak memory.

Every real case also records the simulator's prediction for the same plan, so one real run per
case gives both numbers. Reports each case's error, the MAPE (overall and per method) and, per
(model, cluster), Kendall's tau between the measured and the predicted ordering of the methods:
over the pairs the measurement separates (the per-iteration intervals of their medians do not
overlap: with repeats=N, each (model, cluster) runs as bench.compare does, N interleaved rounds
over the methods, and a case's number is its median; one run per case separates nothing) and
over all pairs.
"""

from __future__ import annotations

import argparse
import json
import sys
from datetime import UTC, datetime
from pathlib import Path

import torch

from bench.core.errors import ConfigError
from bench.core.paths import PROJECT_DIR
from bench.records.progress import track
from bench.records.rows import fingerprint
from bench.runner.case import check_profile_precision
from bench.runner.configs import check_group_choices, command_argv, compose_settings, methods_supporting
from bench.runner.execute import expect_cases, run_case
from bench.runner.rounds import run_rounds
from bench.runtime.precision import PRECISIONS
from bench.runtime.worker import rank_hardware
from bench.studies.calibration import (
    CLUSTERS,
    MODELS,
    merged_rows,
    print_single_device,
    print_summary,
    recorded_rows,
    repriced_rows,
    single_device_cluster,
    single_device_rows,
    summarize,
)


def build_parser() -> argparse.ArgumentParser:
    """The command's flags: --merge, --reprice, --device and --rows pick a mode, else emulated cases run."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default=",".join(MODELS), help="with --device: the models to step")
    parser.add_argument("--out", type=Path, default=None, help="summary JSON (default results/calibration/)")
    parser.add_argument("--device", default=None, help="cpu or cuda[:i]: calibrate one device's steps instead")
    parser.add_argument("--device-type", default=None, help="with --device: the conf/device type it is")
    parser.add_argument(
        "--profile",
        default=None,
        help="with --device: that type's compute profile (bench.profile "
        "--compute-out); with --reprice: price with this profile instead of the file's",
    )
    parser.add_argument("--batches", default="1,2,4,8,16,32,64,128", help="with --device: batch sizes")
    parser.add_argument(
        "--precision",
        default="fp32",
        choices=PRECISIONS,
        help="with --device: what the steps run at (fp32: TF32 off; tf32; bf16: autocast); the "
        "profile must have been measured at the same",
    )
    parser.add_argument("--preset", default="paper", help="with --device: model sizes")
    parser.add_argument(
        "--reprice",
        type=Path,
        default=None,
        help="an earlier --device calibration file: its measured steps against today's cost model",
    )
    parser.add_argument(
        "--rows",
        type=Path,
        nargs="+",
        default=None,
        help="records files (or results dirs) of earlier real runs: summarise their rows (the last "
        "aggregate per model, cluster and method, e.g. bench.compare's) instead of running; "
        "model=, cluster= and method= pick among them",
    )
    parser.add_argument(
        "--merge",
        type=Path,
        nargs="+",
        default=None,
        help="calibration files of emulated cases (runs split to keep each short): one summary over all their cases",
    )
    parser.add_argument(
        "overrides",
        nargs="*",
        help="runner overrides, e.g. measured_iters=10; model=, cluster= and method= take "
        f"comma lists (default: model={','.join(MODELS)} cluster={','.join(CLUSTERS)} "
        "method=every method that runs for real), as in compare and -m sweeps",
    )
    return parser


def main(argv: list[str]) -> int:
    parser = build_parser()
    argv = command_argv(argv)
    if argv is None:
        return 2
    args = parser.parse_args(argv)
    if args.merge is not None:
        return merge_files(args)
    if args.reprice is not None:
        return reprice(args)
    if args.rows:  # nargs="+" also takes the overrides after the paths (--rows DIR method=a,b)
        args.overrides += [str(p) for p in args.rows if "=" in str(p) and not p.exists()]
        args.rows = [p for p in args.rows if str(p) not in args.overrides]
    if args.device is not None:
        if not (args.device_type and args.profile):
            parser.error("--device needs --device-type NAME and --profile PATH (python -m bench.profile --compute-out)")
        return calibrate_device(args)
    return calibrate_emulated(args)


def merge_files(args: argparse.Namespace) -> int:
    """--merge: one summary over the emulated cases of several calibration files."""
    try:
        rows = merged_rows([json.loads(path.read_text()) for path in args.merge])
    except (OSError, ValueError, KeyError, TypeError) as exc:
        print(f"error: --merge: {exc!r}; give files written by bench.calibrate (emulated cases)", file=sys.stderr)
        return 2
    summary = {
        **summarize(rows),
        "merged": [str(p) for p in args.merge],
        "written_at": datetime.now(UTC).isoformat(timespec="seconds"),
    }
    print_summary(summary)
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(summary, indent=1) + "\n")
        print(f"wrote {args.out}")
    return 0


def reprice(args: argparse.Namespace) -> int:
    """--reprice: the steps an earlier --device calibration measured, priced by today's cost model."""
    try:
        earlier = json.loads(args.reprice.read_text())
        cluster = single_device_cluster(earlier["device_type"], args.profile or earlier["profile"])
        precision = earlier.get("precision", "fp32")  # files before it was recorded ran at fp32's switches
        check_profile_precision(cluster, precision)
    except (OSError, ValueError, KeyError, ConfigError) as exc:
        print(
            f"error: --reprice={args.reprice}: {exc}; give a file written by bench.calibrate --device",
            file=sys.stderr,
        )
        return 2
    print_single_device(
        repriced_rows(earlier["rows"], cluster, args.preset, precision),
        f"{earlier['device_type']}: the steps measured in {args.reprice.name}, priced today"
        + (f" with {args.profile}" if args.profile else ""),
    )
    return 0


def calibrate_device(args: argparse.Namespace) -> int:
    """--device: each model's training step on one device, measured and predicted from its profile."""
    try:
        cluster = single_device_cluster(args.device_type, args.profile)
        check_profile_precision(cluster, args.precision)
    except ConfigError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    out = args.out or (
        PROJECT_DIR / "results" / "calibration" / f"{datetime.now(UTC):%Y%m%d-%H%M%S}-{args.device_type}.json"
    )
    out.parent.mkdir(parents=True, exist_ok=True)
    about = {
        "device_type": args.device_type,
        "profile": args.profile,
        "precision": args.precision,
        "hardware": rank_hardware(torch.device(args.device)),
        **fingerprint(),
    }

    def write(rows: list[dict], summary: dict | None = None) -> None:
        # after every step, so a run cut short leaves what it measured (--reprice reads it)
        out.write_text(
            json.dumps(
                {
                    **(summary or {"partial": True}),
                    **about,
                    "rows": rows,
                    "written_at": datetime.now(UTC).isoformat(timespec="seconds"),
                },
                indent=1,
            )
            + "\n"
        )

    rows = single_device_rows(
        args.models.split(","),
        [int(b) for b in args.batches.split(",")],
        args.device,
        cluster,
        args.preset,
        on_row=write,
        precision=args.precision,
    )
    write(rows, print_single_device(rows, f"{args.device_type} on {args.device}: one training step"))
    print(f"wrote {out}")
    return 0


def calibrate_emulated(args: argparse.Namespace) -> int:
    """Emulated cases (or, with --rows, the rows earlier runs recorded): errors, MAPE, Kendall's tau."""
    lists = {"model": list(MODELS), "cluster": list(CLUSTERS), "method": methods_supporting("real")}
    rest = []
    for item in args.overrides:
        key, sep, value = item.partition("=")
        if sep and key in lists:
            lists[key] = value.split(",")
        else:
            rest.append(item)
    try:
        check_group_choices([f"{k}={','.join(v)}" for k, v in lists.items()])
    except ConfigError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    rows = rows_recorded(args) if args.rows is not None else run_emulated_cases(lists, rest)
    if rows is None:
        return 2
    summary = {**summarize(rows), "written_at": datetime.now(UTC).isoformat(timespec="seconds")}
    print_summary(summary)
    out = args.out or (PROJECT_DIR / "results" / "calibration" / f"{datetime.now(UTC):%Y%m%d-%H%M%S}.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(summary, indent=1) + "\n")
    print(f"wrote {out}")
    return 0 if not summary["failed"] else 1


def rows_recorded(args: argparse.Namespace) -> list[dict] | None:
    """--rows: a calibration split over earlier runs, from what they recorded (None: nothing there)."""
    chosen = {k.partition("=")[0]: k.partition("=")[2].split(",") for k in args.overrides if "=" in k}
    rows = recorded_rows(args.rows, chosen.get("model"), chosen.get("cluster"), chosen.get("method"))
    if not rows:
        print(
            f"error: --rows {' '.join(map(str, args.rows))}: no real rows there (of the chosen models, "
            "clusters and methods); give records of bench.run, bench.compare or bench.calibrate",
            file=sys.stderr,
        )
        return None
    return rows


def run_emulated_cases(lists: dict[str, list[str]], rest: list[str]) -> list[dict] | None:
    """Every (model, cluster, method) of `lists` run for real (None: a case's config is bad); with
    repeats=N, per (model, cluster), N interleaved rounds over the methods as bench.compare runs them."""
    try:
        configs = [
            compose_settings("wandb.mode=disabled", *rest, f"model={m}", f"cluster={c}", f"method={meth}")
            for m in lists["model"]
            for c in lists["cluster"]
            for meth in lists["method"]
        ]
    except ConfigError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return None
    expect_cases(configs)
    repeats = configs[0].repeats
    if repeats == 1:
        return [vars(run_case(c)) for c in track(configs, "calibration cases")]
    rows = []
    for i in range(0, len(configs), len(lists["method"])):
        group = {c.method_name: c for c in configs[i : i + len(lists["method"])]}
        rows += [vars(r) for r in run_rounds(group, repeats)]
    return rows


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
