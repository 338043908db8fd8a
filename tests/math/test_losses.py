"""losses.ppo_loss without a trainer: the composition of the three terms, checked by hand."""

import math

import pytest
import torch

from trl_ppo_ext import functional as F
from trl_ppo_ext.losses import loss_settings, ppo_loss

MASK = torch.tensor([[True, True, False], [True, False, False]])


def inputs(**changes):
    values = dict(
        new_logprobs=torch.log(torch.tensor([[1.5, 0.5, 1.0], [1.0, 1.0, 1.0]])),  # ratios 1.5, 0.5, 1
        logits=torch.zeros(2, 3, 4),  # uniform over 4: entropy log 4 at every token
        new_values=torch.tensor([[2.0, 0.0, 7.0], [1.0, 0.0, 7.0]]),
        old_logprobs=torch.zeros(2, 3), old_values=torch.tensor([[1.0, 0.0, 0.0], [1.0, 0.0, 0.0]]),
        advantages=torch.tensor([[1.0, -1.0, 5.0], [2.0, 5.0, 5.0]]),
        returns=torch.tensor([[3.0, 1.0, 0.0], [0.0, 0.0, 0.0]]),
        response_mask=MASK, cliprange=0.2, cliprange_value=0.5, vf_coef=0.1, entropy_coef=0.01,
    )
    values.update(changes)
    return values


def test_composition_by_hand():
    loss, stats = ppo_loss(**inputs())
    # surrogate per valid token: min(r A, clip(r, 0.8, 1.2) A):
    #   1.5 * 1 vs 1.2 * 1 -> 1.2 (clipped); 0.5 * -1 vs 0.8 * -1 -> -0.8 (clipped); 1 * 2 -> 2
    #   pg_loss = -(1.2 - 0.8 + 2) / 3 = -0.8, clipfrac 2/3
    assert stats["pg_loss"].item() == pytest.approx(-0.8, abs=1e-6)
    assert stats["pg_clipfrac"].item() == pytest.approx(2 / 3, abs=1e-6)
    # value per valid token: max((V - R)^2, (clip(V, old -+ 0.5) - R)^2):
    #   V=2, old 1 -> clip 1.5, R 3: max(1, 2.25) = 2.25 (clipped); V=0, old 0, R 1: 1; V=1, old 1, R 0: 1
    #   vf_loss = 0.5 * (2.25 + 1 + 1) / 3 = 0.708333..., vf_clipfrac 1/3
    assert stats["vf_loss"].item() == pytest.approx(0.5 * 4.25 / 3, abs=1e-6)
    assert stats["vf_clipfrac"].item() == pytest.approx(1 / 3, abs=1e-6)
    assert stats["entropy"].item() == pytest.approx(math.log(4), abs=1e-6)
    expected = -0.8 + 0.1 * (0.5 * 4.25 / 3) - 0.01 * math.log(4)
    assert loss.item() == pytest.approx(expected, abs=1e-6)
    assert stats["loss"].item() == pytest.approx(expected, abs=1e-6)
    # ratios over the valid tokens: 1.5, 0.5, 1 -> mean 1, max 1.5
    assert stats["ratio_mean"].item() == pytest.approx(1.0, abs=1e-6)
    assert stats["ratio_max"].item() == pytest.approx(1.5, abs=1e-6)
    assert all(not v.requires_grad for v in stats.values())


def test_loss_matches_the_three_functional_terms():
    args = inputs()
    loss, _ = ppo_loss(**args)
    pg, _ = F.masked_clipped_surrogate(args["new_logprobs"], args["old_logprobs"], args["advantages"], MASK, 0.2)
    vf, _ = F.masked_clipped_value_loss(args["new_values"], args["old_values"], args["returns"], MASK, 0.5)
    ent = F.masked_entropy(args["logits"], MASK)
    assert torch.equal(loss, pg + 0.1 * vf - 0.01 * ent)


def test_num_tokens_divides_the_loss_and_stats_stay_local_means():
    _, local = ppo_loss(**inputs())
    loss, shared = ppo_loss(**inputs(), num_tokens=torch.tensor([6.0]))  # 3 valid tokens of a 6-token mini-batch
    assert loss.item() == pytest.approx(local["loss"].item() * 3 / 6, abs=1e-6)
    for key in ("pg_loss", "vf_loss", "entropy", "loss"):
        assert shared[key].item() == pytest.approx(local[key].item(), abs=1e-6)


def test_entropy_gets_a_gradient_only_with_a_positive_coefficient():
    for coef, expect_grad in ((0.0, False), (0.01, True)):
        logits = torch.randn(2, 3, 4, generator=torch.Generator().manual_seed(0)).requires_grad_()
        # log-probs and values constant: only the entropy term can reach the logits
        loss, _ = ppo_loss(**inputs(logits=logits, entropy_coef=coef,
                                    new_values=inputs()["new_values"].requires_grad_()))
        loss.backward()
        assert (logits.grad is not None and logits.grad.abs().sum() > 0) == expect_grad


def test_loss_settings_reads_the_config_fields(make_config):
    config = make_config(cliprange=0.3, cliprange_value=0.4, vf_coef=0.5, entropy_coef=0.02, cliprange_high=0.35,
                         dual_clip=3.0, loss_type="grpo")
    assert loss_settings(config) == dict(cliprange=0.3, cliprange_value=0.4, vf_coef=0.5, entropy_coef=0.02,
                                         cliprange_high=0.35, dual_clip=3.0, loss_type="grpo")


def test_pg_weights_multiply_each_tokens_surrogate_and_leave_the_value_loss():
    # per valid token, unweighted (test_composition_by_hand): 1.2, -0.8, 2; weights 0.5, 2, 3:
    #   pg_loss = -(0.5 * 1.2 + 2 * -0.8 + 3 * 2) / 3 = -(0.6 - 1.6 + 6) / 3 = -5 / 3
    weights = torch.tensor([[0.5, 2.0, 9.0], [3.0, 9.0, 9.0]])  # 9 where the mask is False: never read
    plain_loss, plain = ppo_loss(**inputs())
    loss, stats = ppo_loss(**inputs(), pg_weights=weights)
    assert stats["pg_loss"].item() == pytest.approx(-5 / 3, abs=1e-6)
    assert stats["vf_loss"].item() == plain["vf_loss"].item()  # the value loss is not weighted
    assert stats["entropy"].item() == plain["entropy"].item()
    assert loss.item() == pytest.approx(plain_loss.item() + (-5 / 3 + 0.8), abs=1e-6)
    assert stats["pg_clipfrac"].item() == pytest.approx(2 / 3, abs=1e-6)  # same choices: weights > 0


def test_pg_weights_per_sequence_broadcast_and_scale_the_gradient():
    # (B, 1) weights 0.5 and 3: row 0's tokens 1.2 and -0.8 get 0.5, row 1's 2 gets 3:
    #   pg_loss = -(0.6 - 0.4 + 6) / 3 = -6.2 / 3
    new = torch.log(torch.tensor([[1.5, 0.5, 1.0], [1.0, 1.0, 1.0]])).requires_grad_(True)
    advantages = torch.tensor([[1.0, -1.0, 5.0], [2.0, 5.0, 5.0]])
    loss, stats = ppo_loss(**inputs(new_logprobs=new, advantages=advantages, vf_coef=0.0, entropy_coef=0.0),
                           pg_weights=torch.tensor([[0.5], [3.0]]))
    assert stats["pg_loss"].item() == pytest.approx(-6.2 / 3, abs=1e-6)
    loss.backward()
    # only row 1's token is unclipped: d/d logp of -(w * r * A) / 3 = -3 * 1 * 2 / 3 = -2; clipped tokens: 0
    torch.testing.assert_close(new.grad, torch.tensor([[0.0, 0.0, 0.0], [-2.0, 0.0, 0.0]]), atol=1e-6, rtol=0)
    assert advantages.tolist() == [[1.0, -1.0, 5.0], [2.0, 5.0, 5.0]]  # the caller's tensor is unchanged


# ---------------------------------------------------------------- episodes with turns: the loss over actions
def _episode_loss(logits, new_values, old_logprobs, old_values, advantages, returns, action_mask, **kw):
    logits = logits.clone().requires_grad_(True)
    new_values = new_values.clone().requires_grad_(True)
    tokens = torch.zeros(action_mask.shape, dtype=torch.long)
    new_logprobs = torch.log_softmax(logits, -1).gather(-1, tokens[..., None])[..., 0]
    loss, stats = ppo_loss(new_logprobs, logits, new_values, old_logprobs=old_logprobs, old_values=old_values,
                           advantages=advantages, returns=returns, response_mask=action_mask, cliprange=0.2,
                           cliprange_value=0.2, vf_coef=0.5, entropy_coef=0.01, **kw)
    loss.backward()
    return loss.detach(), logits.grad, new_values.grad, stats


@pytest.mark.parametrize("loss_type", ["dapo", "grpo", "dr_grpo"])
def test_garbage_at_environment_positions_changes_no_loss_and_no_gradient(loss_type):
    g = torch.Generator().manual_seed(0)
    B, T, V = 3, 7, 5
    act = torch.tensor([[1, 1, 0, 0, 0, 1, 1], [1, 0, 1, 0, 1, 0, 0], [0, 0, 1, 1, 1, 1, 0]], dtype=torch.bool)
    logits, new_values = torch.randn(B, T, V, generator=g), torch.randn(B, T, generator=g)
    old_logprobs, old_values = -torch.rand(B, T, generator=g), torch.randn(B, T, generator=g)
    advantages, returns = torch.randn(B, T, generator=g), torch.randn(B, T, generator=g)
    kw = {} if loss_type == "dapo" else dict(num_sequences=torch.tensor([3.0]), max_completion_length=T)
    clean = _episode_loss(logits, new_values, old_logprobs, old_values, advantages, returns, act,
                          loss_type=loss_type, **kw)
    env = ~act
    dirty = _episode_loss(
        torch.where(env[..., None], 1e4 * torch.randn(B, T, V, generator=g), logits),
        torch.where(env, torch.full((B, T), 3e3), new_values),
        torch.where(env, torch.full((B, T), -50.0), old_logprobs),
        torch.where(env, torch.full((B, T), float("nan")), old_values),
        torch.where(env, torch.full((B, T), float("inf")), advantages),
        torch.where(env, torch.full((B, T), float("-inf")), returns), act, loss_type=loss_type, **kw)
    assert torch.equal(clean[0], dirty[0])
    assert torch.equal(clean[1][act], dirty[1][act]) and torch.equal(clean[2][act], dirty[2][act])
    # no gradient at all reaches an environment position, clean or dirty
    for grads in (clean, dirty):
        assert torch.count_nonzero(grads[1][env]) == 0 and torch.count_nonzero(grads[2][env]) == 0
    for name in ("pg_loss", "vf_loss", "entropy", "pg_clipfrac", "vf_clipfrac", "approxkl", "ratio_mean"):
        assert torch.equal(clean[3][name], dirty[3][name]), name
