"""The optimizer side of a PPO update: one mini-batch's micro-batches accumulated, then one step if finite.

The trainer's ``ppo_update`` walks ``num_ppo_epochs`` shuffled passes of mini-batches (the order,
preemption and the guards' decisions are its own); per mini-batch it calls :func:`mini_batch_step`,
which reads as

    counts -> for each micro-batch: loss (the trainer's ``compute_loss_terms``) -> backward
           -> at the last one: clip -> step if finite

Everything the step needs is an argument: the :class:`Stepper` (accelerator, wrapped model,
optimizer, the batch plan's accumulation count and the loss settings) and per call the
rollout, its targets, the mini-batch's rows and the two hooks that may be overridden
(``loss_terms``: a micro-batch's loss; ``micro_batches``: how the mini-batch is cut). Nothing
here reads or writes the trainer.

Notation: ``B`` rollout rows, ``T`` response tokens, ``n`` rows of a mini-batch, ``b`` of a micro-batch.

>>> import torch
>>> stack_stats({"loss": [torch.tensor(1.0), torch.tensor(3.0)]})
{'loss': tensor([1., 3.])}
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

from . import critic_epochs, critic_warmup
from .batching import BatchPlan, micro_batch_rows, split_to_count
from .distributed import accumulation_step, needs_equal_micro_batch_counts
from .gradients import clip_gradients, skip_scaler_step
from .rollout import row_extents, trimmed_together

__all__ = ["FIRST_LOGPROBS", "Stepper", "mini_batch_counts", "mini_batch_step", "plan_micro_batches",
           "stack_stats", "step_if_finite"]

logger = logging.getLogger(__name__)

# compute_loss_terms' statistic that carries the on-policy update's first log-probs (b, T) to the rollout
FIRST_LOGPROBS = "_first_logprobs"


@dataclass(frozen=True)
class Stepper:
    """What an optimizer step acts on: built once per run by the trainer.

    ``model`` is the wrapped module (DDP/DeepSpeed: its backward synchronises), ``unwrapped`` the
    module whose policy gradients a critic warm-up drops; ``loss_type`` "dapo" divides by tokens
    only (no sequence count is passed to the loss hook); ``trim_forwards`` cuts each micro-batch to
    its own extent; ``deepspeed``: the engine steps inside ``backward`` and keeps its own loss scale.
    """

    accelerator: object
    model: nn.Module
    unwrapped: nn.Module
    optimizer: object
    plan: BatchPlan
    loss_type: str
    trim_forwards: bool
    max_grad_norm: float | None
    deepspeed: bool


def stack_stats(stats: dict[str, list[torch.Tensor]]) -> dict[str, torch.Tensor]:
    """Per-micro-batch scalars -> one ``(n,)`` float tensor per statistic."""
    return {k: torch.stack([v.float().reshape(()) for v in vs]) for k, vs in stats.items()}


def mini_batch_counts(loss_mask: torch.Tensor, mini: torch.Tensor, accelerator) -> tuple[torch.Tensor, torch.Tensor]:
    """``(num_tokens (1,), num_sequences (1,))`` of the mini-batch ``mini`` (``(n,)`` rows of the
    ``(B, T)`` bool ``loss_mask``), summed over every process: what each micro-batch's token (or
    sequence) sum is divided by, so that the step's gradient is the mini-batch's mean however it is cut."""
    counts = torch.stack([loss_mask[mini].sum().float(), torch.tensor(float(mini.numel()), device=loss_mask.device)])
    if accelerator.num_processes > 1:
        counts = accelerator.reduce(counts, reduction="sum")
    return counts[:1], counts[1:]


def plan_micro_batches(rollout, mini: torch.Tensor, plan: BatchPlan, accelerator, *, group_by_length: bool,
                       max_tokens: int | None) -> list[torch.Tensor]:
    """The rollout rows of each micro-batch of the mini-batch ``mini`` (``(n,)`` long rows):
    ``batching.micro_batch_rows`` by length or by ``max_tokens`` per micro-batch; under ZeRO or FSDP
    every process then runs the largest count of any process (they communicate in every backward),
    under DDP each its own. Returns ``(b_i,)`` long tensors of rollout rows."""
    rows = micro_batch_rows(*row_extents(rollout.query_mask[mini], rollout.response_mask[mini]),
                            plan.micro_batch_slices(), group_by_length=group_by_length, max_tokens=max_tokens)
    if max_tokens is not None and needs_equal_micro_batch_counts(accelerator):
        count = accelerator.gather(torch.tensor([len(rows)], device=accelerator.device)).max()
        rows = split_to_count(rows, int(count))
    return [mini[r] for r in rows]


def mini_batch_step(stepper: Stepper, rollout, adv, mini: torch.Tensor, stats: dict[str, list], *,
                    loss_terms: Callable, micro_batches: Callable, warming: bool, update: int,
                    critic_only: bool = False) -> bool | None:
    """Accumulate gradients over the micro-batches of the mini-batch ``mini``, then step once if finite.

    Each micro-batch's loss is its token sum over the valid-token count of the whole mini-batch on
    every process (or, by ``loss_type``, over its sequence count), so the step's gradient is that of
    the mini-batch's loss however the mini-batch is cut into micro-batches and processes -- which is
    why the micro-batches may be cut from length-sorted rows or by a token budget (``micro_batches``),
    each trimmed to its own extent. While ``warming`` (a critic warm-up) the policy's gradients are
    dropped before clipping and the step. Appends each micro-batch's statistics to ``stats``; an
    on-policy loss's first log-probs are written into ``rollout.logprobs`` (its pi_old).

    ``critic_only``: a critic epoch's value-only step (``critic_epochs``; ``loss_terms`` the value loss
    alone): the policy's gradients are dropped as while warming, no micro-batch is reduced by DDP (the
    policy's parameters get no gradient, which its reducer would wait for) and the critic's gradients
    are averaged over the processes before clipping instead; the statistics go to ``stats`` under
    ``critic_epochs.STATS_PREFIX``.

    Returns:
        True when the optimizer stepped, False when the step was skipped (a NaN/inf loss or gradient
        norm on any process), None when no micro-batch ended the accumulation.
    """
    accelerator = stepper.accelerator
    # accelerate (or, under DeepSpeed, the engine: its gradient_accumulation_steps is set to the same
    # number by `distributed.configure_deepspeed`) divides each backward by the accumulation steps,
    # and DDP (ZeRO's reduce) averages over processes; both are undone so the sums below add up to
    # the mini-batch token mean.
    num_tokens, num_sequences = mini_batch_counts(rollout.loss_mask, mini, accelerator)
    # only the loss types that divide by it get the sequence count: an override of the hook written
    # for the token mean keeps its (mb, adv, num_tokens) signature
    sequence_count = {} if stepper.loss_type == "dapo" else {"num_sequences": num_sequences}
    loss_scale = stepper.plan.micro_batches_per_mini_batch * accelerator.num_processes
    nonfinite_loss = torch.zeros((), device=accelerator.device)
    stepped = None
    micros = micro_batches(rollout, mini)
    prefix = critic_epochs.STATS_PREFIX if critic_only else ""
    for i, micro in enumerate(micros):
        with accumulation_step(accelerator, stepper.model, last=i == len(micros) - 1, reduce=not critic_only):
            mb, mb_adv = rollout.select(micro), adv.select(micro)
            if stepper.trim_forwards:  # the micro-batch's own extent
                mb, mb_adv = trimmed_together(mb, mb_adv)
            loss, micro_stats = loss_terms(mb, mb_adv, num_tokens, **sequence_count)
            first = micro_stats.pop(FIRST_LOGPROBS, None)
            if first is not None:  # on-policy: the rollout's pi_old is the update's first forward (scoring_plan)
                rollout.logprobs[micro, : first.shape[1]] = first
            nonfinite_loss = torch.maximum(nonfinite_loss, (~torch.isfinite(loss.detach())).float())
            accelerator.backward(loss * loss_scale)
            if accelerator.sync_gradients:
                if warming or critic_only:
                    critic_warmup.drop_policy_gradients(stepper.unwrapped)
                if critic_only:
                    critic_epochs.average_critic_gradients(accelerator, stepper.unwrapped)
                grad_norm = clip_gradients(accelerator, stepper.model, stepper.max_grad_norm, stepper.deepspeed)
                micro_stats["grad_norm"] = grad_norm
                stepped = step_if_finite(stepper, grad_norm, nonfinite_loss, update)
        for k, v in micro_stats.items():
            stats[prefix + k].append(v)
    return stepped


def step_if_finite(stepper: Stepper, grad_norm: torch.Tensor, nonfinite_loss: torch.Tensor, update: int) -> bool:
    """The optimizer step, unless any process saw a NaN/inf loss or gradient norm (0-d tensors);
    True when it stepped.

    One scalar crosses to the host per optimizer step (the guard needs the answer). Under DeepSpeed
    the engine has already stepped inside ``backward`` (``step``/``zero_grad`` below are no-ops
    there); it skips a step itself when the gradient norm is not finite.
    """
    accelerator, optimizer = stepper.accelerator, stepper.optimizer
    bad = torch.maximum(nonfinite_loss, (~torch.isfinite(grad_norm)).float()).reshape(1)
    bad = accelerator.reduce(bad, reduction="sum") if accelerator.num_processes > 1 else bad
    if bad.item() > 0:
        if stepper.deepspeed and not optimizer.step_was_skipped:
            logger.warning("Update %d: DeepSpeed applied a step whose loss was not finite (its gradients "
                           "were finite); it is counted as skipped.", update)
        if not stepper.deepspeed:  # the engine keeps its own loss scale
            skip_scaler_step(getattr(accelerator, "scaler", None), optimizer)
        optimizer.zero_grad()  # no parameter (nor optimizer moment) may change
        return False
    optimizer.step()
    optimizer.zero_grad()
    return True
