"""Keep a frozen model (reward model, separate reference) off the GPU between its uses.

PPO needs the reward model (and, without a shared backbone, a reference model) only for
the scoring pass of each rollout. Parking it in CPU memory the rest of the time means the
PPO update -- the peak of GPU memory -- holds none of its weights::

    reward_model.to("cpu")                      # once, after loading
    with on_device(reward_model, "cuda"):       # each scoring pass
        scores = reward_model(**batch).logits   # (B, 1)
    # back on the CPU here

4-bit models (bitsandbytes 0.50, read from its source): ``Params4bit.to(device)`` on an
already-quantized weight moves the packed data and its ``QuantState`` (absmax, code and
the nested double-quant state) in place, and ``transformers`` allows device moves of 4-bit
models (it refuses only dtype casts), so ``.to('cuda')`` / ``.to('cpu')`` round trips work.
One exception, handled here: a weight that bitsandbytes repacked for its avx512_bf16 CPU
kernel is only converted back by ``Params4bit.cuda()``, not by ``.to('cuda')``; a
``make_4bit_cpu_safe`` call before moving keeps (or puts) every weight in the standard
layout. A model that cannot be moved (8-bit with bitsandbytes < 0.48, a model dispatched
over several devices) stays where it is, with a warning once: on the GPU that costs memory,
never correctness.

Without CUDA every call is a no-op (logged once per process): there is no GPU to free.
Transfers are synchronous: each scoring pass costs one host-to-device and one
device-to-host copy of the weights (a 7B model is about 4 GB in nf4, 14 GB in bf16).

Example:

>>> from torch import nn
>>> from trl_ppo_ext.models.offload import module_devices
>>> module_devices(nn.Linear(2, 2))
{device(type='cpu')}
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator

import torch
from torch import nn

from .._utils import log_once
from .quantization import is_4bit_model, make_4bit_cpu_safe

logger = logging.getLogger(__name__)


def _say_once(level: int, message: str) -> None:
    """Log ``message`` at ``level`` at most once per process."""
    log_once(logger, level, message)


def module_devices(model: nn.Module) -> set[torch.device]:
    """Every device holding a parameter or buffer of ``model`` (empty for a stateless one)."""
    tensors = list(model.parameters()) + list(model.buffers())
    return {t.device for t in tensors}


def _same_device(a: torch.device, b: torch.device) -> bool:
    """``cuda`` and ``cuda:<current>`` are the same device."""
    if a.type != b.type:
        return False
    if a.type != "cuda":
        return True
    current = torch.cuda.current_device()
    return (a.index if a.index is not None else current) == (b.index if b.index is not None else current)


@contextlib.contextmanager
def on_device(model: nn.Module, device: str | torch.device, *,
              empty_cache: bool = False) -> Iterator[nn.Module]:
    """Run the block with ``model`` on ``device``, then move it back where it was.

    Args:
        model: a frozen model living on one device (usually the CPU).
        device: where to run it, e.g. ``"cuda"`` or ``accelerator.device``.
        empty_cache: after moving back, return the freed blocks to the driver
            (``torch.cuda.empty_cache()``); only useful when another process needs them,
            since PyTorch's allocator reuses them for the PPO update anyway.

    Yields:
        ``model`` itself (moved in place).

    No-op, logged once per process, when CUDA is unavailable, when ``model`` is already on
    ``device``, or when it cannot be moved (see the module docstring).
    """
    target = torch.device(device)
    home = _home_device(model)
    if home is None or not torch.cuda.is_available() or _same_device(home, target):
        if not torch.cuda.is_available():
            _say_once(logging.INFO, "on_device: CUDA is not available, so offloading has no "
                      "effect; models stay on the CPU.")
        yield model
        return
    if is_4bit_model(model):
        make_4bit_cpu_safe(model)  # no avx512_bf16-repacked weight may travel (see above)
    if not _try_move(model, target):
        yield model
        return
    try:
        yield model
    finally:
        model.to(home)
        if empty_cache and target.type == "cuda":
            torch.cuda.empty_cache()


def _home_device(model: nn.Module) -> torch.device | None:
    """The single device ``model`` lives on; None (with a warning once) if it spans several."""
    devices = module_devices(model)
    if len(devices) == 1:
        return devices.pop()
    if devices:
        _say_once(logging.WARNING, f"on_device: {type(model).__name__} is spread over "
                  f"{sorted(map(str, devices))} (a device_map dispatch); it stays where it is.")
    return None


def _try_move(model: nn.Module, target: torch.device) -> bool:
    """``model.to(target)``; False (model unchanged, warning once) if transformers refuses."""
    try:
        model.to(target)
    except ValueError as err:  # transformers: e.g. 8-bit models with bitsandbytes < 0.48
        _say_once(logging.WARNING, f"on_device: {type(model).__name__} cannot be moved to "
                  f"{target} ({err}); it stays on {_home_device(model)}, which costs memory.")
        return False
    return True
