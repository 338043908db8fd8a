"""The critic recipe's math (issue 21) in trl_ppo_ext.functional: decoupled and per-sequence GAE
lambdas, VAPO's length-adaptive lambda, clip-higher, dual clip, and GRPO-named loss aggregation.

Expected values are written by hand (the arithmetic is in the comments) or computed by naive
formulas in this file (Python floats, one sequence at a time); never by the code under test.
"""

from __future__ import annotations

import math

import pytest
import torch

from trl_ppo_ext import functional as F

NAN, INF = float("nan"), float("inf")


def assert_close(actual, expected, rtol=1e-6, atol=None):
    """|actual - expected| <= rtol * |expected| + atol elementwise, in float64; atol defaults to
    1e-6 * max(1, max|expected|) (fp32 errors scale with the summed terms)."""
    actual = torch.as_tensor(actual).detach().to(torch.float64)
    expected = torch.as_tensor(expected, dtype=torch.float64)
    assert actual.shape == expected.shape, (actual.shape, expected.shape)
    if atol is None:
        atol = 1e-6 * max(1.0, expected.abs().max().item() if expected.numel() else 0.0)
    torch.testing.assert_close(actual, expected, rtol=rtol, atol=atol)


def prefix_mask(lengths, length):
    """bool (B, T): True on the first lengths[b] positions of each row."""
    return torch.arange(length)[None, :] < torch.as_tensor(lengths)[:, None]


def naive_two_lambda_gae(rewards, values, mask, gamma, lams, value_lams):
    """GAE one sequence at a time with Python floats, a policy lambda and a value lambda per row.

    Returns ``(advantages, returns, advantage_scale, return_scale)`` as nested lists. A scale is
    the discounted sum of the absolute values of every term that enters the result: fp32
    rounding errors are relative to it (the result may be a small difference of large terms).
    """
    out = [[], [], [], []]
    for r, v, m, lam, value_lam in zip(rewards.tolist(), values.tolist(), mask.tolist(), lams, value_lams):
        length = len(m)
        adv, gae_v, adv_scale, v_scale = ([0.0] * length for _ in range(4))
        for t in range(length - 1, -1, -1):
            if not m[t]:
                continue
            terminal = t == length - 1 or not m[t + 1]
            next_value = 0.0 if terminal else v[t + 1]
            delta = r[t] + gamma * next_value - v[t]
            delta_scale = abs(r[t]) + gamma * abs(next_value) + abs(v[t])
            adv[t] = delta + (0.0 if terminal else gamma * lam * adv[t + 1])
            gae_v[t] = delta + (0.0 if terminal else gamma * value_lam * gae_v[t + 1])
            adv_scale[t] = delta_scale + (0.0 if terminal else gamma * lam * adv_scale[t + 1])
            v_scale[t] = delta_scale + (0.0 if terminal else gamma * value_lam * v_scale[t + 1])
        out[0].append(adv)
        out[1].append([gae_v[t] + v[t] if m[t] else 0.0 for t in range(length)])
        out[2].append(adv_scale)
        out[3].append([v_scale[t] + abs(v[t]) if m[t] else 0.0 for t in range(length)])
    return out


def assert_within_scale(actual, expected, scale, rel=1e-6):
    """|actual - expected| <= rel * scale elementwise (exact where the scale is 0)."""
    expected, scale = torch.tensor(expected, dtype=torch.float64), torch.tensor(scale, dtype=torch.float64)
    error = (actual.double() - expected).abs()
    worst = (error - rel * scale).argmax()
    assert (error <= rel * scale).all(), (
        f"error {error.flatten()[worst].item():.3g} > {rel} * scale {scale.flatten()[worst].item():.3g} "
        f"at flat index {worst.item()}"
    )


def naive_length_adaptive_lam(length, alpha):
    return 1.0 - 1.0 / (alpha * length) if alpha * length > 1 else 0.0


# --------------------------------------------------------------------------- decoupled GAE


# row 0: three valid tokens; row 1: two (the third holds garbage that must not matter)
HAND_MASK = torch.tensor([[True, True, True], [True, True, False]])
HAND_REWARDS = torch.tensor([[1.0, 0.0, 2.0], [2.0, 4.0, 99.0]])
HAND_VALUES = torch.tensor([[0.5, 1.0, -1.0], [1.0, 2.0, NAN]])


def test_decoupled_gae_hand_computed_value_lambda_one_is_monte_carlo():
    advantages, returns = F.masked_gae_decoupled(HAND_REWARDS, HAND_VALUES, HAND_MASK, 0.5, 0.5, 1.0)
    # gamma = 0.5. Row 0 deltas: t2 (terminal) 2 + 0 - (-1) = 3; t1: 0 + 0.5 * (-1) - 1 = -1.5;
    #   t0: 1 + 0.5 * 1 - 0.5 = 1.0
    # advantages, gamma * lam = 0.25: A2 = 3; A1 = -1.5 + 0.25 * 3 = -0.75; A0 = 1 + 0.25 * -0.75 = 0.8125
    # value lambda 1, gamma * 1 = 0.5: G2 = 3; G1 = -1.5 + 0.5 * 3 = 0; G0 = 1 + 0.5 * 0 = 1
    #   R = V + G = [0.5 + 1, 1 + 0, -1 + 3] = [1.5, 1, 2]
    #   Monte-Carlo: R2 = 2; R1 = 0 + 0.5 * 2 = 1; R0 = 1 + 0.5 * 0 + 0.25 * 2 = 1.5
    # Row 1 deltas: t1 (terminal) 4 - 2 = 2; t0: 2 + 0.5 * 2 - 1 = 2
    #   A1 = 2; A0 = 2 + 0.25 * 2 = 2.5.  G1 = 2; G0 = 2 + 0.5 * 2 = 3 -> R = [1 + 3, 2 + 2] = [4, 4]
    #   Monte-Carlo: R1 = 4; R0 = 2 + 0.5 * 4 = 4
    assert_close(advantages, [[0.8125, -0.75, 3.0], [2.5, 2.0, 0.0]])
    assert_close(returns, [[1.5, 1.0, 2.0], [4.0, 4.0, 0.0]])


def test_decoupled_gae_without_value_lambda_returns_advantages_plus_values():
    advantages, returns = F.masked_gae_decoupled(HAND_REWARDS, HAND_VALUES, HAND_MASK, 0.5, 0.5)
    # advantages as above; R = A + V: [0.8125 + 0.5, -0.75 + 1, 3 - 1] and [2.5 + 1, 2 + 2]
    assert_close(advantages, [[0.8125, -0.75, 3.0], [2.5, 2.0, 0.0]])
    assert_close(returns, [[1.3125, 0.25, 2.0], [3.5, 4.0, 0.0]])


@pytest.mark.parametrize("gae", [F.masked_gae, F.masked_gae_loop, F.masked_gae_decoupled])
def test_per_sequence_lambda_hand_computed(gae):
    advantages, returns = gae(HAND_REWARDS, HAND_VALUES, HAND_MASK, 0.5, torch.tensor([0.5, 0.0]))
    # row 0 has lambda 0.5: as above. Row 1 has lambda 0: A = delta = [2, 2]; R = A + V = [3, 4]
    assert_close(advantages, [[0.8125, -0.75, 3.0], [2.0, 2.0, 0.0]])
    assert_close(returns, [[1.3125, 0.25, 2.0], [3.0, 4.0, 0.0]])


def test_decoupled_gae_per_sequence_value_lambda_hand_computed():
    _, returns = F.masked_gae_decoupled(HAND_REWARDS, HAND_VALUES, HAND_MASK, 0.5, 0.5, torch.tensor([0.0, 1.0]))
    # row 0, value lambda 0: G = delta = [1, -1.5, 3] -> R = [1.5, -0.5, 2]; row 1, lambda 1: [4, 4] as above
    assert_close(returns, [[1.5, -0.5, 2.0], [4.0, 4.0, 0.0]])


def test_single_lambda_gae_equals_decoupled_gae_bitwise():
    generator = torch.Generator().manual_seed(0)
    rewards, values = torch.randn(6, 70, generator=generator), torch.randn(6, 70, generator=generator)
    mask = torch.rand(6, 70, generator=generator) < 0.8
    single = F.masked_gae(rewards, values, mask, 0.99, 0.95)
    for value_lambda in (None, 0.95):  # 0.95 runs the second scan, on the same deltas
        decoupled = F.masked_gae_decoupled(rewards, values, mask, 0.99, 0.95, value_lambda)
        assert all(torch.equal(a, b) for a, b in zip(single, decoupled))
    # a (B,) lambda holding one value equals the float: gamma * lambda = 1.0 * 0.75 is exact either way
    as_float = F.masked_gae(rewards, values, mask, 1.0, 0.75)
    as_tensor = F.masked_gae(rewards, values, mask, 1.0, torch.full((6,), 0.75))
    assert all(torch.equal(a, b) for a, b in zip(as_float, as_tensor))


@pytest.mark.parametrize("holes", [False, True])
@pytest.mark.parametrize("length", [1, 9, 64, 300])
def test_decoupled_gae_matches_naive_loop_with_random_lambdas(length, holes):
    generator = torch.Generator().manual_seed(length + 1000 * holes)
    batch = 6
    rewards, values = torch.randn(batch, length, generator=generator), torch.randn(batch, length, generator=generator)
    if holes:
        mask = torch.rand(batch, length, generator=generator) < 0.7
    else:
        lengths = torch.randint(0, length + 1, (batch,), generator=generator)
        lengths[0] = length
        mask = prefix_mask(lengths, length)
    lams = torch.rand(batch, generator=generator)
    lams[:2] = torch.tensor([0.0, 1.0])  # the ends of the range
    value_lams = torch.rand(batch, generator=generator)
    value_lams[-1] = 1.0
    gamma = 0.97
    naive = naive_two_lambda_gae(rewards, values, mask, gamma, lams.tolist(), value_lams.tolist())
    advantages, returns = F.masked_gae_decoupled(rewards, values, mask, gamma, lams, value_lams)
    assert_within_scale(advantages, naive[0], naive[2])
    assert_within_scale(returns, naive[1], naive[3])
    # a scalar value lambda, and the per-sequence lambda in the loop reference
    naive_scalar = naive_two_lambda_gae(rewards, values, mask, gamma, lams.tolist(), [1.0] * batch)
    _, returns_mc = F.masked_gae_decoupled(rewards, values, mask, gamma, lams, 1.0)
    assert_within_scale(returns_mc, naive_scalar[1], naive_scalar[3])
    loop_advantages, _ = F.masked_gae_loop(rewards, values, mask, gamma, lams)
    assert_within_scale(loop_advantages, naive[0], naive[2])


def test_value_lambda_one_gives_monte_carlo_returns_whatever_the_values():
    generator = torch.Generator().manual_seed(5)
    rewards = torch.randn(4, 50, generator=generator, dtype=torch.float64)
    mask = prefix_mask([50, 31, 1, 0], 50)
    gamma = 0.9
    expected = []  # R_t = sum_k gamma^k r_{t+k} within the episode, terminal value 0
    for r, m in zip(rewards.tolist(), mask.tolist()):
        row, running = [0.0] * 50, 0.0
        for t in range(49, -1, -1):
            running = r[t] + gamma * running if m[t] else 0.0
            row[t] = running
        expected.append(row)
    for scale in (1.0, 1e3):  # two different critics: the targets must not change
        values = scale * torch.randn(4, 50, generator=generator, dtype=torch.float64)
        _, returns = F.masked_gae_decoupled(rewards, values, mask, gamma, 0.95, 1.0)
        assert_close(returns, expected, rtol=1e-12, atol=1e-12 * scale * 10)


@pytest.mark.parametrize("garbage", [NAN, INF, 1e30])
def test_decoupled_gae_ignores_everything_outside_the_mask(garbage):
    generator = torch.Generator().manual_seed(3)
    rewards, values = torch.randn(4, 40, generator=generator), torch.randn(4, 40, generator=generator)
    mask = prefix_mask([40, 25, 1, 0], 40)
    lams = F.length_adaptive_lam(mask, 0.1)
    clean = F.masked_gae_decoupled(rewards, values, mask, 0.99, lams, 1.0)
    dirty = F.masked_gae_decoupled(
        torch.where(mask, rewards, garbage), torch.where(mask, values, garbage), mask, 0.99, lams, 1.0
    )
    for a, b in zip(clean, dirty):
        assert torch.equal(a, b) and torch.equal(a[~mask], torch.zeros((~mask).sum()))


def test_gae_lambda_tensor_is_checked():
    ones, mask = torch.ones(2, 3), torch.ones(2, 3, dtype=torch.bool)
    with pytest.raises(ValueError, match=r"one value per sequence \(B = 2\).* got shape \(3,\)"):
        F.masked_gae(ones, ones, mask, 0.9, torch.full((3,), 0.5))
    with pytest.raises(ValueError, match=r"gae_lambda\[1\]=1.5"):
        F.masked_gae_decoupled(ones, ones, mask, 0.9, torch.tensor([0.5, 1.5]))
    with pytest.raises(ValueError, match=r"value_lambda\[0\]=nan"):
        F.masked_gae_decoupled(ones, ones, mask, 0.9, 0.9, torch.tensor([NAN, 0.5]))
    with pytest.raises(ValueError, match=r"value_lambda must be in \[0.0, 1.0\], got value_lambda=-0.5"):
        F.masked_gae_decoupled(ones, ones, mask, 0.9, 0.9, -0.5)


# --------------------------------------------------------------------------- length-adaptive lambda


def test_length_adaptive_lam_hand_computed():
    mask = torch.tensor([[True, True, True], [True, True, False], [True, False, True], [False, False, False]])
    # lengths 3, 2, 2 (a hole: every valid token counts), 0
    # alpha = 1: 1 - 1/3 = 2/3; 1 - 1/2 = 0.5; 0.5; alpha * 0 = 0 <= 1 -> 0
    assert_close(F.length_adaptive_lam(mask, 1.0, dtype=torch.float64), [2 / 3, 0.5, 0.5, 0.0], rtol=1e-15, atol=0)
    # alpha = 0.5: 1.5 -> 1 - 1/1.5 = 1/3; alpha * 2 = 1 <= 1 -> 0 (the formula would give 0 too); 0; 0
    assert_close(F.length_adaptive_lam(mask, 0.5, dtype=torch.float64), [1 / 3, 0.0, 0.0, 0.0], rtol=1e-15, atol=0)
    # VAPO's alpha 0.05: L = 200 -> 1 - 1/10 = 0.9; L = 10 -> alpha * L = 0.5 -> clamped to 0
    lams = F.length_adaptive_lam(prefix_mask([200, 10], 200), 0.05)
    assert lams.dtype == torch.float32 and lams.shape == (2,)
    assert_close(lams, [0.9, 0.0])


def test_length_adaptive_lam_matches_its_formula_and_stays_in_range():
    generator = torch.Generator().manual_seed(9)
    lengths = torch.randint(0, 513, (64,), generator=generator)
    for alpha in (0.05, 0.3, 2.0):
        lams = F.length_adaptive_lam(prefix_mask(lengths, 512), alpha, dtype=torch.float64)
        assert_close(lams, [naive_length_adaptive_lam(n, alpha) for n in lengths.tolist()], rtol=1e-14, atol=0)
        assert ((lams >= 0) & (lams < 1)).all()


@pytest.mark.parametrize("length", [7, 300])
def test_gae_with_length_adaptive_lambda_matches_naive_loop(length):
    generator = torch.Generator().manual_seed(length)
    batch, alpha, gamma = 8, 0.05, 1.0
    rewards, values = torch.randn(batch, length, generator=generator), torch.randn(batch, length, generator=generator)
    lengths = torch.randint(0, length + 1, (batch,), generator=generator)
    lengths[0] = length
    mask = prefix_mask(lengths, length)
    lams = [naive_length_adaptive_lam(n, alpha) for n in lengths.tolist()]
    naive = naive_two_lambda_gae(rewards, values, mask, gamma, lams, [1.0] * batch)  # VAPO: value lambda 1
    advantages, returns = F.masked_gae_decoupled(
        rewards, values, mask, gamma, F.length_adaptive_lam(mask, alpha), 1.0
    )
    assert_within_scale(advantages, naive[0], naive[2])
    assert_within_scale(returns, naive[1], naive[3])


def test_length_adaptive_lam_rejects_bad_arguments():
    mask = torch.ones(2, 3, dtype=torch.bool)
    for alpha in (0.0, -0.05, NAN, INF):
        with pytest.raises(ValueError, match=rf"alpha must be a finite number > 0 .*got alpha={alpha!r}"):
            F.length_adaptive_lam(mask, alpha)
    with pytest.raises(TypeError, match="response_mask must be a bool tensor"):
        F.length_adaptive_lam(torch.ones(2, 3), 0.05)


# --------------------------------------------------------------------------- clip-higher and dual clip


def surrogate(ratio, advantages, mask=None, cliprange=0.2, **kwargs):
    """``masked_clipped_surrogate`` on log-probs whose ratio is ``ratio`` (old log-probs 0)."""
    ratio = torch.as_tensor(ratio, dtype=torch.float32)
    new_logprobs = ratio.log().requires_grad_(True)
    mask = torch.ones(ratio.shape, dtype=torch.bool) if mask is None else mask
    loss, stats = F.masked_clipped_surrogate(
        new_logprobs, torch.zeros(ratio.shape), torch.as_tensor(advantages), mask, cliprange, **kwargs
    )
    loss.backward()
    return loss, stats, new_logprobs.grad


CLIP_RATIO = [[1.25, 0.75, 1.5], [0.5, 1.0, 2.0]]
CLIP_ADV = [[1.0, -1.0, 2.0], [1.0, 0.5, -1.0]]


def test_clip_higher_hand_computed():
    loss, stats, grad = surrogate(CLIP_RATIO, CLIP_ADV, cliprange_high=0.28)
    # clip(ratio, 0.8, 1.28); min(ratio * A, clip(ratio) * A):
    # row 0: min(1.25, 1.25) = 1.25 (inside); min(-0.75, -0.8) = -0.8 (lower clip);
    #        min(3, 1.28 * 2 = 2.56) = 2.56 (upper clip)
    # row 1: min(0.5, 0.8) = 0.5; min(0.5, 0.5) = 0.5; min(-2, -1.28) = -2 (unclipped)
    # sum = 1.25 - 0.8 + 2.56 + 0.5 + 0.5 - 2 = 2.01 over 6 tokens
    assert_close(loss, -2.01 / 6)
    assert_close(stats["clipfrac"], 2 / 6)
    assert_close(stats["clipfrac_lower"], 1 / 6)
    assert_close(stats["clipfrac_upper"], 1 / 6)
    assert stats["clipfrac_dual"].item() == 0.0
    # gradient -A * ratio / 6 where the unclipped term is chosen, 0 where clipped
    assert_close(grad, [[-1.25 / 6, 0.0, 0.0], [-0.5 / 6, -0.5 / 6, 2.0 / 6]])


def test_clip_higher_moves_only_the_upper_bound():
    symmetric, symmetric_stats, symmetric_grad = surrogate(CLIP_RATIO, CLIP_ADV)  # cliprange_high=None: 0.2
    # clip(ratio, 0.8, 1.2): row 0: min(1.25, 1.2) = 1.2 (now clipped); -0.8; min(3, 2.4) = 2.4
    # row 1 as before: 0.5, 0.5, -2. Sum = 1.2 - 0.8 + 2.4 + 0.5 + 0.5 - 2 = 1.8
    assert_close(symmetric, -1.8 / 6)
    assert_close(symmetric_stats["clipfrac_upper"], 2 / 6)
    assert_close(symmetric_stats["clipfrac_lower"], 1 / 6)  # the lower side is the same with or without
    # the token at ratio 1.25 with A > 0: clipped (no gradient) at 1.2, still learning at 1.28
    _, _, higher_grad = surrogate(CLIP_RATIO, CLIP_ADV, cliprange_high=0.28)
    assert symmetric_grad[0, 0].item() == 0.0 and higher_grad[0, 0].item() < 0
    assert torch.equal(symmetric_grad[:, 1], higher_grad[:, 1])  # ratio 0.75 / 1.0 with A < 0 or small
    # a lower clip range of 0.5 with an upper one of 0.28: ratio 0.75 with A < 0 is no longer clipped
    low_wide, low_stats, _ = surrogate(CLIP_RATIO, CLIP_ADV, cliprange=0.5, cliprange_high=0.28)
    # clip(ratio, 0.5, 1.28): row 0: 1.25; min(-0.75, -0.75) = -0.75 (inside now); 2.56
    # row 1: min(0.5, 0.5) = 0.5; 0.5; -2. Sum = 1.25 - 0.75 + 2.56 + 0.5 + 0.5 - 2 = 2.06
    assert_close(low_wide, -2.06 / 6)
    assert low_stats["clipfrac_lower"].item() == 0.0


DUAL_RATIO = [[5.0, 2.0, 0.5], [10.0, 5.0, 1.0]]
DUAL_ADV = [[-1.0, -1.0, -2.0], [-0.5, 1.0, 0.0]]


def test_dual_clip_hand_computed():
    loss, stats, grad = surrogate(DUAL_RATIO, DUAL_ADV, dual_clip=3.0)
    # min(ratio * A, clip(ratio, 0.8, 1.2) * A), then max(., 3 * A) where A < 0:
    # (0,0) r 5,  A -1:   min(-5, -1.2) = -5;   3A = -3   > -5   -> -3 (dual)
    # (0,1) r 2,  A -1:   min(-2, -1.2) = -2;   3A = -3   < -2   -> -2
    # (0,2) r 0.5, A -2:  min(-1, -1.6) = -1.6 (lower clip); 3A = -6 -> -1.6
    # (1,0) r 10, A -0.5: min(-5, -0.6) = -5;   3A = -1.5 > -5   -> -1.5 (dual)
    # (1,1) r 5,  A 1:    min(5, 1.2) = 1.2 (upper clip); A > 0: no dual clip
    # (1,2) r 1,  A 0:    0
    # sum = -3 - 2 - 1.6 - 1.5 + 1.2 + 0 = -6.9 -> loss = 6.9 / 6 = 1.15
    assert_close(loss, 1.15)
    assert_close(stats["clipfrac_dual"], 2 / 6)
    assert_close(stats["clipfrac"], 2 / 6)
    assert_close(stats["clipfrac_lower"], 1 / 6)
    assert_close(stats["clipfrac_upper"], 1 / 6)
    # no gradient through c * A (a constant) nor the clipped terms; (0,1): -A * r / 6 = 2 / 6
    assert_close(grad, [[0.0, 2.0 / 6, 0.0], [0.0, 0.0, 0.0]])
    without, without_stats, _ = surrogate(DUAL_RATIO, DUAL_ADV)
    # -5 - 2 - 1.6 - 5 + 1.2 + 0 = -12.4
    assert_close(without, 12.4 / 6)
    assert without_stats["clipfrac_dual"].item() == 0.0


def test_dual_clip_bounds_each_tokens_loss_by_c_times_abs_advantage():
    generator = torch.Generator().manual_seed(11)
    c, count = 3.0, 200
    log_ratio = torch.empty(count).uniform_(-5.0, 40.0, generator=generator)
    log_ratio[:3] = torch.tensor([100.0, 1000.0, INF])  # ratios up to inf
    advantages = -torch.rand(count, generator=generator) * 5 - 0.01  # all negative
    losses, unbounded = [], []
    for i in range(count):  # one token at a time: the per-token loss
        args = (log_ratio[i].reshape(1, 1), torch.zeros(1, 1), advantages[i].reshape(1, 1))
        mask = torch.ones(1, 1, dtype=torch.bool)
        losses.append(F.masked_clipped_surrogate(*args, mask, 0.2, dual_clip=c)[0].item())
        unbounded.append(F.masked_clipped_surrogate(*args, mask, 0.2)[0].item())
    bounds = (c * advantages.abs()).tolist()
    assert all(math.isfinite(loss) and loss <= bound * (1 + 1e-6) for loss, bound in zip(losses, bounds))
    assert sum(loss > bound for loss, bound in zip(unbounded, bounds)) > count // 2  # the bound does work


@pytest.mark.parametrize("dual_clip", [1.0, 0.5, -3.0, NAN, INF])
def test_dual_clip_must_exceed_one(dual_clip):
    ones, mask = torch.ones(1, 1), torch.ones(1, 1, dtype=torch.bool)
    with pytest.raises(ValueError, match=rf"dual_clip must be a finite number > 1 .*got dual_clip={dual_clip!r}"):
        F.masked_clipped_surrogate(ones, ones, ones, mask, 0.2, dual_clip=dual_clip)


def test_cliprange_high_must_not_be_negative():
    ones, mask = torch.ones(1, 1), torch.ones(1, 1, dtype=torch.bool)
    with pytest.raises(ValueError, match=r"cliprange_high must be in \[0.0, inf\], got cliprange_high=-0.1"):
        F.masked_clipped_surrogate(ones, ones, ones, mask, 0.2, cliprange_high=-0.1)


# --------------------------------------------------------------------------- loss aggregation

# 3 x 3 with row lengths 3, 1, 2: row sums 6, 4, 15 (token sum 25 over 6 tokens); row means 2, 4, 7.5
AGG_X = torch.tensor([[1.0, 2.0, 3.0], [4.0, 5.0, 6.0], [7.0, 8.0, 9.0]])
AGG_MASK = prefix_mask([3, 1, 2], 3)


def test_loss_aggregation_hand_computed():
    agg = F.masked_loss_aggregate
    assert_close(agg(AGG_X, AGG_MASK, "dapo"), 25 / 6)  # token mean
    assert_close(agg(AGG_X, AGG_MASK, "grpo"), (2 + 4 + 7.5) / 3)  # = 4.5, mean of row means
    assert_close(agg(AGG_X, AGG_MASK, "dr_grpo"), 25 / (3 * 3))  # B * T
    # the mini-batch's normalisers: 10 tokens, 6 sequences, a generation limit of 4
    assert_close(agg(AGG_X, AGG_MASK, "dapo", num_tokens=10), 2.5)
    assert_close(agg(AGG_X, AGG_MASK, "grpo", num_sequences=6), 13.5 / 6)
    assert_close(agg(AGG_X, AGG_MASK, "dr_grpo", num_sequences=6, max_completion_length=4), 25 / 24)
    # an empty row adds 0 to the sequence mean but counts as a sequence: (2 + 0 + 7.5) / 3
    empty_row = prefix_mask([3, 0, 2], 3)
    assert_close(agg(AGG_X, empty_row, "grpo"), 9.5 / 3)
    assert_close(F.masked_sequence_mean(AGG_X, AGG_MASK), 4.5)


def test_loss_aggregation_default_is_the_token_mean_bitwise():
    generator = torch.Generator().manual_seed(4)
    x, mask = torch.randn(5, 9, generator=generator), torch.rand(5, 9, generator=generator) < 0.6
    for num_tokens in (None, torch.tensor([23.0])):
        expected = F.masked_token_mean(x, mask, num_tokens)
        assert torch.equal(F.masked_loss_aggregate(x, mask, num_tokens=num_tokens), expected)


def _shards(split):
    """Row slices of sizes ``split`` (micro-batches, or processes' shards)."""
    starts = [sum(split[:i]) for i in range(len(split))]
    return [slice(s, s + n) for s, n in zip(starts, split)]


@pytest.mark.parametrize("loss_type", F.LOSS_TYPES)
@pytest.mark.parametrize("split", [[8], [3, 1, 4], [1] * 8, [2, 6]])
def test_loss_aggregation_shards_sum_to_the_whole(loss_type, split):
    generator = torch.Generator().manual_seed(6)
    lengths = torch.tensor([13, 1, 0, 7, 13, 4, 9, 2])
    x = torch.randn(8, 13, generator=generator, dtype=torch.float64)
    mask = prefix_mask(lengths, 13)
    # the whole mini-batch's normalisers, as every shard receives them
    normalisers = {"num_tokens": int(mask.sum()), "num_sequences": 8, "max_completion_length": 13}
    whole_x = x.clone().requires_grad_(True)
    whole = F.masked_loss_aggregate(whole_x, mask, loss_type)  # None: this batch's own, here the mini-batch
    whole.backward()
    shard_x = x.clone().requires_grad_(True)
    total = sum(
        F.masked_loss_aggregate(shard_x[rows], mask[rows], loss_type, **normalisers) for rows in _shards(split)
    )
    total.backward()
    assert_close(total, whole.item(), rtol=1e-14, atol=1e-14)
    assert_close(shard_x.grad, whole_x.grad, rtol=1e-14, atol=1e-14)  # the same gradient, token by token
    if len(split) > 1:  # each shard's own normalisers would not add up
        own = sum(F.masked_loss_aggregate(x[rows], mask[rows], loss_type) for rows in _shards(split))
        assert abs(own.item() - whole.item()) > 1e-3


@pytest.mark.parametrize("loss_type", F.LOSS_TYPES)
def test_loss_aggregation_ignores_padding_columns_given_the_normalisers(loss_type):
    # a micro-batch cut to its longest response, or padded further, gives the same value
    generator = torch.Generator().manual_seed(8)
    x, mask = torch.randn(4, 6, generator=generator, dtype=torch.float64), prefix_mask([6, 2, 0, 5], 6)
    normalisers = {"num_tokens": 13, "num_sequences": 4, "max_completion_length": 20}
    padded_x = torch.cat([x, torch.full((4, 5), NAN, dtype=torch.float64)], 1)
    padded_mask = torch.cat([mask, torch.zeros(4, 5, dtype=torch.bool)], 1)
    padded = F.masked_loss_aggregate(padded_x, padded_mask, loss_type, **normalisers)
    # equal up to the order of the summation (the padding adds zeros to the sums)
    assert_close(padded, F.masked_loss_aggregate(x, mask, loss_type, **normalisers).item(), rtol=1e-15, atol=1e-15)


@pytest.mark.parametrize("loss_type", F.LOSS_TYPES)
def test_surrogate_shards_sum_to_the_whole_with_clip_higher_and_dual_clip(loss_type):
    generator = torch.Generator().manual_seed(10)
    lengths = torch.tensor([9, 3, 0, 9, 5, 1])
    mask = prefix_mask(lengths, 9)
    new_logprobs = -torch.rand(6, 9, generator=generator, dtype=torch.float64) * 3
    old_logprobs = new_logprobs + torch.randn(6, 9, generator=generator, dtype=torch.float64)
    advantages = torch.randn(6, 9, generator=generator, dtype=torch.float64)
    options = {"cliprange_high": 0.28, "dual_clip": 3.0, "loss_type": loss_type}
    normalisers = {"num_tokens": int(mask.sum()), "num_sequences": 6, "max_completion_length": 9}
    whole_lp = new_logprobs.clone().requires_grad_(True)
    whole, stats = F.masked_clipped_surrogate(whole_lp, old_logprobs, advantages, mask, 0.2, **options)
    whole.backward()
    assert stats["clipfrac_dual"] > 0 and stats["clipfrac_upper"] > 0 and stats["clipfrac_lower"] > 0
    shard_lp = new_logprobs.clone().requires_grad_(True)
    total = sum(
        F.masked_clipped_surrogate(
            shard_lp[rows], old_logprobs[rows], advantages[rows], mask[rows], 0.2, **options, **normalisers
        )[0]
        for rows in _shards([2, 1, 3])
    )
    total.backward()
    assert_close(total, whole.item(), rtol=1e-14, atol=1e-14)
    assert_close(shard_lp.grad, whole_lp.grad, rtol=1e-14, atol=1e-14)


def test_surrogate_loss_types_hand_computed():
    # CLIP_RATIO / CLIP_ADV with clip-higher 0.28; row 1 keeps its first token only.
    # objective: row 0 [1.25, -0.8, 2.56] (sum 3.01, mean 3.01 / 3); row 1 [0.5]
    mask = torch.tensor([[True, True, True], [True, False, False]])
    losses = {t: surrogate(CLIP_RATIO, CLIP_ADV, mask, cliprange_high=0.28, loss_type=t)[0] for t in F.LOSS_TYPES}
    assert_close(losses["dapo"], -(3.01 + 0.5) / 4)
    assert_close(losses["grpo"], -(3.01 / 3 + 0.5) / 2)
    assert_close(losses["dr_grpo"], -(3.01 + 0.5) / (2 * 3))


def test_loss_aggregation_rejects_bad_arguments():
    with pytest.raises(ValueError, match=r"loss_type must be one of 'dapo', 'grpo', 'dr_grpo', got loss_type='bnpo'"):
        F.masked_loss_aggregate(AGG_X, AGG_MASK, "bnpo")
    with pytest.raises(ValueError, match="num_sequences must be > 0 .*got num_sequences=0"):
        F.masked_loss_aggregate(AGG_X, AGG_MASK, "grpo", num_sequences=0)
    with pytest.raises(ValueError, match="max_completion_length must be > 0 .*got max_completion_length=-1"):
        F.masked_loss_aggregate(AGG_X, AGG_MASK, "dr_grpo", max_completion_length=-1)
    with pytest.raises(ValueError, match="loss_type must be one of"):
        F.masked_clipped_surrogate(AGG_X, AGG_X, AGG_X, AGG_MASK, 0.2, loss_type="token_mean")


# --------------------------------------------------------------------------- no mutation


def test_new_functions_do_not_modify_their_inputs():
    generator = torch.Generator().manual_seed(12)
    mask = prefix_mask([4, 2, 0], 4)
    x = [torch.where(mask, torch.randn(3, 4, generator=generator), NAN) for _ in range(3)]
    lams = torch.tensor([0.2, 0.9, 1.0])
    inputs = [*x, mask, lams]
    before = [t.clone() for t in inputs]
    F.masked_gae_decoupled(x[0], x[1], mask, 0.9, lams, lams)
    F.masked_gae_loop(x[0], x[1], mask, 0.9, lams)
    F.length_adaptive_lam(mask, 0.05)
    F.masked_clipped_surrogate(x[0], x[1], x[2], mask, 0.2, cliprange_high=0.3, dual_clip=2.0, loss_type="grpo")
    for loss_type in F.LOSS_TYPES:
        F.masked_loss_aggregate(x[0], mask, loss_type)
    for after, original in zip(inputs, before):
        assert torch.equal(after.isnan(), original.isnan())
        assert torch.equal(after.nan_to_num(), original.nan_to_num())
