"""Critic updates per batch (``PPOConfig.num_critic_epochs``; verl's ``critic.ppo_epochs``, SAO's two
critic updates per batch): after an update's ``num_ppo_epochs`` joint PPO epochs, further shuffled
epochs over the same rollout train the critic alone.

The epochs of one update are numbered ``0 .. E - 1`` with ``E = num_critic_epochs`` (``num_ppo_epochs``
when None, :func:`total_epochs`): those below ``num_ppo_epochs`` are the joint epochs, the others
value-only (:func:`is_value_only`). Every epoch cuts its own shuffled order into the same
mini-batches, one optimizer step each, so the critic takes ``E * num_mini_batches`` steps per update and
the policy ``num_ppo_epochs * num_mini_batches``. A value-only step (``update.mini_batch_step`` with
``critic_only=True``, the trainer's ``compute_value_loss_terms``):

* its loss is ``losses.value_only_loss``: ``vf_coef *`` the clipped value loss against the update's
  returns, clipped around the rollout's old values, as in the joint epochs;
* its forward is the critic's own pass where the layout has one (a value model, a value adapter, a
  branch critic: ``models.values.value_forward``, no LM head, no policy layers above a branch);
  the shared value head reads the policy's own pass, which then runs whole (its logits unused);
* the policy's gradients are dropped before the step (``critic_warmup.drop_policy_gradients``, the
  warm-up's mechanism): no policy parameter, AdamW moment or weight decay moves. With the shared value
  head that leaves the head alone to train: the shared trunk (its LoRA adapter) is the policy's;
* gradients are not reduced by DDP in these steps (the policy's parameters get none, which DDP's
  reducer would wait for); :func:`average_critic_gradients` averages the critic's over the processes
  before clipping, as DDP would have.

A value-only step does not change the policy, so it does not advance ``policy_version``; the
learning-rate schedule steps once per update as always. Its statistics are kept under
:data:`STATS_PREFIX` and logged apart from the joint epochs' (:func:`critic_epoch_statistics`).

Example (three epochs for two joint ones: the last trains the critic alone):

>>> from types import SimpleNamespace
>>> args = SimpleNamespace(num_ppo_epochs=2, num_critic_epochs=3)
>>> [is_value_only(epoch, args) for epoch in range(total_epochs(args))]
[False, False, True]
"""

from __future__ import annotations

import torch
from torch import nn

from .critic_warmup import is_critic_parameter

# The key prefix of a value-only step's statistics in the update's per-micro-batch stats
STATS_PREFIX = "critic_epochs/"


def total_epochs(args) -> int:
    """The epochs of one update: ``num_critic_epochs``, or ``num_ppo_epochs`` when it is None."""
    return args.num_ppo_epochs if args.num_critic_epochs is None else args.num_critic_epochs


def is_value_only(epoch: int, args) -> bool:
    """Whether epoch ``epoch`` (0-based, of :func:`total_epochs`) trains the critic alone."""
    return epoch >= args.num_ppo_epochs


def critic_epoch_statistics(stats: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The value-only steps' figures of one update's stacked ``(n,)`` statistics, as 0-dim means:
    ``loss/value_critic_epochs_avg``, ``val/clipfrac_critic_epochs_avg`` and
    ``val/grad_norm_critic_epochs_avg`` (the critic's gradient norm before clipping); none without
    value-only steps.

    Example:
        >>> figures = critic_epoch_statistics({"critic_epochs/vf_loss": torch.tensor([1.0, 3.0]),
        ...     "critic_epochs/vf_clipfrac": torch.tensor([0.0, 0.5]), "critic_epochs/grad_norm": torch.tensor([2.0])})
        >>> {k: v.item() for k, v in figures.items()}  # doctest: +NORMALIZE_WHITESPACE
        {'loss/value_critic_epochs_avg': 2.0, 'val/clipfrac_critic_epochs_avg': 0.25,
         'val/grad_norm_critic_epochs_avg': 2.0}
        >>> critic_epoch_statistics({"vf_loss": torch.tensor([1.0])})
        {}
    """
    names = {"vf_loss": "loss/value_critic_epochs_avg", "vf_clipfrac": "val/clipfrac_critic_epochs_avg",
             "grad_norm": "val/grad_norm_critic_epochs_avg"}
    return {name: stats[STATS_PREFIX + key].mean() for key, name in names.items() if STATS_PREFIX + key in stats}


def average_critic_gradients(accelerator, model: nn.Module) -> None:
    """Replace the gradient of every trainable critic parameter of ``model`` (the unwrapped module,
    ``critic_warmup.is_critic_parameter``) by its mean over the processes, in place: what DDP's
    reduction does in a joint step. A parameter without a gradient counts as zeros on that process
    (every process reduces the same tensors, in the same order), and keeps None only where every
    process had none. Nothing happens on one process."""
    if accelerator.num_processes == 1:
        return
    params = [p for n, p in model.named_parameters() if p.requires_grad and is_critic_parameter(model, n)]
    if not params:
        return
    had = torch.tensor([float(p.grad is not None) for p in params], device=accelerator.device)
    grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in params]
    by_dtype: dict[torch.dtype, list[int]] = {}
    for i, g in enumerate(grads):
        by_dtype.setdefault(g.dtype, []).append(i)
    for indices in by_dtype.values():  # one collective per dtype
        flat = accelerator.reduce(torch.cat([grads[i].reshape(-1) for i in indices]), reduction="mean")
        for i, part in zip(indices, flat.split([grads[i].numel() for i in indices])):
            grads[i] = part.view_as(params[i])
    had = accelerator.reduce(had, reduction="sum")
    for p, g, any_had in zip(params, grads, had.tolist()):
        p.grad = g if any_had > 0 else None
