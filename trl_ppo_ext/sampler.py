"""A shuffling sampler whose order is a pure function of (seed, epoch).

``torch.utils.data.RandomSampler`` draws its permutation from a generator whose state
moves with every epoch, so a resumed run cannot re-create "epoch 3, batch 5" without
replaying everything before it. Here epoch ``e``'s order is ``randperm(n)`` from a fresh
generator seeded with ``seed + e``: a resumed run sets the epoch and skips the batches it
already consumed, and gets the same prompts in the same order. Every process builds the
same permutation; accelerate's batch-sampler sharding then gives each process its share.

Example:

>>> from trl_ppo_ext.sampler import EpochSeededSampler
>>> sampler = EpochSeededSampler(4, seed=0)
>>> sorted(sampler), list(sampler) == list(sampler)  # a permutation, the same for the same epoch
([0, 1, 2, 3], True)
"""

from __future__ import annotations

import torch
from torch.utils.data import Sampler


class EpochSeededSampler(Sampler[int]):
    """Indices ``0..n-1`` in the order ``randperm(n, generator=manual_seed(seed + epoch))``;
    with ``shuffle=False`` (TRL GRPO's ``shuffle_dataset=False``) in the dataset's order, every epoch."""

    def __init__(self, num_samples: int, seed: int, shuffle: bool = True) -> None:
        if num_samples < 1:
            raise ValueError(f"EpochSeededSampler needs at least one sample, got num_samples={num_samples}.")
        self.num_samples, self.seed, self.epoch, self.shuffle = num_samples, seed, 0, shuffle

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def __iter__(self):
        if not self.shuffle:
            return iter(range(self.num_samples))
        generator = torch.Generator().manual_seed(self.seed + self.epoch)
        return iter(torch.randperm(self.num_samples, generator=generator).tolist())

    def __len__(self) -> int:
        return self.num_samples
