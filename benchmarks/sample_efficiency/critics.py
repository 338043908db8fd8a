"""The critic of this package's arms (``Arm.critic``): the examples' shared LoRA actor-critic (its
value head, or its own value adapter), or a separate value model, trained whole or as a LoRA adapter."""

from __future__ import annotations


def shared_actor_critic(critic: str, policy, lora, config=None):
    """The examples' shared LoRA actor-critic; with ``critic="value_lora"`` the critic gets its own
    adapter on the same base, the trainer's ``value_adapter_config`` of ``lora`` (its rank and targets,
    the LM head excepted: what ``use_value_adapter=True`` builds). Without a value head when ``config``
    trains no critic (a critic-free ``advantage_estimator``)."""
    from trl_ppo_ext.models.actor_critic import SharedActorCritic
    from trl_ppo_ext.models.assembly import value_adapter_config

    value_lora = value_adapter_config(lora) if critic == "value_lora" else None
    if not getattr(config, "trains_critic", True):
        return SharedActorCritic(policy, lora_config=lora, with_value=False)
    return SharedActorCritic(policy, lora_config=lora, value_lora_config=value_lora)


def critic_as(critic: str, value, lora):
    """The value model of a ``separate`` arm as it is, or of a ``lora`` arm with ``lora``'s adapter
    injected (peft, in place: the trainer sees a plain transformers model) and every weight but
    the adapter's and the ``score`` head's frozen (the optimizer takes what requires grad)."""
    if critic == "separate":
        return value
    from peft import LoraConfig, inject_adapter_in_model

    targets = [t for t in lora.target_modules if t != "lm_head"]  # a sequence classifier has none
    value = inject_adapter_in_model(LoraConfig(r=lora.r, lora_alpha=lora.lora_alpha, lora_dropout=0.0,
                                               target_modules=targets), value)
    for name, param in value.named_parameters():
        param.requires_grad_("lora_" in name or name.startswith("score."))
    return value


def actor_and_critic(arm, policy, lora, config, value_model) -> dict:
    """The trainer keywords ``model``, ``ref_model``, ``value_model`` (and ``peft_config``) of a PPO arm,
    the one place the critic is chosen:

    * ``trl112``: TRL's separate value model as ``value_model()`` loads it (TRL's example script: the
      reward model, or the initial policy with a fresh score head), every weight trained;
    * ``critic`` "separate" or "lora": that value model trained whole, or as a LoRA adapter and its
      head (:func:`critic_as`), beside a LoRA policy;
    * ``critic`` "shared" or "value_lora": the shared actor-critic (:func:`shared_actor_critic`),
      without a value head when ``config`` trains no critic;
    * a config with ``use_value_adapter=True`` (an arm's override, or an example's own settings):
      the policy and its LoRA config, for the trainer to build its own value adapter (with
      ``value_branch_layer`` where set: the branch critic, which only the trainer's config builds);
      the same adapter ``critic="value_lora"`` builds by hand, so either critic name leads here.

    With ``arm.lm_head == "whole"`` the policy's LM head leaves the LoRA targets and trains whole
    (``trl_grpo.grpo_lora``), as the ``trl_grpo`` arm's must.

    ``value_model`` is called only where a separate value model is used (a load draws no random
    numbers otherwise), at the point where the tasks loaded it before."""
    if arm.trainer == "trl112":
        return dict(model=policy, ref_model=None, value_model=value_model(), peft_config=lora)
    if arm.lm_head == "whole":  # as the trl_grpo arm trains it
        from .trl_grpo import grpo_lora

        lora = grpo_lora(lora)
    if getattr(config, "use_value_adapter", False):
        if arm.critic not in ("shared", "value_lora"):
            raise ValueError(f"use_value_adapter=True builds the trainer's own value adapter; critic={arm.critic!r} "
                             "names a separate value model. Set use_value_adapter=false in the arm, or leave critic= "
                             "out of it.")
        return dict(model=policy, ref_model=None, value_model=None, peft_config=lora)
    if arm.critic in ("separate", "lora"):
        return dict(model=policy, ref_model=None, value_model=critic_as(arm.critic, value_model(), lora),
                    peft_config=lora)
    return dict(model=shared_actor_critic(arm.critic, policy, lora, config), ref_model=None, value_model=None)
