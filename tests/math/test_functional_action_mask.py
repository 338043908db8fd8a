"""GAE over the policy's own tokens (`action_masked_gae`) and its reward check (issue 31).

Expected values are written by hand (arithmetic in the comments) or computed by a naive
Python loop in this file, one row at a time over that row's action tokens; never by the code
under test.
"""

from __future__ import annotations

import random

import pytest
import torch

from trl_ppo_ext import functional as F

NAN, INF = float("nan"), float("inf")


def mask(*rows: str) -> torch.Tensor:
    """``mask("1100011")`` -> bool (1, 7)."""
    return torch.tensor([[c == "1" for c in row] for row in rows])


def naive_action_gae(rewards, values, action_mask, gamma, lams):
    """The SPEC's rule in plain Python floats: the recursion over each row's action positions."""
    batch, length = action_mask.shape
    advantages = [[0.0] * length for _ in range(batch)]
    returns = [[0.0] * length for _ in range(batch)]
    for b in range(batch):
        positions = [t for t in range(length) if action_mask[b, t]]
        next_value, next_advantage = 0.0, 0.0
        for t in reversed(positions):
            delta = float(rewards[b, t]) + gamma * next_value - float(values[b, t])
            next_advantage = delta + gamma * lams[b] * next_advantage
            next_value = float(values[b, t])
            advantages[b][t] = next_advantage
            returns[b][t] = next_advantage + next_value
    return torch.tensor(advantages, dtype=torch.float64), torch.tensor(returns, dtype=torch.float64)


def worked_example(env_value=0.0, env_reward=0.0):
    """SPEC: tokens a1 a2 | o1 o2 o3 | b1 b2, action mask 1100011, V .5 .6 .7 .8 on the actions."""
    action = mask("1100011")
    values = torch.tensor([[0.5, 0.6, env_value, env_value, env_value, 0.7, 0.8]])
    rewards = torch.tensor([[0.0, 0.1, env_reward, env_reward, env_reward, 0.0, 1.0]])
    return rewards, values, torch.ones_like(action), action


# --------------------------------------------------------------------------- hand-computed


def test_the_specs_worked_example():
    rewards, values, response, action = worked_example()
    advantages, returns = F.action_masked_gae(rewards, values, response, action, gamma=1.0, gae_lambda=0.9)
    # b2: 1 - .8 = .2
    # b1: 0 + .8 - .7 + .9 * .2 = .28
    # a2: .1 + .7 - .6 + .9 * .28 = .452   (a2's next step is b1: o1..o3 are not steps)
    # a1: 0 + .6 - .5 + .9 * .452 = .5068
    expected = torch.tensor([[0.5068, 0.452, 0.0, 0.0, 0.0, 0.28, 0.2]])
    torch.testing.assert_close(advantages, expected, rtol=0, atol=1e-6)
    # returns = A + V on the actions: 1.0068 1.052 | 0 0 0 | .98 1.0
    torch.testing.assert_close(returns, torch.tensor([[1.0068, 1.052, 0.0, 0.0, 0.0, 0.98, 1.0]]), rtol=0, atol=1e-6)


def test_stepping_through_environment_tokens_gives_other_values():
    """The SPEC's contrast: the same row read as seven actions (values 0 on o1..o3) differs."""
    rewards, values, response, _ = worked_example()
    stepped, _ = F.masked_gae(rewards, values, response, 1.0, 0.9)
    # a2 stepped through o1: .1 + 0 - .6 + .9 * A[o1] != .452
    assert abs(stepped[0, 1].item() - 0.452) > 1e-2


def test_gamma_below_one_counts_action_steps_only():
    # row 1 0 1, gamma .5, lambda 1, V = 1 at both actions, reward 2 on the last one
    # A[2] = 2 - 1 = 1 ; A[0] = 0 + .5 * 1 - 1 + .5 * 1 * 1 = 0   (one step, not two)
    action = mask("101")
    advantages, returns = F.action_masked_gae(
        torch.tensor([[0.0, 0.0, 2.0]]), torch.tensor([[1.0, 5.0, 1.0]]), mask("111"), action, 0.5, 1.0
    )
    torch.testing.assert_close(advantages, torch.tensor([[0.0, 0.0, 1.0]]), rtol=0, atol=1e-7)
    torch.testing.assert_close(returns, torch.tensor([[1.0, 0.0, 2.0]]), rtol=0, atol=1e-7)


def test_a_row_ending_on_environment_tokens_and_padding():
    # row 0: actions at 0, 1; env at 2, 3 (the episode ends on the environment); pad at 4
    # row 1: no action at all -> zeros
    # gamma 1, lambda 1, V .5 .5, reward 1 on index 1 (the last action token)
    # A[1] = 1 - .5 = .5 ; A[0] = 0 + .5 - .5 + .5 = .5
    response = mask("11110", "11000")
    action = mask("11000", "00000")
    values = torch.tensor([[0.5, 0.5, NAN, INF, NAN], [NAN, 3.0, NAN, NAN, NAN]])
    rewards = torch.tensor([[0.0, 1.0, 0.0, 0.0, NAN], [7.0, 0.0, 0.0, 0.0, 0.0]])
    advantages, returns = F.action_masked_gae(rewards, values, response, action, 1.0, 1.0)
    torch.testing.assert_close(advantages, torch.tensor([[0.5, 0.5, 0, 0, 0], [0.0, 0, 0, 0, 0]]), rtol=0, atol=1e-7)
    torch.testing.assert_close(returns, torch.tensor([[1.0, 1.0, 0, 0, 0], [0.0, 0, 0, 0, 0]]), rtol=0, atol=1e-7)


# --------------------------------------------------------------------------- nothing read off the actions


@pytest.mark.parametrize("garbage", [NAN, INF, -INF, 1e30, -3.0])
def test_garbage_at_environment_positions_changes_nothing(garbage):
    clean = F.action_masked_gae(*worked_example(), gamma=1.0, gae_lambda=0.9)
    dirty = F.action_masked_gae(*worked_example(garbage, garbage), gamma=1.0, gae_lambda=0.9)
    for a, b in zip(clean, dirty):
        assert torch.equal(a, b)


def test_no_gradient_reaches_environment_positions():
    rewards, values, response, action = worked_example(env_value=NAN)
    values = values.clone().requires_grad_(True)
    rewards = rewards.clone().requires_grad_(True)
    advantages, returns = F.action_masked_gae(rewards, values, response, action, 1.0, 0.9)
    (returns.sum() + advantages.sum()).backward()
    environment = ~action
    assert torch.equal(values.grad[environment], torch.zeros(3))
    assert torch.equal(rewards.grad[environment], torch.zeros(3))
    assert torch.isfinite(values.grad).all() and (values.grad[action] != 0).any()


def test_inputs_are_not_modified():
    rewards, values, response, action = worked_example(env_value=NAN)
    copies = [t.clone() for t in (rewards, values, response, action)]
    F.action_masked_gae(rewards, values, response, action, 1.0, 0.9)
    for before, after in zip(copies, (rewards, values, response, action)):
        assert torch.equal(before.isnan(), after.isnan()) and torch.equal(before.nan_to_num(), after.nan_to_num())


# --------------------------------------------------------------------------- against the loop, and today


def random_masks(rng: random.Random, batch: int, length: int):
    """Prefix response masks; action masks of random turns inside them (some rows empty)."""
    response, action = torch.zeros(batch, length, dtype=torch.bool), torch.zeros(batch, length, dtype=torch.bool)
    for b in range(batch):
        n = rng.randint(0, length)
        response[b, :n] = True
        for t in range(n):
            action[b, t] = rng.random() < 0.6
    return response, action


@pytest.mark.parametrize("batch,length", [(1, 1), (3, 7), (5, 16), (4, 33), (2, 64)])
@pytest.mark.parametrize("per_row_lambda", [False, True])
def test_vectorised_equals_the_naive_loop_on_random_masks(batch, length, per_row_lambda):
    rng = random.Random(batch * 1000 + length + per_row_lambda)
    generator = torch.Generator().manual_seed(rng.randint(0, 2**31))
    for _ in range(5):
        response, action = random_masks(rng, batch, length)
        rewards = torch.randn(batch, length, generator=generator, dtype=torch.float64)
        rewards = torch.where(action, rewards, torch.full_like(rewards, NAN))  # off-action: garbage
        values = torch.where(action, torch.randn(batch, length, generator=generator, dtype=torch.float64), INF)
        gamma = rng.choice([1.0, 0.99, 0.7])
        lams = [rng.random() for _ in range(batch)] if per_row_lambda else [rng.choice([0.0, 0.95, 1.0])] * batch
        lam = torch.tensor(lams, dtype=torch.float64) if per_row_lambda else lams[0]
        advantages, returns = F.action_masked_gae(rewards, values, response, action, gamma, lam)
        expected_advantages, expected_returns = naive_action_gae(rewards, values, action, gamma, lams)
        torch.testing.assert_close(advantages, expected_advantages, rtol=1e-12, atol=1e-12)
        torch.testing.assert_close(returns, expected_returns, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16])
@pytest.mark.parametrize("lam", [0.95, "per_row"])
def test_an_all_action_mask_is_masked_gae_bitwise(dtype, lam):
    generator = torch.Generator().manual_seed(0)
    batch, length = 6, 40
    lengths = torch.tensor([40, 1, 0, 17, 39, 25])
    response = torch.arange(length) < lengths[:, None]
    rewards = torch.randn(batch, length, generator=generator).to(dtype)
    values = torch.randn(batch, length, generator=generator).to(dtype)
    lam = torch.rand(batch, generator=generator) if lam == "per_row" else lam
    expected = F.masked_gae(rewards, values, response, 1.0, lam)
    actual = F.action_masked_gae(rewards, values, response, response.clone(), 1.0, lam)
    for a, b in zip(actual, expected):
        assert a.dtype == b.dtype
        assert torch.equal(a, b)


def test_length_adaptive_lambda_over_the_action_tokens():
    # actions 1100011 -> L = 4; alpha .5 -> lambda = 1 - 1 / (.5 * 4) = .5
    action = mask("1100011")
    assert F.action_lengths(action).tolist() == [4]
    torch.testing.assert_close(F.length_adaptive_lam(action, 0.5), torch.tensor([0.5]))


def test_empty_batch_and_zero_length():
    empty = torch.zeros(2, 0)
    advantages, returns = F.action_masked_gae(empty, empty, empty.bool(), empty.bool(), 1.0, 0.9)
    assert advantages.shape == returns.shape == (2, 0)


# --------------------------------------------------------------------------- refusals


def test_an_action_outside_the_response_is_refused():
    with pytest.raises(ValueError, match=r"action_mask\[0, 2\] is True but response_mask\[0, 2\] is False"):
        F.action_masked_gae(torch.zeros(1, 3), torch.zeros(1, 3), mask("110"), mask("101"), 1.0, 0.9)


def test_masks_must_be_bool_and_of_one_shape():
    with pytest.raises(TypeError, match="action_mask must be a bool tensor"):
        F.action_masked_gae(torch.zeros(1, 3), torch.zeros(1, 3), mask("111"), torch.ones(1, 3), 1.0, 0.9)
    with pytest.raises(ValueError, match="same shape"):
        F.action_masked_gae(torch.zeros(1, 3), torch.zeros(1, 3), mask("111"), mask("11"), 1.0, 0.9)
    with pytest.raises(ValueError, match="gae_lambda"):
        F.action_masked_gae(torch.zeros(1, 3), torch.zeros(1, 3), mask("111"), mask("111"), 1.0, 1.5)


def test_a_reward_on_an_environment_token_is_refused():
    rewards, _, response, action = worked_example()
    F.check_rewards_on_actions(rewards, response, action)  # .1 on a2 and 1 on b2: fine
    rewards = rewards.clone()
    rewards[0, 3] = 0.25  # on o2
    with pytest.raises(ValueError, match=r"reward 'token_rewards' is 0.25 at row 0, index 3"):
        F.check_rewards_on_actions(rewards, response, action)
    with pytest.raises(ValueError, match=r"reward 'tool_bonus' is 0.25 at row 0, index 3, a response token"):
        F.check_rewards_on_actions(rewards, response, action, names="tool_bonus")


def test_the_reward_check_names_which_of_several_rewards():
    response, action = mask("1111", "1111"), mask("1111", "1001")
    stacked = torch.zeros(2, 2, 4)
    stacked[1, 1, 2] = NAN  # nan is not zero either
    with pytest.raises(ValueError, match=r"reward 'format' is nan at row 1, index 2"):
        F.check_rewards_on_actions(stacked, response, action, names=["correct", "format"])
    with pytest.raises(ValueError, match=r"names must give one name per reward \(2\)"):
        F.check_rewards_on_actions(stacked, response, action, names=["correct"])


def test_the_reward_check_ignores_padding():
    # padding (index 3) is outside the response: never read, never checked
    F.check_rewards_on_actions(torch.tensor([[0.0, 0.0, 1.0, 9.0]]), mask("1110"), mask("1010"))
    with pytest.raises(ValueError, match=r"token_rewards must have shape \(B, T\) or \(K, B, T\)"):
        F.check_rewards_on_actions(torch.zeros(1, 5), mask("1110"), mask("1010"))


def test_action_lengths_refuses_a_float_mask():
    with pytest.raises(TypeError, match="action_mask must be a bool tensor"):
        F.action_lengths(torch.ones(1, 3))


# --------------------------------------------------------------------------- decoupled lambdas


def test_decoupled_value_lambda_on_the_worked_example():
    # value_lambda 1: returns are Monte-Carlo over the actions (gamma 1): b2 1, b1 1, a2 1.1, a1 1.1
    # advantages keep lambda .9: .5068 .452 .28 .2 as in the SPEC
    rewards, values, response, action = worked_example(env_value=NAN)
    advantages, returns = F.action_masked_gae_decoupled(rewards, values, response, action, 1.0, 0.9, 1.0)
    torch.testing.assert_close(advantages, torch.tensor([[0.5068, 0.452, 0, 0, 0, 0.28, 0.2]]), rtol=0, atol=1e-6)
    torch.testing.assert_close(returns, torch.tensor([[1.1, 1.1, 0, 0, 0, 1.0, 1.0]]), rtol=0, atol=1e-6)


@pytest.mark.parametrize("batch,length", [(3, 7), (4, 33)])
def test_decoupled_equals_two_naive_loops(batch, length):
    rng = random.Random(7 + length)
    generator = torch.Generator().manual_seed(length)
    response, action = random_masks(rng, batch, length)
    rewards = torch.where(action, torch.randn(batch, length, generator=generator, dtype=torch.float64), NAN)
    values = torch.where(action, torch.randn(batch, length, generator=generator, dtype=torch.float64), NAN)
    lams, value_lams = [rng.random() for _ in range(batch)], [rng.random() for _ in range(batch)]
    lam, value_lam = (torch.tensor(x, dtype=torch.float64) for x in (lams, value_lams))  # float32 would round
    advantages, returns = F.action_masked_gae_decoupled(rewards, values, response, action, 0.9, lam, value_lam)
    expected_advantages, _ = naive_action_gae(rewards, values, action, 0.9, lams)
    _, expected_returns = naive_action_gae(rewards, values, action, 0.9, value_lams)
    torch.testing.assert_close(advantages, expected_advantages, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(returns, expected_returns, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("value_lambda", [None, 1.0, 0.5])
def test_an_all_action_mask_is_masked_gae_decoupled_bitwise(value_lambda):
    generator = torch.Generator().manual_seed(1)
    response = torch.arange(30) < torch.tensor([30, 3, 0, 12])[:, None]
    rewards, values = torch.randn(4, 30, generator=generator), torch.randn(4, 30, generator=generator)
    expected = F.masked_gae_decoupled(rewards, values, response, 0.99, 0.95, value_lambda)
    actual = F.action_masked_gae_decoupled(rewards, values, response, response.clone(), 0.99, 0.95, value_lambda)
    for a, b in zip(actual, expected):
        assert torch.equal(a, b)
