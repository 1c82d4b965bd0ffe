"""The zoo's tables: every zoo model at a realistic size planned and simulated by every method on
a cluster (default paper_hetero, k=8), and the zoo's tiny models trained for real.

What it does: `sim` composes each zoo case as `bench.run` would (preset=paper, mode=sim), plans
it with dp_ev, dp_cp, deepspeed, sfb and hap in this process and prints one row per model:
parameters, hap's capture time, rule coverage (share of ops and of FLOPs), hap's plan in a few
words, every method's simulated iteration time and hap's speedup over the best baseline; with
--repeat N, hap is planned N times and the planner's seconds are given as median [min, max].
`real` runs `bench.run` per model for every method on a small emulated cluster (tiny preset,
mode=real) into one results folder and prints the rows' status and throughput.

What it doesn't do: no plot and no record of its own; the real rows are bench.run's.

    python scripts/zoo_table.py sim --repeat 3
    python scripts/zoo_table.py real --results results/zoo/real
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

METHODS = ("dp_ev", "dp_cp", "deepspeed", "sfb", "hap")
BASELINES = ("dp_ev", "dp_cp", "deepspeed")
CUSTOM = ("model=custom", "model.factory=tests.zoo_custom:build_decoder", "model.task=causal_lm")
# (label, source, overrides at the realistic size[, hap's and sfb's own overrides]). Batch norm: hap
# and sfb compute its statistics over the whole batch by default (exact, all-reduced), DDP and
# DeepSpeed over each rank's shard; "BN per shard" plans hap and sfb as DDP trains.
ZOO = [
    ("GPT-2 124M", "hf gpt2", ("model=hf", "model.arch=gpt2")),
    ("BERT-Base", "hf bert", ("model=hf", "model.arch=bert")),
    (
        "Llama 1B shape",
        "hf llama",
        (
            "model=hf",
            "model.arch=llama",
            "model.config.num_hidden_layers=16",
            "model.config.hidden_size=2048",
            "model.config.num_attention_heads=32",
            "model.config.num_key_value_heads=8",
            "model.config.intermediate_size=8192",
            "model.config.vocab_size=128256",
        ),
    ),
    ("Llama 7B shape", "hf llama", ("model=hf", "model.arch=llama")),
    ("ViT-B/16", "hf vit", ("model=hf", "model.arch=vit")),
    ("ResNet-50", "hf resnet", ("model=hf", "model.arch=resnet")),
    ("ResNet-50, BN per shard", "hf resnet", ("model=hf", "model.arch=resnet"), ("method.batch_norm=local",)),
    ("Swin-T", "hf swin", ("model=hf", "model.arch=swin")),
    (
        "custom decoder",
        "custom",
        CUSTOM
        + ("+model.kwargs.vocab=32000", "+model.kwargs.width=1024", "model.vocab_size=32000", "model.seq_len=128"),
    ),
]
# The tiny real runs: the same architectures at preset=tiny.
REAL = [
    ("gpt2", ("model=hf", "model.arch=gpt2")),
    ("bert", ("model=hf", "model.arch=bert")),
    ("llama", ("model=hf", "model.arch=llama")),
    ("vit", ("model=hf", "model.arch=vit")),
    ("resnet", ("model=hf", "model.arch=resnet")),
    ("swin", ("model=hf", "model.arch=swin")),
    ("custom", CUSTOM),
]


def _params(cfg, batch: int) -> int:
    from methods.capture import capture_config

    graph = capture_config(cfg, batch)
    return sum(n.numel for n in graph.nodes if n.is_param)


def _plan_words(plan: dict) -> str:
    """hap's plan in a few words: its level, data parallel or how many parameters it shards, SFB."""
    layouts, steps = plan["program"]["layouts"], plan["steps"]
    sharded = sorted(n for n, lay in layouts.items() if n.startswith("m_") and lay != "Identity")
    total = len([n for n in layouts if n.startswith("m_")])
    sfb = sum(1 for s in steps if s.get("sfb"))
    shape = "data parallel" if not sharded else f"{len(sharded)}/{total} params sharded"
    if 0 < len(sharded) <= 2:
        shape += " (" + ", ".join(f"{n[2:]} {layouts[n]}" for n in sharded) + ")"
    return f"{plan['chosen']} @{plan['granularity']}: {shape}" + (f", {sfb} SFB ops" if sfb else "")


def sim(args) -> None:
    from bench.runner.case import new_record, prepare_case
    from bench.studies.regression import _compose
    from methods.capture import _captured

    case = ("preset=paper", f"cluster={args.cluster}", "mode=sim")
    print(
        "| model | source | parameters | capture s | rule coverage ops / FLOPs | hap's plan (k=8) "
        "| " + " | ".join(f"{m} s" for m in METHODS) + " | hap vs best baseline | planner s (hap) |"
    )
    print("|" + "---|" * (10 + len(METHODS) - 4))
    for label, source, overrides, *own in ZOO:
        if args.only and not any(o == label or (o in label and "," not in label) for o in args.only):
            continue
        times, hap_records = {}, []
        for method in ("hap",) + METHODS[:-1]:  # hap first, each time capturing afresh (no process cache)
            for _ in range(args.repeat if method == "hap" else 1):
                if method == "hap":
                    _captured.clear()
                extra = own[0] if own and method in ("hap", "sfb") else ()
                cfg = _compose(*case, *overrides, f"method={method}", *extra)
                record = new_record(cfg)
                try:
                    prepared = prepare_case(cfg, record)
                except Exception as exc:  # reported as measured: a case that does not plan
                    print(f"note: {label}/{method}: {type(exc).__name__}: {exc}", file=sys.stderr)
                    break
                times[method] = record.predicted_iter_time_s
                oom = " OOM" if record.predicted_oom else ""
                times[method + "_oom"] = oom
                if method == "hap":
                    hap_records.append(record)
                    model_cfg = prepared.workload.model_cfg
        if not hap_records:
            print(f"| {label} | {source} | - | - | - | hap failed | " + " | ".join("-" for _ in METHODS) + " |")
            continue
        rec = hap_records[0]
        plan, cov = rec.plan, rec.plan["rule_coverage"]
        secs = [r.planner_time_s for r in hap_records]
        spread = (
            f"{statistics.median(secs):.1f} [{min(secs):.1f}, {max(secs):.1f}]" if len(secs) > 1 else f"{secs[0]:.1f}"
        )
        # the best baseline that fits in memory (the simulator's verdict); an OOM one is shown, not counted
        fits = [(times[m], m) for m in BASELINES if m in times and not times[m + "_oom"]]
        best = min(fits) if fits else min((times[m], m + ", every baseline OOM") for m in BASELINES if m in times)
        words = _plan_words(plan)
        params = _params(model_cfg, 2) / 1e6 if args.params else float("nan")
        cells = [f"{times[m]:.4f}{times[m + '_oom']}" if m in times else "failed" for m in METHODS]
        print(
            f"| {label} | {source} | {params:.1f}M | {plan['capture_time_s']:.1f} | "
            f"{cov['ops_covered']}/{cov['ops']} ({cov['ops_share']:.1%}) / {cov['flops_share']:.2%} | {words} | "
            + " | ".join(cells)
            + f" | {best[0] / times['hap']:.3f}x ({best[1]}){times['hap_oom']} | {spread} |",
            flush=True,
        )


def real(args) -> None:
    out = Path(args.results)
    out.mkdir(parents=True, exist_ok=True)
    for name, overrides in REAL:
        if args.only and name not in args.only:
            continue
        cmd = [
            sys.executable,
            "-m",
            "bench.run",
            "-m",
            f"method={','.join(METHODS)}",
            *overrides,
            "preset=tiny",
            f"cluster={args.cluster}",
            "mode=real",
            f"warmup_iters={args.warmup}",
            f"measured_iters={args.iters}",
            "wandb.mode=disabled",
            "logger=none",
            f"results_dir={out}",
        ]
        print("$", " ".join(cmd[1:]), flush=True)
        done = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True)
        if done.returncode:
            print(done.stderr[-2000:], flush=True)
    rows = [json.loads(x) for x in (out / "records.jsonl").read_text().splitlines()]
    print("| model | method | status | samples/s: median [min, max] over iterations | iter ms: median (n) |")
    print("|---|---|---|---|---|")
    for r in rows:
        ts = r.get("iter_times_s") or []
        if ts:
            sps = sorted(r["global_batch"] / t for t in ts)
            cell = f"{statistics.median(sps):.1f} [{sps[0]:.1f}, {sps[-1]:.1f}]"
            it = f"{1e3 * statistics.median(ts):.1f} ({len(ts)})"
        else:
            cell, it = "-", "-"
        error = f" ({r['error'][:80]})" if r.get("error") else ""
        print(f"| {r['model']} | {r['method']} | {r['status']}{error} | {cell} | {it} |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="cmd", required=True)
    s = sub.add_parser("sim")
    s.add_argument("--cluster", default="paper_hetero")
    s.add_argument("--repeat", type=int, default=1)
    s.add_argument("--only", nargs="*")
    s.add_argument("--no-params", dest="params", action="store_false")
    r = sub.add_parser("real")
    r.add_argument("--cluster", default="local_hetero2")
    r.add_argument("--results", default="/tmp/zoo-real")
    r.add_argument("--warmup", type=int, default=2)
    r.add_argument("--iters", type=int, default=10)
    r.add_argument("--only", nargs="*")
    args = parser.parse_args()
    sim(args) if args.cmd == "sim" else real(args)


if __name__ == "__main__":
    main()
