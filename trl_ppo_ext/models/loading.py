"""Loading the models of a PPO run from a local directory or the Hub, plain or 4-bit (nf4).

``load_actor_critic`` builds the shared-backbone actor-critic of ``trl_ppo_ext.models.actor_critic``
(a LoRA policy and a value head on one frozen base); ``load_reward_model`` a frozen
sequence classifier. Both take ``load_in_4bit=True`` for a bitsandbytes nf4 base (bf16
compute on CUDA, fp32 on the CPU). Kept apart from the model classes as PEFT keeps its
quantized variants apart (``bnb.py``).

Example:

>>> from trl_ppo_ext.models.loading import resolve_model_source
>>> resolve_model_source("Qwen/Qwen2.5-0.5B")  # a Hub id is passed on; a local folder must exist
'Qwen/Qwen2.5-0.5B'
"""

from __future__ import annotations

import os
import re

import torch
from torch import nn

from .actor_critic import SharedActorCritic, default_lora_config
from .quantization import import_bitsandbytes, make_4bit_cpu_safe, nf4_quantization_config, resolve_compute_dtype

_HUB_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*(/[A-Za-z0-9][A-Za-z0-9._-]*)?$")


def resolve_model_source(model_name_or_path: str | os.PathLike) -> str:
    """``model_name_or_path`` as a string, checked to be a local directory or a hub id.

    Raises:
        FileNotFoundError: it is neither an existing directory nor shaped like a
            Hugging Face Hub id (``name`` or ``org/name``).
    """
    source = os.fspath(model_name_or_path)
    if os.path.isdir(source):
        return source
    # "outputs/sft" with an existing "outputs/" is a mistyped local path, not a Hub id.
    local_parent = "/" in source and os.path.isdir(source.split("/", 1)[0])
    if os.path.exists(source) or local_parent or not _HUB_ID.match(source) or ".." in source:
        raise FileNotFoundError(
            f"model_name_or_path={source!r} is not an existing local directory nor a Hugging Face "
            "Hub id ('name' or 'org/name'). Pass the directory written by save_pretrained(), or "
            "a Hub id."
        )
    return source


def _torch_dtype(torch_dtype: torch.dtype | str | None) -> torch.dtype | str | None:
    """Validate ``torch_dtype``: None, ``"auto"``, a torch dtype or its name."""
    if torch_dtype is None or torch_dtype == "auto" or isinstance(torch_dtype, torch.dtype):
        return torch_dtype
    resolved = getattr(torch, str(torch_dtype), None)
    if not isinstance(resolved, torch.dtype):
        raise ValueError(
            f"torch_dtype={torch_dtype!r} is not a torch dtype. Pass e.g. torch.bfloat16, "
            "'bfloat16', 'float32', 'auto' or None."
        )
    return resolved


def _target_device(device_map) -> torch.device:
    """The device a model loaded with ``device_map`` computes on (first GPU wins)."""
    if device_map is None or device_map == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    places = device_map.values() if isinstance(device_map, dict) else [device_map]
    for place in places:
        if isinstance(place, int) or str(place).startswith("cuda"):
            return torch.device("cuda", place) if isinstance(place, int) else torch.device(place)
    return torch.device("cpu")


def _load_kwargs(*, load_in_4bit: bool, torch_dtype, revision, device_map,
                 trust_remote_code: bool) -> dict:
    """``from_pretrained`` keyword arguments shared by both loaders."""
    dtype = _torch_dtype(torch_dtype)
    kwargs = {"revision": revision, "trust_remote_code": trust_remote_code}
    if load_in_4bit:
        import_bitsandbytes("load_in_4bit=True")  # clear ImportError before any download
        device = _target_device(device_map)
        if device.type == "cuda" and isinstance(dtype, torch.dtype):
            compute = dtype
        else:  # fp32 on the CPU whatever was asked (see resolve_compute_dtype)
            compute = resolve_compute_dtype(True if dtype == torch.bfloat16 else None, device)
        kwargs["quantization_config"] = nf4_quantization_config(compute)
        # Norms, embeddings and lm_head in the compute dtype, so nothing mixes dtypes.
        dtype = compute
        if device_map is None:
            device_map = {"": torch.cuda.current_device() if device.type == "cuda" else "cpu"}
    if dtype is not None:
        kwargs["dtype"] = dtype
    if device_map is not None:
        kwargs["device_map"] = device_map
    return kwargs


def _from_pretrained(auto_class, source: str, **kwargs):
    """``auto_class.from_pretrained`` with a load failure that names the argument."""
    try:
        return auto_class.from_pretrained(source, **kwargs)
    except OSError as err:
        raise OSError(
            f"could not load model_name_or_path={source!r} (revision={kwargs.get('revision')!r}): "
            f"{err} If it is a Hub id, check its spelling, your network and token, or set "
            "HF_HUB_OFFLINE=1 with the model in the local cache; otherwise pass a local directory."
        ) from err


def _own_unquantized_tensors(model: nn.Module) -> None:
    """Copy the tensors a 4-bit load left unquantized (embeddings, norms, heads) out of the
    checkpoint file. On CPU, transformers leaves them as views of the memory-mapped fp32
    safetensors file, which keeps every page the quantizer read counted in the process's
    memory (~650 MiB of a ~100M-parameter model in benchmarks/memory.py)."""
    bnb = import_bitsandbytes()
    with torch.no_grad():
        for module in model.modules():
            for name, param in list(module.named_parameters(recurse=False)):
                if param.device.type == "cpu" and not isinstance(param, bnb.nn.Params4bit):
                    param.data = param.data.clone()
            for name, buf in list(module.named_buffers(recurse=False)):
                if buf is not None and buf.device.type == "cpu":
                    module._buffers[name] = buf.clone()


def load_actor_critic(model_name_or_path: str | os.PathLike, *, lora_r: int = 16,
                      lora_alpha: int = 32, lora_dropout: float = 0.0,
                      lora_target_modules: list[str] | str | None = None,
                      load_in_4bit: bool = False, torch_dtype: torch.dtype | str | None = None,
                      revision: str | None = None, device_map=None,
                      trust_remote_code: bool = False,
                      value_lora: bool = False, value_branch_layer: int | None = None) -> SharedActorCritic:
    """Load a causal LM and wrap it as a :class:`SharedActorCritic` (frozen base + LoRA).

    Args:
        model_name_or_path: local directory or Hugging Face Hub id of the SFT policy.
        lora_r, lora_alpha, lora_dropout: LoRA rank, alpha and dropout.
        lora_target_modules: modules to adapt; None -> the q/k/v/o projections.
        load_in_4bit: load the base as bitsandbytes nf4 (double quant; compute in bf16 on
            CUDA, fp32 on the CPU) and make it CPU-safe to train (``make_4bit_cpu_safe``).
        torch_dtype: dtype of the non-quantized weights (None: transformers' default; with
            4-bit: the compute dtype). Use bf16 on CUDA for 7B models.
        revision: hub revision (branch, tag or commit) -- record it for reproducibility.
        device_map: passed to ``from_pretrained``; with 4-bit, None -> the current GPU or CPU.
        trust_remote_code: passed to ``from_pretrained``.
        value_lora: give the critic its own LoRA adapter (same r/alpha/targets; see
            :class:`SharedActorCritic` for the cost).
        value_branch_layer: with ``value_lora``, the critic branches from the policy's pass at
            this decoder layer and its adapter covers the layers above only
            (``models.branch_critic``); None: the whole backbone.

    Raises:
        ImportError: ``load_in_4bit=True`` without an importable bitsandbytes.
        FileNotFoundError / OSError: the model cannot be found or loaded.
    """
    from transformers import AutoModelForCausalLM

    source = resolve_model_source(model_name_or_path)
    kwargs = _load_kwargs(load_in_4bit=load_in_4bit, torch_dtype=torch_dtype, revision=revision,
                          device_map=device_map, trust_remote_code=trust_remote_code)
    base = _from_pretrained(AutoModelForCausalLM, source, **kwargs)
    if load_in_4bit:
        _own_unquantized_tensors(base)
    lora = default_lora_config(base, r=lora_r, lora_alpha=lora_alpha, lora_dropout=lora_dropout,
                               target_modules=lora_target_modules)
    value_lora_config = None
    if value_lora:
        value_lora_config = default_lora_config(base, r=lora_r, lora_alpha=lora_alpha,
                                                lora_dropout=lora_dropout,
                                                target_modules=lora.target_modules)
    return SharedActorCritic(base, lora_config=lora, value_lora_config=value_lora_config,
                             value_branch_layer=value_branch_layer)


def load_reward_model(model_name_or_path: str | os.PathLike, *, num_labels: int = 1,
                      load_in_4bit: bool = False, torch_dtype: torch.dtype | str | None = None,
                      revision: str | None = None, device_map=None,
                      trust_remote_code: bool = False) -> nn.Module:
    """Load a frozen, eval-mode scalar reward model (``AutoModelForSequenceClassification``).

    Args:
        model_name_or_path: local directory or Hub id of a reward model trained with one
            output (``num_labels=1``).
        num_labels: must be 1: PPO needs one scalar score per sequence.
        load_in_4bit, torch_dtype, revision, device_map, trust_remote_code: as in
            :func:`load_actor_critic`. The score head stays unquantized.

    Raises:
        ValueError: ``num_labels != 1``, or a checkpoint whose config has ``num_labels != 1``.
        ImportError: ``load_in_4bit=True`` without an importable bitsandbytes.
        FileNotFoundError / OSError: the model cannot be found or loaded.
    """
    from transformers import AutoConfig, AutoModelForSequenceClassification

    if num_labels != 1:
        raise ValueError(
            f"num_labels={num_labels!r}: a PPO reward model must output one scalar per sequence. "
            "Pass num_labels=1 (and a reward model trained with one output)."
        )
    source = resolve_model_source(model_name_or_path)
    kwargs = _load_kwargs(load_in_4bit=load_in_4bit, torch_dtype=torch_dtype, revision=revision,
                          device_map=device_map, trust_remote_code=trust_remote_code)
    config = _from_pretrained(AutoConfig, source, revision=revision,
                              trust_remote_code=trust_remote_code)
    if config.num_labels != 1:
        raise ValueError(
            f"model_name_or_path={source!r} has num_labels={config.num_labels} in its config; a PPO "
            "reward model must output one scalar (num_labels=1). Use a reward model trained with "
            "one output (e.g. TRL's RewardTrainer), not a multi-class classifier."
        )
    model = _from_pretrained(AutoModelForSequenceClassification, source, config=config, **kwargs)
    if load_in_4bit:
        _own_unquantized_tensors(model)
        make_4bit_cpu_safe(model)
    model.requires_grad_(False)
    return model.eval()
