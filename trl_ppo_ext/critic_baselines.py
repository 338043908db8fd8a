"""Baselines for a run with a critic: when to stop trusting it, and how to share the work with a group.

Two pure tensor pieces that ``estimators`` assembles into the targets of ``advantage_estimator="gae"``
and ``"gae_rloo"``:

* the explained-variance gate (EVPO, arXiv 2604.19485): :func:`gate_explained_variance` measures
  ``EV = 1 - Var(R - V_old) / Var(R)`` of a rollout before its update, over every process; while
  ``EV <= threshold`` the update's advantages use a baseline that does not read the critic (the
  group's leave-one-out mean with several samples per prompt, else :func:`batch_mean_advantages`),
  because a critic that explains none of the returns adds variance to the advantages instead of
  removing it;
* the group-and-critic hybrid: :func:`critic_credit` is the part of GAE that the critic alone
  decides, the redistribution of an episode's credit over its tokens, and
  :func:`group_critic_advantages` adds it to the group's leave-one-out advantage. For row ``b`` with
  action tokens ``i_1 < ... < i_n``, sequence return ``S_b`` (the undiscounted sum of its shaped
  rewards) and leave-one-out baseline ``m_b = (sum_{j in group} S_j - S_b) / (G - 1)``::

      A[i_k] = (S_b - m_b) + C[i_k],   C = GAE(rewards = 0, values = V - V[i_1]; gamma, lambda)

  GAE is linear in (rewards, values), so ``C = GAE(r, V) - GAE(r, V[i_1] everywhere)``: the
  critic's GAE minus the GAE of a critic that is flat at the episode's first value. A flat critic
  (``V`` constant on a row, a zeroed value head included) makes ``V - V[i_1]`` exactly 0, hence
  ``C`` exactly 0 and ``A`` exactly RLOO's, for every gamma and lambda. With gamma = lambda = 1,
  ``C[i_k] = V[i_1] - V[i_k]`` and ``A[i_k] = (S_b - m_b) - (V[i_k] - V[i_1])``.

Notation as in ``functional``: ``B`` sequences, ``T`` response tokens; ``action_mask`` ``(B, T)``
bool, True = a token the policy sampled (the response mask when an episode has no environment
tokens). Every ``(B, T)`` output is exactly 0 where ``action_mask`` is False.

Example (one row, gamma = lambda = 1: the first token keeps the group's advantage, later tokens
lose what the critic already expected):

>>> import torch
>>> mask = torch.tensor([[True, True, True]])
>>> group_critic_advantages(torch.tensor([0.5]), torch.tensor([[0.2, 0.4, 0.7]]), mask, mask, 1.0, 1.0)
tensor([[0.5000, 0.3000, 0.0000]])
"""

from __future__ import annotations

from typing import Optional

import torch

from . import functional as F

__all__ = ["gate_explained_variance", "batch_mean_advantages", "critic_credit", "group_critic_advantages"]


def gate_explained_variance(values: torch.Tensor, returns: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """``1 - Var(R - V) / Var(R)`` over the True entries of ``mask`` on every process.

    The gate's measure: ``values`` are the rollout's old values (before the update), ``returns``
    the value targets of the same rollout. Unlike ``functional.masked_explained_variance`` (this
    process's tokens, a diagnostic) both variances are taken over all processes, so every process
    takes the same decision. A collective when ``torch.distributed`` is initialised.

    Naive form: ``R, V = returns[mask], values[mask]; 1 - var(R - V) / var(R)`` (0 when ``var(R)
    == 0``: fewer than two tokens, or equal returns).

    Args:
        values: ``(B, T)``. returns: ``(B, T)``. mask: bool ``(B, T)``, the tokens that count.

    Returns:
        0-dim float tensor (at least float32), detached. 1 is a perfect critic, 0 no better than
        the returns' mean, negative worse than it.

    >>> m = torch.tensor([[True, True, False]])
    >>> gate_explained_variance(torch.tensor([[1.0, 2.0, 9.0]]), torch.tensor([[1.0, 3.0, 0.0]]), m)
    tensor(0.7500)
    """
    F._check_mask(mask, "mask")
    F._check_same_shape(values=values, returns=returns, mask=mask)
    dtype = F._float_dtype(values, returns)
    zero = torch.zeros((), dtype=dtype, device=values.device)
    returns = torch.where(mask, returns.detach().to(dtype), zero)
    residual = torch.where(mask, returns - values.detach().to(dtype), zero)  # nothing off the mask is read
    _, var_returns = F.masked_global_mean_var(returns, mask)
    _, var_residual = F.masked_global_mean_var(residual, mask)
    safe = torch.where(var_returns > 0, var_returns, 1)
    return torch.where(var_returns > 0, 1 - var_residual / safe, zero)


def batch_mean_advantages(sequence_returns: torch.Tensor, scored: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Each sequence's return minus the mean return of the batch (every process): the gate's
    baseline with one sample per prompt (EVPO's batch-mean baseline).

    Naive form: ``m = mean(S[b] for b if scored[b]); A[b] = S[b] - m if scored[b] else 0``.

    Args:
        sequence_returns: ``(B,)`` one return per sequence. scored: ``(B,)`` bool, the rows a
            reward applies to (the others are out of the mean and get 0); None: every row.

    Returns:
        ``(B,)`` in the returns' float dtype (at least float32). A collective when
        ``torch.distributed`` is initialised.

    >>> batch_mean_advantages(torch.tensor([1.0, 2.0, 6.0]), torch.tensor([True, True, False]))
    tensor([-0.5000,  0.5000,  0.0000])
    """
    x = sequence_returns if sequence_returns.dtype == torch.float64 else sequence_returns.float()
    if x.dim() != 1:
        raise ValueError(f"sequence_returns must have shape (B,), got {tuple(x.shape)}")
    counted = torch.ones_like(x, dtype=torch.bool) if scored is None else scored
    mean, _ = F.masked_global_mean_var(x, counted)
    return torch.where(counted, x - mean, torch.zeros((), dtype=x.dtype, device=x.device))


def critic_credit(
    values: torch.Tensor, response_mask: torch.Tensor, action_mask: torch.Tensor, gamma: float, lam: F.Lambda
) -> torch.Tensor:
    """The critic's redistribution of credit inside each episode: GAE with no reward and the values
    taken relative to the episode's first action token, ``C = GAE(0, V - V[i_1]; gamma, lam)`` over
    the policy's own tokens (``functional.action_masked_gae``; the terminal value is 0, i.e.
    ``V[i_1]`` past the end). Exactly 0 on a row whose values are equal on its action tokens.

    Naive form, per row with action positions ``i_1 < ... < i_n`` and ``U_k = V[i_k] - V[i_1]``
    (``U_{n+1} = 0``)::

        c = 0
        for k in reversed(range(1, n + 1)):
            c = gamma * U_{k+1} - U_k + gamma * lam * c;  C[i_k] = c

    Args:
        values: ``(B, T)`` the rollout's old values. response_mask: bool ``(B, T)``.
        action_mask: bool ``(B, T)`` inside ``response_mask``. gamma: in [0, 1]. lam: a float in
            [0, 1], ``(B,)`` or ``(B, T)`` (the advantages' lambda of the run).

    Returns:
        ``(B, T)`` float (at least float32), 0 off the action tokens.

    >>> m = torch.tensor([[True, True, True]])
    >>> critic_credit(torch.tensor([[0.2, 0.4, 0.7]]), m, m, gamma=1.0, lam=0.5)
    tensor([[ 0.2250,  0.0500, -0.5000]])
    """
    F._check_action_mask(response_mask, action_mask)
    dtype = F._float_dtype(values)
    values = values.detach().to(dtype)
    first = values.gather(1, action_mask.to(torch.uint8).argmax(dim=1, keepdim=True))  # V[i_1], (B, 1)
    relative = torch.where(action_mask, values - first, torch.zeros((), dtype=dtype, device=values.device))
    credit, _ = F.action_masked_gae(torch.zeros_like(relative), relative, response_mask, action_mask, gamma, lam)
    return credit


def group_critic_advantages(
    sequence_advantages: torch.Tensor, values: torch.Tensor, response_mask: torch.Tensor,
    action_mask: torch.Tensor, gamma: float, lam: F.Lambda,
) -> torch.Tensor:
    """The hybrid's advantages: a sequence-level advantage (the group's leave-one-out one) on every
    action token plus :func:`critic_credit` (see the module docstring for the formula).

    Naive form: ``A[b, t] = sequence_advantages[b] + C[b, t] if action_mask[b, t] else 0``.

    Args:
        sequence_advantages: ``(B,)``. values, response_mask, action_mask, gamma, lam: as
            :func:`critic_credit`.

    Returns:
        ``(B, T)`` in the promoted float dtype; exactly ``sequence_advantages`` broadcast where every
        row's values are flat.
    """
    if sequence_advantages.shape != action_mask.shape[:1]:
        raise ValueError(f"sequence_advantages must have shape (B,) = {tuple(action_mask.shape[:1])}, got "
                         f"{tuple(sequence_advantages.shape)}")
    credit = critic_credit(values, response_mask, action_mask, gamma, lam)
    total = sequence_advantages.to(credit.dtype)[:, None] + credit
    return torch.where(action_mask, total, torch.zeros((), dtype=total.dtype, device=total.device))
