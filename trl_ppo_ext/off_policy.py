"""Off-policy corrections for rollouts sampled by an older policy than the one being trained.

With asynchronous rollouts three policies meet in one update (AReaL's names, arXiv 2505.24298):

* ``pi_behav``: the policy that sampled the tokens (an engine holding weights ``max_staleness``
  versions old or fewer); its log-probs come with the samples.
* ``pi_prox``: the proximal policy, the current weights before this update, whose log-probs
  the trainer recomputes when it trains the batch (NeMo-RL's and AReaL's choice); it is the
  ``old_logprobs`` of today's PPO loss.
* ``pi_theta``: the policy being optimised.

PPO's ratio is ``pi_theta / pi_prox`` and is clipped as today; the gap between the sampler and
the proximal policy is corrected by a per-token behaviour weight ``w = pi_prox / pi_behav``
that multiplies each token's clipped objective (never differentiated: both log-probs are data).
Two ways to bound it, named by ``OFF_POLICY_CORRECTIONS``:

* ``"decoupled"`` (AReaL's decoupled PPO loss): tokens whose ``w`` exceeds the cap are left out
  (weight 0), the others keep ``w`` as it is;
* ``"tis"`` (truncated importance sampling, Ionides 2008; Yao et al. 2025): ``min(w, cap)``,
  every token stays;
* ``"none"``: no weight (today's loss with ``old_logprobs = pi_prox``).

When ``pi_behav == pi_prox`` every weight is exactly ``exp(0) = 1`` and both corrections give
today's loss bit for bit. The engine-mismatch weights of ``generation.mismatch`` correct the
same gap (there ``pi_prox`` is called ``pi_old`` and ``pi_behav`` ``pi_engine``); use one or
the other for a batch, not both.

Notation: ``B`` sequences, ``T`` response tokens; ``(B, T)`` float log-probs; bool
``response_mask`` True = the token counts. Behaviour log-probs may hold NaN where the engine gave
none: such tokens get weight 1 and are left out of the statistics.

Example (one token 2x more likely under the proximal policy, cap 1.5):

>>> import math, torch
>>> from trl_ppo_ext.off_policy import behaviour_weights
>>> prox = torch.tensor([[math.log(0.4), math.log(0.5)]])
>>> behav = torch.tensor([[math.log(0.2), math.log(0.5)]])
>>> mask = torch.tensor([[True, True]])
>>> behaviour_weights(prox, behav, mask, correction="tis", cap=1.5)        # min(2, 1.5), min(1, 1.5)
tensor([[1.5000, 1.0000]])
>>> behaviour_weights(prox, behav, mask, correction="decoupled", cap=1.5)  # 2 > 1.5: left out
tensor([[0., 1.]])
"""

from __future__ import annotations

import math

import torch

from . import losses
from .choices import OFF_POLICY_CORRECTIONS

# The keys :func:`off_policy_stats` logs.
OFF_POLICY_KEYS = (
    "off_policy/weight_mean", "off_policy/weight_max", "off_policy/capped_frac", "off_policy/logp_gap_mean",
    "off_policy/staleness",
)


def _check(correction: str, cap: float | None) -> None:
    if correction not in OFF_POLICY_CORRECTIONS:
        raise ValueError(f"correction must be one of {list(OFF_POLICY_CORRECTIONS)}, got correction={correction!r}.")
    if correction != "none" and (cap is None or not 1.0 <= cap < math.inf):  # nan fails too
        raise ValueError(
            f"correction={correction!r} needs a finite cap >= 1 on the behaviour weights pi_prox / pi_behav "
            f"(AReaL's behav_imp_weight_cap; 2 to 10 are common), got cap={cap!r}."
        )


def behaviour_log_ratio(proximal_logprobs: torch.Tensor, behaviour_logprobs: torch.Tensor,
                        response_mask: torch.Tensor) -> torch.Tensor:
    """``log pi_prox - log pi_behav`` per token, 0 where the mask is False or the behaviour
    log-prob is NaN.

    Args:
        proximal_logprobs: ``(B, T)`` the trainer's log-probs of the sampled tokens, recomputed
            with the current weights.
        behaviour_logprobs: ``(B, T)`` the sampler's, NaN where it gave none.
        response_mask: ``(B, T)`` bool.
    Returns:
        ``(B, T)`` float32, detached (the weights are data, as in AReaL and TRL).
    """
    if proximal_logprobs.shape != behaviour_logprobs.shape or proximal_logprobs.shape != response_mask.shape:
        raise ValueError(
            f"proximal_logprobs {tuple(proximal_logprobs.shape)}, behaviour_logprobs "
            f"{tuple(behaviour_logprobs.shape)} and response_mask {tuple(response_mask.shape)} must have one "
            "shape (B, T)."
        )
    delta = proximal_logprobs.detach().float() - behaviour_logprobs.detach().float()
    keep = response_mask.bool() & ~torch.isnan(delta)
    return torch.where(keep, delta, torch.zeros((), device=delta.device))


def behaviour_weights(proximal_logprobs: torch.Tensor, behaviour_logprobs: torch.Tensor,
                      response_mask: torch.Tensor, *, correction: str, cap: float | None) -> torch.Tensor | None:
    """The per-token weights ``w`` of the policy objective (see the module docstring).

    Args:
        proximal_logprobs, behaviour_logprobs: ``(B, T)``; response_mask: ``(B, T)`` bool.
        correction: one of ``OFF_POLICY_CORRECTIONS``.
        cap: the bound ``C >= 1`` of ``w = pi_prox / pi_behav`` (unused for ``"none"``).
    Returns:
        ``(B, T)`` float32: ``min(w, C)`` for ``"tis"``; ``w`` where ``w <= C`` and 0 where
        ``w > C`` for ``"decoupled"``; 1 on tokens that do not count. None for ``"none"``.
        Equivalent, per counted token, to::

            w = exp(prox - behav)
            tis = min(w, C);  decoupled = w if w <= C else 0
    """
    _check(correction, cap)
    if correction == "none":
        return None
    weights = torch.exp(behaviour_log_ratio(proximal_logprobs, behaviour_logprobs, response_mask))
    if correction == "tis":
        return torch.clamp(weights, max=cap)
    return weights.masked_fill(weights > cap, 0.0)


def off_policy_stats(proximal_logprobs: torch.Tensor, behaviour_logprobs: torch.Tensor, response_mask: torch.Tensor,
                     weights: torch.Tensor | None, *, cap: float | None, staleness: float | None = None
                     ) -> dict[str, torch.Tensor]:
    """What the correction did to one batch, for the log (``OFF_POLICY_KEYS``).

    Args:
        proximal_logprobs, behaviour_logprobs: ``(B, T)``; response_mask: ``(B, T)`` bool.
        weights: ``(B, T)`` from :func:`behaviour_weights`, or None (no correction: weight 1).
        cap: the cap those weights were bounded by (None: nothing counts as capped).
        staleness: policy versions between the sampler and the trainer for this batch
            (``async_rollouts.VersionedBatch.staleness``); None leaves the key out.
    Returns:
        0-dim float32 tensors over the counted tokens with a behaviour log-prob:
        ``weight_mean`` and ``weight_max`` of the applied weights, ``capped_frac`` (share whose raw
        ``w`` exceeded the cap: truncated by TIS, left out by the decoupled loss),
        ``logp_gap_mean`` (mean ``|log pi_prox - log pi_behav|``); all 0 when no token counts.
    """
    log_ratio = behaviour_log_ratio(proximal_logprobs, behaviour_logprobs, response_mask)
    counted = response_mask.bool() & ~torch.isnan(behaviour_logprobs)
    zero = torch.zeros((), device=log_ratio.device)
    applied = torch.ones_like(log_ratio) if weights is None else weights.float()
    capped = torch.zeros_like(counted) if cap is None else log_ratio.exp() > cap
    if counted.any():
        stats = {"off_policy/weight_mean": applied[counted].mean(), "off_policy/weight_max": applied[counted].max(),
                 "off_policy/capped_frac": capped[counted].float().mean(),
                 "off_policy/logp_gap_mean": log_ratio[counted].abs().mean()}
    else:
        stats = {key: zero.clone() for key in OFF_POLICY_KEYS[:4]}
    if staleness is not None:
        stats["off_policy/staleness"] = torch.tensor(float(staleness))
    return stats


def off_policy_ppo_loss(
    new_logprobs: torch.Tensor,
    logits: torch.Tensor,
    new_values: torch.Tensor,
    *,
    proximal_logprobs: torch.Tensor,
    behaviour_logprobs: torch.Tensor,
    correction: str,
    cap: float | None,
    staleness: float | None = None,
    **loss_kwargs,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """:func:`losses.ppo_loss` with the ratio taken against the proximal policy and the policy
    objective weighted by the behaviour weights (the decoupled PPO loss, or TIS).

    Args:
        new_logprobs, logits, new_values: as in ``losses.ppo_loss`` (``(B, T)``, ``(B, T, V)``,
            ``(B, T)``).
        proximal_logprobs: ``(B, T)`` ``log pi_prox``, the ``old_logprobs`` of the PPO ratio.
        behaviour_logprobs: ``(B, T)`` ``log pi_behav`` of the sampler (NaN: none given).
        correction, cap: see :func:`behaviour_weights`.
        staleness: logged as ``off_policy/staleness`` when given.
        **loss_kwargs: every other keyword of ``losses.ppo_loss`` (``old_values``,
            ``advantages``, ``returns``, ``response_mask``, the clip ranges and coefficients, the
            divisors); not ``old_logprobs`` or ``pg_weights``, which this function sets.
    Returns:
        ``(loss, stats)``: ``ppo_loss``'s, its stats joined by :func:`off_policy_stats`'. The
        divisor of the policy term is unchanged: a token left out by the decoupled loss still
        counts in the token mean (as in AReaL), so leaving tokens out does not inflate the others.
    """
    for name in ("old_logprobs", "pg_weights"):
        if name in loss_kwargs:
            raise TypeError(f"off_policy_ppo_loss sets {name} itself (from proximal_logprobs and the behaviour "
                            "weights); pass proximal_logprobs and behaviour_logprobs instead.")
    mask = loss_kwargs["response_mask"]
    weights = behaviour_weights(proximal_logprobs, behaviour_logprobs, mask, correction=correction, cap=cap)
    loss, stats = losses.ppo_loss(new_logprobs, logits, new_values, old_logprobs=proximal_logprobs,
                                  pg_weights=weights, **loss_kwargs)
    with torch.no_grad():
        stats.update(off_policy_stats(proximal_logprobs, behaviour_logprobs, mask, weights,
                                      cap=None if correction == "none" else cap, staleness=staleness))
    return loss, stats
