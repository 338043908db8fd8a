"""The estimators PPO is compared with (GRPO, RLOO, REINFORCE++): hand-computed tiny cases with
the arithmetic in comments, naive loops against the vectorised code on random inputs, and
``estimator_targets`` against the same pieces assembled by hand."""

import math
import statistics
from dataclasses import replace

import pytest
import torch

from trl_ppo_ext import estimators as E
from trl_ppo_ext.advantages import compute_targets
from trl_ppo_ext.rollout import Rollout

EPS = E.GROUP_STD_EPS


# ------------------------------------------------------------------ grouping


def test_grouped_keeps_adjacent_copies_together():
    assert E.grouped(torch.arange(6.0), 2).tolist() == [[0, 1], [2, 3], [4, 5]]


@pytest.mark.parametrize("fn", [
    lambda s: E.grpo_advantages(s, 2), lambda s: E.rloo_advantages(s, 2), lambda s: E.group_reward_metrics(s, 2),
])
def test_a_batch_that_is_not_a_multiple_of_the_group_is_refused(fn):
    with pytest.raises(ValueError, match="batch of 5 sequences is not a multiple of num_generations=2"):
        fn(torch.zeros(5))


@pytest.mark.parametrize("fn, name", [
    (lambda s: E.grpo_advantages(s, 1), "grpo"), (lambda s: E.rloo_advantages(s, 1), "rloo"),
    (lambda s: E.reinforce_pp_baseline_advantages(s, torch.zeros(4, 2), torch.ones(4, 2, dtype=torch.bool), 1),
     "reinforce_pp_baseline"),
])
def test_group_estimators_refuse_one_sample_per_prompt(fn, name):
    with pytest.raises(ValueError, match=f"advantage_estimator='{name}' needs num_generations >= 2"):
        fn(torch.zeros(4))


def test_needs_critic_and_scale_rewards_values():
    assert [E.needs_critic(e) for e in E.ESTIMATORS] == [True, False, False, False, False, True]
    with pytest.raises(ValueError, match="advantage_estimator must be one of"):
        E.needs_critic("ppo")
    assert [E.resolve_scale_rewards(v) for v in (True, False, "group", "batch", "none")] == [
        "group", "none", "group", "batch", "none"]
    with pytest.raises(ValueError, match="scale_rewards must be one of"):
        E.resolve_scale_rewards("std")


# ------------------------------------------------------------------ GRPO


def test_grpo_by_hand_each_scale():
    scores = torch.tensor([1.0, 3.0, 2.0, 2.0])  # groups (1, 3) and (2, 2)
    # group means 2 and 2 -> centred (-1, 1, 0, 0)
    assert E.grpo_advantages(scores, 2, "none").tolist() == [-1.0, 1.0, 0.0, 0.0]
    # "group": unbiased std of (1, 3) = sqrt(((1-2)^2 + (3-2)^2) / 1) = sqrt(2); of (2, 2) = 0
    expected = [-1 / (math.sqrt(2) + EPS), 1 / (math.sqrt(2) + EPS), 0.0, 0.0]
    torch.testing.assert_close(E.grpo_advantages(scores, 2, "group"), torch.tensor(expected), rtol=0, atol=1e-7)
    # "batch": unbiased std of all four = sqrt((1 + 1 + 0 + 0) / 3) = sqrt(2/3); the mean is still the group's
    b = math.sqrt(2 / 3) + EPS
    torch.testing.assert_close(E.grpo_advantages(scores, 2, "batch"), torch.tensor([-1 / b, 1 / b, 0.0, 0.0]),
                               rtol=0, atol=1e-7)
    # TRL's legacy booleans
    assert torch.equal(E.grpo_advantages(scores, 2, True), E.grpo_advantages(scores, 2, "group"))
    assert torch.equal(E.grpo_advantages(scores, 2, False), E.grpo_advantages(scores, 2, "none"))


def _grpo_loop(scores, G, scale):
    s = scores.tolist()
    batch_std = statistics.stdev(s)
    out = []
    for p in range(len(s) // G):
        group = s[p * G:(p + 1) * G]
        for x in group:
            a = x - statistics.mean(group)
            if scale == "group":
                a /= statistics.stdev(group) + EPS
            elif scale == "batch":
                a /= batch_std + EPS
            out.append(a)
    return torch.tensor(out, dtype=torch.float64)


@pytest.mark.parametrize("scale", E.SCALE_REWARDS)
@pytest.mark.parametrize("G", [2, 3, 4])
def test_grpo_matches_the_loop(scale, G):
    scores = torch.randn(5 * G, generator=torch.Generator().manual_seed(G), dtype=torch.float64)
    torch.testing.assert_close(E.grpo_advantages(scores, G, scale), _grpo_loop(scores, G, scale),
                               rtol=1e-12, atol=1e-12)


def test_grpo_matches_trl_grpo_trainer_formula():
    """TRL 1.16 GRPOTrainer, sum_then_normalize: nanmean/nanstd per view(-1, G), then / (std + 1e-4)."""
    from trl.trainer.utils import nanstd

    rewards = torch.tensor([0.0, 1.0, 1.0, 0.5, 0.5, 0.5, 2.0, -1.0, 0.0])
    mean = torch.nanmean(rewards.view(-1, 3), dim=1).repeat_interleave(3)
    std = nanstd(rewards.view(-1, 3), dim=1).repeat_interleave(3)
    torch.testing.assert_close(E.grpo_advantages(rewards, 3), (rewards - mean) / (std + 1e-4), rtol=0, atol=1e-6)


def test_grpo_does_not_modify_its_input():
    scores = torch.tensor([1.0, 2.0])
    E.grpo_advantages(scores, 2)
    assert scores.tolist() == [1.0, 2.0]


# ------------------------------------------------------------------ RLOO


def test_rloo_by_hand():
    # group (1, 2, 6): baselines (2+6)/2 = 4, (1+6)/2 = 3.5, (1+2)/2 = 1.5 -> -3, -1.5, 4.5
    # group (0, 0, 3): baselines 1.5, 1.5, 0 -> -1.5, -1.5, 3
    scores = torch.tensor([1.0, 2.0, 6.0, 0.0, 0.0, 3.0])
    assert E.rloo_advantages(scores, 3).tolist() == [-3.0, -1.5, 4.5, -1.5, -1.5, 3.0]


@pytest.mark.parametrize("G", [2, 3, 5])
def test_rloo_matches_the_loop_and_the_scaled_mean_form(G):
    scores = torch.randn(4 * G, generator=torch.Generator().manual_seed(10 + G), dtype=torch.float64)
    s = scores.tolist()
    loop = []
    for p in range(len(s) // G):
        for i in range(G):
            others = [s[p * G + j] for j in range(G) if j != i]
            loop.append(s[p * G + i] - sum(others) / (G - 1))
    got = E.rloo_advantages(scores, G)
    torch.testing.assert_close(got, torch.tensor(loop, dtype=torch.float64), rtol=1e-12, atol=1e-12)
    # an independent identity: A_i = G / (G - 1) * (s_i - mean_g)
    centred = E.grpo_advantages(scores, G, "none")
    torch.testing.assert_close(got, centred * G / (G - 1), rtol=1e-12, atol=1e-12)


# ------------------------------------------------------------------ REINFORCE++


def _whiten_loop(values, mask):
    picked = [v for v, m in zip(values.flatten().tolist(), mask.flatten().tolist()) if m]
    mean, var = statistics.mean(picked), statistics.variance(picked)
    return torch.where(mask, (values - mean) / math.sqrt(var + 1e-8), 0.0)


def test_reinforce_pp_by_hand_skips_environment_tokens():
    # row 0: a1 a2 | o1 | b1, rewards .1 .2 (9 on o1, never read) 1.0, gamma .5
    #   R(b1) = 1.0; R(a2) = .2 + .5 * 1.0 = .7; R(a1) = .1 + .5 * .7 = .45 (o1 is no step)
    # row 1: two action tokens then padding: R = 2 + .5 * 3 = 3.5, 3
    mask = torch.tensor([[True, True, False, True], [True, True, False, False]])
    rewards = torch.tensor([[0.1, 0.2, 9.0, 1.0], [2.0, 3.0, 0.0, 0.0]], dtype=torch.float64)
    advantages, returns = E.reinforce_pp_advantages(rewards, mask, gamma=0.5)
    torch.testing.assert_close(returns, torch.tensor([[0.45, 0.7, 0, 1.0], [3.5, 3.0, 0, 0]], dtype=torch.float64),
                               rtol=0, atol=1e-12)
    # whitened over the five action tokens: mean (.45 + .7 + 1 + 3.5 + 3) / 5 = 1.73
    torch.testing.assert_close(advantages, _whiten_loop(returns, mask), rtol=1e-9, atol=1e-9)
    assert advantages[mask].mean().abs() < 1e-12 and advantages[~mask].eq(0).all()


def _returns_loop(rewards, mask, gamma):
    out = torch.zeros_like(rewards)
    for b in range(rewards.shape[0]):
        idx = mask[b].nonzero()[:, 0].tolist()
        running = 0.0
        for k in reversed(idx):
            running = rewards[b, k].item() + gamma * running
            out[b, k] = running
    return out


@pytest.mark.parametrize("gamma", [1.0, 0.9, 0.0])
def test_reinforce_pp_matches_the_loop_on_random_holes(gamma):
    g = torch.Generator().manual_seed(3)
    rewards = torch.randn(6, 9, generator=g, dtype=torch.float64)
    response = torch.arange(9) < torch.randint(1, 10, (6, 1), generator=g)
    mask = response & (torch.rand(6, 9, generator=g) < 0.7)
    mask[:, 0] = True  # every row has an action
    advantages, returns = E.reinforce_pp_advantages(rewards, mask, gamma)
    expected = _returns_loop(rewards, mask, gamma)
    torch.testing.assert_close(returns, expected, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(advantages, _whiten_loop(expected, mask), rtol=1e-9, atol=1e-9)


def test_reinforce_pp_baseline_centres_the_scores_first():
    # two prompts x two samples, one action token each then padding; no KL
    # scores (1, 3) -> (-1, 1); (5, 5) -> (0, 0). Returns = centred score on the only token.
    mask = torch.tensor([[True, False]] * 4)
    advantages, returns = E.reinforce_pp_baseline_advantages(
        torch.tensor([1.0, 3.0, 5.0, 5.0]), torch.zeros(4, 2), mask, num_generations=2)
    assert returns[:, 0].tolist() == [-1.0, 1.0, 0.0, 0.0] and returns[:, 1].eq(0).all()
    # whitened: mean 0, unbiased var 2/3 -> -1/sqrt(2/3 + 1e-8) ...
    torch.testing.assert_close(advantages, _whiten_loop(returns, mask), rtol=1e-6, atol=1e-6)


def test_reinforce_pp_baseline_keeps_token_rewards_per_token():
    # row 0: tokens t0 t1, KL part (-.1, -.2), score 2; row 1: score 0, KL 0. Group mean of scores 1.
    # centred scores 1, -1 -> rewards row 0: (-.1, -.2 + 1), row 1: (0, -1); gamma 1
    mask = torch.ones(2, 2, dtype=torch.bool)
    _, returns = E.reinforce_pp_baseline_advantages(
        torch.tensor([2.0, 0.0]), torch.tensor([[-0.1, -0.2], [0.0, 0.0]]), mask, num_generations=2)
    torch.testing.assert_close(returns, torch.tensor([[0.7, 0.8], [-1.0, -1.0]]), rtol=0, atol=1e-6)


# ------------------------------------------------------------------ broadcast, sequence sums, metrics


def test_broadcast_is_zero_off_the_action_tokens():
    mask = torch.tensor([[True, False, True, False], [False, True, True, True]])
    out = E.broadcast_sequence_advantages(torch.tensor([0.5, -2.0]), mask)
    assert out.tolist() == [[0.5, 0.0, 0.5, 0.0], [0.0, -2.0, -2.0, -2.0]]
    with pytest.raises(ValueError, match="advantages must have shape"):
        E.broadcast_sequence_advantages(torch.zeros(3), mask)


def test_sequence_returns_sum_the_action_tokens_only():
    rewards = torch.tensor([[0.5, 7.0, 1.0], [-0.25, 0.0, 0.0]])
    mask = torch.tensor([[True, False, True], [True, True, False]])
    assert E.sequence_returns(rewards, mask).tolist() == [1.5, -0.25]  # .5 + 1; -.25 + 0


def test_group_reward_metrics_by_hand():
    # groups (1, 1), (0, 2): stds 0 and sqrt(2); one of two groups has zero std
    m = E.group_reward_metrics(torch.tensor([1.0, 1.0, 0.0, 2.0]), 2)
    assert m["frac_reward_zero_std"].item() == 0.5
    torch.testing.assert_close(m["group_reward_std"], torch.tensor(math.sqrt(2) / 2))
    # batch: mean 1, squared deviations 0 0 1 1 -> unbiased var 2/3
    torch.testing.assert_close(m["reward_std"], torch.tensor(math.sqrt(2 / 3)))
    one = E.group_reward_metrics(torch.tensor([1.0, 2.0]), 1)  # one sample: std 0, as TRL
    assert one["frac_reward_zero_std"].item() == 1.0 and one["group_reward_std"].item() == 0.0


# ------------------------------------------------------------------ estimator_targets


def _rollout(scores, mask, logprobs, ref_logprobs, token_rewards=None, has_stop=None):
    B, T = mask.shape
    return Rollout(
        queries=torch.ones(B, 1, dtype=torch.long), query_mask=torch.ones(B, 1, dtype=torch.bool),
        responses=torch.ones(B, T, dtype=torch.long), response_mask=mask,
        logprobs=logprobs, ref_logprobs=ref_logprobs, values=torch.full((B, T), 5.0),
        scores=scores, has_stop=torch.ones(B, dtype=torch.bool) if has_stop is None else has_stop,
        token_rewards=token_rewards,
    )


SETTINGS = dict(kl_coef=0.5, kl_estimator="k1", missing_eos_penalty=1.0, whiten_rewards=False,
                whiten_advantages=True, gamma=1.0, lam=0.95)


def _small_rollout(token_rewards=None):
    # 4 rows = 2 prompts x 2 samples; T = 3; row 1 stops after two tokens
    mask = torch.tensor([[True, True, True], [True, True, False], [True, True, True], [True, True, True]])
    logprobs = torch.tensor([[-1.0, -1.0, -1.0], [-1.0, -2.0, 0.0], [-1.0, -1.0, -1.0], [-1.0, -1.0, -1.0]])
    ref = torch.tensor([[-1.0, -1.2, -1.0], [-1.0, -2.0, 0.0], [-1.0, -1.0, -1.0], [-1.0, -1.0, -1.4]])
    # k1 = logprobs - ref: row 0 (0, .2, 0); row 3 (0, 0, .4); others 0
    return _rollout(torch.tensor([1.0, 0.0, 2.0, 2.0]), mask, logprobs, ref, token_rewards,
                    has_stop=torch.tensor([True, True, True, False]))


def test_grpo_targets_by_hand():
    t = E.estimator_targets(_small_rollout(), advantage_estimator="grpo", num_generations=2, scale_rewards="none",
                            **SETTINGS)
    # scores after the missing-stop penalty: 1, 0, 2, 2 - 1 = 1
    assert t.scores.tolist() == [1.0, 0.0, 2.0, 1.0]
    # the groups compare the scores alone: (1, 0) -> .5, -.5; (2, 1) -> .5, -.5 on every action token.
    # The KL penalty comes per token as its return-to-go: row 0 -.5 * .2 = -.1 on t1 -> (-.1, -.1, 0);
    # row 3 -.5 * .4 = -.2 on t2 -> (-.2, -.2, -.2)
    expected = torch.tensor([[0.4, 0.4, 0.5], [-0.5, -0.5, 0.0], [0.5] * 3, [-0.7] * 3])
    torch.testing.assert_close(t.advantages, expected, rtol=0, atol=1e-6)
    assert t.returns.eq(0).all()
    # the shaped rewards are compute_targets' (the values are never read: 5.0 everywhere)
    gae = compute_targets(_small_rollout(), **SETTINGS)
    assert torch.equal(t.rewards, gae.rewards) and torch.equal(t.kl, gae.kl)


def test_rloo_targets_by_hand_with_token_rewards_summed_in():
    # a process reward of .3 on row 0's first token: row 0 sums to .9 + .3 = 1.2
    token_rewards = torch.zeros(4, 3)
    token_rewards[0, 0] = 0.3
    t = E.estimator_targets(_small_rollout(token_rewards), advantage_estimator="rloo", num_generations=2,
                            **SETTINGS)
    # G = 2: A = s_i - s_other: 1.2 - 0 = 1.2, -1.2; 2 - .8 = 1.2, -1.2
    expected = torch.tensor([[1.2] * 3, [-1.2, -1.2, 0.0], [1.2] * 3, [-1.2] * 3])
    torch.testing.assert_close(t.advantages, expected, rtol=0, atol=1e-6)


def test_reinforce_pp_targets_are_the_whitened_returns_of_the_shaped_rewards():
    rollout = _small_rollout()
    t = E.estimator_targets(rollout, advantage_estimator="reinforce_pp", num_generations=2, **{**SETTINGS,
                            "gamma": 0.5})
    expected_returns = _returns_loop(t.rewards.double(), rollout.response_mask, 0.5).float()
    torch.testing.assert_close(t.returns, expected_returns, rtol=0, atol=1e-6)
    torch.testing.assert_close(t.advantages, _whiten_loop(expected_returns, rollout.response_mask).float(),
                               rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(t.raw_advantage_mean, expected_returns[rollout.response_mask].mean())


def test_reinforce_pp_baseline_targets_centre_the_penalised_scores():
    rollout = _small_rollout()
    t = E.estimator_targets(rollout, advantage_estimator="reinforce_pp_baseline", num_generations=2, **SETTINGS)
    # scores 1, 0 -> .5, -.5; 2, 1 -> .5, -.5 on the last token; KL parts stay: row 0 -.1 on t1, row 3 -.2 on t2
    # gamma 1: row 0 returns (.4, .4, .5); row 1 (-.5, -.5); row 2 (.5, .5, .5); row 3 (-.7, -.7, -.7)
    expected = torch.tensor([[0.4, 0.4, 0.5], [-0.5, -0.5, 0.0], [0.5] * 3, [-0.7] * 3])
    torch.testing.assert_close(t.returns, expected, rtol=0, atol=1e-6)


def test_gae_goes_to_compute_targets():
    rollout = _small_rollout()
    t = E.estimator_targets(rollout, advantage_estimator="gae", num_generations=1, **SETTINGS)
    gae = compute_targets(rollout, **SETTINGS)
    assert torch.equal(t.advantages, gae.advantages) and torch.equal(t.returns, gae.returns)


def test_an_action_mask_moves_the_score_and_zeroes_environment_tokens():
    rollout = _small_rollout()
    actions = rollout.response_mask.clone()
    actions[:, 1] = False  # the middle token is an environment token in every row
    t = E.estimator_targets(rollout, advantage_estimator="grpo", num_generations=2, scale_rewards="none",
                            action_mask=actions, **SETTINGS)
    assert t.advantages[:, 1].eq(0).all() and t.kl[:, 1].eq(0).all()
    # row 1's last action token is now t0, where its score sits; row 0's KL on t1 is no longer counted:
    # scores 1, 0, 2, 1 -> .5, -.5, .5, -.5; row 3's KL penalty -.2 on t2 reaches t0 across the environment token
    assert t.rewards[1, 0].item() == 0.0 and t.advantages[:, 0].tolist() == pytest.approx([0.5, -0.5, 0.5, -0.7])


def test_estimator_settings_read_a_config(make_config):
    config = make_config()
    settings = E.estimator_settings(config)
    assert settings["advantage_estimator"] == "gae" and settings["num_generations"] == 1
    assert settings["scale_rewards"] == "group" and settings["lam"] == config.lam


def _returns_to_go_loop(p, mask, gamma):
    out = torch.zeros_like(p, dtype=torch.float64)
    for b in range(p.shape[0]):
        running = 0.0
        for t in reversed(range(p.shape[1])):
            if mask[b, t]:
                running = float(p[b, t]) + gamma * running
                out[b, t] = running
    return out


@pytest.mark.parametrize("gamma", [1.0, 0.9, 0.0])
def test_returns_to_go_matches_the_loop(gamma):
    g = torch.Generator().manual_seed(3)
    p = -torch.rand(5, 7, generator=g)
    mask = torch.rand(5, 7, generator=g) > 0.3
    mask[4] = False  # a row with no action token
    got = E.returns_to_go(p.masked_fill(~mask, 0.0), mask, gamma)
    torch.testing.assert_close(got.double(), _returns_to_go_loop(p, mask, gamma), rtol=0, atol=1e-6)
    assert got[~mask].eq(0).all()


def test_grpo_a_tied_group_gets_only_the_kl_penalty_not_an_amplified_one():
    # four equal scores whose KL differs a little: TRL GRPO gives the group advantage 0; the KL must not be
    # divided by the group's (tiny) std and become a full-size advantage
    mask = torch.ones(4, 2, dtype=torch.bool)
    logprobs = torch.full((4, 2), -1.0)
    ref = logprobs - torch.tensor([[3.0, 0.0], [3.1, 0.0], [2.9, 0.0], [3.0, 0.0]])  # k1 = 3, 3.1, 2.9, 3
    rollout = _rollout(torch.full((4,), 1.2), mask, logprobs, ref)
    t = E.estimator_targets(rollout, advantage_estimator="grpo", num_generations=4, scale_rewards="group",
                            **{**SETTINGS, "kl_coef": 0.01, "missing_eos_penalty": None})
    # only the penalty's return-to-go: -0.01 * k1 on the first token, 0 after it
    expected = torch.tensor([[-0.03, 0.0], [-0.031, 0.0], [-0.029, 0.0], [-0.03, 0.0]])
    torch.testing.assert_close(t.advantages, expected, rtol=0, atol=1e-6)


# ------------------------------------------------------------------ unscorable rows (issue 40, case 2)
# A row every reward function returned None for (TRL GRPO's "unscorable" row): out of its group's
# statistics, advantage 0. Before the fix it scored 0 and joined the baseline: scores [1, -, 0, 0]
# gave grpo [1.5, -0.5, -0.5, -0.5] where TRL 1.16 gives [1.155, 0, -0.577, -0.577].

SCORED = torch.tensor([True, False, True, True, True, True, False, False])


def _scored_rollout(scores, applies, mask=None, values=None):
    B = scores.shape[0]
    mask = torch.ones(B, 2, dtype=torch.bool) if mask is None else mask
    return Rollout(queries=torch.ones(B, 1, dtype=torch.long), query_mask=torch.ones(B, 1, dtype=torch.bool),
                   responses=torch.ones(B, 2, dtype=torch.long), response_mask=mask, logprobs=torch.zeros(B, 2),
                   ref_logprobs=torch.zeros(B, 2), values=torch.zeros(B, 2) if values is None else values,
                   scores=scores, has_stop=torch.ones(B, dtype=torch.bool), reward_applies=applies[:, None],
                   reward_values=torch.where(applies, scores, math.nan)[:, None])


def test_grpo_leaves_an_unscored_row_out_of_its_group_by_hand():
    # group 1 (1, -, 0, 0): scored mean 1/3; deviations 2/3, -1/3, -1/3; unbiased var (4/9 + 1/9 + 1/9) / 2 = 1/3
    #   -> (2/3) / (sqrt(1/3) + 1e-4), (-1/3) / (sqrt(1/3) + 1e-4); the unscored row 0
    # group 2 (2, 4, -, -): mean 3, var (1 + 1) / 1 = 2 -> -1 / (sqrt 2 + 1e-4), +1 / (sqrt 2 + 1e-4)
    scores = torch.tensor([1.0, 0.0, 0.0, 0.0, 2.0, 4.0, 0.0, 0.0], dtype=torch.float64)
    s3, s2 = math.sqrt(1 / 3) + EPS, math.sqrt(2) + EPS
    expected = [2 / 3 / s3, 0.0, -1 / 3 / s3, -1 / 3 / s3, -1 / s2, 1 / s2, 0.0, 0.0]
    torch.testing.assert_close(E.grpo_advantages(scores, 4, "group", SCORED),
                               torch.tensor(expected, dtype=torch.float64), rtol=0, atol=1e-12)
    # "none": centred on the scored mean only; "batch": over the std of the 5 scored values (1, 0, 0, 2, 4)
    none = E.grpo_advantages(scores, 4, "none", SCORED)
    torch.testing.assert_close(none, torch.tensor([2 / 3, 0, -1 / 3, -1 / 3, -1, 1, 0, 0], dtype=torch.float64))
    batch = E.grpo_advantages(scores, 4, "batch", SCORED)
    torch.testing.assert_close(batch, none / (statistics.stdev([1, 0, 0, 2, 4]) + EPS), rtol=0, atol=1e-12)


def test_grpo_over_scored_rows_matches_trl_nan_statistics():
    """TRL 1.16 GRPOTrainer: an unscorable row is NaN, nanmean / nanstd per group, then nan_to_num(0)."""
    from trl.trainer.utils import nanstd

    g = torch.Generator().manual_seed(3)
    scores = torch.randn(12, generator=g)
    scored = torch.tensor([1, 0, 1, 1, 1, 1, 1, 1, 0, 0, 0, 1], dtype=torch.bool)
    rewards = torch.where(scored, scores, math.nan)
    mean = torch.nanmean(rewards.view(-1, 4), dim=1).repeat_interleave(4)
    std = nanstd(rewards.view(-1, 4), dim=1).repeat_interleave(4)
    trl = torch.nan_to_num((rewards - mean) / (std + 1e-4), nan=0.0)
    torch.testing.assert_close(E.grpo_advantages(scores, 4, "group", scored), trl, rtol=0, atol=1e-6)


def test_rloo_baseline_is_the_other_scored_rows_by_hand():
    # group 1 (1, -, 0, 0): baselines (0+0)/2 = 0, -, (1+0)/2, (1+0)/2 -> 1, 0, -0.5, -0.5
    # group 2 (2, 4, -, -): 2 - 4 = -2, 4 - 2 = 2
    scores = torch.tensor([1.0, 7.0, 0.0, 0.0, 2.0, 4.0, 9.0, 9.0])
    assert E.rloo_advantages(scores, 4, SCORED).tolist() == [1.0, 0.0, -0.5, -0.5, -2.0, 2.0, 0.0, 0.0]
    # a group with one scored row has no baseline to compare with: 0
    assert E.rloo_advantages(torch.tensor([3.0, 5.0]), 2, torch.tensor([True, False])).tolist() == [0.0, 0.0]


def test_reinforce_pp_baseline_centres_on_the_scored_rows_and_trains_none_of_the_others():
    # one token per row; group (1, -, 0, 0): centred 2/3, -, -1/3, -1/3 -> whitened over the three scored tokens:
    # mean 0, unbiased var (4/9 + 1/9 + 1/9) / 2 = 1/3 -> 2/3 / sqrt(1/3 + 1e-8), ...
    scores = torch.tensor([1.0, 5.0, 0.0, 0.0])
    mask = torch.ones(4, 1, dtype=torch.bool)
    adv, ret = E.reinforce_pp_baseline_advantages(scores, torch.zeros(4, 1), mask, 4, scored=SCORED[:4])
    s = math.sqrt(1 / 3 + 1e-8)
    torch.testing.assert_close(adv[:, 0], torch.tensor([2 / 3 / s, 0.0, -1 / 3 / s, -1 / 3 / s]))
    torch.testing.assert_close(ret[:, 0], torch.tensor([2 / 3, 0.0, -1 / 3, -1 / 3]))


@pytest.mark.parametrize("estimator", ["grpo", "rloo", "reinforce_pp", "reinforce_pp_baseline", "gae"])
def test_no_estimator_trains_on_an_unscored_row(estimator):
    scores = torch.tensor([1.0, 0.0, 0.0, 0.0, 2.0, 4.0, 0.0, 0.0])
    values = torch.full((8, 2), 0.25)
    rollout = _scored_rollout(scores, SCORED, values=values)
    targets = E.estimator_targets(rollout, advantage_estimator=estimator, num_generations=4, kl_coef=0.0,
                                  kl_estimator="k1", missing_eos_penalty=None, whiten_rewards=False,
                                  whiten_advantages=estimator == "gae", gamma=1.0, lam=1.0)
    unscored = ~SCORED
    assert (targets.advantages[unscored] == 0).all()
    assert (targets.advantages[SCORED] != 0).any()
    if estimator == "gae":  # no value target made up: the row's own old values
        assert torch.equal(targets.returns[unscored], values[unscored])
    # the scored rows' advantages are those of the batch without the unscored rows (their statistics, alone)
    kept = SCORED.nonzero()[:, 0]
    alone = _scored_rollout(scores[kept], torch.ones(len(kept), dtype=torch.bool), values=values[kept])
    if estimator in E.GROUP_ESTIMATORS:
        return  # groups of unequal size: compared by hand above
    expected = E.estimator_targets(alone, advantage_estimator=estimator, num_generations=1, kl_coef=0.0,
                                   kl_estimator="k1", missing_eos_penalty=None, whiten_rewards=False,
                                   whiten_advantages=estimator == "gae", gamma=1.0, lam=1.0)
    torch.testing.assert_close(targets.advantages[kept], expected.advantages, rtol=0, atol=1e-6)


def test_a_fully_scored_batch_is_bit_identical_to_one_without_reward_applies():
    scores = torch.tensor([1.0, 0.3, 0.0, 0.7])
    for estimator in ("grpo", "rloo", "reinforce_pp_baseline"):
        kwargs = dict(advantage_estimator=estimator, num_generations=2, kl_coef=0.1, kl_estimator="k1",
                      missing_eos_penalty=None, whiten_rewards=False, whiten_advantages=False, gamma=1.0, lam=1.0)
        with_applies = E.estimator_targets(_scored_rollout(scores, torch.ones(4, dtype=torch.bool)), **kwargs)
        without = E.estimator_targets(replace(_scored_rollout(scores, torch.ones(4, dtype=torch.bool)),
                                              reward_applies=None), **kwargs)
        assert torch.equal(with_applies.advantages, without.advantages)
