"""A token-classification process reward model passed to the trainer as ``reward_model`` (or
among ``reward_funcs``), TRL PRMTrainer's conventions, ``PPOConfig.step_separator``: its step
scores land on the separator tokens (returns at gamma = lam = 1, kl_coef = 0 by hand)."""

import math
from dataclasses import replace

import pytest
import torch
from transformers import LlamaForSequenceClassification, LlamaForTokenClassification

from trl_ppo_ext.rewards.process import ProcessRewardModel
from trl_ppo_ext.tiny import build_tiny_tokenizer, tiny_llama_config


def constant_prm(tok, p_good=0.75):
    """A tiny Llama token classifier whose P(label 1) is ``p_good`` at every token (head weights
    0, biases 0 and log(p / (1 - p)))."""
    torch.manual_seed(0)
    model = LlamaForTokenClassification(tiny_llama_config(tok, num_labels=2))
    with torch.no_grad():
        model.score.weight.zero_()
        model.score.bias.copy_(torch.tensor([0.0, math.log(p_good / (1 - p_good))]))
    return model


def hand_returns(ids, special, separator, p):
    """Per token: ``p`` on every separator, and on the last token for a final step without one;
    returns at gamma = lam = 1 with values 0 are the suffix sums."""
    per_token = [p if i == separator else 0.0 for i in ids]
    words = [k for k, i in enumerate(ids) if i not in special]
    if words and ids[words[-1]] != separator:
        per_token[-1] += p
    return per_token, [sum(per_token[k:]) for k in range(len(ids))]


@pytest.mark.parametrize("form", ["reward_model", "model in reward_funcs", "ProcessRewardModel in reward_funcs"])
def test_a_token_classifier_reward_scores_each_step_on_its_separator(make_trainer, form):
    """P(good) = 0.75 at every token; gamma = lam = 1, kl_coef = 0, values 0: the return at token
    k is 0.75 times the number of scored steps at or after k (every separator w0, and a final
    step without one on the last token), whichever way the PRM is given."""
    tok = build_tiny_tokenizer(["w0", "w1", "w2"])  # w0 = 6, the separator
    prm = constant_prm(tok)
    wrapped = ProcessRewardModel(prm, tok, step_separator="w0")
    assert wrapped.text_tokenizer is None  # built here: no path to load from, the ids fit: the id path
    given = {"reward_model": dict(reward_model=prm),
             "model in reward_funcs": dict(reward_model=None, reward_funcs=[prm]),
             "ProcessRewardModel in reward_funcs": dict(reward_model=None, reward_funcs=[wrapped])}[form]
    trainer = make_trainer(tok, **given, step_separator="w0", gamma=1.0, lam=1.0, kl_coef=0.0, whiten_rewards=False,
                           missing_eos_penalty=None, total_episodes=8, response_length=8)
    source = trainer.rewards[0].source
    assert isinstance(source, ProcessRewardModel) and source.model is prm
    assert (trainer.reward_model is prm) == (form == "reward_model")  # TRL's attribute: the model itself
    rollout = trainer.score_rollout(trainer.generate_rollout(next(iter(trainer.dataloader))))
    rollout = replace(rollout, values=torch.zeros_like(rollout.values))
    targets = trainer.compute_advantages(rollout)
    separators = 0
    for b, m in enumerate(rollout.response_mask):
        ids = rollout.responses[b, m].tolist()
        separators += ids.count(6)
        per_token, suffix = hand_returns(ids, set(tok.all_special_ids), 6, 0.75)
        torch.testing.assert_close(rollout.token_rewards[b, m], torch.tensor(per_token), rtol=0, atol=1e-6)
        torch.testing.assert_close(targets.returns[b, m], torch.tensor(suffix), rtol=0, atol=1e-5)
    assert separators >= 2 and rollout.scores.eq(0).all()  # seeded: the check above met separators
    trainer.train()
    assert all(not p.requires_grad for p in prm.parameters())  # frozen, as a reward model
    logs = [h for h in trainer.state.log_history if "objective/scores" in h]
    assert len(logs) == 2 and all(f"rewards/{trainer.rewards[0].name}/mean" in h for h in logs)


def test_a_prm_of_another_vocabulary_takes_its_reward_processing_class(make_trainer):
    policy = build_tiny_tokenizer(["w0", "w1", "w2"])
    theirs = build_tiny_tokenizer(["w2", "w1", "w0"])
    trainer = make_trainer(policy, reward_model=constant_prm(theirs), reward_processing_classes=[theirs],
                           step_separator="w0", total_episodes=8)
    assert trainer.rewards[0].source.text_tokenizer is theirs and trainer.rewards[0].source.separator_ids == [8]


def test_the_separator_must_be_in_the_vocabulary_and_sequence_heads_stay_scalar(make_trainer):
    tok = build_tiny_tokenizer(["w0", "w1", "w2"])
    with pytest.raises(ValueError, match=r"step_separator='\\n' encodes to \[\]"):
        make_trainer(tok, reward_model=constant_prm(tok), total_episodes=8)  # the default "\n"
    two = LlamaForSequenceClassification(tiny_llama_config(tok, num_labels=2))
    with pytest.raises(ValueError, match=r"`reward_model`'s score head has 2 outputs"):
        make_trainer(tok, reward_model=two, total_episodes=8)
