"""Gradient norm and clipping for the optimizer step, without the work that changes nothing.

``torch.nn.utils.clip_grad_norm_`` (what ``Accelerator.clip_grad_norm_`` calls on one device
or under DDP) always multiplies every gradient by ``min(max_norm / (norm + 1e-6), 1)``, also
when that factor is exactly 1, so as not to read the norm back to the host. That pass reads
and writes every gradient: for a full fine-tune of a 97M-parameter policy and its value model
(188M gradients) it was ~0.09 s of a ~5 s PPO update on the CPU benchmark, a factor-1 multiply
that leaves every bit as it was. The trainer reads one scalar back per optimizer step anyway
(the non-finite guard), so here the norm is compared on the host and the gradients are scaled
only when the factor is below 1: the same gradients, bit for bit, as torch's function.

>>> import torch
>>> p, q = torch.nn.Parameter(torch.zeros(2)), torch.nn.Parameter(torch.zeros(1))
>>> p.grad, q.grad = torch.tensor([3.0, 0.0]), torch.tensor([4.0])  # norm sqrt(9 + 16) = 5
>>> clip_grad_norm_([p, q], max_norm=10.0).item(), p.grad.tolist()  # below: untouched
(5.0, [3.0, 0.0])
>>> clip_grad_norm_([p, q], max_norm=1.0).item(), [round(x, 4) for x in p.grad.tolist() + q.grad.tolist()]
(5.0, [0.6, 0.0, 0.8])
"""

from __future__ import annotations

import math
from collections.abc import Iterable

import torch

__all__ = ["clip_coefficient", "clip_grad_norm_", "clip_gradients", "scaler_found_inf", "skip_scaler_step"]

# torch.nn.utils.clip_grads_with_norm_ divides by (norm + this), so a zero norm needs no guard
_EPS = 1e-6


def clip_coefficient(total_norm: torch.Tensor, max_norm: float) -> torch.Tensor:
    """``max_norm / (total_norm + 1e-6)``, unclamped, as torch computes it: a 0-d tensor."""
    return float(max_norm) / (total_norm + _EPS)


def clip_grad_norm_(parameters: Iterable[torch.nn.Parameter], max_norm: float | None) -> torch.Tensor:
    """The 2-norm of all gradients (0-d float tensor, before clipping); when ``max_norm`` is a
    positive number and the norm exceeds it, every gradient is scaled in place by
    ``max_norm / (norm + 1e-6)``.

    Same norm and same resulting gradients as ``torch.nn.utils.clip_grad_norm_(parameters,
    max_norm)`` wherever the norm is finite (a factor >= 1 is torch's multiply by exactly 1,
    skipped here). A NaN norm leaves the gradients as they are (torch would multiply them by
    NaN); an infinite one zeroes them, as in torch. Either way the trainer skips the step.
    Parameters without a gradient are ignored; with none at all the norm is 0.
    """
    params = [p for p in parameters if p.grad is not None]
    if not params:
        return torch.zeros(())
    norm = torch.nn.utils.get_total_norm([p.grad for p in params], norm_type=2.0)
    if max_norm is not None and max_norm > 0 and bool(clip_coefficient(norm, max_norm) < 1.0):
        torch.nn.utils.clip_grads_with_norm_(params, max_norm, norm)
    return norm


def clip_gradients(accelerator, model: torch.nn.Module, max_grad_norm: float | None,
                   deepspeed: bool = False) -> torch.Tensor:
    """Clip the gradients of ``model``'s trainable parameters at ``max_grad_norm`` (when set)
    and return their 2-norm before clipping, a 0-d float32 tensor.

    On one device and under DDP: :func:`clip_grad_norm_` on the unscaled gradients (fp16: the
    norm of the true gradient; a no-op otherwise). FSDP and XLA shard the gradients, so
    accelerate's ``clip_grad_norm_`` takes their norm. Under DeepSpeed (``deepspeed``) the
    engine clipped at the same norm inside ``backward`` (``distributed.configure_deepspeed``)
    and reports the norm it saw (inf when it skipped; NaN here when it reports none).

    Example:
        >>> from types import SimpleNamespace
        >>> layer = torch.nn.Linear(2, 1, bias=False)
        >>> layer.weight.grad = torch.tensor([[3.0, 4.0]])
        >>> acc = SimpleNamespace(distributed_type="NO", unscale_gradients=lambda: None)
        >>> norm = clip_gradients(acc, layer, max_grad_norm=1.0)  # 5 before, scaled to 1
        >>> norm.item(), [round(g, 4) for g in layer.weight.grad[0].tolist()]
        (5.0, [0.6, 0.8])
    """
    from accelerate.utils import DistributedType

    if deepspeed:
        norm = accelerator.clip_grad_norm_(None, max_grad_norm)
        value = float("nan") if norm is None else float(norm)
        return torch.tensor(value, dtype=torch.float32, device=accelerator.device)
    params = [p for p in model.parameters() if p.requires_grad]
    if accelerator.distributed_type in (DistributedType.FSDP, DistributedType.XLA):
        norm = accelerator.clip_grad_norm_(params, max_grad_norm or math.inf)  # their own norms
    else:
        accelerator.unscale_gradients()  # fp16: the norm of the true gradient (a no-op otherwise)
        norm = clip_grad_norm_(params, max_grad_norm)  # scales only when the norm is above it
    return torch.as_tensor(norm).detach().float()


def scaler_found_inf(scaler, optimizer) -> bool:
    """Whether ``scaler.unscale_`` found an inf/NaN gradient of ``optimizer`` (accelerate's
    wrapper or the torch optimizer inside it) since the last ``update()``: the record
    ``GradScaler.step`` reads to decide to skip.

    Example:
        >>> scaler = torch.amp.GradScaler("cpu", enabled=True)
        >>> scaler_found_inf(scaler, torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=0.1))
        False
    """
    while hasattr(optimizer, "optimizer"):  # accelerate's wrapper
        optimizer = optimizer.optimizer
    state = scaler._per_optimizer_states.get(id(optimizer), {})
    return any(bool(v.item()) for v in state.get("found_inf_per_device", {}).values())


def skip_scaler_step(scaler, optimizer) -> None:
    """fp16 loss scaling: close a skipped optimizer step as ``GradScaler.step`` + ``update``
    would. No-op without an enabled ``scaler`` (bf16, fp32; DeepSpeed has its own).

    :func:`clip_gradients` unscaled the step's gradients; until ``update()`` the scaler refuses
    a second ``unscale_`` (the next step crashed) and its scale never shrank. An overflow
    (inf/NaN gradient, recorded by the unscale) backs the scale off; a non-finite loss whose
    gradients were finite backs it off too, as it is the same kind of event.

    Example:
        >>> p = torch.nn.Parameter(torch.ones(1))
        >>> optimizer, scaler = torch.optim.SGD([p], lr=0.1), torch.amp.GradScaler("cpu", init_scale=1024.0)
        >>> scaler.scale(p.sum()).backward()
        >>> scaler.unscale_(optimizer)  # finite gradients: a step skipped for a non-finite loss
        >>> skip_scaler_step(scaler, optimizer)
        >>> scaler.get_scale()  # backed off by the factor 0.5 all the same
        512.0
    """
    if scaler is None or not scaler.is_enabled():
        return
    if scaler_found_inf(scaler, optimizer):
        scaler.update()
    else:
        scaler.update(new_scale=scaler.get_scale() * scaler.get_backoff_factor())
