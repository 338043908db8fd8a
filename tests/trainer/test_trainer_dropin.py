"""What a TRL user brings and TRL 1.12 handles: each test pins one finding of the drop-in
review (issue 9) on tiny local models -- a policy whose embedding has exactly len(tokenizer)
rows with [PAD] added by the script, TRL's stop_token=None, mixed precision, config-float
dropout, a value adapter, micro-batch size, reward heads, temperature 0."""

import logging

import pytest
import torch
from peft import LoraConfig

from trl_ppo_ext.rollout import sequence_inputs
from trl_ppo_ext.tiny import build_tiny_causal_lm, build_tiny_scorer, build_tiny_tokenizer

LORA = dict(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], task_type="CAUSAL_LM")


def _trainable_snapshot(trainer):
    return {n: p.detach().clone() for n, p in trainer.unwrapped.named_parameters() if p.requires_grad}


def _moved(before, trainer):
    now = dict(trainer.unwrapped.named_parameters())
    return {n for n, p in before.items() if not torch.equal(p, now[n].detach())}


@pytest.mark.parametrize("use_peft", [False, True], ids=["full", "peft"])
def test_vocab_exact_policy_with_an_added_pad_token_trains(make_trainer, make_models, make_prompts, use_peft):
    """TRL's own tests and scripts: the tokenizer gets [PAD] after the models were built with
    exactly len(tokenizer) embedding rows; generate used to embed the [PAD] id of a finished row."""
    tok = build_tiny_tokenizer()
    policy, ref, value, reward = make_models(tok)  # vocab_size == len(tok)
    tok.add_special_tokens({"pad_token": "[PAD]"})
    assert tok.pad_token_id >= policy.get_input_embeddings().num_embeddings
    trainer = make_trainer(
        tok, model=policy, ref_model=None if use_peft else ref, reward_model=reward, value_model=value,
        train_dataset=make_prompts(tok, n=16), peft_config=LoraConfig(**LORA) if use_peft else None,
        total_episodes=16, response_length=8, stop_token="eos",
    )
    before = _trainable_snapshot(trainer)
    trainer.train()
    moved = _moved(before, trainer)
    assert any("lora" in n for n in moved) if use_peft else any(n.startswith("policy.") for n in moved)
    assert any(n.startswith("value_model.") for n in moved)


def test_stop_token_none_ends_the_mask_at_the_eos_generation_stopped_at(make_trainer, make_prompts):
    """TRL's default stop_token=None: transformers still stops at the checkpoint's EOS; every
    masked-in token was sampled, nothing after the EOS counts, the RM reads the EOS."""
    tok = build_tiny_tokenizer(pad_equals_eos=True)
    trainer = make_trainer(
        tok, stop_token=None, response_length=40, per_device_train_batch_size=16, total_episodes=16,
        local_rollout_forward_batch_size=16, train_dataset=make_prompts(tok, n=16),
    )
    assert trainer.stop_token_ids == (tok.eos_token_id,)
    torch.manual_seed(0)
    rollout = trainer.generate_rollout(next(iter(trainer.dataloader)))
    eos = rollout.responses == tok.eos_token_id
    first_eos = torch.where(eos.any(1), eos.float().argmax(1), rollout.responses.shape[1] - 1)
    positions = torch.arange(rollout.responses.shape[1])
    assert torch.equal(rollout.response_mask, positions[None] <= first_eos[:, None])
    assert rollout.has_stop.any() and torch.equal(rollout.has_stop, eos.any(1))


def test_bf16_config_turns_autocast_on_and_kl_is_zero_at_step_zero(make_trainer):
    """bf16=True reaches the trainer's Accelerator; old and reference log-probs come from the
    same precision context, so a reference equal to the policy gives exactly 0 KL."""
    trainer = make_trainer(bf16=True, use_cpu=True)
    assert trainer.accelerator.mixed_precision == "bf16"
    rollout = trainer.score_rollout(trainer.generate_rollout(next(iter(trainer.dataloader))))
    mask = rollout.response_mask
    assert torch.equal(rollout.logprobs[mask], rollout.ref_logprobs[mask])
    # logits were not copied to fp32 by accelerate's output wrapper: the forward is the model's own
    assert "_original_forward" not in vars(trainer.unwrapped)


def test_config_float_dropout_is_off(make_trainer, make_models, tok):
    policy, ref, value, reward = make_models(tok, attention_dropout=0.5)
    trainer = make_trainer(tok, model=policy, ref_model=ref, reward_model=reward, value_model=value)
    rates = [getattr(m, "attention_dropout") for m in trainer.unwrapped.modules() if hasattr(m, "attention_dropout")]
    assert rates and all(r == 0.0 for r in rates)
    trainer.model.train()  # the update runs in train mode: the same rollout must score the same twice
    rollout = trainer.generate_rollout(next(iter(trainer.dataloader)))
    inputs = sequence_inputs(rollout.queries, rollout.query_mask, rollout.responses, rollout.response_mask)
    first, _ = trainer.policy_logprobs_and_values(trainer.model, rollout, inputs)
    second, _ = trainer.policy_logprobs_and_values(trainer.model, rollout, inputs)
    assert torch.equal(first, second)


def test_a_saved_policy_keeps_the_dropout_of_its_config(make_trainer, make_models, tok, tmp_path):
    """Training zeroes config dropout (some models read it at forward time); what save_model
    writes is the user's model, so its config.json keeps 0.5 -- as TRL's saves do."""
    import json

    policy, ref, value, reward = make_models(tok, attention_dropout=0.5)
    trainer = make_trainer(tok, model=policy, ref_model=ref, reward_model=reward, value_model=value)
    trainer.save_model(str(tmp_path / "saved"))
    assert json.loads((tmp_path / "saved" / "config.json").read_text())["attention_dropout"] == 0.5
    assert policy.config.attention_dropout == 0.0  # and training goes on without dropout


def test_a_value_adapter_stays_trainable_and_trains(make_trainer, tok):
    from trl_ppo_ext.models.actor_critic import SharedActorCritic

    model = SharedActorCritic(build_tiny_causal_lm(tok), lora_config=LoraConfig(**LORA),
                              value_lora_config=LoraConfig(**LORA))
    trainer = make_trainer(tok, model=model, ref_model=None, reward_model=build_tiny_scorer(tok), value_model=None,
                           total_episodes=8)
    before = _trainable_snapshot(trainer)
    value_names = {n for n in before if ".value." in n}
    assert len(value_names) == 8  # q and v, A and B, 2 layers
    trainer.train()
    assert all(p.requires_grad for n, p in trainer.unwrapped.named_parameters() if n in value_names)
    assert value_names <= _moved(before, trainer)


def test_a_value_adapter_holds_under_trls_default_checkpointing(tmp_path, make_trainer, tok, caplog):
    """gradient_checkpointing=True (TRL's default) is applied to a shared actor-critic with a
    value adapter -- it used to be skipped with a warning -- and the run ends on the same weights
    as one without checkpointing: each layer recomputed under the adapter it ran forward with."""
    from trl_ppo_ext.models.actor_critic import SharedActorCritic

    final = {}
    for checkpointing in (False, True):
        torch.manual_seed(0)
        model = SharedActorCritic(build_tiny_causal_lm(tok, seed=0), lora_config=LoraConfig(**LORA),
                                  value_lora_config=LoraConfig(**LORA))
        with caplog.at_level(logging.WARNING):
            trainer = make_trainer(tok, model=model, ref_model=None, reward_model=build_tiny_scorer(tok, seed=2),
                                   value_model=None, total_episodes=8, gradient_checkpointing=checkpointing,
                                   output_dir=str(tmp_path / str(checkpointing)))
        assert "not applied" not in caplog.text
        trainer.train()
        assert model.is_gradient_checkpointing == checkpointing  # on for the update, as configured
        final[checkpointing] = _trainable_snapshot(trainer)
    assert final[True].keys() == final[False].keys() and any(".value." in n for n in final[True])
    for name, value in final[False].items():
        assert torch.equal(final[True][name], value), name


def test_the_step_does_not_depend_on_the_micro_batch_size(tmp_path, make_trainer, make_models, make_prompts):
    """Same rollout, same mini-batch: per-device 1 x 4 accumulation steps and per-device 4 x 1
    take the same SGD step (loss = token mean over the whole mini-batch)."""
    params = []
    for per_device, ga in ((1, 4), (4, 1)):
        tok = build_tiny_tokenizer()
        policy, ref, value, reward = make_models(tok)
        optimizer = torch.optim.SGD([p for m in (policy, value) for p in m.parameters()], lr=1.0)
        trainer = make_trainer(
            tok, model=policy, ref_model=ref, reward_model=reward, value_model=value,
            train_dataset=make_prompts(tok, n=4), optimizers=(optimizer, None),
            output_dir=str(tmp_path / str(per_device) / "out"), per_device_train_batch_size=per_device,
            gradient_accumulation_steps=ga, total_episodes=4, response_length=8, max_grad_norm=0,
        )
        before = _trainable_snapshot(trainer)
        trainer.train()
        lengths = [h["val/response_length"] for h in trainer.state.log_history if "val/response_length" in h]
        params.append(({n: p.detach().clone() for n, p in trainer.unwrapped.named_parameters() if n in before},
                       before, lengths))
    (a, start, len_a), (b, _, len_b) = params
    assert len_a == len_b  # the same rollout in both runs
    moved = [n for n in a if not torch.equal(a[n], start[n])]
    assert moved
    for n in moved:
        torch.testing.assert_close(a[n], b[n], rtol=1e-5, atol=1e-6)


def test_a_one_output_head_is_accepted_whatever_the_config_says(make_trainer, make_models, tok):
    """A rule wrapped as a classifier on a LlamaConfig (num_labels defaults to 2) with a 1-output head."""
    policy, ref, value, reward = make_models(tok)
    reward.config.num_labels = 2
    assert reward.score.out_features == 1
    trainer = make_trainer(tok, model=policy, ref_model=ref, reward_model=reward, value_model=value,
                           total_episodes=4)
    trainer.train()
    assert trainer.state.global_step == 1


def test_temperature_zero_trains_near_greedily(make_trainer):
    trainer = make_trainer(temperature=0.0, total_episodes=4)
    trainer.train()
    log = trainer.state.log_history[-1]
    assert log["objective/kl"] == pytest.approx(0.0, abs=1e-3)  # greedy tokens: log-probs ~0 for both


def test_a_lora_adapter_on_the_embedding_trains(make_trainer, tok):
    """peft wraps a LoRA'd embedding in a module without `num_embeddings`; the rollout reads the rows
    of the wrapped embedding to pick an in-range pad id."""
    from trl_ppo_ext.models.actor_critic import SharedActorCritic

    model = SharedActorCritic(build_tiny_causal_lm(tok), lora_config=LoraConfig(
        r=4, lora_alpha=8, target_modules=["q_proj", "embed_tokens"], task_type="CAUSAL_LM"))
    trainer = make_trainer(tok, model=model, ref_model=None, reward_model=build_tiny_scorer(tok), value_model=None,
                           total_episodes=4)
    adapter = {n: p for n, p in trainer.unwrapped.named_parameters() if "lora_embedding" in n}
    assert adapter and all(p.requires_grad for p in adapter.values())  # the embedding's LoRA A and B train
    before = {n: p.detach().clone() for n, p in adapter.items()}
    trainer.train()
    assert trainer.state.global_step == 1
    moved = [n for n, p in adapter.items() if not torch.equal(p.detach(), before[n])]
    assert moved, "no weight of the embedding's LoRA adapter changed in the update"
    assert all(torch.isfinite(p).all() for p in adapter.values())


def test_the_trainer_warns_once_about_ignored_checkpoint_fields(make_trainer, make_models, tok, caplog):
    policy, ref, value, reward = make_models(tok)
    policy.generation_config.repetition_penalty = 1.05
    with caplog.at_level(logging.WARNING, logger="trl_ppo_ext"):  # generation_stop_ids says it
        make_trainer(tok, model=policy, ref_model=ref, reward_model=reward, value_model=value)
    messages = [r.getMessage() for r in caplog.records if "generation_config" in r.getMessage()]
    assert len(messages) == 1 and "repetition_penalty=1.05" in messages[0]
