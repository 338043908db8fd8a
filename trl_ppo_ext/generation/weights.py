"""The policy's weights as an inference engine loads them: checkpoint names, nothing but the policy.

Three forms, chosen per policy:

* a plain causal LM: every parameter under its checkpoint name (:func:`policy_weights`);
* a LoRA policy (a ``peft.PeftModel``, e.g. ``SharedActorCritic.policy``) as merged weights:
  ``W + scale * B @ A`` of the policy adapter only, computed beside the model (the training
  weights are never merged in place, where merge/unmerge would round them);
* the same policy's adapter alone, saved to a folder for vLLM's LoRA support
  (:func:`save_policy_adapter`), when vLLM accepts every module it adapts
  (:func:`adapter_sync_refusal`).

A value adapter and a value head are never part of any of them.

Example:

>>> from torch import nn
>>> from trl_ppo_ext.generation.weights import policy_weights
>>> [name for name, _ in policy_weights(nn.Linear(2, 1))]
['weight', 'bias']
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator

import torch
from torch import nn

# Module names vLLM's LoRA layers accept in Llama-like models (Llama, Mistral, Qwen2, ...): the
# seven projections, which vLLM packs as qkv_proj and gate_up_proj. An adapter on anything else
# (lm_head, embed_tokens, GPT-2's c_attn) is refused when loaded, so it goes as merged weights.
VLLM_LORA_MODULES = frozenset({"q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"})


def _is_peft(model: nn.Module) -> bool:
    try:
        from peft import PeftModel
    except ImportError:  # pragma: no cover - peft is a dependency
        return False
    return isinstance(model, PeftModel)


def _whole(name: str, param: torch.Tensor) -> torch.Tensor:
    """``param`` detached; a ``ValueError`` for a parameter FSDP2 holds sharded (an engine needs the
    whole tensor: the trainer gathers the policy for generation unless told not to)."""
    from ..models.sharding import is_fsdp2_param

    if is_fsdp2_param(param):
        raise ValueError(
            f"{name} is sharded by FSDP2 here, and an inference engine needs the policy's whole weights. Keep "
            "ds3_gather_for_generation=True (the default), which gathers the policy for each rollout."
        )
    return param.detach()


def policy_weights(policy: nn.Module, adapter: str | None = None) -> Iterator[tuple[str, torch.Tensor]]:
    """``(checkpoint name, tensor)`` of every weight of the policy, as its checkpoint names them.

    Args:
        policy: a causal LM, or a ``PeftModel`` around one.
        adapter: for a ``PeftModel``, the LoRA adapter merged into the yielded weights (None:
            the base weights alone). Other adapters (a value adapter) are ignored.
    Yields:
        detached tensors; tied weights once (as ``named_parameters`` gives them). LoRA-adapted
        weights are new tensors ``W + delta`` in ``W``'s dtype (the sum taken in float32);
        the others are the model's own parameters, not copies.
    """
    if not _is_peft(policy):
        for name, param in policy.named_parameters():
            yield name, _whole(name, param)
        return
    if adapter is not None and adapter not in policy.peft_config:
        raise ValueError(f"adapter={adapter!r} is not an adapter of this PeftModel; it has {list(policy.peft_config)}.")
    yield from _merged(policy.get_base_model(), "", adapter, set())


def _merged(module: nn.Module, prefix: str, adapter: str | None, seen: set) -> Iterator[tuple[str, torch.Tensor]]:
    """Depth-first walk yielding base-model names; LoRA layers yield their base layer's weights
    plus the adapter's delta, wrappers of ``modules_to_save`` yield the adapter's copy."""
    from peft.tuners.lora import LoraLayer
    from peft.utils import ModulesToSaveWrapper

    if isinstance(module, ModulesToSaveWrapper):
        copies = module.modules_to_save
        inner = copies[adapter] if adapter is not None and adapter in copies else module.original_module
        yield from _merged(inner, prefix, adapter, seen)
        return
    if isinstance(module, LoraLayer):
        base = module.get_base_layer()
        delta = None
        if adapter is not None and (adapter in module.lora_A or adapter in module.lora_embedding_A):
            if module.use_dora.get(adapter, False):
                raise NotImplementedError(
                    f"{prefix}: the policy adapter {adapter!r} uses DoRA (use_dora=True), whose merged weight is "
                    "not W + B @ A; sampling with vLLM supports plain LoRA adapters."
                )
            delta = module.get_delta_weight(adapter)
        for name, param in base.named_parameters(recurse=False):
            if id(param) in seen:
                continue
            seen.add(id(param))
            value = _whole(f"{prefix}{name}", param)
            if name == "weight" and delta is not None:
                value = (value.float() + delta.detach().float()).to(value.dtype)
            yield f"{prefix}{name}", value
        return
    for name, param in module.named_parameters(recurse=False):
        if id(param) not in seen:
            seen.add(id(param))
            yield f"{prefix}{name}", _whole(f"{prefix}{name}", param)
    for name, child in module.named_children():
        yield from _merged(child, f"{prefix}{name}.", adapter, seen)


def adapted_module_names(policy: nn.Module, adapter: str) -> set[str]:
    """The leaf names (``q_proj``, ``lm_head``, ...) of the modules ``adapter`` adapts in a ``PeftModel``."""
    from peft.tuners.lora import LoraLayer
    from peft.utils import ModulesToSaveWrapper

    names = set()
    for name, module in policy.named_modules():
        if isinstance(module, LoraLayer) and (adapter in module.lora_A or adapter in module.lora_embedding_A):
            names.add(name.rsplit(".", 1)[-1])
        if isinstance(module, ModulesToSaveWrapper) and adapter in module.modules_to_save:
            names.add(name.rsplit(".", 1)[-1])
    return names


def adapter_sync_refusal(policy: nn.Module, adapter: str) -> str | None:
    """Why vLLM cannot take ``adapter`` as a LoRA adapter (so merged weights must go instead), or
    None when it can: not LoRA, DoRA, trained biases or ``modules_to_save``, or a module outside
    ``VLLM_LORA_MODULES``."""
    config = policy.peft_config[adapter]
    if getattr(config, "peft_type", None) is None or str(config.peft_type.value) != "LORA":
        return f"the adapter is {config.peft_type}, not LoRA"
    if getattr(config, "use_dora", False):
        return "the adapter uses DoRA"
    if getattr(config, "bias", "none") != "none":
        return f"the adapter trains biases (bias={config.bias!r})"
    if getattr(config, "modules_to_save", None):
        return f"the adapter trains whole modules (modules_to_save={list(config.modules_to_save)})"
    outside = sorted(adapted_module_names(policy, adapter) - VLLM_LORA_MODULES)
    if outside:
        return f"it adapts {outside}, which vLLM's LoRA layers do not accept (only {sorted(VLLM_LORA_MODULES)})"
    return None


def save_policy_adapter(policy: nn.Module, adapter: str, folder: str) -> str:
    """Save the weights and config of ``adapter`` alone (never a value adapter) into ``folder``,
    in the layout vLLM's ``LoRARequest`` reads; returns the folder that holds them."""
    from peft.utils import get_peft_model_state_dict
    from safetensors.torch import save_file

    os.makedirs(folder, exist_ok=True)
    state = get_peft_model_state_dict(policy, adapter_name=adapter)
    save_file({k: v.detach().contiguous() for k, v in state.items()}, os.path.join(folder, "adapter_model.safetensors"))
    config = policy.peft_config[adapter].to_dict()
    config["target_modules"] = sorted(adapted_module_names(policy, adapter))  # "all-linear" resolved
    with open(os.path.join(folder, "adapter_config.json"), "w") as f:
        json.dump(config, f, default=lambda v: sorted(v) if isinstance(v, set) else str(v))
    return folder


def write_checkpoint(policy: nn.Module, folder: str) -> str:
    """Write the policy's base weights (no adapter) and config as a transformers checkpoint in
    ``folder``, for an engine that loads from disk; returns ``folder``."""
    from safetensors.torch import save_file

    base = policy.get_base_model() if _is_peft(policy) else policy
    os.makedirs(folder, exist_ok=True)
    tensors = {name: t.contiguous() for name, t in policy_weights(policy)}
    save_file(tensors, os.path.join(folder, "model.safetensors"), metadata={"format": "pt"})
    base.config.save_pretrained(folder)
    return folder
