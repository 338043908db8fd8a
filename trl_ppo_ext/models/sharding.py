"""Parameters sharded by DeepSpeed ZeRO: which are, a context holding their full values, a full
copy of a state, and the ZeRO stage of a run. The models, the checkpoints and the trainer all
read these; nothing here imports DeepSpeed unless a parameter is sharded.

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


def gathered(params):
    """Context in which ZeRO-3-partitioned ``params`` hold their full values on every process
    (a collective: every process must enter it). A no-op for ordinary parameters."""
    params = [p for p in params if is_zero3_param(p)]
    if not params:
        return nullcontext()
    import deepspeed

    return deepspeed.zero.GatheredParameters(params, modifier_rank=None)


def full_state(named_params, keep: bool) -> dict[str, torch.Tensor]:
    """``{name: CPU copy}`` of ``named_params``, gathered one at a time under ZeRO-3 (so no
    process ever holds more than one extra full parameter). Every process must call it;
    those with ``keep=False`` get an empty dict."""
    out = {}
    for name, param in named_params:
        with gathered([param]):
            if keep:
                out[name] = param.detach().cpu().clone()
    return out
