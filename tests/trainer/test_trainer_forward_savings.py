"""No scoring forward the update does not read (issue 42, ``scoring_plan``): no reference where no KL is
read (none built either), and no old-log-prob forward where the update is on-policy -- the update's
first forward is pi_old, the first ratio exactly 1 and the gradient the one the extra forward gave."""

import dataclasses

import pytest
import torch
from peft import LoraConfig

from trl_ppo_ext.scoring_plan import ScoringPlan

GRPO = dict(advantage_estimator="grpo", num_generations=2, kl_coef=0.0)


def _count_forwards(trainer):
    calls = {"policy": 0, "reference": 0, "critic": 0}
    for hook, key in (("policy_logprobs_and_values", "policy"), ("reference_logprobs", "reference"),
                      ("critic_values", "critic")):
        original = getattr(trainer, hook)

        def counted(*args, _original=original, _key=key, **kwargs):
            calls[_key] += 1
            return _original(*args, **kwargs)

        setattr(trainer, hook, counted)  # an instance attribute: the class's hooks stay the trainer's own
    return calls


def _logs(trainer):
    return [h for h in trainer.state.log_history if "objective/scores" in h]


LORA = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], task_type="CAUSAL_LM")
VALUE_ADAPTER = dict(value_model=None, use_value_adapter=True, peft_config=LORA)


@pytest.mark.parametrize("overrides, policy_forwards, critic_forwards, reference", [
    (GRPO, 0, 0, False),  # critic-free, kl 0, one epoch, one mini-batch: neither forward
    ({**GRPO, "num_ppo_epochs": 2}, 1, 0, False),  # two optimizer steps: the second one's pi_old is not its own
    ({**GRPO, "num_mini_batches": 2}, 1, 0, False),
    ({**GRPO, "kl_coef": 0.05}, 1, 0, True),  # the KL penalty reads both
    ({**GRPO, "kl_max": 50.0}, 1, 0, True),  # a KL guard the user asked for
    ({"kl_coef": 0.0}, 0, 1, False),  # a separate value model: its pass alone gives V; no reference
    ({"kl_coef": 0.0, **VALUE_ADAPTER}, 0, 1, False),  # a value adapter: the same
    ({"kl_coef": 0.0, "value_model": None, "peft_config": VALUE_ADAPTER["peft_config"]}, 1, 0, False),  # shared head
    ({"kl_coef": 0.0, **VALUE_ADAPTER, "num_ppo_epochs": 2}, 1, 0, False),
], ids=["grpo_kl0", "two_epochs", "two_mini_batches", "kl_penalty", "kl_guard", "value_model_kl0",
        "value_adapter_kl0", "shared_head_kl0", "value_adapter_two_epochs"])
def test_the_scoring_forwards_run_only_where_read(make_trainer, tok, overrides, policy_forwards, critic_forwards,
                                                  reference):
    trainer = make_trainer(tok, ref_model=None, total_episodes=8, **overrides)  # a full fine-tune: no adapter
    calls = _count_forwards(trainer)
    trainer.train()
    updates = len(_logs(trainer))
    assert updates == 2
    assert calls == {"policy": policy_forwards * updates, "reference": updates if reference else 0,
                     "critic": critic_forwards * updates}
    assert (trainer.ref_model is not None) == reference  # no copy of the policy is made for nothing
    assert all(("objective/kl" in h) == reference for h in _logs(trainer))  # the KL is logged where computed
    if policy_forwards == 0:  # the rollout's pi_old is the update's forward: the first ratio is exactly 1
        assert all(h["val/ratio"] == 1.0 for h in _logs(trainer))
        assert all(h["policy/approxkl_avg"] == 0.0 for h in _logs(trainer))
        assert all(h["objective/entropy"] > 0 for h in _logs(trainer))  # -log pi_old of the sampled tokens


def test_on_policy_gradient_equals_the_scored_one(make_trainer, tok):
    trainer = make_trainer(tok, ref_model=None, per_device_train_batch_size=8, **GRPO)
    assert trainer.scoring == ScoringPlan(reference=False, old_logprobs=False)
    sample = trainer.generate_rollout(trainer.repeated_prompts(next(iter(trainer.dataloader))))
    params = [p for p in trainer.unwrapped.parameters() if p.requires_grad]
    results = {}
    for old_logprobs in (True, False):  # True: today's separate scoring forward
        trainer.scoring = ScoringPlan(reference=False, old_logprobs=old_logprobs)
        rollout = trainer.score_rollout(sample)
        adv = trainer.compute_advantages(rollout)
        loss, stats = trainer.compute_loss_terms(rollout, adv)
        first = stats.pop("_first_logprobs", None)
        results[old_logprobs] = (rollout, adv, torch.autograd.grad(loss, params), stats, first)
    (scored, adv_scored, grads_scored, stats_scored, _), (_, adv_fresh, grads_fresh, stats_fresh, first) = (
        results[True], results[False])
    assert torch.equal(adv_scored.advantages, adv_fresh.advantages)  # nothing before the update read pi_old
    assert stats_fresh["ratio_mean"].item() == 1.0 and stats_fresh["ratio_max"].item() == 1.0  # exactly
    assert abs(stats_scored["ratio_max"].item() - 1.0) < 1e-5  # two forwards: 1 up to their rounding
    torch.testing.assert_close(first, scored.logprobs, rtol=0, atol=1e-5)  # the update's forward is pi_old
    for g_scored, g_fresh in zip(grads_scored, grads_fresh):
        torch.testing.assert_close(g_fresh, g_scored, rtol=0, atol=1e-7)


def test_the_critics_pass_alone_gives_the_values_of_the_whole_forward(make_trainer, tok):
    from trl_ppo_ext.models.values import has_values_alone, value_forward

    trainer = make_trainer(tok, ref_model=None, kl_coef=0.0, **VALUE_ADAPTER)
    model = trainer.unwrapped
    assert has_values_alone(model) and trainer.scoring == ScoringPlan(reference=False, old_logprobs=False)
    ids = torch.tensor([[4, 6, 7, 8, 3, 5], [0, 0, 4, 9, 3, 5]])
    mask = (ids != 0).long()
    positions = (mask.cumsum(1) - 1).clamp(min=0)
    with torch.no_grad():
        _, values = model(ids, mask, positions, logits_to_keep=3)
        torch.testing.assert_close(value_forward(model, ids, mask, positions, keep=3), values, rtol=0, atol=0)


@pytest.mark.parametrize("overrides", [GRPO, {"kl_coef": 0.0, **VALUE_ADAPTER}], ids=["grpo", "value_adapter"])
def test_an_on_policy_run_with_accumulation_across_epoch_ends_ends_where_the_scored_run_ends(
        make_trainer, make_prompts, tok, overrides):
    """Micro-batches accumulated into the one mini-batch (gradient_accumulation_steps=2) and a dataset
    of 4 prompts read over 3 updates of 2 prompts (epoch ends inside the run): the run without the
    old-log-prob forward ends at the weights of the run that computes it, to the rounding of two
    forwards (the ratio is 1 either way; only its last bits differ)."""
    finals, logs = [], []
    for old_logprobs in (False, True):
        trainer = make_trainer(tok, ref_model=None, train_dataset=make_prompts(tok, n=4), total_episodes=12,
                               per_device_train_batch_size=2, gradient_accumulation_steps=2, **overrides)
        assert trainer.scoring.old_logprobs is False  # the plan skips it; the second run forces it back
        trainer.scoring = dataclasses.replace(trainer.scoring, old_logprobs=old_logprobs)
        trainer.train()
        finals.append([p.detach().clone() for p in trainer.unwrapped.parameters() if p.requires_grad])
        logs.append(_logs(trainer))
    assert len(logs[0]) == len(logs[1]) == 3
    assert all(h["val/ratio"] == 1.0 for h in logs[0])  # the update's own forward is pi_old: exactly 1
    assert all(abs(h["val/ratio"] - 1.0) < 1e-5 for h in logs[1])
    for fresh, scored in zip(*finals):
        torch.testing.assert_close(fresh, scored, rtol=0, atol=1e-5)
    assert [h["objective/scores"] for h in logs[0]] == [h["objective/scores"] for h in logs[1]]  # same episodes
