"""Forward passes the trainer needs from its models, for separate and shared set-ups.

Every function takes explicit ``attention_mask`` and ``position_ids``: the masks come from
the collator's prompt mask and the response mask, never from comparing ids with the pad id
(with pad == EOS that would hide real EOS tokens).

Notation: ``B`` sequences, ``L`` = prompt + response positions, ``V`` vocabulary.

Example:

>>> from torch import nn
>>> from trl_ppo_ext.models.policy_value import is_checkpointing
>>> is_checkpointing(nn.Linear(2, 2))
False
"""

from __future__ import annotations

import contextlib
import logging
import weakref

import torch
from torch import nn

from .fsdp import unit_class_names
from .sharding import is_zero3_param

logger = logging.getLogger(__name__)


def backbone_hidden(model: nn.Module, input_ids, attention_mask, position_ids) -> torch.Tensor:
    """Final hidden states of a ``*ForSequenceClassification``-style model's backbone.

    Args:
        model: a model with ``base_model_prefix`` naming its backbone (as every transformers
            model has) and a ``score`` head.
        input_ids, attention_mask, position_ids: ``(B, L)``.
    Returns:
        ``(B, L, H)`` last hidden state.
    """
    backbone = getattr(model, model.base_model_prefix)
    out = backbone(
        input_ids=input_ids,
        attention_mask=attention_mask,
        position_ids=position_ids,
        use_cache=False,
        return_dict=True,
    )
    hidden = getattr(out, "last_hidden_state", None)
    if hidden is None and getattr(out, "hidden_states", None):
        hidden = out.hidden_states[-1]  # a custom backbone that fills only what TRL reads
    if hidden is None:
        raise ValueError(
            f"{type(model).__name__}.{model.base_model_prefix} returned {type(out).__name__} without "
            "`last_hidden_state` or `hidden_states`. Return a transformers BaseModelOutput with the final "
            "hidden states (B, L, H) as `last_hidden_state`."
        )
    return hidden


def scalar_head(model: nn.Module, hidden: torch.Tensor) -> torch.Tensor:
    """Apply a scalar head (``model.score``) to hidden states ``(..., H)`` -> ``(...)`` float32.

    A plain ``nn.Linear`` head is computed in float32 outside autocast, whatever the dtype of
    its weights or the surrounding mixed precision: values and scores are regression outputs
    whose bf16 rounding (~0.4% of their size) would show in the value loss and the advantages.
    The shared actor-critic's value head follows the same rule. Other heads (quantized,
    wrapped) run as they are, and so does a head partitioned by DeepSpeed ZeRO-3: only its own
    forward gathers its weight (in the precision DeepSpeed keeps it in).
    """
    head = getattr(model, "score", None)
    if head is None:
        raise ValueError(
            f"{type(model).__name__} has no `score` head. The reward and value models must be "
            "AutoModelForSequenceClassification models with num_labels=1."
        )
    if type(head) is nn.Linear and not is_zero3_param(head.weight):
        with torch.autocast(device_type=hidden.device.type, enabled=False):
            bias = None if head.bias is None else head.bias.float()
            out = torch.nn.functional.linear(hidden.float(), head.weight.float(), bias)
    else:
        out = head(hidden.to(head.weight.dtype) if hasattr(head, "weight") else hidden)
    if out.shape[-1] != 1:
        raise ValueError(
            f"{type(model).__name__}.score returns {out.shape[-1]} labels; PPO needs a scalar reward/value "
            "head. Load the model with num_labels=1."
        )
    return out.squeeze(-1).float()


@torch.no_grad()
def score_at(model: nn.Module, input_ids, attention_mask, position_ids, index: torch.Tensor) -> torch.Tensor:
    """Reward model score read at one position per sequence.

    Args:
        input_ids, attention_mask, position_ids: ``(B, L)``.
        index: ``(B,)`` position to read, the last valid response token.
    Returns:
        ``(B,)`` float32 scores.
    """
    hidden = backbone_hidden(model, input_ids, attention_mask, position_ids)
    rows = torch.arange(hidden.shape[0], device=hidden.device)
    return scalar_head(model, hidden[rows, index.to(hidden.device)])


def lm_logits(model: nn.Module, input_ids, attention_mask, position_ids, logits_to_keep: int = 0) -> torch.Tensor:
    """Causal-LM logits of the last ``logits_to_keep`` positions (0: all), ``(B, k, V)``.

    Models whose forward has no ``logits_to_keep`` (older or remote-code ones) return every
    position; callers slice from the end, so both work.
    """
    kwargs = dict(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids, use_cache=False)
    if logits_to_keep:
        try:
            return model(**kwargs, logits_to_keep=logits_to_keep).logits
        except TypeError as err:
            if "logits_to_keep" not in str(err):
                raise
    return model(**kwargs).logits


class GeneratesWithPolicy:
    """What a GRPO ``rollout_func`` reads on ``trainer.model`` (the policy+critic module) to sample
    without vLLM, delegated to the causal LM ``self.policy``: ``generate``, ``generation_config``,
    ``device`` and ``dtype``. ``trainer.model.generate(...)`` and
    ``trainer.accelerator.unwrap_model(trainer.model).generate(...)`` then sample from the policy
    being trained, with its adapter active (:meth:`_policy_active`). Mixed into
    :class:`PolicyAndValue` and ``SharedActorCritic``; the causal LM itself is ``.policy``."""

    def _policy_active(self):
        """The block in which ``self.policy`` computes the policy (nothing to switch by default)."""
        return contextlib.nullcontext()

    def generate(self, *args, **kwargs):
        """``self.policy.generate(*args, **kwargs)``: transformers' ``generate`` of the policy."""
        with self._policy_active():
            return self.policy.generate(*args, **kwargs)

    @property
    def generation_config(self):
        """The policy's ``generation_config`` (the trainer's own rollouts set theirs in full)."""
        return self.policy.generation_config

    @property
    def device(self) -> torch.device:
        """The device of the policy's first parameter (transformers' ``model.device``)."""
        return next(self.policy.parameters()).device

    @property
    def dtype(self) -> torch.dtype:
        """The dtype of the policy's first floating-point parameter (transformers' ``model.dtype``)."""
        return next(p.dtype for p in self.policy.parameters() if p.is_floating_point())


class PolicyAndValue(GeneratesWithPolicy, nn.Module):
    """A policy causal LM and a separate value model behind one ``forward`` (TRL's set-up).

    ``forward`` returns ``(logits (B, L, V), values (B, L))`` like ``SharedActorCritic``, so the
    trainer treats both set-ups alike; here the two come from two backbones.

    ``value_model=None`` is the critic-free policy (an advantage estimator that reads no value:
    GRPO, RLOO, REINFORCE++): no value parameters at all, and ``forward`` runs the policy only
    and returns values of 0.

    ``generate`` (and ``generation_config``, ``device``, ``dtype``) are the policy's
    (:class:`GeneratesWithPolicy`), so a GRPO ``rollout_func`` that calls ``trainer.model.generate``
    samples from the policy.
    """

    is_actor_critic = False

    def __init__(self, policy: nn.Module, value_model: nn.Module | None):
        super().__init__()
        self.policy = policy
        self.value_model = value_model

    @property
    def has_value(self) -> bool:
        """Whether there is a critic (a value model)."""
        return self.value_model is not None

    @property
    def config(self):
        return self.policy.config

    @property
    def _no_split_modules(self) -> list[str]:
        """The classes FSDP2 makes units of (``models.fsdp.unit_class_names``): the policy's
        transformers class, and the backbones and blocks of the policy and the value model."""
        return unit_class_names(self.policy, self.value_model)

    def forward(self, input_ids, attention_mask=None, position_ids=None, logits_to_keep: int = 0,
                value_inputs: tuple | None = None, **kwargs):
        """``(logits (B, k, V), values (B, k))`` for the last ``k = logits_to_keep`` positions (0: all);
        values float32, all 0 without a value model (nothing of a critic runs). ``value_inputs``: the
        value model's own ``(input_ids, attention_mask, position_ids)``, each ``(B, L')`` (a privileged
        context before the prompt, ``critic_context_column``), its values read at its own last ``k``
        positions; None: the policy's inputs."""
        logits = lm_logits(self.policy, input_ids, attention_mask, position_ids, logits_to_keep)
        if self.value_model is None:
            return logits, torch.zeros(logits.shape[:2], dtype=torch.float32, device=logits.device)
        if value_inputs is not None:
            input_ids, attention_mask, position_ids = value_inputs
        hidden = backbone_hidden(self.value_model, input_ids, attention_mask, position_ids)
        if logits_to_keep:
            hidden = hidden[:, -logits_to_keep:]
        return logits, scalar_head(self.value_model, hidden)

    def _models(self) -> list[tuple[nn.Module, str]]:
        return [(self.policy, "policy")] + ([(self.value_model, "value model")] if self.has_value else [])

    @property
    def is_gradient_checkpointing(self) -> bool:
        """Whether the policy or the value model checkpoints activations (TRL's generation
        context reads it to switch checkpointing off and back on around ``generate``)."""
        return any(is_checkpointing(m) for m, _ in self._models())

    def gradient_checkpointing_enable(self, gradient_checkpointing_kwargs: dict | None = None, **kwargs):
        """Checkpoint the activations of both backbones (policy and value model); a model that
        cannot is skipped with one warning naming it (see :func:`enable_checkpointing`). Called
        again without kwargs (TRL's generation context, after each rollout), it reuses the
        kwargs of the last call that gave some."""
        kwargs = remembered_checkpointing_kwargs(self, gradient_checkpointing_kwargs)
        for model, role in self._models():
            enable_checkpointing(model, kwargs, role=role)

    def gradient_checkpointing_disable(self):
        for model, _ in self._models():
            disable_checkpointing(model)


def remembered_checkpointing_kwargs(wrapper: nn.Module, given: dict | None) -> dict | None:
    """``given``, remembered on ``wrapper``; or, when None, the kwargs remembered last time.

    The trainer enables checkpointing with the config's kwargs (``use_reentrant`` ...); TRL's
    generation context switches it off for ``generate`` and back on without them, which would
    otherwise reset them to transformers' defaults after the first rollout.
    """
    if given is not None:
        wrapper._checkpointing_kwargs = dict(given)
    return getattr(wrapper, "_checkpointing_kwargs", None)


def _transformers_model(model: nn.Module) -> nn.Module:
    """The ``transformers`` model inside a peft wrapper, or ``model`` itself."""
    get_base_model = getattr(model, "get_base_model", None)
    return get_base_model() if callable(get_base_model) else model


def checkpointing_unsupported_reason(model: nn.Module) -> str | None:
    """Why ``model`` cannot checkpoint its activations, or None if it can.

    transformers models say so with the class attribute ``supports_gradient_checkpointing``
    and need at least one module with a ``gradient_checkpointing`` flag to set; other modules
    need their own ``gradient_checkpointing_enable``. A peft model is judged by its base.
    """
    base = _transformers_model(model)
    if hasattr(base, "supports_gradient_checkpointing"):  # a transformers PreTrainedModel
        if not base.supports_gradient_checkpointing:
            return "its class does not set supports_gradient_checkpointing = True"
        if not any(hasattr(m, "gradient_checkpointing") for m in base.modules()):
            return "none of its modules has a `gradient_checkpointing` flag"
        return None
    if not (hasattr(model, "activation_checkpointing_enable") or hasattr(model, "gradient_checkpointing_enable")):
        return "it has no gradient_checkpointing_enable method"
    return None


# Models already warned about, so that each gets its warning once per process however often
# checkpointing is re-enabled (TRL's generation context does so after every rollout).
_WARNED: weakref.WeakSet = weakref.WeakSet()


def _is_main_process() -> bool:
    """Rank 0, or no process group: one warning per run, not one per process."""
    dist = torch.distributed
    return not (dist.is_available() and dist.is_initialized()) or dist.get_rank() == 0


def enable_checkpointing(model: nn.Module, checkpointing_kwargs: dict | None = None, role: str = "model") -> bool:
    """Turn on activation checkpointing of a ``transformers`` model (or a peft model around one)
    under the name its version has (``activation_checkpointing_enable`` from transformers 5).

    A model that cannot checkpoint (a custom ``PreTrainedModel`` without
    ``supports_gradient_checkpointing``, a plain ``nn.Module``) is left as it is and trains
    without checkpointing, as under TRL's PPO trainer: one warning names it and its ``role``
    (e.g. ``"value model"``) the first time, on the main process only; later calls skip it
    silently.

    Returns:
        Whether checkpointing is on for ``model`` now.
    """
    reason = checkpointing_unsupported_reason(model)
    if reason is not None:
        if model not in _WARNED:
            _WARNED.add(model)
            if _is_main_process():
                logger.warning(
                    "gradient_checkpointing=True is not applied to the %s (%s): %s. It trains without activation "
                    "checkpointing (more activation memory); set supports_gradient_checkpointing = True on the "
                    "class if its layers can checkpoint, or gradient_checkpointing=False to silence this.",
                    role, type(_transformers_model(model)).__name__, reason,
                )
        return False
    if hasattr(model, "activation_checkpointing_enable"):
        model.activation_checkpointing_enable(checkpointing_kwargs)
    else:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=checkpointing_kwargs)
    return True


def disable_checkpointing(model: nn.Module) -> None:
    """Turn activation checkpointing off; a model that cannot checkpoint is left as it is."""
    if checkpointing_unsupported_reason(model) is not None:
        return
    if hasattr(model, "activation_checkpointing_disable"):
        model.activation_checkpointing_disable()
    else:
        model.gradient_checkpointing_disable()


def is_checkpointing(model: nn.Module) -> bool:
    """Whether any layer of ``model`` checkpoints its activations."""
    return any(getattr(m, "gradient_checkpointing", False) is True for m in model.modules())
