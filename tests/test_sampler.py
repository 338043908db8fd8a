"""EpochSeededSampler: the shuffle order is a pure function of (seed, epoch)."""

import torch

from trl_ppo_ext.sampler import EpochSeededSampler


def test_order_is_a_permutation_fixed_by_seed_and_epoch():
    s = EpochSeededSampler(10, seed=3)
    first = list(s)
    assert sorted(first) == list(range(10))
    assert list(s) == first  # iterating again without a new epoch repeats the order
    assert first == torch.randperm(10, generator=torch.Generator().manual_seed(3)).tolist()
    s.set_epoch(1)
    second = list(s)
    assert second == torch.randperm(10, generator=torch.Generator().manual_seed(4)).tolist()
    assert second != first


def test_order_does_not_touch_the_global_rng():
    state = torch.random.get_rng_state()
    list(EpochSeededSampler(5, seed=0))
    assert torch.equal(torch.random.get_rng_state(), state)


def test_without_shuffling_every_epoch_is_the_datasets_order():
    """PPOConfig.shuffle_dataset=False (TRL GRPO's field): the prompts in their order."""
    s = EpochSeededSampler(5, seed=3, shuffle=False)
    assert list(s) == [0, 1, 2, 3, 4]
    s.set_epoch(2)
    assert list(s) == [0, 1, 2, 3, 4] and len(s) == 5
    assert list(EpochSeededSampler(5, seed=3)) != [0, 1, 2, 3, 4]  # the default shuffles (seed 3: a permutation)
