"""On one CUDA GPU: every method on a real one-GPU cluster and on two MPS ranks, every method
clipping its gradients under NCCL, out-of-memory rows, MPS speed shares, and HAP under MPS
training exactly like one device.

Marked gpu: tests/conftest.py skips them where torch sees no CUDA device. scripts/gpu-check
runs them and the main job on local_gpu_hetero2.
"""

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from bench.core.cluster import ClusterSpec
from bench.records.rows import load_records
from bench.runner.configs import group_options
from bench.runtime.launch import launch
from bench.runtime.pacing import RankHooks
from bench.runtime.worker import Case
from methods.hap.runtime import FixedPlanMethod
from tests.e2e.test_hap_equivalence import STEPS, check_equivalence, make_workload, plan_at_ratios

pytestmark = pytest.mark.gpu
ROOT = Path(__file__).resolve().parents[2]
QUICK = ["warmup_iters=1", "measured_iters=3", "wandb.mode=disabled"]
METHODS = ",".join(group_options("method"))  # every method conf/method has, a new one included
MAIN_JOB_TABLE = "main_local_gpu_hetero2.txt"


def run(module, *args, results_dir, timeout=900):
    cmd = [sys.executable, "-m", module, *args, f"results_dir={results_dir}"]
    return subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=timeout, env=os.environ)


def rows(results_dir):
    return load_records(Path(results_dir) / "records.jsonl")


def test_every_method_trains_on_two_mps_ranks_of_one_gpu(tmp_path):
    # the README's main job on local_gpu_hetero2; scripts/gpu-check prints its table
    out = run("bench.compare", "cluster=local_gpu_hetero2", "repeats=1", *QUICK, results_dir=tmp_path)
    if os.environ.get("HETBENCH_GPU_CHECK_DIR"):
        (Path(os.environ["HETBENCH_GPU_CHECK_DIR"]) / MAIN_JOB_TABLE).write_text(out.stdout)
    got = {r["method"]: r for r in rows(tmp_path)}
    assert set(got) == set(METHODS.split(",")), out.stderr[-3000:]
    for method, r in got.items():
        assert r["status"] == "ok", (method, (r["error"] or "")[-1500:])
        assert [h["mps_active_thread_percentage"] for h in r["rank_hardware"]] == [71, 28]
        assert r["emulation"]["device"] == "cuda" and r["emulation"]["headroom"] == 1.0
    assert out.returncode == 0, out.stderr[-3000:]


def test_a_real_out_of_memory_is_an_oom_row_with_its_peak(tmp_path):
    # BERT-Base at 8192 samples keeps several hundred GiB of activations: far past any card.
    out = run(
        "bench.run",
        "cluster=h100x1",
        "model=bert",
        "preset=paper",
        "global_batch=8192",
        "method=dp_ev",
        "warmup_iters=0",
        "measured_iters=1",
        "wandb.mode=disabled",
        results_dir=tmp_path,
    )
    [r] = rows(tmp_path)
    assert r["status"] == "oom", (r["error"] or "")[-2000:]
    assert "OutOfMemoryError" in r["error"] and r["oom_rank"] == 0
    assert r["peak_mem_gib"][0] > 1 and r["samples_per_s"] is None
    assert out.returncode != 0 and "case recorded as oom" in out.stderr


def test_mps_ranks_achieve_their_configured_speed_ratio(tmp_path):
    out = run("bench.run", "cluster=local_gpu_hetero2", "method=dp_ev", *QUICK, results_dir=tmp_path)
    [r] = rows(tmp_path)
    assert r["status"] == "ok", out.stderr[-3000:]
    fast, slow = r["emulation"]["ranks"]
    assert fast["speed"] == 1.0 and slow["speed"] == 0.4
    assert fast["achieved_speed"] / slow["achieved_speed"] == pytest.approx(1.0 / 0.4, rel=0.05)


def _single_device_on_gpu(workload, lr=5e-4):
    """single_device of test_hap_equivalence, on the GPU in fp32 (TF32 off, as the ranks)."""
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    model = workload.build(0).cuda()
    data = workload.model_cfg.dataset("synthetic", None, "train", 0)
    opt = torch.optim.Adam(model.parameters(), lr=lr)
    losses, batch = [], workload.global_batch
    for it in range(STEPS):
        opt.zero_grad(set_to_none=True)
        loss = model(*(t.cuda() for t in data.batch(it, 0, batch, batch))) / workload.targets_per_iter
        loss.backward()
        losses.append(loss.item())
        opt.step()
    grads = {n: p.grad.detach().cpu() for n, p in model.named_parameters() if p.grad is not None}
    return losses, grads, {n: p.detach().cpu() for n, p in model.named_parameters()}


def test_hap_on_two_mps_ranks_trains_exactly_like_one_device():
    workload = make_workload("bert", 2, 7)
    cluster = ClusterSpec.from_config(
        {
            "name": "gpu2",
            "emulated": True,
            "device": "cuda",
            "virtual_device": "gpu",
            "machines": [{"count": 1, "device": "H100-80", "num_devices": 1, "speed": s} for s in (1.0, 0.4)],
            "links": {
                level: {"bandwidth_gbps": 1.0, "latency_s": 5e-5} for level in ("intra_machine", "inter_machine")
            },
        }
    )
    plan = plan_at_ratios(workload, cluster, [0.6, 0.4])
    method = FixedPlanMethod(plan, mirror_full_state=True)
    case = Case(
        workload,
        cluster,
        method,
        method.plan(workload, cluster),
        seed=0,
        warmup_iters=0,
        measured_iters=STEPS,
        hooks=RankHooks(return_state=True),
    )
    results = launch(case, 2, timeout_s=300)
    assert all(r["hardware"]["device"] == "cuda" for r in results)
    check_equivalence(workload, results, reference=_single_device_on_gpu(workload))


@pytest.mark.parametrize("model", ["vgg19", "vit", "bert", "bert_moe"])
def test_every_method_trains_the_model_on_one_real_gpu(tmp_path, model):
    # one test per model, so that pytest -n spreads the models' cases over processes
    out = run("bench.run", "-m", "cluster=h100x1", f"model={model}", f"method={METHODS}", *QUICK, results_dir=tmp_path)
    got = rows(tmp_path)
    assert len(got) == len(METHODS.split(",")), out.stderr[-3000:]
    failed = [(r["model"], r["method"], (r["error"] or "")[-500:]) for r in got if r["status"] != "ok"]
    assert not failed, failed
    name = torch.cuda.get_device_name(0)
    for r in got:
        [hw] = r["rank_hardware"]
        assert hw["device"] == "cuda" and hw["name"] == name and hw["memory_gib"] > 1
        assert hw["cuda"] == torch.version.cuda and hw["nccl"]
        assert r["precision"]["matmul_allow_tf32"] is False and r["emulation"] is None


def test_every_method_clips_its_gradients_with_nccl_on_one_real_gpu(tmp_path):
    # NCCL reduces CUDA tensors only, even on one rank: a global norm summed into a CPU tensor
    # fails here (the pipeline's and hap's clipping; tests/e2e/test_methods_on_meta.py catches
    # it on a CPU with the meta device). One stage for the pipeline, whose model is exported
    # with its sample moved to the GPU.
    out = run(
        "bench.run",
        "-m",
        "cluster=h100x1",
        "model=bert",
        f"method={METHODS}",
        "method.grad_clip=0.05",
        *QUICK,
        results_dir=tmp_path,
    )
    got = {r["method"]: r for r in rows(tmp_path)}
    assert set(got) == set(METHODS.split(",")), out.stderr[-3000:]
    failed = {m: (r["error"] or "")[-500:] for m, r in got.items() if r["status"] != "ok"}
    assert not failed, failed
    assert all(r["config"]["method"]["grad_clip"] == 0.05 for r in got.values())


def test_every_method_runs_its_forward_matmuls_in_bf16_on_a_gpu_when_asked(tmp_path):
    # DeepSpeed's engine switches an outer CUDA autocast off in forward unless its own config
    # enables torch_autocast: on the CPU that cannot show, here it does. The dtypes are those
    # the first (warm-up) step's matrix products made on the rank (bench.runtime.precision).
    out = run(
        "bench.run",
        "-m",
        "cluster=h100x1",
        "model=bert",
        f"method={METHODS}",
        "precision=bf16",
        "warmup_iters=1",
        "measured_iters=2",
        "wandb.mode=disabled",
        results_dir=tmp_path,
    )
    got = {r["method"]: r for r in rows(tmp_path)}
    assert set(got) == set(METHODS.split(",")), out.stderr[-3000:]
    seen = {m: (r["status"], r["precision"] and r["precision"]["forward_matmul_dtypes"]) for m, r in got.items()}
    assert all(status == "ok" and dtypes and set(dtypes) == {"bfloat16"} for status, dtypes in seen.values()), seen


def test_the_libraries_workspace_is_measured_and_a_steps_peak_holds_it():
    """bench.runtime.probes.workspace_bytes in a fresh process: what cuBLAS keeps after a first matrix
    product; a step after it keeps no more than its tensors (the workspace is made once)."""
    code = (
        "import torch\n"
        "from bench.runtime.probes import workspace_bytes\n"
        "w = workspace_bytes('cuda', torch.cuda.memory_allocated())\n"
        "torch.cuda.reset_peak_memory_stats()\n"
        "base = torch.cuda.memory_allocated()\n"
        "x = torch.randn(64, 256, device='cuda', requires_grad=True)\n"
        "layer = torch.nn.Linear(256, 256, device='cuda')\n"
        "layer(x).sum().backward()\n"
        "print(w, torch.cuda.memory_allocated() - base)\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=300, env=os.environ
    )
    assert out.returncode == 0, out.stderr[-2000:]
    workspace, live = (int(v) for v in out.stdout.split())
    assert 0 < workspace < 2**30
    tensors = (64 * 256 + 256 * 256 + 256) * 4 * 2  # x, weight, bias and their gradients
    assert live <= tensors + 2**16
