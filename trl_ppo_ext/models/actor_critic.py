"""Shared-backbone actor-critic for PPO on one GPU (the loaders are in ``trl_ppo_ext.models.loading``).

TRL's PPO keeps four full models (policy, reference, value model, reward model); at 7B
that does not fit one GPU. Here policy, reference and critic share ONE frozen base:

* policy    = base + a LoRA adapter (``SharedActorCritic.policy``, a ``peft.PeftModel``);
* reference = the same base with the adapter disabled (``reference_context()``);
* critic    = a scalar ``nn.Linear(hidden_size, 1)`` on the final hidden state of the
  policy's own forward, so one forward gives logits and values.

Only the LoRA weights and the value head train. The reward model is loaded separately
(``trl_ppo_ext.models.loading.load_reward_model``), optionally in 4-bit, and can be kept off the GPU between
scoring passes (``trl_ppo_ext.models.offload``).

Notation: ``B`` sequences, ``L`` tokens per sequence (prompt + response), ``V`` vocab,
``H`` hidden size.

Example:

>>> from torch import nn
>>> from trl_ppo_ext.models.prepare import disable_dropout
>>> model = nn.Sequential(nn.Linear(2, 2), nn.Dropout(0.1))
>>> disable_dropout(model)  # no config values to record in a plain module
[]
>>> model[1].p
0.0
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import warnings
from collections.abc import Iterator

import torch
from peft import LoraConfig, PeftModel, get_peft_model
from torch import nn

from .branch_critic import (
    branch_lora_config,
    capture_layer_inputs,
    check_adapter_above_branch,
    decoder_stack,
    num_decoder_layers,
    resolve_branch_layer,
    run_layers_above,
    switch_adapter_at_branch,
)
from .fsdp import is_fsdp2_model, unit_class_names
from .policy_value import (
    GeneratesWithPolicy,
    disable_checkpointing,
    enable_checkpointing,
    is_checkpointing,
    remembered_checkpointing_kwargs,
)
from .quantization import is_4bit_model, make_4bit_cpu_safe

logger = logging.getLogger(__name__)

VALUE_HEAD_WEIGHTS = "value_head.safetensors"
VALUE_HEAD_CONFIG = "value_head_config.json"
VALUE_ADAPTER_NAME = "value"
# Attention projections of Llama-like models (Llama, Mistral, Qwen2, Gemma, Phi-3 ...).
LLAMA_ATTENTION_PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj")


def default_lora_config(model: nn.Module, *, r: int = 16, lora_alpha: int = 32,
                        lora_dropout: float = 0.0,
                        target_modules: list[str] | str | None = None) -> LoraConfig:
    """A causal-LM ``LoraConfig``; by default on the q/k/v/o projections of ``model``.

    Args:
        model: the base model (only its module names are read).
        r, lora_alpha, lora_dropout: the usual LoRA rank, scale numerator and dropout.
        target_modules: module names (or ``"all-linear"``); None picks those of
            ``LLAMA_ATTENTION_PROJECTIONS`` that ``model`` has.

    Raises:
        ValueError: ``target_modules`` is None and ``model`` has none of q/k/v/o_proj.
    """
    if target_modules is None:
        leaf_names = {name.rsplit(".", 1)[-1] for name, _ in model.named_modules()}
        target_modules = [n for n in LLAMA_ATTENTION_PROJECTIONS if n in leaf_names]
        if not target_modules:
            raise ValueError(
                f"lora_target_modules=None: {type(model).__name__} has none of the Llama-style "
                f"projections {list(LLAMA_ATTENTION_PROJECTIONS)}. Pass the module names to adapt, "
                "e.g. lora_target_modules=['c_attn'] for GPT-2, or 'all-linear'."
            )
    return LoraConfig(r=r, lora_alpha=lora_alpha, lora_dropout=lora_dropout,
                      target_modules=target_modules, bias="none", task_type="CAUSAL_LM")


def _hidden_size(config) -> int:
    """Hidden size of a (possibly multimodal) transformers config."""
    text_config = config.get_text_config() if hasattr(config, "get_text_config") else config
    return int(text_config.hidden_size)


@contextlib.contextmanager
def _quiet_peft_on_new_transformers() -> Iterator[None]:
    """peft 0.21 reads ``model.is_gradient_checkpointing``, which transformers 5 deprecated
    in favour of ``is_activation_checkpointing``; the FutureWarning is not the user's to fix."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=r".*is_gradient_checkpointing.*deprecated",
                                category=FutureWarning)
        yield


def _new_value_head(hidden_size: int, device: torch.device) -> nn.Linear:
    """fp32 ``Linear(H, 1)``; weights ~ N(0, 1/(H+1)^2) and zero bias, so initial values are
    close to 0 and the first value-loss gradients do not swamp the policy gradient."""
    head = nn.Linear(hidden_size, 1, device=device, dtype=torch.float32)
    nn.init.normal_(head.weight, std=1.0 / (hidden_size + 1))
    nn.init.zeros_(head.bias)
    return head


class SharedActorCritic(GeneratesWithPolicy, nn.Module):
    """Policy (LoRA on a frozen base), reference (adapter off) and critic on one backbone.

    ``forward`` runs the policy once with ``output_hidden_states=True`` and applies the
    value head to the last hidden state: logits and values from the same pass. The base
    stays frozen; ``value_head`` and the LoRA weights are the only trainable parameters.

    Value LoRA (``value_lora_config``), off by default. Off: the critic reads the
    policy-adapted final hidden state -- one backbone forward, but policy and value
    gradients meet in the same LoRA weights (``value_coef`` balances them). On: the critic
    gets its own LoRA adapter (``"value"``) on the same base, and ``forward`` costs a
    second backbone pass (without the LM head) with that adapter active: about 2x the
    forward/backward compute and activation memory of the default, plus one adapter of
    weights and optimizer state; in exchange the value loss cannot disturb the policy.
    With ``value_branch_layer=k`` the value adapter covers layers ``k..N-1`` only and the critic
    branches from the policy's own pass at the input of layer ``k``, detached: it costs those
    ``N - k`` layers instead of a whole backbone (``models.branch_critic``; Llama, Mistral, Qwen2,
    Qwen3).
    Gradient checkpointing holds with a value adapter: a checkpointed layer recomputes during
    backward, when another adapter may be active, so each one recomputes under the adapter
    that was active when it ran forward (torch's non-reentrant ``context_fn``); gradients are
    those without checkpointing, bit for bit. Reentrant checkpointing has no such hook and is
    refused with a value adapter.

    ``generate`` (and ``generation_config``, ``device``, ``dtype``) are the policy's: the
    PeftModel ``.policy`` with the policy adapter active, whichever adapter was active before
    (a GRPO ``rollout_func`` calls ``trainer.model.generate``).

    Args:
        base_model: a causal LM (``transformers`` ``*ForCausalLM``), plain or 4-bit; or a
            ``peft.PeftModel`` that already carries the policy adapter (``lora_config``
            must then be None). A 4-bit base is made CPU-safe (``make_4bit_cpu_safe``).
        lora_config: LoRA for the policy; None -> :func:`default_lora_config`.
        value_head: a ``Linear(H, 1)`` to use as critic; None -> a new fp32 one.
        value_lora_config: a separate LoRA adapter for the critic (see above); None -> off.
            A PeftModel that already has an adapter named ``"value"`` turns it on too.
        with_value: False builds the critic-free policy (an advantage estimator that reads no
            value: GRPO, RLOO, REINFORCE++): no value head and no value adapter exist, and
            ``forward`` runs the policy alone and returns values of 0. The reference is the
            adapter off, as with a critic.
        value_branch_layer: with a value adapter, the decoder layer whose input the critic
            branches from (negative: counted from the top; see ``models.branch_critic``); the
            value adapter's ``layers_to_transform`` is set to the layers from there up. None:
            the value adapter runs the whole backbone.

    Raises:
        ValueError: a PeftModel together with ``lora_config``; a value head of the wrong
            shape; reentrant gradient checkpointing together with a value adapter; a value
            head, a value adapter or ``value_lora_config`` with ``with_value=False``;
            ``value_branch_layer`` without a value adapter, out of range, on a family
            ``models.branch_critic`` does not support, or with a value adapter on layers
            below it.
    """

    is_actor_critic = True

    def __init__(self, base_model: nn.Module, lora_config: LoraConfig | None = None,
                 value_head: nn.Linear | None = None,
                 value_lora_config: LoraConfig | None = None, with_value: bool = True,
                 value_branch_layer: int | None = None):
        super().__init__()
        if not with_value and (value_head is not None or value_lora_config is not None
                               or value_branch_layer is not None):
            raise ValueError(
                "with_value=False builds an actor-critic without a critic, and a value_head, value_lora_config or "
                "value_branch_layer was given too. Drop them, or pass with_value=True."
            )
        self.value_branch_layer = None
        if value_branch_layer is not None:  # refused before peft changes the caller's model
            base = base_model.get_base_model() if isinstance(base_model, PeftModel) else base_model
            self.value_branch_layer = resolve_branch_layer(
                value_branch_layer, num_decoder_layers(base))
        self.policy = self._wrap_policy(base_model, lora_config)
        self.policy_adapter = self.policy.active_adapter
        self.value_adapter = self._add_value_adapter(value_lora_config)
        if not with_value:
            if self.value_adapter is not None:
                raise ValueError(
                    f"with_value=False, but the policy carries a value adapter {self.value_adapter!r}. Pass a "
                    "PeftModel without it (delete_adapter), or with_value=True."
                )
            self.value_head = None
            return
        hidden_size = _hidden_size(self.config)
        device = self.policy.get_output_embeddings().weight.device
        if value_head is None:
            value_head = _new_value_head(hidden_size, device)
        elif (value_head.in_features, value_head.out_features) != (hidden_size, 1):
            raise ValueError(
                f"value_head=Linear({value_head.in_features}, {value_head.out_features}) does not "
                f"fit this base (hidden_size={hidden_size}). Pass nn.Linear({hidden_size}, 1), "
                "or value_head=None for a new one."
            )
        self.value_head = value_head
        if self.value_adapter is not None and self.is_gradient_checkpointing:
            # the base came checkpointing: again, with each layer recomputing under its adapter
            self.gradient_checkpointing_enable()

    @staticmethod
    def _wrap_policy(base_model: nn.Module, lora_config: LoraConfig | None) -> PeftModel:
        """Wrap ``base_model`` in a LoRA PeftModel (frozen base), or accept one as is."""
        if isinstance(base_model, PeftModel):
            if lora_config is not None:
                raise ValueError(
                    f"base_model is already a PeftModel (adapters {list(base_model.peft_config)}) "
                    f"and lora_config={type(lora_config).__name__}(r={getattr(lora_config, 'r', '?')}, ...) "
                    "was also given. Pass either a plain causal "
                    "LM with lora_config, or the PeftModel with lora_config=None."
                )
            if is_4bit_model(base_model):
                make_4bit_cpu_safe(base_model)
            return base_model
        if is_4bit_model(base_model):
            make_4bit_cpu_safe(base_model)
        config = lora_config if lora_config is not None else default_lora_config(base_model)
        with _quiet_peft_on_new_transformers():
            return get_peft_model(base_model, config)  # freezes every base parameter

    def _add_value_adapter(self, value_lora_config: LoraConfig | None) -> str | None:
        """Add the critic's LoRA adapter (trainable, inactive); its name, or None if off."""
        exists = VALUE_ADAPTER_NAME in self.policy.peft_config
        k = self.value_branch_layer
        if value_lora_config is None:
            if k is not None and not exists:
                raise ValueError(
                    f"value_branch_layer={k} gives the value adapter the layers above the branch, and there is no "
                    "value adapter: pass value_lora_config=LoraConfig(...) (use_value_adapter=True in PPOConfig), or "
                    "value_branch_layer=None."
                )
            if k is not None:
                check_adapter_above_branch(
                    self.policy.peft_config[VALUE_ADAPTER_NAME].layers_to_transform, k)
            return VALUE_ADAPTER_NAME if exists else None
        if k is not None:
            num_layers = num_decoder_layers(self.policy.get_base_model())
            value_lora_config = branch_lora_config(value_lora_config, k, num_layers)
        if exists:
            raise ValueError(
                f"value_lora_config was given but the policy already has an adapter named "
                f"{VALUE_ADAPTER_NAME!r}. Pass value_lora_config=None to use that one."
            )
        self.policy.add_adapter(VALUE_ADAPTER_NAME, value_lora_config)
        # peft leaves an added, inactive adapter frozen; the critic's adapter must train.
        for name, param in self.policy.named_parameters():
            if f".{VALUE_ADAPTER_NAME}." in f".{name}.":
                param.requires_grad_(True)
        return VALUE_ADAPTER_NAME

    @property
    def has_value(self) -> bool:
        """Whether there is a critic (a value head)."""
        return self.value_head is not None

    # ------------------------------------------------------------------ forward

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None,
                position_ids: torch.Tensor | None = None, logits_to_keep: int = 0,
                value_inputs: tuple | None = None, **kwargs) -> tuple[torch.Tensor, torch.Tensor]:
        """Policy logits and critic values for the last ``logits_to_keep`` positions (0: all).

        Args:
            input_ids: token ids. Shape: (B, L).
            attention_mask: 1 = real token, 0 = padding. Shape: (B, L).
            position_ids: positions (left padding needs them). Shape: (B, L).
            logits_to_keep: k > 0 computes the LM head on the last k positions only (PPO
                needs the response positions, not the prompt's).
            value_inputs: the critic's own ``(input_ids, attention_mask, position_ids)``, each
                ``(B, L')``, for its pass under the value adapter (a privileged context before the
                prompt, ``critic_context_column``); its values are read at its own last k positions.
                Needs a value adapter that runs its own pass (refused with the shared value head,
                whose values are the policy's pass, and with a branch critic). None: the policy's.
            **kwargs: passed to the policy's forward (``use_cache`` defaults to False).

        Returns:
            logits: next-token logits, dtype of the model. Shape: (B, k, V) (k = L when 0).
            values: float32 value estimates ``V(s_t)`` at the same positions, all 0 without a
                critic (``with_value=False``). Shape: (B, k).
        """
        kwargs.setdefault("use_cache", False)
        if logits_to_keep:
            kwargs["logits_to_keep"] = logits_to_keep
        if value_inputs is not None and (self.value_adapter is None or self.value_branch_layer is not None):
            raise ValueError(
                "value_inputs (the critic's own sequence) needs a critic with a pass of its own: this "
                f"SharedActorCritic's values come from the policy's pass ({self._value_layout()}). Build it with "
                "value_lora_config=LoraConfig(...) and value_branch_layer=None, or use a separate value model."
            )
        if self.value_head is None:  # no critic: the policy's forward alone
            logits = self.policy(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                                 **kwargs).logits
            return logits, torch.zeros(logits.shape[:2], dtype=torch.float32, device=logits.device)
        # The final hidden state is the LM head's input: catch it there instead of asking for
        # every layer's hidden states (output_hidden_states keeps L+1 (B, L, H) tensors alive).
        captured = []
        head = self.policy.get_base_model().get_output_embeddings()
        hook = head.register_forward_pre_hook(lambda module, args: captured.append(args[0]))
        try:
            with self._branch_capture() as branch_inputs:  # the upper layers' inputs, for a branch critic
                output = self.policy(input_ids=input_ids, attention_mask=attention_mask,
                                     position_ids=position_ids, **kwargs)
        finally:
            hook.remove()
        if self.value_adapter is None:
            hidden = captured[-1]  # (B, k, H), after the final norm
        elif self.value_branch_layer is not None:
            hidden = self._branch_hidden_states(branch_inputs)
            hidden = hidden[:, -logits_to_keep:] if logits_to_keep else hidden
        else:
            hidden = self._value_hidden_states(*(value_inputs or (input_ids, attention_mask, position_ids)))
            hidden = hidden[:, -logits_to_keep:] if logits_to_keep else hidden
        # Outside autocast: under bf16 mixed precision nn.Linear would round values to bf16.
        with torch.autocast(device_type=hidden.device.type, enabled=False):
            values = self.value_head(hidden.to(self.value_head.weight.dtype)).squeeze(-1)
        return output.logits, values.float()

    def _value_layout(self) -> str:
        """How this model's values are computed, in words (for errors)."""
        if self.value_head is None:
            return "no critic"
        if self.value_adapter is None:
            return "the shared value head on the policy's last hidden state"
        if self.value_branch_layer is not None:
            return f"a branch critic from the policy's layer {self.value_branch_layer}"
        return "a value adapter's own pass"

    def _branch_capture(self) -> contextlib.AbstractContextManager:
        """Around the policy's pass: record the inputs of the layers above the branch (a list), or
        nothing (None) without a branch critic."""
        if self.value_branch_layer is None:
            return contextlib.nullcontext()
        layers, _ = decoder_stack(self.policy.get_base_model())
        return capture_layer_inputs(layers, self.value_branch_layer)

    def _branch_hidden_states(self, branch_inputs: list) -> torch.Tensor:
        """The branch critic's final hidden states from the policy pass's record: the layers above
        the branch under the value adapter, the branch detached. Shape: (B, L, H)."""
        self._check_value_pass()
        layers, norm = decoder_stack(self.policy.get_base_model())
        with self._active_adapter(self.value_adapter):
            return run_layers_above(layers, norm, self.value_branch_layer, branch_inputs)

    def _check_value_pass(self) -> None:
        """Refuse a value pass that checkpointing would recompute under the wrong adapter, or that
        FSDP2 cannot run."""
        if torch.is_grad_enabled() and self.is_gradient_checkpointing and not self._recomputes_under_its_adapter():
            raise RuntimeError(
                "activation checkpointing was turned on on the base model directly: its layers would recompute "
                "the value pass with the policy adapter during backward. Turn it on through "
                "SharedActorCritic.gradient_checkpointing_enable(), which makes each layer recompute under the "
                "adapter it ran forward with."
            )
        if self.value_branch_layer is not None and is_fsdp2_model(self.policy.get_base_model()):
            raise NotImplementedError(
                "value_branch_layer under FSDP2: the critic calls the decoder layers above the branch and the "
                "final norm outside the backbone's forward, which FSDP2's units do not gather for. Use "
                "value_branch_layer=None (the full value adapter), or train under DDP or DeepSpeed."
            )

    def _value_hidden_states(self, input_ids, attention_mask, position_ids) -> torch.Tensor:
        """Final hidden states with the value adapter active (with a branch: from the branch up, the
        layers below under the policy adapter). Shape: (B, L, H)."""
        self._check_value_pass()
        base = self.policy.get_base_model()
        if self.value_branch_layer is not None:
            layers, _ = decoder_stack(base)
            backbone = getattr(base, base.base_model_prefix)
            with self._policy_active(), switch_adapter_at_branch(
                    layers, self.value_branch_layer, lambda: self._active_adapter(self.value_adapter)):
                return backbone(input_ids=input_ids, attention_mask=attention_mask,
                                position_ids=position_ids, use_cache=False).last_hidden_state
        backbone = getattr(base, base.base_model_prefix, None)  # the LM without its head
        if backbone is not None and is_fsdp2_model(base) and not is_fsdp2_model(backbone):
            raise NotImplementedError(
                f"A value adapter under FSDP2 needs the backbone of {type(base).__name__} as an FSDP unit of its "
                "own (the value pass runs it without the LM head), which a model whose input and output "
                "embeddings are tied cannot have (FSDP2 keeps a parameter in one unit). Build SharedActorCritic "
                "with value_lora_config=None (the value head reads the policy's hidden states), or train under "
                "DDP or DeepSpeed."
            )
        with self._active_adapter(self.value_adapter):
            if backbone is None:
                return base(input_ids=input_ids, attention_mask=attention_mask,
                            position_ids=position_ids, output_hidden_states=True,
                            use_cache=False).hidden_states[-1]
            return backbone(input_ids=input_ids, attention_mask=attention_mask,
                            position_ids=position_ids, use_cache=False).last_hidden_state

    def _policy_active(self):
        """The policy adapter active in the block (``generate``)."""
        return self._active_adapter(self.policy_adapter)

    @contextlib.contextmanager
    def _active_adapter(self, name: str) -> Iterator[None]:
        """Make adapter ``name`` the active one inside the block, leaving every
        ``requires_grad`` flag as it was (peft's ``set_adapter`` freezes inactive adapters).
        Nothing to switch when it is active already (the policy pass's layers recomputing).

        The switch runs once per forward and, under activation checkpointing, once per layer
        as the value pass recomputes in backward. peft's ``set_adapter`` walks every module and
        parameter (~16 ms a switch on a 32-layer Llama, whatever its width); where the adapters
        are plain LoRA layers it is enough to name the active adapter on each of them, which
        is what ``set_adapter`` does besides the ``requires_grad`` flags this keeps anyway."""
        previous = self.policy.active_adapter
        if previous == name:
            yield
            return
        layers = self._switchable_layers()
        if layers is not None:
            tuner = self.policy.base_model
            saved = [(layer, layer._active_adapter) for layer in layers]
            try:
                self.policy.active_adapter = tuner.active_adapter = name
                for layer, _ in saved:
                    layer._active_adapter = [name]
                yield
            finally:
                self.policy.active_adapter = tuner.active_adapter = previous
                for layer, was in saved:
                    layer._active_adapter = was
            return
        flags = [(p, p.requires_grad) for p in self.policy.parameters()]
        try:
            self.policy.set_adapter(name)
            for param, flag in flags:
                param.requires_grad_(flag)
            yield
        finally:
            self.policy.set_adapter(previous)
            for param, flag in flags:
                param.requires_grad_(flag)

    def _switchable_layers(self) -> list | None:
        """The adapter layers whose active adapter ``_active_adapter`` names directly, or None
        where that is not enough and peft's ``set_adapter`` must run: a module of another kind
        that follows the active adapter (``modules_to_save``, trainable tokens), a merged layer.
        Found once per set of adapters (adding one may wrap new modules)."""
        key = tuple(self.policy.peft_config)
        if getattr(self, "_switchable_key", None) != key:
            from peft.tuners.tuners_utils import BaseTunerLayer

            tuner = self.policy.base_model
            layers, others = [], False
            for module in tuner.model.modules():
                if isinstance(module, BaseTunerLayer):
                    layers.append(module)
                elif type(module).__module__.startswith("peft.") and hasattr(module, "set_adapter"):
                    others = True  # a peft wrapper of another kind (transformers' models have set_adapter too)
            plain = not others and hasattr(tuner, "active_adapter") and all(
                hasattr(layer, "_active_adapter") for layer in layers)
            self._switchable = layers if plain else None
            self._switchable_key = key
        layers = self._switchable
        if layers is None or any(layer.merged for layer in layers):
            return None
        return layers

    def reference_context(self) -> contextlib.AbstractContextManager:
        """Context in which ``policy`` (and ``forward``) compute with every adapter disabled,
        i.e. the frozen base model: the PPO reference policy, at no extra memory."""
        return self.policy.disable_adapter()

    # ------------------------------------------------------------ pass-throughs

    @property
    def config(self):
        """The base model's ``transformers`` config."""
        return self.policy.get_base_model().config

    @property
    def _no_split_modules(self) -> list[str]:
        """The classes FSDP2 makes units of (``models.fsdp.unit_class_names``): the base's
        transformers class, its backbone (unless the embeddings are tied) and its blocks."""
        return unit_class_names(self.policy)

    @property
    def is_gradient_checkpointing(self) -> bool:
        """Whether any layer of the base model checkpoints activations."""
        return is_checkpointing(self.policy.get_base_model())

    def gradient_checkpointing_enable(self, gradient_checkpointing_kwargs: dict | None = None,
                                      **kwargs) -> None:
        """Enable activation checkpointing on the base. A base that cannot checkpoint is
        skipped with one warning naming it (``enable_checkpointing``). Called again without
        kwargs (TRL's generation context, after each rollout), it reuses the kwargs of the last
        call that gave some. With a value adapter, checkpointing is non-reentrant and each layer
        recomputes under the adapter it ran forward with (see the class docstring); reentrant
        checkpointing or a ``context_fn`` of the caller's is then a ``ValueError``."""
        kwargs = remembered_checkpointing_kwargs(self, gradient_checkpointing_kwargs)
        if self.value_adapter is not None:
            kwargs = dict(kwargs or {})
            if kwargs.get("use_reentrant") or "context_fn" in kwargs:
                raise ValueError(self._checkpointing_refusal())
            kwargs.update(use_reentrant=False, context_fn=self._recompute_context)
        enable_checkpointing(self.policy.get_base_model(), kwargs, role="shared actor-critic backbone")

    def _recompute_context(self) -> tuple[contextlib.AbstractContextManager, contextlib.AbstractContextManager]:
        """torch.utils.checkpoint's ``context_fn``, called as a checkpointed layer runs forward:
        nothing around that forward, and the adapter active now around its recomputation."""
        return contextlib.nullcontext(), self._active_adapter(self.policy.active_adapter)

    def _recomputes_under_its_adapter(self) -> bool:
        """Whether every checkpointing layer of the base recomputes through ``_recompute_context``."""
        funcs = [getattr(m, "_gradient_checkpointing_func", None) for m in self.policy.get_base_model().modules()
                 if getattr(m, "gradient_checkpointing", False) is True]
        return all(getattr(f, "keywords", {}).get("context_fn") == self._recompute_context for f in funcs)

    def gradient_checkpointing_disable(self) -> None:
        """Disable activation checkpointing on the base."""
        disable_checkpointing(self.policy.get_base_model())

    def _checkpointing_refusal(self) -> str:
        return (
            f"reentrant gradient checkpointing (use_reentrant=True) or a context_fn of your own cannot be combined "
            f"with a value LoRA adapter ({self.value_adapter!r}): each layer must recompute under the adapter it "
            "ran forward with, which only non-reentrant checkpointing's context_fn can do. Leave use_reentrant "
            "unset (or False), or build SharedActorCritic with value_lora_config=None (the value head then reads "
            "the policy's hidden states)."
        )

    # ----------------------------------------------------------- save / load

    def save_pretrained(self, output_dir: str | os.PathLike, state_dict: dict | None = None) -> None:
        """Write the adapter(s) (peft layout: policy adapter at the top, the value adapter in
        ``value/``) and the value head (``value_head.safetensors`` + ``value_head_config.json``).

        ``peft.PeftModel.from_pretrained(base, output_dir)`` loads the policy alone;
        :meth:`from_pretrained` restores everything.

        ``state_dict``: the values to write, keyed as this module's ``state_dict`` (the adapters'
        and the value head's at least), instead of the module's own: a sharded model's full
        values (``models.fsdp.full_state_dict``).
        """
        from safetensors.torch import save_file

        os.makedirs(output_dir, exist_ok=True)
        if state_dict is None:
            self.policy.save_pretrained(output_dir)
        else:
            self.policy.save_pretrained(output_dir, state_dict={
                k.removeprefix("policy."): v for k, v in state_dict.items() if k.startswith("policy.")})
        if self.value_head is None:  # no critic: the adapter, and a config that says so
            with open(os.path.join(output_dir, VALUE_HEAD_CONFIG), "w") as f:
                json.dump({"with_value": False, "policy_adapter": self.policy_adapter, "value_adapter": None}, f,
                          indent=2)
            return
        head = self.value_head.state_dict() if state_dict is None else {
            k.removeprefix("value_head."): v for k, v in state_dict.items() if k.startswith("value_head.")}
        state = {k: v.detach().cpu().contiguous() for k, v in head.items()}
        save_file(state, os.path.join(output_dir, VALUE_HEAD_WEIGHTS))
        meta = {
            "hidden_size": self.value_head.in_features,
            "dtype": str(self.value_head.weight.dtype).removeprefix("torch."),
            "bias": self.value_head.bias is not None,
            "policy_adapter": self.policy_adapter,
            "value_adapter": self.value_adapter,
            "value_branch_layer": self.value_branch_layer,
        }
        with open(os.path.join(output_dir, VALUE_HEAD_CONFIG), "w") as f:
            json.dump(meta, f, indent=2)

    @classmethod
    def from_pretrained(cls, base_model: nn.Module, output_dir: str | os.PathLike,
                        is_trainable: bool = False) -> SharedActorCritic:
        """Rebuild a saved actor-critic on ``base_model`` (the same base it was trained on).

        Args:
            base_model: a plain causal LM (plain or 4-bit); it is modified in place by peft.
            output_dir: a directory written by :meth:`save_pretrained`.
            is_trainable: leave adapters and value head trainable (to resume training);
                False freezes everything (inference / evaluation).

        Raises:
            FileNotFoundError: ``output_dir`` lacks the value-head files.
            ValueError: the saved value head does not fit ``base_model``'s hidden size.
        """
        from safetensors.torch import load_file

        meta_path = os.path.join(output_dir, VALUE_HEAD_CONFIG)
        if not os.path.isfile(meta_path):
            raise FileNotFoundError(
                f"output_dir={os.fspath(output_dir)!r} has no {VALUE_HEAD_CONFIG}. Pass a directory "
                "written by SharedActorCritic.save_pretrained (a bare peft adapter directory can be "
                "loaded with SharedActorCritic(PeftModel.from_pretrained(base, dir)))."
            )
        with open(meta_path) as f:
            meta = json.load(f)
        if not meta.get("with_value", True):
            if is_4bit_model(base_model):
                make_4bit_cpu_safe(base_model)
            with _quiet_peft_on_new_transformers():
                policy = PeftModel.from_pretrained(
                    base_model, _adapter_dir(output_dir, meta["policy_adapter"]),
                    is_trainable=is_trainable, adapter_name=meta["policy_adapter"])
            return cls(policy, with_value=False).train(is_trainable)
        if meta["hidden_size"] != _hidden_size(base_model.config):
            raise ValueError(
                f"output_dir={os.fspath(output_dir)!r} holds a value head for hidden_size="
                f"{meta['hidden_size']} but base_model has hidden_size={_hidden_size(base_model.config)}. "
                "Pass the base model the adapter was trained on."
            )
        if is_4bit_model(base_model):
            make_4bit_cpu_safe(base_model)
        with _quiet_peft_on_new_transformers():
            policy = PeftModel.from_pretrained(
                base_model, _adapter_dir(output_dir, meta["policy_adapter"]),
                is_trainable=is_trainable, adapter_name=meta["policy_adapter"])
        if meta["value_adapter"] is not None:
            policy.load_adapter(_adapter_dir(output_dir, meta["value_adapter"]),
                                adapter_name=meta["value_adapter"], is_trainable=is_trainable)
        head = nn.Linear(meta["hidden_size"], 1, bias=meta["bias"],
                         dtype=getattr(torch, meta["dtype"]),
                         device=policy.get_output_embeddings().weight.device)
        head.load_state_dict(load_file(os.path.join(output_dir, VALUE_HEAD_WEIGHTS)))
        head.requires_grad_(is_trainable)
        model = cls(policy, value_head=head, value_branch_layer=meta.get("value_branch_layer"))
        return model.train(is_trainable)


def _adapter_dir(output_dir: str | os.PathLike, adapter_name: str) -> str:
    """Where ``PeftModel.save_pretrained`` put ``adapter_name``: the top for "default",
    a sub-directory named after the adapter otherwise."""
    if adapter_name == "default":
        return os.fspath(output_dir)
    return os.path.join(output_dir, adapter_name)
