"""The table of advantage estimators: one row per ``PPOConfig.advantage_estimator`` value.

Each row says whether the estimator reads a critic's values (without one the run builds no value
head, adapter or model, trains no value loss and logs no value metric), whether it compares the
samples of a prompt with each other (``num_generations >= 2``), and which function of
``trl_ppo_ext.estimators`` computes its advantages. The config, the inputs, the trainer and the
memory model all read this table, and it imports nothing: importing ``PPOConfig`` (or running
``python -m trl_ppo_ext.memory --help``) loads no math.

Example:

>>> ESTIMATOR_TABLE["grpo"].needs_critic, ESTIMATOR_TABLE["grpo"].needs_groups
(False, True)
>>> ESTIMATORS
('gae', 'grpo', 'rloo', 'reinforce_pp', 'reinforce_pp_baseline', 'gae_rloo')
>>> ESTIMATOR_TABLE["gae_rloo"].needs_critic, ESTIMATOR_TABLE["gae_rloo"].needs_groups
(True, True)
>>> estimator("ppo")
Traceback (most recent call last):
...
ValueError: advantage_estimator must be one of ['gae', 'grpo', ...], got 'ppo'.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = [
    "CRITIC_FREE_ESTIMATORS", "CRITIC_ONLY_FIELDS", "ESTIMATORS", "ESTIMATOR_TABLE", "Estimator", "GROUP_ESTIMATORS",
    "SCALE_REWARDS", "estimator", "needs_critic", "resolve_scale_rewards",
]


@dataclass(frozen=True)
class Estimator:
    """One advantage estimator (OpenRLHF's ``--advantage_estimator``, verl's ``adv_estimator`` registry)."""

    name: str  # PPOConfig.advantage_estimator's value
    needs_critic: bool  # reads V(s_t): a value head, adapter or model is trained beside the policy
    needs_groups: bool  # its baseline is the other samples of the prompt: num_generations >= 2
    # the function of trl_ppo_ext.estimators that computes its targets (looked up there; the critic's rows
    # read the rollout itself through estimators.critic_targets, the others read its shaped rewards)
    function: str


ESTIMATOR_TABLE: dict[str, Estimator] = {e.name: e for e in (
    Estimator("gae", needs_critic=True, needs_groups=False, function="gae_targets"),
    Estimator("grpo", needs_critic=False, needs_groups=True, function="grpo_targets"),
    Estimator("rloo", needs_critic=False, needs_groups=True, function="rloo_targets"),
    Estimator("reinforce_pp", needs_critic=False, needs_groups=False, function="reinforce_pp_targets"),
    Estimator("reinforce_pp_baseline", needs_critic=False, needs_groups=True,
              function="reinforce_pp_baseline_targets"),
    # the group's leave-one-out advantage across prompts, the critic's GAE credit inside the episode
    Estimator("gae_rloo", needs_critic=True, needs_groups=True, function="gae_rloo_targets"),
)}

# The table's names, and the two columns as name lists.
ESTIMATORS = tuple(ESTIMATOR_TABLE)
CRITIC_FREE_ESTIMATORS = tuple(name for name, e in ESTIMATOR_TABLE.items() if not e.needs_critic)
GROUP_ESTIMATORS = tuple(name for name, e in ESTIMATOR_TABLE.items() if e.needs_groups)

# The config fields only the critic's GAE path reads (advantages.compute_targets, the value loss): set with a
# critic-free estimator, they are named in a warning (PPOConfig).
CRITIC_ONLY_FIELDS = ("lam", "value_lam", "lam_length_alpha", "whiten_rewards", "whiten_advantages", "vf_coef",
                      "cliprange_value", "lam_length_min", "lam_length_per_turn", "critic_gate_explained_variance",
                      "critic_lr_multiplier")

# TRL GRPOConfig.scale_rewards' values (True means "group" and False "none" there, and here).
SCALE_REWARDS = ("group", "batch", "none")


def estimator(name: str) -> Estimator:
    """The table's row for ``name``; an unknown name is refused with the list of known ones."""
    if name not in ESTIMATOR_TABLE:
        raise ValueError(f"advantage_estimator must be one of {list(ESTIMATORS)}, got {name!r}.")
    return ESTIMATOR_TABLE[name]


def needs_critic(advantage_estimator: str) -> bool:
    """Whether ``advantage_estimator`` reads the critic's values (``"gae"`` and ``"gae_rloo"`` do).

    >>> needs_critic("gae"), needs_critic("grpo")
    (True, False)
    """
    return estimator(advantage_estimator).needs_critic


def resolve_scale_rewards(scale_rewards) -> str:
    """TRL GRPO's ``scale_rewards`` as one of ``SCALE_REWARDS``: ``True`` -> ``"group"``, ``False``
    -> ``"none"`` (TRL's legacy booleans; their text ``"True"``/``"False"`` from a command line
    too), a string of ``SCALE_REWARDS`` as it is.

    >>> resolve_scale_rewards(True), resolve_scale_rewards("False"), resolve_scale_rewards("batch")
    ('group', 'none', 'batch')
    """
    value = {True: "group", False: "none", "True": "group", "False": "none"}.get(scale_rewards, scale_rewards) \
        if isinstance(scale_rewards, (bool, str)) else scale_rewards
    if value not in SCALE_REWARDS:
        raise ValueError(
            f"scale_rewards must be one of {list(SCALE_REWARDS)} (or True = 'group', False = 'none', as in TRL "
            f"GRPO), got {scale_rewards!r}."
        )
    return value
