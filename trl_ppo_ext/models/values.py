"""The critic's values without the policy's pass, where the layout has one.

Before an on-policy update that reads no KL, the old log-probs come from the update's own first
forward (``scoring_plan``), so the scoring forward is needed only for ``V(s_t)``. Two layouts give
the values from parameters of their own, without running the policy:

* ``PolicyAndValue`` with a value model (TRL's separate critic): the value model's backbone and
  head alone, one backbone pass instead of two;
* ``SharedActorCritic`` with a value adapter: the base under the value adapter and the value head,
  one backbone pass instead of two.
* ``SharedActorCritic`` with a branch critic (``value_branch_layer=k``): its values read the policy's
  hidden state at layer ``k``, so the pass runs the policy's layers below ``k`` (policy adapter) and
  switches to the value adapter for the layers from ``k`` up: one backbone pass, no LM head, the
  policy's layers above ``k`` skipped (``models.branch_critic.switch_adapter_at_branch``).

The shared value head reads the policy's own last hidden state: its values need the policy's pass,
which gives the log-probs for the price of the LM head, so nothing is saved there.

Example:

>>> from trl_ppo_ext.models.policy_value import PolicyAndValue
>>> from trl_ppo_ext.tiny import build_tiny_causal_lm, build_tiny_scorer, build_tiny_tokenizer
>>> tok = build_tiny_tokenizer()
>>> pair = PolicyAndValue(build_tiny_causal_lm(tok), build_tiny_scorer(tok))
>>> ids = torch.tensor([[4, 6, 7, 3, 5]])
>>> has_values_alone(pair), value_forward(pair, ids, torch.ones_like(ids), torch.arange(5)[None], 2).shape
(True, torch.Size([1, 2]))
>>> torch.equal(value_forward(pair, ids, torch.ones_like(ids), torch.arange(5)[None], 2),
...             pair(ids, torch.ones_like(ids), torch.arange(5)[None], logits_to_keep=2)[1])
True
"""

from __future__ import annotations

import torch
from torch import nn

from .policy_value import PolicyAndValue, backbone_hidden, scalar_head


def has_values_alone(model: nn.Module) -> bool:
    """Whether ``model`` (the trainer's policy/value module) computes its values with parameters of
    their own, without the policy's pass: a separate value model, or a value adapter (a branch
    critic's included: its pass shares the policy's lower layers, not the LM head or upper layers)."""
    if isinstance(model, PolicyAndValue):
        return model.value_model is not None
    return bool(getattr(model, "is_actor_critic", False) and getattr(model, "value_adapter", None)
                and getattr(model, "value_head", None) is not None)


def value_forward(model: nn.Module, input_ids, attention_mask, position_ids, keep: int = 0) -> torch.Tensor:
    """``V(s)`` float32 ``(B, k)`` at the last ``keep`` positions (0: all), the same values as the
    second output of ``model(...)``, without the policy's pass (``has_values_alone(model)`` must hold)."""
    if isinstance(model, PolicyAndValue):
        hidden = backbone_hidden(model.value_model, input_ids, attention_mask, position_ids)
        return scalar_head(model.value_model, hidden[:, -keep:] if keep else hidden)
    hidden = model._value_hidden_states(input_ids, attention_mask, position_ids)  # under the value adapter
    hidden = hidden[:, -keep:] if keep else hidden
    with torch.autocast(device_type=hidden.device.type, enabled=False):  # as SharedActorCritic.forward
        return model.value_head(hidden.to(model.value_head.weight.dtype)).squeeze(-1).float()
