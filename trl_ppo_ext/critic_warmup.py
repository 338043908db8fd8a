"""Critic warm-up (VAPO's value pre-training): for the first updates only the value
function trains, so the policy's first steps use advantages from a critic that has seen the
task.

:func:`warming` decides from the run's counters (``run_state.RunCounters``) whether the next
update warms the critic: fewer than ``critic_warmup_steps`` warm-up updates done, and the warm-up
not ended early by ``val/explained_variance >= critic_warmup_explained_variance`` (a gathered
metric, so the decision is the same on every process). :func:`record_update` advances the
counters after an update. :func:`drop_policy_gradients` sets the policy's ``.grad`` to None
before the optimizer step: a parameter without a gradient is skipped by torch's optimizers, so
neither its weight (AdamW's decay included) nor its optimizer state moves, and gradient
clipping, which skips None gradients too, sees the critic's parameters only.

Which parameters are the critic's: the value model's (``PolicyAndValue``, separate models), or
the value head and the value adapter's (``SharedActorCritic``); every other trainable parameter
is the policy's (the shared backbone's policy adapter included).

Example:

>>> from types import SimpleNamespace
>>> from trl_ppo_ext.critic_warmup import record_update, warming
>>> from trl_ppo_ext.run.state import RunCounters
>>> args, counters = SimpleNamespace(critic_warmup_steps=3, critic_warmup_explained_variance=0.5), RunCounters()
>>> [warming(args, counters), record_update(args, counters, explained_variance=0.1), warming(args, counters)]
[True, True, True]
>>> record_update(args, counters, explained_variance=0.7), warming(args, counters), counters.critic_warmup_updates
(False, False, 2)
"""

from __future__ import annotations

import torch.nn as nn

from .models.actor_critic import VALUE_ADAPTER_NAME


def warming(args, counters) -> bool:
    """Whether the next update trains the critic only (``args``: ``critic_warmup_steps``;
    ``counters``: ``critic_warmup_updates``, ``critic_warmup_over``)."""
    return not counters.critic_warmup_over and counters.critic_warmup_updates < args.critic_warmup_steps


def record_update(args, counters, explained_variance: float) -> bool:
    """After a warm-up update: count it, and end the warm-up when it has taken
    ``critic_warmup_steps`` updates or ``explained_variance`` (the update's gathered
    ``val/explained_variance``) reached ``critic_warmup_explained_variance``. Returns whether
    the warm-up goes on."""
    counters.critic_warmup_updates += 1
    threshold = args.critic_warmup_explained_variance
    reached = threshold is not None and explained_variance >= threshold  # nan never reaches it
    if reached or counters.critic_warmup_updates >= args.critic_warmup_steps:
        counters.critic_warmup_over = True
    return not counters.critic_warmup_over


def is_critic_parameter(model: nn.Module, name: str) -> bool:
    """Whether parameter ``name`` of ``model`` (a ``PolicyAndValue`` or ``SharedActorCritic``,
    names as ``model.named_parameters()`` gives them) belongs to the value function."""
    if getattr(model, "is_actor_critic", False):
        return name.startswith("value_head.") or f".{VALUE_ADAPTER_NAME}." in f".{name}."
    return name.startswith("value_model.")


def drop_policy_gradients(model: nn.Module) -> int:
    """Set ``.grad = None`` on every policy parameter of ``model`` (see the module docstring);
    the number of tensors whose gradient was dropped."""
    dropped = 0
    for name, param in model.named_parameters():
        if param.grad is not None and not is_critic_parameter(model, name):
            param.grad = None
            dropped += 1
    return dropped


def check_supported(args, deepspeed: bool) -> None:
    """Refuse a critic warm-up under DeepSpeed: its engine steps inside ``backward``, before the
    policy's gradients could be dropped (:func:`drop_policy_gradients`). Raises ``ValueError``
    naming the field."""
    if args.critic_warmup_steps > 0 and deepspeed:
        raise ValueError(
            f"PPOConfig.critic_warmup_steps={args.critic_warmup_steps} is not supported under DeepSpeed "
            "(the engine applies the optimizer step inside backward, so the policy cannot be held still). "
            "Set critic_warmup_steps=0, or train without DeepSpeed."
        )
