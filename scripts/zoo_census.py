"""The census of the zoo: every architecture `python -m models.hf` lists, built, captured and
planned by hap at preset=tiny, and a real step for a sample across the families.

What it does: for each architecture (a transformers model type with a head the task adapters
use) it composes the case `bench.run model=hf model.arch=A preset=tiny method=hap mode=sim`
would (cluster default paper_hetero at k = 1: 2 V100 + 6 P100 machines) and takes it through
the runner's own steps, each timed: `build` (the model spec: config, task, the export check),
`capture` (the planner's graph), `plan` (hap's planner) and `simulate` (the simulator's time and
memory of the plan). The first step that fails gives the row its status and a reason: a short
cause shared by the rows it stops, and the one-line message. Architectures run in chunks, each
chunk in one worker process (capture and plan in-process), each architecture under its own
timeout; a worker that dies or hangs past it loses that architecture only (a `timeout` or
`crashed` row) and a fresh worker takes the rest. With --real N, N architectures that planned,
spread over the tasks, also train for real (`bench.run mode=real`, local_hetero2, 2 warm-up + 2
measured iterations, a process each). It writes one row per architecture to a csv and a json,
and a markdown table with the counts per reason.

What it doesn't do: no other method than hap, no paper sizes, no equivalence check (the zoo
table's tests do that for its models).

    python scripts/zoo_census.py --jobs 2 --out results/zoo/YYYYmmdd-census   # every architecture
    python scripts/zoo_census.py --only gpt2 bert --out /tmp/census    # a few
    python scripts/zoo_census.py --real 14 --out results/zoo/YYYYmmdd-census
    python scripts/zoo_census.py --table --out results/zoo/YYYYmmdd-census  # the table from the json
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

STAGES = ("build", "capture", "plan", "simulate")
TASK_ORDER = ("causal_lm", "seq2seq_lm", "masked_lm", "seq_cls", "image_cls")
FIELDS = (
    "arch",
    "task",
    "status",
    "stage",
    "reason",
    "error",
    "params",
    "flops_share",
    "plan",
    "predicted_iter_s",
    "predicted_oom",
    "build_s",
    "capture_s",
    "plan_s",
    "simulate_s",
    "paper_builds",
    "real_status",
    "real_iter_ms",
    "real_error",
)

# The causes seen, most specific first: (pattern on "<Type>: <message>", the reason's words).
# The message itself stays in the row; a cause not listed is named by its stage and type.
REASONS = (
    (r"requires the (\w+) library", "a library that is not installed"),
    (r"own default config of .* does not validate", "transformers' default config does not validate"),
    (
        r"captured on a real sample, (the shape|a length|forward computes|its branch|its loss)",
        "forward reads tensor values that change with the batch (refused on a real sample too)",
    ),
    (
        r"Could not guard on data-dependent|item\(\) cannot be called on meta|nonzero\(\)|"
        r"unique_consecutive.*Meta|data-dependent",
        "forward reads tensor values (data-dependent control flow or shapes)",
    ),
    (r"a task adapter needs logits", "the task's head returns no logits"),
    (
        r"specify (either|exactly one of) (input_ids|input_features)|invalid for input of size|same reduction dim",
        "the model takes other inputs than the task's alone (text beside an image, audio features)",
    ),
    (r"shared_kv_states cannot be None", "a draft model: it takes the main model's key-value states"),
    (r"the config refused its fields", "the config refuses the tiny sizes (a check across its parts)"),
    (r"found at least two devices", "forward makes tensors on a fixed device"),
    (r"more than the \d+ layer groups", "hap's default ratio rows outnumber the model's layer groups"),
    (r"no distributed program leaves the loss", "no program found by hap's search"),
    (r"captures it has no gradient", "a custom autograd.Function's backward, which export does not keep"),
    (r"escaped from inside a function being vmapped", "export keeps vmap's internals, which cannot run again"),
    (r"torch\.export \(non-strict\) refused", "export: refused"),
)


class ArchTimeout(BaseException):
    """An architecture ran past its timeout (raised by the alarm in the worker; a
    BaseException, so that no `except Exception` on its way swallows it)."""


def architectures() -> list[tuple[str, list[str]]]:
    """(model type, tasks the adapters serve) for every type `python -m models.hf` lists."""
    from models.hf import _transformers, model_types, tasks_of

    _transformers()
    return [(t, tasks) for t in model_types() if (tasks := tasks_of(t))]


def reason_of(row: dict) -> str:
    """A failed row's cause, from its stage, its message ("<Type>: <first line>") and whether
    its architecture builds at its own size: a listed one (REASONS), else the stage and type."""
    text = row.get("error") or ""
    for pattern, words in REASONS:
        if re.search(pattern, text):
            return words
    if row.get("stage") == "build" and row.get("paper_builds") is False:
        return "does not build at its own size either (transformers)"
    return f"{row.get('stage')}: {text.split(':', 1)[0]}"


def one_line(exc: BaseException) -> str:
    first = (str(exc).strip().splitlines() or [""])[0]
    return f"{type(exc).__name__}: {first}"[:400]


def census_one(arch: str, cluster: str, gpus_per_machine: int) -> dict:
    """One architecture through build, capture, plan and simulate (the module docstring)."""
    from hydra.utils import instantiate

    from bench.core.cluster import ClusterSpec
    from bench.cost import simulate
    from bench.runner.case import check_workload, workload_from
    from bench.runner.configs import compose_settings
    from methods.graph import capture_config

    row: dict = {"arch": arch, "status": "ok", "stage": "done"}
    stage = "build"
    try:
        start = time.perf_counter()
        cfg = compose_settings(
            "model=hf",
            f"model.arch={arch}",
            "preset=tiny",
            "mode=sim",
            "method=hap",
            "method.cache_dir=null",
            f"cluster={cluster}",
            f"cluster.gpus_per_machine={gpus_per_machine}",
            "wandb.mode=disabled",
            "logger=none",
        )
        spec = ClusterSpec.from_config(cfg.cluster, cfg.config_roots())
        model_cfg, batch, data = check_workload(cfg, spec)
        row["task"] = model_cfg.task
        row["build_s"] = round(time.perf_counter() - start, 2)
        stage, start = "capture", time.perf_counter()
        graph = capture_config(model_cfg, batch)
        row["params"] = sum(n.numel for n in graph.nodes if n.is_param)
        workload = workload_from(cfg, model_cfg, batch, data)
        row["capture_s"] = round(time.perf_counter() - start, 2)
        stage, start = "plan", time.perf_counter()
        method = instantiate(cfg.method)
        plan = method.plan(workload, spec)
        row["plan_s"] = round(time.perf_counter() - start, 2)
        coverage = plan.details.get("rule_coverage") or {}
        row["flops_share"] = coverage.get("flops_share")
        chosen = plan.details.get("chosen")
        if chosen == "data parallel" and plan.details.get("data_parallel") == "gathers":
            chosen += " (gathers)"  # replicated where no batch shard can run an op
        row["plan"] = f"{chosen} @{plan.details.get('granularity')}"
        stage, start = "simulate", time.perf_counter()
        sim = simulate(plan.program, spec, plan.ratios)
        row["simulate_s"] = round(time.perf_counter() - start, 2)
        row["predicted_iter_s"] = sim.iter_time_s
        row["predicted_oom"] = bool(sim.oom)
    except ArchTimeout as exc:
        row.update(status="timeout", stage=stage, reason=f"timeout in {stage}", error=str(exc))
    except Exception as exc:  # every failure is a row: its stage, its cause and its one line
        row.update(status="failed", stage=stage, error=one_line(exc))
        if stage == "build":
            row["paper_builds"] = builds_at_paper(arch)
        row["reason"] = reason_of(row)
    return row


def builds_at_paper(arch: str) -> bool | None:
    """Whether the architecture's own size builds and exports (a model the tiny preset failed:
    False says the limit is the model's or transformers', not the preset's)."""
    from models.hf import HFModelConfig

    try:
        HFModelConfig(arch=arch, preset="paper")
    except ArchTimeout:  # the architecture's time ran out here: the row is kept, this unknown
        return None
    except Exception:
        return False
    return True


def _alarm(signum, frame):
    raise ArchTimeout("past the per-architecture timeout")


def worker(args) -> None:
    """A chunk in this process: a `start` line before each architecture, its row after."""
    import logging
    import warnings

    import torch

    torch.set_num_threads(1)
    warnings.filterwarnings("ignore")
    logging.disable(logging.WARNING)
    signal.signal(signal.SIGALRM, _alarm)
    with open(args.worker_out, "a") as out:
        for arch in args.archs:
            out.write(json.dumps({"start": arch}) + "\n")
            out.flush()
            signal.alarm(args.timeout)
            try:
                row = census_one(arch, args.cluster, args.gpus_per_machine)
            finally:
                signal.alarm(0)
            out.write(json.dumps({"row": row}) + "\n")
            out.flush()


_GRACE_S = 60.0  # past an architecture's own timeout, before its worker is stopped (its alarm failed)


class _Worker:
    """One worker process on a chunk: the architecture it is on, since when, what it wrote."""

    def __init__(self, chunk: list[str], args):
        self.chunk = chunk
        with tempfile.NamedTemporaryFile("r", suffix=".jsonl", delete=False) as tmp:
            self.path = tmp.name
        cmd = [sys.executable, __file__, "--worker-out", self.path, "--timeout", str(args.timeout)]
        cmd += ["--cluster", args.cluster, "--gpus-per-machine", str(args.gpus_per_machine), "--archs", *chunk]
        self.proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        self.current, self.since, self.seen = None, time.monotonic(), 0

    def poll(self, done: dict[str, dict], save, grace: float) -> bool:
        """Read its new lines into `done`; True once it has ended (or was stopped past `grace`)."""
        lines = Path(self.path).read_text().splitlines()
        for line in lines[self.seen :]:
            entry = json.loads(line)
            if "start" in entry:
                self.current, self.since = entry["start"], time.monotonic()
            else:
                done[entry["row"]["arch"]] = entry["row"]
                self.current = None
                save(entry["row"])
        self.seen = len(lines)
        if self.proc.poll() is not None:
            return True
        if self.current is not None and time.monotonic() - self.since > grace:
            self.proc.kill()
            self.proc.wait()
            return True
        return False


def survey(archs: list[str], args, done: dict[str, dict], save) -> None:
    """Every architecture not in `done`, in chunks, `args.jobs` workers at a time (the module
    docstring); `save` is called after each row. A worker that dies or hangs loses the
    architecture it was on (a row that says so) and a fresh one takes the rest of its chunk."""
    todo = [a for a in archs if a not in done]
    running: list[_Worker] = []
    grace = args.timeout + _GRACE_S
    while todo or running:
        while todo and len(running) < args.jobs:
            chunk, todo = todo[: args.chunk], todo[args.chunk :]
            running.append(_Worker(chunk, args))
        time.sleep(1.0)
        for worker in [w for w in running if w.poll(done, save, grace)]:
            running.remove(worker)
            os.unlink(worker.path)
            left = [a for a in worker.chunk if a not in done]
            if not left:
                continue
            lost = left[0]
            status = "timeout" if worker.proc.returncode in (-9, None) else "crashed"
            row = {
                "arch": lost,
                "status": status,
                "stage": "worker",
                "reason": "worker hung past the timeout" if status == "timeout" else "worker process died",
                "error": f"the worker exited with {worker.proc.returncode} on this architecture",
            }
            done[lost] = row
            save(row)
            todo = left[1:] + todo


def sample_for_real(rows: list[dict], count: int) -> list[dict]:
    """`count` planned architectures spread over the tasks: shares in proportion to each task's
    count, at least one each, evenly spaced in name order within a task."""
    planned = [r for r in rows if r["status"] == "ok"]
    by_task = {t: sorted((r for r in planned if r.get("task") == t), key=lambda r: r["arch"]) for t in TASK_ORDER}
    by_task = {t: rs for t, rs in by_task.items() if rs}
    total = sum(len(rs) for rs in by_task.values())
    shares = {t: max(1, round(count * len(rs) / total)) for t, rs in by_task.items()}
    while sum(shares.values()) > count:
        biggest = max(shares, key=shares.get)
        shares[biggest] -= 1
    picked = []
    for t, rs in by_task.items():
        k = min(shares[t], len(rs))
        picked += [rs[round(i * (len(rs) - 1) / max(k - 1, 1))] for i in range(k)] if k > 1 else [rs[len(rs) // 2]]
    return picked


def real_step(row: dict, args) -> None:
    """One real run of `row`'s architecture (hap, local_hetero2): its status and step time."""
    with tempfile.TemporaryDirectory(prefix="hetbench-census-") as results:
        cmd = [
            sys.executable,
            "-m",
            "bench.run",
            "model=hf",
            f"model.arch={row['arch']}",
            "preset=tiny",
            "method=hap",
            "cluster=local_hetero2",
            "mode=real",
            "warmup_iters=2",
            "measured_iters=2",
            "wandb.mode=disabled",
            "logger=none",
            f"results_dir={results}",
        ]
        try:
            done = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=args.real_timeout)
        except subprocess.TimeoutExpired:
            row.update(real_status="timeout", real_error=f"past {args.real_timeout} s")
            return
        path = Path(results) / "records.jsonl"
        records = [json.loads(x) for x in path.read_text().splitlines()] if path.exists() else []
        if not records:
            row.update(real_status="failed", real_error=(done.stderr.strip().splitlines() or ["no row"])[-1][:300])
            return
        r = records[-1]
        times = r.get("iter_times_s") or []
        row["real_status"] = r["status"]
        row["real_iter_ms"] = round(1e3 * sorted(times)[len(times) // 2], 1) if times else None
        row["real_error"] = (r.get("error") or "").strip().splitlines()[-1][:300] if r.get("error") else ""


def write_files(rows: list[dict], out: Path, args) -> None:
    """The rows as json and csv, and the markdown table with the counts per reason."""
    rows = sorted(rows, key=lambda r: r["arch"])
    out.with_suffix(".json").write_text(json.dumps(rows, indent=1) + "\n")
    with out.with_suffix(".csv").open("w", newline="") as f:
        w = csv.DictWriter(f, FIELDS, extrasaction="ignore")
        w.writeheader()
        for r in rows:
            w.writerow(r)
    out.with_suffix(".md").write_text("\n".join(table_lines(rows)) + "\n")


def table_lines(rows: list[dict]) -> list[str]:
    """The census in markdown: counts per status and per reason, then one line per failure."""
    for r in rows:  # causes as REASONS says them now
        if r["status"] == "failed":
            r["reason"] = reason_of(r)
    n = len(rows)
    ok = [r for r in rows if r["status"] == "ok"]
    lines = [
        f"{len(ok)} of {n} architectures ({len(ok) / max(n, 1):.1%}) build, capture, plan with hap and simulate "
        "at preset=tiny.",
        "",
        "| status | architectures |",
        "|---|---|",
    ]
    for status in sorted({r["status"] for r in rows}):
        lines.append(f"| {status} | {sum(1 for r in rows if r['status'] == status)} |")
    failed = [r for r in rows if r["status"] != "ok"]
    if failed:
        lines += ["", "| reason | architectures | which |", "|---|---|---|"]
        reasons: dict[str, list[str]] = {}
        for r in failed:
            reasons.setdefault(r["reason"], []).append(r["arch"])
        for reason, archs in sorted(reasons.items(), key=lambda kv: (-len(kv[1]), kv[0])):
            lines.append(f"| {reason} | {len(archs)} | {', '.join(archs)} |")
        lines += [
            "",
            "`paper`: whether the architecture's own size builds and exports (for a failed build).",
            "",
            "| architecture | task | stage | reason | paper | message |",
            "|---|---|---|---|---|---|",
        ]
        for r in failed:
            message = (r.get("error") or "").replace("|", "/")
            paper = {True: "builds", False: "fails too", None: "-"}[r.get("paper_builds")]
            lines.append(
                f"| {r['arch']} | {r.get('task') or '-'} | {r['stage']} | {r['reason']} | {paper} | {message} |"
            )
    by_task: dict[str, list[dict]] = {}
    for r in rows:
        by_task.setdefault(r.get("task") or "-", []).append(r)
    lines += ["", "| task | architectures | ok |", "|---|---|---|"]
    for task, rs in sorted(by_task.items()):
        lines.append(f"| {task} | {len(rs)} | {sum(1 for r in rs if r['status'] == 'ok')} |")
    real = [r for r in rows if r.get("real_status")]
    if real:
        lines += [
            "",
            f"Real steps (hap on local_hetero2, 2 warm-up + 2 measured iterations): "
            f"{sum(1 for r in real if str(r['real_status']).startswith('ok'))} of {len(real)} ok.",
            "",
            "| architecture | task | status | step ms (median of 2) | error |",
            "|---|---|---|---|---|",
        ]
        for r in real:
            ms = "-" if r.get("real_iter_ms") is None else f"{r['real_iter_ms']:.1f}"
            error = (r.get("real_error") or "").replace("|", "/")
            lines.append(f"| {r['arch']} | {r.get('task')} | {r['real_status']} | {ms} | {error} |")
    times = sorted(sum(r.get(f"{s}_s") or 0.0 for s in STAGES) for r in ok)
    if times:
        lines += [
            "",
            f"Seconds per planned architecture (build + capture + plan + simulate): median "
            f"{times[len(times) // 2]:.1f}, max {times[-1]:.1f}.",
        ]
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path("/tmp/zoo-census"), help="files OUT.json, OUT.csv, OUT.md")
    parser.add_argument("--only", nargs="*", help="these architectures only")
    parser.add_argument("--chunk", type=int, default=20, help="architectures per worker process")
    parser.add_argument("--jobs", type=int, default=1, help="worker processes at a time")
    parser.add_argument("--timeout", type=int, default=300, help="seconds per architecture")
    parser.add_argument("--cluster", default="paper_hetero")
    parser.add_argument("--gpus-per-machine", type=int, default=1)
    parser.add_argument("--real", type=int, default=0, metavar="N", help="also train N sampled architectures")
    parser.add_argument("--real-timeout", type=int, default=900)
    parser.add_argument("--table", action="store_true", help="only write the table again from OUT.json")
    parser.add_argument("--redo", action="store_true", help="run again the architectures OUT.json has not ok")
    parser.add_argument("--worker-out", help=argparse.SUPPRESS)
    parser.add_argument("--archs", nargs="*", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker_out:
        worker(args)
        return
    out: Path = args.out
    out.parent.mkdir(parents=True, exist_ok=True)
    done: dict[str, dict] = {}
    if out.with_suffix(".json").exists():  # resume: rows already written are kept
        done = {r["arch"]: r for r in json.loads(out.with_suffix(".json").read_text())}
        if args.redo:  # except those that did not plan
            done = {a: r for a, r in done.items() if r["status"] == "ok"}
    if not args.table:
        listed = architectures()
        tasks = dict(listed)
        archs = [a for a, _ in listed if not args.only or a in args.only]
        unknown = sorted(set(args.only or ()) - set(tasks))
        if unknown:
            parser.error(f"--only {' '.join(unknown)}: not listed by python -m models.hf")

        def save(row: dict) -> None:
            print(f"{row['arch']:32s} {row['status']:8s} {row.get('reason') or ''}", flush=True)
            write_files(list(done.values()), out, args)

        survey(archs, args, done, save)
        if args.real:
            for row in sample_for_real([done[a] for a in archs], args.real):
                if row.get("real_status"):
                    continue
                real_step(row, args)
                print(f"real {row['arch']:27s} {row['real_status']} {row.get('real_error') or ''}", flush=True)
                write_files(list(done.values()), out, args)
    write_files(list(done.values()), out, args)
    print("\n".join(table_lines(sorted(done.values(), key=lambda r: r["arch"]))[:12]))


if __name__ == "__main__":
    main()
