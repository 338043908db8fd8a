"""Advantage estimators other than the critic's GAE: GRPO, RLOO and REINFORCE++ (with and
without a group baseline), and :func:`estimator_targets`, which computes a ``PPOTargets`` for
any ``advantage_estimator`` value through the row of ``estimator_table`` (``"gae"`` and
``"gae_rloo"`` go to :func:`critic_targets`: ``advantages.compute_targets``, with the
explained-variance gate and the group-and-critic hybrid of ``critic_baselines``).

Notation as in ``functional``: ``B`` sequences, ``T`` response tokens, ``(B, T)`` token
tensors, ``(B,)`` per-sequence ones. ``action_mask`` ``(B, T)`` bool, True = a token the policy
sampled (the response mask when a completion holds no environment tokens); every ``(B, T)``
output is exactly 0 where it is False.

Grouping: with ``G = num_generations`` samples per prompt, rows ``b*G .. b*G+G-1`` are the ``G``
completions of one prompt (the copies are adjacent, ``repeat_interleave`` order:
``data.repeat_prompts``). A batch of ``B`` rows that is not a multiple of ``G`` is refused.

Where per-token (process) rewards keep a meaning:

* ``"grpo"`` and ``"rloo"`` compare one scalar per sequence within its group
  (:func:`sequence_returns`): the score plus every per-token reward, and for ``"rloo"`` minus
  ``kl_coef`` times the summed KL (TRL RLOO's sequence-level KL in the reward). ``"grpo"``
  keeps the KL out of the group statistics, as TRL GRPO does (its ``beta`` term is not in the
  rewards): the group-normalised advantage is the same on every action token
  (:func:`broadcast_sequence_advantages`), and the KL penalty is added per token as its
  return-to-go (:func:`returns_to_go` of the penalty; OpenRLHF's ``group_norm`` with the KL in the reward). A
  process reward counts only through the sum: where in the completion it was earned is lost.
* ``"reinforce_pp"`` and ``"reinforce_pp_baseline"`` keep the rewards per token: each action
  token's advantage is its discounted return-to-go, so a step reward counts for the tokens
  before it only.

Example:

>>> import torch
>>> grpo_advantages(torch.tensor([1.0, 0.0, 2.0, 2.0]), num_generations=2, scale_rewards="none")
tensor([ 0.5000, -0.5000,  0.0000,  0.0000])
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Optional

import torch

from . import functional as F
from .advantages import PPOTargets, compute_targets, policy_lambda, scored_rows, target_settings
from .critic_baselines import batch_mean_advantages, gate_explained_variance, group_critic_advantages
from .estimator_table import (
    CRITIC_FREE_ESTIMATORS,
    ESTIMATORS,
    GROUP_ESTIMATORS,
    SCALE_REWARDS,
    estimator,
    needs_critic,
    resolve_scale_rewards,
)
from .rollout import Rollout

__all__ = [
    "ESTIMATORS", "CRITIC_FREE_ESTIMATORS", "GROUP_ESTIMATORS", "SCALE_REWARDS", "GROUP_STD_EPS",
    "needs_critic", "resolve_scale_rewards", "grouped", "grpo_advantages", "rloo_advantages",
    "reinforce_pp_advantages", "reinforce_pp_baseline_advantages", "broadcast_sequence_advantages",
    "sequence_returns", "returns_to_go", "group_reward_metrics", "estimator_targets", "estimator_settings",
    "ShapedRewards", "TARGET_FUNCTIONS", "grpo_targets", "rloo_targets", "reinforce_pp_targets",
    "reinforce_pp_baseline_targets", "critic_targets", "gae_targets", "gae_rloo_targets",
]

# TRL GRPO adds this to the std it divides by (grpo_trainer: `advantages / (std_rewards + 1e-4)`).
GROUP_STD_EPS = 1e-4


def _check_num_generations(num_generations: int, minimum: int, what: str) -> None:
    if isinstance(num_generations, bool) or not isinstance(num_generations, int) or num_generations < minimum:
        raise ValueError(
            f"{what} needs num_generations >= {minimum} samples per prompt, got {num_generations!r}"
            + (": the baseline of a sample is its group's other samples." if minimum > 1 else ".")
        )


def grouped(x: torch.Tensor, num_generations: int) -> torch.Tensor:
    """``(B,)`` -> ``(B / G, G)``: row ``p`` holds the ``G`` samples of prompt ``p`` (rows
    ``p*G .. p*G+G-1`` of ``x``). A view, no copy.

    Raises:
        ValueError: ``x`` not 1-D, or ``B`` not a multiple of ``G``, naming both.

    >>> grouped(torch.arange(6.0), 3)
    tensor([[0., 1., 2.],
            [3., 4., 5.]])
    """
    _check_num_generations(num_generations, 1, "grouping")
    if x.dim() != 1:
        raise ValueError(f"expected per-sequence values of shape (B,), got {tuple(x.shape)}")
    if x.shape[0] % num_generations:
        raise ValueError(
            f"a batch of {x.shape[0]} sequences is not a multiple of num_generations={num_generations}: the "
            f"{num_generations} samples of every prompt must be in the same batch, on adjacent rows."
        )
    return x.view(-1, num_generations)


def _float(x: torch.Tensor) -> torch.Tensor:
    return x if x.dtype == torch.float64 else x.float()


def grpo_advantages(scores: torch.Tensor, num_generations: int, scale_rewards="group",
                    scored: torch.Tensor | None = None) -> torch.Tensor:
    """GRPO's per-sequence advantage, with TRL 1.16 GRPOTrainer's arithmetic.

    ``A_i = (s_i - mean_g) / (std + 1e-4)``: ``mean_g`` the mean of the scores of ``i``'s group;
    ``std`` by ``scale_rewards``: ``"group"`` (TRL's default) the unbiased (N - 1) std of ``i``'s
    group, ``"batch"`` the unbiased std of every score of the batch (all processes: TRL gathers
    the rewards before it; the mean is still the group's), ``"none"`` no division (Dr. GRPO).
    Naive form::

        for p in range(B // G):
            group = scores[p*G:(p+1)*G]
            for i in range(G):
                A[p*G+i] = group[i] - mean(group)          # "none"
                A[p*G+i] /= stdev(group) + 1e-4             # "group"; "batch": stdev(all scores)

    Args:
        scores: ``(B,)`` one scalar per sequence (see :func:`sequence_returns`).
        num_generations: ``G >= 2``, the samples per prompt; ``B`` a multiple of it.
        scale_rewards: ``"group"``, ``"batch"``, ``"none"``, or TRL's True / False.
        scored: ``(B,)`` bool, True = the row has a score (``advantages.scored_rows``); None:
            every row. An unscored row is left out of its group's mean and std (and the batch
            std) and gets advantage 0, as TRL 1.16 GRPO's nan-aware statistics treat an
            unscorable row; a group with fewer than two scored rows gets 0 throughout.

    Returns:
        ``(B,)`` in the scores' float dtype (at least float32). A group of equal scores gets 0.
        ``"batch"`` is a collective when ``torch.distributed`` is initialised.
    """
    _check_num_generations(num_generations, 2, "advantage_estimator='grpo'")
    scale = resolve_scale_rewards(scale_rewards)
    x = grouped(_float(scores), num_generations)
    if scored is not None:
        return _grpo_over_scored(x, grouped(scored, num_generations), scale)
    advantages = x - x.mean(dim=1, keepdim=True)
    if scale == "group":
        advantages = advantages / (x.std(dim=1, keepdim=True) + GROUP_STD_EPS)
    elif scale == "batch":
        flat = x.reshape(-1)
        _, var = F.masked_global_mean_var(flat, torch.ones_like(flat, dtype=torch.bool), unbiased=True)
        advantages = advantages / (var.sqrt() + GROUP_STD_EPS)
    return advantages.reshape(-1)


def _group_mean(x: torch.Tensor, m: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(P, G)`` values and bool mask -> each group's mean over its True entries ``(P, 1)``
    (0 for a group with none) and their count ``(P, 1)``."""
    n = m.sum(dim=1, keepdim=True)
    return torch.where(m, x, 0.0).sum(dim=1, keepdim=True) / n.clamp(min=1), n


def _grpo_over_scored(x: torch.Tensor, m: torch.Tensor, scale: str) -> torch.Tensor:
    """:func:`grpo_advantages` on ``(P, G)`` scores whose False entries of ``m`` are unscored:
    TRL's ``nanmean`` / ``nanstd`` (unbiased) over the scored ones, 0 for the unscored. Naive
    form: for each group, ``s = [x[i] for i scored]``; ``A[i] = (x[i] - mean(s)) / (stdev(s) + 1e-4)``
    for scored ``i`` (0 when ``len(s) < 2``), ``A[i] = 0`` otherwise."""
    mean, n = _group_mean(x, m)
    centred = torch.where(m, x - mean, 0.0)
    if scale == "group":
        std = (centred.square().sum(dim=1, keepdim=True) / (n - 1).clamp(min=1)).sqrt()
        centred = torch.where(n > 1, centred / (std + GROUP_STD_EPS), 0.0)
    elif scale == "batch":
        _, var = F.masked_global_mean_var(x.reshape(-1), m.reshape(-1), unbiased=True)
        centred = centred / (var.sqrt() + GROUP_STD_EPS)
    return centred.reshape(-1)


def rloo_advantages(scores: torch.Tensor, num_generations: int, scored: torch.Tensor | None = None) -> torch.Tensor:
    """RLOO's per-sequence advantage (Ahmadian et al. 2024; TRL 1.16 RLOOTrainer): the score
    minus the mean of the other ``G - 1`` scores of its group, ``A_i = s_i - (sum_g - s_i) / (G - 1)``
    (equal to ``G / (G - 1) * (s_i - mean_g)``). TRL's optional ``normalize_advantages`` (off by
    default) is not applied. Naive form::

        for p in range(B // G):
            for i in range(G):
                others = [scores[p*G+j] for j in range(G) if j != i]
                A[p*G+i] = scores[p*G+i] - sum(others) / (G - 1)

    Args:
        scores: ``(B,)`` one scalar per sequence (see :func:`sequence_returns`).
        num_generations: ``G >= 2`` (with one sample there is no other to compare with:
            ``ValueError``, as TRL's RLOOConfig refuses it).
        scored: ``(B,)`` bool, True = the row has a score; None: every row. An unscored row is
            nobody's baseline and gets 0; the baseline of a scored row is the mean of the other
            scored rows of its group (0 advantage when it has no other).

    Returns:
        ``(B,)`` in the scores' float dtype (at least float32); a group's advantages sum to 0.
    """
    _check_num_generations(num_generations, 2, "advantage_estimator='rloo'")
    x = grouped(_float(scores), num_generations)
    if scored is not None:
        m = grouped(scored, num_generations)
        mean, n = _group_mean(x, m)
        baseline = (mean * n - x) / (n - 1).clamp(min=1)
        return torch.where(m & (n > 1), x - baseline, 0.0).reshape(-1)
    baseline = (x.sum(dim=1, keepdim=True) - x) / (num_generations - 1)
    return (x - baseline).reshape(-1)


def reinforce_pp_advantages(
    token_rewards: torch.Tensor, action_mask: torch.Tensor, gamma: float = 1.0
) -> tuple[torch.Tensor, torch.Tensor]:
    """REINFORCE++ (Hu 2025, arXiv:2501.03262; OpenRLHF's ``reinforce``): the discounted
    return-to-go of every action token, whitened over the whole batch.

    For row b with action positions ``i_1 < ... < i_n``: ``R[i_k] = r[i_k] + gamma * R[i_{k+1}]``
    (``R[i_{n+1}] = 0``). Environment tokens (``action_mask`` False inside the response) are not
    steps: their rewards are not read and they do not discount (as
    ``functional.action_masked_gae``, of which this is the case ``V = 0``, ``lambda = 1``). The
    advantages are ``functional.masked_global_whiten(R, action_mask)``: mean and unbiased std
    over every action token of the batch, on all processes. Naive form::

        for b in range(B):
            idx = action_mask[b].nonzero()[:, 0]; running = 0
            for k in reversed(range(len(idx))):
                running = r[b, idx[k]] + gamma * running; R[b, idx[k]] = running
        A = (R - mean(R[action_mask])) / sqrt(var(R[action_mask]) + 1e-8)   # 0 off the mask

    Args:
        token_rewards: ``(B, T)`` shaped rewards: ``-kl_coef * kl`` per action token, the
            sequence score added on the last action token, per-token rewards where they were
            earned (``functional.shaped_rewards`` over ``action_mask``).
        action_mask: bool ``(B, T)``.
        gamma: discount in [0, 1].

    Returns:
        ``(advantages, returns)``, both ``(B, T)``, exactly 0 off the action tokens; the returns
        are ``R`` before whitening.
    """
    returns = returns_to_go(token_rewards, action_mask, gamma)
    return F.masked_global_whiten(returns, action_mask), returns


def reinforce_pp_baseline_advantages(
    scores: torch.Tensor,
    non_score_rewards: torch.Tensor,
    action_mask: torch.Tensor,
    num_generations: int,
    gamma: float = 1.0,
    scored: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """REINFORCE++-baseline (OpenRLHF's ``reinforce_baseline``): each score minus the mean score
    of its group, then :func:`reinforce_pp_advantages` on the shaped rewards built with it.

    The steps, in OpenRLHF's order: ``s'_i = s_i - mean_g`` (no division by the std); the token
    rewards are ``non_score_rewards`` plus ``s'_i`` on row i's last action token; discounted
    returns over the action tokens; global whitening. (OpenRLHF also forces ``gamma = 1`` for
    this estimator; here ``gamma`` is used as given, and ``PPOConfig.gamma`` defaults to 1.)

    Args:
        scores: ``(B,)`` sequence scores.
        non_score_rewards: ``(B, T)`` the per-token part of the reward: ``-kl_coef * kl`` plus
            any per-token (process) reward; not centred.
        action_mask: bool ``(B, T)``.
        num_generations: ``G >= 2``; ``B`` a multiple of it.
        gamma: discount in [0, 1].
        scored: ``(B,)`` bool, True = the row has a score; None: every row. An unscored row is
            out of its group's mean, and its tokens are no steps (0 advantage and return, out
            of the whitening statistics).

    Returns:
        ``(advantages, returns)`` as :func:`reinforce_pp_advantages`.
    """
    _check_num_generations(num_generations, 2, "advantage_estimator='reinforce_pp_baseline'")
    x = grouped(_float(scores), num_generations)
    if scored is not None:
        mean, _ = _group_mean(x, grouped(scored, num_generations))
        action_mask = action_mask & scored[:, None]
    else:
        mean = x.mean(dim=1, keepdim=True)
    centred = (x - mean).reshape(-1)
    token_rewards = _with_score_on_last_action(non_score_rewards, centred, action_mask)
    return reinforce_pp_advantages(token_rewards, action_mask, gamma)


def _with_score_on_last_action(non_score_rewards, scores, action_mask) -> torch.Tensor:
    """``non_score_rewards`` (0 off the mask) + ``scores[b]`` at row b's last action token."""
    dtype = F._float_dtype(non_score_rewards, scores)
    positions = torch.arange(action_mask.shape[1], device=action_mask.device)
    at_end = positions[None, :] == F.last_valid_index(action_mask)[:, None]
    base = torch.where(action_mask, non_score_rewards.to(dtype), 0)
    return base + torch.where(at_end, scores.to(dtype)[:, None], 0)


def broadcast_sequence_advantages(advantages: torch.Tensor, action_mask: torch.Tensor) -> torch.Tensor:
    """A group estimator's per-sequence advantage on every action token of its row; exactly 0
    elsewhere (prompt padding, environment tokens, after the stop token).

    Naive form: ``out[b, t] = advantages[b] if action_mask[b, t] else 0``.

    Args:
        advantages: ``(B,)``. action_mask: bool ``(B, T)``.

    Returns:
        ``(B, T)`` in the advantages' float dtype.

    >>> broadcast_sequence_advantages(torch.tensor([2.0, -1.0]), torch.tensor([[True, False, True], [True] * 3]))
    tensor([[ 2.,  0.,  2.],
            [-1., -1., -1.]])
    """
    F._check_mask(action_mask, "action_mask")
    if action_mask.dim() != 2 or advantages.shape != action_mask.shape[:1]:
        raise ValueError(
            f"advantages must have shape (B,) and action_mask (B, T) with the same B, got {tuple(advantages.shape)} "
            f"and {tuple(action_mask.shape)}"
        )
    values = _float(advantages)
    return torch.where(action_mask, values[:, None], torch.zeros((), dtype=values.dtype, device=values.device))


def sequence_returns(token_rewards: torch.Tensor, action_mask: torch.Tensor) -> torch.Tensor:
    """The scalar a group estimator compares: each row's undiscounted sum of ``token_rewards``
    over the action tokens, ``sum_t r[b, t]`` where ``action_mask[b, t]``. ``"rloo"`` passes the
    shaped rewards (score + per-token rewards - ``kl_coef`` * KL: TRL RLOO's sequence-level KL
    penalty); ``"grpo"`` the same without the KL part (TRL GRPO keeps its KL out of the rewards).

    Args:
        token_rewards: ``(B, T)``. action_mask: bool ``(B, T)``.

    Returns:
        ``(B,)``, the rewards' float dtype (at least float32).
    """
    F._check_mask(action_mask, "action_mask")
    F._check_same_shape(token_rewards=token_rewards, action_mask=action_mask)
    values = _float(token_rewards)
    return torch.where(action_mask, values, torch.zeros((), dtype=values.dtype, device=values.device)).sum(dim=1)


def returns_to_go(token_rewards: torch.Tensor, action_mask: torch.Tensor, gamma: float = 1.0) -> torch.Tensor:
    """Each action token's discounted sum of the per-token rewards from it to the end of its row:
    ``R[i_k] = r[i_k] + gamma * R[i_{k+1}]`` over row b's action positions ``i_1 < ... < i_n``
    (``R[i_{n+1}] = 0``). Environment tokens (``action_mask`` False inside the response) are not
    steps: their rewards are not read, they do not discount, and they get 0 (the case ``V = 0``,
    ``lambda = 1`` of ``functional.action_masked_gae``). REINFORCE++ takes it of the shaped
    rewards; ``"grpo"`` of the KL penalty alone (``-kl_coef * kl``), which pushes a token back
    toward the reference by the KL it and the tokens after it add (OpenRLHF adds it the same way
    to its group-normalised score). Naive form::

        for b in range(B):
            running = 0
            for t in reversed(range(T)):
                if action_mask[b, t]:
                    running = r[b, t] + gamma * running; R[b, t] = running

    Args:
        token_rewards: ``(B, T)``. action_mask: bool ``(B, T)``. gamma: discount in [0, 1].

    Returns:
        ``(B, T)`` float (at least float32), exactly 0 off the action tokens.

    >>> returns_to_go(torch.tensor([[-0.1, -0.2, -0.3]]), torch.tensor([[True, False, True]]))
    tensor([[-0.4000,  0.0000, -0.3000]])
    """
    F._check_mask(action_mask, "action_mask")
    F._check_same_shape(token_rewards=token_rewards, action_mask=action_mask)
    values = torch.zeros_like(token_rewards, dtype=F._float_dtype(token_rewards))
    returns, _ = F.action_masked_gae(token_rewards.to(values.dtype), values, action_mask, action_mask, gamma, 1.0)
    return returns


def group_reward_metrics(scores: torch.Tensor, num_generations: int) -> dict[str, torch.Tensor]:
    """The group figures TRL GRPO logs, under its names, plus OpenRLHF's mean group std.

    * ``reward_std``: TRL's: the unbiased std of every score of the batch (all processes).
    * ``frac_reward_zero_std``: TRL's: the fraction of groups whose scores are all equal
      (``isclose(std, 0)``), i.e. that give every sample a zero advantage. TRL computes it from
      the batch std under ``scale_rewards="batch"``; here it is always the groups'.
    * ``group_reward_std``: the mean over groups of each group's unbiased std (OpenRLHF's
      ``group_reward_std``); TRL has no name for it.

    With ``G = 1`` every group's std is 0 (TRL's convention for one sample). A collective when
    ``torch.distributed`` is initialised (every process must call it).

    Args:
        scores: ``(B,)``. num_generations: ``G >= 1``; ``B`` a multiple of it.

    Returns:
        0-dim float tensors, detached.
    """
    x = grouped(_float(scores.detach()), num_generations)
    group_std = x.std(dim=1) if num_generations > 1 else torch.zeros_like(x[:, 0])
    zero = torch.isclose(group_std, torch.zeros_like(group_std)).to(x.dtype)
    every = torch.ones_like(group_std, dtype=torch.bool)
    flat = x.reshape(-1)
    _, batch_var = F.masked_global_mean_var(flat, torch.ones_like(flat, dtype=torch.bool), unbiased=True)
    frac_zero, _ = F.masked_global_mean_var(zero, every)
    mean_std, _ = F.masked_global_mean_var(group_std, every)
    return {"reward_std": batch_var.sqrt(), "frac_reward_zero_std": frac_zero, "group_reward_std": mean_std}


@torch.no_grad()
def estimator_targets(
    rollout: Rollout,
    *,
    advantage_estimator: str,
    num_generations: int,
    kl_coef: float,
    kl_estimator: str,
    missing_eos_penalty: float | None,
    whiten_rewards: bool,
    whiten_advantages: bool,
    gamma: float,
    lam: float,
    value_lam: float | None = None,
    lam_length_alpha: float | None = None,
    scale_rewards="group",
    action_mask: Optional[torch.Tensor] = None,
    lam_length_min: float | None = None,
    lam_length_per_turn: bool = False,
    critic_gate_explained_variance: float | None = None,
) -> PPOTargets:
    """The update's targets under ``advantage_estimator``; the arguments of
    ``advantages.compute_targets`` plus the estimator's.

    ``"gae"`` and ``"gae_rloo"`` are :func:`critic_targets` (``"gae"`` with the gate off is
    ``compute_targets`` with the same arguments; ``scale_rewards`` unused). Otherwise no value is
    read, and:

    1. ``scores``: the rollout's, minus ``missing_eos_penalty`` where no stop token came;
    2. ``kl``, ``non_score_rewards = -kl_coef * kl`` and the shaped ``rewards`` on the action
       tokens (score on the last one, per-token rewards added; a non-zero one on an
       environment token is an error), as ``compute_targets`` builds them;
    3. ``advantages``: ``"grpo"``: :func:`grpo_advantages` of :func:`sequence_returns` of the
       rewards without the KL part, broadcast over the action tokens, plus :func:`returns_to_go` of
       ``non_score_rewards``' KL part; ``"rloo"``: :func:`rloo_advantages` of the whole sums,
       broadcast; ``"reinforce_pp"``:
       :func:`reinforce_pp_advantages` of ``rewards``; ``"reinforce_pp_baseline"``:
       :func:`reinforce_pp_baseline_advantages` (the group mean off the scores first);
    4. ``returns``: the REINFORCE++ discounted returns; zeros for the group estimators.

    A row no reward applies to (``advantages.scored_rows`` of ``rollout.reward_applies``: TRL
    GRPO's unscorable row) is out of every group and batch statistic and gets advantage 0 on
    every token (its KL term included): it moves nothing.

    ``whiten_rewards``, ``whiten_advantages``, ``lam``, ``value_lam``, ``lam_length_alpha``,
    ``lam_length_min``, ``lam_length_per_turn`` and ``critic_gate_explained_variance`` are the
    critic's: the group estimators normalise by their own rule (``scale_rewards``; RLOO none,
    TRL's default) and REINFORCE++ always whitens. ``gamma`` is read by REINFORCE++ and by
    ``"grpo"``'s KL return-to-go.

    Args:
        rollout: reads ``scores``, ``has_stop``, ``logprobs``, ``ref_logprobs``,
            ``response_mask``, ``token_rewards`` (``values`` for ``"gae"`` only).
        action_mask: bool ``(B, T)`` inside ``response_mask``; None: the rollout's
            ``action_mask`` when it has one, else ``response_mask``.

    Returns:
        ``PPOTargets``; ``raw_advantage_mean`` / ``raw_advantage_std`` are taken over the action
        tokens before REINFORCE++'s whitening.
    """
    gae_settings = dict(kl_coef=kl_coef, kl_estimator=kl_estimator, missing_eos_penalty=missing_eos_penalty,
                        whiten_rewards=whiten_rewards, whiten_advantages=whiten_advantages, gamma=gamma, lam=lam,
                        value_lam=value_lam, lam_length_alpha=lam_length_alpha, lam_length_min=lam_length_min,
                        lam_length_per_turn=lam_length_per_turn)
    row = estimator(advantage_estimator)
    if row.needs_critic:
        return TARGET_FUNCTIONS[row.function](rollout, num_generations=num_generations,
                                              critic_gate_explained_variance=critic_gate_explained_variance,
                                              **gae_settings)
    mask = rollout.response_mask
    actions = action_mask if action_mask is not None else getattr(rollout, "action_mask", None)
    actions = mask if actions is None else actions
    scored = scored_rows(getattr(rollout, "reward_applies", None))
    counted = actions if scored is None else actions & scored[:, None]  # an unscored row trains nothing
    scores = rollout.scores
    if missing_eos_penalty is not None:
        scores = scores - missing_eos_penalty * (~rollout.has_stop).float()
    kl = F.kl_penalty(rollout.logprobs, rollout.ref_logprobs, kl_estimator).masked_fill(~actions, 0.0)
    rewards, non_score = F.shaped_rewards(
        rollout.logprobs, rollout.ref_logprobs, scores, actions, kl_coef, kl_estimator, kl=kl
    )
    per_token = non_score
    if rollout.token_rewards is not None:
        rewards, added = F.add_token_rewards(rewards, rollout.token_rewards, mask, actions)
        per_token = non_score + added
    shaped = ShapedRewards(scores=scores, rewards=rewards, non_score=non_score, per_token=per_token, actions=actions,
                           counted=counted, scored=scored)
    advantages, returns, raw = TARGET_FUNCTIONS[row.function](shaped, num_generations, scale_rewards, gamma)
    raw_mean, raw_var = F.masked_global_mean_var(raw, counted)
    return PPOTargets(
        scores=scores, kl=kl, non_score_rewards=non_score, rewards=rewards, advantages=advantages,
        returns=returns, raw_advantage_mean=raw_mean, raw_advantage_std=raw_var.sqrt(),
    )


@dataclass(frozen=True)
class ShapedRewards:
    """What every critic-free estimator reads: ``(B,)`` per sequence, ``(B, T)`` per token."""

    scores: torch.Tensor  # (B,) the sequence scores, minus missing_eos_penalty where no stop token came
    rewards: torch.Tensor  # (B, T) shaped: -kl_coef * kl, the score on the last action, token rewards added
    non_score: torch.Tensor  # (B, T) the KL part alone, -kl_coef * kl, on the action tokens
    per_token: torch.Tensor  # (B, T) non_score plus the token rewards (no score)
    actions: torch.Tensor  # (B, T) bool, the policy's own tokens
    counted: torch.Tensor  # (B, T) bool, actions of the rows a reward applies to (the others train nothing)
    scored: Optional[torch.Tensor]  # (B,) bool, the rows a reward applies to; None: every row


def grpo_targets(s: ShapedRewards, num_generations: int, scale_rewards, gamma: float):
    """``(advantages, returns, raw)`` ``(B, T)`` of ``"grpo"``: the group-normalised sequence sum of the
    rewards without the KL part, broadcast over the action tokens, plus the KL part's return-to-go
    (kept out of the group statistics, as TRL GRPO does); returns zeros; raw the advantages."""
    sequence = grpo_advantages(sequence_returns(s.rewards - s.non_score, s.actions), num_generations, scale_rewards,
                               s.scored)
    advantages = broadcast_sequence_advantages(sequence, s.counted) + returns_to_go(s.non_score, s.counted, gamma)
    advantages = advantages.to(s.rewards.dtype)
    return advantages, torch.zeros_like(s.rewards), advantages


def rloo_targets(s: ShapedRewards, num_generations: int, scale_rewards, gamma: float):
    """``(advantages, returns, raw)`` ``(B, T)`` of ``"rloo"``: the leave-one-out advantage of the whole
    sequence sums (the KL included), broadcast; returns zeros; raw the advantages."""
    sequence = rloo_advantages(sequence_returns(s.rewards, s.actions), num_generations, s.scored)
    advantages = broadcast_sequence_advantages(sequence, s.counted).to(s.rewards.dtype)
    return advantages, torch.zeros_like(s.rewards), advantages


def reinforce_pp_targets(s: ShapedRewards, num_generations: int, scale_rewards, gamma: float):
    """``(advantages, returns, raw)`` ``(B, T)`` of ``"reinforce_pp"``: whitened discounted returns;
    raw the returns before whitening."""
    advantages, returns = reinforce_pp_advantages(s.rewards, s.counted, gamma)
    return advantages, returns, returns


def reinforce_pp_baseline_targets(s: ShapedRewards, num_generations: int, scale_rewards, gamma: float):
    """``(advantages, returns, raw)`` ``(B, T)`` of ``"reinforce_pp_baseline"``: the group mean off the
    scores, then REINFORCE++'s returns; raw the returns before whitening."""
    advantages, returns = reinforce_pp_baseline_advantages(s.scores, s.per_token, s.actions, num_generations, gamma,
                                                           s.scored)
    return advantages, returns, returns


@torch.no_grad()
def critic_targets(rollout: Rollout, *, hybrid: bool, num_generations: int,
                   critic_gate_explained_variance: float | None = None, **gae_settings) -> PPOTargets:
    """The targets of a run with a critic: ``compute_targets(rollout, **gae_settings)``, then

    1. ``hybrid`` (``"gae_rloo"``): the advantages are ``critic_baselines.group_critic_advantages``
       of :func:`rloo_advantages` of the rows' sequence returns ``S_b`` (the undiscounted sum of
       the shaped rewards over the action tokens, RLOO's scalar): ``A[i_k] = (S_b - m_b) + C[i_k]``,
       ``C = GAE(0, V - V[i_1]; gamma, lambda)`` with the run's gamma and (length-adaptive) lambda;
       a flat critic gives RLOO's advantages exactly;
    2. with ``critic_gate_explained_variance`` set, ``EV = gate_explained_variance(V_old, returns)``
       over the action tokens of the scored rows (every process); where ``EV <= threshold`` the
       advantages are a baseline that does not read the critic, broadcast over each row's action
       tokens: :func:`rloo_advantages` of ``S`` with ``num_generations >= 2``, else
       ``critic_baselines.batch_mean_advantages`` (EVPO's choice);
    3. ``whiten_advantages`` as GAE's (over the batch, after 1 and 2; ``raw_advantage_*`` before).

    The returns (value targets) are GAE's in every case: the critic keeps learning while the gate
    holds it out. ``gate_explained_variance`` and ``used_critic`` record the gate (None when it is
    off). Neither set: ``compute_targets``' result, bit for bit.
    """
    if not hybrid and critic_gate_explained_variance is None:
        return compute_targets(rollout, **gae_settings)
    targets = compute_targets(rollout, **{**gae_settings, "whiten_advantages": False})
    mask = rollout.loss_mask
    scored = scored_rows(rollout.reward_applies)
    counted = mask if scored is None else mask & scored[:, None]
    returns = sequence_returns(targets.rewards, mask)  # S_b, RLOO's scalar
    baseline = (rloo_advantages(returns, num_generations, scored) if num_generations > 1
                else batch_mean_advantages(returns, scored))
    advantages, gate, used = targets.advantages, None, None
    if hybrid:
        lam = policy_lambda(mask, gae_settings["lam"], gae_settings.get("lam_length_alpha"),
                            gae_settings.get("lam_length_min"), gae_settings.get("lam_length_per_turn", False),
                            targets.rewards.dtype)
        advantages = group_critic_advantages(baseline, rollout.values, rollout.response_mask, mask,
                                             gae_settings["gamma"], lam).masked_fill(~counted, 0.0)
    if critic_gate_explained_variance is not None:
        gate = gate_explained_variance(rollout.values, targets.returns, counted)
        used = (gate > critic_gate_explained_variance).to(gate.dtype)
        if not bool(used):  # the same decision on every process: the EV is gathered
            advantages = broadcast_sequence_advantages(baseline, counted)
    advantages = advantages.to(targets.rewards.dtype)
    raw_mean, raw_var = F.masked_global_mean_var(advantages, counted)
    if gae_settings["whiten_advantages"]:
        advantages = F.masked_global_whiten(advantages, counted)
    return replace(targets, advantages=advantages, raw_advantage_mean=raw_mean, raw_advantage_std=raw_var.sqrt(),
                   gate_explained_variance=gate, used_critic=used)


def gae_targets(rollout: Rollout, **settings) -> PPOTargets:
    """``"gae"``: :func:`critic_targets` without the hybrid (the critic's GAE, gated when asked)."""
    return critic_targets(rollout, hybrid=False, **settings)


def gae_rloo_targets(rollout: Rollout, **settings) -> PPOTargets:
    """``"gae_rloo"``: :func:`critic_targets` with the hybrid (RLOO across prompts, the critic inside)."""
    return critic_targets(rollout, hybrid=True, **settings)


# The functions estimator_table's "function" column names (compute_targets: GAE alone, the critic rows' core).
TARGET_FUNCTIONS = {f.__name__: f for f in (gae_targets, gae_rloo_targets, compute_targets, grpo_targets,
                                            rloo_targets, reinforce_pp_targets, reinforce_pp_baseline_targets)}


def estimator_settings(args) -> dict:
    """The keyword arguments of :func:`estimator_targets` read from a config, all but ``kl_coef``:
    ``advantages.target_settings(args)`` plus ``advantage_estimator``, ``num_generations``,
    ``scale_rewards`` and ``critic_gate_explained_variance`` (defaults ``"gae"``, 1, ``"group"``,
    None for a config without them)."""
    return {**target_settings(args), "advantage_estimator": getattr(args, "advantage_estimator", "gae"),
            "num_generations": getattr(args, "num_generations", 1),
            "scale_rewards": getattr(args, "scale_rewards", "group"),
            "critic_gate_explained_variance": getattr(args, "critic_gate_explained_variance", None)}
