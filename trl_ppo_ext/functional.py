"""Pure tensor math for token-level PPO on language models.

Notation, used in every docstring: ``B`` sequences in a batch, ``T`` response tokens per
sequence, ``V`` vocabulary size. ``(B, T)`` tensors hold one value per response token,
``(B,)`` tensors one value per sequence.

One mask convention everywhere: ``response_mask`` is a bool ``(B, T)`` tensor, True where
the token counts (the generated tokens up to and including the first stop token). What is
stored where the mask is False is never read: inputs are selected with ``torch.where``
(not multiplied by the mask, so ``inf * 0`` cannot turn into ``nan``) and every ``(B, T)``
output is exactly 0 there.

No function modifies its inputs. This module imports torch (and ``torch.distributed``)
only, so the trainer and the tests can use it without TRL or transformers.
"""

from __future__ import annotations

import math
from typing import Optional, Sequence, Union

import torch
import torch.distributed as dist

from .choices import KL_ESTIMATORS, LOSS_TYPES  # re-exported: the names the math accepts

__all__ = [
    "KL_ESTIMATORS",
    "LOSS_TYPES",
    "response_mask",
    "last_valid_index",
    "kl_penalty",
    "shaped_rewards",
    "masked_gae",
    "masked_gae_loop",
    "masked_gae_decoupled",
    "length_adaptive_lam",
    "turn_length_adaptive_lam",
    "masked_mean",
    "masked_var",
    "masked_token_mean",
    "masked_sequence_mean",
    "masked_loss_aggregate",
    "masked_global_mean_var",
    "masked_global_whiten",
    "masked_clipped_surrogate",
    "masked_clipped_value_loss",
    "logprobs_from_logits",
    "entropy_from_logits",
    "masked_entropy",
    "masked_explained_variance",
    "action_lengths",
    "turn_ends",
    "check_rewards_on_actions",
    "add_token_rewards",
    "action_masked_gae",
    "action_masked_gae_decoupled",
]


# --------------------------------------------------------------------------- checks


def _check_mask(mask: torch.Tensor, name: str = "response_mask") -> None:
    if mask.dtype != torch.bool:
        raise TypeError(
            f"{name} must be a bool tensor (True = the token counts), got dtype {mask.dtype}. "
            f"Convert it with `{name}.bool()` (and invert it first if it marks padding)."
        )


def _check_same_shape(**tensors: torch.Tensor) -> None:
    shapes = {name: tuple(t.shape) for name, t in tensors.items()}
    if len(set(shapes.values())) > 1:
        listed = ", ".join(f"{name}{shape}" for name, shape in shapes.items())
        raise ValueError(f"these tensors must have the same shape, got {listed}")


def _check_range(name: str, value: float, low: float, high: float) -> None:
    if not low <= value <= high:
        raise ValueError(f"{name} must be in [{low}, {high}], got {name}={value!r}")


def _float_dtype(*tensors: torch.Tensor) -> torch.dtype:
    """The tensors' promoted dtype, at least float32 (half-precision math is upcast)."""
    dtype = torch.float32
    for t in tensors:
        dtype = torch.promote_types(dtype, t.dtype)
    return dtype


def _accumulation_dtype(x: torch.Tensor) -> torch.dtype:
    # float64 sums make the (global) statistics independent of summation order to ~1e-16;
    # MPS has no float64.
    return torch.float32 if x.device.type == "mps" else torch.float64


# --------------------------------------------------------------------------- masks


def response_mask(
    responses: torch.Tensor, stop_token_id: Optional[Union[int, Sequence[int]]]
) -> torch.Tensor:
    """Which response tokens count: the first token through the FIRST stop token.

    The mask is never inferred from a pad id: the pad id may equal the EOS id, and a
    policy may emit the pad id in the middle of its text (TRL's `first_true_indices(
    response == pad_token_id)` gets both wrong, see trl issues #1893 and #3750).

    Args:
        responses: generated token ids without the prompt, shape (B, T).
        stop_token_id: the id that ends a response (usually EOS), a sequence of such ids
            (the first of any of them ends it), or None when generation has no stop token.

    Returns:
        bool (B, T): True from position 0 through the first ``stop_token_id`` inclusive;
        a row without one (truncated), or any row when ``stop_token_id`` is None, is all
        True.

    Example:
        >>> response_mask(torch.tensor([[5, 2, 0, 0], [5, 6, 7, 8]]), stop_token_id=2)
        tensor([[ True,  True, False, False],
                [ True,  True,  True,  True]])
    """
    if responses.dim() != 2:
        raise ValueError(f"responses must have shape (B, T), got shape {tuple(responses.shape)}")
    if stop_token_id is None:
        return torch.ones_like(responses, dtype=torch.bool)
    # One path for an int (Python, NumPy or a 0-dim tensor) and a sequence of ids.
    stop_ids = torch.as_tensor(stop_token_id, device=responses.device).reshape(-1)
    is_stop = torch.isin(responses, stop_ids.to(responses.dtype))
    # stops_before[b, t] = sum(is_stop[b, :t])  (stop tokens strictly before t)
    stops_before = torch.cumsum(is_stop, dim=1) - is_stop.long()
    return stops_before == 0


def last_valid_index(response_mask: torch.Tensor) -> torch.Tensor:
    """Index of the last True position of each row (the EOS, or the last generated token).

    Args:
        response_mask: bool (B, T).

    Returns:
        long (B,): for a prefix mask, its length - 1. A row with no True position (or
        T == 0) gives -1; callers must not use -1 as an index (`shaped_rewards` places
        no score on such a row). The trainer never produces one: when T >= 1 the first
        generated token always counts.

    Example:
        >>> last_valid_index(torch.tensor([[True, True, False], [False, False, False]]))
        tensor([ 1, -1])
    """
    _check_mask(response_mask)
    batch, length = response_mask.shape
    if length == 0:
        return torch.full((batch,), -1, dtype=torch.long, device=response_mask.device)
    positions = torch.arange(length, device=response_mask.device)
    # max((t for t in range(T) if response_mask[b, t]), default=-1) for each row b
    return torch.where(response_mask, positions, -1).amax(dim=1)


# --------------------------------------------------------------------------- rewards


def kl_penalty(
    logprobs: torch.Tensor, ref_logprobs: torch.Tensor, estimator: str = "k1"
) -> torch.Tensor:
    """Per-token estimate of KL(pi || pi_ref) from tokens sampled from pi.

    With ``logr = ref_logprobs - logprobs`` (J. Schulman, "Approximating KL divergence",
    http://joschu.net/blog/kl-approx.html):
    ``k1 = -logr`` (unbiased, can be negative), ``k2 = logr**2 / 2`` (biased, >= 0),
    ``k3 = exp(logr) - 1 - logr`` (unbiased, >= 0).

    Args:
        logprobs: log pi(a_t | s_t) of the sampled tokens, shape (B, T).
        ref_logprobs: log pi_ref(a_t | s_t) of the same tokens, shape (B, T).
        estimator: "k1", "k2" or "k3".

    Returns:
        (B, T) per-token estimates (no masking; see `shaped_rewards`).
    """
    if estimator not in KL_ESTIMATORS:
        raise ValueError(
            f"kl_penalty got estimator={estimator!r}; allowed values are "
            f"{', '.join(repr(e) for e in KL_ESTIMATORS)}"
        )
    _check_same_shape(logprobs=logprobs, ref_logprobs=ref_logprobs)
    log_ratio = ref_logprobs - logprobs
    if estimator == "k1":
        return -log_ratio
    if estimator == "k2":
        return log_ratio.square() / 2
    # expm1 is exp(logr) - 1 without the cancellation near logr = 0
    return torch.expm1(log_ratio) - log_ratio


def shaped_rewards(
    logprobs: torch.Tensor,
    ref_logprobs: torch.Tensor,
    scores: torch.Tensor,
    response_mask: torch.Tensor,
    kl_coef: Union[float, torch.Tensor],
    kl_estimator: str = "k1",
    *,
    kl: Optional[torch.Tensor] = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token rewards: a KL penalty on every valid token, the RM score on the last one.

    Args:
        logprobs: log pi_old(a_t | s_t) of the sampled tokens, shape (B, T).
        ref_logprobs: log pi_ref(a_t | s_t), shape (B, T).
        scores: reward-model score per sequence, shape (B,).
        response_mask: bool (B, T).
        kl_coef: beta >= 0, a float or a 0-dim tensor.
        kl_estimator: "k1", "k2" or "k3" (see `kl_penalty`).
        kl: the per-token KL estimates, (B, T), when the caller already has them (e.g. for
            logging): used as they are (only their masked-in values), so the estimate is
            computed once; None computes them here from the log-probs.

    Returns:
        ``(rewards, non_score_rewards)``, both (B, T) in the promoted float dtype:
        ``non_score_rewards = -kl_coef * KL_t`` on valid tokens and exactly 0 elsewhere
        (whatever logprobs hold there, inf included); ``rewards`` is that plus
        ``scores[b]`` at ``last_valid_index(response_mask)[b]`` (the EOS when present,
        else the last generated token). A row with no valid token gets no score.
    """
    _check_mask(response_mask)
    _check_same_shape(logprobs=logprobs, ref_logprobs=ref_logprobs, response_mask=response_mask)
    if scores.shape != response_mask.shape[:1]:
        raise ValueError(
            f"scores must have shape (B,) = {tuple(response_mask.shape[:1])}, "
            f"got {tuple(scores.shape)}"
        )
    dtype = _float_dtype(logprobs, ref_logprobs, scores)
    zero = torch.zeros((), dtype=dtype, device=logprobs.device)
    if kl is None:
        # select before computing, so garbage outside the mask never reaches exp() or products
        kl = kl_penalty(
            torch.where(response_mask, logprobs.to(dtype), zero),
            torch.where(response_mask, ref_logprobs.to(dtype), zero),
            kl_estimator,
        )
    _check_same_shape(kl=kl, response_mask=response_mask)
    non_score_rewards = torch.where(response_mask, -kl_coef * torch.where(response_mask, kl.to(dtype), zero), zero)
    positions = torch.arange(response_mask.shape[1], device=response_mask.device)
    at_end = positions[None, :] == last_valid_index(response_mask)[:, None]
    # rewards[b, last[b]] += scores[b] for each row b with last[b] >= 0
    rewards = non_score_rewards + torch.where(at_end, scores.to(dtype)[:, None], zero)
    return rewards, non_score_rewards


# --------------------------------------------------------------------------- GAE


Lambda = Union[float, torch.Tensor]  # one GAE lambda for the batch, (B,) one per sequence, or (B, T) one per token


def _check_lambda(name: str, lam: Lambda, batch: int, length: Optional[int] = None) -> Lambda:
    """``lam`` as a float, a (B,) float tensor or, where ``length`` is given, a (B, T) one; every
    value in [0, 1] (a 0-dim tensor -> float). A (B, T) lambda is read at the token whose
    recursion step it weights: ``A_t = delta_t + gamma * lam[b, t] * A_{t+1}``."""
    if not isinstance(lam, torch.Tensor):
        _check_range(name, lam, 0.0, 1.0)
        return lam
    if lam.dim() == 0:
        return _check_lambda(name, lam.item(), batch, length)
    if tuple(lam.shape) != (batch,) and (length is None or tuple(lam.shape) != (batch, length)):
        per_token = "" if length is None else f" or a (B, T) tensor with one per token (T = {length})"
        raise ValueError(
            f"{name} must be a float, a (B,) tensor with one value per sequence (B = {batch}){per_token}, "
            f"got shape {tuple(lam.shape)}"
        )
    outside = ~((lam >= 0) & (lam <= 1))  # nan is outside too
    if outside.any():
        first = tuple(int(i) for i in outside.nonzero()[0])
        where = first[0] if len(first) == 1 else first
        raise ValueError(
            f"{name} must be in [0.0, 1.0] for every sequence, got {name}[{where}]={lam[first].item()!r}")
    return lam if lam.is_floating_point() else lam.float()


def _check_gae_args(token_rewards, values, response_mask, gamma, gae_lambda) -> Lambda:
    _check_mask(response_mask)
    _check_same_shape(token_rewards=token_rewards, values=values, response_mask=response_mask)
    if response_mask.dim() != 2:
        raise ValueError(f"response_mask must have shape (B, T), got {tuple(response_mask.shape)}")
    _check_range("gamma", gamma, 0.0, 1.0)
    return _check_lambda("gae_lambda", gae_lambda, *response_mask.shape)


def masked_gae_loop(
    token_rewards: torch.Tensor,
    values: torch.Tensor,
    response_mask: torch.Tensor,
    gamma: float,
    gae_lambda: Lambda,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Reference GAE: the plain reverse loop over T (batched over B). See `masked_gae`.

    Kept as the readable definition that `masked_gae` is tested against (they agree to
    ~1e-6 of the magnitude of the summed terms in fp32); too slow for long T.

    Args and Returns: as `masked_gae` (``gae_lambda`` a float or a (B,) tensor).
    """
    gae_lambda = _check_gae_args(token_rewards, values, response_mask, gamma, gae_lambda)
    dtype = _float_dtype(token_rewards, values)
    batch, length = response_mask.shape
    zero = torch.zeros((), dtype=dtype, device=values.device)
    rewards = torch.where(response_mask, token_rewards.to(dtype), zero)
    values = torch.where(response_mask, values.to(dtype), zero)
    if isinstance(gae_lambda, torch.Tensor):
        gae_lambda = gae_lambda.to(device=values.device, dtype=dtype)

    next_value = torch.zeros(batch, dtype=dtype, device=values.device)
    next_advantage = torch.zeros_like(next_value)
    next_valid = torch.zeros(batch, dtype=torch.bool, device=values.device)
    columns = []
    for t in reversed(range(length)):
        valid = response_mask[:, t]
        cont = valid & next_valid  # t + 1 is in the same run of True: not terminal
        next_value = torch.where(cont, next_value, zero)
        next_advantage = torch.where(cont, next_advantage, zero)
        delta = rewards[:, t] + gamma * next_value - values[:, t]
        lam_t = gae_lambda[:, t] if isinstance(gae_lambda, torch.Tensor) and gae_lambda.dim() == 2 else gae_lambda
        advantage = torch.where(valid, delta + gamma * lam_t * next_advantage, zero)
        columns.append(advantage)
        next_value, next_advantage, next_valid = values[:, t], advantage, valid
    if not columns:
        advantages = torch.zeros(batch, 0, dtype=dtype, device=values.device)
    else:
        advantages = torch.stack(columns[::-1], dim=1)
    returns = torch.where(response_mask, advantages + values, zero)
    return advantages, returns


def _masked_deltas(token_rewards, values, response_mask, gamma):
    """TD errors inside the mask: ``(deltas, values, cont, zero)``, all (B, T) but ``zero`` (0-dim).

    ``values`` is the input with 0 outside the mask, ``cont`` says that t + 1 continues t's
    episode, ``deltas[b, t] = r_t + gamma * V_{t+1} * cont[b, t] - V_t`` (0 outside the mask).
    """
    dtype = _float_dtype(token_rewards, values)
    zero = torch.zeros((), dtype=dtype, device=values.device)
    rewards = torch.where(response_mask, token_rewards.to(dtype), zero)
    values = torch.where(response_mask, values.to(dtype), zero)
    # cont[b, t] = response_mask[b, t] and t + 1 < T and response_mask[b, t + 1]
    cont = response_mask & _shift_left(response_mask, 1)
    # next_values[b, t] = values[b, t + 1] if cont[b, t] else 0
    next_values = torch.where(cont, _shift_left(values, 1), zero)
    deltas = torch.where(response_mask, rewards + gamma * next_values - values, zero)
    return deltas, values, cont, zero


def _masked_gae_scan(deltas, cont, response_mask, gamma: float, gae_lambda: Lambda, zero) -> torch.Tensor:
    """``A[b, t] = deltas[b, t] + gamma * lambda_bt * cont[b, t] * A[b, t + 1]``, 0 outside the mask
    (``lambda_bt`` the float, row b's of a (B,) lambda, or [b, t] of a (B, T) one)."""
    if isinstance(gae_lambda, torch.Tensor):
        discount = gamma * gae_lambda.to(device=deltas.device, dtype=deltas.dtype)  # (B,) or (B, T)
    else:
        discount = gamma * gae_lambda
    advantages = _reverse_discounted_scan(deltas, cont, discount)
    return torch.where(response_mask, advantages, zero)


def masked_gae(
    token_rewards: torch.Tensor,
    values: torch.Tensor,
    response_mask: torch.Tensor,
    gamma: float,
    gae_lambda: Lambda,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Generalised advantage estimation inside the mask, without a Python loop over T or B.

    ``delta_t = r_t + gamma * V_{t+1} - V_t`` and ``A_t = delta_t + gamma * lambda * A_{t+1}``,
    where ``V_{t+1}`` and ``A_{t+1}`` are 0 when position t+1 does not exist or is not
    valid: a valid position followed by an invalid one is terminal. Masks are prefixes in
    practice; a mask with holes is read as several episodes, one per contiguous run of
    True. Values stored where the mask is False (even nan/inf) do not influence anything.

    The recursion is solved by `_reverse_discounted_scan`, a parallel prefix scan of
    ceil(log2(T)) whole-tensor steps: every coefficient is a product of factors in
    [0, 1] (never c**-t, which overflows fp32 for long T) and memory stays O(B * T)
    (a few MB at B=64, T=4096). `masked_gae_loop` is the reference it is tested against.

    Args:
        token_rewards: shaped reward per token r_t, shape (B, T).
        values: critic values V_t of the rollout (old) policy, shape (B, T).
        response_mask: bool (B, T).
        gamma: discount in [0, 1].
        gae_lambda: GAE lambda in [0, 1]: a float, a (B,) tensor with one lambda per
            sequence (e.g. `length_adaptive_lam`), or a (B, T) tensor with one per token (e.g.
            `turn_length_adaptive_lam`), read at the step it weights.

    Returns:
        ``(advantages, returns)``, both (B, T), computed and returned in the inputs'
        promoted dtype (at least float32), exactly 0 outside the mask;
        ``returns = advantages + values`` on valid positions. For value targets with their
        own lambda see `masked_gae_decoupled`.
    """
    gae_lambda = _check_gae_args(token_rewards, values, response_mask, gamma, gae_lambda)
    deltas, values, cont, zero = _masked_deltas(token_rewards, values, response_mask, gamma)
    advantages = _masked_gae_scan(deltas, cont, response_mask, gamma, gae_lambda, zero)
    returns = torch.where(response_mask, advantages + values, zero)
    return advantages, returns


def masked_gae_decoupled(
    token_rewards: torch.Tensor,
    values: torch.Tensor,
    response_mask: torch.Tensor,
    gamma: float,
    gae_lambda: Lambda,
    value_lambda: Optional[Lambda] = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """GAE with one lambda for the policy's advantages and another for the critic's targets.

    Decoupled GAE (VC-PPO, arXiv 2503.01491; VAPO, 2504.05118): with the TD errors
    ``delta_t`` of `masked_gae`, ``A_t = sum_k (gamma * gae_lambda)**k * delta_{t+k}`` and
    ``R_t = V_t + sum_k (gamma * value_lambda)**k * delta_{t+k}`` (sums within the
    episode). ``value_lambda = 1`` makes ``R_t`` the Monte-Carlo return
    ``sum_k gamma**k * r_{t+k}`` (the sum telescopes; the terminal value is 0), a target
    free of the critic's own bias.

    Equivalent to (two runs of the same reverse loop, one per lambda)::

        advantages, _ = masked_gae_loop(r, V, mask, gamma, gae_lambda)
        value_advantages, _ = masked_gae_loop(r, V, mask, gamma, value_lambda)
        returns = where(mask, value_advantages + V, 0)

    Args:
        token_rewards, values, response_mask, gamma: as `masked_gae`, (B, T).
        gae_lambda: the policy's lambda: a float in [0, 1] or a (B,) tensor.
        value_lambda: the value targets' lambda, a float in [0, 1] or a (B,) tensor; None
            uses ``gae_lambda`` (then the result is exactly `masked_gae`'s).

    Returns:
        ``(advantages, returns)``, both (B, T) in the inputs' promoted dtype (at least
        float32), exactly 0 outside the mask.
    """
    gae_lambda = _check_gae_args(token_rewards, values, response_mask, gamma, gae_lambda)
    if value_lambda is not None:
        value_lambda = _check_lambda("value_lambda", value_lambda, *response_mask.shape)
    deltas, values, cont, zero = _masked_deltas(token_rewards, values, response_mask, gamma)
    advantages = _masked_gae_scan(deltas, cont, response_mask, gamma, gae_lambda, zero)
    if value_lambda is None:
        value_advantages = advantages
    else:
        value_advantages = _masked_gae_scan(deltas, cont, response_mask, gamma, value_lambda, zero)
    returns = torch.where(response_mask, value_advantages + values, zero)
    return advantages, returns


def length_adaptive_lam(
    response_mask: torch.Tensor, alpha: float, dtype: torch.dtype = torch.float32, minimum: float = 0.0
) -> torch.Tensor:
    """VAPO's length-adaptive GAE lambda, one per sequence: ``max(minimum, 1 - 1 / (alpha * L))``.

    L is the number of valid tokens of the sequence, so the effective horizon
    ``1 / (1 - lambda)`` is ``alpha * L``: a long response keeps more of its distant reward
    in each token's advantage (VAPO, arXiv 2504.05118, uses alpha = 0.05). Where
    ``alpha * L <= 1`` (an empty row included) the formula would give lambda <= 0; it is
    clamped to ``minimum`` there (0 by default: VAPO's pure TD step, which with alpha = 0.05
    every sequence of <= 20 tokens gets). Equivalent to::

        [max(minimum, 1 - 1 / (alpha * L)) if alpha * L > 1 else minimum for L in response_mask.sum(1)]

    Args:
        response_mask: bool (B, T); a row's L counts every True position (holes included).
        alpha: > 0, finite.
        dtype: float dtype of the result (computed in float64 unless on MPS).
        minimum: the floor, in [0, 1].

    Returns:
        (B,) lambdas in [minimum, 1), ready for ``gae_lambda`` of `masked_gae` /
        `masked_gae_decoupled`.

    Example:
        >>> length_adaptive_lam(torch.tensor([[True] * 40, [True] * 10 + [False] * 30]), 0.05)
        tensor([0.5000, 0.0000])
        >>> length_adaptive_lam(torch.tensor([[True] * 40, [True] * 10 + [False] * 30]), 0.05, minimum=0.9)
        tensor([0.9000, 0.9000])
    """
    _check_mask(response_mask)
    if response_mask.dim() != 2:
        raise ValueError(f"response_mask must have shape (B, T), got {tuple(response_mask.shape)}")
    acc = _accumulation_dtype(response_mask)
    return _lam_of_length(response_mask.sum(dim=1).to(acc), alpha, minimum).to(dtype)


def _lam_of_length(length: torch.Tensor, alpha: float, minimum: float) -> torch.Tensor:
    """``max(minimum, 1 - 1 / (alpha * length))`` elementwise, ``minimum`` where ``alpha * length <= 1``."""
    if not 0 < alpha < math.inf:  # nan fails too
        raise ValueError(f"alpha must be a finite number > 0 (VAPO uses 0.05), got alpha={alpha!r}")
    _check_range("minimum", minimum, 0.0, 1.0)
    horizon = alpha * length  # alpha * L
    safe_horizon = torch.where(horizon > 1, horizon, 1)  # double where: no 1/0 in either branch
    return torch.where(horizon > 1, 1 - 1 / safe_horizon, 0).clamp(min=minimum)


def turn_length_adaptive_lam(
    action_mask: torch.Tensor, alpha: float, dtype: torch.dtype = torch.float32, minimum: float = 0.0
) -> torch.Tensor:
    """The length-adaptive lambda of `length_adaptive_lam` with L the length of each token's turn.

    Each run of True in ``action_mask`` is one turn (`turn_ends`); every token of a turn of
    ``l`` tokens gets ``max(minimum, 1 - 1 / (alpha * l))``, so a short tool call between long
    replies is not held to the episode's horizon, nor a long reply to a short call's. With one
    run per row (a plain response) every token gets its row's `length_adaptive_lam`. SAO's
    choice for agent turns is alpha = 1.5 (lambda 0.33 at l = 1, 0.93 at l = 10). Equivalent to::

        for b, each run [s, e] of True in action_mask[b]:
            lam[b, s:e + 1] = max(minimum, 1 - 1 / (alpha * (e - s + 1)))   # 0 off the runs

    Args:
        action_mask: bool (B, T), True = a token the policy sampled.
        alpha: > 0, finite. dtype: float dtype of the result. minimum: the floor, in [0, 1].

    Returns:
        (B, T) lambdas, 0 where ``action_mask`` is False (no GAE step reads them there), ready for
        ``gae_lambda`` of `action_masked_gae` / `masked_gae`.

    Example (a turn of 2 tokens, an environment token, a turn of 4):
        >>> turn_length_adaptive_lam(torch.tensor([[True, True, False, True, True, True, True]]), 0.5)
        tensor([[0.0000, 0.0000, 0.0000, 0.5000, 0.5000, 0.5000, 0.5000]])
    """
    _check_mask(action_mask, "action_mask")
    if action_mask.dim() != 2:
        raise ValueError(f"action_mask must have shape (B, T), got {tuple(action_mask.shape)}")
    acc = _accumulation_dtype(action_mask)
    before = torch.nn.functional.pad(action_mask[:, :-1], (1, 0))  # before[b, t] = action_mask[b, t - 1]
    turn = torch.cumsum(action_mask & ~before, dim=1)  # the turn number of t, 1-based, on action tokens
    index = torch.where(action_mask, turn, 0)  # column 0 of `length` collects the other tokens
    length = torch.zeros(action_mask.shape[0], action_mask.shape[1] + 1, dtype=acc, device=action_mask.device)
    length = length.scatter_add(1, index, action_mask.to(acc))  # length[b, k] = tokens of turn k
    lam = _lam_of_length(length.gather(1, index), alpha, minimum)
    return torch.where(action_mask, lam, 0).to(dtype)


def _shift_left(x: torch.Tensor, steps: int) -> torch.Tensor:
    """(B, T) -> (B, T) with ``out[:, t] = x[:, t + steps]``, and 0 where t + steps >= T."""
    return torch.nn.functional.pad(x[:, steps:], (0, min(steps, x.shape[1])))


def _reverse_discounted_scan(
    x: torch.Tensor, cont: torch.Tensor, discount: Union[float, torch.Tensor]
) -> torch.Tensor:
    """Solve ``y[:, t] = x[:, t] + c * cont[:, t] * y[:, t + 1]`` (``y[:, T] = 0``) for all t.

    Naive form: ``for t in reversed(range(T)): y[:, t] = x[:, t] + a[:, t] * y[:, t + 1]``
    with ``a = c * cont``. Here: a parallel (Hillis-Steele) scan, ceil(log2(T)) steps of
    whole-tensor ops. After the step with span s, ``y[:, t]`` holds the terms k in
    [t, t + 2s) and ``a[:, t]`` the product ``a[:, t] * ... * a[:, t + 2s - 1]``, so that
    step s does ``y[:, t] += a[:, t] * y[:, t + s]`` and ``a[:, t] *= a[:, t + s]``.

    Numerically safe for any T: every coefficient is a product of factors in [0, 1] (no
    c**-t rescaling, which overflows fp32 once T is a few hundred), each term goes
    through O(log T) roundings, and memory is a few (B, T) tensors.

    Args:
        x: (B, T) float, finite. cont: (B, T) bool. discount: c in [0, 1], a float, a
            (B,) tensor of x's dtype (one c per row) or a (B, T) one (``c[b, t]`` weights
            ``y[:, t + 1]`` in ``y[:, t]``).

    Returns:
        (B, T) y, same dtype as x.
    """
    y = x
    if isinstance(discount, torch.Tensor):
        per_row = discount[:, None] if discount.dim() == 1 else discount  # (B, 1) or (B, T)
    else:
        per_row = torch.full((), discount, dtype=x.dtype, device=x.device)
    a = torch.where(cont, per_row, 0)
    span = 1
    while span < x.shape[1]:
        y = y + a * _shift_left(y, span)
        a = a * _shift_left(a, span)
        span *= 2
    return y


# --------------------------------------------------------------------------- statistics


def masked_mean(
    x: torch.Tensor, mask: torch.Tensor, dim: Optional[Union[int, Sequence[int]]] = None
) -> torch.Tensor:
    """Mean of ``x`` over the positions where ``mask`` is True.

    Args:
        x: any shape, e.g. (B, T); non-float inputs are converted to float32.
        mask: bool, broadcastable to ``x.shape``.
        dim: dimension(s) to reduce; None reduces everything to a scalar.

    Returns:
        The mean; where nothing is valid (an empty mask or slice) it is 0, not nan.
    """
    _check_mask(mask, "mask")
    if not x.is_floating_point():
        x = x.float()
    mask = mask.expand(x.shape)
    zero = torch.zeros((), dtype=x.dtype, device=x.device)
    if dim is None:
        total, count = torch.where(mask, x, zero).sum(), mask.sum()
    else:
        total, count = torch.where(mask, x, zero).sum(dim), mask.sum(dim)
    # sum / count, and 0 where count == 0
    return torch.where(count > 0, total / count.clamp(min=1).to(x.dtype), zero)


def masked_var(x: torch.Tensor, mask: torch.Tensor, unbiased: bool = True) -> torch.Tensor:
    """Variance of ``x`` over the positions where ``mask`` is True (local, two-pass).

    Args:
        x: any shape, e.g. (B, T).
        mask: bool, broadcastable to ``x.shape``.
        unbiased: divide by n - 1 (Bessel) instead of n.

    Returns:
        Scalar: ``sum((x - mean)**2) / (n - 1)`` (or ``/ n``). With n == 1 the unbiased
        divisor is 0: we return 0, which is also the biased value. With n == 0: 0.
    """
    _check_mask(mask, "mask")
    if not x.is_floating_point():
        x = x.float()
    mask = mask.expand(x.shape)
    zero = torch.zeros((), dtype=x.dtype, device=x.device)
    x = torch.where(mask, x, zero)  # inf outside the mask must not reach (x - mean)**2
    mean = masked_mean(x, mask)
    squared_deviations = torch.where(mask, (x - mean).square(), zero).sum()
    count = mask.sum()
    return squared_deviations / (count - int(unbiased)).clamp(min=1).to(x.dtype)


def masked_token_mean(
    x: torch.Tensor, mask: torch.Tensor, num_tokens: Optional[Union[float, torch.Tensor]] = None
) -> torch.Tensor:
    """``sum(x[mask]) / num_tokens``: this batch's share of a mean over ``num_tokens`` tokens.

    A loss over a mini-batch cut into micro-batches (and processes) must divide each
    micro-batch's token sum by the token count of the WHOLE mini-batch: the mean of
    per-micro-batch means weighs a token of a short micro-batch more, and changes with the
    micro-batch size. Summing this over the micro-batches gives the mini-batch token mean.

    Args:
        x: any shape, e.g. (B, T). mask: bool, same shape.
        num_tokens: the divisor (> 0); None divides by ``mask.sum()`` (``masked_mean``).

    Returns:
        Scalar, differentiable in ``x``.

    Example:
        >>> masked_token_mean(torch.tensor([[1., 2.], [3., 9.]]), torch.tensor([[True, True], [True, False]]), 6)
        tensor(1.)
    """
    if num_tokens is None:
        return masked_mean(x, mask)
    _check_mask(mask, "mask")
    if not x.is_floating_point():
        x = x.float()
    total = torch.where(mask.expand(x.shape), x, torch.zeros((), dtype=x.dtype, device=x.device)).sum()
    return total / torch.as_tensor(num_tokens, dtype=x.dtype, device=x.device).clamp(min=1e-12)


def _check_divisor(name: str, value) -> None:
    if value is not None and not isinstance(value, torch.Tensor) and not value > 0:
        raise ValueError(f"{name} must be > 0 (a count of the whole mini-batch), got {name}={value!r}")


def masked_sequence_mean(
    x: torch.Tensor, mask: torch.Tensor, num_sequences: Optional[Union[float, torch.Tensor]] = None
) -> torch.Tensor:
    """This batch's share of the mean over ``num_sequences`` sequences of each one's token mean.

    TRL GRPO's ``loss_type="grpo"``: every sequence weighs the same, whatever its length
    (so a token of a short sequence weighs more). Equivalent to::

        sum(sum(x[b][t] for t in range(T) if mask[b][t]) / max(1, sum(mask[b])) for b in range(B))
        / num_sequences

    Each sequence's mean is its own, so summing this over the micro-batches (and processes)
    of a mini-batch, each with the mini-batch's ``num_sequences``, gives the whole
    mini-batch's value.

    Args:
        x: (B, T). mask: bool (B, T); a row without a valid token contributes 0.
        num_sequences: the divisor (> 0); None divides by B (this batch's mean).

    Returns:
        Scalar, differentiable in ``x``.

    Example:
        >>> masked_sequence_mean(torch.tensor([[1., 3.], [6., 9.]]), torch.tensor([[True, True], [True, False]]), 4)
        tensor(2.)
    """
    _check_mask(mask, "mask")
    _check_same_shape(x=x, mask=mask)
    _check_divisor("num_sequences", num_sequences)
    if not x.is_floating_point():
        x = x.float()
    per_sequence = masked_mean(x, mask, dim=-1)  # (B,), 0 for an empty row
    divisor = x.shape[0] if num_sequences is None else num_sequences
    return per_sequence.sum() / torch.as_tensor(divisor, dtype=x.dtype, device=x.device).clamp(min=1e-12)


def masked_loss_aggregate(
    x: torch.Tensor,
    mask: torch.Tensor,
    loss_type: str = "dapo",
    *,
    num_tokens: Optional[Union[float, torch.Tensor]] = None,
    num_sequences: Optional[Union[float, torch.Tensor]] = None,
    max_completion_length: Optional[int] = None,
) -> torch.Tensor:
    """A per-token loss reduced to this batch's share of the mini-batch loss, by ``loss_type``.

    The names are TRL ``GRPOConfig.loss_type``'s, for the same normalisations:

    - ``"dapo"``: ``sum(x[mask]) / num_tokens``, the token mean over the mini-batch on every
      process (`masked_token_mean`; this package's loss before ``loss_type`` existed);
    - ``"grpo"``: ``sum_b mean_t(x[b]) / num_sequences``, the mean of each sequence's token
      mean (`masked_sequence_mean`);
    - ``"dr_grpo"``: ``sum(x[mask]) / (num_sequences * max_completion_length)``, Dr. GRPO's
      constant normaliser (arXiv 2503.20783), free of any length weighting.

    Pass the normalisers of the WHOLE mini-batch (over every process): then the values of
    its micro-batches and shards add up to the mini-batch's, however it is cut. None
    normalises by this batch alone (``num_tokens = mask.sum()``, ``num_sequences = B``,
    ``max_completion_length = T``). A normaliser the loss type does not use is ignored.

    Args:
        x: (B, T) per-token loss (or objective). mask: bool (B, T).
        loss_type: one of ``LOSS_TYPES``.
        num_tokens: valid tokens of the mini-batch ("dapo").
        num_sequences: sequences of the mini-batch ("grpo", "dr_grpo").
        max_completion_length: the generation limit, TRL's name ("dr_grpo").

    Returns:
        Scalar, differentiable in ``x``.

    Example:
        >>> x, mask = torch.tensor([[1., 3.], [6., 9.]]), torch.tensor([[True, True], [True, False]])
        >>> [masked_loss_aggregate(x, mask, t).item() for t in LOSS_TYPES]  # 10/3, (2 + 6)/2, 10/(2*2)
        [3.3333332538604736, 4.0, 2.5]
    """
    if loss_type not in LOSS_TYPES:
        raise ValueError(
            f"loss_type must be one of {', '.join(repr(t) for t in LOSS_TYPES)}, got loss_type={loss_type!r}"
        )
    if loss_type == "dapo":
        return masked_token_mean(x, mask, num_tokens)
    if loss_type == "grpo":
        return masked_sequence_mean(x, mask, num_sequences)
    _check_mask(mask, "mask")
    _check_same_shape(x=x, mask=mask)
    _check_divisor("num_sequences", num_sequences)
    _check_divisor("max_completion_length", max_completion_length)
    sequences = x.shape[0] if num_sequences is None else num_sequences
    length = x.shape[-1] if max_completion_length is None else max_completion_length
    return masked_token_mean(x, mask, sequences * length)


def _distributed() -> bool:
    return dist.is_available() and dist.is_initialized()


def _all_reduce_sum(t: torch.Tensor) -> torch.Tensor:
    """Sum ``t`` over all processes (identity when not distributed).

    The value is the all-reduced one; the gradient flows to this process's ``t`` only,
    which is the right gradient: the other processes' parts are constants here.
    """
    if not _distributed():
        return t
    reduced = t.detach().clone()
    dist.all_reduce(reduced, op=dist.ReduceOp.SUM)
    return reduced + (t - t.detach())


def _global_mean_var(x, mask, unbiased):
    """`masked_global_mean_var` in the accumulation dtype (float64 unless on MPS)."""
    acc = _accumulation_dtype(x)
    xs = torch.where(mask, x.to(acc), torch.zeros((), dtype=acc, device=x.device))
    # pass 1: global sum and count -> global mean
    sum_count = _all_reduce_sum(torch.stack([xs.sum(), mask.sum().to(acc)]))
    total, count = sum_count[0], sum_count[1]
    mean = total / count.clamp(min=1)
    # pass 2: global sum of squared deviations from the global mean (no E[x^2] - E[x]^2
    # cancellation)
    squared_deviations = _all_reduce_sum(torch.where(mask, (xs - mean).square(), 0).sum())
    var = squared_deviations / (count - int(unbiased)).clamp(min=1)
    return mean, var


def masked_global_mean_var(
    x: torch.Tensor, mask: torch.Tensor, unbiased: bool = True
) -> tuple[torch.Tensor, torch.Tensor]:
    """Mean and variance of the valid entries of ``x`` across ALL processes.

    When ``torch.distributed`` is initialised this is a collective: every process must
    call it. It all-reduces the sum and the count, then the sum of squared deviations
    from the global mean (two passes, accumulated in float64), so every process gets the
    statistics of the concatenated batch; otherwise the local statistics. Masked-out
    positions are never counted.

    Args:
        x: any shape, e.g. (B, T); shapes may differ between processes.
        mask: bool, same shape as ``x``.
        unbiased: divide by N - 1 (N = global count) instead of N.

    Returns:
        ``(mean, var)``, 0-dim tensors of ``x``'s float dtype. N == 0 gives (0, 0);
        N == 1 gives var 0 (as `masked_var`).
    """
    _check_mask(mask, "mask")
    _check_same_shape(x=x, mask=mask)
    dtype = x.dtype if x.is_floating_point() else torch.float32
    mean, var = _global_mean_var(x, mask, unbiased)
    return mean.to(dtype), var.to(dtype)


def _resolve_keep_mean(shift_mean: Optional[bool], keep_mean: Optional[bool]) -> bool:
    if keep_mean is None:
        return shift_mean is not None and not shift_mean
    if shift_mean is not None and bool(shift_mean) == bool(keep_mean):
        raise ValueError(
            f"masked_global_whiten got shift_mean={shift_mean!r} and keep_mean={keep_mean!r}, "
            f"which disagree (keep_mean=True means shift_mean=False); pass keep_mean only"
        )
    return bool(keep_mean)


def masked_global_whiten(
    x: torch.Tensor,
    mask: torch.Tensor,
    shift_mean: Optional[bool] = None,
    *,
    keep_mean: Optional[bool] = None,
    eps: float = 1e-8,
) -> torch.Tensor:
    """``(x - mean) / sqrt(var + eps)`` with the global masked statistics.

    Args:
        x: any shape, e.g. advantages (B, T).
        mask: bool, same shape as ``x``.
        shift_mean: accepted for TRL's call sites only (``shift_mean=False`` is
            ``keep_mean=True``); use ``keep_mean``. Opposite meanings raise ValueError.
        keep_mean: add the mean back after scaling (whitening rewards keeps their level);
            default False.
        eps: >= 0, added to the variance.

    Returns:
        Same shape and float dtype as ``x``; exactly 0 outside the mask. Statistics from
        `masked_global_mean_var` (unbiased; a collective when distributed). With one
        valid element the variance is 0 and the output is finite: 0 (or the mean when
        keeping it); with ``var + eps == 0`` the centred value (0) is not scaled.
    """
    keep = _resolve_keep_mean(shift_mean, keep_mean)
    _check_mask(mask, "mask")
    _check_same_shape(x=x, mask=mask)
    if eps < 0:
        raise ValueError(f"eps must be >= 0, got eps={eps!r}")
    dtype = x.dtype if x.is_floating_point() else torch.float32
    mean, var = _global_mean_var(x, mask, unbiased=True)
    acc = mean.dtype
    xs = torch.where(mask, x.to(acc), torch.zeros((), dtype=acc, device=x.device))
    std = torch.sqrt(var + eps)
    safe_std = torch.where(std > 0, std, 1)  # double where: no inf in either branch
    whitened = torch.where(std > 0, (xs - mean) / safe_std, 0)
    if keep:
        whitened = whitened + mean
    return torch.where(mask, whitened, 0).to(dtype)


# --------------------------------------------------------------------------- losses


def _check_dual_clip(dual_clip: Optional[float]) -> None:
    if dual_clip is not None and not 1 < dual_clip < math.inf:  # nan fails too
        raise ValueError(
            f"dual_clip must be a finite number > 1 (the bound c of max(min(r*A, clip(r)*A), c*A) for A < 0; "
            f"3.0 is common) or None to turn it off, got dual_clip={dual_clip!r}"
        )


def masked_clipped_surrogate(
    new_logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    cliprange: float,
    num_tokens: Optional[Union[float, torch.Tensor]] = None,
    *,
    cliprange_high: Optional[float] = None,
    dual_clip: Optional[float] = None,
    loss_type: str = "dapo",
    num_sequences: Optional[Union[float, torch.Tensor]] = None,
    max_completion_length: Optional[int] = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """PPO's clipped policy loss from log-probs, averaged over all valid tokens of the batch.

    ``ratio = exp(where(mask, new_logprobs - old_logprobs, 0))``: the log-ratio is selected
    before ``exp``, so garbage (even inf) outside the mask reaches neither the loss nor its
    gradient. Per token the objective is ``min(ratio * A, clip(ratio, 1 - eps, 1 + eps_high) * A)``
    (DAPO's clip-higher when ``eps_high > eps``, arXiv 2503.14476); with ``dual_clip = c``
    (dual-clip PPO, Ye et al. 2020, arXiv 1912.09729) a token with ``A < 0`` takes
    ``max(that, c * A)``, so its loss is at most ``c * |A|`` however large the ratio grows
    (there, no gradient flows).

    Args:
        new_logprobs: log pi_new(a_t|s_t) of the policy being trained, shape (B, T).
        old_logprobs: log pi_old(a_t|s_t) from the rollout, shape (B, T).
        advantages: (B, T), usually whitened and detached.
        response_mask: bool (B, T).
        cliprange: eps >= 0; the ratio is clipped to [1 - eps, 1 + eps].
        num_tokens: divide the token sum by this instead of this batch's valid-token count
            (see ``masked_token_mean``); None: the mean over this batch.
        cliprange_high: eps_high >= 0, the upper clip ``1 + eps_high``; None: ``cliprange``.
        dual_clip: c > 1, or None (off).
        loss_type, num_sequences, max_completion_length: how the per-token objective is
            reduced, see `masked_loss_aggregate` (``num_tokens`` serves "dapo", the default).

    Returns:
        ``(loss, stats)``: ``loss = -masked_mean(objective)`` (or the ``loss_type``
        reduction), and detached scalars over the valid tokens: ``clipfrac`` (share where
        the clipped term is strictly smaller, i.e. the one chosen), split by side into
        ``clipfrac_lower`` (A < 0, ratio < 1 - eps) and ``clipfrac_upper`` (A > 0,
        ratio > 1 + eps_high), ``clipfrac_dual`` (share where ``c * A`` is taken; 0 when off),
        ``ratio_mean``, ``ratio_max`` (-inf for an empty mask) and ``approxkl``
        (``0.5 * mean(log_ratio**2)``). Loss and means are 0 for an empty mask.
    """
    _check_mask(response_mask)
    _check_same_shape(
        new_logprobs=new_logprobs, old_logprobs=old_logprobs, advantages=advantages, response_mask=response_mask
    )
    _check_range("cliprange", cliprange, 0.0, float("inf"))
    if cliprange_high is not None:
        _check_range("cliprange_high", cliprange_high, 0.0, float("inf"))
    _check_dual_clip(dual_clip)
    high = cliprange if cliprange_high is None else cliprange_high
    dtype = _float_dtype(new_logprobs, old_logprobs, advantages)
    zero = torch.zeros((), dtype=dtype, device=new_logprobs.device)
    log_ratio = torch.where(response_mask, new_logprobs.to(dtype) - old_logprobs.to(dtype), zero)
    ratio = torch.exp(log_ratio)
    advantages = torch.where(response_mask, advantages.to(dtype), zero)
    unclipped = ratio * advantages
    clipped = torch.clamp(ratio, 1 - cliprange, 1 + high) * advantages
    objective = torch.minimum(unclipped, clipped)
    # dual clip: objective = max(objective, c * A) where A < 0 (c * A is finite: A is 0 off the mask)
    dual = torch.zeros_like(response_mask)
    if dual_clip is not None:
        dual = (advantages < 0) & (dual_clip * advantages > objective)
        objective = torch.where(dual, dual_clip * advantages, objective)
    loss = -masked_loss_aggregate(
        objective, response_mask, loss_type,
        num_tokens=num_tokens, num_sequences=num_sequences, max_completion_length=max_completion_length,
    )
    with torch.no_grad():
        chose_clipped = clipped < unclipped
        stats = {
            "clipfrac": masked_mean(chose_clipped.to(dtype), response_mask),
            "clipfrac_lower": masked_mean((chose_clipped & (advantages < 0)).to(dtype), response_mask),
            "clipfrac_upper": masked_mean((chose_clipped & (advantages > 0)).to(dtype), response_mask),
            "clipfrac_dual": masked_mean(dual.to(dtype), response_mask),
            "ratio_mean": masked_mean(ratio, response_mask),
            "ratio_max": ratio.masked_fill(~response_mask, float("-inf")).amax() if ratio.numel() else zero - math.inf,
            "approxkl": 0.5 * masked_mean(log_ratio.square(), response_mask),
        }
    return loss, {k: v.detach() for k, v in stats.items()}


def masked_clipped_value_loss(
    new_values: torch.Tensor,
    old_values: torch.Tensor,
    returns: torch.Tensor,
    response_mask: torch.Tensor,
    cliprange_value: Optional[float],
    num_tokens: Optional[Union[float, torch.Tensor]] = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Clipped value loss ``0.5 * masked_mean(max((V - R)**2, (clip(V) - R)**2))``.

    Args:
        new_values: V_t of the critic being trained, shape (B, T).
        old_values: V_old,t from the rollout, shape (B, T).
        returns: R_t targets (from `masked_gae`), shape (B, T).
        response_mask: bool (B, T).
        cliprange_value: eps_v >= 0, V is clipped to [V_old - eps_v, V_old + eps_v];
            None means no clipping.
        num_tokens: divide the token sum by this instead of this batch's valid-token count
            (see ``masked_token_mean``); None: the mean over this batch.

    Returns:
        ``(loss, stats)``: the loss scalar, and ``stats["clipfrac"]`` (detached), the share
        of valid tokens where the clipped term is strictly larger (the one chosen); 0
        without clipping.
    """
    _check_mask(response_mask)
    _check_same_shape(
        new_values=new_values, old_values=old_values, returns=returns, response_mask=response_mask
    )
    dtype = _float_dtype(new_values, old_values, returns)
    zero = torch.zeros((), dtype=dtype, device=new_values.device)
    new_values, old_values, returns = (
        torch.where(response_mask, t.to(dtype), zero) for t in (new_values, old_values, returns)
    )
    unclipped = (new_values - returns).square()
    if cliprange_value is None:
        return 0.5 * masked_token_mean(unclipped, response_mask, num_tokens), {"clipfrac": zero.clone()}
    _check_range("cliprange_value", cliprange_value, 0.0, float("inf"))
    # clip(V, V_old - eps, V_old + eps)
    clipped_values = torch.clamp(
        new_values, old_values - cliprange_value, old_values + cliprange_value
    )
    clipped = (clipped_values - returns).square()
    loss = 0.5 * masked_token_mean(torch.maximum(unclipped, clipped), response_mask, num_tokens)
    clipfrac = masked_mean((clipped > unclipped).to(dtype), response_mask).detach()
    return loss, {"clipfrac": clipfrac}


# --------------------------------------------------------------------------- logits


def _compute_dtype(logits: torch.Tensor) -> torch.dtype:
    return torch.float64 if logits.dtype == torch.float64 else torch.float32


def _check_logits(logits: torch.Tensor) -> None:
    if logits.dim() != 3:
        raise ValueError(f"logits must have shape (B, T, V), got {tuple(logits.shape)}")


def logprobs_from_logits(logits: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    """``log_softmax(logits)[..., tokens]`` without a (B, T, V) log-softmax.

    Computed as ``logits[token] - logsumexp(logits)``, one sequence at a time in float32
    (float64 for float64 logits): the extra memory is one (T, V) block, so bf16 logits
    are never upcast as a whole. (Under autograd, backward still keeps what it needs.)

    Args:
        logits: (B, T, V), any float dtype.
        tokens: long (B, T), the tokens whose log-probabilities are wanted.

    Returns:
        (B, T) float32 (float64 for float64 logits).
    """
    _check_logits(logits)
    if tuple(tokens.shape) != tuple(logits.shape[:2]):
        raise ValueError(
            f"tokens must have shape (B, T) = {tuple(logits.shape[:2])} to match logits "
            f"{tuple(logits.shape)}, got {tuple(tokens.shape)}"
        )
    dtype = _compute_dtype(logits)
    rows = []
    for row_logits, row_tokens in zip(logits, tokens):  # (T, V), (T,)
        row_logits = row_logits.to(dtype)
        picked = torch.gather(row_logits, -1, row_tokens[:, None]).squeeze(-1)
        rows.append(picked - torch.logsumexp(row_logits, dim=-1))
    if not rows:
        return torch.zeros(tokens.shape, dtype=dtype, device=logits.device)
    return torch.stack(rows)


def entropy_from_logits(logits: torch.Tensor) -> torch.Tensor:
    """Entropy of the next-token distribution at every position.

    ``H = -sum_v p_v * log p_v`` with ``log p = logits - logsumexp(logits)``, one sequence
    at a time in float32 (float64 for float64 logits). Banned tokens (logit -inf) add 0 to
    the entropy and to its gradient: log p is clamped to the dtype's finite minimum, so
    ``0 * -inf = nan`` never happens.

    Args:
        logits: (B, T, V), any float dtype.

    Returns:
        (B, T) float32 (float64 for float64 logits), in nats.
    """
    _check_logits(logits)
    dtype = _compute_dtype(logits)
    rows = []
    for row_logits in logits:  # (T, V)
        row_logits = row_logits.to(dtype)
        logp = row_logits - torch.logsumexp(row_logits, dim=-1, keepdim=True)
        logp = logp.clamp(min=torch.finfo(dtype).min)
        rows.append(-(logp.exp() * logp).sum(-1))
    if not rows:
        return torch.zeros(logits.shape[:2], dtype=dtype, device=logits.device)
    return torch.stack(rows)


def masked_entropy(
    logits: torch.Tensor, response_mask: torch.Tensor, num_tokens: Optional[Union[float, torch.Tensor]] = None
) -> torch.Tensor:
    """Mean token entropy over the valid tokens of the batch.

    Args:
        logits: (B, T, V). response_mask: bool (B, T).
        num_tokens: divide the token sum by this instead (see ``masked_token_mean``).

    Returns:
        Scalar (differentiable), 0 for an empty mask.
    """
    _check_mask(response_mask)
    _check_logits(logits)
    _check_same_shape(logits_BT=logits[..., 0], response_mask=response_mask)
    return masked_token_mean(entropy_from_logits(logits), response_mask, num_tokens)


def masked_explained_variance(
    values: torch.Tensor, returns: torch.Tensor, response_mask: torch.Tensor
) -> torch.Tensor:
    """``1 - Var[R - V] / Var[R]`` over the valid tokens (a diagnostic of the critic).

    1 is a perfect critic, 0 no better than a constant, negative worse than one.

    Args:
        values: V_t, shape (B, T). returns: R_t, shape (B, T). response_mask: bool (B, T).

    Returns:
        Detached scalar. When Var[R] == 0 (fewer than two valid tokens, or constant
        returns) the ratio is undefined and we return 0, not nan.
    """
    _check_mask(response_mask)
    _check_same_shape(values=values, returns=returns, response_mask=response_mask)
    dtype = _float_dtype(values, returns)
    zero = torch.zeros((), dtype=dtype, device=values.device)
    values = torch.where(response_mask, values.detach().to(dtype), zero)
    returns = torch.where(response_mask, returns.detach().to(dtype), zero)
    var_returns = masked_var(returns, response_mask)
    var_residual = masked_var(returns - values, response_mask)
    safe_var = torch.where(var_returns > 0, var_returns, 1)
    return torch.where(var_returns > 0, 1 - var_residual / safe_var, zero)


# --------------------------------------------------------------------------- episodes with turns
# A completion may hold tokens the policy did not sample (a tool result, an environment reply,
# template glue). ``action_mask`` (B, T) bool, inside ``response_mask``, is True where the policy
# sampled the token.


def _check_action_mask(response_mask: torch.Tensor, action_mask: torch.Tensor) -> None:
    _check_mask(response_mask)
    _check_mask(action_mask, "action_mask")
    _check_same_shape(response_mask=response_mask, action_mask=action_mask)
    if action_mask.dim() != 2:
        raise ValueError(f"action_mask must have shape (B, T), got {tuple(action_mask.shape)}")
    outside = action_mask & ~response_mask
    if outside.any():
        row, index = (int(i) for i in outside.nonzero()[0])
        raise ValueError(
            f"action_mask must lie inside response_mask: action_mask[{row}, {index}] is True but "
            f"response_mask[{row}, {index}] is False. Build it as `response_mask & env_mask` "
            "(a padding token is never an action)."
        )


def action_lengths(action_mask: torch.Tensor) -> torch.Tensor:
    """Number of tokens the policy sampled in each row (TRL's rule for ``completions/*_length``).

    The length-adaptive lambda over the action tokens is ``length_adaptive_lam(action_mask,
    alpha)``: it counts the True positions of the mask it is given, holes included.

    Args:
        action_mask: bool (B, T), True = the policy sampled this token.

    Returns:
        (B,) int64 counts.

    Example:
        >>> action_lengths(torch.tensor([[True, True, False, False, True], [False] * 5]))
        tensor([3, 0])
    """
    _check_mask(action_mask, "action_mask")
    if action_mask.dim() != 2:
        raise ValueError(f"action_mask must have shape (B, T), got {tuple(action_mask.shape)}")
    return action_mask.sum(dim=1)


def turn_ends(action_mask: torch.Tensor) -> torch.Tensor:
    """The last token of every model turn: each run of True in ``action_mask`` is one turn.

    In an episode with turns the policy's tokens come in runs separated by environment tokens
    (a tool's reply); a per-turn reward lands on the last token of its run.

    Args:
        action_mask: bool (B, T), True = the policy sampled this token.

    Returns:
        bool (B, T): True where ``action_mask[b, t]`` is True and ``action_mask[b, t + 1]`` is
        False (or ``t`` is the last column).

    Equivalent loop::

        for b, t: ends[b, t] = mask[b, t] and (t == T - 1 or not mask[b, t + 1])

    Example:
        >>> turn_ends(torch.tensor([[True, True, False, True, False], [True, True, True, True, True]]))
        tensor([[False,  True, False,  True, False],
                [False, False, False, False,  True]])
    """
    _check_mask(action_mask, "action_mask")
    if action_mask.dim() != 2:
        raise ValueError(f"action_mask must have shape (B, T), got {tuple(action_mask.shape)}")
    following = torch.zeros_like(action_mask)
    following[:, :-1] = action_mask[:, 1:]
    return action_mask & ~following


def add_token_rewards(
    rewards: torch.Tensor, token_rewards: torch.Tensor, response_mask: torch.Tensor,
    action_mask: Optional[torch.Tensor] = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token rewards (a process reward, a tool's) added to shaped rewards on the action tokens: the
    one place both the critic's GAE and the critic-free estimators add them.

    Args:
        rewards: (B, T) shaped rewards. token_rewards: (B, T). response_mask: bool (B, T).
        action_mask: bool (B, T) inside ``response_mask``, or None: every response token is an
            action. ``token_rewards`` must be 0 on the other response tokens: the rewards' scoring
            refuses a non-zero one there once per batch, naming the reward
            (``rewards.scoring.evaluate_rewards_per_token`` with :func:`check_rewards_on_actions`);
            here it is not checked again.

    Returns:
        ``(rewards + added, added)``, ``added`` the token rewards with 0 off the action tokens.

    Example:
        >>> mask = torch.tensor([[True, True, False]])
        >>> add_token_rewards(torch.zeros(1, 3), torch.tensor([[0.5, 1.0, 2.0]]), mask)[0]
        tensor([[0.5000, 1.0000, 0.0000]])
    """
    added = token_rewards.masked_fill(~(response_mask if action_mask is None else action_mask), 0.0)
    return rewards + added, added


def check_rewards_on_actions(
    token_rewards: torch.Tensor,
    response_mask: torch.Tensor,
    action_mask: torch.Tensor,
    names: Optional[Union[str, Sequence[str]]] = None,
) -> None:
    """Refuse a non-zero reward on a response token the policy did not sample.

    `action_masked_gae` never reads a reward at such a position, so one placed there would be
    dropped silently; this check makes it an error instead. Padding (outside
    ``response_mask``) is not checked: nothing there is ever read. NaN counts as non-zero.

    Args:
        token_rewards: per-token rewards, (B, T), or (K, B, T) for K reward functions.
        response_mask: bool (B, T). action_mask: bool (B, T), inside ``response_mask``.
        names: the reward's name for a (B, T) tensor, or K names for a (K, B, T) one; None
            names it ``token_rewards``.

    Raises:
        ValueError: naming the reward, the row and the index of the first offending token.

    Example:
        >>> mask = torch.tensor([[True, True, True]])
        >>> check_rewards_on_actions(torch.tensor([[0.0, 0.0, 1.0]]), mask, torch.tensor([[True, False, True]]))
        >>> check_rewards_on_actions(torch.tensor([[0.0, 0.5, 1.0]]), mask, torch.tensor([[True, False, True]]), "tool")
        Traceback (most recent call last):
        ...
        ValueError: reward 'tool' is 0.5 at row 0, index 1, a response token the policy did not sample ...
    """
    _check_action_mask(response_mask, action_mask)
    stacked = token_rewards if token_rewards.dim() == 3 else token_rewards[None]
    if tuple(stacked.shape[1:]) != tuple(response_mask.shape):
        raise ValueError(
            f"token_rewards must have shape (B, T) or (K, B, T) with (B, T) = {tuple(response_mask.shape)}, "
            f"got {tuple(token_rewards.shape)}"
        )
    if names is None:
        names = ["token_rewards"] * stacked.shape[0]
    elif isinstance(names, str):
        names = [names]
    if len(names) != stacked.shape[0]:
        raise ValueError(f"names must give one name per reward ({stacked.shape[0]}), got {len(names)}: {list(names)}")
    environment = response_mask & ~action_mask
    bad = environment[None] & ~(stacked == 0)  # nan != 0 too
    if bad.any():
        k, row, index = (int(i) for i in bad.nonzero()[0])
        raise ValueError(
            f"reward {names[k]!r} is {stacked[k, row, index].item()!r} at row {row}, index {index}, a response "
            "token the policy did not sample (action_mask is False there). Put per-token rewards on "
            "action tokens only; the sequence score goes on the row's last action token."
        )


def action_masked_gae(
    token_rewards: torch.Tensor,
    values: torch.Tensor,
    response_mask: torch.Tensor,
    action_mask: torch.Tensor,
    gamma: float,
    gae_lambda: Lambda,
) -> tuple[torch.Tensor, torch.Tensor]:
    """GAE over the policy's own tokens: environment tokens are not steps of the episode.

    For row b with action positions ``i_1 < ... < i_n``:
    ``delta_k = r[i_k] + gamma * V[i_{k+1}] - V[i_k]`` (``V[i_{n+1}] = 0``) and
    ``A[i_k] = delta_k + gamma * lambda * A[i_{k+1}]``. Nothing stored at a non-action
    position (reward, value, even nan/inf) is read; stepping through those tokens instead
    (OpenRLHF, SkyRL) would add their decay and critic deltas. With ``action_mask ==
    response_mask`` (a prefix) the result is `masked_gae`'s, bitwise.

    Each row's action tokens are gathered to the left (a stable sort puts them first, in
    order), `masked_gae` runs on the compacted (B, T) tensors, and the results are gathered
    back (miles PR #1827 does the same). Equivalent to::

        for b in range(B):
            idx = action_mask[b].nonzero()[:, 0]
            a, _ = masked_gae_loop(r[b, idx][None], V[b, idx][None], ones(1, len(idx)), gamma, lam_b)
            advantages[b, idx] = a[0]; returns[b, idx] = a[0] + V[b, idx]   # 0 elsewhere

    Args:
        token_rewards: r, (B, T); `check_rewards_on_actions` refuses non-zero values off actions.
        values: critic values V, (B, T); read on action tokens only.
        response_mask: bool (B, T), the real response tokens.
        action_mask: bool (B, T), True = the policy sampled the token; inside ``response_mask``.
        gamma: discount in [0, 1].
        gae_lambda: a float in [0, 1], a (B,) tensor (e.g. ``length_adaptive_lam(action_mask, a)``)
            or a (B, T) one (e.g. ``turn_length_adaptive_lam(action_mask, a)``), read on action tokens.

    Returns:
        ``(advantages, returns)``, both (B, T) in the inputs' promoted dtype (at least
        float32), exactly 0 off the action tokens.

    Example (two turns and an environment reply between them: a1 a2 | o1 o2 o3 | b1 b2):
        >>> act = torch.tensor([[True, True, False, False, False, True, True]])
        >>> V = torch.tensor([[0.5, 0.6, 9.0, 9.0, 9.0, 0.7, 0.8]])
        >>> r = torch.tensor([[0.0, 0.1, 0.0, 0.0, 0.0, 0.0, 1.0]])
        >>> A, R = action_masked_gae(r, V, torch.ones_like(act), act, gamma=1.0, gae_lambda=0.9)
        >>> A
        tensor([[0.5068, 0.4520, 0.0000, 0.0000, 0.0000, 0.2800, 0.2000]])
    """
    return action_masked_gae_decoupled(token_rewards, values, response_mask, action_mask, gamma, gae_lambda)


def _compact_lambda(lam: Optional[Lambda], order: torch.Tensor) -> Optional[Lambda]:
    """A (B, T) per-token lambda reordered like the tokens (``lam.gather(1, order)``); any other as it is."""
    if isinstance(lam, torch.Tensor) and lam.dim() == 2:
        return lam.gather(1, order)
    return lam


def action_masked_gae_decoupled(
    token_rewards: torch.Tensor,
    values: torch.Tensor,
    response_mask: torch.Tensor,
    action_mask: torch.Tensor,
    gamma: float,
    gae_lambda: Lambda,
    value_lambda: Optional[Lambda] = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """`masked_gae_decoupled` over the policy's own tokens (see `action_masked_gae`).

    Equivalent to `action_masked_gae` with ``gae_lambda`` for the advantages, and with
    ``value_lambda`` for the returns (None: ``gae_lambda``); with ``action_mask ==
    response_mask`` (a prefix) it is `masked_gae_decoupled`'s result, bitwise.

    Args:
        token_rewards, values, response_mask, action_mask, gamma, gae_lambda: as
            `action_masked_gae`, (B, T) tensors. value_lambda: a float in [0, 1], a (B,)
            or (B, T) tensor, or None.

    Returns:
        ``(advantages, returns)``, both (B, T), exactly 0 off the action tokens.
    """
    _check_gae_args(token_rewards, values, response_mask, gamma, gae_lambda)
    _check_action_mask(response_mask, action_mask)
    dtype = _float_dtype(token_rewards, values)
    zero = torch.zeros((), dtype=dtype, device=values.device)
    # order[b, k] = the position of row b's k-th action token for k < n_b (the rest follow)
    order = torch.argsort((~action_mask).to(torch.uint8), dim=1, stable=True)
    lengths = action_mask.sum(dim=1, keepdim=True)  # n_b, (B, 1)
    compact_mask = torch.arange(action_mask.shape[1], device=action_mask.device) < lengths
    compact_advantages, compact_returns = masked_gae_decoupled(
        token_rewards.gather(1, order), values.gather(1, order), compact_mask, gamma,
        _compact_lambda(gae_lambda, order), _compact_lambda(value_lambda, order),
    )
    # rank[b, t] = number of action tokens of row b before t: t's place in the compacted row
    rank = (torch.cumsum(action_mask, dim=1) - 1).clamp(min=0)
    advantages = torch.where(action_mask, compact_advantages.gather(1, rank), zero)
    returns = torch.where(action_mask, compact_returns.gather(1, rank), zero)
    return advantages, returns
