"""The explained-variance gate's measure, the batch-mean baseline and the group-and-critic hybrid, on
hand-computed tensors (arithmetic in the comments) and against naive loops."""

import pytest
import torch

from trl_ppo_ext.critic_baselines import (
    batch_mean_advantages,
    critic_credit,
    gate_explained_variance,
    group_critic_advantages,
)
from trl_ppo_ext.functional import masked_explained_variance, turn_length_adaptive_lam


def test_gate_explained_variance_by_hand():
    mask = torch.tensor([[True, True, False], [True, False, False]])
    values = torch.tensor([[0.0, 1.0, 50.0], [2.0, float("nan"), 7.0]])  # nothing off the mask is read
    returns = torch.tensor([[1.0, 1.0, -9.0], [4.0, 3.0, 3.0]])
    # R = 1 1 4 (mean 2, unbiased var (1 + 1 + 4) / 2 = 3); R - V = 1 0 2 (mean 1, var (0 + 1 + 1) / 2 = 1)
    # EV = 1 - 1 / 3
    ev = gate_explained_variance(values, returns, mask)
    assert ev.item() == pytest.approx(2 / 3, abs=1e-6)
    assert torch.allclose(ev, masked_explained_variance(values.nan_to_num(), returns, mask))  # the metric's
    # constant returns: no variance to explain, 0 (not nan)
    assert gate_explained_variance(values.nan_to_num(), torch.ones(2, 3), mask).item() == 0.0


def test_batch_mean_advantages_by_hand():
    # mean of 1, 2, 6 is 3
    assert batch_mean_advantages(torch.tensor([1.0, 2.0, 6.0])).tolist() == [-2.0, -1.0, 3.0]
    # the unscored row is out of the mean (of 1 and 6: 3.5) and gets 0
    got = batch_mean_advantages(torch.tensor([1.0, 2.0, 6.0]), torch.tensor([True, False, True]))
    assert got.tolist() == [-2.5, 0.0, 2.5]
    with pytest.raises(ValueError, match=r"shape \(B,\)"):
        batch_mean_advantages(torch.zeros(2, 2))


def _credit_loop(values, action_mask, gamma, lam):
    """The naive form of the docstring: U = V - V[i_1] on the action tokens, GAE with no reward."""
    out = torch.zeros_like(values)
    for b in range(values.shape[0]):
        idx = action_mask[b].nonzero()[:, 0].tolist()
        if not idx:
            continue
        u = [float(values[b, i] - values[b, idx[0]]) for i in idx] + [0.0]
        c = 0.0
        for k in reversed(range(len(idx))):
            lam_k = float(lam[b, idx[k]]) if torch.is_tensor(lam) and lam.dim() == 2 else float(lam)
            c = gamma * u[k + 1] - u[k] + gamma * lam_k * c
            out[b, idx[k]] = c
    return out


def test_critic_credit_by_hand():
    mask = torch.tensor([[True, True, True]])
    values = torch.tensor([[0.2, 0.4, 0.7]])  # U = 0 .2 .5, U_4 = 0
    # gamma = lambda = 1: C_k = U_{n+1} - U_k = V_1 - V_k -> 0 -.2 -.5
    assert torch.allclose(critic_credit(values, mask, mask, 1.0, 1.0), torch.tensor([[0.0, -0.2, -0.5]]), atol=1e-7)
    # lambda .5: C_3 = 0 - .5 = -.5; C_2 = .5 - .2 + .5 * -.5 = .05; C_1 = .2 - 0 + .5 * .05 = .225
    assert torch.allclose(critic_credit(values, mask, mask, 1.0, 0.5), torch.tensor([[0.225, 0.05, -0.5]]),
                          atol=1e-7)


def test_critic_credit_steps_over_environment_tokens_and_matches_the_loop():
    g = torch.Generator().manual_seed(0)
    action = torch.tensor([[True, True, False, False, True, True, False],
                           [False, True, True, True, False, False, False],
                           [False] * 7])
    values = torch.randn(3, 7, generator=g)
    for gamma, lam in [(1.0, 1.0), (0.97, 0.9), (0.9, turn_length_adaptive_lam(action, 1.5))]:
        got = critic_credit(values, torch.ones_like(action), action, gamma, lam)
        assert torch.allclose(got, _credit_loop(values, action, gamma, lam), atol=1e-6)
        assert (got[~action] == 0).all()


@pytest.mark.parametrize("gamma, lam", [(1.0, 1.0), (0.99, 0.95), (0.5, 0.0)])
def test_a_flat_critic_gives_the_group_advantage_exactly(gamma, lam):
    action = torch.tensor([[True, True, True, False], [True, False, True, True]])
    sequence = torch.tensor([0.75, -1.25])
    for values in (torch.zeros(2, 4), torch.tensor([[0.3] * 4, [-2.0] * 4])):  # a zeroed head, any constant
        got = group_critic_advantages(sequence, values, torch.ones_like(action), action, gamma, lam)
        assert torch.equal(got, torch.where(action, sequence[:, None], 0.0))


def test_the_hybrid_with_gamma_and_lambda_one_is_the_group_advantage_minus_the_value_rise():
    # A_k = (S - m) - (V_k - V_1): .5 - 0, .5 - .2, .5 - .5 on a row with an environment token in it
    action = torch.tensor([[True, False, True, True]])
    values = torch.tensor([[0.2, 9.0, 0.4, 0.7]])
    got = group_critic_advantages(torch.tensor([0.5]), values, torch.ones_like(action), action, 1.0, 1.0)
    assert torch.allclose(got, torch.tensor([[0.5, 0.0, 0.3, 0.0]]), atol=1e-7)
    with pytest.raises(ValueError, match=r"shape \(B,\)"):
        group_critic_advantages(torch.zeros(2), values, torch.ones_like(action), action, 1.0, 1.0)


def test_the_functions_do_not_modify_their_inputs():
    action = torch.tensor([[True, True, False]])
    values = torch.tensor([[0.1, 0.4, 5.0]])
    kept = values.clone()
    group_critic_advantages(torch.tensor([1.0]), values, torch.ones_like(action), action, 0.9, 0.8)
    gate_explained_variance(values, values * 2, action)
    assert torch.equal(values, kept)
