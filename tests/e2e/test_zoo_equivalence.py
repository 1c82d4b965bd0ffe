"""Programs the planner makes for zoo models (Hugging Face architectures from their configs, and
a user's own module) run on 2-3 gloo workers and train exactly like one device: the loss of every
step, the reassembled gradients and the parameters after 3 Adam steps (the checks of
test_hap_equivalence). The planner's own plans on shipped clusters (uneven shares, machine-level
data parallelism inside a machine), and programs synthesized at forced ratios with an empty
shard, where every op runs split."""

from __future__ import annotations

import numpy as np
import pytest

from bench.core.interfaces import Workload
from bench.cost.flops import train_flops_per_sample
from bench.runtime.hostcpu import emulated_device
from bench.runtime.launch import launch
from bench.runtime.pacing import RankHooks
from bench.runtime.worker import Case
from methods.hap.runtime import FixedPlanMethod
from tests.e2e import test_hap_equivalence as H
from tests.e2e.test_hap_equivalence import STEPS, _conf_cluster, check_equivalence, make_cluster, plan_at_ratios

pytestmark = pytest.mark.e2e
transformers = pytest.importorskip("transformers", reason="model=hf needs the optional extra .[zoo]")


def zoo_workload(arch: str, global_batch: int, config: dict | None = None) -> Workload:
    if arch == "custom":
        from models.custom import CustomModelConfig

        cfg = CustomModelConfig.from_preset(
            "tiny", factory="tests.zoo_custom:build_decoder", task="causal_lm", seq_len=16
        )
    else:
        from models.hf import HFModelConfig

        cfg = HFModelConfig.from_preset("tiny", arch=arch, seq_len=16, config=config or {})
    # batch norm over the whole batch, as the one device these programs are checked against
    return Workload(cfg.name, "tiny", cfg, global_batch, train_flops_per_sample(cfg), batch_norm="global")


def check(workload: Workload, results: list[dict], what: str) -> None:
    """check_equivalence against one device, then the largest differences seen (shown with -s).
    The device computes as the workers do, on one thread (docs/hap-runtime.md, "The equivalence test")."""
    with emulated_device():
        ref = H.single_device(workload, 0, STEPS, 5e-4, 0.0)
    check_equivalence(workload, results, reference=ref)
    losses, grads, params = ref[:3]
    dist = [sum(r["loss_sums"][i] for r in results) / workload.targets_per_iter for i in range(STEPS)]
    loss_err = max(abs(a - b) / abs(b) for a, b in zip(dist, losses))
    scale = max(g.abs().max().item() for g in grads.values())
    grad_err = max(float(abs(np.asarray(results[0]["grads"][n]) - g.numpy()).max()) for n, g in grads.items()) / scale
    param_err = max(float(abs(np.asarray(results[0]["params"][n]) - p.numpy()).max()) for n, p in params.items())
    print(
        f"\nequivalence {what}: loss rel {loss_err:.1e}, "
        f"grad max abs / largest grad {grad_err:.1e}, param max abs {param_err:.1e} after {STEPS} steps"
    )


def run(workload: Workload, cluster, plan, **options) -> list[dict]:
    method = FixedPlanMethod(plan, mirror_full_state=True, **options)
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
    return launch(case, cluster.num_devices, timeout_s=180)


# The planner's plans (LP ratios, its choice of program, its gradient buckets): a decoder LLM, a
# CNN with batch norm (statistics all-reduced over the batch's shards), on two devices of speeds
# 1 and 0.4, an encoder with a masked-LM head on three machines of 1, 2 and 1 devices (data
# parallel inside a machine), and encoder-decoders with T5's relative position bias (made in the
# first layer, read by every layer, passed to transformers' SDPA as the mask), RMS norm and a tied
# head scaled by d_model**-0.5 (T5, mT5); 11 samples, so every share is uneven. T5's feed-forward
# is gated as mT5's: its ReLU turns rounding into a gradient difference (docs/hap-runtime.md,
# "The equivalence test"). Their decoders at two layers, as their encoders (the tiny preset keeps
# the decoder's own depth).
DECODER = {"num_decoder_layers": 2}
PLANNED = [
    pytest.param("gpt2", "local_hetero2", None, id="gpt2-local_hetero2"),
    pytest.param("resnet", "local_hetero2", None, id="resnet-local_hetero2"),
    pytest.param("bert", "local_3m", None, id="bert-local_3m"),
    pytest.param("t5", "local_hetero2", {"feed_forward_proj": "gated-gelu", **DECODER}, id="t5-local_hetero2"),
    pytest.param("mt5", "local_hetero2", DECODER, id="mt5-local_hetero2"),
]


@pytest.mark.parametrize("arch,cluster_name,config", PLANNED)
def test_the_planners_program_for_a_zoo_model_trains_exactly_like_one_device(arch, cluster_name, config):
    from methods.hap.planner import HapPlanner

    cluster = _conf_cluster(cluster_name)
    workload = zoo_workload(arch, 11, config)
    plan = HapPlanner(cache_dir=None).plan(workload, cluster)
    assert sum(plan.batch_shares) == 11 and len(set(plan.batch_shares)) > 1
    check(workload, run(workload, cluster, plan), f"{arch} on {cluster_name}, shares {plan.batch_shares}")


# Synthesized at forced ratios with an empty shard on 3 devices: the ops run split (SFB linears,
# grouped or padded gathers), as the planner would run them at other speeds: Llama (grouped
# key/value heads, rotary embeddings, RMS norm) and a user's own module behind a task adapter.
FORCED = [
    pytest.param("llama", [0.45, 0.55, 0.0], dict(force_impl="padded", force_sfb=True), id="llama-3dev-empty2-sfb"),
    pytest.param("custom", [0.3, 0.0, 0.7], dict(force_impl="grouped", force_sfb=True), id="custom-3dev-empty1-sfb"),
]


@pytest.mark.parametrize("arch,ratios,options", FORCED)
def test_a_program_at_forced_ratios_for_a_zoo_model_trains_exactly_like_one_device(arch, ratios, options):
    workload = zoo_workload(arch, 7)
    cluster = make_cluster(len(ratios))
    with pytest.MonkeyPatch.context() as mp:  # the planner's beam: an exact search of a deep graph explodes
        exact = H.synthesize
        mp.setattr(H, "synthesize", lambda theory, cost: exact(theory, cost, beam_width=40))
        plan = plan_at_ratios(workload, cluster, ratios)
    assert (0 in plan.batch_shares) == (0.0 in ratios)
    check(workload, run(workload, cluster, plan, **options), f"{arch} at ratios {ratios}, shares {plan.batch_shares}")
