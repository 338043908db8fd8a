"""PPOTrainer with several samples per prompt and the critic-free estimators (GRPO, RLOO, REINFORCE++)."""

import pytest
import torch
from peft import LoraConfig

from trl_ppo_ext.models.actor_critic import SharedActorCritic


def _value_names(module):
    return [n for n, _ in module.named_parameters() if "value" in n.lower() or "score" in n.lower()]


def _capture_rollouts(trainer):
    seen = []
    original = trainer.compute_advantages
    trainer.compute_advantages = lambda rollout: seen.append((rollout, t := original(rollout))) or t
    return seen


@pytest.mark.parametrize("estimator", ["grpo", "rloo", "reinforce_pp", "reinforce_pp_baseline"])
def test_a_critic_free_run_trains_no_value_parameter_anywhere(make_trainer, estimator):
    with pytest.warns(UserWarning, match="value"):  # a value model given anyway is unused, and said so
        trainer = make_trainer(num_generations=2, advantage_estimator=estimator)
    assert trainer.value_model is None and not trainer.unwrapped.has_value
    assert _value_names(trainer.unwrapped) == []
    optimized = {id(p) for group in trainer.optimizer.param_groups for p in group["params"]}
    assert optimized == {id(p) for p in trainer.unwrapped.policy.parameters()}
    before = {n: p.detach().clone() for n, p in trainer.unwrapped.policy.named_parameters()}
    trainer.train()
    logs = [h for h in trainer.state.log_history if "objective/scores" in h]
    assert len(logs) == 2
    for log in logs:
        assert not {"loss/value_avg", "val/clipfrac_avg", "val/explained_variance"} & set(log)
        assert {"reward_std", "frac_reward_zero_std"} <= set(log)
    after = dict(trainer.unwrapped.policy.named_parameters())
    assert any(not torch.equal(after[n], v) for n, v in before.items())


def test_num_generations_samples_each_prompt_on_adjacent_rows_and_counts_completions(make_trainer):
    trainer = make_trainer(num_generations=2, advantage_estimator="grpo", value_model=None, scale_rewards="group")
    assert trainer.local_dataloader_batch_size == 2  # 4 completions per rollout: 2 prompts, 2 samples each
    seen = _capture_rollouts(trainer)
    trainer.train()
    assert trainer.state.episode == 8 and trainer.args.batch_size == 4  # completions, as GRPO counts them
    for rollout, targets in seen:
        q, m = rollout.queries, rollout.query_mask
        assert torch.equal(q[0::2], q[1::2]) and torch.equal(m[0::2], m[1::2])  # the copies of a prompt
        assert not torch.equal(q[0], q[2])  # two prompts per batch of four
        # GRPO by hand: each sequence's score minus its pair's mean, over the pair's std (+1e-4) ...
        total = targets.scores.view(-1, 2)
        expected = ((total - total.mean(1, keepdim=True)) / (total.std(1, keepdim=True) + 1e-4)).view(-1)
        # ... on every token, plus the KL penalty from that token to the end (gamma 1), 0 off the mask
        mask = rollout.loss_mask
        penalty = targets.non_score_rewards.masked_fill(~mask, 0)
        to_go = penalty.flip(1).cumsum(1).flip(1).masked_fill(~mask, 0)
        assert torch.allclose(targets.advantages, torch.where(mask, expected[:, None], 0) + to_go, atol=1e-5)


def test_gae_with_several_samples_keeps_the_critic(make_trainer):
    trainer = make_trainer(num_generations=2)
    assert trainer.value_model is not None
    trainer.train()
    log = [h for h in trainer.state.log_history if "objective/scores" in h][-1]
    assert "loss/value_avg" in log and "frac_reward_zero_std" in log


def test_a_critic_free_shared_lora_model_has_no_value_head(make_trainer):
    lora = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], task_type="CAUSAL_LM")
    trainer = make_trainer(ref_model=None, value_model=None, peft_config=lora, num_generations=2,
                           advantage_estimator="rloo")
    assert isinstance(trainer.unwrapped, SharedActorCritic) and not trainer.unwrapped.has_value
    trainable = [n for n, p in trainer.unwrapped.named_parameters() if p.requires_grad]
    assert trainable and all("lora_" in n for n in trainable)
    trainer.train()


def test_a_batch_that_is_not_a_multiple_of_num_generations_names_both_fields(make_config):
    with pytest.raises(ValueError, match=r"num_generations.*per_device_train_batch_size|"
                                         r"per_device_train_batch_size.*num_generations"):
        make_config(per_device_train_batch_size=3, num_generations=2)


def test_group_estimators_compose_with_episodes_over_the_action_tokens(make_trainer):
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).parents[1] / "scripts"))
    from tiny_setup import two_turn_rollout

    from trl_ppo_ext.tiny import build_tiny_tokenizer

    tok = build_tiny_tokenizer()
    trainer = make_trainer(tok, num_generations=2, advantage_estimator="grpo", value_model=None,
                           rollout_func=two_turn_rollout(tok))
    seen = _capture_rollouts(trainer)
    trainer.train()
    for rollout, targets in seen:
        env = rollout.response_mask & ~rollout.action_mask
        assert env.any() and (targets.advantages[env] == 0).all()


# ---------------------------------------------------------------- unscorable rows (issue 40, case 2)
def _scripted_group(tok):
    """A rollout_func whose four completions of a prompt are w1..w4 then <eos>, and a reward that
    returns None for w2: one unscorable row per group, the same episodes for either trainer."""

    def rollout_func(prompts, trainer):
        return {"prompt_ids": [tok(p).input_ids for p in prompts],
                "completion_ids": [[7 + i % 4, 3] for i in range(len(prompts))], "logprobs": None}

    def reward(completion_ids, **kwargs):
        return [{7: 1.0, 8: None, 9: 0.0, 10: 0.0}[c[0]] for c in completion_ids]

    return rollout_func, reward


def test_an_unscorable_row_gets_trl_grpo_trainers_advantages(needs_trl_grpo, tmp_path):
    """TRL 1.16's GRPOTrainer itself on the same episodes: [1.155, 0, -0.577, -0.577] (ours were
    [1.5, -0.5, -0.5, -0.5] before issue 40: the unscored row scored 0 and joined the baseline)."""
    from datasets import Dataset
    from trl import GRPOConfig, GRPOTrainer

    from trl_ppo_ext import PPOConfig, PPOTrainer
    from trl_ppo_ext.tiny import build_tiny_causal_lm, build_tiny_tokenizer

    tok = build_tiny_tokenizer()
    policy = build_tiny_causal_lm(tok)
    rollout_func, reward = _scripted_group(tok)
    data = Dataset.from_list([{"prompt": "w1 w2"}, {"prompt": "w3 w4"}])
    common = dict(per_device_train_batch_size=4, num_generations=4, report_to="none", bf16=False, save_strategy="no")
    grpo = GRPOTrainer(model=policy, reward_funcs=[reward], processing_class=tok, train_dataset=data,
                       rollout_func=rollout_func, args=GRPOConfig(output_dir=str(tmp_path / "g"), beta=0.0,
                                                                  max_completion_length=4, use_cpu=True, **common))
    theirs = grpo._generate_and_score_completions([{"prompt": "w1 w2"} for _ in range(4)])["advantages"]
    torch.testing.assert_close(theirs, torch.tensor([1.1545, 0.0, -0.5773, -0.5773]), rtol=0, atol=1e-4)

    trainer = PPOTrainer(model=policy, reward_funcs=[reward], processing_class=tok, train_dataset=data,
                         rollout_func=rollout_func, args=PPOConfig(
                             output_dir=str(tmp_path / "p"), advantage_estimator="grpo", kl_coef=0.0, response_length=4,
                             total_episodes=4, num_mini_batches=1, local_rollout_forward_batch_size=4, **common))
    rollout = trainer.score_rollout(trainer.generate_rollout(trainer.repeated_prompts(next(iter(trainer.dataloader)))))
    ours = trainer.compute_advantages(rollout).advantages
    torch.testing.assert_close(ours[:, 0], theirs.to(ours), rtol=0, atol=1e-6)
    assert torch.equal(ours[:, 0], ours[:, 1]) and (ours[:, 2:] == 0).all()  # on both action tokens, 0 after
    trainer.train()  # one update of one group: the unscored row is counted
    assert [h["rewards/unscored"] for h in trainer.state.log_history if "rewards/unscored" in h] == [1.0]


def test_an_unscored_row_gives_the_critic_no_gradient(make_trainer):
    """GAE: the row's returns are its old values, and its value has no gradient (no made-up target)."""
    from trl_ppo_ext.tiny import build_tiny_tokenizer

    rollout_func, reward = _scripted_group(build_tiny_tokenizer())
    trainer = make_trainer(num_generations=4, reward_model=None, reward_funcs=[reward], rollout_func=rollout_func,
                           value_model=None)
    batch = trainer.repeated_prompts(next(iter(trainer.dataloader)))
    rollout = trainer.score_rollout(trainer.generate_rollout(batch))
    targets = trainer.compute_advantages(rollout)
    unscored = ~rollout.reward_applies.any(1)
    assert unscored.tolist() == [False, True, False, False] * (rollout.batch_size // 4)
    assert (targets.advantages[unscored] == 0).all()
    assert torch.equal(targets.returns[unscored], rollout.values[unscored])
    grads = {}
    for rows in (unscored.nonzero()[:, 0], (~unscored).nonzero()[:, 0]):
        trainer.model.zero_grad()
        loss, _ = trainer.compute_loss_terms(rollout.select(rows), targets.select(rows))
        loss.backward()
        head = [p.grad for n, p in trainer.unwrapped.named_parameters() if "value" in n and p.grad is not None]
        grads[len(grads)] = sum(float(g.abs().sum()) for g in head)
    assert grads[0] == 0.0 and grads[1] > 0.0
