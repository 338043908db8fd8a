"""Which scoring forwards a run needs before its update: no forward nothing reads.

Before the update the trainer scores each rollout: the old policy's log-probs and the critic's
values (one forward), the reference's log-probs (another). TRL 1.16's ``GRPOTrainer`` runs neither
where nothing reads them, and neither does this package:

* **reference** (:func:`reads_reference`): read by the KL penalty (``kl_coef != 0``), the adaptive
  controller (it moves ``kl_coef`` from the KL it measures), the ``kl_range`` guard (``kl_min`` /
  ``kl_max``) and a reward-hacking guard watching a KL figure. Without any of them no reference is
  built, offloaded or run, and ``objective/kl`` / ``eval/kl`` are not logged (GRPO logs ``kl`` only
  when ``beta != 0``).
* **old log-probs** (:func:`on_policy_update`): where the update is one optimizer step on the
  rollout just sampled (one PPO epoch, one mini-batch, sampled by the policy itself, not by vLLM
  whose importance weights and ``sampling/*`` figures read them), the policy has not moved when
  the update's own forward runs, so its log-probs, detached, are ``pi_old``: the ratio is exactly 1
  and the gradient is today's (GRPO with one iteration does the same). A critic's values still need
  a forward before the update (GAE reads them): with a separate value model or a value adapter it
  runs the critic's own pass alone (``models.values``), saving the policy's; with the shared value
  head the values need the policy's pass, which gives the old log-probs as well, so nothing is saved.

Example:

>>> from types import SimpleNamespace
>>> args = SimpleNamespace(kl_coef=0.0, adaptive_kl=False, kl_min=None, kl_max=None, reward_hacking_metric=None,
...                        num_ppo_epochs=1, num_mini_batches=1, use_vllm=False)
>>> reads_reference(args), on_policy_update(args)
(False, True)
>>> reads_reference(SimpleNamespace(**{**vars(args), "kl_coef": 0.05}))
True
>>> plan_scoring(args, trains_critic=False)
ScoringPlan(reference=False, old_logprobs=False)
>>> plan_scoring(args, trains_critic=True)  # the shared head: the values' forward gives the old log-probs too
ScoringPlan(reference=False, old_logprobs=True)
>>> plan_scoring(args, trains_critic=True, values_alone=True)  # a value adapter / value model: its pass alone
ScoringPlan(reference=False, old_logprobs=False)
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class ScoringPlan:
    """The scoring forwards a run runs before each update."""

    reference: bool  # log pi_ref(a_t|s_t) (B, T): the reference's forward
    # log pi_old(a_t|s_t) (B, T) (and V(s_t)) from the policy's forward; False: the update's own first forward's
    # (and V(s_t), with a critic, from the critic's pass alone)
    old_logprobs: bool


def reads_reference(args) -> bool:
    """Whether anything reads the reference's log-probs: ``kl_coef != 0``, ``adaptive_kl``, a KL
    bound of the guards (``kl_min`` / ``kl_max``) or a ``reward_hacking_metric`` naming a KL."""
    watched = str(getattr(args, "reward_hacking_metric", None) or "").lower()
    return (args.kl_coef != 0 or bool(args.adaptive_kl) or getattr(args, "kl_min", None) is not None
            or getattr(args, "kl_max", None) is not None or "kl" in watched)


def on_policy_update(args) -> bool:
    """Whether each update is one optimizer step on a rollout the policy itself sampled just
    before: ``num_ppo_epochs == 1``, ``num_mini_batches == 1`` (micro-batches accumulate into that
    one step, all before it), no vLLM engine (whose log-probs are not the policy's) and synchronous
    rollouts (``max_staleness == 0``: a batch sampled ahead is older than the weights that train it,
    so its proximal log-probs need the forward on the current weights)."""
    return (args.num_ppo_epochs == 1 and args.num_mini_batches == 1 and not getattr(args, "use_vllm", False)
            and getattr(args, "max_staleness", 0) == 0)


def plan_scoring(args, *, trains_critic: bool, values_alone: bool = False, custom_update: bool = False) -> ScoringPlan:
    """The run's :class:`ScoringPlan`. ``values_alone``: the critic's values come from a pass of
    its own (``models.values.has_values_alone``). ``custom_update``: a subclass overrides a hook
    that may read the rollout's old log-probs otherwise (``compute_loss_terms``, ``produce_rollout``):
    they are computed before the update, as without this plan."""
    reference = reads_reference(args)
    critic_needs_policy = trains_critic and not values_alone
    skip_old = not (critic_needs_policy or reference or custom_update) and on_policy_update(args)
    return ScoringPlan(reference=reference, old_logprobs=not skip_old)
