"""Profile this host: FLOP/s per op class on one worker thread, alpha-beta per collective kind.

    python -m bench.profile                       # 2 ranks; results/profiles/<host>.json
    python -m bench.profile --ranks 4 --cluster-out conf/cluster/profiled_local.yaml
    python -m bench.profile --device cuda --device-type H100-80 --compute-out results/profiles/H100-80.json
    python -m bench.profile --device cuda --device-type H200 --precision bf16 --compute-out PATH

With --compute-out it profiles one device's compute only (op microbenchmarks over batch sizes:
per op class a fixed cost per kernel and a FLOP/s rate, and the Adam step's rate over the
parameter bytes), the file a device type's `profile:` names (bench.core.device_types.ComputeProfile),
at one precision (--precision, default fp32 with TF32 off, as a run's default), which the file
records with the TF32 switches; a case at another precision refuses it.

Collectives are real gloo (or NCCL) calls between local worker processes, from 4 KB to 64 MB,
with even and skewed shards, padded and grouped all-gather / reduce-scatter. Each kind is fitted
as t = alpha + bytes_on_link / bandwidth (bench.cost's ring factors). It measures; it does not
change any cluster file unless asked to write one.
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import time
from pathlib import Path

import torch

from bench.core.paths import PROJECT_DIR
from bench.cost.profiles import fit_alpha_beta, refit
from bench.runtime.precision import PRECISIONS
from bench.runtime.probes import SIZES, SKEW_SHARES, profile_collectives, profile_compute, profile_device

PROFILE_DIR = PROJECT_DIR / "results" / "profiles"


def cluster_yaml(name: str, n: int, compute: dict, fits: dict, profile_path: Path) -> str:
    """A cluster file describing this host as one machine of n worker devices; its links read
    every collective kind's fit from the profile file, all-reduce's numbers are the default."""
    ar = fits["all_reduce/ring"]
    gbps = ar["bytes_per_s"] * 8 / 1e9
    profile = _repo_relative(profile_path)
    return (
        f"# Profiled by `python -m bench.profile` on {platform.node()} "
        f"({time.strftime('%Y-%m-%d')}): one machine of {n} worker processes.\n"
        f"# effective_flops: linear forward+backward on one thread; links: each collective kind's\n"
        f"# fit from the profile file (the all-reduce's numbers for kinds it did not measure).\n"
        f"name: {name}\nemulated: true\nvirtual_device: gpu\nmachines:\n"
        f"  - {{count: 1, device: cpu, num_devices: {n}, "
        f"effective_flops: {_yaml_float(compute['linear']['flops_per_s'])}}}\n"
        f"links:\n"
        f"  intra_machine: {{bandwidth_gbps: {_yaml_float(gbps)}, latency_s: {_yaml_float(ar['latency_s'])}, profile: {profile}}}\n"
        f"  inter_machine: {{bandwidth_gbps: {_yaml_float(gbps)}, latency_s: {_yaml_float(ar['latency_s'])}, profile: {profile}}}\n"
    )


def _yaml_float(x: float) -> str:
    """x to 4 significant digits in a form every YAML loader reads as a number: YAML 1.1
    (PyYAML) takes `1e+11` and `5e-05` for strings, so the mantissa always has a point (a
    host whose linear rate came out at 1.000e11 wrote a cluster file its own loader refused)."""
    return f"{x:.3e}"


def _repo_relative(path: Path) -> str:
    """`path` relative to the project (the checkout; installed: the working directory) when
    inside it: cluster files resolve relative profile paths from there."""
    try:
        return str(path.resolve().relative_to(PROJECT_DIR.resolve()))
    except ValueError:
        return str(path.resolve())


def build_parser() -> argparse.ArgumentParser:
    """The command's flags: --refit or --compute-out pick a mode, else this host's collectives."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", type=int, default=2, help="worker processes for collectives")
    parser.add_argument("--max-mb", type=float, default=64, help="largest collective (MB)")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--out", type=Path, default=None, help="JSON output (default results/profiles/<host>.json)")
    parser.add_argument("--cluster-out", type=Path, default=None, help="also write a cluster yaml here")
    parser.add_argument(
        "--compute-out",
        type=Path,
        default=None,
        help="only profile compute of one device type and write it here (a device type's `profile`)",
    )
    parser.add_argument(
        "--device-type", default=None, help="the conf/device type the profile describes (with --compute-out)"
    )
    parser.add_argument("--device", default="cpu", help="cpu (one worker thread) or cuda[:i] (with --compute-out)")
    parser.add_argument(
        "--precision",
        default="fp32",
        choices=PRECISIONS,
        help="with --compute-out: what the kernels run at (fp32: TF32 off; tf32; bf16: autocast)",
    )
    parser.add_argument(
        "--refit",
        type=Path,
        default=None,
        help="a compute profile: fit its stored points again and write it to --compute-out (no device)",
    )
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.refit is not None:
        if args.compute_out is None:
            parser.error("--refit needs --compute-out PATH (where the refitted profile goes)")
        return refit_profile(args)
    if args.compute_out is not None:
        if not args.device_type:
            parser.error("--compute-out needs --device-type NAME (the conf/device type it describes, e.g. H100-80)")
        if args.device != "cpu" and not torch.cuda.is_available():
            parser.error(f"--device={args.device} but torch sees no CUDA device; use --device cpu")
        return profile_one_device(args)
    if args.ranks < 2:
        parser.error(f"--ranks={args.ranks} must be >= 2 (collectives need two processes)")
    return profile_host(args)


def refit_profile(args: argparse.Namespace) -> int:
    """--refit: a compute profile's stored points fitted again, written to --compute-out (no device)."""
    try:
        prof = refit(json.loads(args.refit.read_text()))
    except (OSError, ValueError, KeyError, TypeError) as exc:
        print(
            f"error: --refit={args.refit}: {exc!r}; give a file written by bench.profile --compute-out",
            file=sys.stderr,
        )
        return 2
    args.compute_out.write_text(json.dumps(prof, indent=1) + "\n")
    print(f"wrote {args.compute_out}")
    return 0


def profile_one_device(args: argparse.Namespace) -> int:
    """--compute-out: one device's compute profile (op classes, Adam, views) at one precision."""
    prof = profile_device(args.device, args.device_type, args.repeats, args.precision)
    host = "dispatch_s" in prof["optimizer"]
    p = prof["precision"]
    print(
        f"{'op class':10} {'us/kernel':>10} {'GFLOP/s':>10}"
        + (f" {'host us/kernel':>15}" if host else "")
        + f"   ({prof['device']}; precision {p['precision']}, autocast {p['autocast_dtype']}, TF32 matmul "
        f"{p['matmul_allow_tf32']}, cuDNN {p['cudnn_allow_tf32']})"
    )
    for cls, c in prof["compute"].items():
        print(
            f"{cls:10} {c['fixed_s'] * 1e6:10.2f} {c['flops_per_s'] / 1e9:10.2f}"
            + (f" {c['dispatch_s'] * 1e6:15.2f}" if host else "")
        )
    o = prof["optimizer"]
    print(
        f"optimizer  {o['fixed_s'] * 1e6:10.2f} us + {o['bytes_per_s'] / 1e9:.2f} GB/s of parameters"
        + (f"; host {o['dispatch_s'] * 1e6:.2f} us" if host else "")
    )
    print(f"view call  {prof['views']['dispatch_s'] * 1e6:10.2f} us on the host (forward and backward; no kernel)")
    args.compute_out.parent.mkdir(parents=True, exist_ok=True)
    args.compute_out.write_text(json.dumps(prof, indent=1) + "\n")
    print(f"wrote {args.compute_out}")
    return 0


def profile_host(args: argparse.Namespace) -> int:
    """This host: compute per op class on one worker thread, and each collective kind between --ranks workers."""
    sizes = [s for s in SIZES if s <= args.max_mb * 2**20]
    compute = profile_compute()
    rows = profile_collectives(args.ranks, sizes, args.repeats)
    fits = fit_alpha_beta(rows, args.ranks)
    print(f"{'op class':18} {'ms':>8} {'GFLOP/s':>9}")
    for name, c in compute.items():
        speed = "-" if c["flops_per_s"] is None else f"{c['flops_per_s'] / 1e9:.2f}"
        print(f"{name:18} {c['seconds'] * 1e3:8.3f} {speed:>9}")
    print(f"\n{'collective':24} {'latency us':>10} {'GB/s':>8}   ({args.ranks} ranks)")
    for key, f in fits.items():
        print(f"{key:24} {f['latency_s'] * 1e6:10.1f} {f['bytes_per_s'] / 1e9:8.3f}")
    print(f"\n{'all-gather of the largest size':30} {'padded ms':>10} {'grouped ms':>10}   by the first rank's share")
    big = max(r["size"] for r in rows)
    for first in SKEW_SHARES:
        pick = {
            r["impl"]: r["seconds"]
            for r in rows
            if r["kind"] == "all_gather" and r["first_share"] == first and r["size"] == big
        }
        label = "even" if first is None else f"{first:.0%}"
        print(f"{label:30} {pick['padded'] * 1e3:10.2f} {pick['grouped'] * 1e3:10.2f}")
    out = args.out or PROFILE_DIR / f"{platform.node()}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(
        json.dumps(
            {
                "host": platform.node(),
                "ranks": args.ranks,
                "torch": torch.__version__,
                "compute": compute,
                "collectives": rows,
                "fits": fits,
            },
            indent=1,
        )
        + "\n"
    )
    print(f"\nwrote {out}")
    if args.cluster_out:
        args.cluster_out.write_text(cluster_yaml(args.cluster_out.stem, args.ranks, compute, fits, out))
        print(f"wrote {args.cluster_out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
