"""Tests of trl_ppo_ext.functional: hand-computed tiny tensors, naive references, invariances.

Expected values are written by hand (the arithmetic is in the comments) or computed by a
naive formula in this file (Python floats, one sequence at a time); never by the code
under test. Token ids: EOS = 2, PAD = 0 unless a case says pad == eos.
"""

from __future__ import annotations

import math
import os
import socket
import statistics
import time
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from trl_ppo_ext import functional as F

EOS, PAD = 2, 0
NAN, INF = float("nan"), float("inf")
GAE_FUNCTIONS = [F.masked_gae, F.masked_gae_loop]


def assert_close(actual, expected, rtol=1e-6, atol=None):
    """|actual - expected| <= rtol * |expected| + atol, elementwise, compared in float64.

    atol defaults to 1e-6 * max(1, max|expected|): fp32 rounding errors scale with the
    magnitude of the terms that were summed, not with each (possibly cancelled) result.
    """
    actual = torch.as_tensor(actual).detach().to(torch.float64)
    expected = torch.as_tensor(expected, dtype=torch.float64)
    assert actual.shape == expected.shape, (actual.shape, expected.shape)
    if atol is None:
        scale = expected.abs().max().item() if expected.numel() else 0.0
        atol = 1e-6 * max(1.0, scale)
    torch.testing.assert_close(actual, expected, rtol=rtol, atol=atol, equal_nan=False)


def prefix_mask(lengths, length):
    """bool (B, T): True on the first lengths[b] positions of each row."""
    return torch.arange(length)[None, :] < torch.as_tensor(lengths)[:, None]


def naive_gae(rewards, values, mask, gamma, lam):
    """GAE one sequence at a time with Python floats; a run of True ends at a False.

    Returns ``(advantages, returns, scale)`` as nested lists; ``scale[b][t]`` is the
    discounted sum of the absolute values of every term that enters A_t
    (``sum_k (gamma*lam)**(k-t) * (|r_k| + gamma*|V_k+1| + |V_k|)``): fp32 rounding errors
    are relative to it, not to A_t itself, which may be a small difference of large terms.
    """
    all_advantages, all_returns, all_scales = [], [], []
    for r, v, m in zip(rewards.tolist(), values.tolist(), mask.tolist()):
        length = len(m)
        advantages, scale = [0.0] * length, [0.0] * length
        for t in range(length - 1, -1, -1):
            if not m[t]:
                continue
            terminal = t == length - 1 or not m[t + 1]
            next_value = 0.0 if terminal else v[t + 1]
            next_advantage = 0.0 if terminal else advantages[t + 1]
            next_scale = 0.0 if terminal else scale[t + 1]
            delta = r[t] + gamma * next_value - v[t]
            advantages[t] = delta + gamma * lam * next_advantage
            scale[t] = abs(r[t]) + gamma * abs(next_value) + abs(v[t]) + gamma * lam * next_scale
        all_advantages.append(advantages)
        all_returns.append([advantages[t] + v[t] if m[t] else 0.0 for t in range(length)])
        all_scales.append(scale)
    return all_advantages, all_returns, all_scales


def assert_gae_close(actual, naive, values, which, rel=1e-6):
    """|actual - naive| <= rel * scale elementwise (see `naive_gae`); exact 0 where scale is 0.

    ``which`` is 0 for advantages, 1 for returns (whose scale adds |V_t|).
    """
    expected = torch.tensor(naive[which], dtype=torch.float64)
    scale = torch.tensor(naive[2], dtype=torch.float64)
    if which == 1:
        scale = scale + values.double().abs() * (scale > 0)
    error = (actual.double() - expected).abs()
    worst = (error - rel * scale).argmax()
    assert (error <= rel * scale).all(), (
        f"max error {error.flatten()[worst].item():.3g} > {rel} * scale "
        f"{scale.flatten()[worst].item():.3g} at flat index {worst.item()}"
    )


# --------------------------------------------------------------------------- rollout cases

# (id, response ids, stop_token_id, expected mask, expected last valid index)
CASES = [
    ("pad_ne_eos", [7, 8, EOS, PAD, PAD], EOS, [1, 1, 1, 0, 0], 2),
    ("pad_eq_eos", [7, 8, EOS, EOS, EOS], EOS, [1, 1, 1, 0, 0], 2),
    ("eos_first", [EOS, PAD, PAD, PAD, PAD], EOS, [1, 0, 0, 0, 0], 0),
    ("eos_first_pad_eq_eos", [EOS, EOS, EOS, EOS, EOS], EOS, [1, 0, 0, 0, 0], 0),
    ("eos_last_slot", [7, 8, 9, 6, EOS], EOS, [1, 1, 1, 1, 1], 4),
    ("truncated_no_eos", [7, 8, 9, 6, 5], EOS, [1, 1, 1, 1, 1], 4),
    ("pad_id_mid_response", [7, PAD, 8, EOS, PAD], EOS, [1, 1, 1, 1, 0], 3),
    ("stop_token_none", [7, 8, EOS, PAD, PAD], None, [1, 1, 1, 1, 1], 4),
]
CASE_IDS = [case[0] for case in CASES]


@pytest.mark.parametrize("case", CASES, ids=CASE_IDS)
def test_response_mask_cases(case):
    _, ids, stop, expected_mask, _ = case
    mask = F.response_mask(torch.tensor([ids]), stop)
    assert mask.dtype == torch.bool
    assert mask.tolist() == [[bool(m) for m in expected_mask]]


def test_response_mask_batch_mixes_cases():
    rows = [case for case in CASES if case[2] == EOS]
    mask = F.response_mask(torch.tensor([case[1] for case in rows]), EOS)
    assert mask.tolist() == [[bool(m) for m in case[3]] for case in rows]


def test_response_mask_takes_the_stop_id_in_any_integer_form():
    import numpy as np

    responses = torch.tensor([[5, 2, 0, 0], [5, 6, 7, 8], [2, 2, 2, 2]])
    expected = [[True, True, False, False], [True] * 4, [True, False, False, False]]
    for stop in (2, np.int64(2), torch.tensor(2), [2], (9, 2)):
        assert F.response_mask(responses, stop).tolist() == expected, type(stop)


def test_response_mask_rejects_1d():
    with pytest.raises(ValueError, match="responses"):
        F.response_mask(torch.tensor([7, 2]), EOS)


@pytest.mark.parametrize("case", CASES, ids=CASE_IDS)
def test_last_valid_index_cases(case):
    _, _, _, expected_mask, expected_last = case
    mask = torch.tensor([expected_mask], dtype=torch.bool)
    assert F.last_valid_index(mask).tolist() == [expected_last]


def test_last_valid_index_holes_empty_rows_and_no_columns():
    mask = torch.tensor([[True, False, True, False], [False, False, False, False]])
    # row 0: last True at 2 (holes do not matter); row 1: none -> -1
    assert F.last_valid_index(mask).tolist() == [2, -1]
    assert F.last_valid_index(torch.zeros(3, 0, dtype=torch.bool)).tolist() == [-1, -1, -1]


def test_masks_must_be_bool():
    with pytest.raises(TypeError, match="response_mask must be a bool tensor"):
        F.last_valid_index(torch.tensor([[1, 1, 0]]))


@pytest.mark.parametrize("case", CASES, ids=CASE_IDS)
def test_shaped_rewards_cases(case):
    _, ids, stop, expected_mask, expected_last = case
    mask = F.response_mask(torch.tensor([ids]), stop)
    # garbage where the mask is False must not leak: -inf log-probs, nan reference
    logprobs = torch.where(mask, torch.tensor(-1.0), torch.tensor(-INF))
    ref_logprobs = torch.where(mask, torch.tensor(-1.5), torch.tensor(NAN))
    rewards, non_score = F.shaped_rewards(logprobs, ref_logprobs, torch.tensor([3.0]), mask, 0.1)
    # k1 = logprobs - ref = -1 - (-1.5) = 0.5 per valid token; non-score = -0.1 * 0.5 = -0.05
    expected_non_score = [-0.05 if m else 0.0 for m in expected_mask]
    expected_rewards = list(expected_non_score)
    expected_rewards[expected_last] += 3.0  # the score sits on the EOS / last generated token
    assert_close(non_score, [expected_non_score])
    assert_close(rewards, [expected_rewards])
    assert torch.equal(rewards[~mask], torch.zeros((~mask).sum()))


@pytest.mark.parametrize("case", CASES, ids=CASE_IDS)
@pytest.mark.parametrize("gae", GAE_FUNCTIONS)
def test_gae_cases(case, gae):
    _, ids, stop, _, _ = case
    mask = F.response_mask(torch.tensor([ids]), stop)
    rewards = torch.tensor([[0.5, -1.0, 2.0, 0.25, 1.0]])
    values = torch.tensor([[0.1, 0.2, -0.3, 0.4, -0.5]])
    advantages, returns = gae(
        torch.where(mask, rewards, NAN), torch.where(mask, values, INF), mask, 0.9, 0.8
    )
    naive = naive_gae(rewards, values, mask, 0.9, 0.8)
    assert_gae_close(advantages, naive, values, 0)
    assert_gae_close(returns, naive, values, 1)
    assert torch.equal(advantages[~mask], torch.zeros((~mask).sum()))


@pytest.mark.parametrize("case", CASES, ids=CASE_IDS)
def test_whiten_cases(case):
    _, ids, stop, expected_mask, _ = case
    mask = F.response_mask(torch.tensor([ids]), stop)
    x = torch.tensor([[1.0, 2.0, 4.0, 8.0, 16.0]])
    valid = [v for v, m in zip(x[0].tolist(), expected_mask) if m]
    mean = statistics.fmean(valid)
    std = math.sqrt((statistics.variance(valid) if len(valid) > 1 else 0.0) + 1e-8)
    expected = [(v - mean) / std if m else 0.0 for v, m in zip(x[0].tolist(), expected_mask)]
    assert_close(F.masked_global_whiten(torch.where(mask, x, NAN), mask), [expected])


# --------------------------------------------------------------------------- KL and rewards

LOGPROBS = [[-1.0, -0.5, -INF], [-2.0, -1.0, -0.25]]
REF_LOGPROBS = [[-1.5, -0.5, -3.0], [-1.0, -1.0, -0.75]]
# logr = ref - logprobs: row 0: [-0.5, 0.0, (masked)]; row 1: [1.0, 0.0, -0.5]
HAND_KL = {
    "k1": [[0.5, 0.0], [-1.0, 0.0, 0.5]],  # -logr
    "k2": [[0.125, 0.0], [0.5, 0.0, 0.125]],  # logr**2 / 2
    # exp(logr) - 1 - logr: exp(-0.5) - 1 + 0.5 = 0.10653066, e - 1 - 1 = 0.71828183
    "k3": [[math.exp(-0.5) - 0.5, 0.0], [math.e - 2.0, 0.0, math.exp(-0.5) - 0.5]],
}


@pytest.mark.parametrize("estimator", F.KL_ESTIMATORS)
def test_kl_penalty_hand_computed(estimator):
    kl = F.kl_penalty(torch.tensor(LOGPROBS)[1:], torch.tensor(REF_LOGPROBS)[1:], estimator)
    assert_close(kl, [HAND_KL[estimator][1]])


def test_kl_penalty_unknown_estimator_names_argument_value_and_choices():
    with pytest.raises(ValueError, match=r"estimator='k4'.*'k1', 'k2', 'k3'"):
        F.kl_penalty(torch.zeros(1, 1), torch.zeros(1, 1), "k4")


@pytest.mark.parametrize("estimator", F.KL_ESTIMATORS)
def test_shaped_rewards_hand_computed(estimator):
    mask = torch.tensor([[True, True, False], [True, True, True]])
    scores = torch.tensor([1.0, -2.0])
    rewards, non_score = F.shaped_rewards(
        torch.tensor(LOGPROBS), torch.tensor(REF_LOGPROBS), scores, mask, 0.1, estimator
    )
    (a, b), (c, d, e) = HAND_KL[estimator]
    # non-score = -0.1 * KL on valid tokens, 0 on the masked third token of row 0
    expected_non_score = [[-0.1 * a, -0.1 * b, 0.0], [-0.1 * c, -0.1 * d, -0.1 * e]]
    # + score at the last valid token: row 0 -> index 1 (+1.0), row 1 -> index 2 (-2.0)
    expected_rewards = [[-0.1 * a, -0.1 * b + 1.0, 0.0], [-0.1 * c, -0.1 * d, -0.1 * e - 2.0]]
    assert_close(non_score, expected_non_score)
    assert_close(rewards, expected_rewards)
    assert non_score[0, 2].item() == 0.0 and rewards[0, 2].item() == 0.0  # exact, no nan


def test_shaped_rewards_row_without_valid_token_gets_no_score():
    mask = torch.tensor([[False, False], [True, False]])
    zeros = torch.zeros(2, 2)
    rewards, _ = F.shaped_rewards(zeros, zeros, torch.tensor([5.0, 7.0]), mask, 0.1)
    assert_close(rewards, [[0.0, 0.0], [7.0, 0.0]])


def test_shaped_rewards_checks_scores_shape():
    zeros, mask = torch.zeros(2, 3), torch.ones(2, 3, dtype=torch.bool)
    with pytest.raises(ValueError, match=r"scores must have shape \(B,\)"):
        F.shaped_rewards(zeros, zeros, torch.zeros(2, 1), mask, 0.1)


def trl_score_positions(responses, pad_token_id):
    """Where TRL puts the RM score, in our own words (trl 1.12, experimental/ppo/ppo_trainer.py):

    sequence_length = first_true_indices(response == pad_token_id) - 1
    actual_end = where(sequence_length + 1 < T, sequence_length + 1, sequence_length)
    """
    length = responses.shape[1]
    is_pad = responses == pad_token_id
    first_pad = torch.where(is_pad.any(dim=1), is_pad.int().argmax(dim=1), length)
    sequence_length = first_pad - 1
    actual_end = torch.where(sequence_length + 1 < length, sequence_length + 1, sequence_length)
    return actual_end, sequence_length


def test_regression_trl_actual_end_puts_score_on_padding_issues_1893_3750():
    """trl issues #1893 / #3750: TRL's `actual_end` is one past the last real token."""
    responses = torch.tensor(
        [
            [7, 8, EOS, PAD, PAD],  # pad != eos: TRL -> index 3 (a PAD), ours -> 2 (EOS)
            [7, PAD, 8, EOS, PAD],  # policy emits the pad id mid-text: TRL -> 1, ours -> 3
            [7, 8, 9, 6, 5],  # truncated: both -> 4, the last generated token
        ]
    )
    scores = torch.tensor([1.0, 2.0, 3.0])
    trl_end, _ = trl_score_positions(responses, PAD)
    assert trl_end.tolist() == [3, 1, 4]
    assert responses[0, trl_end[0]].item() == PAD  # the defect: score on a pad position

    mask = F.response_mask(responses, EOS)
    zeros = torch.zeros(responses.shape)
    rewards, _ = F.shaped_rewards(zeros, zeros, scores, mask, kl_coef=0.1)
    # KL is 0, so the rewards are the scores alone: on the EOS (or last token when truncated)
    assert_close(rewards, [[0, 0, 1.0, 0, 0], [0, 0, 0, 2.0, 0], [0, 0, 0, 0, 3.0]])
    assert responses[0, 2].item() == EOS and responses[1, 3].item() == EOS
    trl_rewards = torch.zeros(responses.shape)
    trl_rewards[torch.arange(3), trl_end] += scores
    assert not torch.allclose(trl_rewards[:2], rewards[:2])


def test_regression_trl_pad_eq_eos_drops_eos_from_mask():
    """With pad == eos TRL's length ends BEFORE the EOS and its score lands outside its mask."""
    responses = torch.tensor([[7, 8, EOS, EOS, EOS]])
    trl_end, trl_sequence_length = trl_score_positions(responses, EOS)
    trl_mask = torch.arange(5) <= trl_sequence_length[:, None]  # TRL: padding_mask = idx > len
    assert trl_end.tolist() == [2] and not trl_mask[0, 2]  # score on a position TRL masks out
    mask = F.response_mask(responses, EOS)
    assert mask[0, 2] and F.last_valid_index(mask).tolist() == [2]  # ours: the EOS counts


# --------------------------------------------------------------------------- GAE


@pytest.mark.parametrize("gae", GAE_FUNCTIONS)
def test_gae_hand_computed_prefix(gae):
    mask = torch.tensor([[True, True, False]])
    rewards = torch.tensor([[1.0, 2.0, 99.0]])
    values = torch.tensor([[0.5, 1.0, NAN]])
    advantages, returns = gae(rewards, values, mask, 0.9, 0.8)
    # t=1 (last valid, terminal): delta = 2 + 0 - 1.0 = 1.0; A1 = 1.0
    # t=0: delta = 1 + 0.9 * 1.0 - 0.5 = 1.4; A0 = 1.4 + 0.9 * 0.8 * 1.0 = 2.12
    assert_close(advantages, [[2.12, 1.0, 0.0]])
    assert_close(returns, [[2.12 + 0.5, 1.0 + 1.0, 0.0]])


@pytest.mark.parametrize("gae", GAE_FUNCTIONS)
def test_gae_hand_computed_holes_are_separate_episodes(gae):
    mask = torch.tensor([[True, False, True, True]])
    rewards = torch.tensor([[1.0, 5.0, 2.0, 3.0]])
    values = torch.tensor([[0.5, 7.0, 1.0, 2.0]])
    advantages, returns = gae(rewards, values, mask, 0.9, 0.8)
    # t=3: delta = 3 - 2 = 1; A3 = 1
    # t=2: delta = 2 + 0.9 * 2 - 1 = 2.8; A2 = 2.8 + 0.72 * 1 = 3.52
    # t=1: invalid -> 0; t=0: next position invalid -> terminal: A0 = 1 - 0.5 = 0.5
    assert_close(advantages, [[0.5, 0.0, 3.52, 1.0]])
    assert_close(returns, [[1.0, 0.0, 4.52, 3.0]])


@pytest.mark.parametrize("gae", GAE_FUNCTIONS)
def test_gae_empty_rows_and_zero_length(gae):
    ones, empty = torch.ones(2, 3), torch.zeros(2, 3, dtype=torch.bool)
    advantages, returns = gae(ones, ones, empty, 1.0, 1.0)
    assert torch.equal(advantages, torch.zeros(2, 3)) and torch.equal(returns, torch.zeros(2, 3))
    no_columns = torch.ones(2, 0)
    advantages, _ = gae(no_columns, no_columns, torch.zeros(2, 0, dtype=torch.bool), 1.0, 1.0)
    assert advantages.shape == (2, 0)


@pytest.mark.parametrize("gae", GAE_FUNCTIONS)
@pytest.mark.parametrize("length", [1, 7, 64, 300])
@pytest.mark.parametrize("gamma,lam", [(1.0, 0.95), (0.99, 0.95), (0.5, 0.0), (1.0, 1.0)])
def test_gae_matches_naive_reference_random_prefix_masks(gae, length, gamma, lam):
    generator = torch.Generator().manual_seed(length)
    rewards = torch.randn(5, length, generator=generator)
    values = torch.randn(5, length, generator=generator)
    lengths = torch.randint(0, length + 1, (5,), generator=generator)
    lengths[0] = length  # always one full (truncated) row
    mask = prefix_mask(lengths, length)
    advantages, returns = gae(rewards, values, mask, gamma, lam)
    naive = naive_gae(rewards, values, mask, gamma, lam)
    assert_gae_close(advantages, naive, values, 0)
    assert_gae_close(returns, naive, values, 1)


@pytest.mark.parametrize("gae", GAE_FUNCTIONS)
@pytest.mark.parametrize("gamma,lam", [(1.0, 0.95), (0.999, 0.99), (1.0, 1.0)])
def test_gae_matches_naive_reference_long_fp32_and_fp64(gae, gamma, lam):
    generator = torch.Generator().manual_seed(0)
    rewards = torch.randn(3, 4096, generator=generator)
    values = torch.randn(3, 4096, generator=generator)
    mask = prefix_mask([4096, 3000, 17], 4096)
    naive = naive_gae(rewards, values, mask, gamma, lam)
    advantages32, returns32 = gae(rewards, values, mask, gamma, lam)
    assert advantages32.dtype == torch.float32
    assert_gae_close(advantages32, naive, values, 0)
    assert_gae_close(returns32, naive, values, 1)
    advantages64, _ = gae(rewards.double(), values.double(), mask, gamma, lam)
    assert advantages64.dtype == torch.float64
    assert_gae_close(advantages64, naive, values, 0, rel=1e-14)


@pytest.mark.parametrize("gae", GAE_FUNCTIONS)
def test_gae_matches_naive_reference_masks_with_holes(gae):
    generator = torch.Generator().manual_seed(1)
    rewards = torch.randn(6, 50, generator=generator)
    values = torch.randn(6, 50, generator=generator)
    mask = torch.rand(6, 50, generator=generator) < 0.7
    advantages, returns = gae(rewards, values, mask, 0.97, 0.9)
    naive = naive_gae(rewards, values, mask, 0.97, 0.9)
    assert_gae_close(advantages, naive, values, 0)
    assert_gae_close(returns, naive, values, 1)


def test_vectorised_gae_agrees_with_loop_at_batch_64():
    generator = torch.Generator().manual_seed(2)
    rewards = torch.randn(64, 1024, generator=generator)
    values = torch.randn(64, 1024, generator=generator)
    mask = prefix_mask(torch.randint(1, 1025, (64,), generator=generator), 1024)
    vectorised = F.masked_gae(rewards, values, mask, 1.0, 0.95)
    loop = F.masked_gae_loop(rewards, values, mask, 1.0, 0.95)
    # normwise: max|vectorised - loop| <= 1e-6 * max|loop| (TRL's defaults gamma=1, lambda=0.95)
    for a, b in zip(vectorised, loop):
        assert (a - b).abs().max() <= 1e-6 * b.abs().max()


@pytest.mark.parametrize("gae", GAE_FUNCTIONS)
@pytest.mark.parametrize("garbage", [NAN, INF, -INF, 1e30])
def test_gae_ignores_everything_outside_the_mask(gae, garbage):
    generator = torch.Generator().manual_seed(3)
    rewards = torch.randn(4, 40, generator=generator)
    values = torch.randn(4, 40, generator=generator)
    mask = prefix_mask([40, 25, 1, 0], 40)
    clean = gae(rewards, values, mask, 0.99, 0.95)
    dirty_rewards, dirty_values = torch.where(mask, rewards, garbage), torch.where(mask, values, garbage)
    dirty = gae(dirty_rewards, dirty_values, mask, 0.99, 0.95)
    for a, b in zip(clean, dirty):
        assert torch.equal(a, b)  # bitwise: outside values are selected away before any arithmetic
        assert torch.equal(a[~mask], torch.zeros((~mask).sum()))


@pytest.mark.parametrize("gae", GAE_FUNCTIONS)
def test_gae_rejects_bad_arguments(gae):
    ones, mask = torch.ones(1, 2), torch.ones(1, 2, dtype=torch.bool)
    with pytest.raises(ValueError, match=r"gamma must be in \[0.0, 1.0\], got gamma=1.5"):
        gae(ones, ones, mask, 1.5, 0.9)
    with pytest.raises(ValueError, match="gae_lambda"):
        gae(ones, ones, mask, 0.9, -0.1)
    with pytest.raises(ValueError, match=r"values\(1, 3\)"):
        gae(ones, torch.ones(1, 3), mask, 0.9, 0.9)


# --------------------------------------------------------------------------- statistics


def test_masked_mean_hand_computed():
    x = torch.tensor([[1.0, 2.0, INF], [4.0, NAN, NAN]])
    mask = torch.tensor([[True, True, False], [True, False, False]])
    assert_close(F.masked_mean(x, mask), 7.0 / 3.0)  # (1 + 2 + 4) / 3
    assert_close(F.masked_mean(x, mask, dim=1), [1.5, 4.0])  # (1 + 2) / 2, 4 / 1
    assert_close(F.masked_mean(x, mask, dim=0), [2.5, 2.0, 0.0])  # empty column -> 0
    assert F.masked_mean(x, torch.zeros_like(mask)).item() == 0.0  # mean of nothing := 0


def test_masked_mean_gradient_is_finite_with_inf_outside():
    x = torch.tensor([[1.0, INF], [3.0, 4.0]], requires_grad=True)
    mask = torch.tensor([[True, False], [True, True]])
    F.masked_mean(x, mask).backward()
    assert_close(x.grad, [[1 / 3, 0.0], [1 / 3, 1 / 3]])


def test_masked_var_hand_computed():
    x = torch.tensor([[1.0, 2.0, 3.0], [4.0, INF, NAN]])
    mask = torch.tensor([[True, True, True], [True, False, False]])
    # valid 1, 2, 3, 4: mean 2.5; squared deviations 2.25 + 0.25 + 0.25 + 2.25 = 5
    assert_close(F.masked_var(x, mask), 5.0 / 3.0)
    assert_close(F.masked_var(x, mask, unbiased=False), 5.0 / 4.0)
    one = torch.tensor([[False, True, False], [False, False, False]])
    assert F.masked_var(x, one).item() == 0.0  # n = 1: no division by zero
    assert F.masked_var(x, torch.zeros_like(mask)).item() == 0.0  # n = 0


def test_masked_global_mean_var_local_hand_computed():
    x = torch.tensor([[1.0, 2.0, 3.0], [4.0, 1e6, NAN]])
    mask = torch.tensor([[True, True, True], [True, False, False]])
    mean, var = F.masked_global_mean_var(x, mask)
    assert mean.dtype == torch.float32 and mean.shape == ()
    assert_close(mean, 2.5)
    assert_close(var, 5.0 / 3.0)
    assert_close(F.masked_global_mean_var(x, mask, unbiased=False)[1], 1.25)


WHITEN_X = [[1.0, 2.0, 3.0], [4.0, 50.0, -7.0]]
WHITEN_MASK = [[True, True, True], [True, False, False]]
# valid 1, 2, 3, 4: mean 2.5, unbiased var 5/3; std = sqrt(5/3 + 1e-8)
WHITEN_STD = math.sqrt(5.0 / 3.0 + 1e-8)
WHITENED = [[-1.5 / WHITEN_STD, -0.5 / WHITEN_STD, 0.5 / WHITEN_STD], [1.5 / WHITEN_STD, 0.0, 0.0]]


def test_whiten_hand_computed():
    out = F.masked_global_whiten(torch.tensor(WHITEN_X), torch.tensor(WHITEN_MASK))
    assert_close(out, WHITENED)


@pytest.mark.parametrize(
    "kwargs", [{"keep_mean": True}, {"shift_mean": False}, {"shift_mean": False, "keep_mean": True}]
)
def test_whiten_keep_mean_adds_the_mean_back(kwargs):
    out = F.masked_global_whiten(torch.tensor(WHITEN_X), torch.tensor(WHITEN_MASK), **kwargs)
    expected = [
        [w + 2.5 if m else 0.0 for w, m in zip(w_row, m_row)] for w_row, m_row in zip(WHITENED, WHITEN_MASK)
    ]
    assert_close(out, expected)


@pytest.mark.parametrize(
    "kwargs",
    [{}, {"keep_mean": False}, {"shift_mean": True}, {"shift_mean": True, "keep_mean": False}],
)
def test_whiten_default_and_keep_mean_false_shift(kwargs):
    out = F.masked_global_whiten(torch.tensor(WHITEN_X), torch.tensor(WHITEN_MASK), **kwargs)
    assert_close(out, WHITENED)


@pytest.mark.parametrize("shift_mean,keep_mean", [(True, True), (False, False)])
def test_whiten_disagreeing_flags_raise(shift_mean, keep_mean):
    with pytest.raises(ValueError, match="shift_mean=.*keep_mean=.*disagree"):
        F.masked_global_whiten(
            torch.ones(1, 2), torch.ones(1, 2, dtype=torch.bool), shift_mean, keep_mean=keep_mean
        )


def test_whiten_padding_columns_do_not_change_valid_entries():
    generator = torch.Generator().manual_seed(4)
    x = torch.randn(4, 9, generator=generator)
    mask = prefix_mask([9, 5, 1, 3], 9)
    padded_x = torch.cat([x, torch.full((4, 6), 1e6)], dim=1)
    padded_mask = torch.cat([mask, torch.zeros(4, 6, dtype=torch.bool)], dim=1)
    out = F.masked_global_whiten(x, mask)
    padded_out = F.masked_global_whiten(padded_x, padded_mask)
    assert_close(padded_out[:, :9], out)
    assert torch.equal(padded_out[:, 9:], torch.zeros(4, 6))


@pytest.mark.parametrize("eps", [1e-8, 0.0])
def test_whiten_one_valid_element_is_finite(eps):
    x = torch.tensor([[3.0, NAN], [INF, 5.0]])
    mask = torch.tensor([[True, False], [False, False]])
    out = F.masked_global_whiten(x, mask, eps=eps)
    assert torch.equal(out, torch.zeros(2, 2))  # (3 - 3) / sqrt(0 + eps) = 0; 0 outside
    kept = F.masked_global_whiten(x, mask, keep_mean=True, eps=eps)
    assert_close(kept, [[3.0, 0.0], [0.0, 0.0]])
    empty = F.masked_global_whiten(x, torch.zeros_like(mask), eps=eps)
    assert torch.equal(empty, torch.zeros(2, 2))


def test_whiten_rejects_negative_eps():
    with pytest.raises(ValueError, match="eps must be >= 0, got eps=-1"):
        F.masked_global_whiten(torch.ones(1, 2), torch.ones(1, 2, dtype=torch.bool), eps=-1)


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _distributed_worker(rank, world_size, port, shards, out_dir):
    torch.set_num_threads(1)
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    dist.init_process_group(
        "gloo",
        init_method=f"tcp://127.0.0.1:{port}",
        rank=rank,
        world_size=world_size,
        timeout=timedelta(seconds=30),
    )
    try:
        x, mask = shards[rank]
        torch.save(
            {
                "mean_var": F.masked_global_mean_var(x, mask),
                "biased_var": F.masked_global_mean_var(x, mask, unbiased=False)[1],
                "whitened": F.masked_global_whiten(x, mask),
            },
            os.path.join(out_dir, f"rank{rank}.pt"),
        )
    finally:
        dist.destroy_process_group()


def test_global_statistics_across_two_gloo_processes(tmp_path):
    generator = torch.Generator().manual_seed(5)
    # two shards with 8 and 6 valid tokens; huge padding values would show if counted
    shard0 = (torch.randn(2, 6, generator=generator), prefix_mask([6, 2], 6))
    shard1 = (torch.randn(3, 6, generator=generator) + 1.0, prefix_mask([1, 0, 5], 6))
    shards = [(torch.where(mask, x, 1e6), mask) for x, mask in (shard0, shard1)]

    # fork: the children inherit the imported modules (importing the package takes seconds)
    context = mp.start_processes(
        _distributed_worker,
        args=(2, _free_port(), shards, str(tmp_path)),
        nprocs=2,
        join=False,
        start_method="fork",
    )
    deadline = time.monotonic() + 60
    while not context.join(timeout=1):
        if time.monotonic() > deadline:
            for process in context.processes:
                process.kill()
            pytest.fail("the two gloo processes did not finish within 60 s")

    valid = [v for x, mask in shards for v in x[mask].tolist()]
    mean, var = statistics.fmean(valid), statistics.variance(valid)  # naive, concatenated
    whole_x = torch.cat([shards[0][0], shards[1][0]])
    whole_mask = torch.cat([shards[0][1], shards[1][1]])
    whole = F.masked_global_whiten(whole_x, whole_mask)  # one process, whole batch
    for rank, (x, mask) in enumerate(shards):
        result = torch.load(tmp_path / f"rank{rank}.pt")
        assert_close(result["mean_var"][0], mean)
        assert_close(result["mean_var"][1], var)
        assert_close(result["biased_var"], statistics.pvariance(valid))
        expected = torch.where(mask, (x.double() - mean) / math.sqrt(var + 1e-8), 0.0)
        assert_close(result["whitened"], expected)
        rows = slice(0, 2) if rank == 0 else slice(2, 5)
        assert_close(result["whitened"], whole[rows])


# --------------------------------------------------------------------------- losses


def test_clipped_surrogate_hand_computed():
    ratio = torch.tensor([[0.5, 1.0, 1.5, 1.5], [0.5, 2.0, 9.0, INF]])
    new_logprobs = ratio.log().requires_grad_(True)  # old log-probs 0: exp(new - old) = ratio
    advantages = torch.tensor([[1.0, 2.0, 1.0, -1.0], [-1.0, 0.5, 5.0, NAN]])
    mask = torch.tensor([[True, True, True, True], [True, True, False, False]])
    loss, stats = F.masked_clipped_surrogate(new_logprobs, torch.zeros(2, 4), advantages, mask, 0.2)
    clipfrac = stats["clipfrac"]
    # min(ratio * A, clip(ratio, 0.8, 1.2) * A):
    # row 0: min(0.5, 0.8) = 0.5; min(2, 2) = 2 (tie: not clipped); min(1.5, 1.2) = 1.2 (clipped);
    #        min(-1.5, -1.2) = -1.5
    # row 1: min(-0.5, -0.8) = -0.8 (clipped); min(1.0, 0.6) = 0.6 (clipped)
    # sum = 0.5 + 2 + 1.2 - 1.5 - 0.8 + 0.6 = 2.0 over 6 tokens -> loss = -2/6
    assert_close(loss, -2.0 / 6.0)
    assert_close(clipfrac, 3.0 / 6.0)
    # ratios 0.5, 1, 1.5, 1.5, 0.5, 2 -> mean 7/6, max 2; log-ratios -> 0.5 * mean(log r ^ 2)
    assert_close(stats["ratio_mean"], 7.0 / 6.0)
    assert_close(stats["ratio_max"], 2.0)
    logs = [math.log(r) for r in (0.5, 1.0, 1.5, 1.5, 0.5, 2.0)]
    assert_close(stats["approxkl"], 0.5 * sum(x * x for x in logs) / 6)
    assert not any(v.requires_grad for v in stats.values())
    loss.backward()
    # d loss / d log pi_new = ratio * d loss / d ratio = -A * ratio / 6 where the unclipped term is
    # chosen, 0 where clipped or masked (the inf outside the mask stays out of the gradient)
    assert_close(new_logprobs.grad, [[-0.5 / 6, -2 / 6, 0.0, 1.5 / 6], [0.0, 0.0, 0.0, 0.0]])


def test_clipped_surrogate_rejects_negative_cliprange():
    with pytest.raises(ValueError, match="cliprange"):
        F.masked_clipped_surrogate(
            torch.ones(1, 1), torch.ones(1, 1), torch.ones(1, 1), torch.ones(1, 1, dtype=torch.bool), -0.2
        )


def test_clipped_value_loss_hand_computed():
    new_values = torch.tensor([[1.0, 2.0, 0.0], [1.1, 3.0, 7.0]])
    old_values = torch.tensor([[0.0, 2.5, 9.0], [1.0, 0.0, NAN]])
    returns = torch.tensor([[2.0, 2.0, 5.0], [0.0, 1.0, INF]])
    mask = torch.tensor([[True, True, False], [True, True, False]])
    loss, stats = F.masked_clipped_value_loss(new_values, old_values, returns, mask, 0.2)
    clipfrac = stats["clipfrac"]
    # (V - R)^2 vs (clip(V, V_old - 0.2, V_old + 0.2) - R)^2, take the max:
    # (1 - 2)^2 = 1    vs (0.2 - 2)^2 = 3.24 -> 3.24 (clipped)
    # (2 - 2)^2 = 0    vs (2.3 - 2)^2 = 0.09 -> 0.09 (clipped)
    # (1.1 - 0)^2 = 1.21 vs (1.1 - 0)^2 = 1.21 -> 1.21 (V inside the range: not clipped)
    # (3 - 1)^2 = 4    vs (0.2 - 1)^2 = 0.64 -> 4
    # 0.5 * (3.24 + 0.09 + 1.21 + 4) / 4 = 0.5 * 2.135 = 1.0675
    assert_close(loss, 1.0675)
    assert_close(clipfrac, 0.5)
    unclipped_loss, unclipped_stats = F.masked_clipped_value_loss(
        new_values, old_values, returns, mask, None
    )
    assert_close(unclipped_loss, 0.5 * (1.0 + 0.0 + 1.21 + 4.0) / 4)  # = 0.77625
    assert unclipped_stats["clipfrac"].item() == 0.0


# --------------------------------------------------------------------------- logits


def naive_log_softmax(row, index):
    return row[index] - math.log(sum(math.exp(z) for z in row))


def test_logprobs_from_logits_hand_computed():
    logits = torch.tensor(
        [[[0.0, 0.0, 0.0], [1.0, 2.0, 3.0]], [[0.0, math.log(2.0), 0.0], [-1.0, 0.0, 5.0]]]
    )
    tokens = torch.tensor([[1, 2], [1, 0]])
    out = F.logprobs_from_logits(logits, tokens)
    # uniform over 3: -ln 3; 3 - ln(e + e^2 + e^3); p = 2/4: ln(1/2); -1 - ln(e^-1 + 1 + e^5)
    expected = [
        [-math.log(3.0), 3.0 - math.log(math.e + math.e**2 + math.e**3)],
        [math.log(0.5), -1.0 - math.log(math.exp(-1.0) + 1.0 + math.exp(5.0))],
    ]
    assert_close(out, expected)


def test_logprobs_from_logits_bf16_is_computed_in_fp32():
    generator = torch.Generator().manual_seed(6)
    logits = (torch.randn(3, 4, 11, generator=generator) * 4).to(torch.bfloat16)
    tokens = torch.randint(0, 11, (3, 4), generator=generator)
    out = F.logprobs_from_logits(logits, tokens)
    assert out.dtype == torch.float32
    rows = logits.float().tolist()
    expected = [
        [naive_log_softmax(rows[b][t], tokens[b, t].item()) for t in range(4)] for b in range(3)
    ]
    assert_close(out, expected)


def test_logprobs_from_logits_checks_shapes():
    with pytest.raises(ValueError, match="tokens must have shape"):
        F.logprobs_from_logits(torch.zeros(2, 3, 5), torch.zeros(2, 4, dtype=torch.long))
    with pytest.raises(ValueError, match=r"logits must have shape \(B, T, V\)"):
        F.logprobs_from_logits(torch.zeros(3, 5), torch.zeros(3, dtype=torch.long))


def test_entropy_from_logits_hand_computed_and_banned_tokens():
    logits = torch.tensor(
        [
            [[0.0, 0.0, 0.0, 0.0], [0.0, math.log(2.0), -INF, -INF]],
            [[0.0, -INF, 0.0, -INF], [3.0, -INF, -INF, -INF]],
        ],
        requires_grad=True,
    )
    entropy = F.entropy_from_logits(logits)
    # uniform over 4: ln 4; p = (1/3, 2/3): ln 3 - (2/3) ln 2; uniform over 2: ln 2; one-hot: 0
    expected = [[math.log(4.0), math.log(3.0) - 2.0 / 3.0 * math.log(2.0)], [math.log(2.0), 0.0]]
    assert_close(entropy, expected)
    entropy.sum().backward()
    assert torch.isfinite(logits.grad).all()  # -inf logits give 0 * -inf nowhere


def test_entropy_from_logits_bf16_returns_fp32():
    logits = torch.zeros(2, 3, 8, dtype=torch.bfloat16)
    entropy = F.entropy_from_logits(logits)
    assert entropy.dtype == torch.float32
    assert_close(entropy, torch.full((2, 3), math.log(8.0), dtype=torch.float64))


def test_masked_entropy_hand_computed():
    logits = torch.tensor([[[0.0, 0.0], [NAN, NAN]], [[0.0, math.log(3.0)], [5.0, 5.0]]])
    mask = torch.tensor([[True, False], [True, True]])
    # ln 2, (masked), p = (1/4, 3/4): ln 4 - (3/4) ln 3, ln 2 -> mean of three
    expected = (2 * math.log(2.0) + math.log(4.0) - 0.75 * math.log(3.0)) / 3
    assert_close(F.masked_entropy(logits, mask), expected)


def test_masked_explained_variance_hand_computed():
    returns = torch.tensor([[1.0, 2.0, 3.0], [4.0, NAN, 0.0]])
    mask = torch.tensor([[True, True, True], [True, False, False]])
    # R = 1, 2, 3, 4: Var = 5/3; V = 1, 1, 3, 3: R - V = 0, 1, 0, 1 -> Var = 4 * 0.25 / 3 = 1/3
    values = torch.tensor([[1.0, 1.0, 3.0], [3.0, INF, 0.0]])
    assert_close(F.masked_explained_variance(values, returns, mask), 1.0 - (1.0 / 3.0) / (5.0 / 3.0))
    assert_close(F.masked_explained_variance(returns, returns, mask), 1.0)  # perfect critic
    constant = torch.full((2, 3), 2.0)
    assert F.masked_explained_variance(values, constant, mask).item() == 0.0  # Var[R] = 0 -> 0


# --------------------------------------------------------------------------- no mutation


def test_no_function_modifies_its_inputs():
    generator = torch.Generator().manual_seed(7)
    mask = prefix_mask([4, 2], 4)
    x = [torch.where(mask, torch.randn(2, 4, generator=generator), NAN) for _ in range(3)]
    logits = torch.randn(2, 4, 5, generator=generator)
    tokens = torch.randint(0, 5, (2, 4), generator=generator)
    scores = torch.randn(2, generator=generator)
    inputs = [*x, logits, tokens, scores, mask]
    before = [t.clone() for t in inputs]
    F.shaped_rewards(x[0], x[1], scores, mask, 0.1, "k3")
    for gae in GAE_FUNCTIONS:
        gae(x[0], x[1], mask, 0.9, 0.9)
    F.masked_global_whiten(x[0], mask, keep_mean=True)
    F.masked_var(x[0], mask)
    F.masked_clipped_surrogate(x[0], x[1], x[2], mask, 0.2)
    F.masked_clipped_value_loss(x[0], x[1], x[2], mask, 0.2)
    F.logprobs_from_logits(logits, tokens)
    F.masked_entropy(logits, mask)
    F.masked_explained_variance(x[0], x[1], mask)
    for after, original in zip(inputs, before):
        if after.is_floating_point():  # nan != nan, so compare the nan pattern and the rest
            assert torch.equal(after.isnan(), original.isnan())
            after, original = after.nan_to_num(), original.nan_to_num()
        assert torch.equal(after, original)


def test_shaped_rewards_take_a_precomputed_kl():
    # kl given (e.g. computed once for logging): used as is on the mask, ignored off it
    mask = torch.tensor([[True, True, False]])
    kl = torch.tensor([[0.5, 2.0, NAN]])
    rewards, non_score = F.shaped_rewards(torch.zeros(1, 3), torch.zeros(1, 3), torch.tensor([3.0]), mask, 0.1, kl=kl)
    # non-score: -0.1 * [0.5, 2.0] = [-0.05, -0.2], 0 off the mask; the score 3 lands on index 1
    assert_close(non_score, [[-0.05, -0.2, 0.0]])
    assert_close(rewards, [[-0.05, 2.8, 0.0]])
