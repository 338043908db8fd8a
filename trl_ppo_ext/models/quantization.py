"""bitsandbytes 4-bit (nf4) models: importing bnb quietly, the nf4 config, CPU-safety, dtypes.

Everything in the package that touches bitsandbytes goes through this module, so that

* bnb is imported in one place (:func:`import_bitsandbytes`): with a clear ImportError
  when it is missing, and without the hub-``kernels`` notice bnb logs on CPUs with
  avx512_bf16 (``pip install kernels`` would fetch a hub kernel; it gives nothing here);
* a 4-bit model is made safe to *train* on the CPU (:func:`make_4bit_cpu_safe`);
* the compute dtype follows the device (:func:`resolve_compute_dtype`).

The CPU trap :func:`make_4bit_cpu_safe` removes (bitsandbytes 0.50, peft 0.21): on CPUs
with avx512_bf16, ``bnb.nn.Linear4bit.forward`` repacks its weight to a bf16 kernel layout
the first time it runs in eval mode on an input that does not require grad -- exactly a
PPO rollout (``model.eval()`` + ``torch.no_grad()``). The repacked weight then goes through
``F.gemv_4bit``, which has no autograd formula, in every later forward, including training
forwards: LoRA gradients come out silently wrong and only a UserWarning is emitted. On an
avx512_bf16 CPU a max relative error of 0.7-1.1 against a clean run was measured, with
only 4 of 28 LoRA tensors receiving any gradient; on a CPU without it, with the flag forced
on (the bf16 kernel then falls back to bnb's default one), all 28 got a gradient but
wrong by up to 4.3x its norm. The repack also fails outright when ``in_features`` is not
a multiple of 64. Turning it off (``support_avx512bf16_for_cpu = False``) keeps every forward
on the dequantize-and-matmul path, which has autograd.
"""

from __future__ import annotations

import contextlib
import logging
import sys
import warnings
from collections.abc import Iterator

import torch
from torch import nn

from .._utils import log_once

logger = logging.getLogger(__name__)

# Loggers under which bitsandbytes reports that the optional hub package ``kernels`` is
# missing (bitsandbytes/backends/cpu/ops.py at import time on avx512_bf16 CPUs).
_KERNELS_NOTICE_LOGGERS = ("bitsandbytes.backends.cpu.ops", "bitsandbytes.backends.mps.ops")


class _DropKernelsNotice(logging.Filter):
    """Drops records that only say the optional hub package ``kernels`` is unavailable."""

    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        return not ("kernels-community" in message or "pip install kernels" in message)


@contextlib.contextmanager
def _quiet_kernels_notice() -> Iterator[None]:
    """Silence bitsandbytes' ``kernels`` notice (log record or warning) inside the block."""
    drop = _DropKernelsNotice()
    loggers = [logging.getLogger(name) for name in _KERNELS_NOTICE_LOGGERS]
    for log in loggers:
        log.addFilter(drop)
    try:
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=r".*kernels-community.*")
            warnings.filterwarnings("ignore", message=r".*pip install kernels.*")
            yield
    finally:
        for log in loggers:
            log.removeFilter(drop)


def import_bitsandbytes(needed_for: str = "load_in_4bit=True"):
    """Import and return the ``bitsandbytes`` module, without its ``kernels`` notice.

    Use this instead of a bare ``import bitsandbytes`` anywhere in the package.

    Args:
        needed_for: what asked for bitsandbytes (named in the error message), e.g.
            ``"load_in_4bit=True"``.

    Raises:
        ImportError: bitsandbytes is not installed or fails to import; the message names
            ``needed_for`` and the fix (``pip install bitsandbytes``).
    """
    try:
        with _quiet_kernels_notice():
            import bitsandbytes
    except (ImportError, OSError, RuntimeError) as err:
        raise ImportError(
            f"{needed_for} needs bitsandbytes, which could not be imported ({err}). "
            f"Install it with `pip install bitsandbytes`, or turn 4-bit off "
            f"(load_in_4bit=False)."
        ) from err
    return bitsandbytes


def linear4bit_modules(model: nn.Module) -> list[nn.Module]:
    """Every ``bnb.nn.Linear4bit`` inside ``model`` (peft's LoRA wrappers hold them as
    ``base_layer``). Empty, without importing bitsandbytes, when bnb was never imported:
    no 4-bit layer can exist then."""
    if sys.modules.get("bitsandbytes") is None:
        return []
    bnb = import_bitsandbytes("inspecting a 4-bit model")
    return [module for module in model.modules() if isinstance(module, bnb.nn.Linear4bit)]


def is_4bit_model(model: nn.Module) -> bool:
    """True when ``model`` holds at least one bitsandbytes ``Linear4bit`` layer."""
    return bool(getattr(model, "is_loaded_in_4bit", False)) or bool(linear4bit_modules(model))


def make_4bit_cpu_safe(model: nn.Module) -> int:
    """Keep every ``Linear4bit`` of ``model`` off bitsandbytes' CPU repack path. In place.

    Sets ``support_avx512bf16_for_cpu = False`` on each layer, so an eval-mode no-grad
    forward (a rollout) no longer repacks the weight into the autograd-less bf16 layout
    (see the module docstring). A layer that was already repacked is converted back to
    the standard layout first, with a warning: its absmax went through bf16 during the
    repack, so its dequantized weight may differ from the original by about 0.4%.
    Idempotent; a no-op on models without 4-bit layers and on CUDA-only use.

    Returns:
        The number of ``Linear4bit`` layers seen.
    """
    layers = linear4bit_modules(model)
    repacked = 0
    for layer in layers:
        layer.support_avx512bf16_for_cpu = False
        if getattr(getattr(layer.weight, "quant_state", None), "packing_format_for_cpu", False):
            _unpack_cpu_weight(layer)
            repacked += 1
    if repacked:
        warnings.warn(
            f"make_4bit_cpu_safe: {repacked} Linear4bit layer(s) had already been repacked "
            "for the avx512_bf16 CPU kernel by an eval/no-grad forward; they were converted "
            "back (absmax rounded to bf16). Call make_4bit_cpu_safe right after loading "
            "(load_actor_critic and load_reward_model do) to avoid this.",
            stacklevel=2,
        )
    return len(layers)


def _unpack_cpu_weight(layer: nn.Module) -> None:
    """Undo bitsandbytes' avx512_bf16 CPU repack of one ``Linear4bit`` weight, in place."""
    bnb_functional = import_bitsandbytes("make_4bit_cpu_safe").functional
    inverse = getattr(bnb_functional, "_convert_weight_packed_for_cpu_inverse", None)
    if inverse is None:
        raise RuntimeError(
            "make_4bit_cpu_safe: a Linear4bit weight was repacked for the avx512_bf16 CPU "
            "kernel and this bitsandbytes version offers no way back. Reload the model and "
            "call make_4bit_cpu_safe before any eval/no-grad forward."
        )
    was_nested = layer.weight.quant_state.original_nested
    data, state = inverse(layer.weight.data, layer.weight.quant_state)
    if not was_nested:
        # bitsandbytes restores a nested absmax but leaves a plain one in the repacked
        # (in_features // blocksize, out_features) bf16 layout; the matmul wants it flat
        # fp32 in row-major block order, i.e. absmax[n * K/blocksize + k].
        state.absmax = state.absmax.T.reshape(-1).float()
    layer.weight.data = data
    layer.weight.quant_state = state
    layer.quant_state = state


def nf4_quantization_config(compute_dtype: torch.dtype):
    """The 4-bit config this package loads frozen and LoRA-base models with.

    nf4 with double quantization (QLoRA's choice: nf4 fits normally distributed weights
    best; double quantization saves ~0.4 bit/parameter on the absmax constants).

    Args:
        compute_dtype: dtype of the dequantized matmul; use :func:`resolve_compute_dtype`
            (bf16 on CUDA, fp32 on the CPU).
    """
    from transformers import BitsAndBytesConfig

    return BitsAndBytesConfig(
        load_in_4bit=True,
        bnb_4bit_quant_type="nf4",
        bnb_4bit_compute_dtype=compute_dtype,
        bnb_4bit_use_double_quant=True,
    )


def resolve_compute_dtype(bf16: bool | None, device: str | torch.device) -> torch.dtype:
    """The dtype to compute in (and to load non-quantized weights in) on ``device``.

    On the CPU this is always float32. TRL's ``PPOConfig`` inherits ``bf16=True``, and
    TRL's PPO trainer then casts the embeddings and ``lm_head`` of a 4-bit policy to bf16
    while the 4-bit layers and norms stay fp32; generation on the CPU then fails with
    ``expected m1 and m2 to have the same dtype``. So ``bf16=True`` is ignored on the CPU
    (logged once); the trainer should also run without bf16 mixed precision there.

    Args:
        bf16: the user's wish: True (bf16), False (fp32) or None (bf16 where supported).
        device: where the model computes, e.g. ``"cuda"``, ``"cuda:0"``, ``"cpu"``.

    Returns:
        ``torch.float32`` on the CPU (and any non-CUDA device), or when ``bf16`` is False
        or None on a GPU without bf16; ``torch.bfloat16`` on CUDA otherwise.

    Raises:
        ValueError: ``bf16=True`` on a CUDA device without bf16 support.

    >>> resolve_compute_dtype(True, "cpu")
    torch.float32
    """
    device = torch.device(device)
    if device.type != "cuda":
        if bf16:
            log_once(
                logger, logging.INFO,
                f"bf16=True is ignored on device {device}: 4-bit layers and norms compute in "
                "fp32 there, and bf16 embeddings/lm_head would break generation; using fp32."
            )
        return torch.float32
    if bf16 is False:
        return torch.float32
    supported = torch.cuda.is_available() and torch.cuda.is_bf16_supported()
    if bf16 and not supported:
        raise ValueError(
            f"bf16=True but CUDA device {device} does not support bfloat16. "
            "Pass bf16=False (fp32 compute) or bf16=None to choose automatically."
        )
    return torch.bfloat16 if supported else torch.float32
