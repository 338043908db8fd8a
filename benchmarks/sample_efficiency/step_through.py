"""The ``step_through`` arm: GAE that steps through the environment's tokens as if they were
actions, against the package's GAE over the policy's own tokens (the multiturn task)."""

from __future__ import annotations


def step_through_gae(rewards, values, response_mask, action_mask, gamma: float, lam: float,
                     value_lam: float | None = None):
    """GAE that steps through environment tokens as if they were actions (OpenRLHF, SkyRL): the
    benchmark's ``step_through`` arm, against the package's GAE over the action tokens only.

    At an environment position the reward and the value are taken as 0, but the recursion still
    steps there: each such token adds a factor ``gamma * lam`` between the action tokens around
    it, and the last action token before a reply bootstraps against ``V = 0`` instead of the value
    of the next action. Advantages and returns are then kept on the action tokens only (the loss
    never reads the others). Equivalent to::

        r, V = where(action_mask, rewards, 0), where(action_mask, values, 0)
        A, R = functional.masked_gae_decoupled(r, V, response_mask, gamma, lam, value_lam)
        A, R = where(action_mask, A, 0), where(action_mask, R, 0)

    Args:
        rewards, values: (B, T) float, the shaped rewards and the critic's values.
        response_mask: (B, T) bool, the real response tokens (a prefix per row).
        action_mask: (B, T) bool, inside ``response_mask``: the tokens the policy sampled.
        gamma, lam, value_lam: as in ``PPOConfig`` (``value_lam`` None: ``lam``).

    Returns:
        ``(advantages, returns)``, (B, T), 0 off ``action_mask``.
    """
    import torch

    from trl_ppo_ext import functional as F

    zero = torch.zeros((), dtype=rewards.dtype, device=rewards.device)
    rewards, values = torch.where(action_mask, rewards, zero), torch.where(action_mask, values, zero)
    advantages, returns = F.masked_gae_decoupled(rewards, values, response_mask, gamma, lam, value_lam)
    return torch.where(action_mask, advantages, zero), torch.where(action_mask, returns, zero)


def step_through_trainer(base):
    """``base`` (this package's PPOTrainer) with ``compute_advantages`` replaced by
    ``step_through_gae`` on episodes with turns; rewards, KL, the loss and whitening stay over
    the action tokens, exactly as the package computes them."""
    import dataclasses as dc

    from trl_ppo_ext import functional as F

    class StepThroughTrainer(base):
        def compute_advantages(self, rollout):
            targets = super().compute_advantages(rollout)
            if rollout.action_mask is None:  # no environment tokens: nothing to step through
                return targets
            args, mask = self.args, rollout.action_mask
            if args.lam_length_alpha is not None:
                raise ValueError("the step_through arm takes a fixed lam; unset lam_length_alpha")
            advantages, returns = step_through_gae(targets.rewards, rollout.values, rollout.response_mask, mask,
                                                   args.gamma, args.lam, args.value_lam)
            mean, var = F.masked_global_mean_var(advantages, mask)
            if args.whiten_advantages:
                advantages = F.masked_global_whiten(advantages, mask)
            return dc.replace(targets, advantages=advantages, returns=returns, raw_advantage_mean=mean,
                              raw_advantage_std=var.sqrt())

    return StepThroughTrainer
