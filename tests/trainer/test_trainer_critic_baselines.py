"""PPOTrainer runs with the critic's baselines: the explained-variance gate, the ``"gae_rloo"`` hybrid
and the length-adaptive lambda's floor and per-turn form, each through its PPOConfig field alone
(the trainer reads them through the estimator table)."""

import math

import pytest
import torch

from trl_ppo_ext.estimators import estimator_settings, estimator_targets

GATE_METRICS = ("train/gate_used_critic", "train/gate_explained_variance")


def _capture(trainer):
    seen = []
    original = trainer.compute_advantages
    trainer.compute_advantages = lambda rollout: seen.append((rollout, t := original(rollout))) or t
    return seen


def _logs(trainer):
    return [h for h in trainer.state.log_history if "objective/scores" in h]


@pytest.mark.parametrize("num_generations", [1, 2])
def test_the_gate_logs_which_baseline_each_update_used(make_trainer, assert_metrics, num_generations):
    trainer = make_trainer(num_generations=num_generations, critic_gate_explained_variance=0.0)
    seen = _capture(trainer)
    trainer.train()
    assert_metrics(trainer, 2)
    for log, (rollout, targets) in zip(_logs(trainer), seen):
        assert log["train/gate_used_critic"] in (0.0, 1.0) and math.isfinite(log["train/gate_explained_variance"])
        # the decision follows the EV measured before the update against the rollout's own returns
        assert log["train/gate_used_critic"] == float(log["train/gate_explained_variance"] > 0.0)
        assert log["train/gate_explained_variance"] == pytest.approx(log["val/explained_variance"], abs=1e-5)


def test_without_the_gate_nothing_new_is_logged(make_trainer):
    trainer = make_trainer()
    trainer.train()
    assert not set(GATE_METRICS) & set(_logs(trainer)[-1])


def _flat_critic(trainer):
    """Zero and freeze the value model's head: every value of every rollout is exactly 0."""
    heads = [p for n, p in trainer.unwrapped.named_parameters() if n.startswith("value_model.") and "score" in n]
    assert heads
    with torch.no_grad():
        for p in heads:
            p.zero_()
            p.requires_grad_(False)


def test_the_hybrid_with_a_zeroed_value_head_gives_rloos_advantages(make_trainer, assert_metrics):
    trainer = make_trainer(num_generations=2, advantage_estimator="gae_rloo", whiten_advantages=False)
    _flat_critic(trainer)
    seen = _capture(trainer)
    trainer.train()
    assert_metrics(trainer, 2)
    assert len(seen) == 2
    for rollout, targets in seen:
        assert (rollout.values[rollout.loss_mask] == 0).all()
        settings = {**estimator_settings(trainer.args), "advantage_estimator": "rloo"}
        rloo = estimator_targets(rollout, kl_coef=trainer.kl_controller.value, **settings)
        assert torch.equal(targets.advantages, rloo.advantages)


def test_the_hybrid_trains_its_critic(make_trainer, assert_metrics):
    trainer = make_trainer(num_generations=2, advantage_estimator="gae_rloo")
    before = {n: p.detach().clone() for n, p in trainer.unwrapped.named_parameters() if n.startswith("value_model.")}
    trainer.train()
    assert_metrics(trainer, 2)
    after = dict(trainer.unwrapped.named_parameters())
    assert any(not torch.equal(after[n], v) for n, v in before.items())


def test_the_lambda_floor_and_per_turn_lambda_run(make_trainer, assert_metrics):
    trainer = make_trainer(lam_length_alpha=1.5, lam_length_min=0.5, lam_length_per_turn=True, lam=0.95)
    trainer.train()
    assert_metrics(trainer, 2)
