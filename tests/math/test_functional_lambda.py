"""The length-adaptive lambda's floor, its per-turn form and GAE with one lambda per token.

Expected values are hand-computed (arithmetic in the comments) or come from a naive loop here.
"""

import pytest
import torch

from trl_ppo_ext import functional as F


def test_the_floor_keeps_short_sequences_off_lambda_zero():
    mask = torch.tensor([[True] * 40, [True] * 10 + [False] * 30, [False] * 40])
    # alpha .05: L = 40 -> 1 - 1/2 = .5; L = 10 and the empty row -> alpha * L <= 1 -> the floor
    assert F.length_adaptive_lam(mask, 0.05).tolist() == [0.5, 0.0, 0.0]
    assert F.length_adaptive_lam(mask, 0.05, minimum=0.8).tolist() == pytest.approx([0.8, 0.8, 0.8])
    assert F.length_adaptive_lam(mask, 0.05, minimum=0.3).tolist() == pytest.approx([0.5, 0.3, 0.3])
    with pytest.raises(ValueError, match="minimum"):
        F.length_adaptive_lam(mask, 0.05, minimum=1.5)


def test_turn_lengths_by_hand():
    # turns of 1, 3 and 2 tokens in row 0; one turn of 4 in row 1. SAO's alpha 1.5:
    # l = 1 -> 1 - 1/1.5 = 1/3; l = 3 -> 1 - 1/4.5 = 7/9; l = 2 -> 1 - 1/3 = 2/3; l = 4 -> 1 - 1/6 = 5/6
    action = torch.tensor([[True, False, True, True, True, False, True, True],
                           [True, True, True, True, False, False, False, False]])
    lam = F.turn_length_adaptive_lam(action, 1.5)
    third, sevenths, two, fives = 1 / 3, 7 / 9, 2 / 3, 5 / 6
    expected = torch.tensor([[third, 0, sevenths, sevenths, sevenths, 0, two, two],
                             [fives, fives, fives, fives, 0, 0, 0, 0]])
    torch.testing.assert_close(lam, expected)
    # the floor, and alpha 0.05 (VAPO) where every turn is short: the floor everywhere on the actions
    torch.testing.assert_close(F.turn_length_adaptive_lam(action, 0.05, minimum=0.6), torch.where(action, 0.6, 0.0))
    # one run per row: every token its row's per-sequence lambda
    prefix = torch.tensor([[True] * 5 + [False] * 3, [True] * 8])
    per_row = F.length_adaptive_lam(prefix, 0.5)
    torch.testing.assert_close(F.turn_length_adaptive_lam(prefix, 0.5), torch.where(prefix, per_row[:, None], 0.0))


def _naive_gae(rewards, values, action, gamma, lam):
    """Reverse loop over each row's action positions, lam[b, t] weighting the step out of t."""
    advantages = torch.zeros_like(rewards)
    for b in range(rewards.shape[0]):
        idx = action[b].nonzero()[:, 0].tolist()
        running = 0.0
        for k in reversed(range(len(idx))):
            t = idx[k]
            next_value = float(values[b, idx[k + 1]]) if k + 1 < len(idx) else 0.0
            delta = float(rewards[b, t]) + gamma * next_value - float(values[b, t])
            running = delta + gamma * float(lam[b, t]) * running
            advantages[b, t] = running
    return advantages


def test_gae_with_a_per_token_lambda_matches_the_loop():
    g = torch.Generator().manual_seed(1)
    action = torch.tensor([[True, True, False, False, True, True, True],
                           [True, True, True, True, True, False, False]])
    rewards = torch.randn(2, 7, generator=g).masked_fill(~action, 0.0)
    values = torch.randn(2, 7, generator=g)
    lam = F.turn_length_adaptive_lam(action, 0.7, minimum=0.2)
    expected = _naive_gae(rewards, values, action, 0.95, lam)
    adv, ret = F.action_masked_gae(rewards, values, torch.ones_like(action), action, 0.95, lam)
    torch.testing.assert_close(adv, expected)
    torch.testing.assert_close(ret, torch.where(action, expected + values, 0.0))
    # the reference loop and the scan over a prefix mask, row 1
    prefix = action[1:]
    loop, _ = F.masked_gae_loop(rewards[1:], values[1:], prefix, 0.95, lam[1:])
    scan, _ = F.masked_gae(rewards[1:], values[1:], prefix, 0.95, lam[1:])
    torch.testing.assert_close(loop, expected[1:])
    torch.testing.assert_close(scan, expected[1:])


def test_a_per_token_lambda_equal_on_a_row_is_the_per_row_lambda():
    g = torch.Generator().manual_seed(2)
    mask = torch.arange(6)[None] < torch.tensor([6, 3, 1])[:, None]
    rewards, values = torch.randn(3, 6, generator=g), torch.randn(3, 6, generator=g)
    per_row = torch.tensor([0.9, 0.5, 0.0])
    a_row, r_row = F.masked_gae_decoupled(rewards, values, mask, 0.9, per_row, 1.0)
    a_tok, r_tok = F.masked_gae_decoupled(rewards, values, mask, 0.9, per_row[:, None].expand(3, 6), 1.0)
    torch.testing.assert_close(a_tok, a_row)
    torch.testing.assert_close(r_tok, r_row)


def test_a_lambda_of_the_wrong_shape_or_range_is_refused():
    mask = torch.ones(2, 3, dtype=torch.bool)
    with pytest.raises(ValueError, match=r"one per token \(T = 3\).*\(2, 4\)"):
        F.masked_gae(torch.zeros(2, 3), torch.zeros(2, 3), mask, 1.0, torch.zeros(2, 4))
    with pytest.raises(ValueError, match=r"gae_lambda\[\(1, 2\)\]=1.5"):
        F.masked_gae(torch.zeros(2, 3), torch.zeros(2, 3), mask, 1.0, torch.tensor([[0.5] * 3, [0.5, 0.5, 1.5]]))
