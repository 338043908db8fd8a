"""The value-adapter critic (docs/critic.md: a LoRA adapter of the critic's own on the policy's base)
from the config, with the model given as a folder like every other layout (issue 44 item 7): before,
four lines of ``SharedActorCritic(..., value_lora_config=...)`` by hand."""

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
