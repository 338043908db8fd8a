"""The batch plan: sizes computed by hand, TRL's derived config fields, and a sweep over the
configurations TRL accepts that counts real optimizer steps per update (one per mini-batch
per PPO epoch, across epoch ends of the prompt loader, with and without an eval set)."""

from types import SimpleNamespace

import pytest

from trl_ppo_ext.batching import BatchPlan, check_local_batch
from trl_ppo_ext.tiny import build_tiny_tokenizer


def _args(per_device, ga, nmb, epochs=1, total=None, num_train_epochs=1.0):
    return SimpleNamespace(per_device_train_batch_size=per_device, gradient_accumulation_steps=ga,
                           num_mini_batches=nmb, num_ppo_epochs=epochs, total_episodes=total,
                           num_train_epochs=num_train_epochs)


def test_plan_sizes_by_hand():
    # per-device 4, accumulation 3, 2 mini-batches, 2 processes, 50 episodes
    plan = BatchPlan.from_config(_args(4, 3, 2, epochs=2, total=50), world_size=2, dataset_len=100)
    assert plan.local_batch_size == 12  # 4 * 3
    assert plan.batch_size == 24  # 12 * 2 processes
    assert plan.local_mini_batch_size == 6  # 12 / 2
    assert plan.mini_batch_size == 12  # 6 * 2
    assert plan.local_micro_batch_size == 4  # min(4, 6)
    assert plan.micro_batch_size == 8  # TRL's: per-device 4 * 2 processes
    assert plan.micro_batches_per_mini_batch == 2  # rows 0-3 and 4-5
    assert [(s.start, s.stop) for s in plan.micro_batch_slices()] == [(0, 4), (4, 6)]
    assert [(s.start, s.stop) for s in plan.mini_batch_slices()] == [(0, 6), (6, 12)]
    assert plan.num_total_batches == 3  # ceil(50 / 24)
    assert plan.optimizer_steps_per_update == 4  # 2 mini-batches * 2 epochs


def test_a_mini_batch_smaller_than_the_per_device_size_is_one_micro_batch():
    # TRL accepts per-device 8, no accumulation, 2 mini-batches: its micro-batches have 4 rows
    plan = BatchPlan.from_config(_args(8, 1, 2, total=16), world_size=1, dataset_len=16)
    assert (plan.local_mini_batch_size, plan.local_micro_batch_size, plan.micro_batches_per_mini_batch) == (4, 4, 1)


def test_total_episodes_unset_means_epochs_over_the_dataset():
    plan = BatchPlan.from_config(_args(2, 2, 1, num_train_epochs=2.5), world_size=1, dataset_len=10)
    assert (plan.total_episodes, plan.num_total_batches) == (25, 7)  # int(2.5 * 10); ceil(25 / 4)


@pytest.mark.parametrize("max_steps, total, expected_updates", [(-1, 50, 5), (0, 50, 5), (4, 50, 4), (2, None, 2)])
def test_max_steps_counts_updates_and_wins_over_total_episodes(max_steps, total, expected_updates):
    # batch 2 * 3 * 2 processes = 12 completions per update; 50 episodes = ceil(50 / 12) = 5 updates
    # without max_steps; with it, max_steps updates of 12 (transformers: max_steps wins over epochs);
    # total_episodes=None with 100 prompts and 1 epoch would be ceil(100 / 12) = 9 updates
    args = SimpleNamespace(**vars(_args(2, 3, 1, total=total)), max_steps=max_steps)
    plan = BatchPlan.from_config(args, world_size=2, dataset_len=100)
    expected_total = 50 if max_steps <= 0 else 12 * max_steps
    assert (plan.num_total_batches, plan.total_episodes) == (expected_updates, expected_total)


def test_fill_config_writes_trl_derived_fields():
    args = _args(4, 2, 2, total=32)
    BatchPlan.from_config(args, world_size=2, dataset_len=64).fill_config(args)
    assert (args.local_batch_size, args.batch_size, args.local_mini_batch_size, args.mini_batch_size,
            args.micro_batch_size, args.num_total_batches, args.world_size) == (8, 16, 4, 8, 8, 2, 2)


@pytest.mark.parametrize("kwargs, message", [
    (dict(per_device=2, ga=2, nmb=3), r"num_mini_batches=3 does not divide .* = 2 \* 2 = 4"),
    (dict(per_device=0, ga=1, nmb=1), "per_device_train_batch_size must be >= 1, got 0"),
    (dict(per_device=2, ga=1, nmb=1, total=0), "total_episodes=0 gives no update"),
])
def test_plan_errors_name_the_setting(kwargs, message):
    with pytest.raises(ValueError, match=message):
        BatchPlan.from_config(_args(**kwargs), world_size=1, dataset_len=8)


# (per_device, grad_accum, num_mini_batches, num_ppo_epochs, prompts, eval prompts)
SWEEP = [
    (1, 4, 1, 1, 8, 0),  # the case: the loader's last batch every 2nd update
    (1, 4, 1, 1, 4, 0),  # an epoch end every update
    (1, 4, 1, 1, 16, 4),  # with an eval set whose loop leaves the loader registered
    (8, 1, 2, 1, 8, 0),  # micro-batch of 4 inside a per-device 8 (TRL accepts it)
    (4, 3, 2, 1, 12, 0),  # uneven micro-batches 4 + 2
    (2, 2, 2, 2, 8, 4),
    (2, 4, 4, 1, 8, 0),
    (1, 2, 2, 3, 6, 0),  # epoch end mid-run, 3 PPO epochs
]


@pytest.mark.slow
@pytest.mark.parametrize("per_device, ga, nmb, epochs, prompts, eval_prompts", SWEEP)
def test_one_optimizer_step_per_mini_batch_per_epoch(make_trainer, make_prompts, record_optimizer_steps,
                                                    per_device, ga, nmb, epochs, prompts, eval_prompts):
    tok = build_tiny_tokenizer(pad_equals_eos=True)
    updates = 4
    extra = dict(eval_strategy="steps", eval_steps=1, num_sample_generations=2) if eval_prompts else {}
    trainer = make_trainer(
        tok, per_device_train_batch_size=per_device, gradient_accumulation_steps=ga, num_mini_batches=nmb,
        num_ppo_epochs=epochs, total_episodes=updates * per_device * ga, response_length=3,
        local_rollout_forward_batch_size=8, **extra,
        train_dataset=make_prompts(tok, n=prompts),
        eval_dataset=make_prompts(tok, n=eval_prompts, seed=1) if eval_prompts else None,
    )
    steps = record_optimizer_steps(trainer)
    trainer.train()
    assert steps == [nmb * epochs] * updates


def test_groups_are_in_the_plan_prompts_per_batch_and_episodes_per_epoch():
    # 4 * 2 = 8 rows per process, 4 samples per prompt: 2 prompts per batch; 10 prompts -> 40 episodes an epoch
    plan = BatchPlan.from_config(SimpleNamespace(**vars(_args(4, 2, 2, total=None)), num_generations=4),
                                 world_size=1, dataset_len=10)
    assert plan.prompts_per_batch == 2 and plan.episodes_per_epoch(10) == 40
    assert plan.total_episodes == 40  # num_train_epochs=1 over 10 prompts, 4 episodes each
    plan.check_dataset(2)
    with pytest.raises(ValueError, match=r"has 1 prompts, fewer than one rollout batch .* = 2\)"):
        plan.check_dataset(1)


def test_both_divisibility_rules_read_the_same_per_process_batch():
    check_local_batch(3, 2, num_generations=3, num_mini_batches=2)  # 6 rows: 3 and 2 divide
    with pytest.raises(ValueError, match=r"num_generations=4 does not divide .* = 3 \* 2 = 6"):
        check_local_batch(3, 2, num_generations=4, num_mini_batches=2)
    with pytest.raises(ValueError, match=r"num_mini_batches=4 does not divide .* = 3 \* 2 = 6"):
        check_local_batch(3, 2, num_generations=3, num_mini_batches=4)
