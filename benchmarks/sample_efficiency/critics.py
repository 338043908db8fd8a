"""The critic of this package's arms (``Arm.critic``): the examples' shared LoRA actor-critic (its
value head, or its own value adapter), or a separate value model, trained whole or as a LoRA adapter."""

from __future__ import annotations


def shared_actor_critic(critic: str, policy, lora, config=None):
    """The examples' shared LoRA actor-critic; with ``critic="value_lora"`` the critic gets its own
    adapter of ``lora``'s rank and targets (the LM head excepted) on the same base. Without a value
    head when ``config`` trains no critic (a critic-free ``advantage_estimator``)."""
    from peft import LoraConfig

    from trl_ppo_ext.models.actor_critic import SharedActorCritic

    value_lora = None
    if critic == "value_lora":
        value_lora = LoraConfig(r=lora.r, lora_alpha=lora.lora_alpha, lora_dropout=0.0,
                                target_modules=[t for t in lora.target_modules if t != "lm_head"])
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
