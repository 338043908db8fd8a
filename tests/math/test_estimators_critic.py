"""The critic's rows of the estimator table through ``estimators.estimator_targets``: ``"gae"`` with the
explained-variance gate, and the group-and-critic hybrid ``"gae_rloo"``."""

from dataclasses import fields, replace

import pytest
import torch

from trl_ppo_ext import estimators as E
from trl_ppo_ext.advantages import compute_targets
from trl_ppo_ext.functional import masked_explained_variance, masked_global_whiten
from trl_ppo_ext.rollout import Rollout

GAE = dict(kl_coef=0.0, kl_estimator="k1", missing_eos_penalty=None, whiten_rewards=False,
           whiten_advantages=False, gamma=1.0, lam=1.0)


def _rollout(scores, values, mask, token_rewards=None, reward_applies=None, seed=0):
    g = torch.Generator().manual_seed(seed)
    B, T = mask.shape
    logprobs = -torch.rand(B, T, generator=g).masked_fill(~mask, 0.0)
    return Rollout(
        queries=torch.ones(B, 1, dtype=torch.long), query_mask=torch.ones(B, 1, dtype=torch.bool),
        responses=torch.ones(B, T, dtype=torch.long), response_mask=mask, logprobs=logprobs,
        ref_logprobs=logprobs - 0.1 * torch.rand(B, T, generator=g), values=values,
        scores=scores, has_stop=torch.ones(B, dtype=torch.bool), token_rewards=token_rewards,
        reward_applies=reward_applies,
    )


def _targets(rollout, estimator="gae", num_generations=2, gate=None, **overrides):
    return E.estimator_targets(rollout, advantage_estimator=estimator, num_generations=num_generations,
                               critic_gate_explained_variance=gate, **{**GAE, **overrides})


def _same(a, b):
    for f in fields(a):
        x, y = getattr(a, f.name), getattr(b, f.name)
        assert (x is None and y is None) or torch.equal(x, y), f.name


def _random_rollout(seed=0, B=4, T=6):
    g = torch.Generator().manual_seed(seed)
    mask = torch.arange(T)[None] < torch.randint(1, T + 1, (B,), generator=g)[:, None]
    return _rollout(torch.randn(B, generator=g), torch.randn(B, T, generator=g), mask,
                    token_rewards=torch.randn(B, T, generator=g).masked_fill(~mask, 0.0), seed=seed)


@pytest.mark.parametrize("overrides", [{}, dict(kl_coef=0.1, whiten_advantages=True, lam=0.9, gamma=0.97)])
def test_gae_without_the_gate_is_compute_targets_bit_for_bit(overrides):
    rollout = _random_rollout()
    got = _targets(rollout, **overrides)
    _same(got, compute_targets(rollout, **{**GAE, **overrides}))
    assert got.gate_explained_variance is None and got.used_critic is None


def test_the_gate_closed_uses_the_groups_leave_one_out_mean_and_keeps_the_critics_returns():
    mask = torch.tensor([[True, True, False], [True, True, True], [True, False, False], [True, True, True]])
    # values against Monte-Carlo returns (gamma = lambda = 1, no KL): a poor critic
    values = torch.tensor([[3.0, -1.0, 0.0], [0.0, 2.0, 1.0], [5.0, 0.0, 0.0], [1.0, 1.0, 1.0]])
    rollout = _rollout(torch.tensor([1.0, 0.0, 2.0, 4.0]), values, mask)
    plain = compute_targets(rollout, **GAE)
    ev = masked_explained_variance(values, plain.returns, mask)
    assert ev < 0
    t = _targets(rollout, gate=0.0)
    # leave-one-out per pair: 1 - 0, 0 - 1, 2 - 4, 4 - 2, on every token of the row
    expected = torch.where(mask, torch.tensor([1.0, -1.0, -2.0, 2.0])[:, None], 0.0)
    assert torch.equal(t.advantages, expected)
    assert torch.equal(t.returns, plain.returns)  # the critic still trains toward its own targets
    assert t.used_critic.item() == 0.0 and t.gate_explained_variance.item() == pytest.approx(ev.item(), abs=1e-6)
    # the same as the critic-free "rloo" row on these episodes
    assert torch.equal(t.advantages, _targets(rollout, estimator="rloo").advantages)


def test_the_gate_closed_with_one_sample_per_prompt_uses_the_batch_mean():
    mask = torch.tensor([[True, True], [True, False], [True, True]])
    rollout = _rollout(torch.tensor([1.0, 2.0, 6.0]), torch.tensor([[9.0, -9.0], [4.0, 0.0], [0.0, 7.0]]), mask)
    t = _targets(rollout, num_generations=1, gate=0.5)
    # returns 1, 2, 6 (mean 3): -2, -1, 3 on each row's tokens
    assert torch.equal(t.advantages, torch.where(mask, torch.tensor([-2.0, -1.0, 3.0])[:, None], 0.0))
    assert t.used_critic.item() == 0.0


def test_the_gate_open_keeps_gaes_advantages_and_whitens_as_gae_does():
    rollout = _random_rollout(seed=3)
    settings = dict(whiten_advantages=True, lam=0.9, kl_coef=0.05)
    t = _targets(rollout, gate=-1e9, **settings)  # any critic passes a gate this low
    plain = compute_targets(rollout, **{**GAE, **settings})
    assert t.used_critic.item() == 1.0
    torch.testing.assert_close(t.advantages, plain.advantages, rtol=0, atol=1e-6)
    torch.testing.assert_close(t.raw_advantage_mean, plain.raw_advantage_mean)
    # at a threshold of 1 no critic passes (EV <= 1): the baseline, whitened over the batch
    closed = _targets(rollout, gate=1.0, **settings)
    raw = _targets(rollout, estimator="rloo", **settings).advantages
    torch.testing.assert_close(closed.advantages, masked_global_whiten(raw, rollout.response_mask))


@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize("gamma, lam", [(1.0, 1.0), (0.97, 0.9)])
def test_the_hybrid_with_a_flat_critic_is_rloo_exactly(seed, gamma, lam):
    rollout = _random_rollout(seed)
    for values in (torch.zeros_like(rollout.values), torch.full_like(rollout.values, 0.37)):
        flat = replace(rollout, values=values)
        hybrid = _targets(flat, estimator="gae_rloo", kl_coef=0.1, gamma=gamma, lam=lam)
        rloo = _targets(flat, estimator="rloo", kl_coef=0.1)
        assert torch.equal(hybrid.advantages, rloo.advantages)
        assert torch.equal(hybrid.raw_advantage_mean, rloo.raw_advantage_mean)


def test_the_hybrid_by_hand():
    # one prompt, two samples, gamma = lambda = 1, no KL: S = 1 and 0, leave-one-out 1 and -1;
    # A_k = (S - m) - (V_k - V_1)
    mask = torch.tensor([[True, True, True], [True, True, False]])
    values = torch.tensor([[0.2, 0.5, 0.9], [0.4, 0.1, 7.0]])
    t = _targets(_rollout(torch.tensor([1.0, 0.0]), values, mask), estimator="gae_rloo")
    expected = torch.tensor([[1.0, 1.0 - 0.3, 1.0 - 0.7], [-1.0, -1.0 + 0.3, 0.0]])
    torch.testing.assert_close(t.advantages, expected, rtol=0, atol=1e-6)
    # its returns are GAE's (Monte-Carlo here: the score on every token of the row)
    assert torch.equal(t.returns, torch.where(mask, torch.tensor([1.0, 0.0])[:, None], 0.0))


def test_the_hybrid_with_turns_reads_only_the_policys_tokens():
    response = torch.ones(2, 5, dtype=torch.bool)
    action = torch.tensor([[True, True, False, False, True], [True, False, True, True, True]])
    values = torch.tensor([[0.1, 0.3, 9.0, 9.0, 0.6], [0.0, 9.0, 0.2, 0.2, 0.5]])
    rollout = replace(_rollout(torch.tensor([2.0, 1.0]), values, response), action_mask=action)
    t = _targets(rollout, estimator="gae_rloo")
    # S = 2, 1 -> leave-one-out 1, -1; minus V_k - V_1 on the action tokens only
    expected = torch.tensor([[1.0, 0.8, 0.0, 0.0, 0.5], [-1.0, 0.0, -1.2, -1.2, -1.5]])
    torch.testing.assert_close(t.advantages, expected, rtol=0, atol=1e-6)


def test_an_unscored_row_trains_nothing_under_the_hybrid_and_the_gate():
    mask = torch.ones(4, 2, dtype=torch.bool)
    applies = torch.tensor([[True], [False], [True], [True]])
    values = torch.tensor([[0.5, 0.2], [3.0, 1.0], [0.0, 0.0], [1.0, 1.0]])
    rollout = _rollout(torch.tensor([1.0, 5.0, 2.0, 0.0]), values, mask, reward_applies=applies)
    hybrid, gated = _targets(rollout, estimator="gae_rloo"), _targets(rollout, gate=1.0)
    assert (hybrid.advantages[1] == 0).all() and (gated.advantages[1] == 0).all()
    # row 0's pair has no other scored row: no group advantage (RLOO's 0), so the gate gives it 0 and
    # the hybrid only the critic's credit inside the episode, V_1 - V_k = 0, .3
    assert (gated.advantages[0] == 0).all()
    torch.testing.assert_close(hybrid.advantages[0], torch.tensor([0.0, 0.3]), rtol=0, atol=1e-6)
    torch.testing.assert_close(hybrid.advantages[2:], torch.tensor([[2.0, 2.0], [-2.0, -2.0]]), rtol=0, atol=0)
