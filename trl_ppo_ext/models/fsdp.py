"""FSDP2 (``torch.distributed.fsdp.fully_shard``) and the trainer's policy/value module: which
modules become FSDP units, the policy gathered for generation, and full (unsharded) copies of
the weights and the optimizer state for checkpoints and exports.

**Units.** accelerate (``fsdp_auto_wrap_policy: TRANSFORMER_BASED_WRAP``) makes an FSDP unit of
every module whose class the prepared model names in ``_no_split_modules``, then of the prepared
module itself (the root). A unit's parameters are whole only inside its own ``forward``, and its
gradients flow only through its outputs (FSDP2 gathers the weights again for backward when the
gradient of an output arrives). The trainer calls the policy outside the root's forward
(``generate``, the reference as the disabled adapter) and the shared actor-critic's value adapter
runs the backbone without the LM head, so the policy's transformers model (``LlamaForCausalLM``,
holding the LM head), each backbone (``LlamaModel``: embeddings and final norm) and each
transformer block are units (:func:`unit_class_names`): every call goes through the hooks of the
units it reads. What stays in the root (a value head, a value model's score) is read inside the
root's forward only. A policy with tied input and output embeddings keeps its backbone in the
policy's unit (FSDP2 refuses a parameter in two), and then cannot run a value adapter.

**Generation** (:func:`policy_for_generation`): with ``gather`` (``ds3_gather_for_generation``,
the default) every unit of the policy is gathered once for the whole rollout and kept whole
until it ends; without it each unit gathers in every forward, i.e. at every generated token.

**Checkpoints** hold whole tensors, as without FSDP2: the weights (``sharding.full_state``), the
optimizer's state in torch's own format (:func:`full_optimizer_state`) and the exports
(:func:`full_state_dict`); each process loads its own rows back.

Only public FSDP2 calls are used (``unshard``, ``reshard``, ``set_reshard_after_forward``,
``DTensor.full_tensor``, ``distribute_tensor``) except private reads of torch's FSDP state, named
where they are: making a unit the root, and each unit's reshard-after-forward setting (to put it
back after generation).

Example:

>>> from torch import nn
>>> from trl_ppo_ext.models.fsdp import is_fsdp2_model
>>> is_fsdp2_model(nn.Linear(2, 2))
False
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch
from torch import nn

from .sharding import is_fsdp2_param


def _fsdp_module_class() -> type | None:
    """torch's ``FSDPModule`` (public from torch 2.6), None where this torch has none."""
    if not torch.distributed.is_available():
        return None
    try:
        from torch.distributed.fsdp import FSDPModule
    except ImportError:
        return None
    return FSDPModule


def is_fsdp2_model(module: nn.Module) -> bool:
    """Whether ``module`` was sharded by ``fully_shard`` (it is an FSDP unit itself)."""
    cls = _fsdp_module_class()
    return cls is not None and isinstance(module, cls)


def fsdp2_units(module: nn.Module) -> list[nn.Module]:
    """The FSDP units in ``module`` (itself included when it is one), outermost first."""
    cls = _fsdp_module_class()
    return [] if cls is None else [m for m in module.modules() if isinstance(m, cls)]


def _transformers_model(model: nn.Module) -> nn.Module:
    get_base_model = getattr(model, "get_base_model", None)
    return get_base_model() if callable(get_base_model) else model


def _backbone(model: nn.Module) -> nn.Module | None:
    """A transformers model's backbone (``model.model`` of a Llama), None where it has none."""
    backbone = getattr(model, getattr(model, "base_model_prefix", "") or "", None)
    return backbone if isinstance(backbone, nn.Module) and backbone is not model else None


def ties_embeddings(model: nn.Module) -> bool:
    """Whether a causal LM's input and output embeddings are one parameter."""
    try:
        inputs, outputs = model.get_input_embeddings(), model.get_output_embeddings()
    except (AttributeError, NotImplementedError):
        return False
    return getattr(inputs, "weight", None) is not None and getattr(inputs, "weight", None) is getattr(
        outputs, "weight", False)


def unit_class_names(policy: nn.Module, *others: nn.Module | None) -> list[str]:
    """The ``_no_split_modules`` of a policy/value module: the policy's transformers class, the
    backbone class of each model in it and their transformer blocks (their own
    ``_no_split_modules``), see the module docstring. ``others``: the value model, if any.

    A policy whose input and output embeddings are tied keeps its backbone in the policy's unit
    (FSDP2 keeps a parameter in one unit; the LM head and the embeddings are one), and so does
    any model of the same backbone class."""
    lm = _transformers_model(policy)
    names = [type(lm).__name__]
    for model in (policy, *others):
        if model is None:
            continue
        inner = _transformers_model(model)
        backbone = _backbone(inner)
        for name in [type(backbone).__name__] if backbone is not None else []:
            if name not in names:
                names.append(name)
        for name in getattr(inner, "_no_split_modules", None) or ():
            if name not in names:
                names.append(name)
    if ties_embeddings(lm) and _backbone(lm) is not None:
        names.remove(type(_backbone(lm)).__name__)
    return names


# ---------------------------------------------------------------------- the root and generation
def ready_root(root: nn.Module) -> None:
    """Make ``root`` FSDP2's root before any of its units runs alone.

    FSDP2 takes as root the first unit whose forward runs and refuses a later forward of an
    outer one ("FSDP requires running forward through the root module first"); the trainer's
    first call is the policy's ``generate``, inside the root. Idempotent. (Private: torch's
    ``FSDPState._lazy_init``, what the root's first forward calls.)
    """
    root._get_fsdp_state()._lazy_init()


def _policy_units(root: nn.Module, policy: nn.Module) -> list[nn.Module]:
    units = [m for m in fsdp2_units(policy) if m is not root]
    if not units:
        raise RuntimeError(
            f"Under FSDP2 the policy ({type(_transformers_model(policy)).__name__}) holds no FSDP unit of its own, so "
            "it cannot generate outside the policy/value module's forward. The trainer names the units in the "
            "module's _no_split_modules, which accelerate reads with fsdp_auto_wrap_policy: TRANSFORMER_BASED_WRAP; "
            "use that policy and leave fsdp_transformer_layer_cls_to_wrap unset."
        )
    return units


def check_policy_units(root: nn.Module, policy: nn.Module) -> None:
    """Raise unless every parameter of ``policy`` lies in an FSDP unit inside it (else a call of
    the policy outside the root's forward meets sharded weights). Gathers and reshards the
    policy once, every process together."""
    units = _policy_units(root, policy)
    for unit in units:
        unit.unshard()
    try:
        left = [name for name, p in policy.named_parameters() if is_fsdp2_param(p)]
    finally:
        for unit in units:
            unit.reshard()
    if left:
        raise RuntimeError(
            f"Under FSDP2, {len(left)} parameter(s) of the policy (first: {left[0]!r}) lie in no FSDP unit of the "
            "policy, so generation and the reference forward would meet sharded weights. The trainer names its "
            "units in _no_split_modules for fsdp_auto_wrap_policy: TRANSFORMER_BASED_WRAP; use that policy and "
            "leave fsdp_transformer_layer_cls_to_wrap unset."
        )


def _reshard_settings(unit: nn.Module) -> list:
    """Each parameter group's post-forward mesh (None: kept whole after forward). Private:
    ``FSDPState._fsdp_param_groups`` (``_fsdp_param_group`` before torch 2.10)."""
    state = unit._get_fsdp_state()
    groups = getattr(state, "_fsdp_param_groups", None)
    if groups is None:
        group = getattr(state, "_fsdp_param_group", None)
        groups = [] if group is None else [group]
    return [(group, group.post_forward_mesh_info) for group in groups]


@contextmanager
def policy_for_generation(root: nn.Module, policy: nn.Module, gather: bool) -> Iterator[nn.Module]:
    """The policy of an FSDP2 ``root`` ready to generate for the block; yields ``policy``.

    ``gather=True``: every unit of the policy is gathered once on entry and stays whole until
    the block ends (one all-gather per unit for the whole rollout; the policy's full weights on
    every process meanwhile), then resharded. ``gather=False``: each unit gathers in each of its
    forwards, once per generated token, and holds only its own weights whole meanwhile.
    The first entry checks that the policy's units hold all of its weights
    (:func:`check_policy_units`). Every process must enter it.
    """
    ready_root(root)
    if not getattr(root, "_ppo_policy_units_checked", False):
        check_policy_units(root, policy)
        root._ppo_policy_units_checked = True
    if not gather:
        yield policy
        return
    units = _policy_units(root, policy)
    saved = [setting for unit in units for setting in _reshard_settings(unit)]
    try:
        for unit in units:
            unit.set_reshard_after_forward(False, recurse=False)
            unit.unshard()
        yield policy
    finally:
        for group, mesh_info in saved:
            group.post_forward_mesh_info = mesh_info
        for unit in units:
            unit.reshard()


# ---------------------------------------------------------------------- full states
def full_state_dict(module: nn.Module, keep: bool, names=None) -> dict[str, torch.Tensor]:
    """``{name: full CPU tensor}`` of ``module.state_dict()`` (``names``: only those keys), gathered
    one tensor at a time; a collective (every process calls it, ``keep=False`` ones get ``{}``).
    FSDP2's state dicts are sharded whatever the units' state (its state-dict hooks reshard)."""
    out = {}
    for name, value in module.state_dict().items():
        if names is not None and name not in names:
            continue
        full = value.full_tensor() if is_fsdp2_param(value) else value
        if keep:
            out[name] = full.detach().cpu().clone()
    return out


def _torch_optimizer(optimizer):
    while hasattr(optimizer, "optimizer"):  # accelerate's AcceleratedOptimizer
        optimizer = optimizer.optimizer
    return optimizer


def full_optimizer_state(optimizer, keep: bool) -> dict | None:
    """``optimizer.state_dict()`` with every sharded moment gathered whole onto the CPU: torch's
    own format, as an unsharded run saves it (so an FSDP2 checkpoint and a DDP one hold the same
    ``optimizer.pt``). A collective: every process calls it; those with ``keep=False`` get None.
    (Not ``torch.distributed.checkpoint``'s optimizer state dict: on an optimizer that has not
    stepped yet it takes a step of its own, which advances Adam's step count.)"""
    saved = _torch_optimizer(optimizer).state_dict()
    state = {}
    for index in sorted(saved["state"]):  # the same order on every process: one all-gather per moment
        entry = saved["state"][index]
        state[index] = {}
        for key in sorted(entry):
            value = entry[key]
            if is_fsdp2_param(value):
                value = value.full_tensor()
            if keep:
                state[index][key] = value.detach().cpu().clone() if torch.is_tensor(value) else value
    return {"state": state, "param_groups": saved["param_groups"]} if keep else None


def load_full_optimizer_state(optimizer, saved: dict) -> None:
    """Load :func:`full_optimizer_state`'s dict (or an unsharded run's ``optimizer.state_dict()``),
    read by every process: each keeps its own rows of the moments of a sharded parameter (nothing
    is communicated)."""
    from torch.distributed.tensor import distribute_tensor

    inner = _torch_optimizer(optimizer)
    params = [p for group in inner.param_groups for p in group["params"]]
    state = {}
    for index, entry in saved["state"].items():
        param = params[int(index)]
        state[index] = {
            key: distribute_tensor(value.to(param.device), param.device_mesh, param.placements, src_data_rank=None)
            if is_fsdp2_param(param) and torch.is_tensor(value) and value.shape == param.shape else value
            for key, value in entry.items()
        }
    inner.load_state_dict({**saved, "state": state})
