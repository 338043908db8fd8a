"""Batch arithmetic of a PPO run, in one place: what a rollout, a mini-batch and a
micro-batch are, computed once from the config and the number of processes.

Vocabulary (TRL's): one *update* samples a rollout batch of ``batch_size`` rows, or episodes
(``local_batch_size`` per process): ``prompts_per_batch`` prompts per process, each sampled
``num_generations`` times on adjacent rows (a group); it trains ``num_ppo_epochs`` passes over it, each pass cut
into ``num_mini_batches`` shuffled mini-batches; every mini-batch is one optimizer step,
its gradient accumulated over micro-batches of at most ``per_device_train_batch_size``
rows (the forward/backward size).

TRL 1.12 accepts any configuration where ``num_mini_batches`` divides the rollout batch;
a micro-batch is then ``per_device_train_batch_size`` rows or what is left of the
mini-batch (e.g. per-device 8, one step of accumulation, 2 mini-batches: micro-batches of
4; per-device 4 with mini-batches of 6: micro-batches of 4 and 2). The loss is normalised
by the valid-token count of the whole mini-batch, so uneven micro-batches weigh right.

Which rows share a micro-batch (:func:`micro_batch_rows`): by default the
mini-batch's rows sorted by length and cut into the configured micro-batches (same count
and sizes), or, with ``max_tokens_per_micro_batch``, into as many micro-batches as a token
budget needs. Neither changes the mini-batch's loss or gradient beyond float summation
order, since every micro-batch's token sums are divided by the whole mini-batch's count.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

import torch


def check_local_batch(per_device_train_batch_size: int, gradient_accumulation_steps: int, *,
                      num_generations: int | None = None, num_mini_batches: int | None = None) -> None:
    """Both rules on the per-process rollout batch ``per_device_train_batch_size * gradient_accumulation_steps``
    (rows): ``num_generations`` divides it (a prompt's copies stay on one process), and ``num_mini_batches``
    does (equal mini-batches). A rule whose number is None is not checked. Raises ``ValueError`` naming both.

    >>> check_local_batch(4, 2, num_generations=4, num_mini_batches=2)  # 8 rows: both divide
    """
    local = per_device_train_batch_size * gradient_accumulation_steps
    if num_generations is not None and local % num_generations:
        raise ValueError(
            f"PPOConfig.num_generations={num_generations} does not divide the per-process rollout batch "
            f"per_device_train_batch_size * gradient_accumulation_steps = {per_device_train_batch_size} * "
            f"{gradient_accumulation_steps} = {local}: the copies of a prompt stay on one process. Make "
            f"the rollout batch a multiple of {num_generations}, or change num_generations."
        )
    if num_mini_batches is not None and local % num_mini_batches:
        raise ValueError(
            f"num_mini_batches={num_mini_batches} does not divide the per-process rollout batch "
            f"per_device_train_batch_size * gradient_accumulation_steps = {per_device_train_batch_size} * "
            f"{gradient_accumulation_steps} = {local}. Choose num_mini_batches among the "
            f"divisors of {local}, or change the batch sizes."
        )


@dataclass(frozen=True)
class BatchPlan:
    """The sizes of one PPO run. Sizes count rows (episodes: one sampled response each), not tokens;
    ``prompts_per_batch`` and the dataset count prompts, each giving ``num_generations`` rows.

    Build with :meth:`from_config`; every field is derived there and never stored twice.
    """

    per_device_train_batch_size: int
    gradient_accumulation_steps: int
    num_mini_batches: int
    num_ppo_epochs: int
    world_size: int
    total_episodes: int
    num_generations: int = 1

    @classmethod
    def from_config(cls, args, world_size: int, dataset_len: int) -> "BatchPlan":
        """The plan for ``args`` (a ``PPOConfig``) on ``world_size`` processes.

        ``dataset_len`` counts prompts. ``total_episodes=None`` means ``num_train_epochs`` passes over
        them, each prompt ``num_generations`` episodes (TRL's rule, :meth:`episodes_per_epoch`).
        ``max_steps > 0`` (transformers' field, default -1) counts updates and wins over both, as it
        wins over ``num_train_epochs`` in every transformers trainer: ``total_episodes = max_steps *
        batch_size``. Raises ``ValueError`` naming the setting to change when ``num_generations`` or
        ``num_mini_batches`` does not divide the per-process rollout batch (:func:`check_local_batch`),
        or when no update would run.
        """
        num_generations = int(getattr(args, "num_generations", 1))
        total = args.total_episodes
        if total is None:
            total = int(args.num_train_epochs * (dataset_len * num_generations))
        plan = cls(
            per_device_train_batch_size=int(args.per_device_train_batch_size),
            gradient_accumulation_steps=int(args.gradient_accumulation_steps),
            num_mini_batches=int(args.num_mini_batches),
            num_ppo_epochs=int(args.num_ppo_epochs),
            world_size=int(world_size),
            total_episodes=int(total),
            num_generations=num_generations,
        )
        max_steps = int(getattr(args, "max_steps", -1) or -1)
        if max_steps > 0:
            plan = dataclasses.replace(plan, total_episodes=max_steps * plan.batch_size)
        plan._check()
        return plan

    def _check(self) -> None:
        for name in ("per_device_train_batch_size", "gradient_accumulation_steps", "num_mini_batches",
                     "num_ppo_epochs", "world_size"):
            if getattr(self, name) < 1:
                where = "the number of processes" if name == "world_size" else f"PPOConfig.{name}"
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}: set {where} to a positive integer.")
        check_local_batch(self.per_device_train_batch_size, self.gradient_accumulation_steps,
                          num_generations=self.num_generations, num_mini_batches=self.num_mini_batches)
        if self.total_episodes < 1:
            raise ValueError(
                f"total_episodes={self.total_episodes} gives no update; set total_episodes >= batch_size "
                f"({self.batch_size}) or num_train_epochs > 0."
            )

    # ------------------------------------------------------------------ derived sizes
    @property
    def local_batch_size(self) -> int:
        """Rows (episodes) per process per update (the rollout batch of one process)."""
        return self.per_device_train_batch_size * self.gradient_accumulation_steps

    @property
    def batch_size(self) -> int:
        """Rows (episodes) per update over all processes."""
        return self.local_batch_size * self.world_size

    @property
    def prompts_per_batch(self) -> int:
        """Prompts per process per update: the dataloader's batch, each prompt sampled ``num_generations`` times.

        >>> BatchPlan(4, 2, 1, 1, 1, 8, num_generations=4).prompts_per_batch
        2
        """
        return self.local_batch_size // self.num_generations

    def episodes_per_epoch(self, num_prompts: int) -> int:
        """Episodes (rows) in one pass over ``num_prompts`` prompts: each sampled ``num_generations`` times."""
        return num_prompts * self.num_generations

    def check_dataset(self, num_prompts: int) -> None:
        """A train dataset of ``num_prompts`` prompts fills at least one rollout batch (``drop_last``)."""
        if num_prompts < self.prompts_per_batch:
            raise ValueError(
                f"`train_dataset` has {num_prompts} prompts, fewer than one rollout batch "
                f"(per_device_train_batch_size * gradient_accumulation_steps / num_generations = "
                f"{self.prompts_per_batch}). Add prompts or lower the batch size."
            )

    @property
    def local_mini_batch_size(self) -> int:
        """Rows of one mini-batch on one process."""
        return self.local_batch_size // self.num_mini_batches

    @property
    def mini_batch_size(self) -> int:
        """Rows of one mini-batch over all processes (one optimizer step)."""
        return self.local_mini_batch_size * self.world_size

    @property
    def local_micro_batch_size(self) -> int:
        """Rows of one forward/backward on one process (the last one of a mini-batch may be smaller)."""
        return min(self.per_device_train_batch_size, self.local_mini_batch_size)

    @property
    def micro_batch_size(self) -> int:
        """TRL's ``micro_batch_size``: per-device batch times processes."""
        return self.per_device_train_batch_size * self.world_size

    @property
    def micro_batches_per_mini_batch(self) -> int:
        """Forward/backward passes accumulated into one optimizer step."""
        return math.ceil(self.local_mini_batch_size / self.local_micro_batch_size)

    @property
    def num_total_batches(self) -> int:
        """Updates in the run: ``ceil(total_episodes / batch_size)`` (may train a little past it)."""
        return math.ceil(self.total_episodes / self.batch_size)

    @property
    def optimizer_steps_per_update(self) -> int:
        return self.num_mini_batches * self.num_ppo_epochs

    # ------------------------------------------------------------------ slicing
    def micro_batch_slices(self) -> list[slice]:
        """Row ranges of the micro-batches inside one mini-batch, in order.

        >>> [(s.start, s.stop) for s in BatchPlan(4, 3, 2, 1, 1, 12).micro_batch_slices()]
        [(0, 4), (4, 6)]
        """
        step, size = self.local_micro_batch_size, self.local_mini_batch_size
        return [slice(start, min(start + step, size)) for start in range(0, size, step)]

    def mini_batch_slices(self) -> list[slice]:
        """Row ranges of the mini-batches inside one (shuffled) rollout batch."""
        size = self.local_mini_batch_size
        return [slice(start, start + size) for start in range(0, self.local_batch_size, size)]

    def fill_config(self, args) -> None:
        """Write the derived fields TRL's trainer sets on its config (scripts read them)."""
        args.total_episodes = self.total_episodes
        args.world_size = self.world_size
        args.local_batch_size = self.local_batch_size
        args.batch_size = self.batch_size
        args.local_mini_batch_size = self.local_mini_batch_size
        args.mini_batch_size = self.mini_batch_size
        args.micro_batch_size = self.micro_batch_size
        args.num_total_batches = self.num_total_batches


# ---------------------------------------------------------------------- rows of the micro-batches
def sorted_by_length(prompt_lengths: torch.Tensor, response_lengths: torch.Tensor) -> torch.Tensor:
    """``(n,)`` long: positions of the rows, longest response first, then longest prompt
    (stable). Args: ``(n,)`` long each (``rollout.row_extents``)."""
    key = response_lengths * (int(prompt_lengths.max()) + 1 if prompt_lengths.numel() else 1) + prompt_lengths
    return torch.sort(key, descending=True, stable=True).indices


def token_budget_groups(prompt_lengths: list[int], response_lengths: list[int], max_tokens: int) -> list[list[int]]:
    """Rows, given longest first, packed greedily into consecutive groups whose trimmed
    forward has at most ``max_tokens`` token positions: ``rows * (longest prompt + longest
    response)`` of the group. That bounds the group's real tokens too (verl's
    ``ppo_max_token_len_per_gpu`` counts those; without packed attention a micro-batch costs
    its padded extent). A row longer than the budget alone is a group of its own.

    >>> token_budget_groups([2, 2, 1, 1], [6, 5, 3, 1], max_tokens=16)
    [[0, 1], [2, 3]]
    """
    groups, current, widest_p, widest_r = [], [], 0, 0
    for row, (p, r) in enumerate(zip(prompt_lengths, response_lengths)):
        wp, wr = max(widest_p, p), max(widest_r, r)
        if current and (len(current) + 1) * (wp + wr) > max_tokens:
            groups.append(current)
            current, wp, wr = [], p, r
        current.append(row)
        widest_p, widest_r = wp, wr
    if current:
        groups.append(current)
    return groups


def micro_batch_rows(
    prompt_lengths: torch.Tensor, response_lengths: torch.Tensor, slices: list[slice], *,
    group_by_length: bool = True, max_tokens: int | None = None,
) -> list[torch.Tensor]:
    """The rows of each micro-batch of one mini-batch, as ``(b_i,)`` long positions into it.

    Args:
        prompt_lengths, response_lengths: ``(n,)`` long, the extents of the mini-batch's rows
            (``rollout.row_extents``).
        slices: the configured micro-batches (``BatchPlan.micro_batch_slices``).
        group_by_length: cut ``slices`` from the rows sorted by length (same count and sizes;
            rows of similar length share a micro-batch and its trimmed width); False: from the
            rows in their (shuffled) order, as the trainer did before trimming existed.
        max_tokens: ``max_tokens_per_micro_batch``: ignore ``slices`` and pack the sorted rows
            by :func:`token_budget_groups` (the count varies by mini-batch and process).
    Returns:
        a list of disjoint index tensors covering ``0 .. n-1`` once each.
    """
    n = prompt_lengths.shape[0]
    if max_tokens is None and not group_by_length:
        return [torch.arange(n, device=prompt_lengths.device)[part] for part in slices]
    order = sorted_by_length(prompt_lengths, response_lengths)
    if max_tokens is None:
        return [order[part] for part in slices]
    ordered = torch.stack([prompt_lengths[order], response_lengths[order]]).tolist()  # one host sync
    return [order[group] for group in token_budget_groups(ordered[0], ordered[1], max_tokens)]


def split_to_count(groups: list[torch.Tensor], count: int) -> list[torch.Tensor]:
    """``groups`` (row indices of micro-batches) cut further until there are ``count`` of them:
    the group with the most rows is halved (its longer half first), which never raises a
    group's token cost. For processes that must run equal counts (ZeRO, FSDP): each takes
    the largest count of any process. ``count`` may not exceed the number of rows.

    >>> [g.tolist() for g in split_to_count([torch.tensor([0, 1, 2]), torch.tensor([3])], 3)]
    [[0, 1], [2], [3]]
    """
    groups = list(groups)
    if count > sum(len(g) for g in groups):
        raise ValueError(f"count={count} micro-batches cannot be cut from {sum(len(g) for g in groups)} rows.")
    while len(groups) < count:
        i = max(range(len(groups)), key=lambda j: len(groups[j]))
        g = groups[i]
        groups[i : i + 1] = [g[: (len(g) + 1) // 2], g[(len(g) + 1) // 2 :]]
    return groups
