"""The zoo's tables: every zoo model at a realistic size planned and simulated by every method on
a cluster (default paper_hetero, k=8), and the zoo's tiny models trained for real.

What it does: `sim` composes each zoo case as `bench.run` would (preset=paper, mode=sim), plans
it with every column's method in this process and prints one row per model: parameters, hap's
capture time, rule coverage (share of ops and of FLOPs), hap's plan in a few words, every
column's simulated iteration time and hap's speedup over the best other method that fits (sfb,
hap's own synthesis without its LP, aside); with --repeat N, hap is planned N times and the
planner's seconds are given as median [min, max]. `real` runs `bench.run` per model for every
column on a small emulated cluster (tiny preset, mode=real) into one results folder and prints
the rows' status and throughput. A column is a method with options (COLUMNS): deepspeed at
ZeRO-3 is `deepspeed` with `method.zero_stage=3`, recorded under its column's name.

What it doesn't do: no plot and no record of its own; the real rows are bench.run's.

    python scripts/zoo_table.py sim --repeat 3
    python scripts/zoo_table.py sim --only "GPT-2" --columns hap fsdp
    python scripts/zoo_table.py real --results results/zoo/real
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


@dataclass(frozen=True)
class Column:
    """A method of the table: a conf/method option with its options (method.<field>=V); rows of
    a column with options are recorded under the column's name (method.name=<name>)."""

    name: str
    method: str
    options: tuple[str, ...] = ()

    def overrides(self) -> tuple[str, ...]:
        named = () if self.name == self.method else (f"method.name={self.name}",)
        return (f"method={self.method}", *named, *self.options)


COLUMNS = (
    Column("dp_ev", "dp_ev"),
    Column("dp_cp", "dp_cp"),
    Column("deepspeed", "deepspeed"),  # ZeRO-1, the method's default
    Column("deepspeed_z3", "deepspeed", ("method.zero_stage=3",)),
    Column("fsdp", "fsdp"),
    Column("fsdp_cp", "fsdp_cp"),
    Column("pipeline", "pipeline"),
    # the memory tools where sharding alone leaves activations that do not fit (docs/methods.md)
    Column("fsdp_ckpt", "fsdp", ("method.activation_checkpointing=true",)),
    Column("fsdp_cp_ckpt", "fsdp_cp", ("method.activation_checkpointing=true",)),
    Column("deepspeed_z3_ckpt", "deepspeed", ("method.zero_stage=3", "method.activation_checkpointing=true")),
    Column("sfb", "sfb"),
    Column("hap", "hap"),
    Column("auto", "auto"),  # composes the others: their best, or a composition none of them is
)
# Not baselines of hap's speedup: hap itself, sfb (hap's synthesis without its LP) and auto (which
# searches over hap and the others).
NOT_BASELINES = ("hap", "sfb", "auto")
CUSTOM = ("model=custom", "model.factory=tests.zoo_custom:build_decoder", "model.task=causal_lm")
# (label, source, overrides at the realistic size). Batch norm is the workload's: each device's
# statistics by default, as DDP trains; "BN over the batch" asks the whole batch's (batch_norm=global),
# which only hap's and sfb's programs train (the other methods refuse it: "failed").
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
    ("ResNet-50, BN over the batch", "hf resnet", ("model=hf", "model.arch=resnet", "batch_norm=global")),
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
    from methods.graph import capture_config

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
    head = f"{plan['chosen']} @{plan['granularity']}"
    return (head if shape == plan["chosen"] else f"{head}: {shape}") + (f", {sfb} SFB ops" if sfb else "")


def _columns(args) -> tuple[Column, ...]:
    """The columns asked for (--columns), hap always among them (its plan fills the row)."""
    if not args.columns:
        return COLUMNS
    unknown = sorted(set(args.columns) - {c.name for c in COLUMNS})
    if unknown:
        raise SystemExit(f"--columns {' '.join(unknown)}: unknown; known: {', '.join(c.name for c in COLUMNS)}")
    return tuple(c for c in COLUMNS if c.name in args.columns or c.name == "hap")


def sim(args) -> None:
    from bench.runner.case import new_record, prepare_case
    from bench.studies.regression import _compose
    from methods.graph import _captured

    columns = _columns(args)
    case = ("preset=paper", f"cluster={args.cluster}", "mode=sim")
    print(
        "| model | source | parameters | capture s | rule coverage ops / FLOPs | hap's plan (k=8) "
        "| " + " | ".join(f"{c.name} s" for c in columns) + " | hap vs best other method | planner s (hap) |"
    )
    print("|" + "---|" * (8 + len(columns)))
    hap = next(c for c in columns if c.name == "hap")
    for label, source, overrides in ZOO:
        if args.only and not any(o == label or (o in label and "," not in label) for o in args.only):
            continue
        times, ooms, hap_records, refused = {}, {}, [], {}
        for column in (hap,) + tuple(c for c in columns if c is not hap):  # hap first, capturing afresh
            for _ in range(args.repeat if column is hap else 1):
                if column is hap:
                    _captured.clear()
                cfg = _compose(*case, *overrides, *column.overrides())
                record = new_record(cfg)
                try:
                    prepared = prepare_case(cfg, record)
                except Exception as exc:  # reported as measured: a case that does not plan
                    print(f"note: {label}/{column.name}: {type(exc).__name__}: {exc}", file=sys.stderr)
                    if getattr(exc, "status", None) == "oom":  # no plan fits (the pipeline's stages)
                        refused[column.name] = "OOM (no plan fits)"
                    break
                times[column.name] = record.predicted_iter_time_s
                ooms[column.name] = " OOM" if record.predicted_oom else ""
                if column is hap:
                    hap_records.append(record)
                    model_cfg = prepared.workload.model_cfg
        if not hap_records:
            print(f"| {label} | {source} | - | - | - | hap failed | " + " | ".join("-" for _ in columns) + " | - | - |")
            continue
        rec = hap_records[0]
        plan, cov = rec.plan, rec.plan["rule_coverage"]
        secs = [r.planner_time_s for r in hap_records]
        spread = (
            f"{statistics.median(secs):.1f} [{min(secs):.1f}, {max(secs):.1f}]" if len(secs) > 1 else f"{secs[0]:.1f}"
        )
        # the best other method that fits in memory (the simulator's verdict); an OOM one is shown, not counted
        others = [c.name for c in columns if c.name not in NOT_BASELINES and c.name in times]
        fits = [(times[m], m) for m in others if not ooms[m]]
        best = min(fits) if fits else min(((times[m], m + ", every other method OOM") for m in others), default=None)
        words = _plan_words(plan)
        params = _params(model_cfg, 2) / 1e6 if args.params else float("nan")
        cells = [
            f"{times[c.name]:.4f}{ooms[c.name]}" if c.name in times else refused.get(c.name, "failed") for c in columns
        ]
        speedup = "-" if best is None else f"{best[0] / times['hap']:.3f}x ({best[1]}){ooms['hap']}"
        print(
            f"| {label} | {source} | {params:.1f}M | {plan['capture_time_s']:.1f} | "
            f"{cov['ops_covered']}/{cov['ops']} ({cov['ops_share']:.1%}) / {cov['flops_share']:.2%} | {words} | "
            + " | ".join(cells)
            + f" | {speedup} | {spread} |",
            flush=True,
        )


def _runs(columns: tuple[Column, ...]) -> list[tuple[str, ...]]:
    """The bench.run sweeps that train `columns`: the columns without options in one
    (method=a,b,...), each other column alone (its options are its method's fields)."""
    plain = [c.method for c in columns if not c.options and c.name == c.method]
    runs = [(f"method={','.join(plain)}",)] if plain else []
    return runs + [c.overrides() for c in columns if c.options or c.name != c.method]


def real(args) -> None:
    out = Path(args.results)
    out.mkdir(parents=True, exist_ok=True)
    columns = _columns(args)
    for name, overrides in REAL:
        if args.only and name not in args.only:
            continue
        for methods in _runs(columns):
            cmd = [
                sys.executable,
                "-m",
                "bench.run",
                "-m",
                *methods,
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
    latest = {(r["model"], r["method"]): r for r in rows}  # a case run again replaces its earlier row
    rows = [r for r in rows if latest[(r["model"], r["method"])] is r]
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
        error = f" ({_last_line(r['error'])[:160]})" if r.get("error") else ""
        print(f"| {r['model']} | {r['method']} | {r['status']}{error} | {cell} | {it} |")


def _last_line(text: str) -> str:
    """An error's last line (a traceback's names the exception)."""
    lines = [x for x in text.strip().splitlines() if x.strip()]
    return lines[-1].strip() if lines else ""


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="cmd", required=True)
    s = sub.add_parser("sim")
    s.add_argument("--cluster", default="paper_hetero")
    s.add_argument("--repeat", type=int, default=1)
    s.add_argument("--only", nargs="*")
    s.add_argument("--no-params", dest="params", action="store_false")
    s.add_argument("--columns", nargs="*", help="these columns only (hap always)")
    r = sub.add_parser("real")
    r.add_argument("--cluster", default="local_hetero2")
    r.add_argument("--results", default="/tmp/zoo-real")
    r.add_argument("--warmup", type=int, default=2)
    r.add_argument("--iters", type=int, default=10)
    r.add_argument("--only", nargs="*")
    r.add_argument("--columns", nargs="*", help="these columns only (hap always)")
    args = parser.parse_args()
    sim(args) if args.cmd == "sim" else real(args)


if __name__ == "__main__":
    main()
