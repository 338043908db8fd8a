"""What the trainer does to every model it is given (policy, value, reference, reward): dropout
off in every form, the configs' dropout values kept for saving, the embedding rows, the width of
a scalar head, a warning on low-precision trainable weights, accelerate's fp32 output wrapper
removed.

Example:

>>> from torch import nn
>>> from trl_ppo_ext.models.prepare import disable_dropout
>>> model = nn.Sequential(nn.Linear(2, 2), nn.Dropout(0.1))
>>> _ = disable_dropout(model)
>>> model[1].p
0.0
"""

from __future__ import annotations

import contextlib
import logging

import torch
from torch import nn

logger = logging.getLogger(__name__)



def disable_dropout(model: nn.Module) -> list[tuple[object, str, float]]:
    """Dropout off in every form: ``nn.Dropout`` modules, and the float probabilities that
    attention layers read at forward time (``attention_dropout`` of Llama/Qwen, OPT's
    ``dropout``), copied from the config into module attributes at build time, or read from
    the config itself (GPT-Neo, Falcon).

    PPO's ratio compares two forwards of the same weights; dropout would make it noise.
    Returns ``(config, name, original value)`` of every config float set to 0, so that a
    saved checkpoint can keep the user's values (see :func:`config_values`).
    """
    zeroed = []
    for module in model.modules():
        if isinstance(module, nn.Dropout):
            module.p = 0.0
        for name, value in list(vars(module).items()):
            if "dropout" in name and isinstance(value, float) and not isinstance(value, bool):
                setattr(module, name, 0.0)
        config = vars(module).get("config")
        if config is not None and hasattr(config, "to_dict"):
            for name, value in config.to_dict().items():
                # a config shared by several modules is met again with 0.0 and not recorded twice
                if "dropout" in name and isinstance(value, float) and value != 0.0 and hasattr(config, name):
                    zeroed.append((config, name, value))
                    setattr(config, name, 0.0)
    return zeroed

@contextlib.contextmanager
def config_values(entries):
    """Inside the block, each ``(config, name, value)`` of ``entries`` holds ``value``; the
    current values come back on exit."""
    current = [(config, name, getattr(config, name)) for config, name, _ in entries]
    try:
        for config, name, value in entries:
            setattr(config, name, value)
        yield
    finally:
        for config, name, value in reversed(current):
            setattr(config, name, value)

def warn_low_precision_trainables(model: nn.Module) -> None:
    """Say so when trainable weights are bf16/fp16: AdamW steps at PPO's learning rates (~1e-6)
    are mostly below half precision's rounding step, and such weights barely move."""
    low = [n for n, p in model.named_parameters() if p.requires_grad and p.dtype in (torch.bfloat16, torch.float16)]
    if low:
        logger.warning(
            "%d trainable parameter tensors are %s (e.g. %s): optimizer steps smaller than half precision's "
            "rounding step are lost, so a full fine-tune barely moves. Load the trainable model in float32 "
            "(torch_dtype=torch.float32) and train with bf16=True mixed precision, or train LoRA adapters.",
            len(low), dict(model.named_parameters())[low[0]].dtype, low[0],
        )

def embedding_rows(model: nn.Module) -> int:
    """Rows of ``model``'s input embedding, through peft's wrapper when the embedding carries a
    LoRA adapter (the wrapper has no ``num_embeddings``); read from the module, not the weight,
    which ZeRO-3 partitions."""
    embedding = model.get_input_embeddings()
    return int(getattr(embedding, "base_layer", embedding).num_embeddings)

def scalar_head_outputs(model: nn.Module) -> int:
    """Outputs of a sequence classifier's ``score`` head (its config's num_labels if it has none)."""
    head = getattr(model, "score", None)
    out = getattr(head, "out_features", None)
    return int(out) if out is not None else int(getattr(getattr(model, "config", None), "num_labels", 1))

def strip_fp32_output_wrapper(model: nn.Module) -> None:
    """Undo accelerate's mixed-precision forward patch on a prepared model.

    Under autocast, ``accelerator.prepare`` makes the model's forward return every output in
    fp32, a full ``(B, T+1, V)`` copy of the logits. The trainer runs every forward (policy,
    reference, value, reward) inside ``accelerator.autocast()`` itself instead, so they all
    share one precision context and log-probs are taken from the logits as produced.
    """
    if "_original_forward" in vars(model):
        vars(model).pop("_original_forward")
        vars(model).pop("forward", None)
