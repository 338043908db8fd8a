"""PPOConfig's num_generations, advantage_estimator and scale_rewards: defaults, the checks in
__post_init__ (each error names the fields), TRL GRPO's legacy booleans, and the command line."""

import warnings

import pytest
from transformers import HfArgumentParser

from trl_ppo_ext import PPOConfig


def test_defaults_are_todays_run(make_config):
    config = make_config()
    assert (config.num_generations, config.advantage_estimator, config.scale_rewards) == (1, "gae", "group")
    assert config.trains_critic


@pytest.mark.parametrize("estimator, critic", [
    ("gae", True), ("grpo", False), ("rloo", False), ("reinforce_pp", False), ("reinforce_pp_baseline", False),
    ("gae_rloo", True),
])
def test_each_estimator_is_accepted_and_says_whether_it_trains_a_critic(make_config, estimator, critic):
    config = make_config(advantage_estimator=estimator, num_generations=2)
    assert config.advantage_estimator == estimator and config.trains_critic is critic


@pytest.mark.parametrize("given, stored", [(True, "group"), (False, "none"), ("batch", "batch"), ("none", "none")])
def test_scale_rewards_takes_trl_grpos_values(make_config, given, stored):
    assert make_config(scale_rewards=given).scale_rewards == stored


def test_unknown_values_are_refused(make_config):
    with pytest.raises(ValueError, match="advantage_estimator must be one of .*'reinforce_pp_baseline'.*got 'ppo'"):
        make_config(advantage_estimator="ppo")
    with pytest.raises(ValueError, match="scale_rewards must be one of"):
        make_config(scale_rewards="std")
    with pytest.raises(ValueError, match="num_generations must be an int >= 1.*got 0"):
        make_config(num_generations=0)


def test_the_rollout_batch_must_hold_whole_groups(make_config):
    # per-process rollout batch 4 * 1 = 4; 3 does not divide it
    with pytest.raises(ValueError, match=r"num_generations=3 does not divide the per-process rollout batch "
                                         r"per_device_train_batch_size \* gradient_accumulation_steps = 4 \* 1 = 4"):
        make_config(num_generations=3)
    assert make_config(num_generations=3, per_device_train_batch_size=3, gradient_accumulation_steps=2,
                       local_rollout_forward_batch_size=6).num_generations == 3  # 3 * 2 = 6
    assert make_config(num_generations=4).num_generations == 4  # gae with several samples per prompt


@pytest.mark.parametrize("estimator", ["grpo", "rloo", "reinforce_pp_baseline"])
def test_group_estimators_need_two_samples_per_prompt(make_config, estimator):
    with pytest.raises(ValueError, match=f"advantage_estimator='{estimator}' compares the samples.*"
                                         "num_generations >= 2, got num_generations=1"):
        make_config(advantage_estimator=estimator)


def test_reinforce_pp_runs_with_one_sample(make_config):
    assert make_config(advantage_estimator="reinforce_pp").num_generations == 1


def test_a_critic_warmup_without_a_critic_is_refused(make_config):
    with pytest.raises(ValueError, match="critic_warmup_steps=2 with advantage_estimator='grpo'"):
        make_config(advantage_estimator="grpo", num_generations=2, critic_warmup_steps=2)


def test_the_fields_parse_on_the_command_line(tmp_path):
    (config,) = HfArgumentParser(PPOConfig).parse_args_into_dataclasses(
        ["--output_dir", str(tmp_path), "--report_to", "none", "--bf16", "False", "--per_device_train_batch_size", "4",
         "--num_generations", "4", "--advantage_estimator", "grpo", "--scale_rewards", "batch"])
    assert (config.num_generations, config.advantage_estimator, config.scale_rewards) == (4, "grpo", "batch")
    (legacy,) = HfArgumentParser(PPOConfig).parse_args_into_dataclasses(
        ["--output_dir", str(tmp_path), "--report_to", "none", "--bf16", "False", "--scale_rewards", "False"])
    assert legacy.scale_rewards == "none"  # TRL's False, as text from the command line
    with pytest.raises(SystemExit):  # argparse's choices
        HfArgumentParser(PPOConfig).parse_args_into_dataclasses(
            ["--output_dir", str(tmp_path), "--advantage_estimator", "ppo"])


@pytest.mark.parametrize("estimator", ["grpo", "rloo", "reinforce_pp", "reinforce_pp_baseline"])
def test_a_critic_free_estimator_names_the_critic_settings_it_ignores(make_config, estimator):
    # issue 40: lam, value_lam, lam_length_alpha, whiten_*, vf_coef and cliprange_value were silently unread
    with pytest.warns(UserWarning, match=rf"advantage_estimator='{estimator}' trains no critic and does not read "
                                         r"lam=0\.9, value_lam=1\.0, lam_length_alpha=0\.05, whiten_rewards=True, "
                                         r"whiten_advantages=False, vf_coef=0\.5, cliprange_value=None: "):
        make_config(advantage_estimator=estimator, num_generations=2, lam=0.9, value_lam=1.0, lam_length_alpha=0.05,
                    whiten_rewards=True, whiten_advantages=False, vf_coef=0.5, cliprange_value=None)


def test_critic_settings_at_their_defaults_or_with_gae_say_nothing(make_config):
    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)
        make_config(advantage_estimator="grpo", num_generations=2)
        make_config(advantage_estimator="gae", lam=0.9, whiten_advantages=False, vf_coef=0.5)


# ---------------------------------------------------------------- the critic's baselines and lambda
def test_the_critic_baseline_fields_default_to_todays_run(make_config):
    config = make_config()
    assert (config.critic_gate_explained_variance, config.lam_length_min, config.lam_length_per_turn) == (
        None, None, False)


def test_gae_rloo_needs_groups(make_config):
    with pytest.raises(ValueError, match="advantage_estimator='gae_rloo'.*num_generations >= 2"):
        make_config(advantage_estimator="gae_rloo")


@pytest.mark.parametrize("value", [1.5, float("nan")])
def test_a_gate_threshold_above_one_is_refused(make_config, value):
    with pytest.raises(ValueError, match="critic_gate_explained_variance must be a finite number <= 1"):
        make_config(critic_gate_explained_variance=value)
    assert make_config(critic_gate_explained_variance=0.0).critic_gate_explained_variance == 0.0


def test_the_lambda_floor_and_per_turn_need_lam_length_alpha(make_config):
    with pytest.raises(ValueError, match=r"lam_length_min=0.5 shapes the length-adaptive lambda.*lam_length_alpha"):
        make_config(lam_length_min=0.5)
    with pytest.raises(ValueError, match=r"lam_length_per_turn=True .*lam_length_alpha"):
        make_config(lam_length_per_turn=True)
    with pytest.raises(ValueError, match=r"lam_length_min must be in \[0, 1\]"):
        make_config(lam_length_alpha=1.5, lam_length_min=2.0)
    config = make_config(lam_length_alpha=1.5, lam_length_min=0.3, lam_length_per_turn=True)
    assert (config.lam_length_min, config.lam_length_per_turn) == (0.3, True)


def test_the_gate_with_a_critic_free_estimator_is_named_in_a_warning(make_config):
    with pytest.warns(UserWarning, match="critic_gate_explained_variance=0.0"):
        make_config(advantage_estimator="rloo", num_generations=2, critic_gate_explained_variance=0.0)


def test_the_command_line_reads_the_new_fields(tmp_path):
    (config,) = HfArgumentParser(PPOConfig).parse_args_into_dataclasses(args=[
        "--output_dir", str(tmp_path), "--report_to", "none", "--bf16", "False", "--num_generations", "2",
        "--advantage_estimator", "gae_rloo", "--critic_gate_explained_variance", "0.0", "--lam_length_alpha", "1.5",
        "--lam_length_min", "0.2", "--lam_length_per_turn", "True"])
    assert config.advantage_estimator == "gae_rloo" and config.critic_gate_explained_variance == 0.0
    assert (config.lam_length_min, config.lam_length_per_turn) == (0.2, True)
