"""PPOConfig.critic_lr_multiplier: the critic's parameters in optimizer groups of their own, at
``learning_rate`` times the multiplier through the schedule, checked on the groups and on the step
AdamW takes (its first step moves each weight by about ``lr`` whatever the gradient's size)."""

import math

import pytest
import torch

from trl_ppo_ext import PPOConfig
from trl_ppo_ext.critic_warmup import is_critic_parameter


def _lrs(trainer):
    """{id(param): lr} over the optimizer's groups."""
    return {id(p): g["lr"] for g in trainer.optimizer.param_groups for p in g["params"]}


def test_the_critics_groups_run_at_the_multiplied_rate_through_the_schedule(make_trainer):
    trainer = make_trainer(critic_lr_multiplier=4.0, learning_rate=1e-3, lr_scheduler_type="linear",
                           warmup_steps=2, total_episodes=16)
    named = dict(trainer.unwrapped.named_parameters())
    critic = {id(p) for n, p in named.items() if p.requires_grad and is_critic_parameter(trainer.unwrapped, n)}
    policy = {id(p) for n, p in named.items() if p.requires_grad and not is_critic_parameter(trainer.unwrapped, n)}
    assert critic and policy
    for _ in range(3):  # warm-up, then decay: the ratio holds at every step
        lrs = _lrs(trainer)
        assert set(lrs) == critic | policy  # every trainable parameter once
        policy_lr = {lrs[i] for i in policy}
        assert len(policy_lr) == 1 and {lrs[i] for i in critic} == {4.0 * policy_lr.pop()}
        trainer.lr_scheduler.step()


def test_the_first_adamw_step_moves_the_critic_by_the_multiple(make_trainer, tok):
    moves = {}
    for multiplier in (1.0, 3.0):
        trainer = make_trainer(tok, critic_lr_multiplier=multiplier, learning_rate=1e-3, total_episodes=4,
                               weight_decay=0.0)
        before = {n: p.detach().clone() for n, p in trainer.unwrapped.named_parameters() if p.requires_grad}
        trainer.train()  # one update, one optimizer step
        moves[multiplier] = {n: (p.detach() - before[n]).abs().max().item()
                             for n, p in trainer.unwrapped.named_parameters() if n in before}
    checked = {1.0: 0, 3.0: 0}
    for name, move in moves[1.0].items():
        if move < 1e-6:  # a weight no gradient reached
            continue
        expected = 3.0 if is_critic_parameter(trainer.unwrapped, name) else 1.0
        assert math.isclose(moves[3.0][name] / move, expected, rel_tol=1e-3), name
        checked[expected] += 1
    assert checked[1.0] > 0 and checked[3.0] > 0  # the policy's weights and the critic's both moved


def test_an_optimizer_passed_in_is_left_as_it_is(make_trainer, make_models, tok):
    policy, ref, value, reward = make_models(tok)
    model_params = list(policy.parameters()) + list(value.parameters())
    optimizer = torch.optim.SGD(model_params, lr=0.1)
    trainer = make_trainer(tok, model=policy, ref_model=ref, value_model=value, reward_model=reward,
                           optimizers=(optimizer, None), critic_lr_multiplier=4.0)
    assert len(trainer.optimizer.param_groups) == 1 and trainer.optimizer.param_groups[0]["lr"] == 0.1


@pytest.mark.parametrize("value", [0.0, -1.0, float("nan"), float("inf")])
def test_a_multiplier_that_is_not_a_positive_number_is_refused(tmp_path, value):
    with pytest.raises(ValueError, match="critic_lr_multiplier must be a finite number > 0"):
        PPOConfig(output_dir=str(tmp_path), critic_lr_multiplier=value, report_to=[])
