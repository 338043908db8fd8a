"""losses.value_only_loss, the loss of a critic epoch's step: checked by hand, and its gradient on the
values against the value part of ppo_loss's (what the critic gets in a joint step)."""

import pytest
import torch

from trl_ppo_ext.losses import ppo_loss, value_only_loss

MASK = torch.tensor([[True, True, False], [True, False, False]])
NEW = torch.tensor([[2.0, 0.0, 7.0], [1.0, 0.0, 7.0]])
OLD = torch.tensor([[1.0, 0.0, 0.0], [1.0, 0.0, 0.0]])
RETURNS = torch.tensor([[3.0, 1.0, 0.0], [0.0, 0.0, 0.0]])


def test_by_hand():
    loss, stats = value_only_loss(NEW, old_values=OLD, returns=RETURNS, response_mask=MASK, cliprange_value=0.5,
                                  vf_coef=0.1)
    # per valid token max((V - R)^2, (clip(V, old -+ 0.5) - R)^2):
    #   V=2, old 1 -> clip 1.5, R 3: max(1, 2.25) = 2.25 (clipped); V=0, old 0, R 1: 1; V=1, old 1, R 0: 1
    #   vf_loss = 0.5 * 4.25 / 3 = 0.708333..., clipfrac 1/3; the masked V=7 never counts
    assert stats["vf_loss"].item() == pytest.approx(0.5 * 4.25 / 3, abs=1e-6)
    assert stats["vf_clipfrac"].item() == pytest.approx(1 / 3, abs=1e-6)
    assert loss.item() == pytest.approx(0.1 * 0.5 * 4.25 / 3, abs=1e-7)
    assert stats["loss"].item() == pytest.approx(loss.item(), abs=1e-7)
    assert set(stats) == {"vf_loss", "vf_clipfrac", "loss"} and not any(v.requires_grad for v in stats.values())


def test_the_mini_batch_token_count_divides_and_the_stats_stay_this_micro_batchs():
    # 3 valid tokens here out of 6 in the mini-batch: the loss is half the micro-batch's own mean, the stat is not
    loss, stats = value_only_loss(NEW, old_values=OLD, returns=RETURNS, response_mask=MASK, cliprange_value=None,
                                  vf_coef=1.0, num_tokens=torch.tensor([6.0]))
    # unclipped: (2 - 3)^2 + (0 - 1)^2 + (1 - 0)^2 = 3; 0.5 * 3 / 6 = 0.25; own mean 0.5 * 3 / 3 = 0.5
    assert loss.item() == pytest.approx(0.25, abs=1e-7)
    assert stats["vf_loss"].item() == pytest.approx(0.5, abs=1e-7) and stats["vf_clipfrac"].item() == 0.0


def test_the_values_gradient_is_the_joint_steps():
    """d loss / d V of the value-only loss equals that of the full PPO loss (policy terms do not touch V)."""
    grads = []
    for joint in (False, True):
        values = NEW.clone().requires_grad_(True)
        if joint:
            loss, _ = ppo_loss(torch.zeros(2, 3), torch.zeros(2, 3, 4), values, old_logprobs=torch.zeros(2, 3),
                               old_values=OLD, advantages=torch.ones(2, 3), returns=RETURNS, response_mask=MASK,
                               cliprange=0.2, cliprange_value=0.5, vf_coef=0.1, entropy_coef=0.0)
        else:
            loss, _ = value_only_loss(values, old_values=OLD, returns=RETURNS, response_mask=MASK,
                                      cliprange_value=0.5, vf_coef=0.1)
        loss.backward()
        grads.append(values.grad)
    # by hand: 0.1 * 0.5 * 2 (V - R) / 3 on the unclipped tokens; 0 on the clipped one (its clipped V is flat)
    expected = torch.tensor([[0.0, 0.1 * (0.0 - 1.0) / 3, 0.0], [0.1 * (1.0 - 0.0) / 3, 0.0, 0.0]])
    torch.testing.assert_close(grads[0], expected, rtol=0, atol=1e-7)
    torch.testing.assert_close(grads[1], grads[0], rtol=0, atol=0)
