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
                                           value_lam=1.0, lam_length_alpha=0.05)
