"""TRL GRPO's config names in a PPO config: the same idea under GRPO's name is accepted, another
idea under a familiar name is refused with the field that means it here.

A GRPO script moved to this trainer keeps most of its ``GRPOConfig(...)`` arguments. Four of
them mean exactly what one of TRL PPO's fields means, so :class:`GRPOFields` accepts them as
fields (also on the command line, through ``HfArgumentParser``) and copies each onto the PPO
field (beside ``model_init_kwargs``, GRPO's keywords for loading a policy given by its id):

==========================  ==================  ==========================================
GRPO's name                 PPO's field         meaning
==========================  ==================  ==========================================
``max_completion_length``   ``response_length`` tokens generated per completion
``num_iterations``          ``num_ppo_epochs``  passes over each rollout batch
``epsilon``                 ``cliprange``       lower clip of the policy ratio, ``1 - eps``
``epsilon_high``            ``cliprange_high``  upper clip, ``1 + eps_high`` (DAPO)
==========================  ==================  ==========================================

Both names then hold the same value. Giving both with different values is an error. GRPO's
``num_generations`` and ``scale_rewards`` are ``PPOConfig`` fields of their own, with GRPO's
meaning (samples per prompt; the std ``advantage_estimator="grpo"`` divides by). Names
whose idea differs here (``beta``: a KL term in GRPO's loss, while PPO puts the KL in the
reward with ``kl_coef``) raise a ``TypeError`` that names this package's field and the
difference (:func:`refuse_foreign_names`), instead of the bare "unexpected keyword argument".

Example:

>>> from trl_ppo_ext.grpo_names import foreign_name_message
>>> print(foreign_name_message("beta").split(":")[0])
PPOConfig has no field 'beta'
"""

from __future__ import annotations

import functools
from dataclasses import MISSING, dataclass, field, fields

# GRPO's name -> the PPO field with the same meaning.
GRPO_ALIASES = {
    "max_completion_length": "response_length",
    "num_iterations": "num_ppo_epochs",
    "epsilon": "cliprange",
    "epsilon_high": "cliprange_high",
}

# GRPO names whose idea is not this trainer's, with what to use instead and why.
FOREIGN_NAMES = {
    "beta": (
        "GRPO's beta weights a KL term added to the loss (0.0 there: no reference model). PPO puts the KL in "
        "the reward instead, per token: use kl_coef (default 0.05; kl_estimator='k3' for GRPO's estimator), "
        "or kl_coef=0.0 for no KL penalty."
    ),
    "log_completions": (
        "this trainer prints and logs a table of completions for held-out prompts num_sample_generations "
        "times per run (TRL PPO's field; default 10, 0 for none). Use num_sample_generations."
    ),
    "num_completions_to_print": "the completions table shows every held-out prompt; use num_sample_generations.",
    "steps_per_generation": (
        "one rollout feeds one update here: the rollout batch is per_device_train_batch_size * "
        "gradient_accumulation_steps completions per process, split into num_mini_batches optimizer steps, "
        "each num_ppo_epochs times. Use num_mini_batches and num_ppo_epochs."
    ),
    "generation_batch_size": (
        "the rollout batch is per_device_train_batch_size * gradient_accumulation_steps completions per "
        "process; set those (and local_rollout_forward_batch_size for the scoring chunks)."
    ),
    "mask_truncated_completions": (
        "a completion without a stop token is trained on here; to discourage it, use missing_eos_penalty "
        "(subtracted from the score of every completion that did not stop)."
    ),
    "max_prompt_length": (
        "prompts are not cut here (a cut prompt is another question). render_prompts(dataset, tokenizer, "
        "max_prompt_length=N) drops longer prompts with a count; the trainer refuses prompts that leave no "
        "room for response_length."
    ),
}


def foreign_name_message(name: str) -> str:
    """The error for a GRPO config name with another meaning here (``name`` in ``FOREIGN_NAMES``)."""
    return f"PPOConfig has no field {name!r}: {FOREIGN_NAMES[name]}"


def refuse_foreign_names(cls):
    """Class decorator (after ``@dataclass``): ``cls(**kwargs)`` with a GRPO name of
    ``FOREIGN_NAMES`` raises ``TypeError(foreign_name_message(name))``; other arguments go to the
    dataclass's own ``__init__`` unchanged (its "unexpected keyword argument" for any other name)."""
    init = cls.__init__

    @functools.wraps(init)
    def __init__(self, *args, **kwargs):
        for name in kwargs:
            if name in FOREIGN_NAMES:
                raise TypeError(foreign_name_message(name))
        init(self, *args, **kwargs)

    cls.__init__ = __init__
    return cls


def _help(ppo_field: str) -> dict:
    return {"help": f"TRL GRPO's name for {ppo_field} (same meaning); set one of the two."}


@dataclass
class GRPOFields:
    """GRPO's names for four PPO fields; ``None`` = not given. :meth:`resolve_grpo_aliases`
    (called first thing in ``PPOConfig.__post_init__``) copies each given one onto its PPO field
    and each unset one from it, so that both read the same value."""

    max_completion_length: int | None = field(default=None, metadata=_help("response_length"))
    num_iterations: int | None = field(default=None, metadata=_help("num_ppo_epochs"))
    epsilon: float | None = field(default=None, metadata=_help("cliprange"))
    epsilon_high: float | None = field(default=None, metadata=_help("cliprange_high"))
    model_init_kwargs: dict | str | None = field(default=None, metadata={"help": (
        "Keyword arguments for AutoModelForCausalLM.from_pretrained when `model` is a model id or folder (TRL "
        "GRPO's field; a dict, or JSON text on the command line).")})

    def resolve_grpo_aliases(self) -> None:
        """Raises ``ValueError`` naming both fields when both are set to different values (the
        PPO field counts as set when it differs from its default)."""
        defaults = {f.name: f.default for f in fields(self) if f.default is not MISSING}
        for alias, ppo_name in GRPO_ALIASES.items():
            given, current = getattr(self, alias), getattr(self, ppo_name)
            if given is None:
                setattr(self, alias, current)
                continue
            if current != defaults.get(ppo_name) and current != given:
                raise ValueError(
                    f"PPOConfig got {alias}={given!r} and {ppo_name}={current!r}: {alias} is GRPO's name for "
                    f"{ppo_name}, so they must agree. Set one of them."
                )
            setattr(self, ppo_name, given)
