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

from collections.abc import Iterable

import torch

__all__ = ["clip_coefficient", "clip_grad_norm_"]

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
