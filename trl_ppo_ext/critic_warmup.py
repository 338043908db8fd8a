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

import torch
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


def split_critic_groups(optimizer: torch.optim.Optimizer, model: nn.Module, multiplier: float) -> None:
    """Give the critic's parameters (:func:`is_critic_parameter`) of every param group of a new
    ``optimizer`` (no state yet) a group of their own: a copy of the group's settings with
    ``lr * multiplier``. Called before the learning-rate scheduler is built, so the scheduler's
    per-group base rates keep the ratio through warm-up and decay. The policy's parameters keep
    their group's settings; a group with no critic parameter is left as it was, and the order of
    the parameters inside each part is kept.

    Example:

    >>> from types import SimpleNamespace
    >>> model = nn.ModuleDict({"policy": nn.Linear(2, 2), "value_model": nn.Linear(2, 1)})
    >>> optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    >>> split_critic_groups(optimizer, model, 5.0)
    >>> [(len(g["params"]), g["lr"]) for g in optimizer.param_groups]
    [(2, 0.1), (2, 0.5)]
    """
    names = {id(p): n for n, p in model.named_parameters()}
    groups, optimizer.param_groups = optimizer.param_groups, []
    for group in groups:
        critic = [p for p in group["params"] if is_critic_parameter(model, names[id(p)])]
        policy = [p for p in group["params"] if not is_critic_parameter(model, names[id(p)])]
        for params, scale in ((policy, 1.0), (critic, multiplier)):
            if params:
                optimizer.add_param_group({**group, "params": params, "lr": group["lr"] * scale})


def drop_policy_gradients(model: nn.Module) -> int:
    """Set ``.grad = None`` on every policy parameter of ``model`` (see the module docstring);
    the number of tensors whose gradient was dropped."""
    dropped = 0
    for name, param in model.named_parameters():
        if param.grad is not None and not is_critic_parameter(model, name):
            param.grad = None
            dropped += 1
    return dropped


def check_supported(args, deepspeed: bool, fsdp: bool = False) -> None:
    """Refuse a critic warm-up under DeepSpeed: its engine steps inside ``backward``, before the
    policy's gradients could be dropped (:func:`drop_policy_gradients`); critic epochs
    (``num_critic_epochs``) under DeepSpeed for the same reason, and under FSDP (``fsdp``, or
    ``args.fsdp``), where their value pass runs outside the wrapped forward and their gradients are
    averaged by hand (``critic_epochs``); and a critic learning-rate multiplier under DeepSpeed or
    FSDP, where its groups are not checked. Raises ``ValueError`` naming the field."""
    fsdp = fsdp or bool(getattr(args, "fsdp", None))
    if getattr(args, "critic_lr_multiplier", 1.0) != 1.0 and (deepspeed or fsdp):
        raise ValueError(
            f"PPOConfig.critic_lr_multiplier={args.critic_lr_multiplier} is not supported under DeepSpeed or FSDP "
            "(the critic's optimizer groups are not checked there). Set critic_lr_multiplier=1.0."
        )
    if args.critic_warmup_steps > 0 and deepspeed:
        raise ValueError(
            f"PPOConfig.critic_warmup_steps={args.critic_warmup_steps} is not supported under DeepSpeed "
            "(the engine applies the optimizer step inside backward, so the policy cannot be held still). "
            "Set critic_warmup_steps=0, or train without DeepSpeed."
        )
    epochs = getattr(args, "num_critic_epochs", None)
    if epochs is not None and epochs > args.num_ppo_epochs and (deepspeed or fsdp):
        where, why = (("DeepSpeed", "the engine applies the optimizer step inside backward, so the policy cannot "
                       "be held still") if deepspeed else
                      ("FSDP", "the value-only steps run the critic's pass outside the sharded forward and "
                       "average its gradients themselves, which is not checked on sharded parameters"))
        raise ValueError(
            f"PPOConfig.num_critic_epochs={epochs} is not supported under {where} ({why}). Set "
            f"num_critic_epochs=None, or train without {where}."
        )
