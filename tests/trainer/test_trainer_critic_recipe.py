"""Issue 21 wired: the critic-recipe fields of PPOConfig (value_lam, lam_length_alpha,
cliprange_high, dual_clip) reach compute_targets / ppo_loss through the trainer, the clip
fractions by side are logged, and every field is off by default. The math itself is tested
in tests/math/test_functional_critic_recipe.py."""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
import torch
from transformers import HfArgumentParser

from trl_ppo_ext import PPOConfig, PPOTrainer
from trl_ppo_ext import functional as F
from trl_ppo_ext.advantages import compute_targets, target_settings
from trl_ppo_ext.kl_control import FixedKLController
from trl_ppo_ext.losses import loss_settings, ppo_loss
from trl_ppo_ext.rollout import Rollout

RECIPE = ("value_lam", "lam_length_alpha", "cliprange_high", "dual_clip")


# ---------------------------------------------------------------- config


def test_recipe_fields_are_off_by_default(make_config):
    args = make_config()
    assert {name: getattr(args, name) for name in RECIPE} == dict.fromkeys(RECIPE)


@pytest.mark.parametrize(
    ("field", "value", "message"),
    [
        ("value_lam", 1.5, r"value_lam must be in \[0, 1\] or None \(use lam\), got 1.5"),
        ("value_lam", -0.1, r"value_lam must be in \[0, 1\] or None \(use lam\), got -0.1"),
        ("value_lam", math.nan, r"value_lam must be in \[0, 1\].*got nan"),
        ("lam_length_alpha", 0.0, r"lam_length_alpha must be a finite number > 0 .*got 0.0"),
        ("lam_length_alpha", math.inf, r"lam_length_alpha must be a finite number > 0 .*got inf"),
        ("cliprange_high", -0.01, r"cliprange_high must be a finite number >= 0 .*got -0.01"),
        ("dual_clip", 1.0, r"dual_clip must be a finite number > 1 .*got 1.0"),
        ("dual_clip", 0.5, r"dual_clip must be a finite number > 1 .*got 0.5"),
    ],
)
def test_recipe_fields_are_checked_naming_field_and_value(make_config, field, value, message):
    with pytest.raises(ValueError, match=message):
        make_config(**{field: value})


def test_recipe_edge_values_are_accepted(make_config):
    args = make_config(value_lam=0.0, lam_length_alpha=0.05, cliprange_high=0.0, dual_clip=1.0001)
    assert (args.value_lam, args.lam_length_alpha, args.cliprange_high, args.dual_clip) == (0.0, 0.05, 0.0, 1.0001)
    assert make_config(value_lam=1.0).value_lam == 1.0


def test_recipe_fields_parse_from_the_command_line_numbers_and_none():
    parser = HfArgumentParser(PPOConfig)
    base = ["--output_dir", "unused", "--report_to", "none"]
    (args,) = parser.parse_args_into_dataclasses(
        args=base + ["--value_lam", "1.0", "--lam_length_alpha", "0.05", "--cliprange_high", "0.28",
                     "--dual_clip", "3"])
    assert (args.value_lam, args.lam_length_alpha, args.cliprange_high, args.dual_clip) == (1.0, 0.05, 0.28, 3.0)
    assert all(type(getattr(args, name)) is float for name in RECIPE)
    (args,) = parser.parse_args_into_dataclasses(args=base + [arg for n in RECIPE for arg in (f"--{n}", "None")])
    assert {name: getattr(args, name) for name in RECIPE} == dict.fromkeys(RECIPE)
    with pytest.raises(ValueError, match=r"PPOConfig.dual_clip must be a number or None, got 'three'"):
        parser.parse_args_into_dataclasses(args=base + ["--dual_clip", "three"])
    text = " ".join(parser.format_help().split())
    assert "decoupled GAE" in text and "DAPO clip-higher" in text and "Dual-clip PPO" in text


# ---------------------------------------------------------------- targets through the trainer's settings


def _rollout():
    # two sequences: 3 and 1 valid tokens of T = 3
    mask = torch.tensor([[True, True, True], [True, False, False]])
    return Rollout(
        queries=torch.ones(2, 1, dtype=torch.long), query_mask=torch.ones(2, 1, dtype=torch.bool),
        responses=torch.ones(2, 3, dtype=torch.long), response_mask=mask,
        logprobs=torch.zeros(2, 3), ref_logprobs=torch.zeros(2, 3),
        values=torch.tensor([[0.5, 0.25, 1.0], [2.0, 9.0, 9.0]]), scores=torch.tensor([1.0, -1.0]),
        has_stop=torch.tensor([True, True]),
    )


def _trainer_targets(make_config, **overrides):
    args = make_config(whiten_advantages=False, gamma=1.0, lam=0.5, **overrides)
    shell = SimpleNamespace(args=args, kl_controller=FixedKLController(0.1))
    return PPOTrainer.compute_advantages(shell, _rollout())


def test_value_lam_one_makes_the_trainer_targets_monte_carlo_returns(make_config):
    # zero KL (equal log-probs): rewards are the score at the last token. gamma = 1, lam = 0.5.
    # row 0: V = (0.5, 0.25, 1.0), r = (0, 0, 1): deltas = (0 + 0.25 - 0.5, 0 + 1 - 0.25, 1 - 1) = (-0.25, 0.75, 0)
    #   A (lam 0.5): A_2 = 0, A_1 = 0.75 + 0.5 * 0 = 0.75, A_0 = -0.25 + 0.5 * 0.75 = 0.125
    #   R (value_lam 1) = Monte-Carlo return 1 at every token
    # row 1: V = 2, r = -1: delta = -3, A = -3, R = -1
    default = _trainer_targets(make_config)
    decoupled = _trainer_targets(make_config, value_lam=1.0)
    expected_adv = torch.tensor([[0.125, 0.75, 0.0], [-3.0, 0.0, 0.0]])
    torch.testing.assert_close(decoupled.advantages, expected_adv, rtol=0, atol=1e-7)
    torch.testing.assert_close(default.advantages, expected_adv, rtol=0, atol=1e-7)
    torch.testing.assert_close(decoupled.returns, torch.tensor([[1.0, 1.0, 1.0], [-1.0, 0.0, 0.0]]), rtol=0, atol=1e-7)
    # default: returns = A + V with the same lambda: 0.125 + 0.5, 0.75 + 0.25, 0 + 1
    torch.testing.assert_close(default.returns, torch.tensor([[0.625, 1.0, 1.0], [-1.0, 0.0, 0.0]]), rtol=0, atol=1e-7)


def test_lam_length_alpha_sets_each_sequences_lambda_in_the_trainer_targets(make_config):
    # alpha = 1: lambda = 1 - 1/(1 * L): row 0 (L = 3) 2/3, row 1 (L = 1) clamped to 0.
    # row 0 deltas (-0.25, 0.75, 0): A_1 = 0.75, A_0 = -0.25 + 2/3 * 0.75 = 0.25
    targets = _trainer_targets(make_config, lam_length_alpha=1.0)
    torch.testing.assert_close(targets.advantages, torch.tensor([[0.25, 0.75, 0.0], [-3.0, 0.0, 0.0]]),
                               rtol=0, atol=1e-7)
    # value_lam None follows the per-sequence lambda: R = A + V
    torch.testing.assert_close(targets.returns, torch.tensor([[0.75, 1.0, 1.0], [-1.0, 0.0, 0.0]]), rtol=0, atol=1e-7)
    both = _trainer_targets(make_config, lam_length_alpha=1.0, value_lam=1.0)
    torch.testing.assert_close(both.advantages, targets.advantages, rtol=0, atol=0)
    torch.testing.assert_close(both.returns, torch.tensor([[1.0, 1.0, 1.0], [-1.0, 0.0, 0.0]]), rtol=0, atol=1e-7)


def test_default_targets_equal_single_lambda_gae_bitwise(make_config):
    """The default path (value_lam = lam_length_alpha = None) is masked_gae's result exactly."""
    args = make_config(whiten_advantages=False)
    rollout = _rollout()
    got = compute_targets(rollout, kl_coef=0.1, **target_settings(args))
    rewards = got.rewards
    adv, ret = F.masked_gae(rewards, rollout.values, rollout.response_mask, args.gamma, args.lam)
    assert torch.equal(got.advantages, adv) and torch.equal(got.returns, ret)


# ---------------------------------------------------------------- the loss's settings


def _loss_inputs():
    # ratios exp(log r) = (0.5, 1.5, 3.0) against advantages (-1, 2, -1); one masked token
    log_ratio = torch.log(torch.tensor([[0.5, 1.5, 3.0, 1.0]]))
    mask = torch.tensor([[True, True, True, False]])
    return dict(
        new_logprobs=log_ratio, logits=torch.zeros(1, 4, 3), new_values=torch.zeros(1, 4),
        old_logprobs=torch.zeros(1, 4), old_values=torch.zeros(1, 4),
        advantages=torch.tensor([[-1.0, 2.0, -1.0, 0.0]]), returns=torch.zeros(1, 4), response_mask=mask,
    )


def test_loss_settings_carry_cliprange_high_and_dual_clip(make_config):
    args = make_config(cliprange=0.2, cliprange_high=0.28, dual_clip=2.0, vf_coef=0.0)
    settings = loss_settings(args)
    assert (settings["cliprange_high"], settings["dual_clip"]) == (0.28, 2.0)
    inputs = _loss_inputs()
    _, stats = ppo_loss(inputs.pop("new_logprobs"), inputs.pop("logits"), inputs.pop("new_values"), **inputs,
                        **settings)
    # token 0: r 0.5, A -1: min(-0.5, clip(0.5 -> 0.8) * -1 = -0.8) = -0.8, clipped (lower)
    # token 1: r 1.5, A 2: min(3.0, clip(1.5 -> 1.28) * 2 = 2.56) = 2.56, clipped (upper)
    # token 2: r 3.0, A -1: min(-3.0, -1.28) = -3.0 (unclipped), dual: max(-3.0, 2 * -1) = -2.0
    # pg_loss = -mean(-0.8, 2.56, -2.0) = 0.24 / 3 = 0.08
    torch.testing.assert_close(stats["pg_loss"], torch.tensor(0.08), rtol=1e-6, atol=0)
    assert stats["pg_clipfrac_lower"].item() == pytest.approx(1 / 3, abs=1e-7)
    assert stats["pg_clipfrac_upper"].item() == pytest.approx(1 / 3, abs=1e-7)
    assert stats["pg_clipfrac_dual"].item() == pytest.approx(1 / 3, abs=1e-7)
    assert stats["pg_clipfrac"].item() == pytest.approx(2 / 3, abs=1e-7)


@pytest.mark.parametrize("loss_type", F.LOSS_TYPES)
def test_ppo_loss_micro_batches_add_up_and_log_their_own_figure(loss_type):
    """The micro-batch losses, each with the whole batch's normalisers, add up to the batch's
    loss; the logged pg_loss of each is the loss of that micro-batch taken alone."""
    gen = torch.Generator().manual_seed(0)
    B, T = 4, 5
    mask = torch.arange(T)[None] < torch.tensor([5, 2, 4, 1])[:, None]
    new_lp = torch.randn(B, T, generator=gen) * 0.3
    common = dict(
        old_logprobs=torch.zeros(B, T), old_values=torch.randn(B, T, generator=gen),
        advantages=torch.randn(B, T, generator=gen), returns=torch.randn(B, T, generator=gen),
        cliprange=0.2, cliprange_value=0.2, vf_coef=0.5, entropy_coef=0.0, loss_type=loss_type,
        max_completion_length=T,
    )
    logits, values = torch.randn(B, T, 3, generator=gen), torch.randn(B, T, generator=gen)

    def loss_of(rows, **norm):
        sel = {k: (v[rows] if torch.is_tensor(v) else v) for k, v in common.items()}
        return ppo_loss(new_lp[rows], logits[rows], values[rows], response_mask=mask[rows], **sel, **norm)

    whole, _ = loss_of(slice(None))
    parts = [slice(0, 1), slice(1, 3), slice(3, 4)]
    norm = dict(num_tokens=mask.sum().float().reshape(1), num_sequences=torch.tensor([float(B)]))
    shares = [loss_of(p, **norm) for p in parts]
    torch.testing.assert_close(sum(s[0] for s in shares).reshape(()), whole, rtol=1e-6, atol=1e-7)
    for part, (_, stats) in zip(parts, shares):
        alone = loss_of(part)[1]
        torch.testing.assert_close(stats["pg_loss"].reshape(()), alone["pg_loss"], rtol=1e-6, atol=1e-7)
        torch.testing.assert_close(stats["vf_loss"].reshape(()), alone["vf_loss"], rtol=1e-6, atol=1e-7)
        torch.testing.assert_close(stats["loss"].reshape(()), alone["loss"], rtol=1e-6, atol=1e-7)


# ---------------------------------------------------------------- trainer level


def _final_weights(trainer):
    return {n: p.detach().clone() for n, p in trainer.unwrapped.named_parameters()}


def _policy_value_split(weights):
    policy = {n: w for n, w in weights.items() if n.startswith("policy.")}
    value = {n: w for n, w in weights.items() if not n.startswith("policy.")}
    assert policy and value
    return policy, value


def _equal(a, b):
    return all(torch.equal(a[n], b[n]) for n in a)


def test_value_lam_changes_only_what_the_value_targets_reach(make_trainer):
    """One update, one mini-batch: value_lam only changes the returns, so the policy takes the
    same step (bit for bit: the advantages are unchanged, AdamW is per parameter and no
    gradient clipping couples the two models) and the value model another."""
    runs = []
    for value_lam in (None, 1.0):
        trainer = make_trainer(total_episodes=4, value_lam=value_lam, lam=0.5, max_grad_norm=0)
        trainer.train()
        runs.append(_policy_value_split(_final_weights(trainer)))
    (policy_a, value_a), (policy_b, value_b) = runs
    assert _equal(policy_a, policy_b)
    assert not _equal(value_a, value_b)


def test_lam_length_alpha_changes_the_policy_step(make_trainer):
    runs = []
    for alpha in (None, 0.05):  # responses of <= 6 tokens: alpha * L <= 0.3, lambda 0 (one-step TD)
        trainer = make_trainer(total_episodes=4, lam_length_alpha=alpha)
        trainer.train()
        runs.append(_policy_value_split(_final_weights(trainer)))
    (policy_a, value_a), (policy_b, value_b) = runs
    assert not _equal(policy_a, policy_b) and not _equal(value_a, value_b)


def _clip_logs(trainer):
    return [h for h in trainer.state.log_history if "policy/clipfrac_avg" in h]


def test_clip_fractions_by_side_are_logged_and_follow_the_clip_settings(make_trainer):
    """cliprange = 0 clips every token whose ratio moved (second epoch on): each clipped token
    is on one side, so lower + upper = clipfrac_avg; cliprange_high = 10 frees the upper side."""
    symmetric = make_trainer(total_episodes=4, num_ppo_epochs=3, cliprange=0.0, learning_rate=1e-2)
    symmetric.train()
    (log,) = _clip_logs(symmetric)
    assert log["policy/clipfrac_avg"] > 0
    assert log["policy/clipfrac_lower_avg"] > 0 and log["policy/clipfrac_upper_avg"] > 0
    assert log["policy/clipfrac_lower_avg"] + log["policy/clipfrac_upper_avg"] == pytest.approx(
        log["policy/clipfrac_avg"], rel=1e-6)
    assert log["policy/clipfrac_dual_avg"] == 0.0

    high = make_trainer(total_episodes=4, num_ppo_epochs=3, cliprange=0.0, cliprange_high=10.0, learning_rate=1e-2)
    high.train()
    (log,) = _clip_logs(high)
    assert log["policy/clipfrac_upper_avg"] == 0.0 and log["policy/clipfrac_lower_avg"] > 0
    assert log["policy/clipfrac_lower_avg"] == pytest.approx(log["policy/clipfrac_avg"], rel=1e-6)


def test_dual_clip_is_logged_and_changes_the_step(make_trainer):
    """Four epochs of two mini-batches at a large learning rate push some ratios of
    negative-advantage tokens above 1.01 (the ratio reaches ~3 here); dual_clip = 1.01 then
    takes c * A for them."""
    runs = []
    for dual_clip in (None, 1.01):
        trainer = make_trainer(total_episodes=4, num_ppo_epochs=4, num_mini_batches=2, learning_rate=1e-2,
                               dual_clip=dual_clip)
        trainer.train()
        (log,) = _clip_logs(trainer)
        runs.append((log["policy/clipfrac_dual_avg"], _policy_value_split(_final_weights(trainer))[0]))
    (dual_off, policy_off), (dual_on, policy_on) = runs
    assert dual_off == 0.0 and 0 < dual_on <= 1
    assert not _equal(policy_off, policy_on)
