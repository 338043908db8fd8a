"""What the PPO update trains toward: :class:`PPOTargets`, computed from a scored ``Rollout``
by the pure :func:`compute_targets` (no trainer, no model, no optimizer).

The steps, all over the rollout's ``loss_mask`` only (``(B, T)`` bool: ``response_mask``, the
response tokens that count, or in an episode with turns its ``action_mask``, the tokens the
policy sampled; environment tokens carry no reward, no KL and no GAE step):

1. ``scores`` ``(B,)``: the rollout's reward, minus ``missing_eos_penalty`` for every response
   that did not end with a stop token (TRL's rule);
2. ``kl`` ``(B, T)``: the per-token KL estimate (``kl_estimator``) of the policy against the
   reference, 0 on padding;
3. ``rewards`` ``(B, T)``: ``-kl_coef * kl`` on every token plus the score at the last valid
   token (``functional.shaped_rewards``), plus the rollout's ``token_rewards`` when it has
   them (0 off the mask; ``missing_eos_penalty`` stays on the score), optionally whitened
   keeping the mean;
4. GAE advantages and returns (``functional.masked_gae_decoupled``, or over the action tokens
   ``functional.action_masked_gae_decoupled``): the advantages with
   ``lam`` (or VAPO's per-sequence ``length_adaptive_lam`` when ``lam_length_alpha`` is set,
   per turn with ``lam_length_per_turn``, floored at ``lam_length_min``),
   the returns with ``value_lam`` (None: the advantages' lambda); the advantages optionally
   whitened over the whole batch (every process).

Example:

>>> import torch
>>> from trl_ppo_ext.advantages import compute_targets
>>> from trl_ppo_ext.rollout import Rollout
>>> mask = torch.tensor([[True, True, False]])
>>> rollout = Rollout(queries=torch.ones(1, 1, dtype=torch.long), query_mask=mask[:, :1],
...                   responses=torch.ones(1, 3, dtype=torch.long), response_mask=mask,
...                   logprobs=torch.zeros(1, 3), ref_logprobs=torch.zeros(1, 3),
...                   values=torch.zeros(1, 3), scores=torch.tensor([1.0]),
...                   has_stop=torch.tensor([False]))
>>> t = compute_targets(rollout, kl_coef=0.1, kl_estimator="k1", missing_eos_penalty=0.25,
...                     whiten_rewards=False, whiten_advantages=False, gamma=1.0, lam=1.0)
>>> t.scores.tolist(), t.rewards.tolist(), t.advantages.tolist()
([0.75], [[0.0, 0.75, 0.0]], [[0.75, 0.75, 0.0]])
"""

from __future__ import annotations

from dataclasses import dataclass, fields

import torch

from . import functional as F
from .rollout import Rollout


@dataclass
class PPOTargets:
    """What the update trains toward, derived from a ``Rollout`` by :func:`compute_targets`:
    the scores and shaped per-token rewards, and from them the advantages (policy) and returns
    (value). All ``(B, T)`` float32 unless noted; every field is 0 where the rollout's
    ``loss_mask`` is False."""

    scores: torch.Tensor  # (B,) RM score after the missing-stop-token penalty
    kl: torch.Tensor  # per-token KL estimate (the configured estimator)
    non_score_rewards: torch.Tensor  # -kl_coef * kl
    rewards: torch.Tensor  # shaped reward: non-score reward + score at the last valid token + token rewards
    advantages: torch.Tensor  # GAE advantages, whitened when `whiten_advantages`
    returns: torch.Tensor  # value targets: raw advantages + old values
    raw_advantage_mean: torch.Tensor  # () before whitening, for logging
    raw_advantage_std: torch.Tensor  # () before whitening, for logging
    # the explained-variance gate (estimators.critic_targets), None when it is off: the EV it measured, ()
    # over every process, and whether the advantages read the critic, () 1.0 (critic) or 0.0 (a baseline that
    # does not read it)
    gate_explained_variance: torch.Tensor | None = None
    used_critic: torch.Tensor | None = None

    def select(self, index: torch.Tensor | slice) -> PPOTargets:
        """The rows ``index`` of every per-sequence/per-token field; the scalars are kept."""
        return PPOTargets(
            **{f.name: (v[index] if torch.is_tensor(v) and v.dim() > 0 else v)
               for f in fields(self) for v in [getattr(self, f.name)]}
        )


def scored_rows(reward_applies: torch.Tensor | None) -> torch.Tensor | None:
    """Which rows have a score: at least one reward applies to them (TRL GRPO's rule: a row every
    reward function returned None for is *unscorable*).

    Args:
        reward_applies: ``(B, F)`` bool, False where reward ``f`` does not apply to row ``b``
            (``Rollout.reward_applies``), or None (a ``score_rollout`` that keeps none).
    Returns:
        ``(B,)`` bool, True = the row has a score and counts; None when every row has one (or
        nothing says otherwise), so that a fully scored batch takes the unmasked arithmetic.
        Reads one bool on the host.

    Naive form: ``[any(applies[b]) for b in range(B)]``.

    >>> scored_rows(torch.tensor([[True, False], [False, False]]))
    tensor([ True, False])
    >>> scored_rows(torch.tensor([[True], [True]])) is None
    True
    """
    if reward_applies is None or reward_applies.shape[-1] == 0:
        return None
    scored = reward_applies.any(dim=1)
    return None if bool(scored.all()) else scored


# The config fields compute_targets reads (PPOConfig's names); the KL coefficient comes from the KL controller.
TARGET_FIELDS = (
    "kl_estimator", "missing_eos_penalty", "whiten_rewards", "whiten_advantages", "gamma", "lam",
    "value_lam", "lam_length_alpha",
)
# Read when the config has them, else their defaults (an object built before the fields existed).
OPTIONAL_TARGET_FIELDS = {"lam_length_min": None, "lam_length_per_turn": False}


def target_settings(args) -> dict:
    """The keyword arguments of :func:`compute_targets` read from a config (any object with the
    ``TARGET_FIELDS`` attributes; ``OPTIONAL_TARGET_FIELDS`` where it has them), all but ``kl_coef``."""
    return {**{name: getattr(args, name) for name in TARGET_FIELDS},
            **{name: getattr(args, name, default) for name, default in OPTIONAL_TARGET_FIELDS.items()}}


def policy_lambda(mask: torch.Tensor, lam: float, lam_length_alpha: float | None = None,
                  lam_length_min: float | None = None, lam_length_per_turn: bool = False,
                  dtype: torch.dtype = torch.float32) -> F.Lambda:
    """The advantages' GAE lambda: ``lam``, or with ``lam_length_alpha`` VAPO's length-adaptive one,
    ``max(lam_length_min, 1 - 1 / (alpha * L))`` (a None floor is 0), ``(B,)`` with L each row's
    True tokens of ``mask`` (bool ``(B, T)``), ``(B, T)`` with L each token's turn with
    ``lam_length_per_turn``."""
    if lam_length_alpha is None:
        return lam
    floor = 0.0 if lam_length_min is None else lam_length_min
    if lam_length_per_turn:  # (B, T): each token its turn's lambda
        return F.turn_length_adaptive_lam(mask, lam_length_alpha, dtype, minimum=floor)
    return F.length_adaptive_lam(mask, lam_length_alpha, dtype, minimum=floor)  # (B,)


@torch.no_grad()
def compute_targets(
    rollout: Rollout,
    *,
    kl_coef: float,
    kl_estimator: str,
    missing_eos_penalty: float | None,
    whiten_rewards: bool,
    whiten_advantages: bool,
    gamma: float,
    lam: float,
    value_lam: float | None = None,
    lam_length_alpha: float | None = None,
    lam_length_min: float | None = None,
    lam_length_per_turn: bool = False,
) -> PPOTargets:
    """Shaped rewards -> masked GAE -> masked global whitening (see the module docstring).

    Args:
        rollout: reads ``scores`` ``(B,)``, ``has_stop`` ``(B,)`` bool, ``logprobs``,
            ``ref_logprobs``, ``values`` ``(B, T)``, ``response_mask`` ``(B, T)`` bool,
            ``action_mask`` ``(B, T)`` bool or None and ``token_rewards`` ``(B, T)`` or None
            (a non-zero one on an environment token raises ``ValueError``).
        kl_coef: the KL coefficient of this update (the KL controller's current value).
        kl_estimator: ``"k1"``, ``"k2"`` or ``"k3"`` (see ``functional.kl_penalty``).
        missing_eos_penalty: subtracted from the score of every response without a stop
            token; None: no penalty.
        whiten_rewards, whiten_advantages, gamma, lam: as in ``PPOConfig``.
        value_lam: the returns' lambda (decoupled GAE); None: the advantages' lambda.
        lam_length_alpha: when set, the advantages' lambda is
            ``functional.length_adaptive_lam(loss_mask, lam_length_alpha)``, one per
            sequence, instead of ``lam``; ``value_lam=None`` then follows it too.
        lam_length_min: the floor of that lambda (None: 0, VAPO's clamp), so that a short
            sequence or turn keeps some of its later TD errors.
        lam_length_per_turn: L is the length of each token's turn (a run of action tokens:
            ``functional.turn_length_adaptive_lam``), one lambda per token; False: per sequence.

    A row no reward applies to (:func:`scored_rows`: every reward function returned None; TRL
    GRPO's "unscorable" row) gets no policy gradient and no made-up value target: its advantages
    are 0, its returns its own old values, and it is left out of every whitening statistic.

    The rollout is not modified.
    """
    mask = rollout.loss_mask  # the policy's own tokens: response_mask unless the episode has turns
    scored = scored_rows(rollout.reward_applies)
    counted = mask if scored is None else mask & scored[:, None]  # the tokens whose rows carry a score
    scores = rollout.scores
    if missing_eos_penalty is not None:
        scores = scores - missing_eos_penalty * (~rollout.has_stop).float()
    kl = F.kl_penalty(rollout.logprobs, rollout.ref_logprobs, kl_estimator).masked_fill(~mask, 0.0)
    rewards, non_score = F.shaped_rewards(  # the score on the last token of `mask`: the last action
        rollout.logprobs, rollout.ref_logprobs, scores, mask, kl_coef, kl_estimator, kl=kl
    )
    if rollout.token_rewards is not None:  # per-token (process) rewards on the tokens they name
        rewards, _ = F.add_token_rewards(rewards, rollout.token_rewards, rollout.response_mask, rollout.action_mask)
    if whiten_rewards:
        rewards = F.masked_global_whiten(rewards, counted, keep_mean=True)
    lam = policy_lambda(mask, lam, lam_length_alpha, lam_length_min, lam_length_per_turn, rewards.dtype)
    if rollout.action_mask is None:
        advantages, returns = F.masked_gae_decoupled(rewards, rollout.values, mask, gamma, lam, value_lam)
    else:  # environment tokens are not steps: GAE over each row's action tokens
        advantages, returns = F.action_masked_gae_decoupled(
            rewards, rollout.values, rollout.response_mask, mask, gamma, lam, value_lam)
    if scored is not None:  # an unscored row: no policy gradient, and its own old value as the target
        advantages = advantages.masked_fill(~counted, 0.0)
        returns = torch.where(counted, returns, rollout.values.to(returns.dtype).masked_fill(~mask, 0.0))
    raw_mean, raw_var = F.masked_global_mean_var(advantages, counted)
    if whiten_advantages:
        advantages = F.masked_global_whiten(advantages, counted)
    return PPOTargets(
        scores=scores, kl=kl, non_score_rewards=non_score, rewards=rewards, advantages=advantages,
        returns=returns, raw_advantage_mean=raw_mean, raw_advantage_std=raw_var.sqrt(),
    )
