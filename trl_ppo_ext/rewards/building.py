"""Every reward of a run, built in one call: the trainer's ``reward_model`` and ``reward_funcs`` (TRL
GRPO's), the environments' ``get_reward``, a token classifier read as a process reward model, and a
reward model of another vocabulary given its own tokenizer.

Example:

>>> from trl_ppo_ext.rewards.building import build_run_rewards
>>> def short(completions, **kwargs):
...     return [float(len(c) < 10) for c in completions]
>>> [(r.name, r.weight) for r in build_run_rewards(None, [short], policy_tokenizer=None)]
[('short', 1.0)]
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from .process import with_process_reward_models
from .scoring import Reward, build_rewards, check_reward_heads, with_reward_tokenizers

__all__ = ["build_run_rewards"]


def build_run_rewards(reward_model, reward_funcs, *, policy_tokenizer, reward_weights: Sequence[float] | None = None,
                      environment_rewards: Sequence[Callable] = (), reward_processing_classes=None,
                      step_separator: str = "\n") -> list[Reward]:
    """The run's rewards, in order: ``reward_model`` first, then ``reward_funcs``, then the
    environments' ``environment_rewards`` (``scoring.build_rewards``, with ``reward_weights``); a
    token classifier (TRL's ``PRMTrainer``) becomes its ``process.ProcessRewardModel`` (step scores on
    ``step_separator``); each scalar head is checked; a reward model whose entry of
    ``reward_processing_classes`` (GRPO's meaning) is another vocabulary scores rebuilt text
    (``scoring.with_reward_tokenizers``).

    Raises:
        ValueError: what the four steps refuse (weights, heads, processing classes), naming the reward.
    """
    rewards = build_rewards(reward_model, reward_funcs, reward_weights, environment_rewards)
    rewards, remaining = with_process_reward_models(rewards, policy_tokenizer, reward_processing_classes,
                                                    step_separator)
    check_reward_heads(rewards, reward_model)
    return with_reward_tokenizers(rewards, policy_tokenizer, remaining)
