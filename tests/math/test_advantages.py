"""advantages.compute_targets without a trainer: EOS penalty, KL-shaped rewards, GAE, whitening."""

import math

import pytest
import torch

from trl_ppo_ext.advantages import PPOTargets, compute_targets, target_settings
from trl_ppo_ext.rollout import Rollout

SETTINGS = dict(kl_estimator="k1", missing_eos_penalty=None, whiten_rewards=False, whiten_advantages=False,
                gamma=0.9, lam=0.5)


def one_row(has_stop=True, score=1.0):
    """B=1, T=3, the last position padding (values 9 there must never be read)."""
    mask = torch.tensor([[True, True, False]])
    return Rollout(
        queries=torch.ones(1, 1, dtype=torch.long), query_mask=torch.ones(1, 1, dtype=torch.bool),
        responses=torch.ones(1, 3, dtype=torch.long), response_mask=mask,
        logprobs=torch.tensor([[-1.0, -2.0, 0.0]]), ref_logprobs=torch.tensor([[-1.5, -2.0, 0.0]]),
        values=torch.tensor([[0.5, 0.25, 9.0]]), scores=torch.tensor([score]), has_stop=torch.tensor([has_stop]),
    )


def test_rewards_gae_and_returns_by_hand():
    t = compute_targets(one_row(), kl_coef=0.2, **SETTINGS)
    # k1 KL = logp - ref = [0.5, 0, -]; non-score = -0.2 * kl = [-0.1, 0, 0]
    assert t.kl.tolist() == [[0.5, 0.0, 0.0]]
    assert torch.allclose(t.non_score_rewards, torch.tensor([[-0.1, 0.0, 0.0]]), atol=1e-7)
    # the score 1 lands on the last valid token (index 1)
    assert torch.allclose(t.rewards, torch.tensor([[-0.1, 1.0, 0.0]]), atol=1e-7)
    # delta_1 = 1 - 0.25 = 0.75 (terminal); delta_0 = -0.1 + 0.9 * 0.25 - 0.5 = -0.375
    # A_1 = 0.75; A_0 = -0.375 + 0.9 * 0.5 * 0.75 = -0.0375; returns = A + V
    assert torch.allclose(t.advantages, torch.tensor([[-0.0375, 0.75, 0.0]]), atol=1e-6)
    assert torch.allclose(t.returns[:, :2], torch.tensor([[0.4625, 1.0]]), atol=1e-6)
    # raw statistics over the two valid tokens: mean 0.35625, unbiased std |0.39375| * sqrt(2)
    assert t.raw_advantage_mean.item() == pytest.approx(0.35625, abs=1e-6)
    assert t.raw_advantage_std.item() == pytest.approx(0.39375 * math.sqrt(2), abs=1e-6)


def test_missing_eos_penalty_lowers_only_responses_without_a_stop_token():
    settings = {**SETTINGS, "missing_eos_penalty": 0.25}
    stopped = compute_targets(one_row(has_stop=True), kl_coef=0.0, **settings)
    cut = compute_targets(one_row(has_stop=False), kl_coef=0.0, **settings)
    assert stopped.scores.tolist() == [1.0]
    assert cut.scores.tolist() == [0.75]  # 1 - 0.25
    assert cut.rewards.tolist() == [[0.0, 0.75, 0.0]]


def test_whitened_advantages_have_zero_mean_unit_std_and_the_raw_statistics_are_kept():
    raw = compute_targets(one_row(), kl_coef=0.2, **SETTINGS)
    white = compute_targets(one_row(), kl_coef=0.2, **{**SETTINGS, "whiten_advantages": True})
    valid = white.advantages[0, :2]
    assert valid.mean().item() == pytest.approx(0.0, abs=1e-6)
    assert valid.std().item() == pytest.approx(1.0, abs=1e-5)
    assert white.advantages[0, 2].item() == 0.0  # padding stays 0
    assert torch.equal(white.returns, raw.returns)  # returns come from the raw advantages
    assert torch.equal(white.raw_advantage_mean, raw.raw_advantage_mean)


def test_the_rollout_is_not_modified():
    rollout = one_row(has_stop=False)
    before = {k: v.clone() for k, v in vars(rollout).items() if torch.is_tensor(v)}
    compute_targets(rollout, kl_coef=0.2, **{**SETTINGS, "missing_eos_penalty": 1.0, "whiten_rewards": True,
                                             "whiten_advantages": True})
    assert all(torch.equal(getattr(rollout, k), v) for k, v in before.items())


def test_select_picks_rows_and_keeps_scalars():
    t = PPOTargets(scores=torch.tensor([1.0, 2.0]), kl=torch.tensor([[1.0], [2.0]]),
                   non_score_rewards=torch.tensor([[3.0], [4.0]]), rewards=torch.tensor([[5.0], [6.0]]),
                   advantages=torch.tensor([[7.0], [8.0]]), returns=torch.tensor([[9.0], [10.0]]),
                   raw_advantage_mean=torch.tensor(0.5), raw_advantage_std=torch.tensor(1.5))
    picked = t.select(torch.tensor([1]))
    assert picked.scores.tolist() == [2.0] and picked.returns.tolist() == [[10.0]]
    assert picked.raw_advantage_mean.item() == 0.5 and picked.raw_advantage_std.item() == 1.5


def test_target_settings_reads_the_config_fields(make_config):
    config = make_config(gamma=0.95, lam=0.9, missing_eos_penalty=2.0, kl_estimator="k3", value_lam=1.0,
                         lam_length_alpha=0.05)
    assert target_settings(config) == dict(kl_estimator="k3", missing_eos_penalty=2.0,
                                           whiten_rewards=config.whiten_rewards,
                                           whiten_advantages=config.whiten_advantages, gamma=0.95, lam=0.9,
                                           value_lam=1.0, lam_length_alpha=0.05, lam_length_min=None,
                                           lam_length_per_turn=False)


# ---------------------------------------------------------------- episodes with turns (action_mask)
def _episode_rollout(action_mask, values, scores, token_rewards=None, logprobs=None, ref_logprobs=None):
    from trl_ppo_ext.rollout import Rollout

    B, T = action_mask.shape
    response_mask = torch.ones(B, T, dtype=torch.bool)
    zeros = torch.zeros(B, T)
    return Rollout(
        queries=torch.ones(B, 1, dtype=torch.long), query_mask=torch.ones(B, 1, dtype=torch.bool),
        responses=torch.ones(B, T, dtype=torch.long), response_mask=response_mask, action_mask=action_mask,
        has_stop=torch.ones(B, dtype=torch.bool), logprobs=zeros if logprobs is None else logprobs,
        ref_logprobs=zeros if ref_logprobs is None else ref_logprobs, values=values, scores=scores,
        token_rewards=token_rewards,
    )


_NO_SHAPING = dict(kl_coef=0.1, kl_estimator="k1", missing_eos_penalty=None, whiten_rewards=False,
                   whiten_advantages=False)


def test_the_worked_episode_through_compute_targets():
    # a1 a2 | o1 o2 o3 | b1 b2: gamma 1, lambda 0.9, values .5 .6 .7 .8 on the action tokens (garbage on
    # the environment's), a token reward .1 on a2 and the sequence score 1 (lands on b2, the last action)
    act = torch.tensor([[True, True, False, False, False, True, True]])
    values = torch.tensor([[0.5, 0.6, 9.0, -9.0, 9.0, 0.7, 0.8]])
    token_rewards = torch.tensor([[0.0, 0.1, 0.0, 0.0, 0.0, 0.0, 0.0]])
    t = compute_targets(_episode_rollout(act, values, torch.tensor([1.0]), token_rewards),
                        gamma=1.0, lam=0.9, **_NO_SHAPING)
    # by hand: deltas b2 = 1 - .8 = .2; b1 = .8 - .7 = .1; a2 = .1 + .7 - .6 = .2; a1 = .6 - .5 = .1
    # A(b2) = .2; A(b1) = .1 + .9*.2 = .28; A(a2) = .2 + .9*.28 = .452; A(a1) = .1 + .9*.452 = .5068
    assert t.advantages[0].tolist() == pytest.approx([0.5068, 0.452, 0, 0, 0, 0.28, 0.2], abs=1e-6)
    assert t.returns[0, act[0]].tolist() == pytest.approx([1.0068, 1.052, 0.98, 1.0], abs=1e-6)
    assert t.rewards[0].tolist() == pytest.approx([0, 0.1, 0, 0, 0, 0, 1.0])


def test_the_score_lands_on_the_last_action_token_when_the_episode_ends_on_the_environment():
    act = torch.tensor([[True, True, False, True, False, False]])
    t = compute_targets(_episode_rollout(act, torch.zeros(1, 6), torch.tensor([2.0])),
                        gamma=1.0, lam=1.0, **_NO_SHAPING)
    assert t.rewards[0].tolist() == [0.0, 0.0, 0.0, 2.0, 0.0, 0.0]
    assert t.advantages[0].tolist() == [2.0, 2.0, 0.0, 2.0, 0.0, 0.0]


def test_environment_tokens_carry_no_kl():
    act = torch.tensor([[True, False, True]])
    logprobs, ref = torch.tensor([[-1.0, -5.0, -2.0]]), torch.tensor([[-1.5, -0.5, -1.0]])
    t = compute_targets(_episode_rollout(act, torch.zeros(1, 3), torch.tensor([0.0]), logprobs=logprobs,
                                         ref_logprobs=ref), gamma=1.0, lam=1.0, **_NO_SHAPING)
    assert t.kl[0].tolist() == pytest.approx([0.5, 0.0, -1.0])
    assert t.non_score_rewards[0].tolist() == pytest.approx([-0.05, 0.0, 0.1])


@pytest.mark.parametrize("settings", [
    dict(whiten_rewards=False, whiten_advantages=True, lam_length_alpha=None, value_lam=None),
    dict(whiten_rewards=True, whiten_advantages=True, lam_length_alpha=0.05, value_lam=1.0),
    dict(whiten_rewards=False, whiten_advantages=False, lam_length_alpha=None, value_lam=0.8),
])
def test_an_action_mask_equal_to_the_response_mask_is_bitwise_single_turn(settings):
    from dataclasses import fields, replace

    from trl_ppo_ext.rollout import Rollout

    g = torch.Generator().manual_seed(3)
    B, T = 5, 9
    lengths = torch.tensor([9, 4, 1, 7, 6])
    mask = torch.arange(T)[None] < lengths[:, None]
    rollout = Rollout(
        queries=torch.ones(B, 2, dtype=torch.long), query_mask=torch.ones(B, 2, dtype=torch.bool),
        responses=torch.ones(B, T, dtype=torch.long), response_mask=mask, has_stop=lengths < T,
        logprobs=-torch.rand(B, T, generator=g).masked_fill(~mask, 0), values=torch.randn(B, T, generator=g),
        ref_logprobs=-torch.rand(B, T, generator=g).masked_fill(~mask, 0), scores=torch.randn(B, generator=g),
        token_rewards=torch.randn(B, T, generator=g).masked_fill(~mask, 0),
    )
    kwargs = dict(kl_coef=0.07, kl_estimator="k3", missing_eos_penalty=0.5, gamma=0.97, lam=0.93, **settings)
    single = compute_targets(rollout, **kwargs)
    turns = compute_targets(replace(rollout, action_mask=mask.clone()), **kwargs)
    for f in fields(single):
        a, b = getattr(single, f.name), getattr(turns, f.name)
        assert (a is None and b is None) or torch.equal(a, b), f.name  # None: the gate's fields, gate off
