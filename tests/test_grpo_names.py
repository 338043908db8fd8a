"""GRPO's config names in PPOConfig: the four with PPO's meaning are accepted in Python and on the
command line and land on the PPO field; the others raise a TypeError naming what to use here."""

import pytest
from transformers import HfArgumentParser

from trl_ppo_ext import PPOConfig
from trl_ppo_ext.grpo_names import FOREIGN_NAMES, GRPO_ALIASES


@pytest.mark.parametrize("alias, ppo_name, value", [
    ("max_completion_length", "response_length", 7),
    ("num_iterations", "num_ppo_epochs", 3),
    ("epsilon", "cliprange", 0.1),
    ("epsilon_high", "cliprange_high", 0.28),
])
def test_a_grpo_alias_sets_the_ppo_field_and_both_read_it(tmp_path, alias, ppo_name, value):
    config = PPOConfig(output_dir=str(tmp_path), report_to=[], bf16=False, **{alias: value})
    assert getattr(config, ppo_name) == value
    assert getattr(config, alias) == value


def test_unset_aliases_read_the_ppo_fields(make_config):
    config = make_config(response_length=5, num_ppo_epochs=2)
    assert (config.max_completion_length, config.num_iterations, config.epsilon, config.epsilon_high) == (
        5, 2, config.cliprange, None)


def test_an_alias_and_its_field_that_disagree_are_refused(make_config):
    with pytest.raises(ValueError, match="max_completion_length=8 and response_length=10: max_completion_length is "
                                         "GRPO's name for response_length"):
        make_config(response_length=10, max_completion_length=8)
    assert make_config(response_length=8, max_completion_length=8).response_length == 8  # agreeing is fine


def test_aliases_parse_on_the_command_line(tmp_path):
    (config,) = HfArgumentParser(PPOConfig).parse_args_into_dataclasses(
        ["--output_dir", str(tmp_path), "--report_to", "none", "--bf16", "False",
         "--max_completion_length", "6", "--num_iterations", "2", "--epsilon", "0.3"])
    assert (config.response_length, config.num_ppo_epochs, config.cliprange) == (6, 2, 0.3)


@pytest.mark.parametrize("name, names_instead", [
    ("beta", "kl_coef"),
    ("log_completions", "num_sample_generations"), ("steps_per_generation", "num_mini_batches"),
    ("mask_truncated_completions", "missing_eos_penalty"), ("max_prompt_length", "render_prompts"),
])
def test_a_grpo_name_with_another_meaning_says_what_to_use(tmp_path, name, names_instead):
    with pytest.raises(TypeError, match=f"PPOConfig has no field '{name}': .*{names_instead}"):
        PPOConfig(output_dir=str(tmp_path), report_to=[], **{name: 1})


def test_other_unknown_names_keep_the_dataclass_error(tmp_path):
    with pytest.raises(TypeError, match="unexpected keyword argument 'no_such_field'"):
        PPOConfig(output_dir=str(tmp_path), no_such_field=1)


def test_no_foreign_name_is_a_field_and_every_alias_is():
    names = {f for f in PPOConfig.__dataclass_fields__}
    assert names.isdisjoint(FOREIGN_NAMES)
    assert set(GRPO_ALIASES) | set(GRPO_ALIASES.values()) <= names
