"""The value-adapter critic (docs/critic.md: a LoRA adapter of the critic's own on the policy's base)
from the config, with the model given as a folder like every other layout (issue 44 item 7): before,
four lines of ``SharedActorCritic(..., value_lora_config=...)`` by hand."""

import math

import pytest
import torch
from peft import LoraConfig
from transformers import HfArgumentParser

from trl_ppo_ext import PPOConfig
from trl_ppo_ext.models.actor_critic import VALUE_ADAPTER_NAME, SharedActorCritic
from trl_ppo_ext.models.assembly import value_adapter_config
from trl_ppo_ext.tiny import build_tiny_causal_lm, build_tiny_scorer

LORA = dict(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj", "lm_head"], task_type="CAUSAL_LM")


def test_the_command_line_selects_the_value_adapter(tmp_path):
    (args,) = HfArgumentParser(PPOConfig).parse_args_into_dataclasses(
        ["--output_dir", str(tmp_path), "--use_value_adapter", "--report_to", "none"])
    assert args.use_value_adapter is True
    assert PPOConfig(output_dir=str(tmp_path), report_to=[]).use_value_adapter is False


def test_the_critics_adapter_copies_the_policys_without_lm_head():
    policy_config = LoraConfig(**LORA, modules_to_save=["embed_tokens"])
    config = value_adapter_config(policy_config)
    assert config.target_modules == {"q_proj", "v_proj"} and config.r == 4 and config.lora_alpha == 8
    assert config.modules_to_save is None and config.task_type is None
    assert policy_config.target_modules == {"q_proj", "v_proj", "lm_head"}  # the caller's, unchanged


def test_a_folder_and_the_flag_train_the_value_adapter_layout(make_trainer, tok, tmp_path):
    folder = tmp_path / "policy"
    build_tiny_causal_lm(tok, seed=0).save_pretrained(folder)
    tok.save_pretrained(folder)
    trainer = make_trainer(tok, model=str(folder), ref_model=None, value_model=None,
                           reward_model=build_tiny_scorer(tok, seed=2), peft_config=LoraConfig(**LORA),
                           use_value_adapter=True)
    model = trainer.unwrapped
    assert isinstance(model, SharedActorCritic) and model.value_adapter == VALUE_ADAPTER_NAME
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    trainer.train()
    moved = {n for n, p in model.named_parameters() if not torch.equal(p.detach(), before[n])}
    value_adapter = {n for n in before if f".{VALUE_ADAPTER_NAME}." in n}
    assert len(value_adapter) == 8 and value_adapter <= moved  # q and v, A and B, 2 layers; no lm_head
    assert any("lora_" in n and ".default." in n for n in moved)  # the policy's adapter
    assert not any("lora_" not in n and "value_head" not in n for n in moved)  # the base is frozen


@pytest.mark.parametrize("kwargs, config, match", [
    ({}, {}, "use_value_adapter=True with peft_config=None"),
    ({"peft_config": LoraConfig(**LORA), "value_model": "scorer"}, {}, "value_model=None, or use_value_adapter"),
    ({"peft_config": LoraConfig(**LORA)}, {"advantage_estimator": "grpo", "num_generations": 2},
     "use_value_adapter=False, or advantage_estimator='gae'"),
], ids=["no_peft_config", "with_a_value_model", "critic_free"])
def test_what_the_value_adapter_cannot_go_with_is_named(make_trainer, tok, kwargs, config, match):
    if kwargs.get("value_model") == "scorer":
        kwargs = {**kwargs, "value_model": build_tiny_scorer(tok)}
    with pytest.raises(ValueError, match=match):
        make_trainer(tok, model=build_tiny_causal_lm(tok), ref_model=None, use_value_adapter=True,
                     **{"value_model": None, **kwargs}, **config)


# ------------------------------------------------------------------ the branch critic (value_branch_layer)

def test_the_command_line_sets_the_branch_layer(tmp_path):
    (args,) = HfArgumentParser(PPOConfig).parse_args_into_dataclasses(
        ["--output_dir", str(tmp_path), "--use_value_adapter", "--value_branch_layer", "-2", "--report_to", "none"])
    assert args.value_branch_layer == -2
    assert PPOConfig(output_dir=str(tmp_path), report_to=[]).value_branch_layer is None


@pytest.mark.parametrize("kl_coef", [0.05, 0.0], ids=["kl", "on_policy_values_alone"])
def test_a_branch_critic_trains_through_the_trainer(make_trainer, assert_metrics, tok, kl_coef):
    """A 4-layer Llama, the critic branching at layer 2: the policy's adapter on every layer and the
    critic's on layers 2-3 move, the base does not, and every metric (explained variance included) is
    finite. kl_coef=0: the on-policy scoring reads the values alone (the policy's layers below the
    branch, then the critic's)."""
    lora = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"])
    model = SharedActorCritic(build_tiny_causal_lm(tok, seed=0, num_layers=4), lora_config=lora,
                              value_lora_config=lora, value_branch_layer=2)
    trainer = make_trainer(tok, model=model, ref_model=None, value_model=None,
                           reward_model=build_tiny_scorer(tok, seed=2), kl_coef=kl_coef)
    assert trainer.scoring.old_logprobs == (kl_coef != 0)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    trainer.train()
    moved = {n for n, p in model.named_parameters() if not torch.equal(p.detach(), before[n])}
    critic_layers = {int(n.split(".layers.")[1].split(".")[0]) for n in moved if f".{VALUE_ADAPTER_NAME}." in n}
    assert critic_layers == {2, 3} and {n for n in before if f".{VALUE_ADAPTER_NAME}." in n} <= moved
    assert {int(n.split(".layers.")[1].split(".")[0]) for n in moved if ".default." in n} == {0, 1, 2, 3}
    assert not any("lora_" not in n and "value_head" not in n for n in moved)  # the base is frozen
    if kl_coef:
        assert_metrics(trainer, 2)
    logs = [h for h in trainer.state.log_history if "val/explained_variance" in h]
    assert len(logs) == 2 and all(math.isfinite(h["val/explained_variance"]) for h in logs)


def test_the_config_field_builds_the_branch_critic(make_trainer, tok):
    trainer = make_trainer(tok, model=build_tiny_causal_lm(tok, seed=0, num_layers=4), ref_model=None,
                           value_model=None, reward_model=build_tiny_scorer(tok, seed=2),
                           peft_config=LoraConfig(**LORA), use_value_adapter=True, value_branch_layer=-1)
    assert trainer.unwrapped.value_branch_layer == 3
