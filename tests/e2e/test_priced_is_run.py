"""What the new methods' programs price is what their runtimes do: FSDP2's collectives (kind,
bytes per rank, order) and the pipeline's transfers (which micro-batch, which way, bytes, in
each rank's order, under single-stage and multi-stage schedules, pipelines at their own
micro-batch), its sharded state's collectives and its tied parameters' all-reduces, recorded
on real ranks, against the Program / PipelineProgram of the plan."""

from __future__ import annotations

import os
import socket

import pytest
import torch
import torch.distributed as dist

from bench.runner.case import new_record, prepare_case
from bench.runtime.launch import forking_context

pytestmark = pytest.mark.e2e


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _rank(rank: int, world: int, port: int, case, kind: str, out) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        from bench.core.interfaces import RankContext
        from bench.runtime.emulation import Emulator

        calls: list = []
        names = {
            "fsdp": ("all_gather_single", "reduce_scatter_single"),
            "pipeline": ("isend", "irecv"),
            "sharded": ("isend", "irecv", "all_gather_single", "reduce_scatter_single"),
            "tied": ("isend", "irecv", "all_gather_single", "reduce_scatter_single", "all_reduce"),
        }[kind]
        for name in names:
            original = getattr(dist, name)

            def wrapped(*args, _name=name, _original=original, **kwargs):
                tensor = args[1] if _name == "all_gather_single" else (args[0] if args else kwargs.get("tensor"))
                if _name == "reduce_scatter_single":
                    tensor = kwargs.get("output", args[0] if args else None)
                calls.append((_name, tensor.numel() * tensor.element_size()))
                return _original(*args, **kwargs)

            setattr(dist, name, wrapped)
            setattr(dist.distributed_c10d, name, wrapped)
        emulator = Emulator(case.cluster, rank, enabled=False)
        ctx = RankContext(rank, world, torch.device("cpu"), case.cluster, case.workload, emulator)
        trainer = case.method.setup(case.plan, case.workload.build(case.seed), ctx)
        data = case.workload.model_cfg.dataset("synthetic", None, "train", case.seed)
        for step in range(2):  # the second step: the first also sends the pipeline's metadata
            calls.clear()
            start, stop = (
                (case.plan.data_slices or [(0, 0)] * world)[rank]
                if kind != "fsdp"
                else (sum(case.plan.batch_shares[:rank]), sum(case.plan.batch_shares[: rank + 1]))
            )
            trainer.step(data.batch(step, start, stop, case.workload.global_batch))
        out.put((rank, calls))
        dist.barrier()
    finally:
        dist.destroy_process_group()


def _record(case, kind: str, world: int) -> dict[int, list]:
    ctx = forking_context()
    out = ctx.Queue()
    port = _port()
    procs = [ctx.Process(target=_rank, args=(r, world, port, case, kind, out)) for r in range(world)]
    for p in procs:
        p.start()
    got = dict(out.get(timeout=120) for _ in range(world))
    for p in procs:
        p.join(30)
    return got


# One case each (their ranks start in ~10 s): the unit tests check the programs of every model.
@pytest.mark.parametrize("model,method", [("vgg19", "fsdp_cp")])
def test_fsdp_runs_the_collectives_its_program_prices(cfg_factory, model, method):
    cfg = cfg_factory(f"model={model}", f"method={method}", "method.work_probe=false", "mode=sim")
    case = prepare_case(cfg, new_record(cfg))
    priced = [(c.kind, c.nbytes.const) for st in case.plan.program.stages for c in st.collectives]
    got = _record(case, "fsdp", 2)
    for rank, calls in got.items():
        # bytes per rank: a gather's input shard, a reduce-scatter's output shard
        ran = [("all_gather" if name == "all_gather_single" else "reduce_scatter", nbytes) for name, nbytes in calls]
        assert ran == priced, f"rank {rank}: ran {ran} priced {priced}"


@pytest.mark.parametrize(
    "overrides,world",
    [
        (("cluster=local_hetero2", "method.schedule=1f1b"), 2),
        # two stages per rank: the stages a rank holds pass their tensors in memory
        (("cluster=local_hetero2", "method.schedule=zbvzerobubble"), 2),
        # pipelines at their own micro-batch: each sends its own bytes
        (
            (
                "cluster=local_2x2",
                "method.stage_level=device",
                "method.alike=pipeline",
                "method.schedule=interleaved1f1b",
                "global_batch=16",
            ),
            4,
        ),
    ],
)
def test_the_pipeline_sends_what_its_program_prices_in_the_traced_order(cfg_factory, overrides, world):
    cfg = cfg_factory("model=bert", "method=pipeline", "method.profile=false", "mode=sim", *overrides)
    case = prepare_case(cfg, new_record(cfg))
    program = case.plan.program
    got = _record(case, "pipeline", world)
    for p in range(program.num_pipelines):
        for r, actions in enumerate(program.actions):
            expected = []
            for a in actions:
                if a[0] in ("send", "recv"):
                    _, _, what, k, _ = a
                    # the tensor is stage j's output: what k sends forward or receives back
                    j = k if (a[0] == "send") == (what == "act") else k - 1
                    nbytes = program.stages[j].work[p].send_bytes
                    expected.append(("isend" if a[0] == "send" else "irecv", nbytes))
            rank = program.position_ranks(r)[p]
            assert got[rank] == expected, f"pipeline {p}, position {r} (rank {rank})"
    assert len({w.send_bytes for w in program.stages[0].work}) == program.num_pipelines


def test_sharded_pipeline_stages_gather_and_scatter_where_their_program_prices_them(cfg_factory):
    """Each stage's replicas (two pipelines over local_2x2's machines) all-gather its parameters
    before the schedule and reduce-scatter its gradients after it, each rank its priced shard
    of the stage's bytes (FSDP2 pads each parameter's dim 0 to a multiple of the replicas),
    between the sends in the traced order."""
    cfg = cfg_factory(
        "model=bert",
        "cluster=local_2x2",
        "method=pipeline",
        "method.stage_level=machine",
        "method.schedule=1f1b",
        "method.sharded_state=true",
        "method.profile=false",
        "mode=sim",
        "global_batch=8",
    )
    case = prepare_case(cfg, new_record(cfg))
    program = case.plan.program
    assert program.sharded_state and program.num_pipelines == 2
    got = _record(case, "sharded", 4)
    kinds = {"send": "isend", "recv": "irecv", "gather": "all_gather_single", "scatter": "reduce_scatter_single"}
    for p in range(program.num_pipelines):
        for r, actions in enumerate(program.actions):
            rank = program.position_ranks(r)[p]
            ran = got[rank]
            assert [name for name, _ in ran] == [kinds[a[0]] for a in actions if a[0] in kinds], f"rank {rank}"
            for a, (_, nbytes) in zip([a for a in actions if a[0] in kinds], ran):
                if a[0] in ("gather", "scatter"):
                    assert nbytes == program.stages[a[1]].shard_bytes, (rank, a, nbytes)


@pytest.mark.parametrize(
    "overrides,world",
    [
        (("cluster=local_hetero2",), 2),
        # two pipelines, each stage's state sharded over its replicas: a copy's shard at its index
        (("cluster=local_2x2", "method.sharded_state=true", "global_batch=16"), 4),
        # two pipelines, replicated: the later holder's copy is in its replicas' buckets
        (("cluster=local_2x2", "global_batch=16"), 4),
    ],
)
def test_the_pipeline_all_reduces_a_tied_parameter_where_its_program_prices_it(cfg_factory, overrides, world):
    """GPT-2's embedding and head (one tensor) on a pipeline's first and last positions: each
    all-reduces its copy's gradient (its shard, with sharded state) with the other holder after
    the schedule, as many bytes as priced, in the traced order; replicated, each rank then
    all-reduces the buckets priced (the later holder's copy among its own parameters)."""
    pytest.importorskip("transformers", reason="model=hf needs the optional extra .[zoo]")
    cfg = cfg_factory(
        "model=hf",
        "model.arch=gpt2",
        "method=pipeline",
        "method.stage_level=device",
        "method.num_stages=2",
        "method.schedule=1f1b",
        "method.profile=false",
        "mode=sim",
        "global_batch=8",
        *overrides,
    )
    case = prepare_case(cfg, new_record(cfg))
    program = case.plan.program
    assert [t.positions for t in program.tied] == [(0, 1)]
    got = _record(case, "tied", world)
    kinds = {
        "send": "isend",
        "recv": "irecv",
        "gather": "all_gather_single",
        "scatter": "reduce_scatter_single",
        "tie": "all_reduce",
    }
    for p in range(program.num_pipelines):
        for r, actions in enumerate(program.actions):
            rank = program.position_ranks(r)[p]
            priced = [a for a in actions if a[0] in kinds]
            buckets = list(program.grad_buckets[r]) if program.grad_buckets else []
            assert [name for name, _ in got[rank]] == [kinds[a[0]] for a in priced] + ["all_reduce"] * len(buckets), (
                f"rank {rank}"
            )
            for a, (_, nbytes) in zip(priced, got[rank]):
                if a[0] == "tie":
                    assert nbytes == program.tied[a[1]].nbytes[p], (rank, a, nbytes)
            assert [nbytes for _, nbytes in got[rank][len(priced) :]] == buckets, f"rank {rank}"
