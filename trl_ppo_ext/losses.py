"""The PPO loss of one micro-batch, composed from ``functional``'s terms, with detached stats.

::

    loss = clipped surrogate + vf_coef * clipped value loss - entropy_coef * entropy

every term a token mean over ``response_mask`` (``(B, T)`` bool, True = a response token
that counts), divided by ``num_tokens`` when given (the valid-token count of the whole
mini-batch on every process, so that micro-batch losses add up to the mini-batch mean; see
``functional.masked_token_mean``). The surrogate's reduction follows ``loss_type``
(``functional.masked_loss_aggregate``: "dapo" is the token mean above; "grpo" and "dr_grpo"
divide by ``num_sequences``, the whole mini-batch's sequence count); the value loss and
the entropy stay token means. The model is torchtune's ``PPOLoss.forward``: one pure
function that composes the terms and returns what is logged, detached.

Example (equal old and new log-probs: ratio 1, surrogate ``-mean(A)``):

>>> import torch
>>> from trl_ppo_ext.losses import ppo_loss
>>> mask = torch.tensor([[True, True, False]])
>>> logits = torch.zeros(1, 3, 4)  # uniform over 4 tokens: entropy log(4)
>>> loss, stats = ppo_loss(
...     torch.zeros(1, 3), logits, torch.tensor([[1.0, 2.0, 0.0]]),
...     old_logprobs=torch.zeros(1, 3), old_values=torch.tensor([[1.0, 2.0, 0.0]]),
...     advantages=torch.tensor([[1.0, 3.0, 0.0]]), returns=torch.tensor([[2.0, 2.0, 0.0]]),
...     response_mask=mask, cliprange=0.2, cliprange_value=0.2, vf_coef=0.1, entropy_coef=0.0)
>>> round(stats["pg_loss"].item(), 4), round(stats["vf_loss"].item(), 4), round(loss.item(), 4)
(-2.0, 0.25, -1.975)
"""

from __future__ import annotations

import torch

from . import functional as F

# The config fields ppo_loss reads (PPOConfig's names).
LOSS_FIELDS = (
    "cliprange", "cliprange_value", "vf_coef", "entropy_coef", "cliprange_high", "dual_clip", "loss_type",
)


def loss_settings(args) -> dict:
    """The keyword arguments of :func:`ppo_loss` read from a config (any object with the
    ``LOSS_FIELDS`` attributes)."""
    return {name: getattr(args, name) for name in LOSS_FIELDS}


def ppo_loss(
    new_logprobs: torch.Tensor,
    logits: torch.Tensor,
    new_values: torch.Tensor,
    *,
    old_logprobs: torch.Tensor,
    old_values: torch.Tensor,
    advantages: torch.Tensor,
    returns: torch.Tensor,
    response_mask: torch.Tensor,
    cliprange: float,
    cliprange_value: float | None,
    vf_coef: float,
    entropy_coef: float,
    num_tokens: torch.Tensor | None = None,
    cliprange_high: float | None = None,
    dual_clip: float | None = None,
    loss_type: str = "dapo",
    num_sequences: torch.Tensor | None = None,
    max_completion_length: int | None = None,
    pg_weights: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """The PPO loss (see the module docstring) and its statistics.

    Args:
        new_logprobs: ``log pi(a_t|s_t)`` of the policy being trained, ``(B, T)``.
        logits: the policy's response logits ``(B, T, V)``, for the entropy bonus; its graph
            is only kept for the entropy when ``entropy_coef > 0``.
        new_values: ``V(s_t)`` of the critic being trained, ``(B, T)``.
        old_logprobs, old_values: the rollout's, ``(B, T)``.
        advantages, returns: the targets (``advantages.PPOTargets``), ``(B, T)``.
        response_mask: bool ``(B, T)``.
        cliprange, cliprange_value, vf_coef, entropy_coef: as in ``PPOConfig``.
        num_tokens: the divisor of every token sum (see the module docstring); None: this
            micro-batch's own valid-token count.
        cliprange_high, dual_clip: as in ``PPOConfig`` (None: symmetric clip, no dual clip).
        loss_type: the surrogate's reduction, ``functional.LOSS_TYPES`` (TRL GRPO's names).
        num_sequences: the whole mini-batch's sequence count ("grpo", "dr_grpo"); None: this
            micro-batch's own.
        max_completion_length: Dr. GRPO's constant length (``PPOConfig.response_length``);
            None: this micro-batch's T.
        pg_weights: non-negative weights of the policy-gradient term, ``(B, T)`` per token or
            ``(B, 1)`` per sequence (the sampler's importance weights,
            ``generation.mismatch.importance_sampling_weights``): each token's clipped
            objective is multiplied by its weight, as TRL GRPO multiplies its per-token loss;
            the divisor is unchanged and the value loss and entropy are not weighted. Applied
            as ``advantages * w``, which is the same since ``min(r wA, clip(r) wA) = w min(rA,
            clip(r) A)`` for ``w >= 0``. None: no weighting.

    Returns:
        ``(loss, stats)``: the differentiable scalar loss, and detached scalars that are this
        micro-batch's own token means whatever ``num_tokens`` is: ``pg_loss``, ``vf_loss``,
        ``entropy``, ``loss``, ``pg_clipfrac``, ``pg_clipfrac_lower``, ``pg_clipfrac_upper``,
        ``pg_clipfrac_dual``, ``vf_clipfrac``, ``approxkl``, ``ratio_mean``, ``ratio_max``.
    """
    if pg_weights is not None:
        advantages = advantages * pg_weights.to(advantages.dtype)  # a new tensor: the caller's is unchanged
    pg_loss, pg_stats = F.masked_clipped_surrogate(
        new_logprobs, old_logprobs, advantages, response_mask, cliprange, num_tokens,
        cliprange_high=cliprange_high, dual_clip=dual_clip, loss_type=loss_type,
        num_sequences=num_sequences, max_completion_length=max_completion_length,
    )
    vf_loss, vf_stats = F.masked_clipped_value_loss(
        new_values, old_values, returns, response_mask, cliprange_value, num_tokens
    )
    with torch.set_grad_enabled(entropy_coef > 0 and torch.is_grad_enabled()):
        entropy = F.masked_entropy(logits, response_mask, num_tokens)
    loss = pg_loss + vf_coef * vf_loss - entropy_coef * entropy
    with torch.no_grad():
        # shares of the mini-batch figure -> this micro-batch's own, for logging: the token terms
        # by the token counts, the surrogate by the normaliser its loss_type divided by
        to_local = 1.0 if num_tokens is None else num_tokens.reshape(()) / response_mask.sum().clamp(min=1)
        pg_to_local = _surrogate_to_local(loss_type, to_local, num_sequences, response_mask.shape[0])
        pg_loss_local = pg_loss.detach() * pg_to_local
        vf_loss_local, entropy_local = vf_loss.detach() * to_local, entropy.detach() * to_local
        stats = {
            "pg_loss": pg_loss_local, "vf_loss": vf_loss_local, "entropy": entropy_local,
            "loss": pg_loss_local + vf_coef * vf_loss_local - entropy_coef * entropy_local,
            "pg_clipfrac": pg_stats["clipfrac"], "pg_clipfrac_lower": pg_stats["clipfrac_lower"],
            "pg_clipfrac_upper": pg_stats["clipfrac_upper"], "pg_clipfrac_dual": pg_stats["clipfrac_dual"],
            "vf_clipfrac": vf_stats["clipfrac"],
            "approxkl": pg_stats["approxkl"], "ratio_mean": pg_stats["ratio_mean"],
            "ratio_max": pg_stats["ratio_max"],
        }
    return loss, stats


def value_only_loss(
    new_values: torch.Tensor,
    *,
    old_values: torch.Tensor,
    returns: torch.Tensor,
    response_mask: torch.Tensor,
    cliprange_value: float | None,
    vf_coef: float,
    num_tokens: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """The loss of a critic epoch's step (``PPOConfig.num_critic_epochs``): ``vf_coef *`` the
    clipped value loss of :func:`ppo_loss`, with no policy term, so the critic's gradient is the
    one a joint PPO step gives it.

    Args:
        new_values: ``V(s_t)`` of the critic being trained, ``(B, T)``.
        old_values, returns: the rollout's values and the update's value targets, ``(B, T)``
            (clipping is around ``old_values``, as in every epoch).
        response_mask: bool ``(B, T)``, the tokens the update trains on.
        cliprange_value, vf_coef: as in ``PPOConfig``.
        num_tokens: the divisor of the token sum (the whole mini-batch's valid tokens on every
            process); None: this micro-batch's own.

    Returns:
        ``(loss, stats)``: the scalar loss and this micro-batch's own detached ``vf_loss``,
        ``vf_clipfrac`` and ``loss`` (``vf_coef * vf_loss``).

    Example (one valid token, V = 2 beyond V_old = 1 +- 0.2, so clipped to 1.2, and R = 3: the
    clipped term is the larger, ``0.5 * max((2 - 3)^2, (1.2 - 3)^2) = 0.5 * 3.24 = 1.62``):

    >>> loss, stats = value_only_loss(torch.tensor([[2.0, 0.0]]), old_values=torch.tensor([[1.0, 0.0]]),
    ...     returns=torch.tensor([[3.0, 0.0]]), response_mask=torch.tensor([[True, False]]),
    ...     cliprange_value=0.2, vf_coef=0.1)
    >>> round(loss.item(), 4), round(stats["vf_loss"].item(), 4), stats["vf_clipfrac"].item()
    (0.162, 1.62, 1.0)
    """
    vf_loss, vf_stats = F.masked_clipped_value_loss(new_values, old_values, returns, response_mask,
                                                    cliprange_value, num_tokens)
    with torch.no_grad():
        to_local = 1.0 if num_tokens is None else num_tokens.reshape(()) / response_mask.sum().clamp(min=1)
        vf_loss_local = vf_loss.detach() * to_local
        stats = {"vf_loss": vf_loss_local, "vf_clipfrac": vf_stats["clipfrac"], "loss": vf_coef * vf_loss_local}
    return vf_coef * vf_loss, stats


def _surrogate_to_local(loss_type: str, token_to_local, num_sequences, batch_size: int):
    """The factor turning the surrogate's share of the mini-batch loss into this micro-batch's
    own figure: ``num_tokens / own tokens`` for "dapo", ``num_sequences / own sequences`` for
    "grpo" and "dr_grpo" (whose divisor, ``num_sequences * max_completion_length``, keeps its
    length factor: the local figure uses the same constant length)."""
    if loss_type == "dapo":
        return token_to_local
    return 1.0 if num_sequences is None else torch.as_tensor(num_sequences).reshape(()) / batch_size
