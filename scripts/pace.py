"""The harness's own pace: what a user waits for around the training, each in a fresh process.

What it does: times `import torch` (the floor every command pays), hap's plan of the paper
models on `paper_hetero` (k = 8) in a fresh process with cold and warm caches (the row's
`planner_time_s`, and its capture and search seconds where the row has them), `bench.plan`'s
wall time cold and warm, hap on 1,024 and 10,000 GPUs, and (`--only auto,auto_scale`) the
whole-space planner, `method=auto`, on the paper models and Llama 7B shape at k = 8 and on BERT
at 128, 512 and 1,024 GPUs; each `--repeat` times, printed as median [min-max]. Caches live in a temporary folder (HETBENCH_CACHE_DIR, results_dir): the
user's are never read or written; `models` runs with the plan cache off (every run searches),
`plan_cache` with it on (the warm run loads the plan the cold one cached). What it doesn't do:
the suite.

    python scripts/pace.py --repeat 3
    python scripts/pace.py --only plan,scale
    python scripts/pace.py --only main   # the main job, with the time it spends outside iterations
    python scripts/pace.py --only torch,auto,auto_scale --repeat 2   # auto's planning time
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PY = sys.executable
MODELS = ("vgg19", "vit", "bert", "bert_moe")
LLAMA_7B = ["model=hf", "model.arch=llama"]  # the zoo table's Llama 7B shape (its config's sizes)
SCALES = {  # GPUs: (V100 machines, P100 machines) of paper_hetero's 8-GPU machines
    1024: (32, 96),
    10000: (312, 938),
}
AUTO_SCALES = {128: (4, 12), 512: (16, 48), 1024: (32, 96)}  # GPUs: paper_hetero's machines, as SCALES


def timed(cmd: list[str], env: dict) -> tuple[float, subprocess.CompletedProcess]:
    start = time.perf_counter()
    done = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True)
    wall = time.perf_counter() - start
    if done.returncode != 0:
        sys.exit(f"{' '.join(cmd)} failed ({done.returncode}):\n{done.stderr[-3000:]}")
    return wall, done


def last_row(results: Path) -> dict:
    lines = (results / "records.jsonl").read_text().splitlines()
    return json.loads(lines[-1])


PARTS = ("prepare_s", "workers_s", "setup_s", "untimed_s", "iterations_s")  # a row's timings


def iteration_wall_s(row: dict) -> float:
    """The wall time of a row's timed iterations (warm-up and measured): its emulated times over
    the emulation's headroom (rows hold emulated time, wall x headroom)."""
    headroom = (row.get("emulation") or {}).get("headroom") or 1.0
    timings = row.get("timings") or {}
    if "iterations_s" in timings:
        return timings["iterations_s"]
    return row["iter_time_s_mean"] * (row["warmup_iters"] + row["measured_iters"]) / headroom


def spread(values: list[float]) -> str:
    if not values:
        return "-"
    if len(values) == 1:
        return f"{values[0]:.2f}"
    return f"{statistics.median(values):.2f} [{min(values):.2f}-{max(values):.2f}]"


class Bench:
    def __init__(self, repeat: int):
        self.repeat = repeat
        self.rows: list[tuple[str, str, str, str, str]] = []

    def env(self, cache: Path) -> dict:
        return {**os.environ, "HETBENCH_CACHE_DIR": str(cache), "WANDB_MODE": "disabled"}

    def import_torch(self) -> None:
        walls = [timed([PY, "-c", "import torch"], dict(os.environ))[0] for _ in range(max(3, self.repeat))]
        self.rows.append(("python -c 'import torch'", spread(walls), "-", "-", "-"))

    def sim_case(self, label: str, overrides: list[str], warm_plan: bool = False, plan_cache: str = "method") -> None:
        """A planner in mode=sim, cold (fresh caches) then warm (the same caches again, the plan
        cache off unless warm_plan): wall, planner, capture and search seconds. `plan_cache`:
        where the method's plan-cache option is (`method.hap` for auto's hap part)."""
        cold: dict[str, list[float]] = {k: [] for k in ("wall", "planner", "capture", "search")}
        warm: dict[str, list[float]] = {k: [] for k in cold}
        for _ in range(self.repeat):
            tmp = Path(tempfile.mkdtemp(prefix="hetbench-pace-"))
            try:
                no_plan_cache = [] if warm_plan else [f"{plan_cache}.cache_dir=null"]
                cmd = [PY, "-m", "bench.run", "mode=sim", "logger=none", f"results_dir={tmp / 'runs'}"]
                for bucket in (cold, warm):
                    wall, _ = timed([*cmd, *no_plan_cache, *overrides], self.env(tmp / "cache"))
                    row = last_row(tmp / "runs")
                    plan = row.get("plan") or {}
                    bucket["wall"].append(wall)
                    bucket["planner"].append(row["planner_time_s"])
                    capture = row.get("capture_time_s", plan.get("capture_time_s"))
                    if capture is not None:
                        bucket["capture"].append(capture)
                    search = row.get("search_time_s", plan.get("search_time_s"))
                    if search is not None:
                        bucket["search"].append(search)
            finally:
                shutil.rmtree(tmp, ignore_errors=True)
        for name, b in (("cold", cold), ("warm", warm)):
            self.rows.append(
                (f"{label}, {name}", spread(b["wall"]), spread(b["planner"]), spread(b["capture"]), spread(b["search"]))
            )

    def plan_command(self) -> None:
        walls: dict[str, list[float]] = {"cold": [], "warm": []}
        for _ in range(self.repeat):
            tmp = Path(tempfile.mkdtemp(prefix="hetbench-pace-"))
            try:
                cmd = [PY, "-m", "bench.plan", "model=bert", "preset=paper", "cluster=paper_hetero", "method=hap"]
                cmd.append(f"results_dir={tmp / 'runs'}")
                for name in ("cold", "warm"):
                    walls[name].append(timed(cmd, self.env(tmp / "cache"))[0])
            finally:
                shutil.rmtree(tmp, ignore_errors=True)
        for name, w in walls.items():
            self.rows.append((f"bench.plan bert paper hap, {name}", spread(w), "-", "-", "-"))

    def main_job(self) -> None:
        """The README's main job (bench.compare, defaults) in a fresh results folder: its wall
        and CPU time, and the wall time its rows' timed iterations (warm-up and measured) took."""
        for _ in range(self.repeat):
            tmp = Path(tempfile.mkdtemp(prefix="hetbench-pace-"))
            try:
                before = resource.getrusage(resource.RUSAGE_CHILDREN)
                wall, done = timed([PY, "-m", "bench.compare", f"results_dir={tmp / 'runs'}"], dict(os.environ))
                after = resource.getrusage(resource.RUSAGE_CHILDREN)
                print(done.stdout)
                rows = [json.loads(x) for x in (tmp / "runs" / "records.jsonl").read_text().splitlines()]
                repeats = [r for r in rows if r.get("row_kind") == "repeat"]
                inside = sum(iteration_wall_s(r) for r in repeats)
                cpu = after.ru_utime - before.ru_utime
                parts = {k: sum((r.get("timings") or {}).get(k, 0.0) for r in repeats) for k in PARTS}
                if any(parts.values()):
                    workers = parts.pop("workers_s")
                    parts["launch_and_results_s"] = workers - sum(parts[k] for k in PARTS[2:])
                    parts["elsewhere_s"] = wall - workers - parts["prepare_s"]
                    print("outside the iterations: " + ", ".join(f"{k} {v:.1f}" for k, v in parts.items()))
                self.rows.append(
                    (
                        f"main job: {len(repeats)} cases",
                        f"{wall:.1f}",
                        f"user CPU {cpu:.1f} s",
                        f"iterations {inside:.1f} s",
                        f"outside {100 * (1 - inside / wall):.0f}%, {(wall - inside) / len(repeats):.2f} s/case",
                    )
                )
            finally:
                shutil.rmtree(tmp, ignore_errors=True)

    def print(self) -> None:
        head = ("what", "wall s", "planner_time_s", "capture s", "search s")
        widths = [max(len(r[i]) for r in [head, *self.rows]) for i in range(len(head))]
        line = lambda r: "| " + " | ".join(c.ljust(w) for c, w in zip(r, widths)) + " |"  # noqa: E731
        print(line(head))
        print("|" + "|".join("-" * (w + 2) for w in widths) + "|")
        for r in self.rows:
            print(line(r))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeat", type=int, default=3, help="fresh-process runs of each timing")
    ap.add_argument(
        "--only",
        default="torch,models,plan,scale",
        help="comma list of: torch, models, plan_cache, plan, scale, main, auto, auto_scale",
    )
    ap.add_argument("--models", default=",".join(MODELS))
    args = ap.parse_args(argv)
    parts = set(args.only.split(","))
    bench = Bench(args.repeat)
    if "torch" in parts:
        bench.import_torch()
    if "models" in parts:
        for model in args.models.split(","):
            case = [f"model={model}", "preset=paper", "cluster=paper_hetero", "method=hap"]
            bench.sim_case(f"hap {model} paper, paper_hetero k=8", case)
    if "plan_cache" in parts:  # the warm run loads the plan the cold one cached
        for model in args.models.split(","):
            case = [f"model={model}", "preset=paper", "cluster=paper_hetero", "method=hap"]
            bench.sim_case(f"hap {model} paper, paper_hetero k=8, plan cache on", case, warm_plan=True)
    if "plan" in parts:
        bench.plan_command()
    if "main" in parts:
        bench.main_job()
    if "scale" in parts:
        for gpus, (v100, p100) in SCALES.items():
            case = ["model=bert", "preset=paper", "cluster=paper_hetero", "method=hap"]
            case += [f"cluster.machines.0.count={v100}", f"cluster.machines.1.count={p100}"]
            bench.sim_case(f"hap bert paper, {gpus:,} GPUs", case)
    if "auto" in parts:
        for model in args.models.split(","):
            case = [f"model={model}", "preset=paper", "cluster=paper_hetero", "method=auto"]
            bench.sim_case(f"auto {model} paper, paper_hetero k=8", case, plan_cache="method.hap")
        case = [*LLAMA_7B, "preset=paper", "cluster=paper_hetero", "method=auto"]
        bench.sim_case("auto Llama 7B shape paper, paper_hetero k=8", case, plan_cache="method.hap")
    if "auto_scale" in parts:  # the sizes Sailor (SOSP'25) reports its planning time at, and 1,024
        for gpus, (v100, p100) in AUTO_SCALES.items():
            case = ["model=bert", "preset=paper", "cluster=paper_hetero", "method=auto"]
            case += [f"cluster.machines.0.count={v100}", f"cluster.machines.1.count={p100}"]
            bench.sim_case(f"auto bert paper, {gpus:,} GPUs", case, plan_cache="method.hap")
    bench.print()
    return 0


if __name__ == "__main__":
    sys.exit(main())
