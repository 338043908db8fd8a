"""Parameters sharded by DeepSpeed ZeRO-3 or by FSDP2: which are, a context holding ZeRO-3's full
values, a full copy of a state, writing a full value back into a sharded parameter, and the ZeRO
stage of a run. The models, the checkpoints and the trainer all read these; nothing here imports
DeepSpeed unless a parameter is sharded. (FSDP2's units, generation and optimizer state:
:mod:`trl_ppo_ext.models.fsdp`.)

Example:

>>> import torch
>>> from trl_ppo_ext.models.sharding import full_state, is_zero3_param
>>> weight = torch.nn.Parameter(torch.ones(2))
>>> is_zero3_param(weight), full_state([("w", weight)], keep=True)["w"].tolist()
(False, [1.0, 1.0])
"""

from __future__ import annotations

from contextlib import nullcontext

import torch


def zero_stage(accelerator) -> int | None:
    """The ZeRO stage of a DeepSpeed run, None without DeepSpeed."""
    plugin = getattr(accelerator.state, "deepspeed_plugin", None)
    if plugin is None:
        return None
    return int(plugin.deepspeed_config.get("zero_optimization", {}).get("stage", 0))



def is_zero3_param(param: torch.Tensor) -> bool:
    """A parameter partitioned by ZeRO-3 (its ``.data`` is a placeholder outside a gather)."""
    return hasattr(param, "ds_id")


def is_fsdp2_param(param: torch.Tensor) -> bool:
    """A parameter sharded by FSDP2 (``fully_shard``): a ``DTensor`` holding this process's rows."""
    if not torch.distributed.is_available():
        return False
    try:
        from torch.distributed.tensor import DTensor  # public from torch 2.5
    except ImportError:
        return False
    return isinstance(param, DTensor)


def gathered(params):
    """Context in which ZeRO-3-partitioned ``params`` hold their full values on every process
    (a collective: every process must enter it). A no-op for ordinary parameters."""
    params = [p for p in params if is_zero3_param(p)]
    if not params:
        return nullcontext()
    import deepspeed

    return deepspeed.zero.GatheredParameters(params, modifier_rank=None)


def full_state(named_params, keep: bool) -> dict[str, torch.Tensor]:
    """``{name: CPU copy}`` of ``named_params``, gathered one at a time under ZeRO-3 or FSDP2 (so
    no process ever holds more than one extra full parameter). Every process must call it, with
    the parameters in the same order; those with ``keep=False`` get an empty dict."""
    out = {}
    for name, param in named_params:
        with gathered([param]):
            value = param.full_tensor() if is_fsdp2_param(param) else param  # FSDP2: an all-gather
            if keep:
                out[name] = value.detach().cpu().clone()
    return out


@torch.no_grad()
def load_full_value(param: torch.Tensor, value: torch.Tensor) -> None:
    """Write the full ``value`` (what :func:`full_state` saved) into ``param``: all of it, or
    under FSDP2 this process's rows of it (every process holds the whole ``value``, so nothing
    is communicated). Not for ZeRO-3 parameters (DeepSpeed loads its own checkpoint)."""
    if is_fsdp2_param(param):
        from torch.distributed.tensor import distribute_tensor

        value = distribute_tensor(value.to(param.device, param.dtype), param.device_mesh, param.placements,
                                  src_data_rank=None)
    param.copy_(value.to(param.device))
