"""Property tests of trl_ppo_ext.functional over random prefix masks and random values.

Hypothesis draws the shapes, the row lengths, gamma/lambda, the scale of the values and
what garbage sits outside the mask; the values themselves come from a seeded torch
generator (fast to draw, still shrinkable through the seed). Expected values come from
naive formulas in this file, never from the code under test.
"""

from __future__ import annotations

import math

import torch
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from trl_ppo_ext import functional as F

SETTINGS = settings(max_examples=40, deadline=None)
GARBAGE = st.sampled_from([float("nan"), float("inf"), float("-inf"), 1e30, 0.0])


@st.composite
def rollouts(draw, max_batch=4, max_length=40, min_length=1):
    """Random (rewards, values, logprobs, ref_logprobs, scores, mask) with a prefix mask.

    Every (B, T) float tensor holds the drawn garbage outside the mask.
    """
    batch = draw(st.integers(1, max_batch))
    length = draw(st.integers(min_length, max_length))
    lengths = draw(st.lists(st.integers(0, length), min_size=batch, max_size=batch))
    scale = draw(st.sampled_from([1e-3, 1.0, 100.0]))
    garbage = draw(GARBAGE)
    generator = torch.Generator().manual_seed(draw(st.integers(0, 2**31 - 1)))
    mask = torch.arange(length)[None, :] < torch.tensor(lengths)[:, None]

    def token_tensor(scale):
        return torch.where(mask, torch.randn(batch, length, generator=generator) * scale, garbage)

    rewards, values = token_tensor(scale), token_tensor(scale)
    # log-probabilities <= 0, within tens of nats (k3 = exp(logr) - 1 - logr overflows fp32
    # once ref_logprobs - logprobs > 88)
    logprobs, ref_logprobs = -token_tensor(3.0).abs(), -token_tensor(3.0).abs()
    scores = torch.randn(batch, generator=generator) * scale
    return rewards, values, logprobs, ref_logprobs, scores, mask


def discounts():
    return st.tuples(st.floats(0.0, 1.0), st.floats(0.0, 1.0))


def pad_columns(x, extra, fill):
    """Append ``extra`` columns holding ``fill`` (False for a mask)."""
    return torch.cat([x, torch.full((x.shape[0], extra), fill, dtype=x.dtype)], dim=1)


def assert_normwise_close(actual, expected, rel=1e-6):
    """max|actual - expected| <= rel * max(1, max|expected|)."""
    assert actual.shape == expected.shape
    if expected.numel() == 0:
        return
    actual, expected = actual.double(), expected.double()
    scale = max(1.0, expected.abs().max().item())
    assert (actual - expected).abs().max().item() <= rel * scale


def assert_zero_outside(x, mask):
    assert torch.equal(x[~mask], torch.zeros((~mask).sum().item(), dtype=x.dtype))
    assert torch.isfinite(x).all()


@SETTINGS
@given(rollouts(), discounts(), st.sampled_from(F.KL_ESTIMATORS))
def test_outputs_are_exactly_zero_outside_the_mask(rollout, gamma_lambda, estimator):
    rewards, values, logprobs, ref_logprobs, scores, mask = rollout
    shaped, non_score = F.shaped_rewards(logprobs, ref_logprobs, scores, mask, 0.05, estimator)
    assert_zero_outside(shaped, mask)
    assert_zero_outside(non_score, mask)
    for gae in (F.masked_gae, F.masked_gae_loop):
        advantages, returns = gae(rewards, values, mask, *gamma_lambda)
        assert_zero_outside(advantages, mask)
        assert_zero_outside(returns, mask)
    assert_zero_outside(F.masked_global_whiten(values, mask), mask)
    assert_zero_outside(F.masked_global_whiten(values, mask, keep_mean=True), mask)


@SETTINGS
@given(rollouts())
def test_whitened_valid_entries_have_mean_zero_and_unit_variance(rollout):
    _, values, _, _, _, mask = rollout
    valid = values[mask].double().tolist()
    assume(len(valid) >= 2)
    mean = sum(valid) / len(valid)
    assume(sum((v - mean) ** 2 for v in valid) > 0)
    # eps=0: exactly unit variance up to rounding (eps would scale it by var / (var + eps))
    out = F.masked_global_whiten(values, mask, eps=0.0)[mask].double().tolist()
    out_mean = sum(out) / len(out)
    out_var = sum((w - out_mean) ** 2 for w in out) / (len(out) - 1)  # unbiased
    assert abs(out_mean) <= 1e-6
    assert abs(out_var - 1.0) <= 1e-6


@SETTINGS
@given(rollouts())
def test_gamma_lambda_one_gives_reverse_cumulative_reward_minus_value(rollout):
    rewards, values, _, _, _, mask = rollout
    lengths = mask.sum(dim=1).tolist()
    expected = torch.zeros(mask.shape, dtype=torch.float64)
    bound = torch.zeros(mask.shape, dtype=torch.float64)
    for b, n in enumerate(lengths):  # A_t = sum(r[t:n]) - V_t, with Python floats
        r, v = rewards[b, :n].tolist(), values[b, :n].tolist()
        for t in range(n):
            expected[b, t] = math.fsum(r[t:]) - v[t]
            bound[b, t] = 1e-6 * (math.fsum(abs(x) for x in r[t:]) + 2 * sum(abs(x) for x in v[t:]))
    for gae in (F.masked_gae, F.masked_gae_loop):
        advantages, _ = gae(rewards, values, mask, 1.0, 1.0)
        # fp32 error is relative to the magnitude of the summed terms
        assert ((advantages.double() - expected).abs() <= bound).all()


@SETTINGS
@given(rollouts(), discounts(), st.integers(1, 20), GARBAGE)
def test_appending_padding_columns_changes_nothing(rollout, gamma_lambda, extra, garbage):
    rewards, values, logprobs, ref_logprobs, scores, mask = rollout
    length = mask.shape[1]
    padded_mask = pad_columns(mask, extra, False)
    padded = [pad_columns(x, extra, garbage) for x in (rewards, values, logprobs, ref_logprobs)]

    for original, longer in zip(
        F.shaped_rewards(logprobs, ref_logprobs, scores, mask, 0.05, "k3"),
        F.shaped_rewards(padded[2], padded[3], scores, padded_mask, 0.05, "k3"),
    ):
        assert_normwise_close(longer[:, :length], original)
        assert_zero_outside(longer, padded_mask)
    for gae in (F.masked_gae, F.masked_gae_loop):
        longer_outputs = gae(padded[0], padded[1], padded_mask, *gamma_lambda)
        for original, longer in zip(gae(rewards, values, mask, *gamma_lambda), longer_outputs):
            assert_normwise_close(longer[:, :length], original)
    whitened = F.masked_global_whiten(values, mask)
    assert_normwise_close(F.masked_global_whiten(padded[1], padded_mask)[:, :length], whitened)


@SETTINGS
@given(rollouts(max_length=80), discounts(), st.booleans())
def test_vectorised_gae_equals_loop_gae(rollout, gamma_lambda, holes):
    rewards, values, _, _, _, mask = rollout
    if holes:  # any mask: each run of True is its own episode; garbage where it is False
        generator = torch.Generator().manual_seed(mask.numel())
        mask = torch.rand(mask.shape, generator=generator) < 0.6
        rewards = torch.where(mask, torch.randn(mask.shape, generator=generator), float("nan"))
        values = torch.where(mask, torch.randn(mask.shape, generator=generator), float("inf"))
    vectorised = F.masked_gae(rewards, values, mask, *gamma_lambda)
    loop = F.masked_gae_loop(rewards, values, mask, *gamma_lambda)
    for a, b in zip(vectorised, loop):
        assert_normwise_close(a, b)
