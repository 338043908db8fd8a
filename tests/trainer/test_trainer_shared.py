"""PPOTrainer with the shared-backbone LoRA actor-critic (reference = disabled adapter), on CPU."""

import pytest
import torch
from peft import LoraConfig

from trl_ppo_ext.models.actor_critic import SharedActorCritic
from trl_ppo_ext.tiny import build_tiny_causal_lm, build_tiny_scorer, build_tiny_tokenizer


def _lora():
    return LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "k_proj", "v_proj", "o_proj"],
                      task_type="CAUSAL_LM")


def _split_params(ac: SharedActorCritic):
    trainable = {k: v.detach().clone() for k, v in ac.named_parameters() if v.requires_grad}
    frozen = {k: v.detach().clone() for k, v in ac.named_parameters() if not v.requires_grad}
    return trainable, frozen


def test_shared_actor_critic_trains_adapter_and_head_only_and_round_trips(tmp_path, make_trainer, assert_metrics):
    tok = build_tiny_tokenizer(pad_equals_eos=True)
    ac = SharedActorCritic(build_tiny_causal_lm(tok), lora_config=_lora())
    trainable, frozen = _split_params(ac)
    assert any("value_head" in k for k in trainable) and any("lora_" in k for k in trainable)
    trainer = make_trainer(tok, model=ac, ref_model=None, value_model=None, num_ppo_epochs=2)
    assert trainer.ref_model is None
    trainer.train()
    assert_metrics(trainer, n_updates=2)
    now = dict(ac.named_parameters())
    assert not torch.equal(now["value_head.weight"], trainable["value_head.weight"])
    assert any(not torch.equal(now[k], v) for k, v in trainable.items() if "lora_B" in k)
    assert all(torch.equal(now[k], v) for k, v in frozen.items()), "a base parameter changed"

    out = tmp_path / "saved"
    trainer.save_model(str(out))
    reloaded = SharedActorCritic.from_pretrained(build_tiny_causal_lm(tok), out)
    ids = torch.tensor([[7, 8, 9, 3, 10]])
    ac.eval(), reloaded.eval()
    with torch.no_grad():
        (l1, v1), (l2, v2) = ac(input_ids=ids), reloaded(input_ids=ids)
    assert torch.equal(l1, l2) and torch.equal(v1, v2)


def test_plain_policy_with_peft_config_and_no_value_model_builds_the_shared_model(make_trainer, assert_metrics):
    trainer = make_trainer(ref_model=None, value_model=None, peft_config=_lora(), total_episodes=4)
    shared = trainer.unwrapped
    assert isinstance(shared, SharedActorCritic)
    assert trainer.ref_model is None  # the reference is the policy with its adapter disabled
    # the LoRA adapter of peft_config on the policy's targets, and a scalar value head on the hidden size
    assert list(shared.policy.peft_config) == ["default"]
    assert set(shared.policy.peft_config["default"].target_modules) == set(_lora().target_modules)
    hidden = shared.policy.get_input_embeddings().weight.shape[1]
    assert (shared.value_head.in_features, shared.value_head.out_features) == (hidden, 1)
    trainable = {n for n, p in shared.named_parameters() if p.requires_grad}
    assert trainable and all("lora_" in n or n.startswith("value_head.") for n in trainable)
    assert {"value_head.weight"} <= trainable
    before = {n: p.detach().clone() for n, p in shared.named_parameters() if p.requires_grad}
    trainer.train()
    assert_metrics(trainer, n_updates=1)
    after = dict(shared.named_parameters())
    assert not torch.equal(after["value_head.weight"], before["value_head.weight"])  # the critic trained
    assert any(not torch.equal(after[n], before[n]) for n in before if "lora_" in n)  # and the policy adapter


def test_reference_logprobs_equal_the_untouched_base(make_trainer):
    """After training, the disabled adapter still gives the base model's log-probs."""
    tok = build_tiny_tokenizer()
    ac = SharedActorCritic(build_tiny_causal_lm(tok, seed=0), lora_config=_lora())
    untouched = build_tiny_causal_lm(tok, seed=0)
    trainer = make_trainer(tok, model=ac, ref_model=None, value_model=None)
    trainer.train()
    rollout = trainer.score_rollout(trainer.generate_rollout(next(iter(trainer.dataloader))))
    from trl_ppo_ext.functional import logprobs_from_logits
    from trl_ppo_ext.rollout import response_logits, sequence_inputs

    ids, attn, pos = sequence_inputs(rollout.queries, rollout.query_mask, rollout.responses, rollout.response_mask)
    with torch.no_grad():
        logits = untouched(input_ids=ids, attention_mask=attn, position_ids=pos).logits
    T = rollout.responses.shape[1]
    expected = logprobs_from_logits(response_logits(logits, T, trainer.args.temperature), rollout.responses)
    expected = expected.masked_fill(~rollout.response_mask, 0)
    assert torch.allclose(rollout.ref_logprobs, expected, atol=1e-6, rtol=0)
    assert not torch.allclose(rollout.logprobs, expected, atol=1e-4), "the adapter did not change the policy"


def test_4bit_base_trains_one_ppo_step(tmp_path, make_trainer, assert_metrics):
    pytest.importorskip("bitsandbytes")
    from trl_ppo_ext.models.loading import load_actor_critic

    tok = build_tiny_tokenizer()
    base_dir = tmp_path / "base"
    build_tiny_causal_lm(tok, hidden_size=64, num_heads=4).save_pretrained(base_dir)
    tok.save_pretrained(base_dir)
    ac = load_actor_critic(str(base_dir), lora_r=4, lora_alpha=8, load_in_4bit=True)
    trainable, _ = _split_params(ac)
    trainer = make_trainer(tok, model=ac, ref_model=None, value_model=None, total_episodes=4,
                           offload_reward_model=True)
    trainer.train()
    assert_metrics(trainer, n_updates=1)
    now = dict(ac.named_parameters())
    assert not torch.equal(now["value_head.weight"], trainable["value_head.weight"])


def test_error_shared_model_with_separate_value_model(make_trainer, tok):
    ac = SharedActorCritic(build_tiny_causal_lm(tok), lora_config=_lora())
    with pytest.raises(ValueError, match=r"has its own value head.*Pass value_model=None"):
        make_trainer(tok, model=ac, ref_model=None, reward_model=build_tiny_scorer(tok),
                     value_model=build_tiny_scorer(tok))


def test_no_value_model_and_no_peft_config_gets_the_policys_backbone_as_critic(make_trainer, tok, caplog):
    """A GRPO script gives neither: the critic is a copy of the policy's backbone under a new
    scalar head, said in a warning that names the one-GPU layout (it was a ValueError)."""
    policy = build_tiny_causal_lm(tok)
    with caplog.at_level("WARNING", logger="trl_ppo_ext.inputs"):
        trainer = make_trainer(tok, model=policy, ref_model=None, reward_model=build_tiny_scorer(tok),
                               value_model=None)
    value = trainer.value_model
    assert value is not policy and value.config.num_labels == 1
    assert all(torch.equal(a, b) for a, b in zip(value.base_model.state_dict().values(),
                                                   policy.base_model.state_dict().values()))
    assert "copy of the policy's backbone" in caplog.text and "peft_config=LoraConfig" in caplog.text


def test_error_reward_model_without_scalar_head(make_trainer, tok):
    rm = build_tiny_scorer(tok)
    rm.score = torch.nn.Linear(rm.score.in_features, 2, bias=False)
    with pytest.raises(ValueError, match=r"`reward_model`'s score head has 2 outputs.*num_labels=1"):
        make_trainer(tok, ref_model=None, reward_model=rm, value_model=build_tiny_scorer(tok))


def test_error_a_reward_function_model_without_scalar_head_is_named_by_its_index(make_trainer, tok):
    rm = build_tiny_scorer(tok)
    rm.score = torch.nn.Linear(rm.score.in_features, 3, bias=False)
    with pytest.raises(ValueError, match=r"`reward_funcs\[1\]`'s score head has 3 outputs.*num_labels=1"):
        make_trainer(tok, reward_funcs=[lambda completions, **kw: [0.0] * len(completions), rm])
