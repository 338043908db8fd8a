"""build_policy_and_value without a critic (with_value=False): no value parameter anywhere, no
value forward, the policy's logits; a value model given anyway is unused, with a warning."""

import pytest
import torch
from peft import LoraConfig, PeftModel, get_peft_model

from trl_ppo_ext.models.actor_critic import SharedActorCritic
from trl_ppo_ext.models.assembly import build_policy_and_value
from trl_ppo_ext.models.policy_value import PolicyAndValue
from trl_ppo_ext.tiny import build_tiny_causal_lm, build_tiny_scorer, build_tiny_tokenizer

pytestmark = pytest.mark.filterwarnings("ignore:.*is_gradient_checkpointing.*:FutureWarning")


@pytest.fixture(scope="module")
def tok():
    return build_tiny_tokenizer()


def _lora():
    return LoraConfig(task_type="CAUSAL_LM", r=2, target_modules=["q_proj"])


def _no_value_parameter(module):
    return not any("value" in name or name.startswith("score") for name, _ in module.named_parameters())


def test_each_model_input_without_a_critic(tok):
    full = build_policy_and_value(build_tiny_causal_lm(tok), None, None, with_value=False)
    assert isinstance(full, PolicyAndValue) and not full.has_value and _no_value_parameter(full)
    assert all(p.requires_grad for p in full.parameters())  # full training, no adapter
    lora = build_policy_and_value(build_tiny_causal_lm(tok), None, _lora(), with_value=False)
    assert isinstance(lora, SharedActorCritic) and not lora.has_value and _no_value_parameter(lora)
    assert isinstance(lora.policy, PeftModel)
    peft_model = get_peft_model(build_tiny_causal_lm(tok), _lora())
    from_peft = build_policy_and_value(peft_model, None, None, with_value=False)
    assert isinstance(from_peft, SharedActorCritic) and from_peft.policy is peft_model and not from_peft.has_value
    assert build_policy_and_value(lora, None, None, with_value=False) is lora


def test_the_critic_free_forward_gives_the_policys_logits_and_zero_values(tok):
    policy = build_tiny_causal_lm(tok, seed=5)
    ids = torch.tensor([[7, 8, 9, 10]])
    with torch.no_grad():
        expected = policy(ids).logits
        logits, values = build_policy_and_value(policy, None, None, with_value=False)(ids)
    assert torch.equal(logits, expected) and values.eq(0).all() and values.shape == (1, 4)


def test_a_value_model_given_anyway_is_unused_with_a_warning(tok):
    scorer = build_tiny_scorer(tok)
    with pytest.warns(UserWarning, match="a `value_model` was passed, but the advantage estimator reads no value"):
        wrapper = build_policy_and_value(build_tiny_causal_lm(tok), scorer, None, with_value=False)
    assert wrapper.value_model is None and _no_value_parameter(wrapper)
    assert not any(p is q for p in wrapper.parameters() for q in scorer.parameters())


def test_an_actor_critic_with_a_value_head_is_refused_without_a_critic(tok):
    shared = SharedActorCritic(build_tiny_causal_lm(tok), lora_config=_lora())
    with pytest.raises(ValueError, match=r"SharedActorCritic with a value head.*with_value=False"):
        build_policy_and_value(shared, None, None, with_value=False)
    critic_free = SharedActorCritic(build_tiny_causal_lm(tok), lora_config=_lora(), with_value=False)
    with pytest.raises(ValueError, match="already carries its LoRA adapter"):
        build_policy_and_value(critic_free, None, _lora(), with_value=False)
