"""Every reward of a run, built in one call and placed in another: the trainer's ``reward_model`` and
``reward_funcs`` (TRL GRPO's), the environments' ``get_reward``, a token classifier read as a process
reward model, and a reward model of another vocabulary given its own tokenizer; their names checked
against the run's ``eval_metrics`` (both are logged as ``eval/<name>``). :func:`place_run_rewards`
readies every reward model to score once the run's devices exist (dropout off, then placed by the
trainer's placement of frozen models: device, offload, 4-bit, DeepSpeed).

Example:

>>> from trl_ppo_ext.rewards.building import build_run_rewards
>>> def short(completions, **kwargs):
...     return [float(len(c) < 10) for c in completions]
>>> [(r.name, r.weight) for r in build_run_rewards(None, [short], policy_tokenizer=None)]
[('short', 1.0)]
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import replace

from torch import nn

from ..models.prepare import disable_dropout
from .process import ProcessRewardModel, with_process_reward_models
from .scoring import Reward, build_rewards, check_reward_heads, with_reward_tokenizers

__all__ = ["build_run_rewards", "check_eval_metric_names", "place_run_rewards", "scoring_model"]


def build_run_rewards(reward_model, reward_funcs, *, policy_tokenizer, reward_weights: Sequence[float] | None = None,
                      environment_rewards: Sequence[Callable] = (), reward_processing_classes=None,
                      step_separator: str = "\n", eval_metric_names: Iterable[str] = ()) -> list[Reward]:
    """The run's rewards, in order: ``reward_model`` first, then ``reward_funcs``, then the
    environments' ``environment_rewards`` (``scoring.build_rewards``, with ``reward_weights``); a
    token classifier (TRL's ``PRMTrainer``) becomes its ``process.ProcessRewardModel`` (step scores on
    ``step_separator``); each scalar head is checked; a reward model whose entry of
    ``reward_processing_classes`` (GRPO's meaning) is another vocabulary scores rebuilt text
    (``scoring.with_reward_tokenizers``); no reward may share its name with one of
    ``eval_metric_names`` (:func:`check_eval_metric_names`).

    Raises:
        ValueError: what the five steps refuse (weights, heads, processing classes, names), naming the reward.
    """
    rewards = build_rewards(reward_model, reward_funcs, reward_weights, environment_rewards)
    rewards, remaining = with_process_reward_models(rewards, policy_tokenizer, reward_processing_classes,
                                                    step_separator)
    check_reward_heads(rewards, reward_model)
    rewards = with_reward_tokenizers(rewards, policy_tokenizer, remaining)
    check_eval_metric_names(rewards, eval_metric_names)
    return rewards


def check_eval_metric_names(rewards: Sequence[Reward], eval_metric_names: Iterable[str]) -> None:
    """Refuse an ``eval_metrics`` name that is also a reward's: an evaluation logs both as ``eval/<name>``.

    Raises:
        ValueError: naming the shared names and what to do.
    """
    clash = sorted({r.name for r in rewards} & set(eval_metric_names))
    if clash:
        raise ValueError(
            f"eval_metrics and the rewards share the name(s) {clash}: both are logged as eval/<name>. Rename the "
            "eval metric."
        )


def scoring_model(reward: Reward) -> nn.Module | None:
    """The model a reward runs: a process reward model's token classifier, a reward model itself, or
    None for a function."""
    if isinstance(reward.source, ProcessRewardModel):
        return reward.source.model
    return reward.source if reward.is_model else None


def place_run_rewards(rewards: Sequence[Reward], place: Callable[[nn.Module, str, bool], nn.Module], *,
                      offload: bool) -> list[Reward]:
    """Every reward model ready to score: dropout off (``models.prepare.disable_dropout``; a reward
    model is never saved, so its configs' values are not kept), then placed by ``place(model, name,
    offloaded)`` (the trainer's placement of a frozen model), ``offloaded=offload`` for a reward model
    and False for a process reward model's classifier, which reads on the training device.

    Returns a new list (a placed model may be a new object, e.g. a DeepSpeed engine); the models
    themselves are moved, and a process reward model holds its placed classifier.
    """
    placed = []
    for reward in rewards:
        model = scoring_model(reward)
        if model is None:
            placed.append(reward)
            continue
        disable_dropout(model)
        if isinstance(reward.source, ProcessRewardModel):
            reward.source.model = place(model, reward.name, False)
            placed.append(reward)
        else:
            placed.append(replace(reward, source=place(model, reward.name, offload)))
    return placed
