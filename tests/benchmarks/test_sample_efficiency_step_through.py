"""benchmarks/sample_efficiency/step_through.py: GAE stepping through environment tokens, by hand and
against the package's GAE."""

import torch


def test_step_through_gae_by_hand(se):
    """Tokens a1 a2 | o1 o2 o3 | b1 b2 (o: environment), gamma 1, lambda 0.9, values .5 .6 .7 .8 on
    the actions, reward .1 on a2 and 1 on b2 (the package's GAE over the actions gives .5068 .452 .28 .2).
    Stepping through: V = r = 0 at o1..o3. Deltas r + V_next - V: b2 1 - .8 = .2; b1 .8 - .7 = .1;
    o3 .7 - 0 = .7; o2 0; o1 0; a2 .1 + 0 - .6 = -.5 (bootstraps against V(o1) = 0); a1 .6 - .5 = .1.
    A = delta + .9 A_next: b2 .2; b1 .1 + .18 = .28; o3 .7 + .252 = .952; o2 .8568; o1 .77112;
    a2 -.5 + .694008 = .194008; a1 .1 + .1746072 = .2746072."""
    action = torch.tensor([[True, True, False, False, False, True, True]])
    response = torch.ones(1, 7, dtype=torch.bool)
    values = torch.tensor([[0.5, 0.6, 9.0, -9.0, 9.0, 0.7, 0.8]], dtype=torch.float64)  # garbage at o1..o3
    rewards = torch.tensor([[0.0, 0.1, 0.0, 0.0, 0.0, 0.0, 1.0]], dtype=torch.float64)
    adv, ret = se.step_through_gae(rewards, values, response, action, 1.0, 0.9)
    expected = torch.tensor([[0.2746072, 0.194008, 0.0, 0.0, 0.0, 0.28, 0.2]], dtype=torch.float64)
    torch.testing.assert_close(adv, expected, rtol=0, atol=1e-12)
    torch.testing.assert_close(ret, torch.where(action, expected + values, 0.0), rtol=0, atol=1e-12)
    # value_lam 1: returns are the Monte-Carlo sums of the rewards ahead: .1 + 1 at a1 and a2, 1 at b1 and b2
    _, mc = se.step_through_gae(rewards, values, response, action, 1.0, 0.9, 1.0)
    torch.testing.assert_close(mc, torch.tensor([[1.1, 1.1, 0, 0, 0, 1.0, 1.0]], dtype=torch.float64),
                               rtol=0, atol=1e-12)


def test_step_through_is_the_package_gae_without_environment_tokens(se):
    from trl_ppo_ext.functional import masked_gae

    gen = torch.Generator().manual_seed(0)
    rewards, values = torch.randn(3, 6, generator=gen), torch.randn(3, 6, generator=gen)
    mask = torch.tensor([[True] * 6, [True] * 4 + [False] * 2, [True] + [False] * 5])
    adv, ret = se.step_through_gae(rewards, values, mask, mask, 0.99, 0.95)
    ref_adv, ref_ret = masked_gae(rewards, values, mask, 0.99, 0.95)
    torch.testing.assert_close(adv, ref_adv, rtol=0, atol=1e-6)
    torch.testing.assert_close(ret, ref_ret, rtol=0, atol=1e-6)
