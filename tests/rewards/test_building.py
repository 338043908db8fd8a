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


def test_a_reward_and_an_eval_metric_of_one_name_are_refused():
    def correct(completions, **kwargs):
        return [1.0] * len(completions)

    with pytest.raises(ValueError, match=r"share the name\(s\) \['correct'\]: both are logged as eval/<name>"):
        build_run_rewards(None, [correct], policy_tokenizer=None, eval_metric_names=["length", "correct"])
    assert [r.name for r in build_run_rewards(None, [correct], policy_tokenizer=None,
                                              eval_metric_names=["length"])] == ["correct"]


def test_placing_turns_dropout_off_and_offloads_only_the_reward_models():
    from torch import nn

    from trl_ppo_ext.rewards.building import place_run_rewards
    from trl_ppo_ext.rewards.process import ProcessRewardModel
    from trl_ppo_ext.rewards.scoring import Reward

    model, classifier = nn.Sequential(nn.Linear(2, 1), nn.Dropout(0.3)), nn.Sequential(nn.Dropout(0.2))
    prm = ProcessRewardModel.__new__(ProcessRewardModel)  # only its `model` is read here
    prm.model = classifier

    def fn(completions, **kwargs):
        return [0.0] * len(completions)

    placed_as = []

    def place(m, name, offloaded):
        placed_as.append((name, offloaded, m[-1].p))  # dropout is already off when a model is placed
        return nn.Identity() if m is model else m

    rewards = [Reward("rm", model, 1.0), Reward("fn", fn, 1.0), Reward("prm", prm, 1.0)]
    placed = place_run_rewards(rewards, place, offload=True)
    assert placed_as == [("rm", True, 0.0), ("prm", False, 0.0)]  # the PRM's classifier is never offloaded
    assert isinstance(placed[0].source, nn.Identity) and placed[1] is rewards[1]
    assert placed[2].source.model is classifier
    assert rewards[0].source is model  # the list given is left as it was
