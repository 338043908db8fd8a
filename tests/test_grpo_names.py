"""GRPO's config names in PPOConfig: the aliases with PPO's meaning are accepted in Python and on the
command line and land on the PPO field; GRPO's own fields that carry over are fields; names accepted
only at one value say why another does not apply; the others raise a TypeError naming what to use here.
A walk over the installed TRL's GRPOConfig checks that no field gets the bare dataclass error."""

import dataclasses

import pytest
from transformers import HfArgumentParser

from trl_ppo_ext import PPOConfig
from trl_ppo_ext.grpo_names import FOREIGN_NAMES, GRPO_ALIASES, GRPO_FOLDED, GRPO_VALUE_ONLY


@pytest.mark.parametrize("alias, ppo_name, value", [
    ("max_completion_length", "response_length", 7),
    ("num_iterations", "num_ppo_epochs", 3),
    ("epsilon", "cliprange", 0.1),
    ("epsilon_high", "cliprange_high", 0.28),
    ("delta", "dual_clip", 3.0),
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
    ("generation_batch_size", "per_device_train_batch_size"), ("steps_per_generation", "num_mini_batches"),
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


def _grpo_fields():
    trl = pytest.importorskip("trl")
    return [f for f in dataclasses.fields(trl.GRPOConfig) if f.init]


def _grpo_default(f):
    return f.default_factory() if f.default is dataclasses.MISSING else f.default


def test_every_grpo_field_is_a_field_an_accepted_value_or_a_named_refusal(tmp_path):
    """Each GRPOConfig field this config does not declare, at GRPO's default, is accepted or refused
    with an error naming it (never "unexpected keyword argument")."""
    ours = set(PPOConfig.__dataclass_fields__)
    missing = [f for f in _grpo_fields() if f.name not in ours]
    assert missing, "the installed TRL's GRPOConfig has no field PPOConfig lacks: the walk checks nothing"
    for f in missing:
        assert f.name in {**FOREIGN_NAMES, **GRPO_VALUE_ONLY, **GRPO_FOLDED}, f"GRPOConfig.{f.name} is not classified"
        try:
            PPOConfig(output_dir=str(tmp_path), report_to=[], bf16=False, **{f.name: _grpo_default(f)})
        except (TypeError, ValueError) as err:
            assert "unexpected keyword argument" not in str(err) and f.name in str(err), (f.name, str(err))


@pytest.mark.parametrize("name, value, why", [
    ("importance_sampling_level", "sequence", "GSPO"), ("sync_ref_model", True, "TR-DPO"),
    ("vllm_structured_outputs_regex", "ab", "constrained decoding"), ("num_generations_eval", 4,
                                                                      "num_sample_generations"),
])
def test_a_grpo_field_accepted_only_at_one_value_says_why_another_does_not_apply(make_config, name, value, why):
    with pytest.raises(ValueError, match=f"PPOConfig got {name}={value!r}, a TRL GRPO field accepted here only as "
                                         f".*{why}"):
        make_config(**{name: value})
    accepted = GRPO_VALUE_ONLY[name][0][0]
    assert not hasattr(make_config(**{name: accepted}), name)  # the accepted value sets nothing


def test_the_sampling_filters_and_grpo_fields_are_fields_checked_and_parsed(tmp_path, make_config):
    config = make_config(top_k=5, top_p=0.9, min_p=0.05, repetition_penalty=1.1, generation_kwargs={"top_k": 2},
                         log_completions=True, num_completions_to_print=3, shuffle_dataset=False)
    assert (config.top_k, config.top_p, config.min_p, config.repetition_penalty) == (5, 0.9, 0.05, 1.1)
    with pytest.raises(ValueError, match="PPOConfig.top_p must be in"):
        make_config(top_p=1.5)
    with pytest.raises(ValueError, match=r"generation_kwargs sets \['do_sample'\]"):
        make_config(generation_kwargs={"do_sample": False})
    with pytest.raises(ValueError, match="num_completions_to_print must be an int >= 1"):
        make_config(num_completions_to_print=0)
    (parsed,) = HfArgumentParser(PPOConfig).parse_args_into_dataclasses(
        ["--output_dir", str(tmp_path), "--report_to", "none", "--bf16", "False", "--top_k", "1",
         "--generation_kwargs", '{"top_p": 0.5}', "--log_completions", "True"])
    assert (parsed.top_k, parsed.generation_kwargs, parsed.log_completions) == (1, '{"top_p": 0.5}', True)


def test_trust_remote_code_reaches_from_pretrained_and_leaves_model_config_its_flag(make_config):
    from dataclasses import dataclass, field

    from trl_ppo_ext.inputs import model_init_kwargs

    assert model_init_kwargs(make_config(trust_remote_code=True)) == {"trust_remote_code": True}
    assert model_init_kwargs(make_config(trust_remote_code=True, model_init_kwargs='{"dtype": "float32"}')) == {
        "dtype": "float32", "trust_remote_code": True}
    assert model_init_kwargs(make_config(trust_remote_code=False)) == {}

    @dataclass
    class ModelArguments:  # TRL's ModelConfig before 1.16, and this package's examples, declare the flag
        trust_remote_code: bool = field(default=False)

    HfArgumentParser((PPOConfig, ModelArguments))  # no "conflicting option string"


def test_grpo_metric_names_carry_the_same_quantities():
    from trl_ppo_ext.grpo_names import grpo_metrics

    ours = {"objective/scores_before_penalty": 0.5, "objective/scores_std": 0.2, "val/response_length": 4.0,
            "val/response_length_min": 2.0, "val/response_length_max": 6.0, "val/eos_rate": 0.75,
            "objective/kl": 2.0, "policy/entropy_avg": 3.8, "policy/clipfrac_lower_avg": 0.125,
            "policy/clipfrac_upper_avg": 0.25, "policy/grad_norm": 1.5, "lr": 1e-5, "loss/policy_avg": -0.1}
    grpo = grpo_metrics(ours, num_tokens_seen=1200, step_time=2.5)
    assert grpo == {
        "reward": 0.5, "reward_std": 0.2, "completions/mean_length": 4.0, "completions/min_length": 2.0,
        "completions/max_length": 6.0, "entropy": 3.8, "clip_ratio/low_mean": 0.125, "clip_ratio/high_mean": 0.25,
        "grad_norm": 1.5, "learning_rate": 1e-5, "loss": -0.1,
        "completions/clipped_ratio": 0.25,  # 1 - eos_rate
        "kl": 0.5,  # 2.0 summed over 4 tokens per response
        "clip_ratio/region_mean": 0.375, "num_tokens": 1200.0, "step_time": 2.5,
    }
    # a GRPO key the update logs already (the group estimators' reward_std) is not written again
    assert "reward_std" not in grpo_metrics({**ours, "reward_std": 0.3})


def test_the_metrics_page_maps_every_key_trl_grpo_logs():
    import inspect
    import re
    from pathlib import Path

    grpo_trainer = pytest.importorskip("trl.trainer.grpo_trainer")
    source = inspect.getsource(grpo_trainer)
    keys = set(re.findall(r'_metrics\[mode\]\["([^"]+)"\]', source)) | {"step_time", "num_tokens"}
    keys |= {"loss", "grad_norm", "learning_rate", "epoch"}  # the Trainer's own
    page = (Path(__file__).parents[1] / "docs" / "metrics.md").read_text()
    section = page.split("## TRL GRPO's keys", 1)[1]
    missing = sorted(k for k in keys if f"`{k}`" not in section)
    assert not missing, f"docs/metrics.md does not map GRPO's {missing}"


def test_the_grpo_defaults_named_in_the_warning_are_trls():
    from trl_ppo_ext.grpo_names import GRPO_DEFAULTS, PPO_DEFAULTS

    trl = pytest.importorskip("trl")
    grpo = {f.name: f.default for f in dataclasses.fields(trl.GRPOConfig)}
    assert {name: value for name, (_, value, _) in GRPO_DEFAULTS.items()} == {n: grpo[n] for n in GRPO_DEFAULTS}
    assert PPO_DEFAULTS == {k: PPOConfig.__dataclass_fields__[k].default for k in PPO_DEFAULTS}


def test_a_grpo_style_config_gets_one_warning_naming_the_defaults_that_differ(make_config):
    from trl_ppo_ext.grpo_names import grpo_defaults_warning

    # a GRPO script's config: GRPO's names, its temperature; completion length, samples, passes left unset
    text = grpo_defaults_warning(make_config(max_completion_length=None, epsilon=0.2, top_p=0.95, temperature=1.0,
                                             response_length=53, num_ppo_epochs=4))
    assert text.startswith("This looks like a GRPO configuration (it sets epsilon, top_p, ")
    assert ("completion length: response_length=53, GRPO's max_completion_length=512; samples per prompt: "
            "num_generations=1, GRPO's num_generations=8; passes over each rollout batch: num_ppo_epochs=4, "
            "GRPO's num_iterations=1.") in text
    assert "temperature" not in text.split("sets nothing")[1]  # GRPO's value already


def test_a_ppo_config_and_a_grpo_config_with_grpo_values_get_none(make_config):
    from trl_ppo_ext.grpo_names import grpo_defaults_warning

    assert grpo_defaults_warning(make_config(response_length=53, temperature=0.7)) is None
    grpo_values = make_config(max_completion_length=12, response_length=12, temperature=1.0, num_generations=2,
                              num_iterations=1, per_device_train_batch_size=2, gradient_accumulation_steps=1)
    assert grpo_defaults_warning(grpo_values) is None  # every setting GRPO's or the script's own
    assert "reward_funcs without a reward_model" in grpo_defaults_warning(
        make_config(response_length=53, temperature=0.7), signals=("reward_funcs without a reward_model",))
