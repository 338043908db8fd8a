"""TRL GRPO's config names in a PPO config: the same idea under GRPO's name is accepted, another
idea under a familiar name is refused with the field that means it here.

A GRPO script moved to this trainer keeps its ``GRPOConfig(...)`` arguments. Every ``GRPOConfig``
field is one of four kinds here, and none gives the bare dataclass "unexpected keyword argument":

* a field with GRPO's meaning (:class:`GRPOFields`, also on the command line through
  ``HfArgumentParser``): the sampling filters ``top_k``, ``top_p``, ``min_p``,
  ``repetition_penalty`` and ``generation_kwargs`` (applied on both engines and in the log-probs,
  ``generation.filters``), ``cache_implementation``, ``model_init_kwargs``, ``shuffle_dataset``,
  ``log_completions``, ``num_completions_to_print``; ``trust_remote_code=True`` is accepted and
  folded into ``model_init_kwargs`` (:func:`with_remote_code`);
* an alias of a PPO field (below);
* a name accepted only at the value that means what this trainer does (``GRPO_VALUE_ONLY``:
  ``disable_dropout=True``, ``importance_sampling_level="token"``, ``sync_ref_model=False``, ...):
  that value is accepted and dropped, another raises a ``ValueError`` saying why it does not apply;
* a name whose idea is not this trainer's (``FOREIGN_NAMES``): a ``TypeError`` naming what to use.

Five names mean exactly what one of TRL PPO's fields means, and are copied onto it:

==========================  ==================  ==========================================
GRPO's name                 PPO's field         meaning
==========================  ==================  ==========================================
``max_completion_length``   ``response_length`` tokens generated per completion
``num_iterations``          ``num_ppo_epochs``  passes over each rollout batch
``epsilon``                 ``cliprange``       lower clip of the policy ratio, ``1 - eps``
``epsilon_high``            ``cliprange_high``  upper clip, ``1 + eps_high`` (DAPO)
``delta``                   ``dual_clip``       bound of the ratio where the advantage < 0
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
import json
from dataclasses import MISSING, dataclass, field, fields

# GRPO's name -> the PPO field with the same meaning.
GRPO_ALIASES = {
    "max_completion_length": "response_length",
    "num_iterations": "num_ppo_epochs",
    "epsilon": "cliprange",
    "epsilon_high": "cliprange_high",
    # GRPO clamps the ratio at delta in its unclipped term (two-sided GRPO, INTELLECT-2); for an advantage
    # >= 0 the clipped term already wins above 1 + epsilon_high, so the clamp bounds the loss of a token
    # with a negative advantage at delta * |A|: dual-clip PPO's bound c (same value and gradients).
    "delta": "dual_clip",
}

# GRPO names whose idea is not this trainer's, with what to use instead and why.
FOREIGN_NAMES = {
    "beta": (
        "GRPO's beta weights a KL term added to the loss (0.0 there: no reference model). PPO puts the KL in "
        "the reward instead, per token: use kl_coef (default 0.05; kl_estimator='k3' for GRPO's estimator), "
        "or kl_coef=0.0 for no KL penalty."
    ),
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


_NO_LOSS = "this trainer's policy loss is PPO's clipped surrogate (loss_type 'dapo', 'grpo' or 'dr_grpo')"

# GRPO names accepted at the values that say what this trainer does (dropped: nothing to set), each
# with why another value does not apply. The accepted values include GRPO's default.
GRPO_VALUE_ONLY = {
    # both values accepted: dropout is always off here, as GRPO's True makes it (PPO's ratio needs the
    # rollout's forward and the update's to agree)
    "disable_dropout": ((True, False), "dropout is always off here (the ratio compares two forwards)."),
    "importance_sampling_level": (("token",), "the ratio is per token here (PPO); GRPO's 'sequence' level "
                                  "(GSPO) is not implemented."),
    "multi_objective_aggregation": (("sum_then_normalize",), "the rewards are summed with reward_weights and "
                                    "the estimator then normalises the sum; GRPO's 'normalize_then_sum' (GDPO) is "
                                    "not implemented."),
    "use_bias_correction_kl": ((True, False), "it weights GRPO's KL term in the loss; PPO's KL is in the "
                               "reward (kl_coef)."),
    "sync_ref_model": ((False,), "the reference stays the initial policy (TR-DPO's reference sync is not "
                       "implemented); kl_coef=0.0 removes the KL penalty instead."),
    "ref_model_mixup_alpha": ((0.6,), "it is read only with sync_ref_model, which is not implemented."),
    "ref_model_sync_steps": ((512,), "it is read only with sync_ref_model, which is not implemented."),
    "top_entropy_quantile": ((1.0,), "every action token is in the policy loss here (the top-entropy token "
                             "selection of 'Beyond the 80/20 Rule' is not implemented)."),
    "use_adaptive_entropy": ((False,), "the entropy bonus is entropy_coef, fixed (Skywork-OR1's adaptive "
                             "control is not implemented)."),
    "entropy_coef_min": ((0.0,), "it is read only with use_adaptive_entropy; the bonus here is entropy_coef."),
    "entropy_coef_max": ((1.0,), "it is read only with use_adaptive_entropy; the bonus here is entropy_coef."),
    "entropy_coef_delta": ((0.005,), "it is read only with use_adaptive_entropy; the bonus here is entropy_coef."),
    "entropy_target": ((0.2,), "it is read only with use_adaptive_entropy; the bonus here is entropy_coef."),
    "off_policy_mask_threshold": ((None,), "off-policy sequence masking is not implemented; stale rollouts "
                                  "are bounded by max_rollout_age, and vLLM's by vllm_importance_sampling_*."),
    "sapo_temperature_neg": ((1.05,), f"it is read only with loss_type='sapo': {_NO_LOSS}."),
    "sapo_temperature_pos": ((1.0,), f"it is read only with loss_type='sapo': {_NO_LOSS}."),
    "vespo_k_pos": ((2.0,), f"it is read only with loss_type='vespo': {_NO_LOSS}."),
    "vespo_lambda_pos": ((3.0,), f"it is read only with loss_type='vespo': {_NO_LOSS}."),
    "vespo_k_neg": ((3.0,), f"it is read only with loss_type='vespo': {_NO_LOSS}."),
    "vespo_lambda_neg": ((2.0,), f"it is read only with loss_type='vespo': {_NO_LOSS}."),
    "cast_lm_head_to_fp32": ((False,), "the log-probs are taken in float32 from the model's own logits "
                             "(functional.logprobs_from_logits); casting the head is not implemented."),
    "router_aux_loss_coef": ((None,), "no auxiliary loss is added to PPO's here (a Mixture-of-Experts "
                             "router's load-balancing loss is not implemented)."),
    "pad_to_multiple_of": (("auto", None), "every forward is cut to its rows' own extent here "
                           "(trim_forwards); padding to a multiple is not implemented."),
    "num_generations_eval": ((None,), "held-out prompts are sampled once each, num_sample_generations times "
                             "per run (num_generations applies to training rollouts)."),
    "log_multimodal": ((True, False), "the completions logged are text; there is nothing multimodal to log."),
    "log_unique_prompts": ((False,), "every row up to num_completions_to_print is logged."),
    "log_completions_hub_repo": ((None,), "completions go to the console and the trackers (report_to); "
                                 "pushing them to the Hub is not implemented."),
    "use_transformers_continuous_batching": ((False,), "transformers' generate samples in chunks of "
                                             "local_rollout_forward_batch_size prompts; use_vllm=True for an "
                                             "engine with continuous batching."),
    "transformers_continuous_batching_config": ((None,), "it is read only with "
                                                "use_transformers_continuous_batching, which is not implemented."),
    "use_transformers_paged": ((False,), "deprecated in TRL; use_vllm=True for an engine with a paged cache."),
    "vllm_model_impl": (("vllm",), "vLLM's own implementation is the one whose log-probs were checked against "
                        "the trainer's forward (docs/vllm.md)."),
    "vllm_structured_outputs_regex": ((None,), "constrained decoding changes the distribution sampled from, "
                                      "which the trainer's log-probs would not know."),
}


def value_only_message(name: str, value) -> str:
    """The error for a ``GRPO_VALUE_ONLY`` name given a value it is not accepted at."""
    accepted, why = GRPO_VALUE_ONLY[name]
    return (f"PPOConfig got {name}={value!r}, a TRL GRPO field accepted here only as "
            f"{' or '.join(repr(v) for v in accepted)}: {why}")


def foreign_name_message(name: str) -> str:
    """The error for a GRPO config name with another meaning here (``name`` in ``FOREIGN_NAMES``)."""
    return f"PPOConfig has no field {name!r}: {FOREIGN_NAMES[name]}"


# GRPO fields taken as arguments and folded into another field (name -> that field).
GRPO_FOLDED = {"trust_remote_code": "model_init_kwargs"}


def with_remote_code(model_init_kwargs) -> dict:
    """``model_init_kwargs`` (None, a dict or JSON text) with ``trust_remote_code=True``: GRPO's
    ``trust_remote_code`` field, folded where this package's loading reads it. It is no field of
    its own here, so that ``HfArgumentParser((PPOConfig, ModelConfig))`` keeps working with the
    ``ModelConfig`` / script arguments that declare ``trust_remote_code`` themselves; on the command
    line pass ``--model_init_kwargs '{"trust_remote_code": true}'``."""
    if isinstance(model_init_kwargs, str):
        model_init_kwargs = json.loads(model_init_kwargs)
    return {**(model_init_kwargs or {}), "trust_remote_code": True}


def refuse_foreign_names(cls):
    """Class decorator (after ``@dataclass``): ``cls(**kwargs)`` with a GRPO name of
    ``FOREIGN_NAMES`` raises ``TypeError(foreign_name_message(name))``; a ``GRPO_VALUE_ONLY`` name is
    dropped at an accepted value and raises ``ValueError(value_only_message(...))`` at another; other
    arguments go to the dataclass's own ``__init__`` unchanged (its "unexpected keyword argument" for
    any other name)."""
    init = cls.__init__

    @functools.wraps(init)
    def __init__(self, *args, **kwargs):
        for name in list(kwargs):
            if name in FOREIGN_NAMES:
                raise TypeError(foreign_name_message(name))
            if name in GRPO_VALUE_ONLY:
                value = kwargs.pop(name)
                if value not in GRPO_VALUE_ONLY[name][0]:
                    raise ValueError(value_only_message(name, value))
        if kwargs.pop("trust_remote_code", False):
            kwargs["model_init_kwargs"] = with_remote_code(kwargs.get("model_init_kwargs"))
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
    delta: float | None = field(default=None, metadata=_help("dual_clip"))
    model_init_kwargs: dict | str | None = field(default=None, metadata={"help": (
        "Keyword arguments for AutoModelForCausalLM.from_pretrained when `model` is a model id or folder (TRL "
        "GRPO's field; a dict, or JSON text on the command line).")})

    # Sampling filters (TRL GRPO's fields): on transformers' generate and vLLM alike, and in the log-probs
    # of the update (trl_ppo_ext.generation.filters).
    top_k: int = field(default=0, metadata={"help": (
        "Sample from the top_k most likely tokens only; 0: all. The update's log-probs are those of this "
        "truncated distribution.")})
    top_p: float = field(default=1.0, metadata={"help": (
        "Sample from the smallest set of most likely tokens whose probability reaches top_p, in (0, 1]; 1.0: "
        "all. The update's log-probs are those of this truncated distribution.")})
    min_p: float | None = field(default=None, metadata={"help": (
        "Sample from the tokens at least min_p times as likely as the most likely one, in [0, 1]; None: all.")})
    repetition_penalty: float = field(default=1.0, metadata={"help": (
        "Divide (multiply, when negative) the logit of every token already in the prompt or the completion by "
        "this; > 1 discourages repeats, 1.0: none.")})
    generation_kwargs: dict | str | None = field(default=None, metadata={"help": (
        "TRL GRPO's extra sampling settings (a dict, or JSON text): top_k, top_p, min_p and repetition_penalty "
        "are accepted and win over the fields; any other key is refused (the update's log-probs could not "
        "follow it).")})
    cache_implementation: str | None = field(default=None, metadata={"help": (
        "transformers' KV-cache implementation for generate (e.g. 'static'); no effect on what is sampled, "
        "nor with use_vllm.")})
    shuffle_dataset: bool = field(default=True, metadata={"help": (
        "Shuffle the training prompts each epoch (seeded by `seed`); False: the dataset's order.")})

    # Completions of the training rollouts, as TRL GRPO logs them.
    log_completions: bool = field(default=False, metadata={"help": (
        "At every logged update, print the rollout's completions (the last user message, the completion, "
        "each reward) and send the table to the trackers (TRL GRPO's field).")})
    num_completions_to_print: int | None = field(default=None, metadata={"help": (
        "With log_completions: how many rows to print; None: every row of the rollout.")})

    def check_grpo_fields(self) -> None:
        """Values of the GRPO fields no engine runs with, refused naming the field (after
        :meth:`resolve_grpo_aliases`)."""
        from .generation.filters import SamplingFilters

        SamplingFilters.from_config(self)  # checks the filters and generation_kwargs
        n = self.num_completions_to_print
        if n is not None and (isinstance(n, bool) or not isinstance(n, int) or n < 1):
            raise ValueError(f"PPOConfig.num_completions_to_print must be an int >= 1 or None (every row), got {n!r}.")

    def resolve_grpo_aliases(self) -> None:
        """Raises ``ValueError`` naming both fields when both are set to different values (the
        PPO field counts as set when it differs from its default)."""
        defaults = {f.name: f.default for f in fields(self) if f.default is not MISSING}
        # which GRPO names the caller gave (after this, every alias reads its PPO field's value)
        self._grpo_aliases_given = tuple(alias for alias in GRPO_ALIASES if getattr(self, alias) is not None)
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


# ---------------------------------------------------------------- GRPO's metric names
# TRL GRPO's logged key -> this package's key for the same quantity (log_history keeps both; the
# package's own key says more: where it is a sum, a side, a phase). Derived keys are in grpo_metrics.
GRPO_METRIC_SOURCES = {
    "reward": "objective/scores_before_penalty",  # the reward functions' weighted sum, mean
    "reward_std": "objective/scores_std",  # logged under GRPO's name already with num_generations > 1
    "completions/mean_length": "val/response_length",
    "completions/min_length": "val/response_length_min",
    "completions/max_length": "val/response_length_max",
    "completions/mean_terminated_length": "val/terminated_length_mean",
    "completions/min_terminated_length": "val/terminated_length_min",
    "completions/max_terminated_length": "val/terminated_length_max",
    "entropy": "policy/entropy_avg",  # per token, of the full next-token distribution
    "clip_ratio/low_mean": "policy/clipfrac_lower_avg",
    "clip_ratio/high_mean": "policy/clipfrac_upper_avg",
    "grad_norm": "policy/grad_norm",
    "learning_rate": "lr",
    "loss": "loss/policy_avg",  # GRPO's loss is its policy loss; the value loss is loss/value_avg
}


def grpo_metrics(metrics: dict, *, num_tokens_seen: float | None = None,
                 step_time: float | None = None) -> dict[str, float]:
    """TRL GRPO's names for the quantities of ``metrics`` (one update's, this package's keys),
    to log beside them: :data:`GRPO_METRIC_SOURCES` copied (a key ``metrics`` holds already, such
    as the group estimators' ``reward_std``, stays out), and

    * ``completions/clipped_ratio`` = ``1 - val/eos_rate`` (responses that did not stop);
    * ``kl`` = ``objective/kl / val/response_length``: the per-token KL (GRPO's figure), where the
      package's is summed per response (the total over the tokens, divided by the tokens);
    * ``clip_ratio/region_mean`` = low + high (the two sides never meet: A < 0 vs A > 0);
    * ``num_tokens`` = ``num_tokens_seen`` (prompt + completion tokens so far, every process) and
      ``step_time`` (seconds of the update), when given.

    A source the update did not log is left out (``grad_norm`` without a step).

    Example:
        >>> grpo_metrics({"objective/kl": 1.5, "val/response_length": 3.0, "val/eos_rate": 0.75}, step_time=1.25)
        {'completions/mean_length': 3.0, 'completions/clipped_ratio': 0.25, 'kl': 0.5, 'step_time': 1.25}
    """
    out = {grpo: metrics[ours] for grpo, ours in GRPO_METRIC_SOURCES.items() if ours in metrics and grpo not in metrics}
    if "val/eos_rate" in metrics:
        out["completions/clipped_ratio"] = 1.0 - metrics["val/eos_rate"]
    if "objective/kl" in metrics and metrics.get("val/response_length"):
        out["kl"] = metrics["objective/kl"] / metrics["val/response_length"]
    if "policy/clipfrac_lower_avg" in metrics and "policy/clipfrac_upper_avg" in metrics:
        out["clip_ratio/region_mean"] = metrics["policy/clipfrac_lower_avg"] + metrics["policy/clipfrac_upper_avg"]
    if num_tokens_seen is not None:
        out["num_tokens"] = float(num_tokens_seen)
    if step_time is not None:
        out["step_time"] = float(step_time)
    return out


# ---------------------------------------------------------------- a GRPO script's configuration
# TRL GRPO's defaults for the settings where PPO's differ (tests/test_grpo_names.py checks them against
# the installed TRL): GRPO name -> (PPO field, GRPO's default, what it is).
GRPO_DEFAULTS = {
    "max_completion_length": ("response_length", 512, "completion length"),
    "temperature": ("temperature", 1.0, "sampling temperature"),
    "num_generations": ("num_generations", 8, "samples per prompt"),
    "num_iterations": ("num_ppo_epochs", 1, "passes over each rollout batch"),
}


def grpo_style_fields(args) -> list[str]:
    """The settings of ``args`` (a ``PPOConfig``) that only a GRPO script gives: a GRPO alias
    (``max_completion_length``, ``epsilon``, ...), a GRPO field away from its default (``top_p``,
    ``log_completions``, ...), or ``num_generations > 1``. Empty for a PPO script."""
    given = list(getattr(args, "_grpo_aliases_given", ()))
    own = [f for f in fields(GRPOFields) if f.name not in GRPO_ALIASES and f.default is not MISSING]
    given += [f.name for f in own if getattr(args, f.name, f.default) != f.default]
    if getattr(args, "num_generations", 1) > 1:
        given.append("num_generations")
    return given


def grpo_defaults_warning(args, signals: tuple[str, ...] = ()) -> str | None:
    """The one warning for a GRPO-style configuration that keeps PPO's defaults where GRPO's differ.

    Args:
        args: the trainer's ``PPOConfig``.
        signals: other signs of a GRPO script the caller saw (``"reward_funcs without a
            reward_model"``); with :func:`grpo_style_fields` they make the configuration GRPO-style.
    Returns:
        None for a PPO-style configuration, or one with GRPO's values everywhere; else a text
        naming what matched GRPO and each PPO default in force where GRPO's differs (completion
        length, temperature, samples per prompt, passes per batch), with GRPO's value.

    Example:
        >>> from types import SimpleNamespace
        >>> args = SimpleNamespace(_grpo_aliases_given=("max_completion_length",), response_length=256,
        ...                        temperature=0.7, num_generations=1, num_ppo_epochs=4)
        >>> print(grpo_defaults_warning(args).split(". ")[1])
        PPO's defaults differ from GRPO's where it sets nothing: sampling temperature: temperature=0.7, GRPO's ...
    """
    matched = [*grpo_style_fields(args), *signals]
    if not matched:
        return None
    given = set(matched)
    declared = getattr(type(args), "__dataclass_fields__", {})
    differing = []
    for grpo_name, (ppo_name, grpo_value, what) in GRPO_DEFAULTS.items():
        value = getattr(args, ppo_name)
        ppo_default = declared[ppo_name].default if ppo_name in declared else PPO_DEFAULTS[ppo_name]
        if grpo_name in given or value != ppo_default or value == grpo_value:
            continue  # set by the script (as far as a config can tell), or GRPO's value anyway
        differing.append(f"{what}: {ppo_name}={value}, GRPO's {grpo_name}={grpo_value}")
    if not differing:
        return None
    return (
        f"This looks like a GRPO configuration (it sets {', '.join(matched)}, which mean here what they mean in "
        f"TRL's GRPOConfig). PPO's defaults differ from GRPO's where it sets nothing: {'; '.join(differing)}. "
        "Set them to GRPO's values to sample and update as your GRPO script did, or keep PPO's (a critic "
        "usually wants several passes over each batch); see docs/dropin.md, 'Coming from GRPO'."
    )


# PPO's defaults of the four settings above (PPOConfig's; read from its fields when args is one).
PPO_DEFAULTS = {"response_length": 53, "temperature": 0.7, "num_generations": 1, "num_ppo_epochs": 4}
