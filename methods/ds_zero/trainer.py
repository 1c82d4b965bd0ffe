"""The DeepSpeed method's worker side: its trainer (the engine's forward, backward and step) and
deepspeed itself, imported late and set to the rank's device.

Only a worker (setup()) and the server workers fork from import deepspeed; planning never does.
"""

from __future__ import annotations

import torch
from torch import nn

from bench.core.interfaces import RankContext
from methods.common import micro_batches

INSTALL_HINT = "DS_BUILD_OPS=0 pip install deepspeed==0.19.8"


class DeepSpeedTrainer:
    """One iteration: engine forward, backward (gradient reduction inside), step; with
    gradient accumulation, forward and backward per micro-batch and the engine's step after
    each (DeepSpeed updates the parameters at the last).

    `full_model` (tests: the method's mirror_full_state): a copy of the model that each step
    writes the whole reduced gradients and the updated parameters into, by name (a dense model's;
    DeepSpeed's MoE layers have other names)."""

    def __init__(self, engine, ctx: RankContext, micro_steps: int = 1, full_model: nn.Module | None = None):
        self.engine = engine
        self.full_model = full_model
        self.emulator = ctx.emulator
        self.micro_steps = micro_steps
        # DeepSpeed averages gradients over ranks like DDP and divides each micro-step's loss by
        # the accumulation steps: scaling each micro-batch's summed loss by world_size x
        # micro_steps / (global loss terms) gives the gradient of the global mean loss.
        self.loss_scale = ctx.world_size * micro_steps / ctx.workload.targets_per_iter

    def forward_backward(self, batch: tuple[torch.Tensor, ...]) -> torch.Tensor:
        """Forward and backward over the rank's batch, one micro-batch at a time; the engine's
        step after all but the last (it counts the micro-steps there), so the gradients are
        reduced and readable when this returns."""
        losses = []
        parts = micro_batches(batch, self.micro_steps)
        for i, part in enumerate(parts):
            if i:
                self.engine.step()  # not the accumulation boundary: counts the micro-step
            loss_sum = self.engine(*part)
            self.emulator.stretch()  # forward compute
            self.engine.backward(loss_sum * self.loss_scale)
            self.emulator.stretch()  # backward compute after its last collective (DeepSpeed copies the reduced buckets back)
            losses.append(loss_sum.detach())
        return losses[0] if len(losses) == 1 else torch.stack(losses).sum()

    def optimizer_step(self) -> None:
        self.engine.step()  # ZeRO 1-3: Adam on this rank's partition, then parameter all-gather
        self.emulator.stretch()  # optimizer compute after the last collective

    def step(self, batch: tuple[torch.Tensor, ...]) -> torch.Tensor:
        loss = self.forward_backward(batch)
        grads = self._full_grads() if self.full_model is not None else None
        self.optimizer_step()
        if grads is not None:
            self._mirror(grads)
        return loss

    def _full_grads(self) -> dict[str, torch.Tensor]:
        """Every parameter's whole reduced gradient (ZeRO-1/2 assemble it from the ranks'
        partitions: a collective every rank calls)."""
        from deepspeed.utils import safe_get_full_grad

        return {n: safe_get_full_grad(p).detach().clone() for n, p in self.engine.module.named_parameters()}

    def _mirror(self, grads: dict[str, torch.Tensor]) -> None:
        import deepspeed

        named = list(self.engine.module.named_parameters())
        full = dict(self.full_model.named_parameters())
        with deepspeed.zero.GatheredParameters([p for _, p in named]), torch.no_grad():  # ZeRO-3: whole
            for n, p in named:
                if n in full:
                    full[n].copy_(p.detach())
                    full[n].grad = grads[n].to(full[n].dtype).reshape(full[n].shape)


def use_accelerator(device_type: str) -> None:
    """DeepSpeed's accelerator for this rank's device. Left to itself it picks CUDA whenever it
    sees a GPU and sets the device to the local rank, also for ranks that compute on the CPU.
    The harness hides the GPUs from those before CUDA starts (bench.runtime.worker.CPU_ONLY_ENV); this
    makes the choice explicit where a process saw them already (run_rank called in-process)."""
    from deepspeed.accelerator import get_accelerator, set_accelerator

    if get_accelerator().device_name() == device_type:
        return
    if device_type == "cuda":
        from deepspeed.accelerator.cuda_accelerator import CUDA_Accelerator as Accelerator
    else:
        from deepspeed.accelerator.cpu_accelerator import CPU_Accelerator as Accelerator
    set_accelerator(Accelerator())


def import_deepspeed():
    """import deepspeed, or one line that says what is wrong and how to install it."""
    try:
        import deepspeed
        import deepspeed.moe.layer
    except Exception as exc:  # a broken install fails in many ways (CUDA mismatch, missing ops)
        reason = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
        raise ImportError(
            f"method=deepspeed needs deepspeed, which is missing or broken ({type(exc).__name__}: "
            f"{reason}); install it with: {INSTALL_HINT}"
        ) from None
    return deepspeed


def skip_shm_comm_op(deepspeed) -> None:
    """Keep DeepSpeed from JIT-compiling its shared-memory comm op for CPU ranks.

    deepspeed.comm builds it (~40 s on first use, then cached in ~/.cache/torch_extensions)
    when it creates its torch backend, if the op is marked compatible; only
    inference_all_reduce uses it, and training falls back to torch.distributed without it.
    deepspeed.ops.__compatible_ops__ is one dict probed once per process, so marking the op
    incompatible before deepspeed.initialize is enough. GPU accelerators have no such op.
    """
    from deepspeed.accelerator import get_accelerator

    builder = get_accelerator().create_op_builder("ShareMemCommBuilder")
    if builder is not None:
        deepspeed.ops.__compatible_ops__[builder.NAME] = False
