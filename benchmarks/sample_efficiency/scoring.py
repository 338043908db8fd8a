"""How a run measures the task's own reward whatever the trainer: the ids a reward model's backbone
reads (``RewardRecorder``), the response after the prompt's marker, a rule as a reward "model" for
trainers that take only one, and a reward function that hands on what it measured (``measuring``)."""

from __future__ import annotations

import functools


class RewardRecorder:
    """Reads the token ids every call of a reward model's backbone receives (a forward pre-hook),
    so the task's own reward of the scored responses is measured the same way for any trainer."""

    def __init__(self, reward_model):
        backbone = getattr(reward_model, reward_model.base_model_prefix)
        self.batches = []
        backbone.register_forward_pre_hook(self._record, with_kwargs=True)

    def _record(self, module, args, kwargs):
        ids = kwargs.get("input_ids", args[0] if args else None)
        self.batches.append(ids.detach().cpu())

    def take(self):
        """The sequences recorded since the last call, as rows of token ids."""
        rows = [row.tolist() for batch in self.batches for row in batch]
        self.batches = []
        return rows


def response_after_marker(ids: list[int], marker_id: int, pad_id: int) -> list[int]:
    """The response of a scored sequence: the tokens after the first ``marker_id`` (the chat
    template's ``<assistant>``, which ends a one-turn prompt; a response may contain it again),
    without the padding at its right end.

    >>> response_after_marker([0, 4, 9, 5, 7, 5, 3, 0], marker_id=5, pad_id=0)
    [7, 5, 3]
    """
    response = ids[ids.index(marker_id) + 1 :]
    while response and response[-1] == pad_id:
        response = response[:-1]
    return response


def _rule_reward_model_class():
    import torch
    from torch import nn
    from transformers.modeling_outputs import BaseModelOutputWithPast

    class RuleBackbone(nn.Module):
        """Returns, as its last hidden state, each sequence's rule reward at every position."""

        def __init__(self, rule):
            super().__init__()
            self.rule = rule
            self.anchor = nn.Parameter(torch.zeros(()), requires_grad=False)  # gives the module a device

        def forward(self, input_ids=None, **ignored):
            rewards = torch.tensor([self.rule(row) for row in input_ids.tolist()], dtype=torch.float32)
            hidden = rewards.to(self.anchor.device)[:, None, None].expand(*input_ids.shape, 1)
            return BaseModelOutputWithPast(last_hidden_state=hidden, hidden_states=(hidden,))

    class RuleRewardModel(nn.Module):
        """A reward "model" for trainers that only take one: ``rule(token_ids) -> float`` per sequence,
        behind the ``base_model_prefix`` backbone + ``score`` head that TRL's ``get_reward`` reads."""

        base_model_prefix = "model"

        def __init__(self, rule):
            super().__init__()
            self.model = RuleBackbone(rule)
            self.score = nn.Identity()

    return RuleRewardModel


def measuring(func, measure, sink):
    """``func``, a reward function in TRL GRPO's convention (keywords only), that also hands
    ``sink`` the measured reward of each completion of a call: ``measure(kwargs, rewards)``."""

    @functools.wraps(func)
    def measured(**kwargs):
        rewards = func(**kwargs)
        sink(measure(kwargs, rewards))
        return rewards

    return measured
