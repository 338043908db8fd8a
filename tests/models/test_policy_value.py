"""Forward helpers: logits of the last positions only, with a fallback for older models."""

from types import SimpleNamespace

import torch
from torch import nn

from trl_ppo_ext.models.policy_value import PolicyAndValue, lm_logits
from trl_ppo_ext.tiny import build_tiny_causal_lm, build_tiny_scorer, build_tiny_tokenizer


class NoLogitsToKeep(nn.Module):
    """A causal LM whose forward predates `logits_to_keep`: (B, L, V) with logits = ids."""

    def forward(self, input_ids, attention_mask=None, position_ids=None, use_cache=False):
        return SimpleNamespace(logits=input_ids.float()[..., None].expand(-1, -1, 3))


def test_lm_logits_falls_back_to_all_positions():
    ids = torch.tensor([[5, 6, 7, 8]])
    out = lm_logits(NoLogitsToKeep(), ids, None, None, logits_to_keep=2)
    assert out.shape == (1, 4, 3)  # callers slice from the end, so the last 2 are still right
    assert out[0, -2:, 0].tolist() == [7.0, 8.0]


def test_policy_and_value_keep_the_same_last_positions():
    tok = build_tiny_tokenizer()
    pv = PolicyAndValue(build_tiny_causal_lm(tok), build_tiny_scorer(tok)).eval()
    ids = torch.tensor([[7, 8, 9, 10, 11]])
    mask, pos = torch.ones_like(ids), torch.arange(5)[None]
    with torch.no_grad():
        full_logits, full_values = pv(input_ids=ids, attention_mask=mask, position_ids=pos)
        logits, values = pv(input_ids=ids, attention_mask=mask, position_ids=pos, logits_to_keep=3)
    assert logits.shape[1] == values.shape[1] == 3
    torch.testing.assert_close(logits, full_logits[:, -3:], rtol=0, atol=1e-6)
    torch.testing.assert_close(values, full_values[:, -3:], rtol=0, atol=1e-6)


# ---------------------------------------------------------------- assembling the trainer's models
def test_build_policy_and_value_assembles_each_combination_and_refuses_the_others():
    import pytest
    from peft import LoraConfig, PeftModel

    from trl_ppo_ext.models.actor_critic import SharedActorCritic
    from trl_ppo_ext.models.assembly import build_policy_and_value, build_reference, check_separate_reference

    tok = build_tiny_tokenizer()
    lora = LoraConfig(task_type="CAUSAL_LM", r=2, target_modules=["q_proj"])
    pair = build_policy_and_value(build_tiny_causal_lm(tok), build_tiny_scorer(tok), None)
    assert isinstance(pair, PolicyAndValue) and not isinstance(pair.policy, PeftModel)
    lora_pair = build_policy_and_value(build_tiny_causal_lm(tok), build_tiny_scorer(tok), lora)
    assert isinstance(lora_pair.policy, PeftModel)
    shared = build_policy_and_value(build_tiny_causal_lm(tok), None, lora)
    assert isinstance(shared, SharedActorCritic) and build_policy_and_value(shared, None, None) is shared
    with pytest.raises(ValueError, match="value_model=None asks for a shared-backbone value head"):
        build_policy_and_value(build_tiny_causal_lm(tok), None, None)
    with pytest.raises(ValueError, match="and a separate `value_model` was passed too"):
        build_policy_and_value(shared, build_tiny_scorer(tok), None)
    with pytest.raises(ValueError, match="`model` is already a PeftModel and `peft_config` was passed too"):
        build_policy_and_value(lora_pair.policy, build_tiny_scorer(tok), lora)
    policy = build_tiny_causal_lm(tok)
    with pytest.raises(ValueError, match="`model` and `ref_model` are the same object"):
        check_separate_reference(policy, policy)
    ref = build_reference(policy, None, is_peft=False)  # a frozen copy; the policy stays trainable
    assert ref is not policy and not any(p.requires_grad for p in ref.parameters())
    assert all(p.requires_grad for p in policy.parameters()) and build_reference(policy, None, is_peft=True) is None


def test_reference_adapter_disables_the_adapter_and_restores_every_requires_grad_flag():
    from peft import LoraConfig, get_peft_model

    from trl_ppo_ext.models.assembly import reference_adapter

    tok = build_tiny_tokenizer()
    lora = LoraConfig(task_type="CAUSAL_LM", r=2, target_modules=["q_proj"])
    policy = get_peft_model(build_tiny_causal_lm(tok), lora)
    lora_b = next(p for n, p in policy.named_parameters() if "lora_B" in n)
    with torch.no_grad():
        lora_b.fill_(0.5)  # the adapter changes the logits
    value_head = nn.Linear(1, 1)  # stands for a separate value adapter peft would freeze
    flags = [p.requires_grad for p in [*policy.parameters(), *value_head.parameters()]]
    ids = torch.tensor([[7, 8, 9]])
    with torch.no_grad():
        adapted = policy(input_ids=ids).logits
        with reference_adapter(policy, [*policy.parameters(), *value_head.parameters()]):
            value_head.requires_grad_(False)  # what peft's set_adapter did to a second adapter
            base = policy(input_ids=ids).logits
        again = policy(input_ids=ids).logits
    assert not torch.equal(adapted, base) and torch.equal(adapted, again)
    assert [p.requires_grad for p in [*policy.parameters(), *value_head.parameters()]] == flags


# ---------------------------------------------------------------- without a critic
def test_a_policy_without_a_value_model_runs_the_policy_only():
    tok = build_tiny_tokenizer()
    policy = build_tiny_causal_lm(tok, seed=2)
    pv = PolicyAndValue(policy, None).eval()
    assert not pv.has_value and pv.value_model is None
    assert {n.split(".")[0] for n, _ in pv.named_parameters()} == {"policy"}
    calls = []
    policy.register_forward_hook(lambda m, args, out: calls.append(1))
    ids = torch.tensor([[7, 8, 9, 10, 11]])
    mask, pos = torch.ones_like(ids), torch.arange(5)[None]
    with torch.no_grad():
        logits, values = pv(input_ids=ids, attention_mask=mask, position_ids=pos, logits_to_keep=3)
        direct = policy(input_ids=ids, attention_mask=mask, position_ids=pos).logits
    assert len(calls) == 2  # ours and the direct call: nothing else ran the policy
    assert values.shape == (1, 3) and values.dtype == torch.float32 and values.eq(0).all()
    torch.testing.assert_close(logits, direct[:, -3:], rtol=0, atol=1e-6)
    pv.gradient_checkpointing_enable({"use_reentrant": False})  # the policy alone
    assert pv.is_gradient_checkpointing
    pv.gradient_checkpointing_disable()
    assert not pv.is_gradient_checkpointing


def test_generate_on_the_wrapper_is_the_policys_generate():
    """A GRPO rollout_func samples with `trainer.model.generate`: the wrapper hands it to the policy
    (before: AttributeError: 'PolicyAndValue' object has no attribute 'generate')."""
    tok = build_tiny_tokenizer()
    policy = build_tiny_causal_lm(tok, seed=3)
    pv = PolicyAndValue(policy, build_tiny_scorer(tok)).eval()
    ids = torch.tensor([[7, 8, 9]])
    kwargs = dict(attention_mask=torch.ones_like(ids), max_new_tokens=4, do_sample=False, pad_token_id=0)
    assert torch.equal(pv.generate(ids, **kwargs), policy.generate(ids, **kwargs))
    assert pv.generation_config is policy.generation_config
    assert (pv.device, pv.dtype) == (torch.device("cpu"), torch.float32)
    critic_free = PolicyAndValue(policy, None)
    assert torch.equal(critic_free.generate(ids, **kwargs), policy.generate(ids, **kwargs))
