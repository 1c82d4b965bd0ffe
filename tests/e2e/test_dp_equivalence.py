"""One DDP step with uneven shares on 2 emulated devices == one step on the whole batch."""

import numpy as np
import pytest
import torch

from bench.launch import launch
from bench.run import new_record, prepare_case

pytestmark = pytest.mark.e2e


def _single_device_step(case):
    workload = case.workload
    model = workload.build(case.seed)
    data = workload.model_cfg.dataset("synthetic", None, "train", case.seed)
    batch = data.batch(0, 0, workload.global_batch, workload.global_batch)
    optimizer = torch.optim.Adam(model.parameters(), lr=case.method.lr)
    loss = model(*batch) / workload.targets_per_iter
    loss.backward()
    grads = {n: p.grad.detach().clone() for n, p in model.named_parameters()}
    optimizer.step()
    return loss.item(), grads, dict(model.named_parameters())


@pytest.mark.parametrize("method", ["dp_ev", "dp_cp"])
@pytest.mark.parametrize("model", ["vgg19", "vit", "bert", "bert_moe"])
def test_one_dp_step_with_uneven_shares_equals_single_device_training(cfg_factory, model, method):
    cfg = cfg_factory(f"model={model}", f"method={method}", "global_batch=7",
                      "warmup_iters=0", "measured_iters=1")
    case = prepare_case(cfg, new_record(cfg))
    assert len(set(case.plan.batch_shares)) == 2 and sum(case.plan.batch_shares) == 7
    case.return_state = True
    results = launch(case, 2, timeout_s=120)

    loss, grads, params = _single_device_step(case)
    dist_loss = sum(r["loss_sums"][0] for r in results) / case.workload.targets_per_iter
    assert dist_loss == pytest.approx(loss, rel=1e-5)
    got = results[0]["grads"]
    assert set(got) == set(grads)
    # fp32 sums in another order differ by a few ulps of the terms summed, not of the result:
    # the absolute floor is relative to the model's largest gradient.
    scale = max(g.abs().max().item() for g in grads.values())
    for name, ref in grads.items():
        np.testing.assert_allclose(got[name], ref.numpy(), rtol=1e-5, atol=1e-5 * scale,
                                   err_msg=name)
    for name, ref in params.items():  # after one Adam step
        if grads[name].abs().max() < 1e-3 * scale:
            # A gradient that is zero in exact arithmetic (e.g. attention's key bias: softmax
            # ignores a shift shared by all keys) is float noise, which Adam scales up to +-lr.
            continue
        np.testing.assert_allclose(results[0]["params"][name], ref.detach().numpy(),
                                   rtol=1e-5, atol=1e-6, err_msg=name)
