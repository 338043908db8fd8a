"""build_run_rewards: every reward of a run in one call, in the trainer's order (the weights are the
reward model's and functions'; an environment's reward weighs 1)."""

import pytest

from trl_ppo_ext.rewards.building import build_run_rewards
from trl_ppo_ext.tiny import build_tiny_tokenizer


def test_functions_then_environment_rewards_with_their_weights():
    def first(completions, **kwargs):
        return [1.0] * len(completions)

    def from_env(completions, **kwargs):
        return [0.0] * len(completions)

    rewards = build_run_rewards(None, [first], policy_tokenizer=build_tiny_tokenizer(), reward_weights=[0.5],
                                environment_rewards=[from_env])
    assert [(r.name, r.weight, r.is_model) for r in rewards] == [("first", 0.5, False), ("from_env", 1.0, False)]


def test_a_weight_list_of_the_wrong_length_is_refused():
    with pytest.raises(ValueError):
        build_run_rewards(None, [lambda completions, **kw: [0.0]], policy_tokenizer=None, reward_weights=[1.0, 2.0])
