"""The trainer's models from what its constructor is given: one module whose forward gives
``(logits, values)``, the reference model (or none: the policy with its adapter off), and the
context in which the policy acts as that reference.

TRL's ``PPOTrainer`` takes ``model``, ``ref_model``, ``value_model`` and ``peft_config``; which
combinations make sense, and what each becomes:

=====================  ==================  ===============  ======================================
``model``              ``value_model``     ``peft_config``  assembled as
=====================  ==================  ===============  ======================================
``SharedActorCritic``  None                None             itself
causal LM / PeftModel  None                given / None     ``SharedActorCritic`` (shared backbone)
causal LM              a scorer            given / None     ``PolicyAndValue`` (LoRA'd when given)
=====================  ==================  ===============  ======================================

``value_adapter=True`` (``PPOConfig.use_value_adapter``): a causal LM with ``peft_config``, or a
``PeftModel``, and no ``value_model`` -> ``SharedActorCritic`` whose critic has its own LoRA adapter
(:func:`value_adapter_config` of the policy's), the layout ``docs/critic.md`` recommends for long credit.
``value_branch_layer=k`` (``PPOConfig.value_branch_layer``) with it: that adapter on the layers from ``k`` up
only, the critic branching from the policy's pass there (``models.branch_critic``).

Without a critic (``with_value=False``: an advantage estimator that reads no value), no value
parameter exists anywhere and a ``value_model`` is ignored with a warning:

=====================  ===============  ==============================================
``model``              ``peft_config``  assembled as
=====================  ===============  ==============================================
``SharedActorCritic``  None             itself, if built with ``with_value=False``
causal LM / PeftModel  given / None     ``SharedActorCritic(..., with_value=False)``
causal LM              None             ``PolicyAndValue(model, None)`` (full training)
=====================  ===============  ==============================================

Example:

>>> from trl_ppo_ext.models.assembly import build_policy_and_value
>>> from trl_ppo_ext.tiny import build_tiny_causal_lm, build_tiny_scorer, build_tiny_tokenizer
>>> tok = build_tiny_tokenizer()
>>> type(build_policy_and_value(build_tiny_causal_lm(tok), build_tiny_scorer(tok), None)).__name__
'PolicyAndValue'
"""

from __future__ import annotations

import copy
import logging
import warnings
from collections.abc import Iterable, Iterator
from contextlib import contextmanager

from torch import nn

from .policy_value import PolicyAndValue

__all__ = [
    "build_policy_and_value", "build_reference", "check_separate_reference", "checkpointing_kwargs",
    "reference_adapter", "value_adapter_config",
]


def build_policy_and_value(model: nn.Module, value_model: nn.Module | None, peft_config=None, *,
                           with_value: bool = True, value_adapter: bool = False,
                           value_branch_layer: int | None = None) -> nn.Module:
    """``model`` + ``value_model`` (+ ``peft_config``) -> one module whose forward gives
    ``(logits (B, L, V), values (B, L))``: a ``SharedActorCritic`` or a ``PolicyAndValue`` pair
    (see the module's tables). ``get_peft_model`` wraps ``model`` in place when ``peft_config``
    is given with a separate ``value_model``.

    ``with_value=False``: the critic-free module (second table); its ``has_value`` is False and
    its values are 0. A ``value_model`` given anyway is not used (``UserWarning``).
    ``value_adapter=True``: the critic gets a LoRA adapter of its own (:func:`_build_value_adapter`);
    ``value_branch_layer``: that adapter on the layers above this one only, the critic branching from
    the policy's pass (``models.branch_critic``); it needs ``value_adapter=True``.

    Raises:
        ValueError: a combination of the table's columns that is not in it, naming the
            arguments and which to drop.
    """
    from peft import PeftModel, get_peft_model

    if value_branch_layer is not None and not (with_value and value_adapter):
        raise ValueError(
            f"value_branch_layer={value_branch_layer} places the critic's own adapter above a layer of the policy's "
            f"pass, and {'no critic is trained' if not with_value else 'use_value_adapter=False'}. Set "
            "use_value_adapter=True (with advantage_estimator='gae'), or value_branch_layer=None.")
    if not with_value:
        return _build_policy_only(model, value_model, peft_config)
    if value_adapter:
        return _build_value_adapter(model, value_model, peft_config, value_branch_layer)
    if getattr(model, "is_actor_critic", False):
        if value_model is not None:
            raise ValueError(
                "`model` is a shared-backbone actor-critic, which has its own value head, and a separate "
                "`value_model` was passed too. Pass value_model=None, or pass a plain policy model."
            )
        if peft_config is not None:
            raise ValueError(
                "`model` is a SharedActorCritic, which already carries its LoRA adapter, and `peft_config` was "
                "passed too. Pass peft_config=None (set LoRA options when building the actor-critic)."
            )
        return model
    if value_model is None:
        from .actor_critic import SharedActorCritic

        if peft_config is None and not isinstance(model, PeftModel):
            raise ValueError(
                "value_model=None asks for a shared-backbone value head, which trains a LoRA adapter; pass "
                "`peft_config` (e.g. peft.LoraConfig(task_type='CAUSAL_LM')), or pass a `value_model`."
            )
        return SharedActorCritic(model, lora_config=peft_config)
    policy = model
    if peft_config is not None:
        if isinstance(model, PeftModel):
            raise ValueError(
                "`model` is already a PeftModel and `peft_config` was passed too. Merge and unload the "
                "existing adapter (model.merge_and_unload()) and pass the base model, or pass peft_config=None."
            )
        policy = get_peft_model(model, peft_config)
    return PolicyAndValue(policy, value_model)


def value_adapter_config(lora_config):
    """The critic's own adapter: the policy's ``lora_config`` copied without ``lm_head`` among its
    targets (the value pass never reaches it), ``modules_to_save`` or a task type -- what the
    examples' ``--value_lora`` builds by hand. The caller's config is not changed."""
    config = copy.deepcopy(lora_config)
    if isinstance(config.target_modules, (list, set, tuple)):
        config.target_modules = {name for name in config.target_modules if name != "lm_head"}
    config.modules_to_save = None
    config.task_type = None
    return config


def _build_value_adapter(model: nn.Module, value_model: nn.Module | None, peft_config,
                         value_branch_layer: int | None = None) -> nn.Module:
    """``build_policy_and_value(..., value_adapter=True)``: ``SharedActorCritic`` with
    ``value_lora_config=value_adapter_config(<the policy's LoRA config>)`` (and ``value_branch_layer``)."""
    from peft import PeftModel

    from .actor_critic import SharedActorCritic

    if getattr(model, "is_actor_critic", False):
        raise ValueError(
            "use_value_adapter=True and `model` is a SharedActorCritic, which is built already. Pass the causal LM "
            "(or its name) with peft_config, or build the actor-critic with value_lora_config=... and "
            "use_value_adapter=False.")
    if value_model is not None:
        raise ValueError(
            f"use_value_adapter=True gives the critic an adapter on the policy's base, and a value_model "
            f"({type(value_model).__name__}) was passed too. Pass value_model=None, or use_value_adapter=False "
            "for the separate critic.")
    if peft_config is None and not isinstance(model, PeftModel):
        raise ValueError(
            "use_value_adapter=True with peft_config=None: the value adapter sits beside the policy's LoRA adapter "
            "on a frozen base. Pass peft_config=peft.LoraConfig(task_type='CAUSAL_LM', ...) (the critic's adapter "
            "copies it), or a PeftModel policy.")
    policy_config = peft_config if peft_config is not None else model.peft_config[model.active_adapter]
    return SharedActorCritic(model, lora_config=peft_config, value_lora_config=value_adapter_config(policy_config),
                             value_branch_layer=value_branch_layer)


def _build_policy_only(model: nn.Module, value_model: nn.Module | None, peft_config) -> nn.Module:
    """``build_policy_and_value(..., with_value=False)``."""
    from peft import PeftModel

    from .actor_critic import SharedActorCritic

    if value_model is not None:
        warnings.warn(
            "a `value_model` was passed, but the advantage estimator reads no value (no critic is trained): the "
            "value model is not used and holds no memory on the device here. Pass value_model=None, or "
            "advantage_estimator='gae' to train it.", UserWarning, stacklevel=3,
        )
    if getattr(model, "is_actor_critic", False):
        if model.has_value:
            raise ValueError(
                "`model` is a SharedActorCritic with a value head, and the advantage estimator trains no critic. "
                "Build it with SharedActorCritic(..., with_value=False), or use advantage_estimator='gae'."
            )
        if peft_config is not None:
            raise ValueError(
                "`model` is a SharedActorCritic, which already carries its LoRA adapter, and `peft_config` was "
                "passed too. Pass peft_config=None (set LoRA options when building the actor-critic)."
            )
        return model
    if peft_config is not None or isinstance(model, PeftModel):
        return SharedActorCritic(model, lora_config=peft_config, with_value=False)
    return PolicyAndValue(model, None)


def check_separate_reference(model: nn.Module, ref_model: nn.Module | None) -> None:
    """Refuse ``ref_model`` when it is ``model`` itself (training it would move the reference).

    Example:
        >>> layer = nn.Linear(1, 1)
        >>> check_separate_reference(layer, None)
        >>> try:
        ...     check_separate_reference(layer, layer)
        ... except ValueError as err:
        ...     print(str(err)[:50])
        `model` and `ref_model` are the same object. Pass
    """
    if ref_model is not None and ref_model is model:
        raise ValueError(
            "`model` and `ref_model` are the same object. Pass ref_model=None (a frozen copy is made, or the "
            "disabled adapter is used with PEFT) or a separate copy."
        )


def build_reference(policy: nn.Module, ref_model: nn.Module | None, is_peft: bool) -> nn.Module | None:
    """The frozen reference in eval mode: ``ref_model`` when given, else None for a PEFT policy
    (its disabled adapter is the reference, :func:`reference_adapter`), else a deep copy of
    ``policy``. The caller's ``policy`` is not changed."""
    if ref_model is not None:
        ref = ref_model
    elif is_peft:
        return None
    else:
        ref = copy.deepcopy(policy)
    ref.eval()
    ref.requires_grad_(False)
    return ref


@contextmanager
def reference_adapter(policy: nn.Module, parameters: Iterable[nn.Parameter], ref_adapter_name: str | None = None,
                      model_adapter_name: str | None = None) -> Iterator[None]:
    """The PEFT ``policy`` as the reference for the block: its adapter disabled, or the named
    reference adapter ``ref_adapter_name`` active (``model_adapter_name``, default
    ``"default"``, active again after).

    Every ``requires_grad`` flag of ``parameters`` (the whole trained module's) is restored on
    exit: peft's ``set_adapter`` (which ``disable_adapter`` also calls on exit) freezes every
    adapter but the active one, which silently froze a separate value adapter after the first
    reference pass.
    """
    flags = [(p, p.requires_grad) for p in parameters]
    try:
        if ref_adapter_name:
            policy.set_adapter(ref_adapter_name)
            try:
                yield
            finally:
                policy.set_adapter(model_adapter_name or "default")
        else:
            with policy.disable_adapter():
                yield
    finally:
        for param, flag in flags:
            param.requires_grad_(flag)


def checkpointing_kwargs(args) -> dict | None:
    """The ``gradient_checkpointing_kwargs`` a config asks the trained models to checkpoint
    with, or None when it asks for no checkpointing: transformers' ``activation_checkpointing``
    (its new name) or ``gradient_checkpointing`` (TRL's default True), with their kwargs,
    non-reentrant unless they say otherwise.

    Example:
        >>> from types import SimpleNamespace
        >>> checkpointing_kwargs(SimpleNamespace(gradient_checkpointing=True, gradient_checkpointing_kwargs=None))
        {'use_reentrant': False}
        >>> checkpointing_kwargs(SimpleNamespace(gradient_checkpointing=False, gradient_checkpointing_kwargs=None))
    """
    if not (getattr(args, "activation_checkpointing", None) or args.gradient_checkpointing):
        return None
    kwargs = dict(getattr(args, "activation_checkpointing_kwargs", None) or args.gradient_checkpointing_kwargs or {})
    kwargs.setdefault("use_reentrant", False)
    return kwargs


def apply_gradient_checkpointing(wrapper, args) -> bool:
    """``gradient_checkpointing=True`` (TRL's default) checkpoints the policy's and the value
    model's activations during the update (:func:`checkpointing_kwargs`). Generation and scoring
    run without grad and keep their KV cache and speed.

    A shared actor-critic with a value adapter checkpoints too, each layer recomputing under the
    adapter it ran forward with; it refuses reentrant checkpointing, and the run then goes on
    without checkpointing, with a warning saying why. Returns whether checkpointing was applied.
    """
    kwargs = checkpointing_kwargs(args)
    if kwargs is None:
        return False
    try:
        wrapper.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)
    except ValueError as err:
        logging.getLogger(__name__).warning("gradient_checkpointing=True is not applied: %s", err)
        return False
    return True
