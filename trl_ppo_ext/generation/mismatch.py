"""The sampler's numerical mismatch with the trained policy, and its importance-sampling correction.

A rollout sampled by an inference engine (vLLM) comes from ``pi_engine``, which differs from the
trainer's ``pi_old`` by the engine's kernels and precision even with identical weights. PPO's
old log-probs still come from the trainer's own forward (so the first ratio is exactly 1);
these functions measure the difference and form TRL GRPO's truncated importance weights
``pi_old / pi_engine`` that multiply the per-token policy loss
(``vllm_importance_sampling_correction``; Yao et al. 2025, "Your efficient RL framework secretly
brings you off-policy RL training").

Notation: ``B`` sequences, ``T`` response tokens; ``(B, T)`` float log-probs; bool
``response_mask`` True = the token counts. Engine log-probs may hold NaN where the engine gave
none; such tokens are left out of the statistics and get weight 1 (no correction).

Example:

>>> import torch
>>> from trl_ppo_ext.generation.mismatch import logp_difference_stats
>>> old = torch.tensor([[-1.0, -2.0, -3.0]])
>>> engine = torch.tensor([[-1.5, float("nan"), -3.25]])     # no engine log-prob for token 2
>>> stats = logp_difference_stats(old, engine, torch.tensor([[True, True, True]]))
>>> {k.split("/", 1)[1]: round(v.item(), 3) for k, v in stats.items()}  # tokens 1 and 3; token 2 a hole
{'sampling_logp_difference/mean': 0.375, 'sampling_logp_difference/max': 0.5, 'missing_engine_logprobs': 1.0}
"""

from __future__ import annotations

import math

import torch

from .arguments import IMPORTANCE_SAMPLING_MODES

LOGP_DIFFERENCE_KEYS = ("sampling/sampling_logp_difference/mean", "sampling/sampling_logp_difference/max")
# counted tokens the engine gave no log-prob for: left out of the difference and the weights, so
# without this count a hole in the engine's answer would not show in the log
MISSING_LOGPROBS_KEY = "sampling/missing_engine_logprobs"
IS_RATIO_KEYS = ("sampling/importance_sampling_ratio/min", "sampling/importance_sampling_ratio/mean",
                 "sampling/importance_sampling_ratio/max")


def logp_difference_stats(old_logprobs: torch.Tensor, engine_logprobs: torch.Tensor,
                          response_mask: torch.Tensor) -> dict[str, torch.Tensor]:
    """Mean and max of ``|log pi_old - log pi_engine|`` over the counted tokens (TRL's keys).

    Args:
        old_logprobs: ``(B, T)`` the trainer's log-probs of the sampled tokens.
        engine_logprobs: ``(B, T)`` the engine's, NaN where it gave none.
        response_mask: ``(B, T)`` bool.
    Returns:
        ``{"sampling/sampling_logp_difference/mean": (), ".../max": (),
        "sampling/missing_engine_logprobs": ()}`` float32 0-dim tensors: the first two 0 when no
        token counts; the last the number of tokens of ``response_mask`` whose engine log-prob is
        NaN (left out of the first two). Equivalent to::

            diffs = [abs(o - e) for o, e, m in zip(old, engine, mask) if m and not isnan(e)]
            mean, max = sum(diffs) / len(diffs), max(diffs)
            missing = sum(1 for e, m in zip(engine, mask) if m and isnan(e))
    """
    delta = (old_logprobs.float() - engine_logprobs.float()).abs()
    counted = response_mask.bool() & ~torch.isnan(delta)
    missing = (response_mask.bool() & torch.isnan(engine_logprobs.float())).sum().float()
    values = delta[counted]
    if values.numel() == 0:
        zero = torch.zeros((), device=delta.device)
        return {**dict(zip(LOGP_DIFFERENCE_KEYS, (zero, zero.clone()))), MISSING_LOGPROBS_KEY: missing}
    return {**dict(zip(LOGP_DIFFERENCE_KEYS, (values.mean(), values.max()))), MISSING_LOGPROBS_KEY: missing}


def importance_sampling_weights(old_logprobs: torch.Tensor, engine_logprobs: torch.Tensor,
                                response_mask: torch.Tensor, mode: str = "sequence_mask",
                                clip_min: float | None = None, clip_max: float | None = 3.0) -> torch.Tensor:
    """TRL GRPO's truncated (or masked) importance weights ``pi_old / pi_engine``.

    The per-token log-ratio is ``(log pi_old - log pi_engine)`` on counted tokens and 0 elsewhere
    (and where the engine gave NaN). Token modes take ``exp`` of it per token; sequence modes take
    ``exp`` of its sum over the response (the ratio of the whole response's probabilities).
    ``*_truncate`` clamps the ratio to ``[clip_min, clip_max]``; ``*_mask`` sets it to 0 outside
    (a bound that is None is no bound).

    Args:
        old_logprobs, engine_logprobs: ``(B, T)``; response_mask: ``(B, T)`` bool.
        mode: one of ``IMPORTANCE_SAMPLING_MODES``.
    Returns:
        ``(B, T)`` float32 for token modes, ``(B, 1)`` for sequence modes (broadcasts over the
        tokens of the per-token loss). Uncounted tokens hold 1 in token modes (they are masked
        out of the loss anyway).
    """
    if mode not in IMPORTANCE_SAMPLING_MODES:
        raise ValueError(f"vllm_importance_sampling_mode must be one of {list(IMPORTANCE_SAMPLING_MODES)}, "
                         f"got {mode!r}.")
    log_ratio = (old_logprobs.float() - engine_logprobs.float()).masked_fill(~response_mask.bool(), 0.0)
    log_ratio = torch.nan_to_num(log_ratio, nan=0.0)
    if mode.startswith("sequence"):
        log_ratio = log_ratio.sum(dim=1, keepdim=True)
    ratio = torch.exp(log_ratio)
    if mode.endswith("_truncate"):
        return torch.clamp(ratio, min=clip_min, max=clip_max)
    low = -math.inf if clip_min is None else clip_min
    high = math.inf if clip_max is None else clip_max
    return ratio.masked_fill((ratio < low) | (ratio > high), 0.0)


def importance_sampling_stats(weights: torch.Tensor, response_mask: torch.Tensor,
                              mode: str) -> dict[str, torch.Tensor]:
    """Min, mean and max of the importance weights under TRL's keys: over counted tokens in
    token modes, over sequences in sequence modes; 0 when there is nothing to count.

    Args:
        weights: ``(B, T)`` or ``(B, 1)`` from :func:`importance_sampling_weights` with ``mode``.
        response_mask: ``(B, T)`` bool.
    """
    values = weights.flatten() if mode.startswith("sequence") else weights[response_mask.bool()]
    if values.numel() == 0:
        zero = torch.zeros((), device=weights.device)
        return dict(zip(IS_RATIO_KEYS, (zero, zero.clone(), zero.clone())))
    return dict(zip(IS_RATIO_KEYS, (values.min(), values.mean(), values.max())))


def sampling_correction(old_logprobs: torch.Tensor, engine_logprobs: torch.Tensor, response_mask: torch.Tensor,
                        *, correction: bool, mode: str = "sequence_mask", clip_min: float | None = None,
                        clip_max: float | None = 3.0) -> tuple[torch.Tensor | None, dict[str, torch.Tensor]]:
    """What one rollout sampled by an engine gives the update and the log, as TRL GRPO does.

    Args:
        old_logprobs, engine_logprobs: ``(B, T)``; response_mask: ``(B, T)`` bool.
        correction, mode, clip_min, clip_max: ``VLLMArguments``' ``vllm_importance_sampling_*``.
    Returns:
        ``(weights, stats)``: the importance weights (``(B, T)`` or ``(B, 1)``, multiplying the
        per-token policy loss) or None without ``correction``; the log-prob difference stats,
        always, and the weights' stats with ``correction``.
    """
    stats = logp_difference_stats(old_logprobs, engine_logprobs, response_mask)
    if not correction:
        return None, stats
    weights = importance_sampling_weights(old_logprobs, engine_logprobs, response_mask, mode, clip_min, clip_max)
    return weights, {**stats, **importance_sampling_stats(weights, response_mask, mode)}


def sampling_weights(old_logprobs: torch.Tensor, engine_logprobs: torch.Tensor | None, response_mask: torch.Tensor,
                     args) -> torch.Tensor | None:
    """The truncated importance weights ``pi_old / pi_engine`` a micro-batch's policy loss is
    multiplied by, as ``args`` (``VLLMArguments``' ``vllm_importance_sampling_*`` fields) ask:
    ``(b, T)`` in the token modes, ``(b, 1)`` in the sequence modes; None when the batch was not
    sampled by an engine (``engine_logprobs`` None) or the correction is off.

    With ``args.off_policy_correction`` ``"tis"`` or ``"decoupled"`` (``PPOConfig``) the weights
    are ``off_policy.behaviour_weights`` instead, ``(b, T)``, capped at ``args.off_policy_cap``:
    ``pi_old`` is then the proximal policy and ``pi_engine`` the behaviour policy (an older version
    for a stale batch), and ``ppo_loss(old_logprobs=pi_old, pg_weights=these)`` is
    ``off_policy.off_policy_ppo_loss`` term for term. The two corrections weight the same ratio, so
    only one applies (the config refuses both). Each row's weight
    depends on that row alone, so cutting a rollout into micro-batches gives the weights of the
    whole rollout.

    Example:
        >>> from types import SimpleNamespace
        >>> args = SimpleNamespace(vllm_importance_sampling_correction=True,
        ...                        vllm_importance_sampling_mode="token_truncate",
        ...                        vllm_importance_sampling_clip_min=None, vllm_importance_sampling_clip_max=3.0)
        >>> old, engine = torch.tensor([[0.0, -1.0]]), torch.tensor([[-math.log(2.0), -1.0]])
        >>> sampling_weights(old, engine, torch.tensor([[True, True]]), args)  # exp(0 + log 2) = 2, exp(0) = 1
        tensor([[2., 1.]])
        >>> sampling_weights(old, None, torch.tensor([[True, True]]), args) is None
        True
    """
    if engine_logprobs is None:
        return None
    correction = getattr(args, "off_policy_correction", "none")
    if correction != "none":  # the off-policy correction instead (the config refuses both on)
        from ..off_policy import behaviour_weights

        return behaviour_weights(old_logprobs, engine_logprobs, response_mask, correction=correction,
                                 cap=args.off_policy_cap)
    if not args.vllm_importance_sampling_correction:
        return None
    return importance_sampling_weights(
        old_logprobs, engine_logprobs, response_mask, args.vllm_importance_sampling_mode,
        args.vllm_importance_sampling_clip_min, args.vllm_importance_sampling_clip_max,
    )
