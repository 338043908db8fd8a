"""The off-policy corrections: behaviour weights and the decoupled / TIS loss on hand-computed
cases, and today's loss bit for bit when the sampler is the proximal policy."""

import math

import pytest
import torch

from trl_ppo_ext.losses import ppo_loss
from trl_ppo_ext.off_policy import behaviour_weights, off_policy_ppo_loss, off_policy_stats

LOG = math.log
MASK = torch.tensor([[True, True, False]])
# w = pi_prox / pi_behav: 0.4 / 0.2 = 2 on token 1, 0.5 / 0.5 = 1 on token 2; token 3 is padding
PROX = torch.tensor([[LOG(0.4), LOG(0.5), 0.0]])
BEHAV = torch.tensor([[LOG(0.2), LOG(0.5), -30.0]])


def _loss_kwargs(mask, advantages):
    zeros = torch.zeros(mask.shape)
    return dict(old_values=zeros, advantages=advantages, returns=zeros, response_mask=mask, cliprange=0.2,
                cliprange_value=0.2, vf_coef=0.0, entropy_coef=0.0)


def test_weights_tis_truncates_and_decoupled_leaves_out():
    tis = behaviour_weights(PROX, BEHAV, MASK, correction="tis", cap=1.5)
    decoupled = behaviour_weights(PROX, BEHAV, MASK, correction="decoupled", cap=1.5)
    # token 1: min(2, 1.5) = 1.5 (TIS), 2 > 1.5 -> 0 (decoupled); token 2: 1 both; padding: 1
    torch.testing.assert_close(tis, torch.tensor([[1.5, 1.0, 1.0]]), rtol=0, atol=1e-6)
    torch.testing.assert_close(decoupled, torch.tensor([[0.0, 1.0, 1.0]]), rtol=0, atol=1e-6)
    # under a cap of 3 neither touches w = 2
    torch.testing.assert_close(behaviour_weights(PROX, BEHAV, MASK, correction="decoupled", cap=3.0),
                               torch.tensor([[2.0, 1.0, 1.0]]), rtol=0, atol=1e-6)
    assert behaviour_weights(PROX, BEHAV, MASK, correction="none", cap=None) is None


def test_a_missing_behaviour_logprob_gets_weight_one_and_is_not_counted():
    behav = torch.tensor([[float("nan"), LOG(0.25), 0.0]])  # token 2: w = 0.5 / 0.25 = 2
    weights = behaviour_weights(PROX, behav, MASK, correction="tis", cap=1.5)
    torch.testing.assert_close(weights, torch.tensor([[1.0, 1.5, 1.0]]), rtol=0, atol=1e-6)
    stats = off_policy_stats(PROX, behav, MASK, weights, cap=1.5)
    # only token 2 counts: applied 1.5, raw 2 > 1.5, gap log 2
    assert stats["off_policy/weight_mean"].item() == pytest.approx(1.5, abs=1e-6)
    assert stats["off_policy/capped_frac"].item() == 1.0
    assert stats["off_policy/logp_gap_mean"].item() == pytest.approx(LOG(2), abs=1e-6)


def test_stats_on_a_hand_computed_batch():
    weights = behaviour_weights(PROX, BEHAV, MASK, correction="tis", cap=1.5)
    stats = off_policy_stats(PROX, BEHAV, MASK, weights, cap=1.5, staleness=2)
    # applied weights 1.5, 1 -> mean 1.25, max 1.5; one of two raw weights above the cap;
    # gaps |log 2|, 0 -> mean log(2) / 2; padding (gap 30) not counted
    expected = {"off_policy/weight_mean": 1.25, "off_policy/weight_max": 1.5, "off_policy/capped_frac": 0.5,
                "off_policy/logp_gap_mean": LOG(2) / 2, "off_policy/staleness": 2.0}
    assert {k: round(v.item(), 6) for k, v in stats.items()} == {k: round(v, 6) for k, v in expected.items()}
    empty = off_policy_stats(PROX, BEHAV, torch.zeros_like(MASK), None, cap=1.5)
    assert all(v.item() == 0.0 for v in empty.values())


@pytest.mark.parametrize("correction, expected", [
    ("none", -(1.0 + 2.0) / 2),            # ratio 1 (new == prox): -(A1 + A2) / 2 tokens
    ("tis", -(1.5 * 1.0 + 1.0 * 2.0) / 2),  # w = 1.5 (truncated), 1
    ("decoupled", -(0.0 + 1.0 * 2.0) / 2),  # token 1 left out, still counted in the divisor
])
def test_loss_on_a_hand_computed_case(correction, expected):
    advantages = torch.tensor([[1.0, 2.0, 0.0]])
    loss, stats = off_policy_ppo_loss(PROX.clone(), torch.zeros(1, 3, 4), torch.zeros(1, 3), proximal_logprobs=PROX,
                                      behaviour_logprobs=BEHAV, correction=correction, cap=1.5,
                                      **_loss_kwargs(MASK, advantages))
    assert loss.item() == pytest.approx(expected, abs=1e-6)
    assert stats["pg_loss"].item() == pytest.approx(expected, abs=1e-6)


def test_the_ratio_is_clipped_against_the_proximal_policy_not_the_behaviour():
    # token 1: new = prox * 1.5 -> ratio 1.5 vs prox, clipped to 1.2 (A > 0); against the
    # behaviour it would be 3. Weight (TIS, cap 5) w = 2: objective 2 * 1.2 * 1 = 2.4.
    # token 2: ratio 1, w = 1, A = 2: objective 2.   loss = -(2.4 + 2) / 2 = -2.2
    new = PROX + torch.tensor([[LOG(1.5), 0.0, 0.0]])
    loss, stats = off_policy_ppo_loss(new, torch.zeros(1, 3, 4), torch.zeros(1, 3), proximal_logprobs=PROX,
                                      behaviour_logprobs=BEHAV, correction="tis", cap=5.0,
                                      **_loss_kwargs(MASK, torch.tensor([[1.0, 2.0, 0.0]])))
    assert loss.item() == pytest.approx(-2.2, abs=1e-6)
    assert stats["pg_clipfrac"].item() == 0.5


@pytest.mark.parametrize("correction", ["none", "tis", "decoupled"])
def test_behaviour_equal_to_proximal_is_todays_loss_bit_for_bit(correction):
    gen = torch.Generator().manual_seed(0)
    B, T, V = 3, 5, 7
    mask = torch.rand(B, T, generator=gen) > 0.3
    prox = -torch.rand(B, T, generator=gen) * 3
    kwargs = dict(old_values=torch.randn(B, T, generator=gen), advantages=torch.randn(B, T, generator=gen),
                  returns=torch.randn(B, T, generator=gen), response_mask=mask, cliprange=0.2, cliprange_value=0.2,
                  vf_coef=0.1, entropy_coef=0.01, cliprange_high=0.28, dual_clip=3.0, num_tokens=torch.tensor(11.0))
    base_new, base_logits = prox + 0.3 * torch.randn(B, T, generator=gen), torch.randn(B, T, V, generator=gen)
    base_values = torch.randn(B, T, generator=gen)

    def run(fn, **extra):
        new, logits, values = (t.clone().requires_grad_() for t in (base_new, base_logits, base_values))
        loss, stats = fn(new, logits, values, **extra, **kwargs)
        loss.backward()
        return loss, stats, (new.grad, logits.grad, values.grad)

    ref_loss, ref_stats, ref_grads = run(ppo_loss, old_logprobs=prox)
    loss, stats, grads = run(off_policy_ppo_loss, proximal_logprobs=prox, behaviour_logprobs=prox.clone(),
                             correction=correction, cap=2.0)
    assert torch.equal(loss, ref_loss)
    assert all(torch.equal(a, b) for a, b in zip(grads, ref_grads))
    assert all(torch.equal(stats[k], v) for k, v in ref_stats.items())
    assert stats["off_policy/weight_mean"].item() == 1.0 and stats["off_policy/capped_frac"].item() == 0.0


def test_inputs_are_not_changed():
    prox, behav = PROX.clone(), BEHAV.clone()
    behaviour_weights(prox, behav, MASK, correction="decoupled", cap=1.5)
    assert torch.equal(prox, PROX) and torch.equal(behav, BEHAV)


def test_bad_arguments_are_named():
    with pytest.raises(ValueError, match="correction must be one of"):
        behaviour_weights(PROX, BEHAV, MASK, correction="is", cap=2.0)
    for cap in (None, 0.5, float("nan"), float("inf")):
        with pytest.raises(ValueError, match="cap"):
            behaviour_weights(PROX, BEHAV, MASK, correction="tis", cap=cap)
    with pytest.raises(ValueError, match="one shape"):
        behaviour_weights(PROX, BEHAV[:, :2], MASK, correction="tis", cap=2.0)
    with pytest.raises(TypeError, match="sets old_logprobs"):
        off_policy_ppo_loss(PROX, torch.zeros(1, 3, 4), torch.zeros(1, 3), proximal_logprobs=PROX,
                            behaviour_logprobs=BEHAV, correction="tis", cap=2.0, old_logprobs=PROX,
                            **_loss_kwargs(MASK, torch.zeros(1, 3)))


@pytest.mark.parametrize("correction", ["tis", "decoupled"])
def test_the_trainers_loss_with_the_mismatch_weights_is_the_off_policy_loss(correction):
    # the trainer calls ppo_loss(old_logprobs=pi_prox, pg_weights=generation.mismatch.sampling_weights(...)):
    # with off_policy_correction set those weights are the behaviour weights, so its loss and gradients are
    # off_policy_ppo_loss's on a stale batch (behaviour != proximal, some weights above the cap)
    from types import SimpleNamespace

    from trl_ppo_ext.generation.mismatch import sampling_weights

    gen = torch.Generator().manual_seed(1)
    B, T, V = 3, 5, 7
    mask = torch.rand(B, T, generator=gen) > 0.3
    prox = -torch.rand(B, T, generator=gen) * 3
    behav = prox - torch.randn(B, T, generator=gen)  # weights exp(+-1): about a sixth above a cap of 2
    kwargs = dict(old_values=torch.randn(B, T, generator=gen), advantages=torch.randn(B, T, generator=gen),
                  returns=torch.randn(B, T, generator=gen), response_mask=mask, cliprange=0.2, cliprange_value=0.2,
                  vf_coef=0.1, entropy_coef=0.01)
    base = (prox + 0.3 * torch.randn(B, T, generator=gen), torch.randn(B, T, V, generator=gen),
            torch.randn(B, T, generator=gen))
    args = SimpleNamespace(off_policy_correction=correction, off_policy_cap=2.0,
                           vllm_importance_sampling_correction=False)

    def run(fn, **extra):
        new, logits, values = (t.clone().requires_grad_() for t in base)
        loss, _ = fn(new, logits, values, **extra, **kwargs)
        loss.backward()
        return loss, (new.grad, logits.grad, values.grad)

    weights = sampling_weights(prox, behav, mask, args)
    assert (weights[mask] != 1).any() and (behaviour_weights(prox, behav, mask, correction=correction, cap=2.0)
                                           .equal(weights))
    ref_loss, ref_grads = run(off_policy_ppo_loss, proximal_logprobs=prox, behaviour_logprobs=behav,
                              correction=correction, cap=2.0)
    loss, grads = run(ppo_loss, old_logprobs=prox, pg_weights=weights)
    assert torch.equal(loss, ref_loss) and all(torch.equal(a, b) for a, b in zip(grads, ref_grads))
