"""Print a method's plan for one case, readably: `python -m bench.plan <bench.run overrides>`.

    python -m bench.plan model=bert preset=paper cluster=paper_hetero method=hap
    python -m bench.plan model=vgg19 preset=paper cluster=paper_hetero method=hap --json plan.json

It plans (on the CPU, no workers) and simulates; it does not run or record anything. Methods
are instantiated from conf/ like bench.run does, so it knows no concrete method.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections import Counter
from typing import Any

from bench.core.cluster import ClusterSpec
from bench.core.interfaces import Plan
from bench.cost import GroupPipelineProgram, PipelineProgram, simulate, virtual_devices


def _layout(v: Any) -> str:
    return {"I": "I", "R": "R"}.get(v, f"G{v}") if isinstance(v, str) else f"G{v}"


def format_plan(
    plan: Plan, cluster: ClusterSpec, *, max_steps: int | None = 60, planner_time_s: float | None = None
) -> str:
    """The plan as text: ratios, predicted time and memory, collectives, per-op decisions."""
    d = plan.details
    lines = [f"method {plan.method} on {cluster.describe()}"]
    if planner_time_s is not None:
        cache = d.get("cache", {}).get("status")
        lines.append(f"planner time {planner_time_s:.2f} s" + (f" (cache {cache})" if cache else ""))
    for key in ("chosen", "granularity", "states_expanded", "states_pruned"):
        if key in d:
            lines.append(f"{key.replace('_', ' ')}: {d[key]}")
    cov = d.get("rule_coverage")
    if cov:
        missing = ", ".join(f"{op} x{n}" for op, n in cov.get("uncovered_ops", {}).items()) or "none"
        lines.append(
            f"sharding rules: {cov['ops_covered']} of {cov['ops']} ops ({100 * cov['ops_share']:.1f}%), "
            f"{100 * cov['flops_share']:.2f}% of FLOPs; ops without a rule, run replicated: {missing}"
        )
    if isinstance(plan.program, GroupPipelineProgram):
        lines += _group_pipeline_lines(plan.program, cluster)
    elif isinstance(plan.program, PipelineProgram):
        lines += _pipeline_lines(plan.program, cluster)
    elif plan.program is not None and plan.ratios is not None:
        sim = simulate(plan.program, cluster, plan.ratios)
        vdevs = virtual_devices(cluster, plan.program.granularity)
        lines.append(
            f"predicted iteration {sim.iter_time_s:.4f} s (compute {sim.compute_time_s:.4f} s, "
            f"communication {sim.comm_time_s:.4f} s before overlap); "
            f"peak memory {max(sim.peak_mem_gib):.2f} GiB/GPU" + ("  ** OOM **" if sim.oom else "")
        )
        lines.append("ratios (segment x virtual device):")
        for s, row in enumerate(plan.ratios):
            cells = " ".join(f"{r:.4f}" for r in row)
            lines.append(f"  [{s}] {cells}")
        lines.append(
            "virtual devices: "
            + ", ".join(f"{v.index}: {v.num_gpus} GPU(s) {v.flops / 1e12:.3g} TFLOP/s" for v in vdevs)
        )
        kinds: Counter = Counter()
        times: Counter = Counter()
        for st, (comm, _) in zip(plan.program.stages, sim.stage_times):
            for c in st.collectives:
                kinds[(c.kind, c.impl)] += 1
            if st.collectives:
                times[st.collectives[0].kind] += comm
        if kinds:
            lines.append("collectives: " + ", ".join(f"{k}/{i} x{n}" for (k, i), n in sorted(kinds.items())))
    lines.append(f"batch shares per rank: {plan.batch_shares}")
    steps = d.get("steps")
    if steps:
        lines.append(f"program ({len(steps)} ops; layouts I=Identity R=Reduce Gd=Gather(dim d)):")
        shown = steps if max_steps is None else [s for s in steps if _interesting(s)][:max_steps]
        for s in shown:
            pre = ",".join(_layout(p) for p in s["pre"])
            srcs = " ".join(f"{t}:{_layout(lay)}" for t, lay in s.get("sources", []))
            comms = "; ".join(
                f"{c['kind']}({c['tensor']} {_layout(c['src'])}->{_layout(c['dst'])}"
                + (f", {c['impl']}" if c.get("impl") not in (None, "ring") else "")
                + ")"
                for c in s.get("comms", [])
            )
            line = f"  {s['node']:<22} {s.get('op') or '':<14} {s['rule']:<22} ({pre}) -> {_layout(s['post'])}"
            if s.get("sfb"):
                line += "  [SFB]"
            if comms:
                line += f"  << {comms}"
            if srcs:
                line += f"  creates {srcs}"
            lines.append(line)
        if max_steps is not None and len(shown) < len(steps):
            lines.append(
                f"  ... {len(steps) - len(shown)} more ops without collectives or parameters (--all shows them)"
            )
    elif d:
        lines.append("details: " + json.dumps({k: v for k, v in d.items() if k != "program"}, default=str)[:2000])
    return "\n".join(lines)


def _pipeline_lines(program: PipelineProgram, cluster: ClusterSpec) -> list[str]:
    """A pipeline's stages (its layer groups, ranks, predicted compute and memory)."""
    sim = simulate(program, cluster, None)
    per_rank = f", {program.stages_per_rank} stages per rank" if program.stages_per_rank > 1 else ""
    lines = [
        _pipeline_headline(sim),
        f"{program.num_pipelines} pipeline(s) of {program.num_ranks} ranks{per_rank}, {program.schedule}, "
        f"{program.num_micro_batches} micro-batches of {'/'.join(map(str, program.micro_batches))} samples",
    ]
    for s, (st, (send, compute)) in enumerate(zip(program.stages, sim.stage_times)):
        peak = max(sim.peak_mem_gib[r] for r in st.ranks)
        lines.append(
            f"  stage {s}: layer groups {st.groups[0]}-{st.groups[1] - 1} on ranks {list(st.ranks)}, "
            f"compute {compute * 1e3:.2f} ms, sends {send * 1e3:.2f} ms, peak {peak:.2f} GiB"
        )
    return lines


def _pipeline_headline(sim) -> str:
    """A pipeline's predicted iteration and busiest GPU's peak (OOM marked)."""
    return f"predicted iteration {sim.iter_time_s:.4f} s; peak memory {max(sim.peak_mem_gib):.2f} GiB/GPU" + (
        "  ** OOM **" if sim.oom else ""
    )


def _group_pipeline_lines(program: GroupPipelineProgram, cluster: ClusterSpec) -> list[str]:
    """A pipeline of group stages (bench.cost.group_pipeline): each stage's group, predicted
    compute and peak."""
    sim = simulate(program, cluster, None)
    lines = [
        _pipeline_headline(sim),
        f"{program.num_pipelines} rank-aligned pipeline(s) of {program.num_stages} stages, each stage one program "
        f"over its group, {program.schedule}, {program.num_micro_batches} micro-batches of {program.micro_batch} "
        "samples a group",
    ]
    for s, (st, (send, compute)) in enumerate(zip(program.stages, sim.stage_times)):
        peak = max(sim.peak_mem_gib[r] for r in st.ranks)
        lines.append(
            f"  stage {s}: ranks {list(st.ranks)}, compute {compute * 1e3:.2f} ms, sends {send * 1e3:.2f} ms, "
            f"peak {peak:.2f} GiB"
        )
    return lines


def _interesting(step: dict) -> bool:
    """Steps worth reading: collectives, SFB, parameters created, or a non-batch layout."""
    return bool(step.get("comms") or step.get("sfb") or step.get("sources") or step.get("post") not in (0, "R"))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.plan", description=__doc__.splitlines()[0])
    parser.add_argument(
        "overrides", nargs="*", help="Hydra overrides, as for bench.run (model=... cluster=... method=...)"
    )
    parser.add_argument("--all", action="store_true", help="print every op, not only the interesting ones")
    parser.add_argument("--json", metavar="PATH", help="also write the plan (details, program, ratios) as JSON")
    from bench.core.errors import ConfigError
    from bench.core.plan_cache import plan_to_json
    from bench.runner.case import new_record, prepare_case
    from bench.runner.configs import check_group_choices, compose_settings, take_config_dirs

    try:
        argv = take_config_dirs(sys.argv[1:] if argv is None else argv)
    except ConfigError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    args = parser.parse_args(argv)
    try:
        check_group_choices(args.overrides)
        # The runner's own preparation (validation, host speed on emulated clusters, the plan);
        # mode=sim: nothing here needs the cluster's devices.
        cfg = compose_settings(*args.overrides, "mode=sim", "wandb.mode=disabled")
        record = new_record(cfg)
        case = prepare_case(cfg, record)
    except ValueError as exc:  # ConfigError and the planners' clear errors
        print(f"error: {exc}", file=sys.stderr)
        return 2
    plan, cluster, workload, elapsed = case.plan, case.cluster, case.workload, record.planner_time_s
    print(f"{workload.name} ({workload.preset}), global batch {workload.global_batch}")
    print(format_plan(plan, cluster, max_steps=None if args.all else 60, planner_time_s=elapsed))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(plan_to_json(plan), f, indent=1, default=str)
        print(f"plan written to {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
